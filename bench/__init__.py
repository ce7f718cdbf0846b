"""Benchmarks (`specrt bench e2e | trees | ngram | mtad | soak | docs`) and `specrt demo`: several runs,
medians, ratios against a baseline measured in the same run; JSON, Markdown and a plot per result."""

"""The report's own plotting and Markdown rendering: what they draw, escape and refuse."""

import pytest

from specrt.bench import svg
from specrt.bench.html import to_html


def test_line_chart_draws_each_series_and_rule_with_hover_titles():
    text = svg.line_chart("L <n>", "n", "ms", [svg.Series("batch 1", (1, 2, 4), (1.0, 1.5, 2.5)),
                                              svg.Series("one point", (8,), (3.0,), dashed=True)],
                          [svg.Rule(0.5, "roofline")], log_x=True)
    assert text.startswith('<svg class="plot" data-kind="line"') and text.endswith("</svg>")
    assert text.count('<g class="series">') == 2 and text.count("<circle") == 4 and 'class="rule"' in text
    assert "<title>L &lt;n&gt;</title>" in text and "batch 1: x=2, y=1.5" in text
    with pytest.raises(ValueError, match="no series with points"):
        svg.line_chart("empty", "x", "y", [svg.Series("none", (), ())])
    with pytest.raises(ValueError, match="log x axis needs positive x"):
        svg.line_chart("zero", "x", "y", [svg.Series("s", (0, 1), (1, 2))], log_x=True)


def test_bar_chart_skips_missing_values_and_scales_to_the_largest():
    text = svg.bar_chart("tok/s", "tokens/s", ["ar", "sd"], {"run": [100.0, None], "other": [50.0, 200.0]},
                         [svg.Rule(150.0, "roofline")])
    assert text.count('class="bar"') == 3 and "sd, other: 200" in text
    with pytest.raises(ValueError, match="no bars"):
        svg.bar_chart("none", "y", ["a"], {"g": [None]})


def test_nice_ticks_cover_the_range_in_round_steps():
    assert svg.nice_ticks(0, 9.3) == [0, 2, 4, 6, 8, 10]
    assert svg.nice_ticks(0.0, 0.27)[-1] >= 0.27


def test_markdown_renders_tables_lists_code_and_inline_plots(tmp_path):
    md = ("# Title\n\nSome `code` and **bold** <b>raw</b> with a [link](x.html).\n\n"
          "| a | b |\n|---|---:|\n| `x` | 1.5 |\n\n- one\n- two\n  continued\n\n```\nmake test\n```\n\n"
          "![a plot](plots/p.svg)\n\n![missing](nothing.png)\n")
    html = to_html(md, "t", {"plots/p.svg": '<svg class="plot"></svg>'}, tmp_path)
    assert '<h1 id="title">Title</h1>' in html and "<code>code</code>" in html and "<strong>bold</strong>" in html
    assert "&lt;b&gt;raw&lt;/b&gt;" in html and '<a href="x.html">link</a>' in html
    assert "<th>a</th><th>b</th>" in html and "<td class=num>1.5</td>" in html and "<td><code>x</code></td>" in html
    assert "<li>two continued</li>" in html and "<pre><code>make test</code></pre>" in html
    assert '<figure><svg class="plot"></svg><figcaption>a plot</figcaption></figure>' in html
    assert "<p><figure>" not in html and "[missing: nothing.png not found]" in html

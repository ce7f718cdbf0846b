"""`bench docs` renders every committed result with its verb's own Markdown and the command that re-makes it."""

import json
from pathlib import Path

import pytest

from specrt.bench.docs import BEGIN, END, DocsConfig, page, readme_table, run_docs
from specrt.bench.e2e import E2EConfig, MethodResult, report
from specrt.errors import SpecrtError


def test_results_page_from_json(tmp_path):
    results = tmp_path / "results"
    rows = {r.name: r for r in [MethodResult("autoregressive", [1.0, 1.1, 0.9], 100, 100, outputs=[[1]]),
                                MethodResult("sd", [0.5, 0.6, 0.4], 100, 40, outputs=[[1]])]}
    report(E2EConfig(bundle=tmp_path, out=results, label="t", num_prompts=3, baselines=()), rows)
    (results / "plan-x.json").write_text("{}")  # not a bench report: listed, not rendered
    old = json.loads((results / "e2e-t.json").read_text())
    del old["command"]  # results from before commands were recorded: the command is rebuilt from the config
    old["machine"] = {k: v for k, v in old["machine"].items() if k not in ("cpu", "cpu_features")}
    (results / "e2e-old.json").write_text(json.dumps({**old, "label": "old"}))
    int8 = {**old, "label": "int8", "config": {**old["config"], "quant": "int8-weights"}}
    (results / "e2e-int8.json").write_text(json.dumps(int8))  # older, but the only one with 8-bit weights
    peers = {**old, "label": "peers", "config": {**old["config"], "baselines": ["ort-genai", "hf"]}}
    (results / "e2e-peers.json").write_text(json.dumps(peers))  # older, but the only one beside a peer runtime
    other = {**peers, "label": "peers-other", "config": {**peers["config"], "bundle": "build/other"}}
    (results / "e2e-peers-other.json").write_text(json.dumps(other))  # beside peers too, of another bundle
    chat = {**peers, "label": "peers-chat", "config": {**peers["config"], "prompt_set": "chat"}}
    (results / "e2e-peers-chat.json").write_text(json.dumps(chat))  # the same bundle, chat prompts
    more = {**chat, "label": "peers-chat30", "config": {**chat["config"], "num_prompts": 30}}
    (results / "e2e-peers-chat30.json").write_text(json.dumps(more))  # the same prompt set, more of it
    alone = {**peers, "label": "peers-alone", "date": "2099-01-01", "config": {**peers["config"],
                                                                             "methods": ["autoregressive"]}}
    (results / "e2e-peers-alone.json").write_text(json.dumps(alone))  # newer, our AR alone beside the peers
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{BEGIN}\n| stale |\n{END}\nafter\n")
    page = run_docs(DocsConfig(results=results, out=tmp_path / "docs" / "results.md", readme=readme))
    assert page == (tmp_path / "docs" / "results.md").read_text()
    assert "## End to end" in page and "### e2e `t`" in page and "| sd | 200.0 | 2.00x |" in page
    assert page.count("Command: `specrt bench e2e ") == 8 and "--num-prompts 3 --baselines ''" in page
    assert "- `" + (results / "plan-x.json").as_posix() + "`" in page
    from specrt.bundle.machine import CPU_FEATURES, cpu_model

    machine = json.loads((results / "e2e-t.json").read_text())["machine"]  # where it ran, with what the CPU has
    assert machine["cpu"] == cpu_model() and set(machine["cpu_features"]) <= set(CPU_FEATURES)
    assert page.count(f"Ran on: {cpu_model()}, ") == 1  # e2e-old, -int8 and -peers predate it: no line
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{END}\nafter\n") and "| stale |" not in text
    assert "| [`e2e-t`](docs/results.md#end-to-end) | best lossless `sd` **2.00x** our AR (200.0 vs 100.0 tok/s) |" in text
    assert "e2e-old" not in text  # the README shows the latest result of each kind; the page shows them all
    assert text.index("[`e2e-t`]") < text.index("[`e2e-int8`]")  # a quantized variant is a kind of its own, after
    assert text.index("[`e2e-peers`]") < text.index("[`e2e-t`]")  # so is a run beside peer runtimes, before
    assert "[`e2e-peers-other`]" in text and "[`e2e-peers-chat`]" in text  # ... each bundle's and prompt set's apart
    assert "[`e2e-peers-chat30`]" in text  # ... and each number of its prompts
    assert "[`e2e-peers-alone`]" in text  # ... and our AR alone beside theirs does not hide their speculation
    readme.write_text("no markers")
    with pytest.raises(SpecrtError, match="has no results markers"):
        run_docs(DocsConfig(results=results, out=tmp_path / "docs" / "results.md", readme=readme))


def test_the_committed_page_and_readme_table_are_what_the_generator_writes(monkeypatch):
    """docs/results.md and the README's results table are regenerated, never edited: `specrt bench docs`."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    results, out, readme = Path("bench/results"), Path("docs/results.md"), Path("README.md")
    assert page(results, out) == out.read_text(), "docs/results.md is stale: run `specrt bench docs`"
    assert readme_table(results, readme, out) == readme.read_text(), "README's results table is stale: run `specrt bench docs`"

"""`bench docs` renders every committed result with its verb's own Markdown and the command that re-makes it."""

import json

from specrt.bench.docs import DocsConfig, run_docs
from specrt.bench.e2e import E2EConfig, MethodResult, report


def test_results_page_from_json(tmp_path):
    results = tmp_path / "results"
    rows = {r.name: r for r in [MethodResult("autoregressive", [1.0, 1.1, 0.9], 100, 100, 0.0, [[1]]),
                                MethodResult("sd", [0.5, 0.6, 0.4], 100, 40, 0.0, [[1]])]}
    report(E2EConfig(bundle=tmp_path, out=results, label="t", num_prompts=3, baselines=()), rows)
    (results / "plan-x.json").write_text("{}")  # not a bench report: listed, not rendered
    old = json.loads((results / "e2e-t.json").read_text())
    del old["command"]  # results from before commands were recorded: the command is rebuilt from the config
    (results / "e2e-old.json").write_text(json.dumps({**old, "label": "old"}))
    page = run_docs(DocsConfig(results=results, out=tmp_path / "docs" / "results.md"))
    assert page == (tmp_path / "docs" / "results.md").read_text()
    assert "## End to end" in page and "### e2e `t`" in page and "| sd | 200.0 | 2.00x |" in page
    assert page.count("Command: `specrt bench e2e --bundle") == 2 and "--num-prompts 3 --baselines ''" in page
    assert "- `" + (results / "plan-x.json").as_posix() + "`" in page

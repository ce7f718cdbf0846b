"""`specrt bench load`: fresh processes timed to the first token, bundles interleaved, each against the first."""

from __future__ import annotations

import pytest

from specrt.errors import SpecrtError


def test_bench_load_times_each_bundle_from_a_fresh_process(demo_bundle, self_draft_bundle, tmp_path):
    from specrt.bench.load import PHASES, LoadBenchConfig, run_load
    from specrt.bench.catalog import headline

    cfg = LoadBenchConfig(bundle=demo_bundle, vs=(self_draft_bundle,), out=tmp_path, label="t", runs=2, threads=1,
                          verify=("recorded", "full"))
    data = run_load(cfg)
    assert [(r["bundle"], r["verify"]) for r in data["rows"]] == [
        (str(b), v) for b in (demo_bundle, self_draft_bundle) for v in ("recorded", "full")]
    first, other = data["rows"][0], data["rows"][2]
    for r in data["rows"]:
        assert len(r["runs"]) == 2 and all(run[p] > 0 for run in r["runs"] for p in PHASES)
        assert r["total_s"] == pytest.approx(sum(r[p] for p in PHASES), abs=2e-3)
        assert r["same_first_token"] and r["rss_mb"] > 0 and r["external_data"] == []
    # the self-draft bundle's draft is the target: more bytes to load
    assert other["graph_bytes"] > first["graph_bytes"] and first["load_vs_first"] == 1.0
    assert other["load_vs_first"] == pytest.approx(other["load_s"] / first["load_s"], rel=1e-2)
    md = (tmp_path / "load-t.md").read_text()
    assert md.startswith("### load `t`: fresh process to first token") and f"| `{self_draft_bundle}` | full |" in md
    assert headline("load", data).startswith(f"`{demo_bundle}` (verify recorded): **{first['total_s']:.2f} s** to the "
                                             "first token")
    with pytest.raises(SpecrtError, match="--verify takes recorded, full, none, got sometimes"):
        LoadBenchConfig(bundle=demo_bundle, verify=("sometimes",))
    with pytest.raises(SpecrtError, match="--vs names --bundle or one bundle twice"):
        run_load(LoadBenchConfig(bundle=demo_bundle, vs=(demo_bundle,), out=tmp_path))
    with pytest.raises(SpecrtError, match="failed to start: .*BundleError: bundle directory .*missing does not exist"):
        run_load(LoadBenchConfig(bundle=tmp_path / "missing", out=tmp_path, runs=1))

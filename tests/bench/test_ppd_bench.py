"""`specrt bench ppd`: its rows, ablations and summary, rendered by the report generator."""

import pytest


def test_bench_ppd_rows_ablations_and_report(ppd_bundle, tmp_path):
    from specrt.bench.ppd import PpdBenchConfig, run_ppd
    from specrt.bench.catalog import bench_results, bench_section, headline

    cfg = PpdBenchConfig(bundle=ppd_bundle, out=tmp_path, label="t", num_prompts=2, max_new_tokens=16, runs=1,
                         threads=2, methods=("sd",), budgets=(4,))
    data = run_ppd(cfg)
    names = [r["name"] for r in data["rows"]]
    assert names[:2] == ["autoregressive", "sd"] and names[2] == "ppd (picked: 16 rows)"  # unprofiled: the default size
    assert {"ppd 4 rows", "ppd sparse tree (16 rows)", "ppd naive tree (16 rows)", "ppd random tree (16 rows)"} <= set(names)
    sampled = ["autoregressive, T=0.7", "ppd exact, T=0.7 (picked)", "ppd typical, T=0.7 (picked)"]
    assert names[-3:] == sampled  # sampled rows: against the sampled AR, no token identity to check
    assert all(r["same_tokens_as_ar"] is None and r["temperature"] == 0.7 for r in data["rows"][-3:])
    assert data["rows"][-3]["speedup_vs_ar"] == 1.0 and data["rows"][-1]["acceptance"] == "typical"
    assert all(r["same_tokens_as_ar"] for r in data["rows"][:-3])
    ppd_rows = [r for r in data["rows"] if r["method"] == "ppd"]
    assert all(len(r["accepted_at_least"]) == 3 and r["accepted_at_least"] == sorted(r["accepted_at_least"], reverse=True)
               for r in ppd_rows)
    s = data["summary"]
    assert s["added_parameters"] == 3 * 256 and s["added_fraction"] < 1e-3
    assert set(s["predicted_accepted_per_round"]) >= {"trained", "trained, if independent", "untrained, if independent",
                                                       "no prompt tokens, if independent"}
    assert s["measured_accepted_per_round"] == pytest.approx(data["rows"][2]["tokens_per_target_call"] - 1, abs=1e-3)
    md = "\n".join(bench_section(bench_results(tmp_path)[0], tmp_path))
    assert "### PPD `t`" in md and "| ppd naive tree (16 rows) |" in md
    assert "| ppd typical, T=0.7 (picked) |" in md and "typical acceptance is not lossless" in md
    assert headline("ppd", data).startswith("PPD (picked size) **")

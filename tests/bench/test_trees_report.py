"""bench trees: the summary compares the tuned choice with the measured best (report arithmetic)."""

from specrt.bench.trees import TreesConfig, batch_prefill, configurations, report


def row(name, kind, n, measured, predicted, per_call, per_round=None):
    return {"name": name, "kind": kind, "num_nodes": n, "nodes_per_round": n if per_round is None else per_round,
            "measured_tokens_per_s": measured, "decode_tokens_per_s": measured * 1.1,
            "predicted_tokens_per_s": predicted, "prediction_error": None if predicted is None else predicted / measured - 1,
            "tokens_per_target_call": per_call, "runs_s": [1.0], "same_tokens_as_autoregressive": True}


def test_summary_and_outputs(tmp_path):
    rows = [row("autoregressive", "autoregressive", 0, 60, 62, 1.0),
            row("chain 4", "chain", 4, 120, 125, 2.9), row("tree 4", "tree", 4, 118, 125, 2.9),
            row("tree 16", "tree", 16, 138, 140, 3.8), row("chain 16", "chain", 16, 100, None, 3.0),
            row("dynamic 16", "dynamic", 16, 150, None, 4.2), row("merged 8", "merged", 8, 156, 150, 4.4, per_round=9.25),
            row("merged 2", "merged", 2, 126, 130, 3.48, per_round=3.6)]
    data = report(TreesConfig(bundle=tmp_path, out=tmp_path, label="t"), rows, tuned="tree 16")
    s = data["summary"]
    assert s["tuned_vs_best_measured"] == round(138 / 156, 4) and s["best_measured"] == "merged 8"
    assert s["best_merged_vs_best_chain"] == 1.3
    # merged 2 verifies 3.6 nodes per round: against chain 4; merged 8 (9.25) has no chain of width 9 here
    assert s["tokens_per_call_merged_vs_chain_same_width"] == {"2": 1.2}
    assert s["best_tree_vs_best_chain"] == round(138 / 120, 4)
    assert s["tokens_per_call_tree_vs_chain_same_width"] == {"4": 1.0, "16": round(3.8 / 3.0, 3)}
    assert s["best_dynamic_vs_best_chain"] == 1.25
    assert s["tokens_per_call_dynamic_vs_chain_same_width"] == {"16": 1.4}
    md = (tmp_path / "trees-t.md").read_text()
    assert "| tree 16 **(tuned)** | 16 |" in md and "| dynamic 16 | 16 | 16.0 | 150.0 | 165.0 | - | - | 4.20 | yes |" in md
    assert "| merged 8 | 8 | 9.2 | 156.0 |" in md
    assert (tmp_path / "trees-t.json").is_file()


def test_configurations_follow_the_plan_curve(tmp_path):
    plan = {"curves": {"1": [{"kind": "autoregressive", "num_nodes": 0, "predicted_tokens_per_s": 10.0},
                             {"kind": "chain", "num_nodes": 1, "predicted_tokens_per_s": 12.0},
                             {"kind": "tree", "num_nodes": 2, "predicted_tokens_per_s": 13.0},
                             {"kind": "tree", "num_nodes": 3, "predicted_tokens_per_s": 14.0}]},
            "choices": {"1": {"kind": "tree", "num_nodes": 3}}}
    acceptance = {"trees": [{"num_nodes": 1, "paths": [[0]]}, {"num_nodes": 2, "paths": [[0], [1]]},
                            {"num_nodes": 3, "paths": [[0], [1], [0, 0]]}]}
    confs = configurations(plan, acceptance, TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(1, 2), max_chain=2,
                                                         long_chains=(3,), dynamic_sizes=(2,), merged_sizes=()))
    # tree 1 was not in the curve; tree 3 is measured although not in tree_sizes, because it is the tuned one;
    # chain 3 is measured without a prediction
    assert [c["name"] for c in confs] == ["autoregressive", "chain 1", "chain 3", "tree 2", "tree 3", "dynamic 2"]
    assert confs[2]["predicted"] is None and confs[-1]["paths"] is None
    assert confs[3]["paths"] == [[0], [1]] and confs[3]["predicted"] == 13.0


def test_a_tuned_dynamic_tree_is_measured_with_its_prediction(tmp_path):
    plan = {"curves": {"1": [{"kind": "autoregressive", "num_nodes": 0, "predicted_tokens_per_s": 10.0},
                             {"kind": "dynamic", "num_nodes": 2, "predicted_tokens_per_s": 15.0},
                             {"kind": "dynamic", "num_nodes": 5, "predicted_tokens_per_s": 16.0},
                             {"kind": "merged", "num_nodes": 5, "predicted_tokens_per_s": 17.0}]},
            "choices": {"1": {"kind": "dynamic", "num_nodes": 5}}}
    cfg = TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(), max_chain=0, long_chains=(), dynamic_sizes=(2, 3),
                      merged_sizes=(5,))
    assert [(c["name"], c["predicted"]) for c in configurations(plan, {"trees": []}, cfg)] == [
        ("autoregressive", 10.0), ("dynamic 2", 15.0), ("dynamic 3", None), ("dynamic 5", 16.0), ("merged 5", 17.0)]
    # a tuned merged tree is measured whatever merged_sizes says
    plan["choices"]["1"]["kind"] = "merged"
    cfg = TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(), max_chain=0, long_chains=(), dynamic_sizes=(),
                      merged_sizes=())
    assert [c["name"] for c in configurations(plan, {"trees": []}, cfg)] == ["autoregressive", "merged 5"]


def test_configurations_follow_the_plan_for_the_batch_size(tmp_path):
    plan = {"curves": {"1": [{"kind": "autoregressive", "num_nodes": 0, "predicted_tokens_per_s": 10.0}],
                       "4": [{"kind": "autoregressive", "num_nodes": 0, "predicted_tokens_per_s": 30.0},
                             {"kind": "merged", "num_nodes": 4, "predicted_tokens_per_s": 50.0}]},
            "choices": {"1": {"kind": "autoregressive", "num_nodes": 0}, "4": {"kind": "merged", "num_nodes": 4}}}
    cfg = TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(), max_chain=0, long_chains=(), dynamic_sizes=(),
                      merged_sizes=(), batch_size=4)
    assert [(c["name"], c["predicted"]) for c in configurations(plan, {"trees": []}, cfg)] == [
        ("autoregressive", 30.0), ("merged 4", 50.0)]


def test_a_batch_prefill_is_counted_once():
    from types import SimpleNamespace

    # 5 prompts at batch 2: batches (0, 1), (2, 3), (4); each sequence records its batch's prefill
    outs = [SimpleNamespace(stats={"seconds": {"prefill": p}}) for p in (0.2, 0.2, 0.3, 0.3, 0.1)]
    assert batch_prefill(outs, 2) == 0.2 + 0.3 + 0.1
    assert batch_prefill(outs, 1) == sum((0.2, 0.2, 0.3, 0.3, 0.1))

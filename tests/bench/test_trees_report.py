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


def make_plan(curves: dict, chosen: dict):
    """A Plan from {batch: [(kind, nodes, predicted tokens/s)]} and {batch: (kind, nodes)}."""
    from specrt.bundle.artifacts import CurvePoint, Plan, PlanChoice, Stamp

    points = {b: tuple(CurvePoint(k, n, 0.0, v, 0.0, 0.0) for k, n, v in rows) for b, rows in curves.items()}
    choices = {}
    for b, (kind, n) in chosen.items():
        best = next(p for p in points[b] if (p.kind, p.num_nodes) == (kind, n))
        choices[b] = PlanChoice("tree", best, best, 1.0)
    return Plan(Stamp("", "", ""), choices, points)


def make_acceptance(trees):
    from types import SimpleNamespace

    from specrt.bundle.artifacts import TreeEstimate

    return SimpleNamespace(trees=tuple(TreeEstimate(len(paths), tuple(map(tuple, paths)), 0.0) for paths in trees))


def test_configurations_follow_the_plan_curve(tmp_path):
    plan = make_plan({1: [("autoregressive", 0, 10.0), ("chain", 1, 12.0), ("tree", 2, 13.0), ("tree", 3, 14.0)]},
                     {1: ("tree", 3)})
    acceptance = make_acceptance([[[0]], [[0], [1]], [[0], [1], [0, 0]]])
    confs = configurations(plan, acceptance, TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(1, 2), max_chain=2,
                                                         long_chains=(3,), dynamic_sizes=(2,), merged_sizes=()))
    # tree 1 was not in the curve; tree 3 is measured although not in tree_sizes, because it is the tuned one;
    # chain 3 is measured without a prediction
    assert [c["name"] for c in confs] == ["autoregressive", "chain 1", "chain 3", "tree 2", "tree 3", "dynamic 2"]
    assert confs[2]["predicted"] is None and confs[-1]["paths"] is None
    assert confs[3]["paths"] == ((0,), (1,)) and confs[3]["predicted"] == 13.0


def test_a_tuned_dynamic_tree_is_measured_with_its_prediction(tmp_path):
    curve = [("autoregressive", 0, 10.0), ("dynamic", 2, 15.0), ("dynamic", 5, 16.0), ("merged", 5, 17.0)]
    cfg = TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(), max_chain=1, long_chains=(), dynamic_sizes=(2, 3),
                      merged_sizes=(5,))
    assert [(c["name"], c["predicted"]) for c in configurations(make_plan({1: curve}, {1: ("dynamic", 5)}),
                                                                make_acceptance([]), cfg)] == [
        ("autoregressive", 10.0), ("dynamic 2", 15.0), ("dynamic 3", None), ("dynamic 5", 16.0), ("merged 5", 17.0)]
    # a tuned merged tree is measured whatever merged_sizes says
    cfg = TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(), max_chain=1, long_chains=(), dynamic_sizes=(),
                      merged_sizes=())
    assert [c["name"] for c in configurations(make_plan({1: curve}, {1: ("merged", 5)}), make_acceptance([]), cfg)] == [
        "autoregressive", "merged 5"]


def test_configurations_follow_the_plan_for_the_batch_size(tmp_path):
    plan = make_plan({1: [("autoregressive", 0, 10.0)], 4: [("autoregressive", 0, 30.0), ("merged", 4, 50.0)]},
                     {1: ("autoregressive", 0), 4: ("merged", 4)})
    cfg = TreesConfig(bundle=tmp_path, out=tmp_path, tree_sizes=(), max_chain=1, long_chains=(), dynamic_sizes=(),
                      merged_sizes=(), batch_size=4)
    assert [(c["name"], c["predicted"]) for c in configurations(plan, make_acceptance([]), cfg)] == [
        ("autoregressive", 30.0), ("merged 4", 50.0)]


def test_a_batch_prefill_is_counted_once():
    from specrt.runtime.stats import Stats

    # 5 prompts at batch 2: batches (0, 1), (2, 3), (4); each sequence records its batch's prefill
    outs = []
    for p in (0.2, 0.2, 0.3, 0.3, 0.1):
        st = Stats()
        st.seconds.prefill = p
        outs.append(type("Out", (), {"stats": st})())
    assert batch_prefill(outs, 2) == 0.2 + 0.3 + 0.1
    assert batch_prefill(outs, 1) == sum((0.2, 0.2, 0.3, 0.3, 0.1))

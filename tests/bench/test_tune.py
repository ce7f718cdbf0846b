"""The tuner picks the argmax of predicted speed on synthetic curves; plans are refused elsewhere."""

import json

import pytest

from specrt.bench.tune import TuneConfig, tune
from specrt.errors import BundleError
from specrt.machine import fingerprint
from specrt.runtime.plan import choice_for, load_plan


def write_bundle(tmp_path, depth_rank, target_ms, draft_ms, dynamic=(), merged=(), batches=(1,)):
    """acceptance.json and latency.json from synthetic curves (and a stand-in manifest unless one is there)."""
    from specrt.calibration.acceptance import _manifest_hash, best_trees

    import numpy as np

    if not (tmp_path / "manifest.json").is_file():
        (tmp_path / "manifest.json").write_text("{}")
    p = np.array(depth_rank)
    (tmp_path / "acceptance.json").write_text(json.dumps({
        "manifest_sha256": _manifest_hash(tmp_path), "depth_rank": depth_rank, "trees": best_trees(p, 8),
        "dynamic": list(dynamic), "merged": list(merged)}))
    ns = list(range(1, 17))
    lat = {"machine": fingerprint("ort", 2), "config": {},
           "models": {"target": {str(b): {"128": {str(n): b * target_ms(n) for n in ns}} for b in batches},
                      "draft": {str(b): {"128": {str(n): b * draft_ms(n) for n in ns}} for b in batches}}}
    (tmp_path / "latency.json").write_text(json.dumps(lat))
    return tmp_path


def test_memory_bound_target_gets_a_tree(tmp_path):
    # verifying n tokens costs about as much as 1: speculation pays, and a bigger tree pays more
    b = write_bundle(tmp_path, [[0.9, 0.3], [0.9, 0.3], [0.9, 0.3]], lambda n: 10 + 0.1 * n, lambda n: 0.1)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    choice = plan["choices"]["1"]
    curve = plan["curves"]["1"]
    best = max(curve, key=lambda r: r["predicted_tokens_per_s"])
    assert choice["method"] == "tree" and choice["num_nodes"] == best["num_nodes"]
    assert choice["predicted_tokens_per_s"] == pytest.approx(best["predicted_tokens_per_s"], rel=1e-3)
    assert choice["predicted_speedup"] > 2


def test_overhead_bound_target_gets_no_speculation(tmp_path):
    # each verified token costs as much as a whole step and drafting is not free: autoregressive wins
    b = write_bundle(tmp_path, [[0.5, 0.1], [0.5, 0.1]], lambda n: 1.0 * n, lambda n: 0.5 * n)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    assert plan["choices"]["1"]["method"] == "autoregressive"
    assert plan["choices"]["1"]["predicted_speedup"] == 1.0


def test_plan_is_refused_on_another_machine_or_export(tmp_path):
    b = write_bundle(tmp_path, [[0.9, 0.3]], lambda n: 10.0, lambda n: 0.1)
    tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    here = fingerprint("ort", 2)
    assert choice_for(load_plan(b, here), 4)["method"] == "tree"
    with pytest.raises(BundleError, match="was tuned on .* re-run `specrt profile` and `specrt tune` here"):
        load_plan(b, {**here, "cpu": "Some Other CPU"})
    with pytest.raises(BundleError, match="2 threads, but this is .* 4 threads"):
        load_plan(b, fingerprint("ort", 4))
    (b / "manifest.json").write_text('{"re": "exported"}')
    with pytest.raises(BundleError, match="another export"):
        load_plan(b, here)


def test_auto_without_a_plan_says_what_to_run(pipelines):
    with pytest.raises(BundleError, match="specrt calibrate.*specrt profile.*specrt tune"):
        pipelines["ort"].generate("def f():", method="auto")


def test_host_work_term_interpolates_and_defaults_to_zero():
    from specrt.bench.latency import host_ms

    assert host_ms({"models": {}}, 8) == 0.0  # profiles without the measurement
    data = {"host_ms": {"0": 0.02, "8": 0.3, "32": 0.6}}
    assert host_ms(data, 0) == pytest.approx(0.02)
    assert host_ms(data, 20) == pytest.approx(0.45)
    assert host_ms(data, 8, "merged") == pytest.approx(0.3)  # not profiled: the static trees' term
    data["dynamic_host_ms"] = {"2": 0.5, "32": 2.0}
    assert host_ms(data, 8, "merged") == host_ms(data, 8, "dynamic") == pytest.approx(0.8)
    data["merged_host_ms"] = {"2": 0.7, "32": 2.2}
    assert host_ms(data, 8, "merged") == pytest.approx(1.0) and host_ms(data, 8) == pytest.approx(0.3)


def test_host_work_can_tip_the_choice(tmp_path):
    # memory-bound curves, but 40 ms of host work per tree round (vs 10 ms per target step): speculation loses
    b = write_bundle(tmp_path, [[0.9, 0.3], [0.9, 0.3]], lambda n: 10 + 0.1 * n, lambda n: 0.1)
    lat = json.loads((b / "latency.json").read_text())
    lat["host_ms"] = {"0": 0.0, "1": 40.0, "16": 40.0}
    (b / "latency.json").write_text(json.dumps(lat))
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,)))["choices"]["1"]["method"] == "autoregressive"


def test_measured_dynamic_tree_is_a_candidate_and_auto_runs_it(demo_bundle, tmp_path):
    import shutil

    from specrt.runtime.beam import DynamicTreeDrafter
    from specrt.runtime.methods import MethodConfig, build
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    # static trees accept at most 0.5 + 0.25 + ... here; the measured dynamic tree of 6 nodes accepts 2.5
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 0.1 * n, lambda n: 0.1, dynamic=[
        {"num_nodes": 6, "width": 4, "depth": 5, "expected_accepted": 2.5, "draft_calls_per_round": 4.0},
        {"num_nodes": 12, "width": 4, "depth": 8, "expected_accepted": 2.6, "draft_calls_per_round": 7.0}])
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    choice = plan["choices"]["1"]
    assert (choice["method"], choice["num_nodes"], choice["width"], choice["depth"]) == ("dynamic", 6, 4, 5)
    dyn = [r for r in plan["curves"]["1"] if r["kind"] == "dynamic"]
    # 6 nodes: target L(7) = 10.7 ms, draft L(1) + 3 L(4) = 0.4 ms, no host term in this profile
    assert dyn[0]["predicted_tokens_per_s"] == pytest.approx(1e3 * 3.5 / (10.7 + 0.4), rel=1e-3)
    assert choice["best_tree"]["kind"] in ("tree", "chain")  # method="tree" still gets a static tree
    pipe = Pipeline.load(b, threads=2)
    drafter = build(pipe, MethodConfig("auto"), SamplingParams(), 1)[0]
    assert isinstance(drafter, DynamicTreeDrafter) and (drafter.num_nodes, drafter.num_beams, drafter.gamma) == (6, 4, 5)
    prompts = ["def add(a, b):", "import os\n"]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=24)
    assert [o.token_ids for o in pipe.generate(prompts, method="auto", max_new_tokens=24)] == [o.token_ids for o in ar]


def test_measured_merged_tree_is_a_candidate_and_auto_runs_it(demo_bundle, tmp_path):
    import shutil

    from specrt.runtime.beam import DynamicTreeDrafter
    from specrt.runtime.merge import MergedDrafter
    from specrt.runtime.methods import MethodConfig, build
    from specrt.runtime.ngram import NgramDrafter
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    dyn = {"num_nodes": 6, "width": 4, "depth": 5, "expected_accepted": 2.5, "draft_calls_per_round": 4.0}
    merged = {**dyn, "expected_accepted": 3.0, "nodes_per_round": 9.0, "ngram_tokens": 7, "ngram_min_prob": 0.3}
    # a steep target: merged trees verify 9 nodes per round (L(10) = 20 ms) for 4 tokens, dynamic 6 (17 ms) for 3.5
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 1.0 * n, lambda n: 0.1, dynamic=[dyn], merged=[merged])
    choice = tune(TuneConfig(bundle=b, batch_sizes=(1,)))["choices"]["1"]
    assert (choice["kind"], choice["num_nodes"]) == ("dynamic", 6)  # 3.5 / 17.4 > 4 / 20.4
    # a flat one: the merged tree's extra nodes are nearly free
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 0.1 * n, lambda n: 0.1, dynamic=[dyn], merged=[merged],
                 batches=(1, 2))
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1, 2)))
    choice = plan["choices"]["1"]
    assert (choice["method"], choice["kind"], choice["ngram_tokens"], choice["ngram_min_prob"]) == ("dynamic", "merged", 7, 0.3)
    (row,) = [r for r in plan["curves"]["1"] if r["kind"] == "merged"]
    assert row["target_ms"] == pytest.approx(11.0)  # L(9 + 1): the measured nodes per round, not the 6 drafted
    # without a histogram of nodes per round, batch 2 is costed at the mean width too
    (row,) = [r for r in plan["curves"]["2"] if r["kind"] == "merged"]
    assert row["target_ms"] == pytest.approx(2 * 11.0)
    pipe = Pipeline.load(b, threads=2)
    drafter = build(pipe, MethodConfig("auto"), SamplingParams(), 1)[0]
    assert isinstance(drafter, MergedDrafter)
    model, ngram = drafter.drafters
    assert isinstance(model, DynamicTreeDrafter) and model.num_nodes == 6 and isinstance(ngram, NgramDrafter)
    assert (ngram.num_draft_tokens, ngram.min_prob) == (7, 0.3)
    prompts = ["def add(a, b):", "import os\n"]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=24)
    assert [o.token_ids for o in pipe.generate(prompts, method="auto", max_new_tokens=24)] == [o.token_ids for o in ar]


def test_a_batched_step_is_costed_at_the_expected_widest_tree():
    from specrt.bench.tune import step_width

    dyn = {"num_nodes": 4, "nodes_per_round": 6.0, "nodes_hist": {"4": 1, "8": 1}}  # 4 or 8 nodes, evenly
    assert step_width(dyn, 1) == pytest.approx(6.0)
    assert step_width(dyn, 2) == pytest.approx(4 * 0.25 + 8 * 0.75)  # both 4 with probability 1/4
    assert step_width(dyn, 8) == pytest.approx(4 / 256 + 8 * 255 / 256)
    assert step_width({"num_nodes": 4, "nodes_per_round": 5.5}, 4) == 5.5  # no histogram: the mean
    assert step_width({"num_nodes": 4}, 4) == 4

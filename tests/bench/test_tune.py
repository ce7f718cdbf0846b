"""The tuner picks the argmax of predicted speed on synthetic curves; plans are refused elsewhere."""

import json

import pytest

from specrt.bench.tune import TuneConfig, tune
from specrt.errors import BundleError
from specrt.machine import fingerprint
from specrt.runtime.plan import choice_for, load_plan


def write_bundle(tmp_path, depth_rank, target_ms, draft_ms):
    from specrt.calibration.acceptance import _manifest_hash, best_trees

    import numpy as np

    (tmp_path / "manifest.json").write_text("{}")
    p = np.array(depth_rank)
    (tmp_path / "acceptance.json").write_text(json.dumps({
        "manifest_sha256": _manifest_hash(tmp_path), "depth_rank": depth_rank, "trees": best_trees(p, 8)}))
    ns = list(range(1, 17))
    lat = {"machine": fingerprint("ort", 2), "config": {},
           "models": {"target": {"1": {"128": {str(n): target_ms(n) for n in ns}}},
                      "draft": {"1": {"128": {str(n): draft_ms(n) for n in ns}}}}}
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


def test_host_work_can_tip_the_choice(tmp_path):
    # memory-bound curves, but 40 ms of host work per tree round (vs 10 ms per target step): speculation loses
    b = write_bundle(tmp_path, [[0.9, 0.3], [0.9, 0.3]], lambda n: 10 + 0.1 * n, lambda n: 0.1)
    lat = json.loads((b / "latency.json").read_text())
    lat["host_ms"] = {"0": 0.0, "1": 40.0, "16": 40.0}
    (b / "latency.json").write_text(json.dumps(lat))
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,)))["choices"]["1"]["method"] == "autoregressive"

"""The tuner picks the argmax of predicted speed on synthetic curves; auto runs what it picked."""

import json

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import LatencyProfile, Plan
from specrt.calibration.tune import TuneConfig, tune
from tests.fakes import measured_tree, write_acceptance, write_latency


def write_bundle(tmp_path, depth_rank, target_ms, draft_ms, dynamic=(), merged=(), batches=(1,), host_ms=None, ngram=(),
                 by_position=()):
    """acceptance.json and latency.json from synthetic curves (and a stand-in manifest unless one is there)."""
    if not (tmp_path / "manifest.json").is_file():
        (tmp_path / "manifest.json").write_text("{}")
    write_acceptance(tmp_path, depth_rank, dynamic, merged, ngram=ngram, by_position=by_position)
    write_latency(tmp_path, target_ms, draft_ms, batches, host_ms=host_ms)
    return tmp_path


def test_memory_bound_target_gets_a_tree(tmp_path):
    # verifying n tokens costs about as much as 1: speculation pays, and a bigger tree pays more
    b = write_bundle(tmp_path, [[0.9, 0.3], [0.9, 0.3], [0.9, 0.3]], lambda n: 10 + 0.1 * n, lambda n: 0.1)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    choice = plan.choices[1]
    best = max(plan.curves[1], key=lambda r: r.predicted_tokens_per_s)
    assert choice.method == "tree" and choice.best == best
    assert choice.predicted_speedup > 2
    assert artifacts.load(b, Plan) == plan  # what was saved is what loads


def test_overhead_bound_target_gets_no_speculation(tmp_path):
    # each verified token costs as much as a whole step and drafting is not free: autoregressive wins
    b = write_bundle(tmp_path, [[0.5, 0.1], [0.5, 0.1]], lambda n: 1.0 * n, lambda n: 0.5 * n)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    assert plan.choices[1].method == "autoregressive" and plan.choices[1].predicted_speedup == 1.0


def test_a_gain_within_the_models_error_is_not_taken(tmp_path):
    # drafting predicted a few percent faster: within min_gain, so no speculation; with min_gain 0, the tree
    b = write_bundle(tmp_path, [[0.5, 0.1]], lambda n: 10.0 + 7.5 * n, lambda n: 0.1)
    rows = tune(TuneConfig(bundle=b, batch_sizes=(1,), min_gain=0.0)).curves[1]
    gain = max(r.predicted_tokens_per_s for r in rows) / rows[0].predicted_tokens_per_s
    assert 1.0 < gain < 1.05
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,), min_gain=0.0)).choices[1].method == "tree"
    choice = tune(TuneConfig(bundle=b, batch_sizes=(1,))).choices[1]
    assert choice.method == "autoregressive" and choice.predicted_speedup == 1.0


def test_tuning_for_short_outputs_weighs_the_acceptance_where_their_rounds_start(tmp_path):
    """ANPD accepts nothing in an output's first 16 tokens and 4 a round after: on the calibration's average it
    wins; tuned for 16-token outputs it never pays (no speculation); for 128 tokens it does again."""
    from specrt.calibration.tune import describe_plan

    table = [[0.05, 0.01], [0.05, 0.01]]  # the draft model barely helps, and costs 5 ms a call
    ngram = [measured_tree(7, 1, 7, 2.0, 0.0, per_round=5.0, by_position=(0.0, 4.0))]
    b = write_bundle(tmp_path, table, lambda n: 10 + 0.1 * n, lambda n: 5.0, ngram=ngram, by_position=[table, table])
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,))).choices[1].method == "anpd"
    short = tune(TuneConfig(bundle=b, batch_sizes=(1,), new_tokens=16))
    assert short.choices[1].method == "autoregressive" and short.new_tokens == 16
    row = next(r for r in short.curves[1] if r.kind == "ngram")
    assert row.expected_accepted == 0.0  # 16 rounds of one token
    assert "tuned for outputs of 16 tokens" in describe_plan(short)
    long = tune(TuneConfig(bundle=b, batch_sizes=(1,), new_tokens=128))
    row = next(r for r in long.curves[1] if r.kind == "ngram")
    # 16 rounds of 1 token, then 112 tokens at 5 a round: 22.4 rounds (the last one in part)
    assert long.choices[1].method == "anpd" and row.expected_accepted == pytest.approx(128 / (16 + 22.4) - 1, abs=1e-6)


def test_tuning_for_a_context_prices_every_step_there(tmp_path):
    """Verifying more tokens costs little at 128 cached tokens and a lot at 1024 (attention over the cache): tuned for
    a short context, a tree; for a long one, no speculation; untold, the average of the two."""
    from dataclasses import replace

    from specrt.calibration.tune import describe_plan

    b = write_bundle(tmp_path, [[0.6, 0.2], [0.6, 0.2]], lambda n: 10 + 0.1 * n, lambda n: 0.1)
    lat = artifacts.load(b, LatencyProfile)
    long = {n: 10 + 8.0 * n for n in range(1, 17)}
    artifacts.save(b, replace(lat, models={**lat.models, "target": {1: {128: lat.models["target"][1][128], 1024: long}}}))
    short = tune(TuneConfig(bundle=b, batch_sizes=(1,), context=128))
    assert short.choices[1].method == "tree" and short.context == 128
    assert "tuned for steps at 128 cached tokens" in describe_plan(short)
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,), context=1024)).choices[1].method == "autoregressive"
    ar = next(r for r in tune(TuneConfig(bundle=b, batch_sizes=(1,), context=576)).curves[1] if r.kind == "autoregressive")
    assert ar.target_ms == pytest.approx((10.1 + 18.0) / 2)
    assert next(r for r in tune(TuneConfig(bundle=b, batch_sizes=(1,))).curves[1]).target_ms == pytest.approx(ar.target_ms)


def test_tuning_an_unprofiled_batch_size_is_refused(tmp_path):
    from specrt.errors import SpecrtError

    b = write_bundle(tmp_path, [[0.9, 0.3]], lambda n: 10.0, lambda n: 0.1, batches=(1, 2))
    with pytest.raises(SpecrtError, match="batch size\\(s\\) 4 were not profiled \\(profiled: 1, 2\\)"):
        tune(TuneConfig(bundle=b, batch_sizes=(1, 4)))


def test_auto_without_a_plan_says_what_to_run(pipelines):
    from specrt.errors import BundleError

    with pytest.raises(BundleError, match="no plan.json .*: run `specrt calibrate .* && specrt profile .* && specrt tune"):
        pipelines["ort"].generate("def f():", method="auto")


def test_host_work_term_interpolates_and_falls_back_to_simpler_kinds(tmp_path):
    """A kind's host work where profiled, else that of the simpler kinds it is priced as (SpeculationKind.host)."""
    from specrt.runtime.speculation import SPECULATION

    def chain(kind):
        return SPECULATION[kind].host

    (tmp_path / "manifest.json").write_text("{}")
    lat = write_latency(tmp_path, lambda n: 1.0)
    assert lat.host(8) == 0.0  # profiles without the measurement
    lat = write_latency(tmp_path, lambda n: 1.0, host_ms={"tree": {0: 0.02, 8: 0.3, 32: 0.6}})
    assert lat.host(0) == pytest.approx(0.02) and lat.host(20) == pytest.approx(0.45)
    assert lat.host(8, chain("merged")) == pytest.approx(0.3)  # not profiled: the static trees' term
    lat = write_latency(tmp_path, lambda n: 1.0, host_ms={"tree": {0: 0.02, 8: 0.3, 32: 0.6}, "dynamic": {2: 0.5, 32: 2.0}})
    assert lat.host(8, chain("merged")) == lat.host(8, chain("dynamic")) == pytest.approx(0.8)
    lat = write_latency(tmp_path, lambda n: 1.0, host_ms={"tree": {0: 0.02, 8: 0.3, 32: 0.6}, "dynamic": {2: 0.5, 32: 2.0},
                                                          "merged": {2: 0.7, 32: 2.2}})
    assert lat.host(8, chain("merged")) == pytest.approx(1.0) and lat.host(8) == pytest.approx(0.3)
    assert lat.host(8, chain("ngram")) == pytest.approx(0.3)  # ANPD not profiled: the static trees' term, not dynamic's
    assert artifacts.load(tmp_path, LatencyProfile) == lat
    lat = write_latency(tmp_path, lambda n: 1.0, host_ms={"tree": {0: 0.02, 8: 0.3, 32: 0.6}, "ngram": {2: 0.05, 10: 0.09}})
    assert lat.host(6, chain("ngram")) == pytest.approx(0.07) and lat.host(6) == pytest.approx(0.02 + 0.28 * 6 / 8)


def test_anpd_is_costed_with_its_own_host_work_not_a_draft_trees(tmp_path):
    """An ANPD round's host work is what ANPD's decodes were profiled at (no draft bookkeeping), both in the
    tuner's cost and in the hardware-aware drafter's round costs."""
    from specrt.bundle.artifacts import Acceptance
    from specrt.calibration.tune import candidates, point_cost_ms
    from specrt.runtime.cost import ngram_round_costs
    from specrt.runtime.speculation import SPECULATION

    b = write_bundle(tmp_path, [[0.5]] * 4, lambda n: 1.0 + 0.1 * n, lambda n: 0.5,
                     host_ms={"tree": {0: 0.1, 16: 1.7}, "ngram": {2: 0.2, 10: 0.3}},
                     ngram=(measured_tree(5, 1, 5, 1.0, 0.0, 4.0, {4: 10}),))
    acc, lat = artifacts.load(b, Acceptance), artifacts.load(b, LatencyProfile)
    point = next(c for c in candidates(acc) if c.kind == "ngram")
    target, host = point_cost_ms(acc, lat, 1, point)
    assert target == pytest.approx(1.0 + 0.1 * 5) and host == pytest.approx(0.2 + 0.1 * 3 / 8)
    costs = ngram_round_costs(lat, 3, 1, SPECULATION["ngram"].host)
    assert costs == pytest.approx([1.1 + 0.2, 1.2 + 0.2, 1.3 + 0.2, 1.4 + 0.2125])


def test_the_batch_cost_model_grows_host_work_with_the_batch_and_interpolates_between_batch_sizes(tmp_path):
    """Host work profiled per batch size (profiles without it use batch 1's), linear between batch sizes and past
    the largest; L(n) between two profiled batch sizes is linear between theirs (a draining batch runs there)."""
    from specrt.calibration.acceptance import chain_expectation, tree_expectation
    from specrt.calibration.tune import candidates, point_cost_ms

    (tmp_path / "manifest.json").write_text("{}")
    old = write_latency(tmp_path, lambda n: 1.0, host_ms={"tree": {0: 0.1, 8: 0.5}})
    assert old.host(8, batch=4) == pytest.approx(0.5)  # measured at batch 1 only
    lat = write_latency(tmp_path, lambda n: 1.0 + n, batches=(1, 2, 4), host_ms={"tree": {0: 0.1, 8: 0.5}},
                        host_batch={"tree": {4: {0: 0.4, 8: 1.7}}})
    assert lat.host(8, batch=4) == pytest.approx(1.7) and lat.host(4, batch=4) == pytest.approx(1.05)
    assert lat.host(8, batch=2) == pytest.approx(0.5 + (1.7 - 0.5) / 3)
    assert lat.host(8, batch=8) == pytest.approx(1.7 + 4 * (1.7 - 0.5) / 3)  # along the line through 1 and 4
    assert lat.step_ms("target", 3, 2) == pytest.approx((2 * 3.0 + 4 * 3.0) / 2)  # between batch 2 and 4
    with pytest.raises(Exception, match="batch size 8 was not profiled"):
        lat.step_ms("target", 8, 2)
    assert artifacts.load(tmp_path, LatencyProfile) == lat  # the per-batch table round-trips
    p = [[0.8, 0.1], [0.5, 0.2]]
    acc = write_acceptance(tmp_path, p)
    assert tree_expectation(np.array(p), [(0,), (0, 0)]) == pytest.approx(chain_expectation(np.array(p), 2))
    assert tree_expectation(np.array(p), [(0,), (1,), (0, 1), (0, 0, 0)]) == pytest.approx(0.8 + 0.1 + 0.8 * 0.2)
    chain = next(c for c in candidates(acc) if c.kind == "chain" and c.num_nodes == 2)
    target, rest = point_cost_ms(acc, lat, 4, chain)
    # L_target(4, 3); two draft steps of one token at batch 4 (0.1 ms x 4 each) + H(batch 4, 2 nodes)
    assert target == pytest.approx(4 * 4.0) and rest == pytest.approx(2 * 0.4 + 0.4 + 2 / 8 * (1.7 - 0.4))

def test_host_work_can_tip_the_choice(tmp_path):
    # memory-bound curves, but 40 ms of host work per tree round (vs 10 ms per target step): speculation loses
    b = write_bundle(tmp_path, [[0.9, 0.3], [0.9, 0.3]], lambda n: 10 + 0.1 * n, lambda n: 0.1,
                     host_ms={"tree": {0: 0.0, 1: 40.0, 16: 40.0}})
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,))).choices[1].method == "autoregressive"


def test_auto_follows_the_live_batch_size_with_the_plans_static_trees(demo_bundle, tmp_path):
    """Host work that grows with the batch: the plan picks 6 nodes at batch 1 and 3 at batch 2 and 4. auto at batch
    4 drafts 3-node trees while 2 or more sequences are live and 6-node trees once one is left; tokens stay AR's."""
    import shutil

    from specrt.calibration.tune import describe_auto
    from specrt.runtime.drafters.draft_model import DraftModelDrafter
    from specrt.runtime.methods import make_method
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculation import trees_by_batch

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    write_bundle(b, [[0.9, 0.3], [0.9, 0.3], [0.9, 0.3]], lambda n: 10 + 1.0 * n, lambda n: 0.1, batches=(1, 2, 4))
    write_latency(b, lambda n: 10 + 1.0 * n, lambda n: 0.1, (1, 2, 4), host_ms={"tree": {0: 0.0, 16: 0.0}},
                  host_batch={"tree": {2: {0: 0.0, 16: 30.0}, 4: {0: 0.0, 16: 60.0}}})
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1, 2, 4), min_gain=0.0))
    assert {k: (c.method, c.best.num_nodes) for k, c in plan.choices.items()} == {1: ("tree", 6), 2: ("tree", 3),
                                                                                  4: ("tree", 3)}
    pipe = Pipeline.load(b, threads=2)
    drafter = make_method("auto", {}).build(pipe.method_context(), SamplingParams(), 4).drafter
    assert isinstance(drafter, DraftModelDrafter)
    assert [len(drafter.layout_for(n).spec) for n in (1, 2, 3, 4, 8)] == [6, 3, 3, 3, 3]
    assert describe_auto(plan, 4) == "static trees by live batch size: 6 nodes at 1, 3 nodes at 2, 3 nodes at 4"
    assert describe_auto(plan, 1) == "tree of 6 nodes" and trees_by_batch(plan, 1) is None
    drafter.close()
    prompts = ["def add(a, b):", "import os\n", "class A:", "x = [", "for i in range(3):"]
    caps = [40, 8, 12, 16, 10]  # the first outlives the others: its last rounds run alone
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=caps)
    outs = pipe.generate(prompts, method="auto", max_new_tokens=caps, batch_size=4)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert set(outs[0].stats.drafted_hist) == {3, 6} and set(outs[1].stats.drafted_hist) == {3}
    one = pipe.generate(prompts[:1], method="auto", max_new_tokens=24)[0]  # a batch of 1: the batch-1 tree only
    assert set(one.stats.drafted_hist) == {6}


def test_measured_dynamic_tree_is_a_candidate_and_auto_runs_it(demo_bundle, tmp_path):
    import shutil

    from specrt.runtime.drafters import DynamicTreeDrafter
    from specrt.runtime.methods import make_method
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    # static trees accept at most 0.5 + 0.25 + ... here; the measured dynamic tree of 6 nodes accepts 2.5
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 0.1 * n, lambda n: 0.1,
                 dynamic=[measured_tree(6, 4, 5, 2.5, 4.0), measured_tree(12, 4, 8, 2.6, 7.0)])
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    choice = plan.choices[1]
    assert (choice.method, choice.best.num_nodes, choice.best.width, choice.best.depth) == ("dynamic", 6, 4, 5)
    dyn = [r for r in plan.curves[1] if r.kind == "dynamic"]
    # 6 nodes: target L(7) = 10.7 ms, draft L(1) + 3 L(4) = 0.4 ms, no host term in this profile
    assert dyn[0].predicted_tokens_per_s == pytest.approx(1e3 * 3.5 / (10.7 + 0.4), rel=1e-3)
    assert choice.best_static.kind in ("tree", "chain")  # method="tree" still gets a static tree
    pipe = Pipeline.load(b, threads=2)
    drafter = make_method("auto", {}).build(pipe.method_context(), SamplingParams(), 1).drafter
    assert isinstance(drafter, DynamicTreeDrafter) and (drafter.num_nodes, drafter.num_beams, drafter.gamma) == (6, 4, 5)
    prompts = ["def add(a, b):", "import os\n"]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=24)
    assert [o.token_ids for o in pipe.generate(prompts, method="auto", max_new_tokens=24)] == [o.token_ids for o in ar]


def test_measured_ngram_drafts_are_a_candidate_and_auto_runs_anpd(demo_bundle, tmp_path):
    """ANPD (no draft model) is weighed from its acceptance measured by decoding: with an expensive draft model and
    n-gram drafts that are accepted well, the plan picks it and auto runs it, token-identical to AR."""
    import shutil

    from specrt.calibration.tune import describe_plan
    from specrt.runtime.drafters import NgramDrafter
    from specrt.runtime.methods import make_method
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    ngram = [measured_tree(3, 1, 3, 0.9, 0.0, per_round=2.0), measured_tree(7, 1, 7, 1.2, 0.0, per_round=5.0)]
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 0.1 * n, lambda n: 5.0, ngram=ngram)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    choice = plan.choices[1]
    assert (choice.method, choice.best.kind, choice.best.num_nodes) == ("anpd", "ngram", 7)
    row = next(r for r in plan.curves[1] if r.kind == "ngram" and r.num_nodes == 7)
    # target L(5 + 1) = 10.6 ms (the hist-free width is nodes per round), no draft model, no host term here
    assert row.predicted_tokens_per_s == pytest.approx(1e3 * 2.2 / 10.6, rel=1e-3)
    assert "ANPD: up to 7 n-gram drafted tokens" in describe_plan(plan)
    pipe = Pipeline.load(b, threads=2)
    drafter = make_method("auto", {}).build(pipe.method_context(), SamplingParams(), 1).drafter
    assert isinstance(drafter, NgramDrafter) and drafter.num_draft_tokens == 7
    prompts = ["def add(a, b):", "import os\n"]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=24)
    assert [o.token_ids for o in pipe.generate(prompts, method="auto", max_new_tokens=24)] == [o.token_ids for o in ar]


def test_measured_merged_tree_is_a_candidate_and_auto_runs_it(demo_bundle, tmp_path):
    import shutil

    from specrt.runtime.drafters import DynamicTreeDrafter, MergedDrafter, NgramDrafter
    from specrt.runtime.methods import make_method
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    dyn = measured_tree(6, 4, 5, 2.5, 4.0)
    merged = measured_tree(6, 4, 5, 3.0, 4.0, per_round=9.0, ngram_tokens=7, min_prob=0.3)
    # a steep target: merged trees verify 9 nodes per round (L(10) = 20 ms) for 4 tokens, dynamic 6 (17 ms) for 3.5
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 1.0 * n, lambda n: 0.1, dynamic=[dyn], merged=[merged])
    best = tune(TuneConfig(bundle=b, batch_sizes=(1,))).choices[1].best
    assert (best.kind, best.num_nodes) == ("dynamic", 6)  # 3.5 / 17.4 > 4 / 20.4
    # a flat one: the merged tree's extra nodes are nearly free
    write_bundle(b, [[0.5, 0.1], [0.5, 0.1]], lambda n: 10 + 0.1 * n, lambda n: 0.1, dynamic=[dyn], merged=[merged],
                 batches=(1, 2))
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1, 2)))
    choice = plan.choices[1]
    assert (choice.method, choice.best.kind, choice.best.ngram_tokens, choice.best.ngram_min_prob) == ("dynamic", "merged", 7, 0.3)
    (row,) = [r for r in plan.curves[1] if r.kind == "merged"]
    assert row.target_ms == pytest.approx(11.0)  # L(9 + 1): the measured nodes per round, not the 6 drafted
    # without a histogram of nodes per round, batch 2 is costed at the mean width too
    (row,) = [r for r in plan.curves[2] if r.kind == "merged"]
    assert row.target_ms == pytest.approx(2 * 11.0)
    pipe = Pipeline.load(b, threads=2)
    drafter = make_method("auto", {}).build(pipe.method_context(), SamplingParams(), 1).drafter
    assert isinstance(drafter, MergedDrafter)
    model, ngram = drafter.drafters
    assert isinstance(model, DynamicTreeDrafter) and model.num_nodes == 6 and isinstance(ngram, NgramDrafter)
    # the plan's n-gram budget, each round's drafts chosen on this profile (no fixed floor on their estimates)
    assert (ngram.num_draft_tokens, ngram.min_prob) == (7, 0.0)
    assert ngram.step_costs[:3] == pytest.approx([10.1, 10.2, 10.3])  # L(n + 1) at batch 1 (no host work profiled)
    prompts = ["def add(a, b):", "import os\n"]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=24)
    assert [o.token_ids for o in pipe.generate(prompts, method="auto", max_new_tokens=24)] == [o.token_ids for o in ar]


def test_a_batched_step_is_costed_over_the_width_of_its_widest_tree(tmp_path):
    """A ragged step is as wide as its widest tree; its cost is L's expectation over that width, not L at the
    expected width (ANPD drafts K tokens or none, and L is not linear)."""
    from specrt.runtime.cost import target_step_ms, widest

    dyn = measured_tree(4, 4, 4, 1.0, 1.0, per_round=6.0, hist={4: 1, 8: 1})  # 4 or 8 nodes, evenly
    for batch, p8 in ((1, 0.5), (2, 0.75), (8, 255 / 256)):  # both 4 with probability 1/2 ** batch
        widths, p = widest(dyn, batch)
        assert list(widths) == [4, 8] and p == pytest.approx([1 - p8, p8])
    assert [list(a) for a in widest(measured_tree(4, 4, 4, 1.0, 1.0, per_round=5.5), 4)] == [[5.5], [1.0]]
    (tmp_path / "manifest.json").write_text("{}")
    lat = write_latency(tmp_path, lambda n: 1.0 if n <= 5 else 3.0, batches=(1, 2))  # above 5 tokens: 3x (x batch)
    assert target_step_ms(lat, 1, dyn) == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)  # at the mean width (7 tokens): 3.0
    assert target_step_ms(lat, 2, dyn) == pytest.approx(2 * (0.25 * 1.0 + 0.75 * 3.0))


def test_a_packed_step_is_costed_over_the_mean_width_of_its_batch(tmp_path):
    """Where the backend leaves holes out (LatencyProfile.packed_rows), a ragged step does the token-wise work of its
    real rows: L over the distribution of the batch's mean width, not its widest."""
    import dataclasses

    from specrt.runtime.cost import mean_width, prefill_ms, target_step_ms

    dyn = measured_tree(4, 4, 4, 1.0, 1.0, per_round=6.0, hist={4: 1, 8: 1})  # 4 or 8 nodes, evenly
    widths, p = mean_width(dyn, 2)
    assert list(widths) == [4, 6, 8] and p == pytest.approx([0.25, 0.5, 0.25])
    assert list(mean_width(dyn, 1)[0]) == [4, 8]
    assert [list(a) for a in mean_width(measured_tree(4, 4, 4, 1.0, 1.0, per_round=5.5), 4)] == [[5.5], [1.0]]
    (tmp_path / "manifest.json").write_text("{}")
    flat = write_latency(tmp_path, lambda n: float(n), batches=(1, 2))  # linear: 1 ms per token row
    packed = dataclasses.replace(flat, packed_rows=True)
    assert target_step_ms(packed, 1, dyn) == target_step_ms(flat, 1, dyn)  # one sequence: no holes either way
    assert target_step_ms(flat, 2, dyn) == pytest.approx(2 * (0.25 * 5 + 0.75 * 9))  # as wide as the widest: 5 or 9
    assert target_step_ms(packed, 2, dyn) == pytest.approx(2 * (0.25 * 5 + 0.5 * 7 + 0.25 * 9))  # the mean: 5, 7, 9
    assert prefill_ms(flat, "target", [8, 2]) == pytest.approx(2 * 8 * prefill_ms(flat, "target", [1]))
    assert prefill_ms(dataclasses.replace(flat, packed_rows=True), "target", [8, 2]) == \
        pytest.approx(10 * prefill_ms(flat, "target", [1]))


def test_prefill_is_priced_from_the_prefill_profile_chunk_by_chunk(tmp_path):
    """A profiled prefill prices each chunk step at the per-token cost of a step as wide as its longest row (at the
    step's rows, linear between profiled widths and batch sizes), times its real tokens where rows are packed."""
    import dataclasses

    from specrt.runtime.cost import prefill_ms

    (tmp_path / "manifest.json").write_text("{}")
    flat = write_latency(tmp_path, lambda n: float(n), batches=(1, 2))
    # per token: 1 ms at 16 tokens per sequence, 2 ms at 32 (batch 1); twice that at batch 2
    prefill = {"target": {1: {16: 16.0, 32: 64.0}, 2: {16: 64.0, 32: 256.0}}}
    lat = dataclasses.replace(flat, prefill=prefill, prefill_chunk=32, packed_rows=True)
    assert prefill_ms(lat, "target", [16]) == pytest.approx(16.0)
    assert prefill_ms(lat, "target", [24]) == pytest.approx(24 * 1.5)  # halfway between the widths
    assert prefill_ms(lat, "target", [40]) == pytest.approx(32 * 2.0 + 8 * 1.0)  # chunks of 32, then 8
    assert prefill_ms(lat, "target", [32, 8]) == pytest.approx(40 * 4.0)  # ragged, packed: its tokens at width 32
    assert prefill_ms(lat, "target", [16], running=1) == pytest.approx(16 * 2.0)  # a static cache's two rows
    unpacked = dataclasses.replace(lat, packed_rows=False)
    assert prefill_ms(unpacked, "target", [32, 8]) == pytest.approx(64 * 4.0)  # the holes computed too
    assert prefill_ms(lat, "draft", [16]) == prefill_ms(flat, "draft", [16])  # not profiled: the decode curves'


def test_a_plan_is_refused_once_its_inputs_change(tmp_path):
    from specrt.errors import BundleError

    b = write_bundle(tmp_path, [[0.9, 0.3]], lambda n: 10.0, lambda n: 0.1)
    tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    write_acceptance(b, [[0.8, 0.3]])  # re-calibrated: the plan was made from the old numbers
    with pytest.raises(BundleError, match="plan.json was made from an earlier acceptance.json.*specrt tune"):
        artifacts.load(b, Plan)
    data = json.loads((b / "plan.json").read_text())
    assert data["stamp"]["inputs"].keys() == {"acceptance.json", "latency.json"}


def test_the_readme_tuning_flow_with_default_threads(demo_bundle, tmp_path):
    """calibrate, profile and tune, then method="auto", all with their defaults (threads=None resolves the
    same way in each), as the README says: a plan was once refused here over `None threads`."""
    import shutil

    from specrt.calibration.acceptance import CalibrationConfig, calibrate
    from specrt.calibration.latency import ProfileConfig, profile
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    calibrate(CalibrationConfig(bundle=b, num_prompts=2, new_tokens=16, max_depth=3, max_rank=3, max_nodes=6,
                                dynamic_sizes=(4,), merged_sizes=(), ngram_sizes=(5,)), progress=False)
    profile(ProfileConfig(bundle=b, batch_sizes=(1,), contexts=(32,), num_tokens=(1, 2, 4, 8), repeats=1, warmup=0,
                          passes=1),
            progress=False)
    tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    pipe = Pipeline.load(b)
    ar = pipe.generate("def f(x):", method="autoregressive", max_new_tokens=12)
    assert pipe.generate("def f(x):", method="auto", max_new_tokens=12).token_ids == ar.token_ids

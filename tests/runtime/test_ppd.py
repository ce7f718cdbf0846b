"""PPD: prompt tokens in the step graph, their training, the sparse trees and the lossless method."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import PromptTokens
from specrt.engines.ppd import PpdConfig, train_prompt_tokens
from specrt.engines.ppd_trees import PathModel, score, sparse_tree
from specrt.errors import BundleError, SpecrtError
from specrt.runtime.drafters.ppd import PROMPT_RANK, build_layout


def test_training_writes_the_tokens_their_graph_and_a_record(ppd_bundle):
    t = artifacts.load(ppd_bundle, PromptTokens)
    assert (t.num_prompt_tokens, t.num_ensemble, t.vocab_size) == (3, 1, 4096)
    emb = np.load(ppd_bundle / t.embeddings)
    assert emb.shape == (3, t.hidden_size) and np.isfinite(emb).all()
    assert t.parity is not None and t.parity < 1e-5  # ordinary ids: the exported graph's logits
    rec = t.training
    assert rec["steps"] == 30 and len(rec["losses"]) == 30 and rec["loss_last"] < rec["loss_first"]
    assert rec["corpus_sha256"] and rec["seed"] == 0 and rec["seconds"] > 0
    assert [tree.budget for tree in t.trees] == [2, 4, 8, 16]
    for tree in t.trees:
        assert tree.rows <= tree.budget and tree.prompts[0] >= 1 and len(tree.prompts) == len(tree.paths) + 1
    acc = np.array(t.accuracy)
    assert acc.shape == (3, 8) and (acc >= 0).all() and acc.sum(axis=1).max() <= 1
    # trained prompt tokens guess distance 2 better than the last position's own logits do
    assert acc[0, 0] > np.array(t.baseline_accuracy)[0, 0]
    # paths measured together: a depth-1 path is distance 2's accuracy at that rank, a path never beats its parent
    joint = {h.path: h.accuracy for h in t.path_accuracy}
    for r in range(8):
        assert joint.get((r,), 0.0) == pytest.approx(acc[0, r], abs=1e-6)
    assert all(0 < p <= joint[path[:-1]] + 1e-9 for path, p in joint.items() if len(path) > 1)
    assert all(path in joint for tree in t.trees for path in tree.paths)  # no candidate that was never right


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_greedy_ppd_is_token_identical_to_autoregressive(ppd_bundle, humaneval, backend):
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(ppd_bundle, backend=backend, threads=2)
    prompts = humaneval[:20]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=24)
    for batch_size, budget in ((1, 8), (4, 16)):  # batch 4: ragged prompts, sequences in different states
        out = pipe.generate(prompts, method="ppd", max_new_tokens=24, batch_size=batch_size, ppd_budget=budget)
        assert [g.token_ids for g in out] == [g.token_ids for g in ar], (batch_size, budget)
    calls = sum(g.stats.target_calls for g in out)
    assert calls < sum(g.stats.target_calls for g in ar)  # some guesses were accepted: fewer target steps


def test_ppd_with_merged_ngram_drafts_is_token_identical_to_autoregressive(ppd_bundle, humaneval):
    """n-gram drafts merged into PPD's tree (no draft model either way): when the accepted path runs on in the
    n-gram tree, PPD shifts its guesses by the tokens accepted there (Verdict.beyond)."""
    from specrt.errors import InvalidRequestError
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(ppd_bundle, threads=2)
    prompts = humaneval[:12]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=32)
    plain = pipe.generate(prompts, method="ppd", max_new_tokens=32, ppd_budget=8)
    for batch_size in (1, 4):
        out = pipe.generate(prompts, method="ppd", max_new_tokens=32, batch_size=batch_size, ppd_budget=8, ngram_tokens=7)
        assert [g.token_ids for g in out] == [g.token_ids for g in ar], batch_size
    assert sum(g.stats.target_calls for g in out) < sum(g.stats.target_calls for g in plain)  # the n-grams add some
    with pytest.raises(InvalidRequestError, match="ngram_tokens merges n-gram drafts .* not with ppd_acceptance"):
        pipe.generate(prompts[0], method="ppd", ngram_tokens=4, ppd_acceptance="typical", temperature=0.7)


def test_on_a_device_backend_guesses_are_ranked_where_the_logits_lie(ppd_bundle, humaneval, monkeypatch):
    """Greedy PPD on the torch backend: verification reads each row's argmax and the next guesses are ranked from
    the prompt tokens' rows where the logits lie (on a GPU, only [rows, top] tokens cross, never [B, T, V] logits);
    every round drafts and accepts what ranking host copies of the same logits gives, alone and merged with n-grams,
    in a ragged batch."""
    import torch

    from specrt.runtime.drafters import ppd
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(ppd_bundle, backend="torch", threads=2)
    prompts = humaneval[:4]
    vocab = pipe.target.entry.vocab_size
    copies, real_cpu, real_rank = [], torch.Tensor.cpu, ppd.ranked_guesses

    def cpu(self, *args, **kw):
        copies.append(tuple(self.shape))
        return real_cpu(self, *args, **kw)

    def run(**kw):
        copies.clear()
        out = pipe.generate(prompts, method="ppd", max_new_tokens=24, batch_size=4, ppd_budget=16, **kw)
        return [(g.token_ids, g.stats.accepted_hist, g.stats.target_calls) for g in out]

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    for kw in ({}, {"ngram_tokens": 5}):
        device = run(**kw)
        assert copies and not any(len(c) and c[-1] >= vocab for c in copies), kw  # no row of logits crossed
        monkeypatch.setattr(ppd, "ranked_guesses", lambda logits, *a: real_rank(real_cpu(logits).numpy(), *a))
        assert run(**kw) == device, kw
        monkeypatch.setattr(ppd, "ranked_guesses", real_rank)


def test_guesses_shift_by_the_tokens_accepted_past_their_owner():
    """A round that accepted `beyond` tokens past PPD's own path (in a merged tree) leaves the owner's guesses of
    distance d + 1 + beyond as the next round's distance d + 1, and none once beyond reaches its prompt tokens."""
    from specrt.runtime.drafters.ppd import PromptTokenDrafter
    from specrt.runtime.verify import Verdict

    vocab = 10
    d = PromptTokenDrafter([], [3], vocab, 3, 1)  # the root and its 3 prompt tokens, nothing else
    d.start([None])
    tree = d.propose([None], None, None)[0]
    assert tree.tokens.tolist() == [10, 11, 12]
    logits = np.zeros((1, 4, vocab + 3))
    for row, guess in ((1, 4), (2, 5), (3, 6)):  # prompt token d (row d) guesses token 3 + d
        logits[0, row, guess] = 1
    for beyond, state, guesses in ((0, 3, [4, 5, 6]), (1, 2, [5, 6]), (3, 0, None)):
        d._layout_of = [d.layouts[3]]
        d.target_logits(logits)
        d.commit([None], [Verdict([], 0, beyond)])
        assert d._state[0] == state
        assert (d._guesses[0] is None) if guesses is None else d._guesses[0][:, 0].tolist() == guesses


def test_sampling_ppd_uses_the_lossless_one_hot_verifier(ppd_bundle):
    from specrt.runtime.methods import Ppd
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.verify import RejectionVerifier

    pipe = Pipeline.load(ppd_bundle, threads=2)
    built = Ppd(ppd_budget=4).build(pipe.method_context(), SamplingParams(temperature=0.8), 1)
    assert isinstance(built.verifier, RejectionVerifier) and built.slack == pipe.prompt_tokens.tree(4).rows + 1
    a, b = (pipe.generate("def f(x):", method="ppd", max_new_tokens=16, temperature=0.8, seed=3, ppd_budget=4)
            for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16 and max(a.token_ids) < 4096


def test_typical_acceptance_emits_only_tokens_that_pass_its_threshold(ppd_bundle):
    """Typical acceptance is not lossless, but every token it emits, accepted guess or bonus, passes Medusa's
    threshold under the target's own (teacher-forced) distribution at its position; rejection sampling at the
    same temperature emits tokens below it."""
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams, warp
    from specrt.runtime.step_inputs import pack_step
    from specrt.runtime.verify import TypicalVerifier

    pipe = Pipeline.load(ppd_bundle, threads=2)
    params, check = SamplingParams(temperature=1.0), TypicalVerifier(0.09, 0.3)
    prompt = pipe.encode("def fibonacci(n):")

    def below_threshold(acceptance):
        [out] = pipe.generate([prompt], method="ppd", max_new_tokens=48, temperature=1.0, seed=5, ppd_budget=8,
                              ppd_acceptance=acceptance)
        ids = np.array(prompt + out.token_ids[:-1])
        with pipe.target.runner() as r:  # one teacher-forced step over the prompt and the output
            cache = r.new_cache(1)
            logits = r.step(*pack_step(cache, [ids], [np.arange(len(ids))]), cache)[0][0]
        p = warp(logits[len(prompt) - 1:], params)
        passes = p[np.arange(len(out.token_ids)), out.token_ids] > check.thresholds(p)
        return int((~passes).sum()), out

    misses, typical = below_threshold("typical")
    assert misses == 0 and len(typical.token_ids) == 48
    assert typical.stats.target_calls < 48  # guesses were accepted
    assert below_threshold("exact")[0] > 0  # the lossless sampler does emit unlikely tokens


def test_typical_acceptance_is_refused_where_it_does_not_apply(ppd_bundle):
    from specrt.errors import InvalidRequestError
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(ppd_bundle, threads=2)
    with pytest.raises(InvalidRequestError, match="temperature > 0"):
        pipe.generate("def f(x):", method="ppd", max_new_tokens=4, ppd_acceptance="typical")
    with pytest.raises(InvalidRequestError, match="typical_delta apply to typical acceptance"):
        pipe.generate("def f(x):", method="ppd", max_new_tokens=4, temperature=0.5, typical_delta=0.5)
    with pytest.raises(InvalidRequestError, match="ppd_acceptance must be one of"):
        pipe.generate("def f(x):", method="ppd", max_new_tokens=4, ppd_acceptance="loose")


def test_both_backends_compute_the_same_prompt_token_logits(ppd_bundle):
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.step_inputs import pack_step

    outs = []
    for backend in ("ort", "torch"):
        pipe = Pipeline.load(ppd_bundle, backend=backend, threads=2)
        with pipe.target.runner() as r:
            cache = r.new_cache(1)
            ids, pos, mask = pack_step(cache, [np.array([5, 17, 4096, 4097, 4098])], [np.arange(5)])
            outs.append(r.step(ids, pos, mask, cache)[0])
    assert np.isfinite(outs[0]).all() and np.abs(outs[0] - outs[1]).max() < 1e-3


def test_layout_is_the_ensemble_mask_and_prompt_ids_by_distance_and_ept():
    # root carries 2 prompt tokens, candidate (0,) 1, candidate (1,) none; 2 EPTs; state 1 (depth-1 candidates)
    layout = build_layout([(0,), (1,)], [2, 1, 0], state=1, vocab=100, num_ensemble=2)
    spec = layout.spec
    assert len(spec) == 2 + 2 * 2 + 1 * 2  # candidates + root's 2 x 2 EPTs + (0,)'s 1 x 2 EPTs
    root_chain = layout.owners[-1]  # [distance, EPT]
    assert root_chain.shape == (2, 2) and layout.tokens[root_chain].tolist() == [[100, 101], [102, 103]]
    mask = spec.row_mask
    d2_e0, d1_e0, d1_e1 = root_chain[1, 0] + 1, root_chain[0, 0] + 1, root_chain[0, 1] + 1
    assert mask[d2_e0, d1_e0] and not mask[d2_e0, d1_e1]  # EPT 0 of distance 2 sees EPT 0 of distance 1 only
    cand0 = next(int(n) for n, d, r in layout.candidates if r == 0)
    own = layout.owners[cand0]
    assert mask[own[0, 1] + 1, cand0 + 1] and not mask[own[0, 1] + 1, d1_e0]  # below its candidate, not the root's chain
    assert spec.row_depths[own[0, 0] + 1] == 2 and spec.paths[own[0, 1]] == (0, PROMPT_RANK + 1)
    # state 0: no candidates, only the root's prompt tokens
    assert len(build_layout([(0,), (1,)], [2, 1, 0], state=0, vocab=100, num_ensemble=2).candidates) == 0


def test_steady_state_score_by_hand():
    # one candidate accepted half the time; both carry one prompt token: every round is in state 1
    r, rows = score(PathModel([[0.5]]), [(0,)], [1, 1], e=1)
    assert r == pytest.approx(0.5) and rows == pytest.approx(3.0)
    # the candidate carries none: after accepting it, the next round has no candidates (state 0), then state 1
    # again; pi = (1/3, 2/3), R = 2/3 * 0.5
    r, rows = score(PathModel([[0.5]]), [(0,)], [1, 0], e=1)
    assert r == pytest.approx(1 / 3) and rows == pytest.approx(1 / 3 * 1 + 2 / 3 * 2)


def test_sparse_trees_hold_their_budget_and_grow_with_it():
    p = PathModel([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]])
    trees = [sparse_tree(p, b, e=1) for b in (2, 4, 8, 16, 32)]
    assert all(t.rows <= t.budget for t in trees)
    values = [t.expected_accepted for t in trees]
    assert values == sorted(values) and values[-1] > values[0]
    # two EPTs cost two rows per prompt token: less fits the same budget
    assert sparse_tree(p, 8, e=2).expected_accepted <= trees[2].expected_accepted
    with pytest.raises(SpecrtError, match="no PPD tree fits"):
        sparse_tree(p, 1, e=2)


def test_sparse_trees_follow_the_paths_measured_together():
    """Distance 3's guess is right as often as distance 2's, but never in the same round: as a product the table
    makes (0, 0) a good candidate; measured together it is worthless and the budget goes to depth-1 ranks."""
    table = [[0.4, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05]]
    joint = {(0,): 0.4, (1,): 0.2, (2,): 0.1, (3,): 0.05, (1, 0): 0.02}
    alone, together = PathModel(table), PathModel(table, joint)
    assert alone((0, 0)) == pytest.approx(0.16) and together((0, 0)) == 0 and together(()) == 1
    assert (0, 0) in sparse_tree(alone, 8, e=1).paths
    tree = sparse_tree(together, 8, e=1)
    assert (0, 0) not in tree.paths and all(p in joint for p in tree.paths)
    # what each model predicts for the other's tree: the product over-rates the tree built from it
    naive = sparse_tree(alone, 8, e=1)
    assert score(together, list(naive.paths), list(naive.prompts), 1)[0] < naive.expected_accepted
    # a rank that is never right is never a candidate, even where the budget has room
    assert len(sparse_tree(PathModel([[0.5, 0.0]], {(0,): 0.5}), 16, e=1).paths) == 1


def test_prompt_tokens_serve_an_inflated_target_zero_padded(ppd_bundle, tmp_path):
    from specrt.checkpoints import DEMO_DIR
    from specrt.checkpoints.inflate import InflateConfig, inflate
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    inflate(InflateConfig(src=DEMO_DIR / "target", out=tmp_path / "t", hidden_size=384, intermediate_size=1024,
                          num_layers=3, num_heads=6, device="cpu"))
    big = tmp_path / "big"
    export_bundle(ExportConfig(target=tmp_path / "t", draft=DEMO_DIR / "draft", out=big, tokenizer=DEMO_DIR / "tokenizer",
                               exporter="torchscript"), progress=False)
    t = train_prompt_tokens(PpdConfig(bundle=big, prompts_from=ppd_bundle, val_windows=8, budgets=(4, 8)), progress=False)
    small = artifacts.load(ppd_bundle, PromptTokens)
    emb = np.load(big / t.embeddings)
    assert emb.shape == (3, 384) and not emb[:, small.hidden_size:].any()
    assert t.training["from_sha256"] == small.embeddings_sha256
    np.testing.assert_allclose(t.accuracy, small.accuracy, atol=0.02)  # the same function guesses the same
    pipe, ref = Pipeline.load(big, threads=2), Pipeline.load(ppd_bundle, threads=2)
    prompt = "def fib(n):"
    a = pipe.generate(prompt, method="ppd", max_new_tokens=24, ppd_budget=8)
    assert a.token_ids == ref.generate(prompt, method="ppd", max_new_tokens=24, ppd_budget=8).token_ids
    assert a.stats.target_calls == ref.generate(prompt, method="ppd", max_new_tokens=24, ppd_budget=8).stats.target_calls


def test_a_16_bit_bundle_without_onnx_takes_prompt_tokens_from_a_float_one(ppd_bundle, fp16_bundle, tmp_path, humaneval):
    """The GPU bundles (float16, --no-onnx) cannot train prompt tokens, but take those of the float32 target they
    copy, measured in float32 on --device; PPD then decodes AR's tokens on the torch backend. A 16-bit bundle with
    ONNX graphs is refused (its prompt-token graph would need them in its dtype)."""
    from specrt.checkpoints import DEMO_DIR
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "fp16"
    export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", out=b, tokenizer=DEMO_DIR / "tokenizer",
                               dtype="float16", onnx=False), progress=False)
    t = train_prompt_tokens(PpdConfig(bundle=b, prompts_from=ppd_bundle, val_windows=8, budgets=(4, 8), device="cpu"),
                            progress=False)
    small = artifacts.load(ppd_bundle, PromptTokens)
    assert t.graph is None and t.training["from_sha256"] == small.embeddings_sha256
    np.testing.assert_allclose(t.accuracy, small.accuracy, atol=0.02)  # measured in float32: the same function
    pipe = Pipeline.load(b, backend="torch", device="cpu", threads=2)
    prompts = humaneval[:2]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=16)]
    assert [o.token_ids for o in pipe.generate(prompts, method="ppd", max_new_tokens=16, ppd_budget=8)] == ar
    with pytest.raises(SpecrtError, match="train PPD's prompt tokens on a float32 export \\(a float16 export without "
                                          "ONNX graphs, --no-onnx, can take them with --prompts-from\\)"):
        train_prompt_tokens(PpdConfig(bundle=fp16_bundle, prompts_from=ppd_bundle), progress=False)


def test_ppd_refuses_with_the_command_that_makes_what_is_missing(demo_bundle, ppd_bundle, tmp_path):
    from specrt.runtime.pipeline import Pipeline

    with pytest.raises(BundleError, match="has no PPD prompt tokens: run `specrt ppd train --bundle"):
        Pipeline.load(demo_bundle, threads=2).generate("x", method="ppd", max_new_tokens=2)
    b = tmp_path / "b"
    shutil.copytree(ppd_bundle, b)
    t = artifacts.load(b, PromptTokens)
    (b / t.graph).write_bytes((b / t.graph).read_bytes() + b"x")
    pipe = Pipeline.load(b, threads=2)  # other methods still load and run
    assert pipe.generate("x", method="autoregressive", max_new_tokens=2).token_ids
    with pytest.raises(BundleError, match="changed since `specrt ppd train` wrote it"):
        pipe.generate("x", method="ppd", max_new_tokens=2)
    artifacts.save(b, replace(t, num_ensemble=2))
    with pytest.raises(SpecrtError, match="has 3 prompt tokens x 2 EPTs: pass --num-prompt-tokens 3 --num-ensemble 2"):
        train_prompt_tokens(PpdConfig(bundle=demo_bundle, prompts_from=b), progress=False)


def test_tune_weighs_ppd_and_auto_runs_it_where_it_pays(ppd_bundle, tmp_path, humaneval):
    from specrt.calibration.tune import TuneConfig, tune
    from specrt.runtime.methods import Auto, Ppd
    from specrt.runtime.pipeline import Pipeline
    from tests.fakes import write_acceptance, write_latency

    b = tmp_path / "b"
    shutil.copytree(ppd_bundle, b)
    tokens = artifacts.load(b, PromptTokens)
    # a step costs the same for any token count, the draft model as much as the target, and the draft is never
    # right: drafting never pays, PPD's free guesses do
    write_latency(b, lambda n: 10.0, lambda n: 10.0, max_tokens=32)
    write_acceptance(b, [[0.01, 0.01]] * 4)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    best = plan.choices[1].best
    assert plan.choices[1].method == "ppd" and best.kind == "ppd" and "ppd.json" in plan.stamp.inputs
    # among the PPD trees, the flat latency makes the one accepting the most per round the fastest
    assert best.num_nodes == max(tokens.trees, key=lambda t: t.expected_accepted).budget
    pipe = Pipeline.load(b, threads=2)
    assert Auto().resolve(pipe.method_context(), 1) == Ppd(ppd_budget=best.num_nodes)
    assert pipe.evidence.ppd_tree(pipe.prompt_tokens, 1).budget == best.num_nodes  # method="ppd" without a budget: the same choice
    ar = pipe.generate(humaneval[:3], method="autoregressive", max_new_tokens=16)
    assert [g.token_ids for g in pipe.generate(humaneval[:3], method="auto", max_new_tokens=16)] == [g.token_ids for g in ar]
    # the plan is refused once the prompt tokens it weighed change
    artifacts.save(b, replace(tokens, trees=tokens.trees[:1]))
    with pytest.raises(BundleError, match="made from an earlier ppd.json"):
        pipe.evidence.plan()


def test_calibrate_decodes_ppd_trees_and_the_tuner_and_tree_choice_weigh_what_it_measured(ppd_bundle, demo_bundle,
                                                                                           tmp_path):
    """`specrt calibrate` measures PPD's sparse trees by decoding its prompts (what decoding those prompts with each
    tree accepts, exactly); the tuner and PPD's own tree choice then weigh only the measured trees, with the
    measured acceptance and rows, until the prompt tokens or their trees change."""
    from specrt.calibration.acceptance import CalibrationConfig, calibrate
    from specrt.calibration.tune import TuneConfig, tune
    from specrt.checkpoints.corpus import validation_prompts
    from specrt.runtime.pipeline import Pipeline
    from tests.fakes import measured_tree, write_acceptance, write_latency

    b = tmp_path / "b"
    shutil.copytree(ppd_bundle, b)
    tokens = artifacts.load(b, PromptTokens)
    acc = calibrate(CalibrationConfig(bundle=b, threads=2, num_prompts=2, new_tokens=16, max_depth=2, max_rank=2,
                                      max_nodes=3, dynamic_sizes=(), merged_sizes=(), ngram_sizes=(), ppd_budgets=(8, 2)),
                    progress=False)
    assert [m.num_nodes for m in acc.measured["ppd"]] == [2, 8] and acc.ppd_source == tokens.identity()
    pipe = Pipeline.load(b, threads=2)
    prompts = validation_prompts(pipe.encode, 2, 64, 0)
    for m in acc.measured["ppd"]:
        stats = [g.stats for g in (pipe.generate([p], method="ppd", ppd_budget=m.num_nodes, max_new_tokens=16)[0]
                                   for p in prompts)]
        rounds = sum(st.rounds for st in stats)
        assert m.expected_accepted == round(sum(st.accepted for st in stats) / rounds, 6)
        assert m.nodes_per_round == round(sum(st.drafted for st in stats) / rounds, 4) <= m.num_nodes
        assert m.accepted_interval is not None and len(m.accepted_by_position) == 1
        assert m.width == len(tokens.tree(m.num_nodes).paths)
    assert acc.ppd_measured(tokens) == {m.num_nodes: m for m in acc.measured["ppd"]}
    small = dict(bundle=b, threads=2, num_prompts=1, new_tokens=8, max_depth=2, max_rank=2, max_nodes=3,
                 dynamic_sizes=(), merged_sizes=(), ngram_sizes=())
    every = calibrate(CalibrationConfig(**small), progress=False)  # by default, every tree ppd train built
    assert [m.num_nodes for m in every.measured["ppd"]] == [t.budget for t in tokens.trees]
    none = calibrate(CalibrationConfig(**small, ppd_budgets=()), progress=False)
    assert ("ppd" in none.measured, none.ppd_source, none.ppd_measured(tokens)) == (False, None, {})
    with pytest.raises(SpecrtError, match=r"--ppd-budgets 2,5: `specrt ppd train` built trees of 2, 4, 8, 16 rows"):
        calibrate(CalibrationConfig(**small, ppd_budgets=(2, 5)), progress=False)  # before decoding anything
    with pytest.raises(SpecrtError, match="has no PPD prompt tokens: run `specrt ppd train"):
        calibrate(CalibrationConfig(**{**small, "bundle": demo_bundle}, ppd_budgets=(2,)), progress=False)

    # measured acceptance against the table: the table favours the larger tree (a flat latency: more accepted is
    # faster); measured, the 2-row tree accepts more
    write_latency(b, lambda n: 10.0, lambda n: 10.0, max_tokens=32)
    table = {t.budget: t.expected_accepted for t in tokens.trees}
    assert table[8] > table[2]
    two, eight = measured_tree(2, 1, 1, table[8] + 0.2, 0.0, per_round=1.5), measured_tree(8, 3, 2, table[8], 0.0, per_round=6.0)
    write_acceptance(b, [[0.01, 0.01]] * 4, ppd=(two, eight), ppd_source=tokens.identity())
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    ppd_rows = {r.num_nodes: r for r in plan.curves[1] if r.kind == "ppd"}
    assert sorted(ppd_rows) == [2, 8] and ppd_rows[2].expected_accepted == pytest.approx(table[8] + 0.2)
    assert (plan.choices[1].method, plan.choices[1].best.num_nodes) == ("ppd", 2)
    pipe = Pipeline.load(b, threads=2)
    assert pipe.evidence.ppd_tree(pipe.prompt_tokens, 1).budget == 2
    # trees rebuilt (or the tokens trained again) since: the measurements no longer apply, the table decides
    artifacts.save(b, replace(tokens, trees=tuple(replace(t, expected_accepted=t.expected_accepted + 1e-3)
                                                  for t in tokens.trees)))
    pipe = Pipeline.load(b, threads=2)
    assert pipe.evidence.acceptance().ppd_measured(pipe.prompt_tokens) == {}
    assert pipe.evidence.ppd_tree(pipe.prompt_tokens, 1).budget == max(tokens.trees, key=lambda t: t.expected_accepted).budget

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
    assert [m.num_nodes for m in acc.ppd] == [2, 8] and acc.ppd_source == tokens.identity()
    pipe = Pipeline.load(b, threads=2)
    prompts = validation_prompts(pipe.encode, 2, 64, 0)
    for m in acc.ppd:
        stats = [g.stats for g in (pipe.generate([p], method="ppd", ppd_budget=m.num_nodes, max_new_tokens=16)[0]
                                   for p in prompts)]
        rounds = sum(st.rounds for st in stats)
        assert m.expected_accepted == round(sum(st.accepted for st in stats) / rounds, 6)
        assert m.nodes_per_round == round(sum(st.drafted for st in stats) / rounds, 4) <= m.num_nodes
        assert m.accepted_interval is not None and len(m.accepted_by_position) == 1
        assert m.width == len(tokens.tree(m.num_nodes).paths)
    assert acc.ppd_measured(tokens) == {m.num_nodes: m for m in acc.ppd}
    small = dict(bundle=b, threads=2, num_prompts=1, new_tokens=8, max_depth=2, max_rank=2, max_nodes=3,
                 dynamic_sizes=(), merged_sizes=(), ngram_sizes=())
    every = calibrate(CalibrationConfig(**small), progress=False)  # by default, every tree ppd train built
    assert [m.num_nodes for m in every.ppd] == [t.budget for t in tokens.trees]
    none = calibrate(CalibrationConfig(**small, ppd_budgets=()), progress=False)
    assert (none.ppd, none.ppd_source, none.ppd_measured(tokens)) == ((), None, {})
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


def test_a_prompt_token_graph_that_changes_ordinary_logits_is_refused(demo_bundle, tmp_path, monkeypatch):
    import onnx
    from onnx import numpy_helper

    from specrt.graphs import passes

    real = passes.add_prompt_embeddings

    def wrong(src, dest, prompts):  # a pass that also disturbs the ordinary rows of the table
        real(src, dest, prompts)
        model = onnx.load(str(dest))
        for i, init in enumerate(model.graph.initializer):
            if init.name == "ppd.embed_tokens_with_prompts":
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
        onnx.save_model(model, str(dest))

    monkeypatch.setattr(passes, "add_prompt_embeddings", wrong)
    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    with pytest.raises(SpecrtError, match="gives other logits for ordinary ids"):
        train_prompt_tokens(PpdConfig(bundle=b, steps=1, val_windows=2, budgets=(4,)), progress=False)
    assert not (b / "target-ppd.onnx").exists() and not (b / PromptTokens.FILE).exists()


def test_the_step_looks_prompt_tokens_up_without_copying_the_embedding_table():
    """Ids >= V are prompt tokens: their rows, and the ordinary rows of every other id, as one table [V + P, hidden]
    would give them; but no step copies the vocabulary's embeddings into such a table (on a 7B-class target in
    float16 that would be ~0.25 GB moved each step)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from specrt.checkpoints import DEMO_DIR
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    hf = load_checkpoint(DEMO_DIR / "target", "float32", "cpu")
    table = hf.model.embed_tokens.weight.detach().clone()
    vocab, hidden = table.shape
    prompts = torch.randn(3, hidden)
    module = StepModule(hf, prompts).eval()
    ids = torch.tensor([[5, vocab, 7, vocab + 2], [vocab + 1, 0, vocab - 1, 9]])

    class Sizes(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Sizes.largest = max(Sizes.largest, t.numel())
            return out

    with torch.no_grad(), Sizes():
        got = module.embed(ids)
    assert torch.equal(got, torch.cat([table, prompts])[ids])
    assert Sizes.largest < table.numel()  # fails when the step concatenates the tables: checked


def test_guess_accuracy_is_scored_against_the_targets_own_greedy_continuation():
    """PPD's guesses are verified against the target's argmax after its own tokens, so the accuracy tables (and the
    trees built from them) score guesses on greedy continuations of held-out windows, not on the text."""
    import torch

    from specrt.checkpoints import DEMO_DIR
    from specrt.engines.ppd import greedy_windows
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    module = StepModule(load_checkpoint(DEMO_DIR / "target", "float32", "cpu")).eval()
    windows = np.random.default_rng(0).integers(0, 4096, (3, 24))
    g = greedy_windows(module, windows.tolist(), 12, batch=2)
    assert g.shape == (3, 24) and (g[:, :12] == windows[:, :12]).all()
    assert (g[:, 12:] != windows[:, 12:]).any()
    # teacher-forced over whole windows, each token of the second half is the argmax after the tokens before it
    past = [torch.zeros(3, module.num_kv_heads, 0, module.head_dim) for _ in range(2 * module.num_layers)]
    with torch.no_grad():
        logits = module(torch.from_numpy(g), torch.arange(24).expand(3, 24),
                        torch.ones(3, 24, 24, dtype=torch.bool).tril(), *past)[0]
    assert (logits[:, 11:-1].argmax(-1).numpy() == g[:, 12:]).all()


def test_the_own_corpus_trains_on_the_targets_greedy_continuations_of_training_prompts(demo_bundle):
    """corpus "own": each window is the last quarter-window of a mixed training prompt and the target's own greedy
    tokens after it (what decoding reads), never a validation prompt."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from specrt.checkpoints import DEMO_DIR
    from specrt.checkpoints.prompt_mix import mixed_prompts
    from specrt.engines.ppd import PpdConfig, greedy_windows, training_windows
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    module = StepModule(load_checkpoint(DEMO_DIR / "target", "float32", "cpu")).eval()
    tokenizer = Tokenizer.from_file(str(demo_bundle / "tokenizer" / "tokenizer.json"))
    encode = (lambda text: tokenizer.encode(text).ids)
    cfg = PpdConfig(bundle=demo_bundle, corpus="own", window=32, batch_size=2)
    windows = np.array(training_windows(cfg, module, demo_bundle / "tokenizer", encode))
    assert windows.shape == (64, 32)
    assert (greedy_windows(module, windows.tolist(), 8) == windows).all()  # past 8 prompt tokens: the target's own
    train = {tuple(encode(p.text)[-8:]) for p in mixed_prompts(AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer"),
                                                               128, "train")}
    assert {tuple(w[:8]) for w in windows.tolist()} <= train
    stdlib = np.array(training_windows(PpdConfig(bundle=demo_bundle, window=32, batch_size=2), module,
                                       demo_bundle / "tokenizer", encode))
    assert stdlib.shape == (64, 32) and (greedy_windows(module, stdlib.tolist(), 8) != stdlib).any()


def test_ppd_runs_on_the_in_graph_kv_update_too_and_says_when_it_is_newer(inplace_bundle, ppd_bundle, humaneval,
                                                                           tmp_path):
    """Prompt tokens trained on a bundle with `specrt inplace`'s graphs get an in-graph twin of the target graph:
    ppd then runs with kv_update="inplace", token-identical to AR; in-graph graphs made after them are refused, saying
    what to re-run."""
    from specrt.export.inplace import InPlaceConfig, in_place
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(inplace_bundle, b)
    t = train_prompt_tokens(PpdConfig(bundle=b, prompts_from=ppd_bundle, val_windows=4, budgets=(4, 8)),
                            progress=False)
    assert t.inplace_graph == "inplace/target-ppd.onnx" and (b / t.inplace_graph).is_file()
    pipe = Pipeline.load(b, kv_update="inplace", threads=2)
    ar = pipe.generate(humaneval[:3], method="autoregressive", max_new_tokens=32)
    for batch_size in (1, 3):
        got = pipe.generate(humaneval[:3], method="ppd", max_new_tokens=32, batch_size=batch_size)
        assert [o.token_ids for o in got] == [o.token_ids for o in ar], batch_size
    assert sum(o.stats.rounds for o in got) < 3 * 32  # guesses were accepted
    late = tmp_path / "late"  # prompt tokens trained first, then `specrt inplace`: they have no in-graph twin
    shutil.copytree(ppd_bundle, late)
    in_place(InPlaceConfig(bundle=late), progress=False)
    with pytest.raises(BundleError, match="newer than its PPD prompt tokens"):
        Pipeline.load(late, kv_update="inplace", threads=2).generate(humaneval[0], method="ppd", max_new_tokens=4)


def test_accuracy_is_measured_on_your_own_prompts(ppd_bundle, tmp_path):
    """--prompts: the validation windows end in the user's prompts (no training: --prompts-from), the file's hash is
    recorded, and too few prompts long enough for the window are refused in one line."""
    import json

    from specrt.bench.prompts import humaneval_prompts
    from specrt.bundle.manifest import sha256_file

    b = tmp_path / "b"
    shutil.copytree(ppd_bundle, b)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in humaneval_prompts(20)[10:]))
    cfg = PpdConfig(bundle=b, prompts_from=ppd_bundle, prompts=prompts, val_windows=6, window=64, budgets=(4,))
    t = train_prompt_tokens(cfg, progress=False)
    assert t.training["validation"] == {"prompts_sha256": sha256_file(prompts)}
    assert t.accuracy != artifacts.load(ppd_bundle, PromptTokens).accuracy  # other text, other accuracy
    assert "corpus_sha256" in artifacts.load(ppd_bundle, PromptTokens).training["validation"]
    with pytest.raises(SpecrtError, match="has 10 prompt\\(s\\) of at least 32 tokens \\(--window 64 / 2\\); "
                                          "--val-windows asks for 11"):
        train_prompt_tokens(replace(cfg, val_windows=11), progress=False)
    # each window: the prompt's last --window / 2 tokens, then --max-new-tokens for the target's own continuation
    from tokenizers import Tokenizer

    from specrt.engines.ppd import validation_windows

    encode = Tokenizer.from_file(str(b / "tokenizer" / "tokenizer.json")).encode
    windows = validation_windows(replace(cfg, new_tokens=40), lambda text: encode(text).ids)
    long_enough = [ids for ids in (encode(p).ids for p in humaneval_prompts(20)[10:]) if len(ids) >= 32]
    assert [w[:32] for w in windows] == [ids[-32:] for ids in long_enough[:6]] and {len(w) for w in windows} == {72}


def test_prompt_rows_join_a_table_whose_data_file_has_several_hard_links(tmp_path):
    """onnx's own external-data reader refuses a data file with several hard links (a bundle copied with `cp -al`);
    the graph pass reads the table itself, and the new graph shares the data file."""
    import os

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specrt.graphs.passes import add_prompt_embeddings

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "input_ids"], ["logits"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 4])],
                              [numpy_helper.from_array(table, "table")])
    src = tmp_path / "target.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src),
                    save_as_external_data=True, location="target.onnx.data", size_threshold=0)
    os.link(tmp_path / "target.onnx.data", tmp_path / "linked.data")
    extra = np.full((2, 4), -1.0, dtype=np.float32)
    add_prompt_embeddings(src, tmp_path / "target-ppd.onnx", extra)
    session = ort.InferenceSession(str(tmp_path / "target-ppd.onnx"), providers=["CPUExecutionProvider"])
    out = session.run(["logits"], {"input_ids": np.array([3, 10, 11])})[0]
    assert (out == np.concatenate([table[3:4], extra])).all()

"""End-to-end greedy equality and API behaviour on the committed demo pair."""

from collections import Counter

import numpy as np
import pytest

BACKENDS = ["ort", "torch"]


def test_sd_is_token_identical_to_autoregressive(pipelines, humaneval):
    pipe = pipelines["ort"]
    ar = pipe.generate(humaneval, method="autoregressive", max_new_tokens=48)
    sd = pipe.generate(humaneval, method="sd", max_new_tokens=48, num_draft_tokens=4)
    assert len(humaneval) >= 20
    for i, (a, s) in enumerate(zip(ar, sd)):
        assert a.token_ids == s.token_ids, f"prompt {i} differs"
    accepted = sum(s.stats.mean_accepted for s in sd) / len(sd)
    assert accepted > 0.5  # the drafts really were accepted, so the equality is not vacuous


def test_tree_is_token_identical_to_autoregressive(pipelines, humaneval):
    pipe = pipelines["ort"]
    ar = pipe.generate(humaneval, method="autoregressive", max_new_tokens=48)
    tree = pipe.generate(humaneval, method="tree", max_new_tokens=48)
    chain = pipe.generate(humaneval, method="sd", max_new_tokens=48, num_draft_tokens=4)
    for i, (a, t) in enumerate(zip(ar, tree)):
        assert a.token_ids == t.token_ids, f"prompt {i} differs"
    per_call = [sum(len(o.token_ids) for o in outs) / sum(o.stats.rounds for o in outs) for outs in (tree, chain)]
    assert per_call[0] > per_call[1]  # the tree's extra branches do get accepted


def test_lossless_methods_on_the_torch_backend(pipelines, humaneval):
    """Every lossless method (the ORT tests above and in test_merge, test_ngram and test_mtad, on fewer
    prompts) is token-identical to autoregressive decoding on the torch backend too."""
    pipe = pipelines["torch"]
    prompts = humaneval[:8]
    ar = [a.token_ids for a in pipe.generate(prompts, method="autoregressive", max_new_tokens=32)]
    runs = {"sd": dict(method="sd", num_draft_tokens=4), "tree": dict(method="tree"),
            "dynamic": dict(method="dynamic", batch_size=4), "anpd": dict(method="anpd"),
            "anpd-tree": dict(method="anpd", ngram_branches=3, num_draft_tokens=8),
            "merged": dict(method="dynamic", num_draft_tokens=6, ngram_tokens=7, batch_size=3),
            "mtad tau=1": dict(method="mtad", tau=1.0)}
    for name, kw in runs.items():
        assert [o.token_ids for o in pipe.generate(prompts, max_new_tokens=32, **kw)] == ar, name


def test_tree_ragged_batch_and_custom_spec(pipelines, humaneval):
    pipe = pipelines["ort"]
    paths = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    ar = pipe.generate(humaneval[:5], method="autoregressive", max_new_tokens=32)
    tree = pipe.generate(humaneval[:5], method="tree", tree=paths, max_new_tokens=32, batch_size=5)
    assert [a.token_ids for a in ar] == [t.token_ids for t in tree]
    assert all(t.stats.draft_calls == 3 * t.stats.rounds + 1 for t in tree)  # levels fed: root, d1, d2


def test_self_draft_tree_accepts_the_whole_best_path(self_draft_bundle, humaneval):
    from specrt.runtime.methods import DEFAULT_TREE
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(self_draft_bundle, threads=2)
    ar = pipe.generate(humaneval[:3], method="autoregressive", max_new_tokens=40)
    tree = pipe.generate(humaneval[:3], method="tree", max_new_tokens=40)
    depth = max(len(p) for p in DEFAULT_TREE)
    for a, t in zip(ar, tree):
        assert a.token_ids == t.token_ids
        assert set(t.stats.accepted_hist) == {depth}


def test_tree_sampling_is_seeded(pipelines, humaneval):
    pipe = pipelines["ort"]
    kw = dict(method="tree", max_new_tokens=24, temperature=0.8, top_p=0.95)
    assert pipe.generate(humaneval[2], seed=3, **kw).token_ids == pipe.generate(humaneval[2], seed=3, **kw).token_ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_matches_batch_of_one(pipelines, humaneval, backend):
    pipe, prompts = pipelines[backend], humaneval[:5]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=32)
    sd = pipe.generate(prompts, method="sd", max_new_tokens=32, batch_size=5, num_draft_tokens=3)
    assert [a.token_ids for a in ar] == [s.token_ids for s in sd]


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_batches_match_batch_of_one(pipelines, humaneval, backend, monkeypatch):
    """EMS-SD's vanilla baseline (padded=True) on the real pair: the same tokens; and padding slots left
    visible to attention (a mutation) do change them, so the mask is what keeps them out."""
    from specrt.runtime.kv_cache import KVCache

    pipe = pipelines[backend]
    prompts = humaneval[:5]
    ar = [a.token_ids for a in pipe.generate(prompts, method="autoregressive", max_new_tokens=24)]
    for method in ("sd", "anpd"):
        out = pipe.generate(prompts, method=method, max_new_tokens=24, batch_size=4, padded=True)
        assert [o.token_ids for o in out] == ar and sum(o.stats.padded for o in out) > 0
    real = KVCache.pad_to

    def visible(self, length):
        added = real(self, length)
        self.valid[:] = True
        return added

    monkeypatch.setattr(KVCache, "pad_to", visible)
    out = pipe.generate(prompts, method="sd", max_new_tokens=24, batch_size=4, padded=True)
    assert [o.token_ids for o in out] != ar

def test_backends_agree(pipelines, humaneval):
    outs = [pipelines[b].generate(humaneval[:4], method="autoregressive", max_new_tokens=32) for b in BACKENDS]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_self_draft_accepts_everything(self_draft_bundle, humaneval):
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(self_draft_bundle, threads=2)
    ar = pipe.generate(humaneval[:3], method="autoregressive", max_new_tokens=37)
    sd = pipe.generate(humaneval[:3], method="sd", max_new_tokens=37, num_draft_tokens=4)
    for a, s in zip(ar, sd):
        assert a.token_ids == s.token_ids
        assert s.stats.accepted_hist.keys() == {4}  # every round accepted all four drafts


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_bundle_sd_is_token_identical(fp16_bundle, humaneval, backend):
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(fp16_bundle, backend=backend, threads=2)
    assert pipe.target.entry.dtype == "float16"
    ar = pipe.generate(humaneval[:6], method="autoregressive", max_new_tokens=32)
    sd = pipe.generate(humaneval[:6], method="sd", max_new_tokens=32)
    assert [a.token_ids for a in ar] == [s.token_ids for s in sd]


def test_stops_exactly_at_max_new_tokens(pipelines, humaneval):
    for n in (1, 2, 5, 7):
        out = pipelines["ort"].generate(humaneval[0], method="sd", max_new_tokens=n)
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stops_at_eos(pipelines):
    pipe = pipelines["ort"]
    eos = pipe.eos_id
    # a prompt that ends a file: the demo model was trained with EOS after every file
    out = pipe.generate("if __name__ == '__main__':\n    main()\n", method="sd", max_new_tokens=200)
    ar = pipe.generate("if __name__ == '__main__':\n    main()\n", method="autoregressive", max_new_tokens=200)
    assert out.token_ids == ar.token_ids
    if eos in out.token_ids:
        assert out.token_ids[-1] == eos and out.token_ids.count(eos) == 1 and out.finish_reason == "eos"
    else:
        pytest.skip("the demo model did not emit EOS within 200 tokens for this prompt")


def test_stream_concatenates_to_generate(pipelines, humaneval):
    pipe = pipelines["ort"]
    pieces = list(pipe.stream(humaneval[1], max_new_tokens=40))
    assert len(pieces) > 1
    assert "".join(pieces) == pipe.generate(humaneval[1], max_new_tokens=40).text


def test_sampling_is_seeded_and_lossless_methods_share_the_rng_contract(pipelines, humaneval):
    pipe = pipelines["ort"]
    kw = dict(method="sd", max_new_tokens=24, temperature=0.8, top_k=50, top_p=0.95)
    a = pipe.generate(humaneval[2], seed=7, **kw)
    b = pipe.generate(humaneval[2], seed=7, **kw)
    c = pipe.generate(humaneval[2], seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stats_are_consistent(pipelines, humaneval):
    out = pipelines["ort"].generate(humaneval[3], method="sd", max_new_tokens=40, num_draft_tokens=4)
    s = out.stats
    hist = {int(k): v for k, v in s.accepted_hist.items()}
    assert sum((k + 1) * v for k, v in hist.items()) >= len(out.token_ids)  # emitted = accepted + bonus per round
    assert s.target_calls == s.rounds + 1  # + prefill
    assert s.draft_calls == 4 * s.rounds + 1
    assert all(v >= 0 for v in vars(s.seconds).values())
    data = s.as_dict()  # the JSON form benches and users record
    assert (data["rounds"], data["drafted"], data["accepted_hist"]) == (s.rounds, s.drafted, dict(sorted(s.accepted_hist.items())))
    assert data["seconds"]["total"] == s.seconds.total and data["draft_hit_ratio"] == pytest.approx(s.accepted / s.drafted)
    assert s.drafted_hist == {4: s.rounds} and s.drafted == 4 * s.rounds
    # by the bucket of 16 output positions each round started at: the rounds and what they accepted add up
    assert sum(s.rounds_by_position.values()) == s.rounds and sum(s.accepted_by_position.values()) == s.accepted
    ar = pipelines["ort"].generate(humaneval[3], method="autoregressive", max_new_tokens=40)
    starts = range(len(ar.token_ids))  # a round per token, starting where the tokens before it end
    assert ar.stats.rounds_by_position == Counter(p // 16 for p in starts) and len(ar.token_ids) > 32
    assert not sum(ar.stats.accepted_by_position.values())
    merged = pipelines["ort"].generate(humaneval[3], method="dynamic", num_draft_tokens=4, ngram_tokens=5,
                                       max_new_tokens=40).stats
    widths = merged.drafted_hist
    assert sum(widths.values()) == merged.rounds and sum(k * v for k, v in widths.items()) == merged.drafted
    assert len(widths) > 1 and max(widths) <= 9  # merged trees vary in width, up to 4 + 5 nodes


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_brings_to_the_host_only_what_its_head_keeps(pipelines, backend):
    """Runner.step's head: the logits whole, each row's argmax or k likeliest tokens with their log-probabilities
    (computed where the logits lie: on a GPU only those cross), or nothing (prefill)."""
    from specrt.runtime.backends.base import TopLogProbs
    from specrt.runtime.sampling import log_softmax
    from specrt.runtime.step_inputs import pack_step

    pipe = pipelines[backend]
    rows = [np.array([5, 9, 3, 7]), np.array([11, 2])]
    with pipe.target.runner() as runner:
        out = {}
        for head in ("logits", "argmax", "discard", TopLogProbs(3, 0.5)):
            cache = runner.new_cache(2)
            cache.reserve(4)
            ids, pos, mask = pack_step(cache, rows, [np.arange(4), np.arange(2)])
            out[head] = runner.step(ids, pos, mask, cache, head)[0]
            out[head] = out[head] if out[head] is None or isinstance(head, TopLogProbs) else out[head].copy()
        with pytest.raises(ValueError, match="head must be one of"):
            runner.step(ids, pos, mask, cache, "top8")
        picked = {}  # one row per sequence (a drafter's root: its last fed token), chosen before the head reads
        for head in ("logits", "argmax", TopLogProbs(3, 0.5)):
            cache = runner.new_cache(2)
            cache.reserve(4)
            picked[head] = runner.step(*pack_step(cache, rows, [np.arange(4), np.arange(2)]), cache, head, [3, 1])[0]
    assert out["logits"].shape == (2, 4, pipe.target.entry.vocab_size) and out["discard"] is None
    assert out["argmax"].dtype == np.int64 and (out["argmax"] == out["logits"].argmax(-1)).all()
    last = out["logits"][[0, 1], [3, 1]]
    assert np.allclose(picked["logits"], last) and (picked["argmax"] == last.argmax(-1)).all()
    assert (picked[TopLogProbs(3, 0.5)].tokens == out[TopLogProbs(3, 0.5)].tokens[[0, 1], [3, 1]]).all()
    top, want = out[TopLogProbs(3, 0.5)], log_softmax(out["logits"] / 0.5)
    assert top.tokens.shape == top.values.shape == (2, 4, 3) and top.tokens.dtype == np.int64
    assert (top.tokens == np.argsort(-want, axis=-1, kind="stable")[..., :3]).all()
    assert np.allclose(top.values, np.take_along_axis(want, top.tokens, -1), atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_device_argmax_head_feeds_the_next_step_where_it_lies(pipelines, backend):
    """Runner.step's "device-argmax": each row's argmax left where the logits lie (a torch tensor on the torch
    backend, numpy on ONNX Runtime's host), taken by a later step as its input_ids as they stand (pack_step passes
    it through) and brought to the host once by Runner.to_host: the same logits as the host's tokens give."""
    import torch

    from specrt.runtime.step_inputs import pack_step

    pipe = pipelines[backend]
    rows = [np.array([5, 9, 3, 7]), np.array([11, 2, 8, 4])]
    with pipe.draft.runner() as runner:
        cache = runner.new_cache(2)
        cache.reserve(5)
        ids, pos, mask = pack_step(cache, rows, [np.arange(4)] * 2)
        lazy = runner.step(ids, pos, mask, cache, "device-argmax", [3, 3])[0]  # [B]
        assert isinstance(lazy, torch.Tensor if backend == "torch" else np.ndarray)
        assert lazy.shape == (2,)
        cache.append(runner.step(ids, pos, mask, cache, "discard")[1], [4, 4])
        column = lazy[:, None]
        ids, pos, mask = pack_step(cache, column, [np.full(1, 4)] * 2, [np.eye(1, dtype=bool)] * 2)
        assert ids is column if backend == "torch" else (ids == column).all()
        fed = runner.step(ids, pos, mask, cache, "logits")[0].copy()
        host = runner.to_host(lazy)
        assert isinstance(host, np.ndarray) and host.dtype == np.int64
        ids, pos, mask = pack_step(cache, [host[:1], host[1:]], [np.full(1, 4)] * 2)
        assert np.array_equal(runner.step(ids, pos, mask, cache, "logits")[0], fed)


def test_a_greedy_draft_chain_brings_its_tokens_to_the_host_once_a_round(pipelines, humaneval, monkeypatch):
    """A greedy chain (sd) on a backend whose logits lie on a device feeds each draft step's argmax to the next step
    where it lies: one copy to the host per round, for all its tokens, not one per draft step; and each chain is the
    draft model's own greedy continuation, as an independent rollout (one host argmax a step) computes it."""
    from specrt.runtime.drafters.draft_model import DraftModelDrafter
    from specrt.runtime.step_inputs import sequence_logits
    from tests.drafting_syncs import host_copies_while_drafting

    pipe = pipelines["torch"]
    rounds = []

    def on_round(drafter, seqs, trees):
        rounds.append(([s.tokens.copy() for s in seqs], [t.tokens.copy() for t in trees], drafter.num_calls))

    copies, out = host_copies_while_drafting(monkeypatch, DraftModelDrafter, lambda: pipe.generate(
        humaneval[:2], method="sd", max_new_tokens=16, batch_size=2, num_draft_tokens=4), on_round)
    assert len(rounds) > 2 and copies == [1, None] * len(rounds)
    assert max(n for *_, n in rounds) == 4  # draft steps a round: up to 4, one copy
    with pipe.draft.runner() as runner:
        for prefixes, chains, _ in rounds[:3]:
            for prefix, chain in zip(prefixes, chains):
                want = list(prefix)
                for _ in range(len(chain)):
                    want.append(int(sequence_logits(runner, np.asarray(want))[-1].argmax()))
                assert chain.tolist() == want[len(prefix):]
    ar = pipe.generate(humaneval[:2], method="autoregressive", max_new_tokens=16, batch_size=2)
    assert [g.token_ids for g in out] == [g.token_ids for g in ar]


@pytest.mark.gpu
def test_on_cuda_a_greedy_draft_chain_waits_for_the_device_only_for_its_tokens(demo_bundle, humaneval, monkeypatch):
    """On CUDA, drafting a greedy chain synchronises with the device once, in Runner.to_host: its step inputs are
    copied from pinned memory without blocking (a blocking host-to-device copy synchronises the stream) and each step's
    argmax feeds the next where it lies. PyTorch's sync debug mode raises at any other synchronising call."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from specrt.runtime.drafters.draft_model import DraftModelDrafter
    from specrt.runtime.pipeline import Pipeline
    from tests.drafting_syncs import device_waits_while_drafting

    pipe = Pipeline.load(demo_bundle, backend="torch", device="cuda")
    waits, out = device_waits_while_drafting(monkeypatch, DraftModelDrafter, lambda: pipe.generate(
        humaneval[:2], method="sd", max_new_tokens=16, batch_size=2, num_draft_tokens=4))
    assert waits and sum(g.stats.rounds for g in out) >= waits
    ar = pipe.generate(humaneval[:2], method="autoregressive", max_new_tokens=16, batch_size=2)
    assert [g.token_ids for g in out] == [g.token_ids for g in ar]


@pytest.mark.parametrize("method, options, want, draft", [
    # greedy verification reads each row's argmax only; a greedy chain drafts from the draft's argmax
    ("sd", {}, "argmax", {"device-argmax"}),  # each draft step's argmax fed to the next where it lies
    ("dynamic", {}, "argmax", {"top-k"}),  # its beams' top-k log-probabilities, at the draft temperature
    ("dynamic", {"temperature": 0.8, "seed": 1}, "logits", {"logits"}),  # the warped q needs whole rows
    ("tree", {}, "argmax", {"top-k"}),  # children of rank > 0: the draft's top-k tokens
    ("autoregressive", {}, "argmax", set()),
    ("sd", {"temperature": 0.8, "seed": 1}, "logits", {"logits"}),  # rejection sampling warps whole rows
    ("ppd", {}, "argmax", set()),  # PPD ranks its next guesses where the logits lie
    ("ppd", {"ngram_tokens": 3}, "argmax", set()),  # ... merged with n-gram drafts too
])
def test_decoding_asks_each_step_for_what_it_reads(pipelines, humaneval, monkeypatch, request, method, options, want,
                                                   draft):
    """Target steps of a decode round bring each row's argmax to the host where greedy verification is all that reads
    them, whole logits where sampling or a drafter does; draft steps the same for what drafting reads; prefill steps
    bring none. Greedy stays token-identical to AR."""
    from specrt.runtime.backends.base import Runner, TopLogProbs
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(request.getfixturevalue("ppd_bundle"), backend="torch", threads=2) if method == "ppd" \
        else pipelines["torch"]
    heads = {"target": [], "draft": []}
    real = Runner.step

    def spy(self, *args, **kw):
        head = args[4] if len(args) > 4 else kw.get("head", "logits")
        heads[self.entry.role].append("top-k" if isinstance(head, TopLogProbs) else head)
        return real(self, *args, **kw)

    monkeypatch.setattr(Runner, "step", spy)
    out = pipe.generate(humaneval[:2], method=method, max_new_tokens=12, **options)
    prefills = sum(g.stats.target_calls - g.stats.rounds for g in out)  # batch size 1: each prompt prefilled alone
    target = heads["target"]
    assert target[0] == "discard" and target.count("discard") == prefills and set(target) - {"discard"} == {want}
    assert set(heads["draft"]) - {"discard"} == draft
    if "temperature" not in options:
        ar = pipe.generate(humaneval[:2], method="autoregressive", max_new_tokens=12)
        assert [g.token_ids for g in out] == [g.token_ids for g in ar]


@pytest.mark.parametrize("method", ["dynamic", "mtad", "tree"])
def test_a_greedy_search_over_the_top_k_head_drafts_what_whole_logits_draft(pipelines, humaneval, monkeypatch,
                                                                              method):
    """A greedy beam search over logits that lie on a device (the torch backend's, here on the CPU) reads only each
    draft step's num_beams likeliest tokens (TopLogProbs): the best extensions of any beams lie among them; a static
    tree only the k best tokens its top-k children take. So every round drafts and accepts exactly what it did over
    the whole logits. (ONNX Runtime's logits are host arrays: its drafters read them whole, as before.)"""
    from specrt.runtime.backends.base import Runner, TopLogProbs

    pipe = pipelines["torch"]
    assert not pipe.draft.host_logits and pipelines["ort"].draft.host_logits
    heads = []
    real = Runner.step

    def spy(self, *args, **kw):
        heads.append(isinstance(args[4] if len(args) > 4 else kw.get("head"), TopLogProbs))
        return real(self, *args, **kw)

    def run():
        heads.clear()
        out = pipe.generate(humaneval[:3], method=method, max_new_tokens=24, batch_size=3)
        return [(g.token_ids, g.stats.accepted_hist, g.stats.drafted_hist, g.stats.accepted) for g in out]

    monkeypatch.setattr(Runner, "step", spy)
    top = run()
    assert any(heads)
    monkeypatch.setattr(pipe.draft, "host_logits", True)  # as if they were host arrays: whole rows
    assert run() == top and not any(heads)


@pytest.mark.parametrize("host_logits", [True, False])
def test_a_host_side_head_is_host_work_and_a_device_side_one_the_models(host_logits):
    """Runner.busy_seconds (the model's time, which decode rounds tell host work by): a backend whose logits are host
    arrays does its head on the host, outside it; one whose logits lie on a device waits for its step in the head's
    copy, inside it, and Runner.to_host's wait for a device-argmax head's tokens is inside it too."""
    import time

    from specrt.runtime.backends.base import Backend

    class Slow(Backend):
        name = "slow"

        def allocate(self, shape):
            return np.zeros(shape, np.float32)

        def _run(self, binding, input_ids, position_ids, attention_mask, cache):
            return np.zeros((1, 1, 8), np.float32), None

        def _head(self, logits, head):
            time.sleep(0.05)
            return super()._head(logits, head)

    Slow.host_logits = host_logits
    runner = Slow(None).runner()
    assert runner.step(None, None, None, None, "argmax")[0].tolist() == [[0]]
    assert (runner.busy_seconds < 0.04) == host_logits

    class Lazy:  # a "device-argmax" head's tokens: bringing them over waits for the steps that made them
        def cpu(self):
            time.sleep(0.05)
            return self

        def numpy(self):
            return np.zeros(2, np.int64)

    busy = runner.busy_seconds
    assert runner.to_host(Lazy()).tolist() == [0, 0] and runner.busy_seconds - busy >= 0.04  # the model's time
    assert runner.to_host(np.ones(2, np.int64)).tolist() == [1, 1]  # host arrays: nothing to wait for

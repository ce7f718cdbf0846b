"""The fast layer: the whole decode loop over fake models (tests/fakes.py), no ONNX export needed.

PathBackend's logits depend on the previous token as each row sees it through the mask and the cache, so
greedy speculation equals greedy autoregressive decoding over it only when positions, masks, KV commits,
compaction and ragged batching are all right.
"""

import numpy as np
import pytest

from specrt import contract
from specrt.runtime import step_inputs
from tests.fakes import PathBackend, fake_pipeline, noisy_copy, path_table

VOCAB = 12


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    table = path_table(VOCAB, seed=0)
    return fake_pipeline(tmp_path_factory.mktemp("fake"), PathBackend(table), PathBackend(noisy_copy(table, 1.0, 1), "draft"))


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


LOSSLESS = [
    dict(method="sd", num_draft_tokens=3),
    dict(method="sd", num_draft_tokens=6),
    dict(method="tree"),
    dict(method="tree", tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    dict(method="dynamic", num_draft_tokens=6),
    dict(method="dynamic", num_draft_tokens=10, num_beams=3, tree_depth=4),
    dict(method="anpd"),
    dict(method="anpd", ngram_branches=2, num_draft_tokens=10),
    dict(method="dynamic", num_draft_tokens=4, ngram_tokens=5),
    dict(method="sd", num_draft_tokens=3, ngram_tokens=4, ngram_min_prob=0.0),
    dict(method="mtad", tau=1.0),  # accepts nothing: autoregressive
]


@pytest.mark.parametrize("kw", LOSSLESS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
@pytest.mark.parametrize("batch_size", [1, 3])
def test_lossless_methods_equal_autoregressive(fake, kw, batch_size):
    ps = prompts(7)
    ar = fake.generate(ps, method="autoregressive", max_new_tokens=30)
    out = fake.generate(ps, max_new_tokens=30, batch_size=batch_size, **kw)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]


def test_the_fake_catches_wrong_bookkeeping(fake, monkeypatch):
    """Mutation check: commit one wrong row and greedy sd no longer equals autoregressive decoding."""
    from specrt.runtime.kv_cache import KVCache

    ps = prompts(5, seed=3)
    ar = fake.generate(ps, method="autoregressive", max_new_tokens=30)
    real = KVCache.append

    def off_by_one(self, new_kv, counts):
        real(self, new_kv[:, :, :, :, ::-1] if new_kv.shape[4] > 1 else new_kv, counts)

    monkeypatch.setattr(KVCache, "append", off_by_one)
    sd = fake.generate(ps, method="sd", num_draft_tokens=4, max_new_tokens=30)
    assert [o.token_ids for o in sd] != [a.token_ids for a in ar]


def test_speculation_pays_on_the_fake(fake):
    ps = prompts(6, seed=4)
    out = fake.generate(ps, method="sd", num_draft_tokens=4, max_new_tokens=40)
    assert sum(o.stats.accepted for o in out) / sum(o.stats.rounds for o in out) > 1.0  # not a vacuous equality


def test_chunked_prefill_equals_one_step_prefill(fake, monkeypatch):
    ps = prompts(4, seed=5, lo=30, hi=90)
    whole = fake.generate(ps, method="sd", max_new_tokens=20, batch_size=2)
    monkeypatch.setattr(step_inputs, "PREFILL_CHUNK", 7)
    chunked = fake.generate(ps, method="sd", max_new_tokens=20, batch_size=2)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    longest = max(len(p) for p in ps[:2]) - 1
    assert chunked[0].stats.target_calls - chunked[0].stats.rounds == -(-longest // 7)  # prefill steps


def test_causal_blocks_are_views_of_one_cached_array():
    for n in (1, 5, 256):
        assert (step_inputs._tri(n) == np.tri(n, dtype=bool)).all()
    assert step_inputs._tri(300).shape == (300, 300) and (step_inputs._tri(300) == np.tri(300, dtype=bool)).all()
    assert step_inputs._tri(9).base is step_inputs._TRI  # no new array per decode step size


def test_mtad_samples_its_beams_at_temperature_above_zero(tmp_path):
    """With one beam of one token, beam sampling is multinomial sampling from the warped draft: the first
    drafted token's frequencies over seeds match q (chi-square), and differ from the greedy draft's."""
    from specrt.runtime.drafters import BeamDrafter
    from specrt.runtime.sampling import SamplingParams, warp
    from specrt.runtime.scheduler import SeqState
    from tests.fakes import MarkovBackend

    table = np.log(np.array([[0.1, 0.5, 0.3, 0.1], [0.25] * 4, [0.25] * 4, [0.25] * 4]))
    params = SamplingParams(temperature=1.0)
    q = warp(table[0], params)
    n = 4000
    counts = np.zeros(4)
    drafter = BeamDrafter(MarkovBackend(table).runner(), num_beams=1, gamma=1)
    rng = np.random.default_rng(0)
    for _ in range(n):
        seqs = [SeqState(0, [3, 0], 4, 8)]
        drafter.start(seqs)
        counts[int(drafter.propose(seqs, params, rng)[0].tokens[0])] += 1
    chi2 = float(((counts - n * q) ** 2 / (n * q)).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    seqs = [SeqState(0, [3, 0], 4, 8)]
    drafter.start(seqs)
    assert drafter.propose(seqs, SamplingParams(), rng)[0].tokens[0] == 1  # greedy: the top token


def test_mtad_output_follows_the_seed_at_temperature_above_zero(tmp_path):
    table = path_table(VOCAB, seed=0, sharpness=1.0)
    pipe = fake_pipeline(tmp_path, PathBackend(table), PathBackend(noisy_copy(table, 0.3, 1), "draft"))
    outs = [tuple(pipe.generate([[1, 2, 3]], method="mtad", temperature=1.0, seed=s, max_new_tokens=2)[0].token_ids)
            for s in range(40)]
    assert len(set(outs)) > 5 and len({o[0] for o in outs}) > 2  # not the same two tokens for every seed
    greedy = {tuple(pipe.generate([[1, 2, 3]], method="mtad", seed=s, max_new_tokens=2)[0].token_ids) for s in range(5)}
    assert len(greedy) == 1


def test_continuous_batching_admits_waiting_prompts_as_sequences_finish(fake):
    """7 prompts, at most 3 at once: continuous batching gives a finished sequence's place to the next prompt
    between rounds, so the batch runs fewer target steps than static batches that wait for their slowest
    sequence; every sequence's tokens and rounds are what they are alone."""
    from specrt.runtime.pipeline import DecodeOptions
    from specrt.runtime.sampling import SamplingParams

    ps = prompts(7, seed=6)
    ar = fake.generate(ps, method="autoregressive", max_new_tokens=30)
    alone = fake.generate(ps, method="sd", num_draft_tokens=3, max_new_tokens=30)
    steps = {}
    for batching in ("static", "continuous"):
        params = SamplingParams()
        scheduler, seqs = fake._prepare("sd", {"num_draft_tokens": 3}, params, DecodeOptions(30, 0, 3, batching), ps)
        runner, sizes = scheduler.target, []
        real = runner.step
        runner.step = lambda ids, *a, **k: (sizes.append(ids.shape[0]), real(ids, *a, **k))[1]
        chunks = [seqs] if batching == "continuous" else [seqs[i:i + 3] for i in range(0, len(seqs), 3)]
        for chunk in chunks:
            for _ in scheduler.run(chunk, params, np.random.default_rng(0), max_batch=3):
                pass
        scheduler.close()
        assert [s.new_tokens.tolist() for s in seqs] == [a.token_ids for a in ar]
        assert [s.stats.rounds for s in seqs] == [a.stats.rounds for a in alone]  # per request, as when alone
        assert max(sizes) == 3
        steps[batching] = len(sizes)
    assert steps["continuous"] < steps["static"]


def test_static_batching_is_kept_for_comparison(fake):
    ps = prompts(5, seed=7)
    a = fake.generate(ps, method="tree", max_new_tokens=20, batch_size=2, batching="static")
    b = fake.generate(ps, method="tree", max_new_tokens=20, batch_size=2)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    with pytest.raises(Exception, match="batching must be one of"):
        fake.generate(ps, method="tree", batching="dynamic")


def test_request_latency_counts_from_the_call_whichever_batch_a_request_waits_for(fake):
    ps = prompts(6, seed=8)
    outs = fake.generate(ps, method="sd", max_new_tokens=20, batch_size=2, batching="static")
    done = [o.stats.seconds.finished for o in outs]
    # the third static batch waited for the first: its requests finish after every request of the first
    assert min(done[4:]) > max(done[:2]) > 0
    outs = fake.generate(ps, method="sd", max_new_tokens=20, batch_size=2)
    assert all(0 < o.stats.seconds.first <= o.stats.seconds.finished <= o.stats.seconds.total for o in outs)
    # one at a time: each request's first token comes after the one before it finished
    outs = fake.generate(ps, method="sd", max_new_tokens=20, batch_size=1)
    assert all(a.stats.seconds.finished < b.stats.seconds.first for a, b in zip(outs, outs[1:]))


@pytest.mark.parametrize("kw", [dict(method="sd", num_draft_tokens=4), dict(method="tree"),
                                dict(method="dynamic", num_draft_tokens=6), dict(method="anpd")],
                         ids=lambda kw: kw["method"])
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_padded_batches_equal_autoregressive(fake, kw, batching):
    """The vanilla padded mode (EMS-SD's baseline) pads every target cache to the batch's longest with masked
    slots: same tokens as autoregressive decoding alone, more slots."""
    ps = prompts(7, seed=9)
    ar = fake.generate(ps, method="autoregressive", max_new_tokens=30)
    out = fake.generate(ps, max_new_tokens=30, batch_size=3, batching=batching, padded=True, **kw)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert sum(o.stats.padded for o in out) > 0
    unpadded = fake.generate(ps, max_new_tokens=30, batch_size=3, batching=batching, **kw)
    assert sum(o.stats.padded for o in unpadded) == 0


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_padded_batches_compute_their_holes_and_unpadded_ones_mark_them(fake, monkeypatch, batching):
    """Unpadded, a ragged target step's holes sit at contract.HOLE_POSITION (a backend that packs rows leaves them
    out); padded, they are real rows, prefill and admission included, as vanilla batching computes its padding."""
    holes = []
    run = type(fake.target)._run

    def recording(self, binding, input_ids, position_ids, attention_mask, cache):
        if self is fake.target:
            holes.append(bool((position_ids == contract.HOLE_POSITION).any()))
        return run(self, binding, input_ids, position_ids, attention_mask, cache)

    monkeypatch.setattr(type(fake.target), "_run", recording)
    ps = prompts(7, seed=9)
    fake.generate(ps, method="anpd", max_new_tokens=30, batch_size=3, batching=batching, padded=True)
    assert holes and not any(holes)
    holes.clear()
    fake.generate(ps, method="anpd", max_new_tokens=30, batch_size=3, batching=batching)
    assert any(holes)


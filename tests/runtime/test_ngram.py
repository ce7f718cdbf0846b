"""ANPD: multi-level n-gram memory units and lossless decoding."""

import pytest

from specrt.runtime.drafters.ngram import NgramDrafter, NgramMemory
from specrt.runtime.scheduler import SeqState


def test_longest_context_wins_then_falls_back():
    m = NgramMemory(max_n=3)
    m.update([1, 2, 3, 9, 2, 4, 7, 2, 4])
    # bigram table: after 2 came 3, 4, 4 -> 4; trigram table: after (1, 2) came 3
    assert m.query([1, 2]) == 3  # longest context (1, 2) matches
    assert m.query([8, 2]) == 4  # (8, 2) unseen: falls back to the bigram after 2
    assert m.query([5]) is None  # no level matches


def test_online_update_and_recency_tie_break():
    m = NgramMemory(max_n=2)
    m.update([5, 6])
    assert m.query([5]) == 6
    m.update([5, 7])  # after 5: 6 once, 7 once -> the most recent reaching the top count
    assert m.query([5]) == 7
    m.update([5, 6, 5, 6])  # 6 now leads 3 to 1
    assert m.query([5]) == 6


def test_draft_chains_queries_and_stops_without_a_match():
    m = NgramMemory(max_n=3)
    m.update([1, 2, 3, 4, 1, 2, 3, 4])
    assert m.draft([9, 1], 6) == [2, 3, 4, 1, 2, 3]
    assert m.draft([9], 3) == []  # 9 was never followed by anything


def test_hit_rates_are_counted_online_per_context_length():
    m = NgramMemory(max_n=3)
    assert m.hit_rate(1) == m.hit_rate(2) == 0.5  # the prior: one hit in two tries
    m.update([1, 2, 5, 1, 2, 6, 1, 2, 6, 0, 2, 7])
    # longest matching level and its most frequent token, per token from the 5th: (1,) -> 2 for 2: hit;
    # (1, 2) -> 5 for 6: miss; (1,) -> 2 for 2: hit; (1, 2) -> 6 for 6: hit; (2, 6) -> 1 for 0: miss;
    # (2,) -> 6 for 7: miss
    assert m.hit_rate(1) == (1 + 2) / (2 + 3) and m.hit_rate(2) == (1 + 1) / (2 + 3)


def split(pairs):
    return [t for t, _ in pairs], [p for _, p in pairs]


def test_continuations_estimate_the_best_at_the_level_hit_rate_and_the_rest_by_count():
    m = NgramMemory(max_n=3)
    m.update([1, 2, 5, 1, 2, 6, 1, 2, 6, 0, 2, 7])  # hit rates 0.6 (1-token contexts), 0.4 (2-token)
    # after (1, 2): 6 twice, 5 once -> 6 at 0.4, 5 at (1 - 0.4) * 1 / (3 + 1)
    assert split(m.continuations([1, 2], 3)) == ([6, 5], pytest.approx([0.4, 0.6 / 4]))
    # (8, 2) unseen: falls back to the bigram after 2 (5, 6, 6, 7) -> 6 at 0.6, then 5 at 0.4 * 1 / 5
    assert split(m.continuations([8, 2], 2)) == ([6, 5], pytest.approx([0.6, 0.4 / 5]))
    assert m.continuations([9], 2) == []


def test_ngram_tree_grows_best_first_and_is_the_chain_with_one_branch():
    m = NgramMemory(max_n=2)
    m.update([1, 2, 5, 1, 3, 6, 1, 2, 7])  # every prediction missed: hit rate 1 / 5
    # after 1: 2 (0.2), 3 (0.8 * 1/4 = 0.2); after 2: 7 (0.2), 5 (0.8 * 1/3); after 3: 6 (0.2)
    tokens, parents, probs = m.draft_tree([1], 4, branches=2)
    assert tokens == [2, 3, 5, 7] and parents == [-1, -1, 0, 0]
    assert probs == pytest.approx([0.2, 0.2, 0.2 * 0.8 / 3, 0.2 * 0.2])  # best first; 3 -> 6 (0.04) came later
    assert m.draft_tree([1], 4, branches=2, min_prob=0.1)[:2] == ([2, 3], [-1, -1])  # nothing below 0.1
    m = NgramMemory(max_n=3)
    m.update([1, 2, 3, 4, 1, 2, 3, 4])  # hit rates 2/3 (1-token contexts), 3/4 (2-token)
    tokens, parents, _ = m.draft_tree([9, 1], 6, branches=1)
    assert tokens == m.draft([9, 1], 6) and parents == [-1, 0, 1, 2, 3, 4]
    assert m.draft_tree([9], 3, branches=2) == ([], [], [])
    # a certain-looking chain still fades: 2/3, then * 3/4 per step (0.5, 0.375, 0.28, 0.21)
    assert m.draft_tree([9, 1], 6, branches=1, min_prob=0.25)[:2] == ([2, 3, 4, 1], [-1, 0, 1, 2])


def test_best_prefix_maximises_expected_tokens_per_ms():
    from specrt.runtime.drafters.ngram import best_prefix

    probs = [0.9, 0.5, 0.1]
    assert best_prefix(probs, [10, 10, 10, 10]) == 3  # verification is free: take every node
    assert best_prefix(probs, [10, 11, 12, 13]) == 2  # (1 + 1.4) / 12 beats 2.5 / 13 and 1.9 / 11
    assert best_prefix(probs, [10, 30, 40, 50]) == 0  # one more token costs 3 steps: do not draft
    assert best_prefix(probs, [10, 10]) == 1  # costs known up to 1 node only
    assert best_prefix(probs, []) == 0  # no cost known (a merged round already as wide as the profile): no draft
    # a round already expected to yield 3 tokens pays for fewer drafts: (3 + 0.9) / 12 beats 4.4 / 14; alone, 2.4 / 14
    # beats 1.9 / 12
    assert best_prefix(probs, [10, 12, 14, 16]) == 2 and best_prefix(probs, [10, 12, 14, 16], base=3.0) == 1


def test_sequences_do_not_share_memories():
    d = NgramDrafter(max_n=3, num_draft_tokens=3)
    seqs = [SeqState(0, [1, 2, 3, 1, 2], 8, 4), SeqState(1, [7, 8, 9, 7, 8], 8, 4)]
    d.start(seqs)
    trees = d.propose(seqs, None, None)
    assert trees[0].tokens.tolist() == [3, 1, 2] and trees[1].tokens.tolist() == [9, 7, 8]
    assert trees[0].draft_probs is None  # one-hot drafts
    d.keep([1])
    assert len(d.memories) == 1 and d.memories[0].query([7]) == 8


def test_bad_orders():
    with pytest.raises(ValueError):
        NgramMemory(1)
    with pytest.raises(ValueError):
        NgramDrafter(5, 0)
    with pytest.raises(ValueError):
        NgramDrafter(5, 7, branches=0)


def test_anpd_is_token_identical_to_autoregressive(pipelines, humaneval):
    pipe = pipelines["ort"]  # the torch backend: test_pipeline.py::test_lossless_methods_on_the_torch_backend
    ar = pipe.generate(humaneval, method="autoregressive", max_new_tokens=64)
    anpd = pipe.generate(humaneval, method="anpd", max_new_tokens=64)
    batched = pipe.generate(humaneval[:6], method="anpd", max_new_tokens=64, batch_size=3, ngram_n=3, num_draft_tokens=5)
    trees = pipe.generate(humaneval, method="anpd", max_new_tokens=64, ngram_branches=3, num_draft_tokens=8,
                          ngram_min_prob=0.1)
    unpruned = pipe.generate(humaneval[:6], method="anpd", max_new_tokens=64, ngram_branches=3, num_draft_tokens=8)
    for i, (a, n, t) in enumerate(zip(ar, anpd, trees)):
        assert a.token_ids == n.token_ids, f"prompt {i} differs"
        assert a.token_ids == t.token_ids, f"prompt {i} differs with n-gram trees"
    assert [a.token_ids for a in ar[:6]] == [u.token_ids for u in unpruned]
    drafted_trees, drafted_chains = (sum(o.stats.drafted for o in outs) for outs in (trees, anpd))
    assert drafted_trees < drafted_chains  # pruned below 0.1: fewer drafted tokens than chains of 7
    assert sum(o.stats.drafted for o in unpruned) > sum(o.stats.drafted for o in anpd[:6])  # unpruned trees of 8: more
    assert [a.token_ids for a in ar[:6]] == [b.token_ids for b in batched]
    per_call = sum(len(o.token_ids) for o in anpd) / sum(o.stats.rounds for o in anpd)
    assert per_call > 1.1  # the n-gram drafts really are accepted
    assert all(o.stats.draft_calls == 0 for o in anpd)  # no draft model runs


def test_hardware_aware_anpd_is_lossless_and_drafts_what_the_latency_profile_pays_for(demo_bundle, humaneval, tmp_path):
    import shutil

    from specrt.bundle.machine import Machine
    from specrt.errors import BundleError
    from specrt.runtime.pipeline import Pipeline
    from tests.fakes import hardware_aware_drafted, write_latency

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    pipe = Pipeline.load(b, threads=2)
    kw = dict(method="anpd", ngram_branches=2, num_draft_tokens=12, ngram_hardware_aware=True, max_new_tokens=48)
    drafted, ar = hardware_aware_drafted(pipe, b, humaneval[:6], kw)
    # free verification: the whole best-first tree (up to 12 nodes) each round; at +40% of a step per
    # token only the likeliest few
    assert drafted["steep"] < 0.5 * drafted["flat"] and drafted["flat"] > 3
    write_latency(b, lambda n: 10.0, machine=pipe.machine, max_tokens=4)  # profiled up to 4 tokens per step
    outs = pipe.generate(humaneval[:3], **kw)  # so no round verifies more than 3 drafted tokens
    assert [o.token_ids for o in outs] == [a.token_ids for a in ar[:3]] and max(max(o.stats.drafted_hist) for o in outs) <= 3
    write_latency(b, lambda n: 10.0, machine=Machine("Some Other CPU", 2, "x86_64", "ort", 2, "cpu"))
    with pytest.raises(BundleError, match="was measured on Some Other CPU.*re-run `specrt profile .*` here"):
        pipe.generate(humaneval[:1], **kw)

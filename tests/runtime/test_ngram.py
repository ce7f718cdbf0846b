"""ANPD: multi-level n-gram memory units and lossless decoding."""

import pytest

from specrt.runtime.ngram import NgramDrafter, NgramMemory
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


def test_continuations_are_most_frequent_first_with_relative_counts():
    m = NgramMemory(max_n=3)
    m.update([1, 2, 5, 1, 2, 6, 1, 2, 6, 0, 2, 7])
    # count / (total + 1): room for a continuation not seen yet
    assert m.continuations([1, 2], 3) == [(6, 2 / 4), (5, 1 / 4)]  # longest level (1, 2) only
    assert m.continuations([8, 2], 2) == [(6, 2 / 5), (5, 1 / 5)]  # falls back to the bigram after 2
    assert m.continuations([9], 2) == []


def test_ngram_tree_grows_best_first_and_is_the_chain_with_one_branch():
    m = NgramMemory(max_n=2)
    m.update([1, 2, 5, 1, 3, 6, 1, 2, 7])
    # after 1: 2 (2/4), 3 (1/4); after 2: 5 and 7 (1/3 each, 7 most recent); after 3: 6 (1/2)
    tokens, parents = m.draft_tree([1], 4, branches=2)
    assert tokens == [2, 3, 7, 5] and parents == [-1, -1, 0, 0]  # paths 2/4, 1/4, 1/6, 1/6 (3->6: 1/8)
    assert m.draft_tree([1], 4, branches=2, min_prob=0.2) == ([2, 3], [-1, -1])  # nothing below 0.2
    m = NgramMemory(max_n=3)
    m.update([1, 2, 3, 4, 1, 2, 3, 4])
    tokens, parents = m.draft_tree([9, 1], 6, branches=1)
    assert tokens == m.draft([9, 1], 6) and parents == [-1, 0, 1, 2, 3, 4]
    assert m.draft_tree([9], 3, branches=2) == ([], [])
    # a certain-looking chain still fades: after (3, 4) came 1 twice, so each step is 2/3
    assert m.draft_tree([9, 1], 6, branches=1, min_prob=0.25) == ([2, 3, 4], [-1, 0, 1])


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


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_anpd_is_token_identical_to_autoregressive(pipelines, humaneval, backend):
    pipe = pipelines[backend]
    ar = pipe.generate(humaneval, method="autoregressive", max_new_tokens=64)
    anpd = pipe.generate(humaneval, method="anpd", max_new_tokens=64)
    batched = pipe.generate(humaneval[:6], method="anpd", max_new_tokens=64, batch_size=3, ngram_n=3, num_draft_tokens=5)
    trees = pipe.generate(humaneval, method="anpd", max_new_tokens=64, ngram_branches=3, num_draft_tokens=8,
                          ngram_min_prob=0.1 if backend == "ort" else 0.0)
    for i, (a, n, t) in enumerate(zip(ar, anpd, trees)):
        assert a.token_ids == n.token_ids, f"prompt {i} differs"
        assert a.token_ids == t.token_ids, f"prompt {i} differs with n-gram trees"
    drafted_trees, drafted_chains = (sum(o.stats["drafted"] for o in outs) for outs in (trees, anpd))
    if backend == "ort":  # pruned below 0.1: fewer drafted tokens than chains of 7
        assert drafted_trees < drafted_chains
    else:  # unpruned trees of 8 nodes: more
        assert drafted_trees > drafted_chains
    assert [a.token_ids for a in ar[:6]] == [b.token_ids for b in batched]
    per_call = sum(len(o.token_ids) for o in anpd) / sum(o.stats["rounds"] for o in anpd)
    assert per_call > 1.1  # the n-gram drafts really are accepted
    assert all(o.stats["draft_calls"] == 0 for o in anpd)  # no draft model runs

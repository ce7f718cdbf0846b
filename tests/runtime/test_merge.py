"""MergedDrafter: n-gram drafts merged into the draft model's tree (SpecInfer-style)."""

import numpy as np
import pytest

from specrt.errors import InvalidRequestError
from specrt.runtime.drafters import Drafter
from specrt.runtime.drafters.merge import MergedDrafter, merge_trees
from specrt.runtime.tree import DraftTree
from specrt.runtime.verify import Verdict


def _tree(tokens, parents):
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


def test_merge_shares_prefixes_and_keeps_parents_first():
    a = _tree([5, 6, 7], [-1, -1, 0])  # 5 -> 7, and 6
    b = DraftTree.chain([5, 7, 9])  # agrees with a for two tokens, then goes deeper
    c = DraftTree.chain([6, 8])  # a's second branch, extended
    merged, maps = merge_trees([a, b, c])
    assert merged.tokens.tolist() == [5, 6, 7, 9, 8]
    assert merged.parents.tolist() == [-1, -1, 0, 2, 1]
    assert [m.tolist() for m in maps] == [[0, 1, 2], [0, 2, 3], [1, 4]]
    assert not merged.is_chain
    for node in range(-1, len(merged)):  # siblings carry distinct tokens: one-hot verification stays lossless
        kids = merged.tokens[merged.children(node)]
        assert len(set(kids.tolist())) == len(kids)
    # a tree whose nodes are all in the first one adds nothing
    same, maps = merge_trees([a, DraftTree.chain([5, 7])])
    assert same.tokens.tolist() == [5, 6, 7] and maps[1].tolist() == [0, 2]


def test_merge_refuses_sampled_drafts():
    sampled = DraftTree.chain([1, 2], np.full((2, 4), 0.25))
    with pytest.raises(ValueError, match="deterministic"):
        merge_trees([DraftTree.chain([1]), sampled])


class _Fixed(Drafter):
    """Proposes the same tree every round and records what it is told to commit."""

    def __init__(self, tree):
        self.tree, self.committed = tree, []

    def _admit(self, new):
        pass

    def _propose(self, seqs, params, rng):
        return [self.tree for _ in seqs]

    def commit(self, seqs, verdicts):
        self.committed.append(verdicts)


def test_each_drafter_commits_the_accepted_prefix_in_its_own_tree():
    model, ngram = _Fixed(_tree([5, 6, 7], [-1, -1, 0])), _Fixed(DraftTree.chain([5, 7, 9]))
    drafter = MergedDrafter([model, ngram])
    drafter.start([None])
    merged = drafter.propose([None], None, None)[0]  # nodes 5, 6, 7, 9 (merged ids 0..3)
    assert merged.tokens.tolist() == [5, 6, 7, 9]
    drafter.commit([None], [Verdict([0, 2, 3], bonus=11)])  # 5, 7, 9 accepted: 9 only the n-gram drafted
    assert model.committed[-1] == [Verdict([0, 2], 11, beyond=1)]  # 9 stays pending text for the draft model
    assert ngram.committed[-1] == [Verdict([0, 1, 2], 11)]
    drafter.propose([None], None, None)
    drafter.commit([None], [Verdict([1], bonus=3)])  # 6: only the model drafted it
    assert model.committed[-1] == [Verdict([1], 3)] and ngram.committed[-1] == [Verdict([], 3, beyond=1)]
    seen = []

    class Reading(_Fixed):
        def target_logits(self, logits, rows=None):
            seen.append((logits, rows))

    drafter = MergedDrafter([Reading(model.tree), Reading(ngram.tree), _Fixed(ngram.tree)])  # the last reads none
    drafter.start([None])
    drafter.propose([None], None, None)
    logits = np.arange(5)[None, :, None] * np.ones((1, 5, 2))  # [B, root + 4 merged nodes, V]: row r holds r
    drafter.target_logits(logits)  # each drafter: the rows of the root, then of its own nodes in its own order
    assert all(x is logits for x, _ in seen)  # the step's logits where they lie, not a copy of rows
    assert [rows[0].tolist() for _, rows in seen] == [[0, 1, 2, 3], [0, 1, 3, 4]]
    with pytest.raises(ValueError, match="at least two"):
        MergedDrafter([model])


def test_a_hardware_aware_ngram_drafter_is_told_what_the_round_already_holds():
    from specrt.runtime.drafters.ngram import NgramDrafter

    class Seq:
        def __init__(self, tokens):
            self.tokens = tokens

    # text where 1 2 3 4 always follows: the n-gram drafter's chain is 1 2 3 4, each estimated likely
    seqs = [Seq([1, 2, 3, 4] * 6 + [1]), Seq([1, 2, 3, 4] * 6 + [1])]
    model = _Fixed(_tree([2, 9, 3], [-1, -1, 0]))  # 3 nodes; agrees with the n-gram chain on 2 3
    ngram = NgramDrafter(5, 4, step_costs=[10.0] * 12)  # verification free up to 11 drafted tokens
    drafter = MergedDrafter([model, ngram])
    drafter.start(seqs)
    merged = drafter.propose(seqs, None, None)
    assert [(t.tokens.tolist(), e) for t, e, _ in ngram.ahead] == [([2, 9, 3], 1.0)] * 2  # the model's tree, prior 1
    assert all(spent >= 0 for *_, spent in ngram.ahead)
    assert merged[0].tokens.tolist() == [2, 9, 3, 4, 1]  # free: the whole chain, merged where it agrees
    drafter.commit(seqs, [Verdict([0, 2], bonus=4), Verdict([], bonus=7)])  # the model's 2 3 accepted in row 0
    drafter.propose(seqs, None, None)
    assert [round(e, 6) for _, e, _ in ngram.ahead] == [1.5, 0.5]  # (1 + 2) / 2 rounds and (1 + 0) / 2
    drafter.keep([1])  # row 0 left the batch: its counts go with it
    drafter.propose(seqs[1:], None, None)
    assert [round(e, 6) for _, e, _ in ngram.ahead] == [0.5]
    # where a step of more than the model's 3 nodes costs ten times more: the n-gram's 2 3 are the model's own nodes
    # (no row, no gain), its 4 1 would add the dear rows, so the round verifies the model's tree alone
    steep = NgramDrafter(5, 4, step_costs=[10.0] * 4 + [100.0] * 8)
    drafter = MergedDrafter([model, steep])
    drafter.start(seqs)
    assert drafter.propose(seqs, None, None)[0].tokens.tolist() == [2, 9, 3]


def test_merged_drafts_are_token_identical_to_autoregressive(pipelines, humaneval):
    pipe = pipelines["ort"]  # the torch backend: test_pipeline.py::test_lossless_methods_on_the_torch_backend
    prompts = humaneval[:12]
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=64)
    runs = {
        "dynamic": dict(method="dynamic", num_draft_tokens=6),
        "dynamic+ngram": dict(method="dynamic", num_draft_tokens=6, ngram_tokens=7),
        "sd+ngram": dict(method="sd", num_draft_tokens=3, ngram_tokens=5, ngram_min_prob=0.0),
        "tree+ngram": dict(method="tree", tree=[(0,), (1,), (0, 0)], ngram_tokens=6, ngram_branches=2),
    }
    outs = {name: pipe.generate(prompts, max_new_tokens=64, **kw) for name, kw in runs.items()}
    batched = pipe.generate(prompts[:6], max_new_tokens=64, batch_size=3, **runs["dynamic+ngram"])
    for name, got in outs.items():
        assert [o.token_ids for o in got] == [a.token_ids for a in ar], name
    assert [o.token_ids for o in batched] == [a.token_ids for a in ar[:6]]

    def per_call(got):
        return sum(len(o.token_ids) for o in got) / sum(o.stats.rounds for o in got)

    # the n-gram nodes really are verified and accepted: more tokens per target step than the model's tree alone
    assert per_call(outs["dynamic+ngram"]) > per_call(outs["dynamic"]) + 0.2
    def nodes_per_round(got):
        return sum(o.stats.drafted for o in got) / sum(o.stats.rounds for o in got)

    assert nodes_per_round(outs["dynamic+ngram"]) > nodes_per_round(outs["dynamic"])


def test_merged_sampling_is_seeded_and_sampled_chains_are_refused(pipelines, humaneval):
    pipe = pipelines["ort"]
    kw = dict(method="dynamic", ngram_tokens=5, max_new_tokens=24, temperature=0.8, top_k=50)
    a, b = (pipe.generate(humaneval[4], seed=3, **kw) for _ in range(2))
    assert a.token_ids == b.token_ids
    with pytest.raises(InvalidRequestError, match="deterministic drafts"):
        pipe.generate(humaneval[4], method="sd", ngram_tokens=5, temperature=0.8)


def test_hardware_aware_merged_drafts_are_lossless_and_follow_the_latency_profile(demo_bundle, humaneval, tmp_path):
    import shutil

    from specrt.runtime.pipeline import Pipeline
    from tests.fakes import hardware_aware_drafted

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    pipe = Pipeline.load(b, threads=2)
    kw = dict(method="dynamic", num_draft_tokens=3, ngram_tokens=12, ngram_min_prob=0.0, ngram_hardware_aware=True,
              max_new_tokens=48)
    drafted, _ = hardware_aware_drafted(pipe, b, humaneval[:6], kw, batch_sizes=(1, 3))  # and ragged batches of 3
    # free verification: the model's 3 nodes and most of the n-gram chain; at +40% of a step per token, n-gram drafts
    # only where they are likely
    assert drafted["steep"] < drafted["flat"] - 1 and drafted["flat"] > 5
    assert drafted["steep"] >= 3  # the model's nodes are verified whatever they cost

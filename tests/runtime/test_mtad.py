"""MTAD / MJSD: joint-likelihood acceptance, beam search, and tau = 1 reducing to greedy decoding."""

import itertools

import numpy as np
import pytest

from specrt.runtime.drafters import BeamDrafter, DynamicTreeDrafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import SeqState
from specrt.runtime.tree import DraftTree
from specrt.runtime.verify import JointLikelihoodVerifier
from tests.fakes import MarkovBackend


@pytest.mark.parametrize("tau,ratios,expected", [
    (0.5, [0.9, 0.4, 0.6, 0.3], 3),  # prefix 2 fails, prefix 3 passes: the longest passing prefix wins
    (0.5, [0.5, 0.5], 0),            # strict: a ratio equal to tau fails
    (0.5, [2.0, 1.5, 0.51], 3),      # p > q counts as ratio 1
    (0.0, [1e-9, 1e-9], 2),          # tau = 0 accepts any prefix with p > 0
    (1.0, [1.0, 3.0], 0),            # tau = 1 accepts nothing
])
def test_acceptance_rule_on_hand_built_tables(tau, ratios, expected):
    logq = np.zeros(len(ratios))  # q = 1, so the ratio is exactly p (no rounding at the boundary)
    logp = logq + np.log(ratios)
    assert JointLikelihoodVerifier(tau).accepted_length(logp, logq) == expected


def test_verify_computes_joint_likelihoods_from_target_logits():
    # target: p(x1 = 1) = 0.5, p(x2 = 2 | x1) = 0.1; draft said q(x1) = 0.5, q(x1, x2) = 0.4
    probs = np.array([[0.1, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.3], [0.7, 0.1, 0.1, 0.1]])
    tree = DraftTree(np.array([1, 2]), np.array([-1, 0]), is_chain=True, joint_logq=np.log([0.5, 0.4]))
    greedy = SamplingParams()
    v = JointLikelihoodVerifier(0.2).verify(tree, np.log(probs), greedy, None)
    assert v.path == [0] and v.bonus == 0  # ratio 1.0 passes, 0.05 / 0.4 = 0.125 fails; bonus argmax row 1
    v = JointLikelihoodVerifier(0.1).verify(tree, np.log(probs), greedy, None)
    assert v.path == [0, 1] and v.bonus == 0  # 0.125 > 0.1: both accepted; bonus from row 2


def test_tree_of_beams_accepts_the_deepest_passing_prefix_then_the_likeliest():
    # nodes: 0 = a (root child), 1 = b (child of a), 2 = c (root child), 3 = d (child of c), 4 = e (child of c)
    tokens, parents = np.array([1, 2, 3, 1, 2]), np.array([-1, 0, -1, 2, 2])
    probs = np.full((6, 4), 0.25)  # rows: root, then one row per node (only parent rows are read)
    probs[0] = [0.0, 0.5, 0.0, 0.5]  # p(a) = 0.5, p(c) = 0.5
    probs[1] = [0.9, 0.0, 0.1, 0.0]  # p(b | a) = 0.1
    probs[3] = [0.2, 0.3, 0.5, 0.0]  # p(d | c) = 0.3, p(e | c) = 0.5
    greedy = SamplingParams()
    logq = np.log([0.5, 0.4, 0.5, 0.3, 0.25])  # joint q of a, ab, c, cd, ce
    tree = DraftTree(tokens, parents, joint_logq=logq)
    with np.errstate(divide="ignore"):
        logits = np.log(probs)
    # tau 0.5: ab fails (0.05 / 0.4), cd passes (0.15 / 0.3 = 0.5? no: strict, fails), ce passes (0.25 / 0.25)
    v = JointLikelihoodVerifier(0.5).verify(tree, logits, greedy, None)
    assert v.path == [2, 4] and v.bonus == int(np.argmax(probs[5]))
    # tau 0.1: ab (0.125), cd (0.5) and ce (1.0) all pass at depth 2; ce has the highest p (0.25)
    v = JointLikelihoodVerifier(0.1).verify(tree, logits, greedy, None)
    assert v.path == [2, 4]
    # tau 0.6: no depth-2 prefix passes (ce's ratio 1.0 does, so raise q(ce) to make it fail), a and c do
    tree = DraftTree(tokens, parents, joint_logq=np.log([0.5, 0.4, 0.5, 0.3, 0.5]))
    v = JointLikelihoodVerifier(0.6).verify(tree, logits, greedy, None)
    assert v.path == [0]  # a and c tie on depth and p: the first wins
    assert JointLikelihoodVerifier(1.0).verify(tree, logits, greedy, None).path == []


def markov_joint(table):
    """joint(seq, prev=0): the Markov model's joint log-likelihood of seq after token prev."""
    logq = table - np.log(np.exp(table).sum(axis=1, keepdims=True))
    return lambda seq, prev=0: sum(logq[p, t] for p, t in zip((prev,) + tuple(seq[:-1]), seq))


def draft_once(drafter):
    """One round's tree after the prompt [3, 0] (so the root token is 0)."""
    seqs = [SeqState(0, [3, 0], 8, 64)]
    drafter.start(seqs)
    return drafter.propose(seqs, SamplingParams(), None)[0]


def tree_path(tree, node):
    """Tokens from the root to `node`."""
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tuple(reversed(out))


def test_beam_search_finds_the_top_joint_likelihood_sequence():
    rng = np.random.default_rng(3)
    vocab, gamma = 5, 3
    table = rng.normal(size=(vocab, vocab)) * 2
    table[0] = [0, 3.0, 2.9, -5, -5]  # greedy takes 1, but 2 leads to a much likelier continuation
    table[1] = [0, 0, 0, 0, 0.2]
    table[2] = [-5, -5, -5, -5, 6.0]
    backend = MarkovBackend(table).runner()
    joint = markov_joint(table)
    best = max(itertools.product(range(vocab), repeat=gamma), key=joint)
    drafter = BeamDrafter(backend, num_beams=vocab, gamma=gamma)
    tree = draft_once(drafter)
    assert tuple(tree.tokens) == best
    assert np.allclose(tree.joint_logq, [joint(best[:d]) for d in range(1, gamma + 1)])
    assert best[0] != int(np.argmax(table[0]))  # the test would catch a greedy drafter
    assert drafter.num_calls == gamma  # root step + one step per fed depth


def test_top_beams_as_one_tree_are_the_top_joint_likelihood_sequences():
    rng = np.random.default_rng(5)
    vocab, gamma, k = 5, 3, 3
    table = rng.normal(size=(vocab, vocab)) * 2
    joint = markov_joint(table)
    top = sorted(itertools.product(range(vocab), repeat=gamma), key=joint, reverse=True)[:k]
    # vocab ** (gamma - 1) beams keep every depth-2 prefix, so the search is exhaustive
    backend = MarkovBackend(table).runner()
    tree = draft_once(BeamDrafter(backend, num_beams=vocab ** (gamma - 1), gamma=gamma, num_verified=k))
    assert all(tree.parents[i] < i for i in range(len(tree)))
    leaves = [i for i in range(len(tree)) if not len(tree.children(i))]
    assert sorted(tree_path(tree, i) for i in leaves) == sorted(top)
    assert len(tree) == len({p[:d] for p in top for d in range(1, gamma + 1)})  # shared prefixes merged
    assert np.allclose(tree.joint_logq, [joint(tree_path(tree, i)) for i in range(len(tree))])
    with pytest.raises(ValueError, match="num_verified"):
        BeamDrafter(backend, num_beams=2, gamma=3, num_verified=3)


def test_dynamic_tree_is_the_top_joint_likelihood_prefixes():
    rng = np.random.default_rng(0)
    vocab, depth, nodes = 4, 3, 7
    table = rng.normal(size=(vocab, vocab)) * 2
    joint = markov_joint(table)
    prefixes = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
    top = sorted(prefixes, key=lambda p: (-joint(p), len(p)))[:nodes]
    # vocab ** (depth - 1) beams keep every prefix, so the search is exhaustive
    tree = draft_once(DynamicTreeDrafter(MarkovBackend(table).runner(), num_nodes=nodes, width=vocab ** (depth - 1), depth=depth))
    assert sorted(tree_path(tree, i) for i in range(len(tree))) == sorted(top)
    assert all(tree.parents[i] < i for i in range(len(tree)))
    assert max(len(p) for p in top) == depth and len({p[0] for p in top}) > 1  # deep and branching
    # with a calibrated temperature, nodes are ranked by the sharpened joint likelihood instead
    sharp = markov_joint(table / 0.3)
    top_sharp = sorted(prefixes, key=lambda p: (-sharp(p), len(p)))[:nodes]
    assert sorted(top_sharp) != sorted(top)  # this table's tree does change shape
    tree = draft_once(DynamicTreeDrafter(MarkovBackend(table).runner(), num_nodes=nodes, width=vocab ** (depth - 1), depth=depth,
                                         temperature=0.3))
    assert sorted(tree_path(tree, i) for i in range(len(tree))) == sorted(top_sharp)


class FullDynamicSearch:
    """Mixin: a dynamic drafter that feeds every beam node (no pruning), as the reference."""

    def _expand(self, nodes):
        return BeamDrafter._expand(self, nodes)


def fed_tokens(drafter):
    return int(sum(drafter.cache.lengths - drafter._anchor))


def test_pruned_dynamic_search_chooses_the_same_tree_with_less_draft_work(pipelines, humaneval):
    class Full(FullDynamicSearch, DynamicTreeDrafter):
        pass

    # a real draft model, whose logits depend on which scratch rows each node sees: a wrong visibility mask
    # for the pruned search's non-contiguous scratch rows would change deeper scores and the chosen tree
    pipe = pipelines["ort"]
    seqs = [SeqState(b, pipe.encode(p), 8, 256) for b, p in enumerate(humaneval[:6])]
    fed = {}
    for cls in (DynamicTreeDrafter, Full):
        drafter = cls(pipe.draft.runner(), num_nodes=6, width=4, depth=6, temperature=0.6)
        drafter.start(seqs)
        trees = drafter.propose(seqs, SamplingParams(), None)
        fed[cls] = fed_tokens(drafter), [(t.tokens.tolist(), t.parents.tolist()) for t in trees]
    assert fed[DynamicTreeDrafter][1] == fed[Full][1]
    assert fed[DynamicTreeDrafter][0] < fed[Full][0]
    # and on Markov tables, which reach every branch of the search
    saved = 0
    for seed in range(20):
        table = np.random.default_rng(seed).normal(size=(6, 6)) * 2
        trees = []
        for cls in (DynamicTreeDrafter, Full):
            drafter = cls(MarkovBackend(table).runner(), num_nodes=5, width=3, depth=5)
            trees.append(draft_once(drafter))
            saved += fed_tokens(drafter) * (1 if cls is Full else -1)
        assert sorted(tree_path(trees[0], i) for i in range(len(trees[0]))) == \
            sorted(tree_path(trees[1], i) for i in range(len(trees[1])))
    assert saved > 0


def test_dynamic_tree_is_token_identical_to_autoregressive(pipelines, humaneval):
    pipe = pipelines["ort"]  # the torch backend: test_pipeline.py::test_lossless_methods_on_the_torch_backend
    ar = pipe.generate(humaneval[:8], method="autoregressive", max_new_tokens=40)
    dyn = pipe.generate(humaneval[:8], method="dynamic", max_new_tokens=40)
    batched = pipe.generate(humaneval[:6], method="dynamic", num_draft_tokens=12, num_beams=3, tree_depth=5,
                            max_new_tokens=40, batch_size=3)
    assert [a.token_ids for a in ar] == [d.token_ids for d in dyn]
    assert [a.token_ids for a in ar[:6]] == [d.token_ids for d in batched]
    assert sum(len(o.token_ids) for o in dyn) / sum(o.stats.rounds for o in dyn) > 1.5
    kw = dict(method="dynamic", temperature=1.0, top_p=0.6, seed=1, max_new_tokens=24, batch_size=3)
    sampled = pipe.generate(humaneval[:3], **kw)  # sampling is seeded
    assert [o.token_ids for o in sampled] == [o.token_ids for o in pipe.generate(humaneval[:3], **kw)]


def test_beam_levels_may_differ_in_width_across_a_batch():
    # after token 0 the warped draft keeps one candidate (top-p 0.6), after token 1 two: one batched step
    # must still feed each sequence its own level
    table = np.array([[6.0, 0, 0, 0], [1.0, 1.0, 1.0, -9], [0, 0, 0, 0], [0, 0, 0, 0]])
    drafter = DynamicTreeDrafter(MarkovBackend(table).runner(), num_nodes=6, width=4, depth=3)
    seqs = [SeqState(0, [3, 0], 8, 64), SeqState(1, [3, 1], 8, 64)]
    drafter.start(seqs)
    trees = drafter.propose(seqs, SamplingParams(temperature=1.0, top_p=0.6), None)
    assert [len(t.children(-1)) for t in trees] == [1, 2]
    for t in trees:
        assert all(t.parents[i] < i for i in range(len(t)))
        assert all(table[(0 if p < 0 else t.tokens[p]), t.tokens[i]] > -9 for i, p in enumerate(t.parents))


@pytest.mark.parametrize("backend,verify_beams", [("ort", 1), ("ort", 3)])
def test_tau_one_is_greedy_decoding(pipelines, humaneval, backend, verify_beams):
    pipe = pipelines[backend]
    ar = pipe.generate(humaneval[:8], method="autoregressive", max_new_tokens=40)
    mtad = pipe.generate(humaneval[:8], method="mtad", tau=1.0, verify_beams=verify_beams, max_new_tokens=40,
                         batch_size=4 if verify_beams > 1 else 1)
    assert [a.token_ids for a in ar] == [m.token_ids for m in mtad]


def test_mtad_accepts_more_as_tau_falls(pipelines, humaneval):
    pipe = pipelines["ort"]
    per_call = []
    for tau in (0.9, 0.5, 0.1):
        outs = pipe.generate(humaneval[:6], method="mtad", tau=tau, num_beams=2, max_new_tokens=40, batch_size=3)
        per_call.append(sum(len(o.token_ids) for o in outs) / sum(o.stats.rounds for o in outs))
    assert per_call[0] < per_call[2]


def test_beams_never_take_impossible_tokens():
    from specrt.runtime.drafters.beam import top_beams

    with np.errstate(divide="ignore"):
        logq = np.log(np.array([[0.6, 0.4, 0.0, 0.0]]))  # a warped draft: two tokens have probability 0
    par, tok, sc = top_beams(np.zeros(1), logq, width=4)
    assert sorted(tok.tolist()) == [0, 1] and np.isfinite(sc).all()

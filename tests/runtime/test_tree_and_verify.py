import numpy as np
import pytest

from specrt.runtime.sampling import SamplingParams, top_k, warp
from specrt.runtime.tree import DraftTree
from specrt.runtime.verify import GreedyVerifier, RejectionVerifier

GREEDY = SamplingParams()


def one_hot_logits(best_per_row, vocab=8):
    logits = np.zeros((len(best_per_row), vocab), np.float32)
    logits[np.arange(len(best_per_row)), best_per_row] = 5.0
    return logits


def test_chain_mask_positions():
    t = DraftTree.chain([5, 6, 7])
    assert t.is_chain
    assert t.depths().tolist() == [0, 1, 2, 3]
    assert (t.mask() == np.tri(4, dtype=bool)).all()


def test_tree_mask_sees_ancestors_only():
    #        root
    #       /    \
    #     n0      n1
    #    /  \
    #  n2    n3
    t = DraftTree(np.array([1, 2, 3, 4]), np.array([-1, -1, 0, 0]))
    assert not t.is_chain
    assert t.depths().tolist() == [0, 1, 1, 2, 2]
    m = t.mask().astype(int)
    assert m.tolist() == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 0, 1, 0, 0],
                          [1, 1, 0, 1, 0],
                          [1, 1, 0, 0, 1]]


@pytest.mark.parametrize("best,path,bonus", [
    ([5, 6, 7, 1], [0, 1, 2], 1),   # all accepted, bonus from the last row
    ([5, 6, 0, 1], [0, 1], 0),      # third draft rejected: bonus is the target's token at row 2
    ([4, 6, 7, 1], [], 4),          # first rejected
])
def test_greedy_chain(best, path, bonus):
    v = GreedyVerifier().verify(DraftTree.chain([5, 6, 7]), one_hot_logits(best), GREEDY, None)
    assert v.path == path and v.bonus == bonus


def test_greedy_tree_follows_the_matching_branch():
    t = DraftTree(np.array([1, 2, 3, 4]), np.array([-1, -1, 1, 1]))  # root -> {1, 2}; 2 -> {3, 4}
    # target argmax: root->2, n1->4, n3->7
    best = [2, 0, 4, 0, 7]
    v = GreedyVerifier().verify(t, one_hot_logits(best), GREEDY, None)
    assert v.path == [1, 3] and v.bonus == 7


@pytest.mark.parametrize("shape,k", [((3, 49152), 8), ((2, 4, 49153), 5), ((7, 300), 4), ((2, 1000), 20),
                                     ((1, 4 * 49152), 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_is_a_full_sort_cut_to_k(shape, k, ties):
    """top_k ranks only the blocks whose maxima lead; it must give what sorting every entry gives (value, then the
    smaller index), ties spread over more blocks than k included."""
    x = np.random.default_rng(k).standard_normal(shape).astype(np.float32)
    if ties:
        x[..., ::97] = x.max()
        x[..., 5::301] = -np.inf
    flat = x.reshape(-1, shape[-1])
    want = np.stack([np.lexsort((np.arange(r.size), -r))[:k] for r in flat]).reshape(*shape[:-1], k)
    assert (top_k(x, k) == want).all()


def test_warp_top_k_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(p, [0.625, 0.375, 0, 0])
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert np.allclose(p, [0.625, 0.375, 0, 0])
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert np.allclose(p, np.array([0.5, 0.3, 0.15, 0]) / 0.95)


class ResidualFromTarget(RejectionVerifier):
    """A wrong sampler: after a rejection it samples from p, not norm(max(p - q, 0))."""

    def verify(self, tree, logits, params, rng):
        v = super().verify(tree, logits, params, rng)
        if not v.path and len(tree):
            p = warp(logits[0], params)
            return type(v)([], int(rng.choice(len(p), p=p)))
        return v


def first_token_distribution(verifier, p_logits, q_logits, params, trials, seed):
    """Empirical distribution of the first emitted token of a 2-token chain drafted from q."""
    rng = np.random.default_rng(seed)
    q = warp(q_logits, params)
    counts = np.zeros(len(p_logits[0]))
    drafts = np.stack([rng.choice(len(q[0]), size=trials, p=q[0]), rng.choice(len(q[1]), size=trials, p=q[1])], axis=1)
    for x0, x1 in drafts:  # [trials, 2] chains drafted from q
        tree = DraftTree.chain([x0, x1], q[:2])
        v = verifier.verify(tree, p_logits, params, rng)
        first = int(tree.tokens[v.path[0]]) if v.path else v.bonus
        counts[first] += 1
    return counts / trials


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)])
def test_rejection_sampling_reproduces_target_distribution(params):
    rng = np.random.default_rng(0)
    p_logits = rng.normal(size=(3, 6)) * 1.5
    q_logits = rng.normal(size=(2, 6)) * 1.5
    target = warp(p_logits[0], params)
    got = first_token_distribution(RejectionVerifier(), p_logits, q_logits, params, 20000, seed=1)
    assert 0.5 * np.abs(got - target).sum() < 0.015
    wrong = first_token_distribution(ResidualFromTarget(), p_logits, q_logits, params, 20000, seed=1)
    assert 0.5 * np.abs(wrong - target).sum() > 0.03  # the test can tell a wrong residual apart


def test_rejection_multi_round_over_siblings():
    """SpecInfer multi-round: with two i.i.d. children the first emitted token is still ~ p."""
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(3)
    p_logits = rng.normal(size=(3, 5)) * 2
    q = warp(rng.normal(size=5) * 2, params)
    target = warp(p_logits[0], params)
    counts = np.zeros(5)
    for _ in range(20000):
        a, b = rng.choice(5, p=q), rng.choice(5, p=q)
        tree = DraftTree(np.array([a, b]), np.array([-1, -1]), np.stack([q, q]))
        v = RejectionVerifier().verify(tree, p_logits, params, rng)
        counts[int(tree.tokens[v.path[0]]) if v.path else v.bonus] += 1
    assert 0.5 * np.abs(counts / counts.sum() - target).sum() < 0.015


# -- TreeSpec ------------------------------------------------------------------------------------
from specrt.runtime.tree import TreeSpec  # noqa: E402


def test_tree_spec_compiles_paths():
    spec = TreeSpec.from_paths([(1,), (0, 1), (0,), (0, 0), (1, 0), (0, 0, 0)])  # any order in
    assert spec.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert spec.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert spec.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert spec.ranks.tolist() == [0, 1, 0, 1, 0, 0]
    assert [lv.tolist() for lv in spec.levels] == [[0, 1], [2, 3, 4], [5]]
    assert spec.num_children.tolist() == [2, 2, 1, 1, 0, 0, 0]
    assert spec.children(-1).tolist() == [0, 1] and spec.children(0).tolist() == [2, 3]
    assert spec.row_depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert spec.row_mask[6].tolist() == [True, True, False, True, False, False, True]  # (0,0,0) sees (0,), (0,0)
    assert not spec.is_chain and TreeSpec.chain(4).is_chain
    assert not TreeSpec.from_paths([(1,), (1, 0)]).is_chain  # a single path, but not through best children


@pytest.mark.parametrize("paths,match", [([], "at least one"), ([(0, 0)], "no parent"), ([(-1,)], ">= 0")])
def test_tree_spec_rejects_bad_paths(paths, match):
    with pytest.raises(ValueError, match=match):
        TreeSpec.from_paths(paths)


def test_one_hot_rejection_over_a_tree_reproduces_target_distribution():
    """Deterministic (top-k) children verified as one-hot drafts: the first emitted token is ~ p."""
    params = SamplingParams(temperature=0.9, top_k=5)
    rng = np.random.default_rng(5)
    p_logits = rng.normal(size=(4, 6)) * 2
    tree = DraftTree(np.array([int(np.argmax(p_logits[0])), 3, 1]), np.array([-1, -1, 0]))  # no draft_probs
    target = warp(p_logits[0], params)
    counts = np.zeros(6)
    for _ in range(20000):
        v = RejectionVerifier().verify(tree, p_logits, params, rng)
        counts[int(tree.tokens[v.path[0]]) if v.path else v.bonus] += 1
    assert 0.5 * np.abs(counts / counts.sum() - target).sum() < 0.015


def test_retrieve_indices():
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    # leaves: (0,1) -> node 3, (1,0) -> node 4, (0,0,0) -> node 5; rows are node + 1
    assert spec.retrieve.tolist() == [[1, 4, -1], [2, 5, -1], [1, 3, 6]]


def test_vectorised_greedy_tree_verification_matches_the_walk():
    """Random trees and targets: retrieve-index verification == walking the tree node by node."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        paths = {(int(rng.integers(0, 3)),)}
        for _ in range(int(rng.integers(1, 12))):
            base = list(paths)[int(rng.integers(0, len(paths)))]
            paths.add(base + (int(rng.integers(0, 3)),))
        spec = TreeSpec.from_paths(paths)
        tokens = rng.integers(0, 4, len(spec))
        for parent in range(-1, len(spec)):  # siblings carry distinct tokens, as top-k children do
            kids = spec.children(parent)
            tokens[kids] = rng.permutation(6)[: len(kids)]
        best = rng.integers(0, 6, len(spec) + 1)
        logits = one_hot_logits(best, vocab=6)
        fast = GreedyVerifier().verify(DraftTree(tokens, spec.parents, spec=spec), logits, GREEDY, None)
        walk = GreedyVerifier().verify(DraftTree(tokens, spec.parents), logits, GREEDY, None)
        assert (fast.path, fast.bonus) == (walk.path, walk.bonus)


def logits_of(probs):
    return np.log(np.asarray(probs, np.float64))


def test_typical_threshold_by_hand():
    from specrt.runtime.verify import TypicalVerifier

    v = TypicalVerifier(epsilon=0.09, delta=0.3)
    # uniform over 4: H = log 4, delta * exp(-H) = 0.075 < epsilon; a peaked row: epsilon caps it
    assert v.thresholds(np.full(4, 0.25)) == pytest.approx(0.075)
    assert v.thresholds(np.array([0.97, 0.01, 0.01, 0.01])) == pytest.approx(0.09)


def test_typical_acceptance_keeps_plausible_tokens_and_takes_the_deepest_path():
    from specrt.runtime.verify import TypicalVerifier

    params = SamplingParams(temperature=1.0)
    v = TypicalVerifier(epsilon=0.09, delta=0.3)
    flat = [0.3, 0.3, 0.2, 0.2]  # threshold min(0.09, 0.3 exp(-H)) = 0.077: every token passes
    peaked = [0.94, 0.02, 0.02, 0.02]  # threshold 0.09: only token 0 passes
    #   root -> n0 (token 2, passes under flat) -> n2 (token 1, fails under peaked)
    #        -> n1 (token 3, passes)            -> n3 (token 0, passes) -> n4 (prompt id 9: never accepted)
    tree = DraftTree(np.array([2, 3, 1, 0, 9]), np.array([-1, -1, 0, 1, 3]))
    logits = logits_of([flat, peaked, [0.25] * 4, peaked, [0.25] * 4, peaked])
    for seed in range(20):
        verdict = v.verify(tree, logits, params, np.random.default_rng(seed))
        assert verdict.path == [1, 3]  # not the argmax at the root (token 0) nor n0's branch: the deeper one
        assert verdict.bonus in (0, 1, 2, 3)  # row of n3 is uniform: everything passes 0.075
    # a lone token below the threshold is rejected, and the bonus passes it: only token 0 under `peaked`
    lone = DraftTree.chain([1])
    bonuses = {v.verify(lone, logits_of([peaked, flat]), params, np.random.default_rng(s)).bonus for s in range(50)}
    assert bonuses == {0}
    with pytest.raises(ValueError, match="temperature > 0"):
        v.verify(lone, logits_of([peaked, flat]), GREEDY, np.random.default_rng(0))

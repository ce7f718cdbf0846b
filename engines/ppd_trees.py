"""PPD's sparse trees (section 4.2): from the prompt tokens' measured guess accuracy, the candidate paths of each
budget that maximise the expected accepted candidates per round, with their step rows (`specrt ppd train` builds
them, engines/ppd.py); the naive and random trees they are compared with."""

from __future__ import annotations

import numpy as np

from specrt.bundle.artifacts import PpdTree
from specrt.errors import SpecrtError


class PathModel:
    """P(every guess along a candidate path is right): measured jointly (`joint`: {path: probability}, paths never
    seen right count 0), or without it the product of the per-distance accuracies of `table` [k][K] (the
    independence assumption: what an accuracy table alone can say)."""

    def __init__(self, table, joint: dict | None = None):
        self.table = np.asarray(table, dtype=float)
        self.depth, self.ranks = self.table.shape
        self.joint = joint

    @classmethod
    def of(cls, tokens) -> "PathModel":
        """The measured model of a PromptTokens artifact."""
        return cls(tokens.accuracy, {tuple(h.path): h.accuracy for h in tokens.path_accuracy})

    def __call__(self, path: tuple[int, ...]) -> float:
        if not path:
            return 1.0
        if self.joint is not None:
            return self.joint.get(tuple(path), 0.0)
        return float(np.prod([self.table[d][r] for d, r in enumerate(path)]))


def _candidates(model: PathModel, count: int) -> list[tuple[int, ...]]:
    """The candidate tree of up to `count` nodes (depth <= model.depth) maximising the sum of path probabilities:
    best first, any rank of a child of a node in the tree (a path is never likelier than its parent, so the tree
    stays prefix-closed and each prefix of the list is the best tree of its size). Paths of probability 0 are
    never added."""
    paths: list[tuple[int, ...]] = []
    frontier: dict[tuple[int, ...], float] = {}

    def expand(base):
        if len(base) < model.depth:
            for r in range(model.ranks):
                if (p := model(base + (r,))) > 0:
                    frontier[base + (r,)] = p

    expand(())
    while len(paths) < count and frontier:
        best = max(frontier, key=lambda q: (frontier[q], -len(q), [-r for r in q]))
        del frontier[best]
        paths.append(best)
        expand(best)
    return paths


def score(model: PathModel, paths: list[tuple[int, ...]], prompts: list[int], e: int) -> tuple[float, float]:
    """(R, expected rows) of a sparse tree in its steady state: state s = the depth limit the last round's
    accepted node left (its prompt tokens); in state s the candidates of depth <= s are verified."""
    k = int(np.max(prompts)) if len(prompts) else 0
    nodes = [()] + list(paths)
    pp = np.array([model(q) for q in nodes])
    depth = np.array([len(q) for q in nodes])
    parent = np.array([-1] + [nodes.index(q[:-1]) for q in paths])
    states = k + 1
    trans, f, rows = np.zeros((states, states)), np.zeros(states), np.zeros(states)
    for s in range(states):
        live = depth <= s
        f[s] = pp[1:][live[1:]].sum()
        rows[s] = live[1:].sum() + e * np.asarray(prompts)[live].sum()
        end = pp * live  # P(round ends at c) = P(c accepted) - P(some child of c accepted)
        for c in np.flatnonzero(live)[1:]:
            end[parent[c]] -= pp[c]
        for c in np.flatnonzero(live):
            trans[s, prompts[c]] += max(end[c], 0.0)
    trans /= trans.sum(axis=1, keepdims=True)
    pi = np.full(states, 1.0 / states)
    for _ in range(500):  # power iteration: the chain is small and mixes fast
        pi = pi @ trans
    return float(pi @ f), float(pi @ rows)


def sparse_tree(model: PathModel, budget: int, e: int) -> PpdTree:
    """The best sparse tree of at most `budget` step rows beyond the root (section 4.2.1, appendix A)."""
    k = model.depth
    best = None
    ranked = _candidates(model, budget)
    for count in range(0, len(ranked) + 1):
        paths = ranked[:count]
        prompts = [k] * (len(paths) + 1)
        nodes = [()] + paths
        pp = [model(q) for q in nodes]
        f = [sum(pq for q, pq in zip(nodes[1:], pp[1:]) if len(q) <= m) for m in range(k + 1)]
        children = {i: [j for j, q in enumerate(nodes) if j and q[:-1] == nodes[i]] for i in range(len(nodes))}
        end = [pp[i] - sum(pp[j] for j in children[i]) for i in range(len(nodes))]
        while count + e * sum(prompts) > budget:
            # the root keeps one: a round that accepts nothing must still leave guesses for the next
            i = min((i for i in range(len(nodes)) if prompts[i] > (1 if i == 0 else 0)),
                    key=lambda i: (end[i] * (f[prompts[i]] - f[prompts[i] - 1]), -len(nodes[i]), -i), default=None)
            if i is None:
                break
            prompts[i] -= 1
        if count + e * sum(prompts) > budget:
            continue
        r, rows = score(model, paths, prompts, e)
        if best is None or r > best.expected_accepted + 1e-12:
            best = PpdTree(budget, tuple(paths), tuple(prompts), count + e * sum(prompts), round(rows, 4), round(r, 6))
    if best is None:
        raise SpecrtError(f"no PPD tree fits {budget} rows with {e} EPT(s) per prompt token")
    return best


def naive_tree(model: PathModel, budget: int, e: int) -> PpdTree:
    """The ablation without prompt-token pruning: the best candidate tree whose every node (root included) carries
    all k prompt tokens, within the budget."""
    k = model.depth
    if e * k > budget:
        raise SpecrtError(f"no naive PPD tree fits {budget} rows: the root alone carries {e * k}")
    paths = _candidates(model, (budget - e * k) // (1 + e * k))
    prompts = [k] * (len(paths) + 1)
    r, rows = score(model, paths, prompts, e)
    return PpdTree(budget, tuple(paths), tuple(prompts), len(paths) + e * sum(prompts), round(rows, 4), round(r, 6))


def random_tree(model: PathModel, tree: PpdTree, e: int, seed: int = 0) -> PpdTree:
    """The ablation with the same candidates and as many prompt tokens as `tree`, placed at random (the root keeps
    at least one)."""
    k = model.depth
    rng = np.random.default_rng(seed)
    prompts = [1] + [0] * len(tree.paths)
    for _ in range(sum(tree.prompts) - 1):
        room = [i for i, m in enumerate(prompts) if m < k]
        prompts[int(rng.choice(room))] += 1
    r, rows = score(model, list(tree.paths), prompts, e)
    return PpdTree(tree.budget, tree.paths, tuple(prompts), tree.rows, round(rows, 4), round(r, 6))


# -- the verb ------------------------------------------------------------------------------------------

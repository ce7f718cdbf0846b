"""DynamicTreeDrafter: a draft tree shaped anew every round by the draft's own confidence (EAGLE-2)."""

from __future__ import annotations

import numpy as np

from specrt.runtime.backends import Runner
from specrt.runtime.drafters.beam import BeamDrafter, SearchNodes


def tree_shape(num_nodes: int, beams: int | None = None, depth: int | None = None) -> tuple[int, int]:
    """(beams expanded per depth, depth) of a dynamic tree of `num_nodes` verified nodes, where they are not given:
    max(4, nodes // 4) beams; depth min(nodes, 8), since a level is reached with the product of the rank-0 acceptances
    above it and deep levels rarely are."""
    return beams or max(4, num_nodes // 4), depth or min(num_nodes, 8)


class DynamicTreeDrafter(BeamDrafter):
    """A dynamic draft tree (EAGLE-2, Li et al. 2024, section 4): the draft's beam search of `depth`
    tokens with `width` beams grows candidates where the draft is confident, then the `num_nodes` nodes
    with the highest joint log q over all depths are verified as one tree. A node scores no higher than
    its parent (log q <= 0), so the chosen set is a tree; a confident draft yields a long chain, an
    unsure one a bushy tree, per sequence and per round. Children are deterministic (top-k), so
    verification is exact match (greedy) or one-hot rejection (sampling): lossless either way.

    When greedy, nodes are scored with the draft's logits divided by `temperature`, the calibrated
    temperature (acceptance.json `draft_temperature`) at which the draft's probability of a token best
    predicts the target's greedy choice, i.e. greedy acceptance; raw log q ranks deep chains too low
    when the draft is under-confident. When sampling, one-hot acceptance of x is p(x), which the warped
    draft distribution already estimates.
    """

    sample_beams = False  # children are deterministic top-k, so one-hot verification stays lossless

    def __init__(self, runner: Runner, num_nodes: int, width: int, depth: int, bucket: int = 128,
                 temperature: float = 1.0):
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        super().__init__(runner, width, depth, bucket)
        self.num_nodes = num_nodes
        self.temperature = temperature

    def _expand(self, nodes: SearchNodes) -> list[int]:
        # A node scores no higher than its parent, and ties go to earlier nodes, so a node that does not beat
        # the num_nodes-th best score found so far has no descendant that can be chosen: feeding it is
        # wasted draft work. Search stops for a sequence when no node of its level beats it; the chosen
        # tree is the same as a full search's (tested).
        if len(nodes.scores) < self.num_nodes:
            return nodes.level
        bar = np.partition(np.asarray(nodes.scores), -self.num_nodes)[-self.num_nodes]
        return [i for i in nodes.level if nodes.scores[i] > bar]

    def _select(self, nodes: SearchNodes) -> set[int]:
        # highest joint log q first; ties go to the shallower (earlier) node, so ancestors come first
        order = sorted(range(len(nodes.tokens)), key=lambda i: (-nodes.scores[i], i))
        return nodes.closure(order[: self.num_nodes])

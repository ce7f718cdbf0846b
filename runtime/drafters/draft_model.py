"""DraftModelDrafter: the draft model fills a static TreeSpec (a chain for `sd`, a tree for `tree`)."""

from __future__ import annotations

import numpy as np

from specrt.runtime.backends import Runner
from specrt.runtime.backends.base import TopK, TopLogProbs
from specrt.runtime.drafters.base import ModelDrafter
from specrt.runtime.sampling import rng_of, sample, top_k, warp
from specrt.runtime.tree import DraftTree, TreeSpec


class _Layout:
    """A TreeSpec compiled for drafting: per level d >= 1, the nodes fed (those with children) and their visibility
    of earlier fed nodes; the children of each node."""

    def __init__(self, spec: TreeSpec):
        self.spec = spec
        self.plan = []
        fed: list[int] = []
        anc = spec.row_mask[1:, 1:]  # [N, N] ancestor-or-self
        for level in spec.levels[:-1]:
            expand = np.asarray([i for i in level if spec.num_children[i + 1] > 0], dtype=np.int64)
            vis = anc[np.ix_(expand, np.asarray(fed, dtype=np.int64))] if fed else np.zeros((len(expand), 0), bool)
            self.plan.append((expand, vis, np.eye(len(expand), dtype=bool)))
            fed += expand.tolist()
        self.children = [spec.children(i) for i in range(-1, len(spec))]  # [N + 1] by parent (root first)


class DraftModelDrafter(ModelDrafter):
    """Fills a TreeSpec with the draft model, one draft step per tree level.

    Level 0 feeds the pending tokens; the root's children are the draft's top-k tokens after them. Each
    later step feeds the nodes of one depth that have children in the spec: they are scratch rows in the
    draft cache (after the pending tokens), each seeing the committed prefix, its ancestors and itself;
    their top-k tokens become their children. A chain spec with temperature > 0 samples each token from
    the warped draft distribution q instead (and records q for lossless rejection sampling); trees use
    deterministic top-k children, verified against one-hot drafts.

    `spec` may also map batch sizes to TreeSpecs: each round drafts the tree of the largest batch size <= the live
    batch (the smallest's below it), so a batch that fills or drains switches its tree from one round to the next
    (the tuner's choice per batch size: `auto` over continuous batching).
    """

    def __init__(self, runner: Runner, spec: TreeSpec | dict[int, TreeSpec], bucket: int = 128):
        super().__init__(runner, bucket)
        by_batch = spec if isinstance(spec, dict) else {1: spec}
        self._layouts = {b: _Layout(t) for b, t in sorted(by_batch.items())}
        self._layout = next(iter(self._layouts.values()))

    def layout_for(self, batch: int) -> _Layout:
        """The tree drafted for a round of `batch` live sequences."""
        fit = [b for b in self._layouts if b <= batch]
        return self._layouts[fit[-1] if fit else next(iter(self._layouts))]

    def _fill(self, parents: np.ndarray, rows, tokens: np.ndarray, probs, params, rng) -> None:
        """Set the tokens of the children of `parents` (node ids, -1 = root) from their next-token logits rows
        [B, len(parents), V] (or, on a device, a TopK of their best tokens), all parents of one level at once."""
        kids = [self._layout.children[p + 1] for p in parents]
        if probs is not None:  # sampled chain: one child, drawn from q
            q = warp(rows[:, 0], params)
            for b in range(len(rows)):
                tokens[b, kids[0][0]] = sample(q[b], rng_of(rng, b))
                probs[b, kids[0][0]] = q[b]
            return
        child = np.concatenate(kids)  # [M] children of this level's parents
        which = np.repeat(np.arange(len(parents)), [len(k) for k in kids])  # [M] their parent's row
        rank = self._layout.spec.ranks[child]  # [M]
        if isinstance(rows, TopK):  # best first already
            tokens[:, child] = rows.tokens[:, which, rank]
            return
        k = int(rank.max()) + 1
        if k == 1:
            tokens[:, child] = rows.argmax(axis=-1)[:, which]
            return
        tokens[:, child] = top_k(rows, k)[:, which, rank]  # [B, P, k] best first

    def _node_inputs(self, expand: np.ndarray) -> dict:
        """What a step feeding the nodes `expand` takes besides their tokens (a head's features: EagleDrafter)."""
        return {}

    def _propose(self, seqs, params, rng):
        batch = len(seqs)
        self._layout = self.layout_for(batch)
        spec = self._layout.spec
        self._slots = np.full((batch, len(spec)), -1, dtype=np.int64)
        if params.greedy and spec.is_chain:
            return self._greedy_chain(seqs)
        sampled = spec.is_chain
        # a tree of top-k children on a device reads each fed node's k best tokens, not its logits (Runner.step's head)
        on_device = not sampled and not self.runner.backend.host_logits
        head = TopLogProbs(int(spec.ranks.max()) + 1) if on_device else "logits"
        root = self._feed_pending(seqs, head)
        tokens = np.zeros((batch, len(spec)), dtype=np.int64)
        probs = np.zeros((batch, len(spec), root.shape[-1])) if sampled else None
        self._fill(np.array([-1]), root[:, None], tokens, probs, params, rng)
        for expand, vis, block in self._layout.plan:
            logits, first_slot = self._step_nodes([tokens[b, expand] for b in range(batch)],
                                                  [spec.depths[expand]] * batch,
                                                  None if spec.is_chain else [vis] * batch, block, head,
                                                  **self._node_inputs(expand))
            self._slots[:, expand] = first_slot[:, None] + np.arange(len(expand))[None, :]
            self._fill(expand, logits[:, : len(expand)], tokens, probs, params, rng)
        if spec.is_chain:
            return [DraftTree.chain(tokens[b], probs[b]) for b in range(batch)]
        return [DraftTree(tokens[b], spec.parents, None, spec=spec) for b in range(batch)]

    def _greedy_chain(self, seqs) -> list[DraftTree]:
        """A greedy chain: each draft step's argmax is the next step's input where it lies (Runner.step's
        "device-argmax"). On a device the chain's steps queue one behind another and the host waits once, for all its
        tokens, instead of once a step; on ONNX Runtime the argmax is a host array as before."""
        batch = len(seqs)
        last = self._feed_pending(seqs, "device-argmax")[:, None]  # [B, 1]
        drafted = [last]
        for expand, _, block in self._layout.plan:  # one node a level
            last, first_slot = self._step_nodes(last, [self._layout.spec.depths[expand]] * batch, None, block,
                                                "device-argmax", **self._node_inputs(expand))
            self._slots[:, expand] = first_slot[:, None]
            drafted.append(last)
        tokens = self.runner.to_host(np.concatenate(drafted, axis=1) if isinstance(last, np.ndarray)
                                     else self.runner.backend.torch.cat(drafted, dim=1))  # [B, N]
        return [DraftTree.chain(tokens[b]) for b in range(batch)]

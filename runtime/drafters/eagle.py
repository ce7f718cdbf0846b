"""EagleDrafter: a feature-level draft head (EAGLE, Li et al. 2024; model/eagle.py) fills a static TreeSpec.

The head's step feeds, at position q, the token x_{q+1} beside the target's last hidden state n_q of position q
(contract.FEATURES); its LM head guesses x_{q+2} and its own hidden output guesses n_{q+1}, which feeds the next depth.
So the head's cache holds entry q only once the target has committed position q: the target's hidden states of the
rows it commits (every prefill row; each round's root and accepted path) come to `target_hidden`, and wait there as
pending entries. Invariant between rounds: the head's cache holds entries 0 .. lengths[b] - 1 of sequence b, all from
true hidden states, and its pending entries are the next ones, at least one (at the start the last prompt entry is
held back, as a draft model holds back the last prompt token).

A round feeds the pending entries (the last one's guesses are the root's children), then each level of the tree as
the draft model does (DraftModelDrafter), each node fed beside its parent's hidden output, which stays where the
backend holds it (on a GPU, a greedy chain waits for the device once a round, as a draft model's does). The scratch
entries are guesses: `commit` drops them all, and the accepted tokens come back next round with the target's true
hidden states.
"""

from __future__ import annotations

import numpy as np

from specrt.runtime.drafters.draft_model import DraftModelDrafter
from specrt.runtime.step_inputs import admit, feed_rows, prefill
from specrt.runtime.tree import DraftTree


def own_rows(hidden, first, count: int) -> list:
    """hidden [B, T, H] -> rows first[b] .. first[b] + count - 1 of each sequence b, copies of their own (the runner's
    buffer is reused by its next step) where hidden lies: float32 host arrays, or tensors on a torch backend's device,
    copied there behind the step without waiting for it (a draft chain's steps queue one behind another)."""
    if isinstance(hidden, np.ndarray):
        return [np.array(hidden[b, f:f + count], dtype=np.float32) for b, f in enumerate(first)]
    import torch

    with torch.inference_mode():
        return [hidden[b, f:f + count].clone() for b, f in enumerate(first)]


def _joined(parts: list):
    """Rows [n, H] end to end, where they lie."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


def host_rows(hidden, rows) -> list[np.ndarray]:
    """hidden [B, T, H] (numpy, or a torch tensor where a backend holds it) -> rows[b] of each sequence, float32 host
    arrays of their own (the runner's buffer is reused by its next step)."""
    if isinstance(hidden, np.ndarray):
        return [np.array(hidden[b, r], dtype=np.float32) for b, r in enumerate(rows)]
    import torch

    with torch.inference_mode():
        return [hidden[b, torch.as_tensor(np.asarray(r), device=hidden.device)].float().cpu().numpy()
                for b, r in enumerate(rows)]


class EagleDrafter(DraftModelDrafter):
    """DraftModelDrafter over a head whose step reads the hidden state before each token (module docstring)."""

    def __init__(self, runner, spec, bucket: int = 128):
        super().__init__(runner, spec, bucket)
        self._width = runner.entry.hidden_size
        self._pending: list[list[np.ndarray]] = []  # per sequence: the target's hidden rows not yet fed, in order
        self._hidden: dict[int, list[np.ndarray]] = {}  # this round: node (-1: root) -> its hidden output per sequence
        self._fed = None  # the nodes the next _step_nodes feeds

    def target_hidden(self, hidden, rows, first: int = 0) -> None:
        for b, got in enumerate(host_rows(hidden, rows), start=first):
            while len(self._pending) <= b:
                self._pending.append([])
            if len(got):
                self._pending[b].append(got)

    def _entries(self, seqs, first: int, hold_last: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(tokens, features) of each sequence's pending entries (the last one kept pending where `hold_last`), taken
        out of the pending ones; sequence b of `seqs` is batch row first + b."""
        tokens, features = [], []
        for b, s in enumerate(seqs, start=first):
            rows = self._pending[b] if b < len(self._pending) else []
            got = np.concatenate(rows) if rows else np.zeros((0, self._width), np.float32)
            keep = got[len(got) - 1:] if hold_last and len(got) else got[:0]
            got = got[:len(got) - len(keep)]
            done = int(self.cache.lengths[b]) if self.cache is not None and b < self.cache.batch else 0
            if done + 1 + len(got) + len(keep) != len(s.tokens):  # entry q holds x_{q+1} beside n_q
                raise RuntimeError(f"the head's entries of sequence {b} ({done} fed, {len(got) + len(keep)} pending) "
                                   f"do not follow its {len(s.tokens)} tokens")
            tokens.append(np.asarray(s.tokens[done + 1:done + 1 + len(got)], dtype=np.int64))
            features.append(got)
            if b < len(self._pending):
                self._pending[b] = [keep] if len(keep) else []
        return tokens, features

    def _start(self, seqs) -> None:
        self.cache = self.runner.new_cache(len(seqs), self.bucket)
        tokens, features = self._entries(seqs, 0, hold_last=True)
        prefill(self.runner, self.cache, tokens, features=features)

    def _admit(self, new) -> None:
        first = self.cache.batch
        tokens, features = self._entries(new, first, hold_last=True)
        admit(self.runner, self.cache, tokens, features=features)

    def _propose(self, seqs, params, rng):
        if not any(len(r) for rows in self._pending[:len(seqs)] for r in rows):
            # no entry to guess from anywhere (one-token prompts: the target has committed no position yet)
            self._anchor = self.cache.lengths.copy()
            return [DraftTree.empty() for _ in seqs]
        return super()._propose(seqs, params, rng)

    def _feed_pending(self, seqs, head: str = "logits"):
        tokens, features = self._entries(seqs, 0, hold_last=False)
        counts = [len(t) for t in tokens]
        root = feed_rows(self.runner, self.cache, tokens, head, last=True, features=features)
        self._hidden = {-1: own_rows(self.runner.last_hidden, [max(n, 1) - 1 for n in counts], 1)}
        self._anchor = self.cache.lengths.copy()
        return root

    def _node_inputs(self, expand: np.ndarray) -> dict:
        """Each fed node's features: its parent's hidden output. DraftModelDrafter calls this right before
        _step_nodes feeds `expand`, which then keeps their own hidden outputs for their children."""
        parents = self._layout.spec.parents[expand]
        self._fed = expand
        batch = len(self._hidden[-1])
        return {"features": [_joined([self._hidden[int(p)][b] for p in parents]) for b in range(batch)]}

    def _step_nodes(self, rows, depths, vis, blocks, head: str = "logits", features=None):
        out = super()._step_nodes(rows, depths, vis, blocks, head, features)
        hidden = own_rows(self.runner.last_hidden, [0] * len(features), len(self._fed))
        for i, node in enumerate(self._fed):
            self._hidden[int(node)] = [h[i:i + 1] for h in hidden]
        return out

    def commit(self, seqs, verdicts) -> None:
        """Every scratch entry was fed beside a guessed hidden state: all go (the accepted tokens are pending)."""
        for b in range(len(verdicts)):
            self.cache.compact(b, int(self._anchor[b]), [])

    def keep(self, rows) -> None:
        super().keep(rows)
        self._pending = [self._pending[r] for r in rows]

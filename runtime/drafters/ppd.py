"""PromptTokenDrafter: PPD, the target drafting for itself through trained prompt tokens (no draft model).

Each round's step holds the root, the candidate (guess) tokens of a sparse tree and, hanging off the root and
each candidate, chains of prompt tokens: prompt token d of EPT j (id V + (d - 1) * e + j) sits at depth d
below its owner and sees the owner's path and its own chain, so the tree mask is the ensemble mask.
The target's logits at a candidate verify the next candidate (exact match, or lossless one-hot rejection
when sampling: prompt ids are >= V, so no prompt row is ever accepted and their K/V never enter the cache).
The logits at the prompt tokens of the round's last accepted node (averaged over its EPTs) are the next
round's guesses: distance d's top ranks fill the candidates of depth d. A candidate carrying m prompt
tokens leaves the next round a tree cut to depth m (state m); the first round, with no guesses yet, is
the root and its prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.contract import prompt_token_id
from specrt.runtime.drafters.base import Drafter
from specrt.runtime.sampling import top_k
from specrt.runtime.tree import DraftTree, TreeSpec

PROMPT_RANK = 1 << 20  # prompt token j of a chain is child rank PROMPT_RANK + j in TreeSpec paths


@dataclass(frozen=True)
class Layout:
    """The static step tree of one state (depth limit s): where each candidate and prompt token sits."""

    spec: TreeSpec | None  # None: nothing to verify (no candidates and no prompt tokens)
    tokens: np.ndarray  # [N] prompt ids filled in, candidates 0
    candidates: np.ndarray  # [C, 3] (node, depth, rank) of each candidate
    owners: dict[int, np.ndarray]  # owner node (-1 = root) -> [m, e] nodes of its prompt tokens (distance, EPT)


def build_layout(paths, prompts, state: int, vocab: int, num_ensemble: int) -> Layout:
    """`paths`: candidate paths of the sparse tree; `prompts`: prompt tokens of the root, then of each candidate."""
    live = [(i, tuple(p)) for i, p in enumerate(paths) if len(p) <= state]
    owners = [((), prompts[0])] + [(p, prompts[i + 1]) for i, p in live]
    # chains[owner][d - 1][j]: the path of prompt token d of EPT j below its owner
    chains = {base: [[base + (PROMPT_RANK + j,) * d for j in range(num_ensemble)] for d in range(1, m + 1)]
              for base, m in owners}
    every = [p for _, p in live] + [q for rows in chains.values() for row in rows for q in row]
    if not every:
        return Layout(None, np.zeros(0, np.int64), np.zeros((0, 3), np.int64), {})
    spec = TreeSpec.from_paths(every)
    index = {p: i for i, p in enumerate(spec.paths)}
    tokens = np.zeros(len(spec), np.int64)
    nodes = {}
    for base, rows in chains.items():
        if rows:
            nodes[index[base] if base else -1] = np.array([[index[q] for q in row] for row in rows], np.int64)
            for d, row in enumerate(rows, start=1):
                for j, q in enumerate(row):
                    tokens[index[q]] = prompt_token_id(vocab, num_ensemble, d, j)
    tokens.flags.writeable = False
    candidates = np.array([(index[p], len(p), p[-1]) for _, p in live], np.int64).reshape(-1, 3)
    return Layout(spec, tokens, candidates, nodes)


DEFAULT_BUDGET = 16  # step rows beyond the root, where no latency profile says better


def ranked_guesses(logits, wanted, vocab: int, top: int) -> np.ndarray:
    """[sum m_b, top] best-first tokens of each wanted (b, rows [m_b, e]) prompt token: its rows' logits (of the step's
    [B, T, V]) averaged over its EPTs, ranked over the first `vocab` tokens. All sequences at once, where the logits
    lie: on a device only these tokens cross to the host (one copy), not the step's logits."""
    b_idx = np.concatenate([np.full(r.shape, b) for b, r in wanted])  # [M, e]
    r_idx = np.concatenate([r for _, r in wanted])  # [M, e]
    if not isinstance(logits, np.ndarray):  # a torch tensor on the target's device
        import torch

        from specrt.runtime.backends.base import torch_input

        index = [torch_input(torch, i, logits.device) for i in (b_idx, r_idx)]
        guess = logits[index[0], index[1]].float().mean(dim=1)[:, :vocab]  # [M, vocab]
        return guess.topk(min(top, vocab), dim=-1).indices.cpu().numpy()
    return top_k(logits[b_idx, r_idx].mean(axis=1)[:, :vocab], top)


class PromptTokenDrafter(Drafter):
    def __init__(self, paths, prompts, vocab: int, num_prompt_tokens: int, num_ensemble: int):
        self.vocab = vocab
        self.layouts = [build_layout(paths, prompts, s, vocab, num_ensemble) for s in range(num_prompt_tokens + 1)]
        self.top = 1 + max((p[-1] for p in paths), default=0)  # ranks a depth's candidates use
        self._state: list[int] = []
        self._guesses: list[np.ndarray | None] = []  # per sequence: [state, top] ranked guesses by depth
        self._logits = self._rows = None
        self._layout_of: list[Layout] = []

    def _start(self, seqs) -> None:
        self._state = [0] * len(seqs)
        self._guesses = [None] * len(seqs)

    def _admit(self, new) -> None:
        self._state += [0] * len(new)  # no guesses yet: the first round is the root and its prompt tokens
        self._guesses += [None] * len(new)

    def _propose(self, seqs, params, rng) -> list[DraftTree]:
        trees = []
        self._layout_of = []
        for b in range(len(seqs)):
            layout = self.layouts[self._state[b]]
            self._layout_of.append(layout)
            if layout.spec is None:
                trees.append(DraftTree.empty())
                continue
            tokens = layout.tokens.copy()
            if len(layout.candidates):
                node, depth, rank = layout.candidates.T
                tokens[node] = self._guesses[b][depth - 1, rank]
            trees.append(DraftTree(tokens, layout.spec.parents, is_chain=False, spec=layout.spec))
        return trees

    def target_logits(self, logits, rows=None) -> None:
        self._logits, self._rows = logits, rows

    def commit(self, seqs, verdicts) -> None:
        wanted = []  # (sequence, step rows [m, e] of the prompt tokens its next guesses come from)
        for b, verdict in enumerate(verdicts):
            layout = self._layout_of[b]
            owner = verdict.path[-1] if verdict.path else -1
            chain = layout.owners.get(owner)
            # merged with other drafts (MergedDrafter), the round may have accepted `beyond` more tokens past the owner
            # in another tree: the owner's guess of distance d + 1 + beyond is then the next round's distance d + 1
            if chain is not None:
                chain = chain[verdict.beyond:]
            if chain is None or not len(chain):  # no prompt token left to guess with: no guesses next round
                self._state[b], self._guesses[b] = 0, None
                continue
            wanted.append((b, chain + 1 if self._rows is None else self._rows[b][chain + 1]))  # node i: row i + 1
            self._state[b] = len(chain)
        if wanted:
            ranked = ranked_guesses(self._logits, wanted, self.vocab, self.top)
            for (b, rows), guesses in zip(wanted, np.split(ranked, np.cumsum([len(r) for _, r in wanted])[:-1])):
                self._guesses[b] = guesses

    def keep(self, rows) -> None:
        self._state = [self._state[r] for r in rows]
        self._guesses = [self._guesses[r] for r in rows]

"""ANPD: adaptive multi-level n-gram drafting (Ou et al., "Lossless Acceleration of Large Language Model
via Adaptive N-gram Parallel Decoding"; ../shared/papers/anpd-*.txt).

Each sequence has its own NgramMemory: for every n in 2..N, a table from the previous n - 1 tokens to
the most frequent next token seen after them. It is initialised from the prompt and updated online with
every emitted token. A query tries the longest context first and falls back to shorter ones (the
paper's Multi-Level N-gram, Algorithm 2); drafting chains K queries, each on the text plus the tokens
drafted so far, and stops early when no level matches. No model runs: proposing costs microseconds.

Cost: an update touches N - 1 table entries per token; a query at most N - 1 dict lookups. Both O(1).
Ties between next tokens go to the one seen most recently reaching the top count.

Beyond the paper (its chain is `branches=1`, `min_prob=0`): with `branches` > 1 the drafter returns a
token tree of up to K nodes, grown best-first by the estimated probability of each path, where a
node's children are the `branches` most frequent continuations at the longest matching level. A
context always followed by the same token keeps drafting a chain; one followed by several spends the
budget on its alternatives. With `min_prob` > 0, no node whose path estimate falls below it is drafted;
with `step_costs` (the profiled cost of verifying n drafted tokens), each round verifies the best-first
prefix of the tree that maximises expected tokens per millisecond, (1 + sum of path estimates) /
cost(n): where verifying one more token costs a noticeable fraction of a step (a CPU), drafting only
likely tokens pays (see bench ngram). One target step verifies the tree.

Estimates are adaptive too: how often the longest matching level's most frequent token turned out to be
the next token is counted online, per context length, on every emitted token. The most frequent
continuation is estimated at that hit rate, the others at the rest of the mass in proportion to their
counts (+ 1 for a continuation not seen yet). The hit rate depends strongly on the context length (far
lower after one token than after four, on the demo pair's HumanEval decoding), whatever the counts say,
so counts alone (count / total) mis-rank drafts.

A prior (NgramTable, beyond the paper): the most frequent continuation of each context in a corpus of the target's
own text (the bundle's ngram-prior.json, `specrt ngram prior`), shared read-only by every sequence. A query takes the
longest context that either the sequence's own memory or the prior knows, the sequence's own at equal length: what the
text itself repeats first, what the target habitually writes where the text has not (yet) said it. A corpus n-gram
datastore is REST's idea (He et al., 2023), here the target's own continuations rather than a human corpus.
"""

from __future__ import annotations

import heapq

import numpy as np

from specrt.runtime.drafters.base import Drafter
from specrt.runtime.tree import DraftTree


class NgramTable:
    """A read-only n-gram prior: per context length c = 1 .. N - 1, context -> its most frequent next token in the
    sequences it was made from (ties to the smaller id), and per length the leave-one-out rate at which that token was
    the next one (an occurrence predicted from the other occurrences of its context)."""

    def __init__(self, max_n: int, sequences):
        if max_n < 2:
            raise ValueError(f"n-gram order must be >= 2, got {max_n}")
        self.max_n = max_n
        self.tables: list[dict[tuple[int, ...], int]] = []
        self.hits: list[float] = []
        for c in range(1, max_n):
            rows = [np.lib.stride_tricks.sliding_window_view(np.asarray(s, dtype=np.int64), c + 1)
                    for s in sequences if len(s) > c]
            grams = np.concatenate(rows) if rows else np.zeros((0, c + 1), dtype=np.int64)
            pairs, counts = np.unique(grams, axis=0, return_counts=True)  # sorted by context, then next token
            _, start, per_context = np.unique(pairs[:, :c], axis=0, return_index=True, return_counts=True)
            if not len(start):
                self.tables.append({})
                self.hits.append(0.0)
                continue
            of = np.repeat(np.arange(len(start)), per_context)  # each pair's context
            top = counts == np.maximum.reduceat(counts, start)[of]
            best_at = np.flatnonzero(top)[np.unique(of[top], return_index=True)[1]]  # the first (smallest id) top
            totals = np.add.reduceat(counts, start)
            self.tables.append(dict(zip(map(tuple, pairs[best_at, :c].tolist()), pairs[best_at, c].tolist())))
            seen_twice = totals >= 2  # leave-one-out: an occurrence whose context occurs elsewhere too is a try
            self.hits.append(float((counts[best_at] - 1)[seen_twice].sum() / max(1, totals[seen_twice].sum())))

    def next_token(self, context: tuple[int, ...]) -> int | None:
        return self.tables[len(context) - 1].get(context)


class NgramMemory:
    def __init__(self, max_n: int, prior: NgramTable | None = None, prior_min_prob: float = 0.0):
        if max_n < 2:
            raise ValueError(f"n-gram order must be >= 2, got {max_n}")
        self.max_n = max_n
        self.prior = prior if prior is not None and prior.max_n >= max_n else None
        self.prior_min_prob = prior_min_prob  # no draft from the prior alone whose path estimate is lower
        # per context length c = n - 1 (index c - 1): context tuple -> [best_token, best_count, {token: count}, total]
        self._tables: list[dict[tuple[int, ...], list]] = [{} for _ in range(max_n - 1)]
        self._tail: list[int] = []  # the last max_n - 1 tokens seen
        # per context length: (hits, tries) of the longest matching level's most frequent token, counted
        # from a prior of one hit in two tries
        self._hits = [1.0] * (max_n - 1)
        self._tries = [2.0] * (max_n - 1)

    def update(self, tokens) -> None:
        """Record each token as the continuation of every context of 1..N-1 tokens before it."""
        tail = self._tail
        for tok in tokens:
            tok = int(tok)
            longest = None  # (context length, its most frequent token) of the longest level that matched
            for c in range(1, min(len(tail), self.max_n - 1) + 1):
                ctx = tuple(tail[-c:])
                entry = self._tables[c - 1].get(ctx)
                if entry is None:
                    self._tables[c - 1][ctx] = [tok, 1, {tok: 1}, 1]
                    continue
                longest = (c, entry[0])
                counts = entry[2]
                count = counts.get(tok, 0) + 1
                counts[tok] = count
                entry[3] += 1
                if count >= entry[1]:
                    entry[0], entry[1] = tok, count
            if longest is not None:
                self._tries[longest[0] - 1] += 1
                self._hits[longest[0] - 1] += longest[1] == tok
            tail.append(tok)
            if len(tail) > self.max_n - 1:
                del tail[0]

    def _longest(self, context) -> tuple[int, list | None, int | None]:
        """(c, own entry or None, the prior's token or None) of the longest suffix of `context` that this memory
        or its prior knows, this memory's first at equal length; (0, None, None) where neither knows any."""
        for c in range(min(len(context), self.max_n - 1), 0, -1):
            key = tuple(int(t) for t in context[-c:])
            entry = self._tables[c - 1].get(key)
            if entry is not None:
                return c, entry, None
            if self.prior is not None and (tok := self.prior.next_token(key)) is not None:
                return c, None, tok
        return 0, None, None

    def query(self, context) -> int | None:
        """Most frequent next token after the longest matching suffix of `context` (None: no match)."""
        _, entry, tok = self._longest(context)
        return entry[0] if entry is not None else tok

    def hit_rate(self, context_len: int) -> float:
        """How often the most frequent token after a matching context of this length came next."""
        return self._hits[context_len - 1] / self._tries[context_len - 1]

    def continuations(self, context, limit: int) -> list[tuple[int, float]]:
        """Up to `limit` (token, estimated probability) pairs after the longest matching suffix of `context`,
        most frequent first (the query's answer first): the level's hit rate for the most frequent token;
        the rest of the mass, (1 - hit rate) * count / (total + 1), for the others (+ 1: one not seen yet)."""
        return self._continuations(context, limit)[0]

    def _continuations(self, context, limit: int) -> tuple[list[tuple[int, float]], bool]:
        """(continuations(), whether they are the prior's)."""
        c, entry, tok = self._longest(context)
        if entry is None:  # the prior keeps one continuation, at its leave-one-out hit rate
            return ([] if tok is None else [(tok, self.prior.hits[c - 1])]), True
        counts = entry[2]
        best = entry[0]
        hit = self.hit_rate(c)
        rest = (1 - hit) / (entry[3] + 1)
        others = heapq.nlargest(limit - 1, (t for t in counts if t != best), key=counts.__getitem__)
        return [(best, hit)] + [(t, counts[t] * rest) for t in others], False

    def draft_tree(self, context, num_nodes: int, branches: int,
                   min_prob: float = 0.0) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, path probability estimates) of up to num_nodes nodes, best-first by estimated
        path probability, none below min_prob; parents come before their children (-1 = the root), so
        every prefix of the lists is a tree too."""
        keep = self.max_n - 1
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        contexts: list[list[int]] = []
        heap: list = []
        order = 0  # FIFO among equal probabilities: shallower and more frequent first

        def push(node: int, ctx: list[int], prob: float) -> None:
            nonlocal order
            found, prior = self._continuations(ctx, branches)
            for tok, rel in found:
                if prob * rel >= (max(min_prob, self.prior_min_prob) if prior else min_prob):
                    heapq.heappush(heap, (-prob * rel, order, node, tok))
                    order += 1

        push(-1, [int(t) for t in context[-keep:]], 1.0)
        while heap and len(tokens) < num_nodes:
            neg, _, parent, tok = heapq.heappop(heap)
            ctx = (contexts[parent] if parent >= 0 else [int(t) for t in context[-keep:]]) + [tok]
            contexts.append(ctx[-keep:])
            tokens.append(tok)
            parents.append(parent)
            probs.append(-neg)
            push(len(tokens) - 1, contexts[-1], -neg)
        return tokens, parents, probs

    def draft(self, context, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens, each the query on context + tokens drafted so far; a token from the prior alone
        ends the chain where the chain's path estimate (the product of the hit rates) would fall below
        prior_min_prob."""
        ctx = [int(t) for t in context[-(self.max_n - 1):]]
        out: list[int] = []
        prob = 1.0
        for _ in range(num_tokens):
            c, entry, tok = self._longest(ctx)
            prob *= self.hit_rate(c) if entry is not None else self.prior.hits[c - 1] if tok is not None else 0.0
            if entry is not None:
                tok = entry[0]
            elif tok is None or prob < self.prior_min_prob:
                break
            out.append(tok)
            ctx.append(tok)
            if len(ctx) > self.max_n - 1:
                del ctx[0]
        return out


def best_prefix(probs, step_costs, base: float = 1.0) -> int:
    """How many of the best-first nodes with path estimates `probs` to verify: the n that maximises
    (base + sum(probs[:n])) / step_costs[n], step_costs[n] being the cost of a round verifying n drafted
    tokens (n = 0 included: no draft) and `base` the tokens the round yields without them (1: the bonus token)."""
    n = min(len(probs), len(step_costs) - 1)
    if n < 0:
        return 0
    gain = base + np.concatenate([[0.0], np.cumsum(probs[:n])])
    return int(np.argmax(gain / np.asarray(step_costs[: n + 1])))


class NgramDrafter(Drafter):
    """One NgramMemory per sequence; per round a chain of up to K tokens, or with `branches` > 1 a tree
    of up to K nodes (one-hot drafts); with `step_costs`, the best-first prefix worth verifying.

    Merged behind other drafters (MergedDrafter), the round already verifies their nodes: `ahead` then holds, per
    sequence, (their merged tree this round, the tokens it is expected to yield, the ms its drafting took), and the
    prefix is chosen on the costs of the rows it adds to that tree plus those ms, from that many tokens expected
    (best_prefix's base)."""

    def __init__(self, max_n: int = 5, num_draft_tokens: int = 7, branches: int = 1, min_prob: float = 0.0,
                 step_costs=None, prior: NgramTable | None = None, prior_min_prob: float = 0.0):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        NgramMemory(max_n)  # validates max_n
        self.max_n = max_n
        self.num_draft_tokens = num_draft_tokens
        self.branches = branches
        self.min_prob = min_prob
        self.step_costs = step_costs  # ms of a round verifying 0, 1, ... drafted tokens, or None
        self.prior = prior  # every sequence's memory falls back on it (module docstring), or None
        self.prior_min_prob = prior_min_prob
        self.ahead: list[tuple[DraftTree, float, float]] | None = None  # set each round by a MergedDrafter (above)
        self.memories: list[NgramMemory] = []
        self._seen: list[int] = []  # tokens of each sequence already in its memory

    def _start(self, seqs) -> None:
        self.memories = [NgramMemory(self.max_n, self.prior, self.prior_min_prob) for _ in seqs]
        self._seen = [0] * len(seqs)

    def _admit(self, new) -> None:
        self.memories += [NgramMemory(self.max_n, self.prior, self.prior_min_prob) for _ in new]
        self._seen += [0] * len(new)

    def _propose(self, seqs, params, rng) -> list[DraftTree]:
        trees = []
        for b, s in enumerate(seqs):
            tokens = s.tokens
            self.memories[b].update(tokens[self._seen[b]:])  # the prompt at first, then what was emitted
            self._seen[b] = len(tokens)
            if self.branches == 1 and self.min_prob == 0 and self.step_costs is None:
                trees.append(DraftTree.chain(np.asarray(self.memories[b].draft(tokens, self.num_draft_tokens), dtype=np.int64)))
                continue
            toks, parents, probs = self.memories[b].draft_tree(tokens, self.num_draft_tokens, self.branches, self.min_prob)
            if self.step_costs is None:
                n = len(toks)
            elif self.ahead is None:
                n = best_prefix(probs, self.step_costs)
            else:
                n = self._best_behind(toks, parents, probs, *self.ahead[b])
            trees.append(DraftTree(np.asarray(toks[:n], dtype=np.int64), np.asarray(parents[:n], dtype=np.int64)))
        return trees

    def _best_behind(self, toks, parents, probs, prior: DraftTree, expected: float, spent: float) -> int:
        """best_prefix behind the other drafters' tree `prior` (class docstring): a drafted node whose path of tokens
        `prior` already holds adds no step row and no expected token (they are counted in `prior`'s)."""
        held = []  # per drafted node: its node in prior, or -1 (new, and so are its descendants)
        for tok, par in zip(toks, parents):
            at = -1 if par < 0 else held[par]
            kids = [] if par >= 0 and at < 0 else prior.children(at)
            held.append(next((int(k) for k in kids if prior.tokens[k] == tok), -1))
        new = np.asarray(held) < 0
        rows = len(prior) + np.concatenate([[0], np.cumsum(new)])  # drafted rows of the round with n of these nodes
        fits = int(np.searchsorted(rows, len(self.step_costs), side="left"))  # prefixes whose step is profiled
        costs = np.asarray(self.step_costs)[rows[:fits]] + spent
        return best_prefix(np.where(new, probs, 0.0)[: max(0, fits - 1)], costs, 1.0 + expected)

    def keep(self, rows) -> None:
        self.memories = [self.memories[r] for r in rows]
        self._seen = [self._seen[r] for r in rows]

"""latency.json (`specrt profile`): step latency L(n) per model, batch size and context, prefill and host work."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from specrt.bundle.artifacts.base import Artifact
from specrt.errors import SpecrtError




def roofline_ms(weight_bytes: int, copy_bandwidth: float) -> float:
    """The least time a step can take: every weight read once at a copy bandwidth (bytes per second)."""
    return 1e3 * weight_bytes / copy_bandwidth


@functools.lru_cache(maxsize=4096)
def nondecreasing(values: tuple[float, ...]) -> tuple[float, ...]:
    """The least-squares non-decreasing fit of a sequence (pool adjacent violators): a profiled cost that falls
    as the work grows (a step of more tokens, a round of more nodes) is noise, and the tuner must not pick a
    tree for it, so each run of such points is replaced by its mean."""
    blocks: list[tuple[float, int]] = []  # (mean, points pooled)
    for v in values:
        blocks.append((float(v), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2))
    return tuple(m for m, c in blocks for _ in range(c))


@dataclass(frozen=True)
class LatencyProfile(Artifact):
    FILE: ClassVar[str] = "latency.json"
    FORMAT: ClassVar[int] = 2  # 2: copy_bandwidth, host_batch, packed_rows, cache_bucket always recorded
    COMMAND: ClassVar[str] = "specrt profile --bundle {bundle} {flags}"
    PER_VARIANT: ClassVar[bool] = True  # a quantized step costs less

    config: dict  # the ProfileConfig it was made with
    models: dict[str, dict[int, dict[int, dict[int, float]]]]  # role -> batch -> context -> new tokens -> ms
    host_ms: dict[str, dict[int, float]]  # kind (runtime/speculation.py) -> tree nodes -> host ms per round, batch 1
    copy_bandwidth: float  # the device's measured copy bandwidth, bytes read + written per second
    # kind -> batch size (> 1) -> tree nodes -> host ms per round: host work grows with the batch ({}: batch 1 only)
    host_batch: dict[str, dict[int, dict[int, float]]]
    # the target's backend left holes out of its token-wise work (Backend.packs_rows): a ragged step costs about L at
    # its mean width, not its widest (False: it computes them)
    packed_rows: bool
    # slots the profiled KV caches grew by (capacity: a multiple of it; a static cache's: its whole capacity): what
    # at_context prices a context by
    cache_bucket: int
    # a static cache's attention spans (the static engines' EngineSet.spans): a step over c cached tokens attends over
    # the smallest span >= c, which at_context prices it by instead (None: no spans)
    cache_spans: tuple[int, ...] | None = None
    # role -> batch -> tokens per sequence -> ms of one prefill step of that many prompt tokens per sequence into an
    # empty cache (a prompt's tokens cost more there than in a decode-shaped step of as many rows: attention over the
    # step's own tokens grows with them); prefill_chunk: the tokens per sequence per step the pipeline prefilled in
    # (None: profiled with no --prefill-tokens; prefill_step_ms then prices it from the decode curves)
    prefill: dict[str, dict[int, dict[int, float]]] | None = None
    prefill_chunk: int | None = None

    def roofline_ms(self, weight_bytes: int) -> float:
        """The least time one step can take: every weight read once at the measured bandwidth."""
        return roofline_ms(weight_bytes, self.copy_bandwidth)

    def batch_sizes(self, role: str = "target") -> list[int]:
        return sorted(self.models[role])

    def at_context(self, context: float) -> LatencyProfile:
        """This profile with one curve per batch size, each point at `context` cached tokens per sequence (a batch's:
        its longest sequence's). A step attends over the cache's capacity, which grows by `cache_bucket` slots: each
        point is the profiled one at the same capacity, linear between profiled capacities, the smallest's below
        them, along the line through the two largest (never falling) above them. Engines with attention spans (cache_spans) attend over the span the cached
        context fits, which stands for the capacity. Without it, step_ms averages over the profiled contexts."""
        def capacity(cached: float, new: int) -> float:
            if self.cache_spans:
                return next((s for s in self.cache_spans if cached <= s), self.cache_spans[-1])
            tokens = cached + new
            return -(-tokens // self.cache_bucket) * self.cache_bucket

        models = {}
        for role, per_batch in self.models.items():
            models[role] = {}
            for b, per_context in per_batch.items():
                ns = sorted(set.intersection(*(set(curve) for curve in per_context.values())))
                curve = {}
                for n in ns:
                    at: dict[float, list[float]] = {}  # capacity -> the profiled points there
                    for c, points in per_context.items():
                        at.setdefault(capacity(c, n), []).append(points[n])
                    xs = sorted(at)
                    ys = [float(np.mean(at[x])) for x in xs]
                    x = capacity(context, n)
                    if x > xs[-1] and len(xs) > 1:
                        curve[n] = ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) * (x - xs[-1])
                    else:
                        curve[n] = float(np.interp(x, xs, ys))
                models[role][b] = {round(context): curve}
        return replace(self, models=models)

    def step_ms(self, role: str, batch: float, num_tokens: float) -> float:
        """L(n) at a batch size, averaged over the profiled contexts, linear between profiled n of the curve's
        non-decreasing fit; between two profiled batch sizes, linear between theirs (a batch that drains runs at
        every size below its own)."""
        per_batch = self.models[role].get(batch)
        if per_batch is None:
            sizes = self.batch_sizes(role)
            if not sizes[0] < batch < sizes[-1]:
                raise SpecrtError(f"batch size {batch} was not profiled (profiled: {sizes})")
            lo = max(b for b in sizes if b < batch)
            hi = min(b for b in sizes if b > batch)
            w = (batch - lo) / (hi - lo)
            return (1 - w) * self.step_ms(role, lo, num_tokens) + w * self.step_ms(role, hi, num_tokens)
        values = []
        for curve in per_batch.values():
            ns = sorted(curve)
            if num_tokens > ns[-1]:
                raise SpecrtError(f"{role} was profiled up to {ns[-1]} tokens at batch {batch}, not {num_tokens}")
            values.append(float(np.interp(num_tokens, ns, nondecreasing(tuple(curve[n] for n in ns)))))
        return float(np.mean(values))

    def prefill_step_ms(self, role: str, rows: int, lens: list[int]) -> float:
        """Ms of one prefill step of `rows` sequences of which these feed `lens` prompt tokens (the others, if
        any, are empty rows of a static cache). A ragged step is as wide as its longest row for every sequence;
        a backend that packs rows leaves the holes out, so it costs the per-token price of a step that wide, times
        its tokens. Per-token prices: the prefill profile's, linear between profiled widths and batch sizes (the
        nearest profiled one beyond them); without one, the decode curve's largest step at the largest profiled
        batch size <= rows."""
        width = max(lens)
        tokens = sum(lens) if self.packed_rows else rows * width
        if not self.prefill or role not in self.prefill:
            sizes = self.batch_sizes(role)
            batch = max([b for b in sizes if b <= rows] or sizes[:1])
            largest = min(max(curve) for curve in self.models[role][batch].values())
            return self.step_ms(role, batch, largest) / (batch * largest) * tokens
        per_batch = self.prefill[role]
        sizes = sorted(per_batch)

        def per_token(b: int) -> float:
            curve = per_batch[b]
            ns = sorted(curve)
            return float(np.interp(width, ns, [curve[n] / (b * n) for n in ns]))

        return float(np.interp(rows, sizes, [per_token(b) for b in sizes])) * tokens

    def host(self, num_nodes: float, kinds: str | tuple[str, ...] = ("tree",), batch: float = 1) -> float:
        """Host ms per round for a tree of num_nodes (0 = autoregressive) at a batch size, linear between measured
        sizes (of their non-decreasing fit) and batch sizes (beyond the largest profiled batch, along the line
        through the two largest); of the first of `kinds` profiled (a kind's own, then the simpler ones it is priced
        as where the profile lacks it: SpeculationKind.host), else 0."""
        for k in (kinds,) if isinstance(kinds, str) else kinds:
            table = self.host_ms.get(k)
            if table:
                tables = {1: table, **self.host_batch.get(k, {})}
                sizes = sorted(tables)
                ys = [float(np.interp(num_nodes, sorted(tables[b]),
                                      nondecreasing(tuple(tables[b][n] for n in sorted(tables[b]))))) for b in sizes]
                if batch > sizes[-1] and len(sizes) > 1:
                    slope = (ys[-1] - ys[-2]) / (sizes[-1] - sizes[-2])
                    return max(0.0, ys[-1] + slope * (batch - sizes[-1]))
                return float(np.interp(batch, sizes, ys))
        return 0.0

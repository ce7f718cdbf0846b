"""`specrt profile`: latency L(n) of each model's step at n new tokens, per batch size and context.

Each point is the median of `repeats` timed steps after `warmup` untimed ones, on a cache filled to
`context` slots (contents do not change the cost). Points with batch * n above `max_tokens_per_step`
are skipped (CPU time). It also measures the runtime's own host work per decode round (masks, drafting
bookkeeping, verification, cache commits: everything outside model calls) for static and dynamic trees
of several sizes at every profiled batch size (fewer sizes above batch 1), since on small models that is a
real part of a round that grows with the batch (a dynamic tree's beam search is host work at every depth,
per sequence), and the device's copy bandwidth, for the roofline: a step must read
every weight once, so no step is faster than weight bytes / bandwidth. Writes latency.json (a
LatencyProfile, stamped with this machine, backend, threads and device) into the bundle and latency.png
beside it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import LatencyProfile, Stamp, variant_quant
from specrt.calibration.acceptance import MERGE_NGRAM_TOKENS, best_trees
from specrt.checkpoints.corpus import validation_prompts
from specrt.bundle.manifest import BundleOptions
from specrt.config import config_dict, option
from specrt.runtime.backends import BackendOptions
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.plotting import pyplot, save_figure

NUM_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
HOST_TREE_SIZES = (0, 1, 4, 8, 16, 32, 63)
HOST_DYNAMIC_SIZES = (2, 8, 16, 32)
HOST_BATCH_SIZES = {"tree": (0, 4, 16, 63), "dynamic": (8, 32), "merged": (8, 32)}  # per kind, at batch > 1


@dataclass(frozen=True)
class ProfileConfig(BundleOptions, BackendOptions):
    batch_sizes: tuple[int, ...] = option((1, 2, 4, 8), "batch sizes to profile")
    contexts: tuple[int, ...] = option((128, 512), "cached tokens per sequence to profile at")
    num_tokens: tuple[int, ...] = option(NUM_TOKENS, "new tokens per step to profile")
    repeats: int = option(5, "timed steps per point (the median is kept)", ge=1)
    warmup: int = option(2, "untimed steps per point", ge=0)
    max_tokens_per_step: int = option(512, "skip points with batch * new tokens above this", ge=1)
    variants: tuple[str, ...] = option((), "profile these variants of the step graphs (exported and quantized schemes) "
                                           "in one run, each point of each variant timed side by side, each into its "
                                           "own latency.json: what `tune --variants` compares, under the same load "
                                           "(default: the one --quant selects)")

    def __post_init__(self):
        super().__post_init__()
        if self.variants and self.quant is not None:
            raise InvalidRequestError("give --quant (one variant) or --variants (several), not both")
        if len(set(self.variants)) < len(self.variants):
            raise InvalidRequestError(f"variants must name each variant once, got {list(self.variants)}")


def copy_bandwidth(device: str, size_mb: int = 1024, repeats: int = 5) -> float:
    """Bytes per second (read + write) of copying a size_mb buffer on `device` ("cpu" or "cuda:N"): the best
    of `repeats` copies of a buffer far larger than any cache."""
    n = size_mb * 2**20
    if device.startswith("cuda"):
        import torch

        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return 2 * n / best
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def time_step(runner, batch: int, num_tokens: int, context: int, repeats: int, warmup: int) -> float:
    """Median seconds of one step of `num_tokens` new tokens per sequence after `context` cached ones."""
    from specrt.runtime.step_inputs import pack_step

    cache = runner.new_cache(batch)
    cache.reserve(context + num_tokens)
    cache.lengths[:] = context
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, runner.entry.vocab_size, num_tokens) for _ in range(batch)]
    ids, pos, mask = pack_step(cache, rows, [context + np.arange(num_tokens)] * batch)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        runner.step(ids, pos, mask, cache)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(cfg: ProfileConfig, progress: bool = True) -> dict[str | None, LatencyProfile]:
    """Profile the variant --quant selects, or each of cfg.variants side by side; quant -> what was written."""
    from contextlib import ExitStack

    from tqdm import tqdm

    from specrt.runtime.pipeline import Pipeline

    quants = [variant_quant(v) for v in cfg.variants] if cfg.variants else [cfg.quant]
    pipes = {q: Pipeline.load(cfg.bundle, **{**cfg.pipeline_options(), "quant": q}) for q in quants}
    largest = min(p.target.max_step_tokens or max(cfg.num_tokens) for p in pipes.values())  # static-shape engines
    points = [(role, b, c, n) for role in ("target", "draft") for b in cfg.batch_sizes for c in cfg.contexts
              for n in cfg.num_tokens if b * n <= cfg.max_tokens_per_step and n <= largest]
    if not points:
        raise SpecrtError("nothing to profile: every batch * num_tokens exceeds max_tokens_per_step")
    too_long = max(cfg.contexts) + max(cfg.num_tokens)
    if too_long > min(p.max_context for p in pipes.values()):
        raise SpecrtError(f"context {max(cfg.contexts)} + {max(cfg.num_tokens)} tokens exceeds the model's "
                          f"{min(p.max_context for p in pipes.values())}")
    models: dict = {q: {"target": {}, "draft": {}} for q in quants}
    with ExitStack() as stack:  # given back before host_per_round decodes
        runners = {(q, role): stack.enter_context(getattr(p, role).runner()) for q, p in pipes.items()
                   for role in ("target", "draft")}
        for role, b, c, n in tqdm(points, desc="profile", unit="point", disable=not progress):
            for q in quants:  # variants side by side: a point's costs compared under the same load
                ms = 1e3 * time_step(runners[q, role], b, n, c, cfg.repeats, cfg.warmup)
                models[q][role].setdefault(b, {}).setdefault(c, {})[n] = round(ms, 4)
    bandwidth = round(copy_bandwidth(next(iter(pipes.values())).machine.device))
    out = {}
    for q, pipe in pipes.items():
        host = [(kind, b) for b in sorted(set(cfg.batch_sizes) | {1}) for kind in HOST_BATCH_SIZES]
        host_ms, host_batch = {}, {}
        for kind, b in tqdm(host, desc=f"profile host work{f' ({q})' if q else ''}", unit="point",
                            disable=not progress):
            table = host_per_round(pipe, kind, b)
            if b == 1:
                host_ms[kind] = table
            else:
                host_batch.setdefault(kind, {})[b] = table
        data = LatencyProfile(stamp=Stamp.make(cfg.bundle, pipe.machine), config=config_dict(cfg), models=models[q],
                              host_ms=host_ms, copy_bandwidth=bandwidth, host_batch=host_batch)
        path = artifacts.save(cfg.bundle, data, quant=q)
        plot_latency(data, path.with_suffix(".png"))
        out[q] = data
    return out


def host_per_round(pipe, kind: str = "tree", batch: int = 1, new_tokens: int = 48) -> dict[int, float]:
    """Host milliseconds per decode round (outside any model call) by tree size, at a batch size.

    kind "tree": static trees from a fixed synthetic acceptance table (the shape calibration would build);
    size 0 is autoregressive. "dynamic": dynamic trees of HOST_DYNAMIC_SIZES nodes; "merged": the same
    with MERGE_NGRAM_TOKENS n-gram drafts merged in (sizes count the draft model's nodes); above batch 1,
    the HOST_BATCH_SIZES of each kind. Two generations per size on `batch` held-out prompts in one batch (of
    new_tokens each, a third of that above batch 1); the second is measured."""
    prompts = validation_prompts(pipe.encode, batch, 64, seed=0)
    sizes = (HOST_TREE_SIZES if kind == "tree" else HOST_DYNAMIC_SIZES) if batch == 1 else HOST_BATCH_SIZES[kind]
    new_tokens = new_tokens if batch == 1 else max(8, new_tokens // 3)
    trees = {t.num_nodes: t.paths for t in best_trees(np.array([[0.7, 0.15, 0.07, 0.03]] * 8), max(HOST_TREE_SIZES))}
    largest = pipe.target.max_step_tokens  # a round's target step holds the root, the nodes and any n-gram drafts
    extra = 1 + (MERGE_NGRAM_TOKENS if kind == "merged" else 0)
    out = {}
    for n in [n for n in sizes if not largest or n + extra <= largest]:
        if kind != "tree":
            kw = {"method": "dynamic", "num_draft_tokens": n, "ngram_tokens": MERGE_NGRAM_TOKENS if kind == "merged" else 0}
        else:
            kw = {"method": "autoregressive"} if n == 0 else {"method": "tree", "tree": trees[n]}
        for _ in range(2):
            stats = pipe.generate(prompts, max_new_tokens=new_tokens, batch_size=batch, **kw)[0].stats
        out[n] = round(1e3 * stats.seconds.host / max(1, stats.rounds), 4)
    return out


def plot_latency(data: LatencyProfile, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    m = data.stamp.machine
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, role in zip(axes, ("target", "draft")):
        for b, per_ctx in sorted(data.models[role].items()):
            for c, curve in sorted(per_ctx.items()):
                ns = sorted(curve)
                ax.plot(ns, [curve[n] for n in ns], marker=".", label=f"batch {b}, context {c}")
        ax.set_xlabel("new tokens per sequence (n)")
        ax.set_ylabel("step latency (ms, median)")
        ax.set_title(f"{role}: L(n), {m.backend}, {m.threads} threads, {m.gpu or m.device}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)

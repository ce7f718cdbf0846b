"""`specrt profile`: latency L(n) of each model's step at n new tokens, per batch size and context.

Each point is the median of `repeats` timed steps after `warmup` untimed ones in each of `passes` passes over
all points, on a cache filled to `context` slots (contents do not change the cost). Every pass visits the
points in a new random order, so that a machine whose speed drifts over minutes (a shared VM, a GPU's clocks)
shifts every point alike rather than some against others: the tuner compares points, and on sub-millisecond
steps that drift was larger than the differences it weighs. A draft step is timed after an untimed target
step, as in a decode round, where the target's step has just pushed the draft's weights out of the caches.
Points with batch * n above `max_tokens_per_step` are skipped (CPU time).

Prefill steps are points of the same passes: `prefill_tokens` prompt tokens for each of `batch` sequences into an
empty cache (none wider than the pipeline's prefill chunk, none with batch * tokens above `max_prefill_tokens`),
what the batch cost model prices admitting requests by (LatencyProfile.prefill_step_ms): a prompt token costs
more there than a decode step's row does, and at batch 1 with 16 tokens twice what it does with 256 (the inflated
target on 2 cores, `latency-inflated-prefill` in bench/results).

It also measures the runtime's own host work per decode round (masks, drafting bookkeeping, verification,
cache commits: everything outside model calls) for static and dynamic trees of several sizes at every
profiled batch size (fewer sizes above batch 1), since on small models that is a real part of a round that
grows with the batch (a dynamic tree's beam search is host work at every depth, per sequence), and the
device's copy bandwidth, for the roofline: a step must read every weight once, so no step is faster than
weight bytes / bandwidth. Writes latency.json (a LatencyProfile, stamped with this machine, backend, threads
and device) into the bundle and latency.png beside it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import LatencyProfile, Stamp, nondecreasing, variant_quant
from specrt.checkpoints.corpus import validation_prompts
from specrt.bundle.manifest import BundleOptions
from specrt.config import config_dict, option
from specrt.runtime.backends import BackendOptions
from specrt.runtime.methods import runs_with
from specrt.runtime.speculation import SPECULATION
from specrt.runtime.step_inputs import PREFILL_CHUNK
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.plotting import pyplot, save_figure

NUM_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
PREFILL_TOKENS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ProfileConfig(BundleOptions, BackendOptions):
    batch_sizes: tuple[int, ...] = option((1, 2, 4, 8), "batch sizes to profile", ge=1, nonempty=True)
    contexts: tuple[int, ...] = option((128, 512), "cached tokens per sequence to profile at", ge=0, nonempty=True)
    num_tokens: tuple[int, ...] = option(NUM_TOKENS, "new tokens per step to profile", ge=1, nonempty=True)
    repeats: int = option(3, "timed steps per point per pass (the median over all passes is kept)", ge=1)
    warmup: int = option(1, "untimed steps per point per pass", ge=0)
    passes: int = option(3, "passes over every point (and host-work configuration), each in a new random order",
                         ge=1)
    max_tokens_per_step: int = option(512, "skip points with batch * new tokens above this", ge=1)
    prefill_tokens: tuple[int, ...] = option(PREFILL_TOKENS, "prompt tokens per sequence of the prefill steps to "
                                                             "profile (from an empty cache; none above the pipeline's "
                                                             "prefill chunk)", ge=1)
    prefill_repeats: int = option(1, "timed prefill steps per point per pass", ge=1)
    max_prefill_tokens: int = option(2048, "skip prefill points with batch * prompt tokens above this", ge=1)
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


def same_state(a: float, b: float) -> bool:
    """Whether two copy bandwidths measured on one machine are within a quarter of each other. A shared machine's
    memory moves between states with its other tenants' load (26 and 50 GB/s hours apart on this project's 2-core
    CPU); a one-token step slows with it while a verification row's arithmetic does not, so costs profiled in one
    state mislead the hardware-aware choices in the other."""
    return 0.8 <= a / b <= 1.25


def profiled_bandwidth(pipe, bandwidth: float) -> float | None:
    """GB/s of copy bandwidth the bundle's latency profile was measured at, where it has one for this machine (the
    hardware-aware rows and `auto` choose by its costs); warns where the machine is in another state now
    (same_state)."""
    import warnings

    try:
        profiled = pipe.evidence.latency().copy_bandwidth
    except SpecrtError:  # none, or not this machine's: those rows say so themselves
        return None
    if not profiled:
        return None
    if not same_state(bandwidth, profiled):
        warnings.warn(f"the latency profile's costs were measured at {profiled / 1e9:.1f} GB/s of copy bandwidth, "
                      f"this run's at {bandwidth / 1e9:.1f}: the machine was in another state then, so the "
                      "hardware-aware rows choose by costs it does not have now (run `specrt profile` again)",
                      RuntimeWarning, stacklevel=2)
    return round(profiled / 1e9, 1)


def copy_bandwidth(device: str, threads: int = 1, size_mb: int = 1024, repeats: int = 5) -> float:
    """Bytes per second (read + write) of copying a size_mb buffer on `device` ("cpu" or "cuda:N"): the best
    of `repeats` copies of a buffer far larger than any cache. On the CPU, `threads` copy a slice each at once, as
    the step's intra-op threads read its weights (a one-thread copy put SmolLM2's 2-thread AR at up to 124% of the
    roofline; with the step's two it reads 60-75%: `e2e-smollm2-135m-chat-l2-peers`, `-humaneval-l2-peers`, `-chat30`)."""
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
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    bounds = [i * n // threads for i in range(threads + 1)]
    slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:  # numpy copies with the GIL released
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda s: np.copyto(dst[s], src[s]), slices))
            best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def step_args(runner, batch: int, num_tokens: int, context: int, bucket: int = 128) -> tuple:
    """Runner.step's (input_ids, position_ids, attention_mask, cache) for a step of `num_tokens` random tokens per
    sequence (a chain) after `context` cached slots of a new cache of `batch` sequences (its contents do not change
    a step's cost)."""
    from specrt.runtime.step_inputs import pack_step

    cache = runner.new_cache(batch, bucket)
    cache.reserve(context + num_tokens)
    cache.lengths[:] = context
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, runner.entry.vocab_size, num_tokens) for _ in range(batch)]
    return (*pack_step(cache, rows, [context + np.arange(num_tokens)] * batch), cache)


def head_features(runner, batch: int, num_tokens: int) -> dict:
    """Runner.step's features= where the runner's step reads them (a draft head: ModelEntry.features; zeros, which
    cost what any do), else nothing."""
    entry = runner.entry
    reads = getattr(entry, "features", False)
    return {"features": np.zeros((batch, num_tokens, entry.hidden_size), np.float32)} if reads else {}


def step_times(runner, batch: int, num_tokens: int, context: int, repeats: int, warmup: int,
               before=None, bucket: int = 128, head: str = "logits") -> list[float]:
    """Seconds of `repeats` steps of `num_tokens` new tokens per sequence after `context` cached ones (in a cache
    growing by `bucket` slots, as the pipeline's), each after `warmup` untimed ones, bringing to the host what
    `head` keeps of the logits (Runner.step); `before`: another runner, one untimed step of one token of which
    precedes every step (the target before the draft, as in a decode round). Timed as the runner counts its own
    time (Runner.busy_seconds), by which decode rounds tell model time from host work."""
    args = step_args(runner, batch, num_tokens, context, bucket)
    fed = head_features(runner, batch, num_tokens)
    other = step_args(before, batch, 1, context, bucket) if before is not None else None
    times = []
    for i in range(warmup + repeats):
        if other is not None:
            before.step(*other, head="argmax")
        busy = runner.busy_seconds
        runner.step(*args, head=head, **fed)
        if i >= warmup:  # the model's time as decoding counts it (Runner.busy_seconds: a host-side head is host work)
            times.append(runner.busy_seconds - busy)
    return times


def prefill_times(runner, batch: int, num_tokens: int, repeats: int, warmup: int, bucket: int = 128) -> list[float]:
    """Seconds of `repeats` prefill steps (after `warmup` untimed ones) of `num_tokens` prompt tokens for each of
    `batch` sequences into an empty cache growing by `bucket` slots, their K/V appended, as the pipeline prefills
    a chunk (step_inputs.feed_rows); each into a cache of its own, made before the clock starts."""
    from specrt.runtime.step_inputs import feed_rows

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, runner.entry.vocab_size, num_tokens) for _ in range(batch)]
    times = []
    for i in range(warmup + repeats):
        cache = runner.new_cache(batch, bucket)
        cache.reserve(num_tokens)
        t0 = time.perf_counter()
        fed = head_features(runner, batch, num_tokens).get("features")
        feed_rows(runner, cache, rows, head="discard", features=None if fed is None else list(fed))  # as prefill
        runner.wait()  # ... and on a GPU, not over until the device has run it
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


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
    chunk = min(PREFILL_CHUNK, min(p.target.max_step_tokens or PREFILL_CHUNK for p in pipes.values()))
    widest = min(chunk, min(p.max_context for p in pipes.values()))
    points += [("prefill", role, b, n) for role in ("target", "draft") for b in cfg.batch_sizes
               for n in cfg.prefill_tokens if b * n <= cfg.max_prefill_tokens and n <= widest]
    too_long = max(cfg.contexts) + max(cfg.num_tokens)
    if too_long > min(p.max_context for p in pipes.values()):
        raise SpecrtError(f"context {max(cfg.contexts)} + {max(cfg.num_tokens)} tokens exceeds the model's "
                          f"{min(p.max_context for p in pipes.values())}")
    samples: dict = {(q, *point): [] for q in quants for point in points}
    rng = np.random.default_rng(0)
    machine = next(iter(pipes.values())).machine
    at_start = copy_bandwidth(machine.device, machine.threads)
    with ExitStack() as stack:  # given back before the host work's decodes
        runners = {(q, role): stack.enter_context(getattr(p, role).runner()) for q, p in pipes.items()
                   for role in ("target", "draft")}
        with tqdm(total=cfg.passes * len(points), desc="profile", unit="point", disable=not progress) as bar:
            for _ in range(cfg.passes):
                for i in rng.permutation(len(points)):
                    role, b, c, n = points[i]
                    for q in quants:  # variants side by side: a point's costs compared under the same load
                        if role == "prefill":
                            _, model, batch, tokens = points[i]
                            samples[q, *points[i]] += prefill_times(runners[q, model], batch, tokens,
                                                                    cfg.prefill_repeats, cfg.warmup, pipes[q].bucket)
                            continue
                        before = runners[q, "target"] if role == "draft" else None
                        # the target's step as greedy verification takes it (each row's argmax to the host; on a
                        # GPU the logits stay there), the draft's with its logits (drafters rank them)
                        samples[q, role, b, c, n] += step_times(runners[q, role], b, n, c, cfg.repeats, cfg.warmup,
                                                                before, pipes[q].bucket,
                                                                "argmax" if role == "target" else "logits")
                    bar.update()
        probes = {q: runners[q, "target"].new_cache(1, p.bucket) for q, p in pipes.items()}
        buckets = {q: c.capacity if c.is_static else c.bucket for q, c in probes.items()}  # a static cache: one bucket
        # and the engines' attention spans, where a static step's cost steps as the context crosses them
        spans = {q: tuple(getattr(getattr(pipes[q].target, "engines", None), "spans", ())) for q in probes}
        spans = {q: s if probes[q].is_static and len(s) > 1 else None for q, s in spans.items()}
    models: dict = {q: {"target": {}, "draft": {}} for q in quants}
    prefills: dict = {q: {} for q in quants}
    for (q, kind, *point), times in samples.items():
        ms = round(1e3 * statistics.median(times), 4)
        if kind == "prefill":
            role, b, n = point
            prefills[q].setdefault(role, {}).setdefault(b, {})[n] = ms
        else:
            b, c, n = point
            models[q][kind].setdefault(b, {}).setdefault(c, {})[n] = ms
    bandwidth = round(copy_bandwidth(machine.device, machine.threads))
    if not same_state(bandwidth, at_start):
        import warnings

        warnings.warn(f"the copy bandwidth moved from {at_start / 1e9:.1f} to {bandwidth / 1e9:.1f} GB/s during the "
                      "profile: the machine changed state (another load on it), and the costs mix the two; profile "
                      "again when it is quiet", RuntimeWarning, stacklevel=2)
    out = {}
    for q, pipe in pipes.items():
        host_ms, host_batch = {}, {}
        for (kind, b, n), ms in host_work(pipe, sorted(set(cfg.batch_sizes) | {1}), cfg.passes, rng,
                                          desc=f"profile host work{f' ({q})' if q else ''}", progress=progress).items():
            table = host_ms.setdefault(kind, {}) if b == 1 else host_batch.setdefault(kind, {}).setdefault(b, {})
            table[n] = ms
        data = LatencyProfile(stamp=Stamp.make(cfg.bundle, pipe.machine), config=config_dict(cfg), models=models[q],
                              host_ms=host_ms, copy_bandwidth=bandwidth, host_batch=host_batch,
                              packed_rows=pipe.target.packs_rows, cache_bucket=buckets[q], cache_spans=spans[q],
                              prefill=prefills[q] or None, prefill_chunk=chunk if prefills[q] else None)
        path = artifacts.save(cfg.bundle, data, quant=q)
        plot_latency(data, path.with_suffix(".png"))
        out[q] = data
    return out


def host_configs(pipe, batch_sizes: list[int]) -> list[tuple[str, int, int]]:
    """(kind, batch size, tree nodes) of every decode whose host work is profiled: each kind's own sizes
    (SpeculationKind.host_profile; fewer above batch 1; PPD's only where the bundle's prompt tokens built those
    trees), none wider than the target's largest step."""
    largest = pipe.target.max_step_tokens  # a round's target step holds the root, the nodes and any n-gram drafts
    built = {t.budget for t in pipe.prompt_tokens.trees} if pipe.prompt_tokens is not None else set()
    out = []
    for b in batch_sizes:
        for kind in (k for k in SPECULATION.values() if k.host_profile and runs_with(k, pipe.draft)):
            h = kind.host_profile
            sizes = [n for n in (h.sizes if b == 1 else h.batched_sizes) if not h.prompt_tokens or n in built]
            out += [(kind.name, b, n) for n in sizes if not largest or n + 1 + h.extra_rows <= largest]
    return out


def host_round_ms(pipe, kind: str, batch: int, num_nodes: int, new_tokens: int = 48) -> float:
    """Host milliseconds per decode round (outside any model call) of one generation of `batch` held-out
    prompts in one batch, `new_tokens` each (a third of that above batch 1), with a tree of this kind and size
    (SpeculationKind.decode)."""
    prompts = validation_prompts(pipe.encode, batch, 64, seed=0)
    new_tokens = new_tokens if batch == 1 else max(8, new_tokens // 3)
    kw = SPECULATION[kind].decode(num_nodes)
    stats = pipe.generate(prompts, max_new_tokens=new_tokens, batch_size=batch, **kw)[0].stats
    return 1e3 * stats.seconds.host / max(1, stats.rounds)


def host_work(pipe, batch_sizes: list[int], passes: int, rng, desc: str = "profile host work",
              progress: bool = True) -> dict[tuple[str, int, int], float]:
    """(kind, batch size, tree nodes) -> host ms per round: the median over `passes` generations of each of
    host_configs, after an untimed one; each pass in a new random order (drift over minutes shifts every
    configuration alike)."""
    from tqdm import tqdm

    configs = host_configs(pipe, batch_sizes)
    times: dict = {c: [] for c in configs}
    with tqdm(total=(passes + 1) * len(configs), desc=desc, unit="decode", disable=not progress) as bar:
        for p in range(passes + 1):
            for i in (range(len(configs)) if p == 0 else rng.permutation(len(configs))):
                ms = host_round_ms(pipe, *configs[i])
                if p > 0:
                    times[configs[i]].append(ms)
                bar.update()
    return {c: round(statistics.median(ms), 4) for c, ms in times.items()}


def plot_latency(data: LatencyProfile, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    m = data.stamp.machine
    fig, axes = plt.subplots(1, 3 if data.prefill else 2, figsize=(15 if data.prefill else 10, 3.6))
    for ax, role in zip(axes, ("target", "draft")):
        for b, per_ctx in sorted(data.models[role].items()):
            for c, curve in sorted(per_ctx.items()):
                ns = sorted(curve)
                line, = ax.plot(ns, nondecreasing(tuple(curve[n] for n in ns)), label=f"batch {b}, context {c}")
                ax.plot(ns, [curve[n] for n in ns], ".", color=line.get_color())
        ax.set_xlabel("new tokens per sequence (n)")
        ax.set_ylabel("step ms (dots: medians; lines: the fit tuned on)")
        ax.set_title(f"{role}: L(n), {m.backend}, {m.threads} threads, {m.gpu or m.device}")
        ax.grid(alpha=0.3)
    if data.prefill:
        ax = axes[2]
        for role, style in (("target", "-"), ("draft", "--")):
            for b, curve in sorted(data.prefill.get(role, {}).items()):
                ns = sorted(curve)
                ax.plot(ns, [curve[n] / (b * n) for n in ns], style, marker=".", label=f"{role}, batch {b}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens per sequence in the step")
        ax.set_ylabel("prefill ms per prompt token")
        ax.set_title("prefill from an empty cache")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)

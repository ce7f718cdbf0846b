"""`specrt profile`: latency L(n) of each model's step at n new tokens, per batch size and context.

Each point is the median of `repeats` timed steps after `warmup` untimed ones, on a cache filled to
`context` slots (contents do not change the cost). Points with batch * n above `max_tokens_per_step`
are skipped (CPU time). It also measures the runtime's own host work per decode round (masks, drafting
bookkeeping, verification, cache commits: everything outside model calls) for static and dynamic trees
of several sizes at batch 1, since on small models that is a real part of a round (a dynamic tree's beam
search is host work at every depth). Writes latency.json into the bundle and latency.png beside it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bench.report import config_dict, pyplot, save_figure
from specrt.errors import SpecrtError

LATENCY = "latency.json"
NUM_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)


@dataclass(frozen=True)
class ProfileConfig:
    bundle: Path
    backend: str = "ort"
    threads: int | None = 2
    device: str | None = None
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = (128, 512)
    num_tokens: tuple[int, ...] = NUM_TOKENS
    repeats: int = 5
    warmup: int = 2
    max_tokens_per_step: int = 512


def time_step(backend, batch: int, num_tokens: int, context: int, repeats: int, warmup: int) -> float:
    """Median seconds of one step of `num_tokens` new tokens per sequence after `context` cached ones."""
    from specrt.runtime.step_inputs import pack_step

    cache = backend.new_cache(batch)
    cache.reserve(context + num_tokens)
    cache.lengths[:] = context
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, backend.entry.vocab_size, num_tokens) for _ in range(batch)]
    ids, pos, mask = pack_step(cache, rows, [context + np.arange(num_tokens)] * batch)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        backend.step(ids, pos, mask, cache)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(cfg: ProfileConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    from specrt.machine import fingerprint
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(cfg.bundle, backend=cfg.backend, threads=cfg.threads, device=cfg.device)
    points = [(role, b, c, n) for role in ("target", "draft") for b in cfg.batch_sizes for c in cfg.contexts
              for n in cfg.num_tokens if b * n <= cfg.max_tokens_per_step]
    if not points:
        raise SpecrtError("nothing to profile: every batch * num_tokens exceeds max_tokens_per_step")
    too_long = max(cfg.contexts) + max(cfg.num_tokens)
    if too_long > pipe.max_context:
        raise SpecrtError(f"context {max(cfg.contexts)} + {max(cfg.num_tokens)} tokens exceeds the model's {pipe.max_context}")
    models: dict = {"target": {}, "draft": {}}
    for role, b, c, n in tqdm(points, desc="profile", unit="point", disable=not progress):
        backend = pipe.target if role == "target" else pipe.draft
        ms = 1e3 * time_step(backend, b, n, c, cfg.repeats, cfg.warmup)
        models[role].setdefault(str(b), {}).setdefault(str(c), {})[str(n)] = round(ms, 4)
    data = {"config": config_dict(cfg),
            "machine": fingerprint(cfg.backend, cfg.threads, cfg.device), "date": time.strftime("%Y-%m-%d"),
            "unit": "ms", "models": models, "host_ms": host_per_round(pipe),
            "dynamic_host_ms": host_per_round(pipe, "dynamic"), "merged_host_ms": host_per_round(pipe, "merged")}
    (cfg.bundle / LATENCY).write_text(json.dumps(data, indent=1) + "\n")
    plot_latency(data, cfg.bundle / "latency.png")
    return data


HOST_TREE_SIZES = (0, 1, 4, 8, 16, 32, 63)
HOST_DYNAMIC_SIZES = (2, 8, 16, 32)


def host_per_round(pipe, kind: str = "tree", new_tokens: int = 48) -> dict[str, float]:
    """Median host milliseconds per decode round (outside any model call) by tree size, batch 1.

    kind "tree": static trees from a fixed synthetic acceptance table (the shape calibration would build);
    size 0 is autoregressive. "dynamic": dynamic trees of HOST_DYNAMIC_SIZES nodes; "merged": the same
    with MERGE_NGRAM_TOKENS n-gram drafts merged in (sizes count the draft model's nodes). Two generations
    per size on one held-out prompt; the second is measured."""
    from specrt.calibration.acceptance import best_trees, validation_prompts
    from specrt.runtime.methods import MERGE_NGRAM_TOKENS

    prompt = validation_prompts(pipe.encode, 1, 64, seed=0)[0]
    trees = {t["num_nodes"]: t["paths"] for t in best_trees(np.array([[0.7, 0.15, 0.07, 0.03]] * 8), max(HOST_TREE_SIZES))}
    out = {}
    for n in HOST_TREE_SIZES if kind == "tree" else HOST_DYNAMIC_SIZES:
        if kind != "tree":
            kw = {"method": "dynamic", "num_draft_tokens": n, "ngram_tokens": MERGE_NGRAM_TOKENS if kind == "merged" else 0}
        else:
            kw = {"method": "autoregressive"} if n == 0 else {"method": "tree", "tree": trees[n]}
        for _ in range(2):
            stats = pipe.generate([prompt], max_new_tokens=new_tokens, **kw)[0].stats
        out[str(n)] = round(1e3 * stats["seconds"]["host"] / max(1, stats["rounds"]), 4)
    return out


def host_ms(data: dict, num_nodes: int, kind: str = "tree") -> float:
    """Host work per round for a tree of num_nodes (0 = autoregressive), linear between measured sizes; of
    this kind ("tree", "dynamic" or "merged") where profiled, else of the next simpler one, 0 for profiles
    that did not measure it."""
    order = ("merged_host_ms", "dynamic_host_ms", "host_ms")
    keys = order[{"merged": 0, "dynamic": 1, "tree": 2}[kind]:]
    table = next((data[k] for k in keys if data.get(k)), None)
    if not table:
        return 0.0
    ns = sorted(int(k) for k in table)
    return float(np.interp(num_nodes, ns, [table[str(k)] for k in ns]))


def load_latency(bundle: Path) -> dict:
    path = Path(bundle) / LATENCY
    if not path.is_file():
        raise SpecrtError(f"no {LATENCY} in {bundle}: run `specrt profile --bundle {bundle}` first")
    return json.loads(path.read_text())


def latency_ms(data: dict, role: str, batch: int, num_tokens: int) -> float:
    """L(n) for a batch size, averaged over the profiled contexts, linear between profiled n."""
    per_batch = data["models"][role].get(str(batch))
    if per_batch is None:
        raise SpecrtError(f"batch size {batch} was not profiled (profiled: {sorted(data['models'][role], key=int)})")
    values = []
    for curve in per_batch.values():
        ns = np.array(sorted(int(k) for k in curve))
        ms = np.array([curve[str(k)] for k in ns])
        if num_tokens > ns[-1]:
            raise SpecrtError(f"{role} was profiled up to {ns[-1]} tokens at batch {batch}, not {num_tokens}")
        values.append(float(np.interp(num_tokens, ns, ms)))
    return float(np.mean(values))


def plot_latency(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, role in zip(axes, ("target", "draft")):
        for b, per_ctx in data["models"][role].items():
            for c, curve in per_ctx.items():
                ns = sorted(int(k) for k in curve)
                ax.plot(ns, [curve[str(n)] for n in ns], marker=".", label=f"batch {b}, context {c}")
        ax.set_xlabel("new tokens per sequence (n)")
        ax.set_ylabel("step latency (ms, median)")
        ax.set_title(f"{role}: L(n), {data['config']['backend']}, {data['config']['threads']} threads")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)

"""`specrt bench batch`: throughput and per-request latency by batch size, continuous against static batching.

HumanEval prompts (their lengths vary) with per-request limits of new tokens drawn between
`--min-new-tokens` and `--max-new-tokens` (seeded), greedy, every configuration in one process
(interleaved timed runs, medians): for each method and batch size, continuous batching (a finished
sequence's place goes to the next prompt between rounds) and static batching (batches that wait for
their slowest sequence). Per row: tokens/s, speedup over autoregressive at the same batch size and
batching, continuous over static, p50 / p95 request latency (from the call's start to a request's last
token: waiting included, as a server's client sees it), and whether every request's tokens are the
single-sequence autoregressive ones. The padded mode and the batch cost model of issue 14 are not here yet.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import BenchConfig, header, timed_runs, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.plotting import finish_figure, pyplot
from specrt.runtime.backends import BackendOptions

BATCHINGS = ("continuous", "static")


@dataclass(frozen=True)
class BatchBenchConfig(BenchConfig, BackendOptions):
    num_prompts: int = option(32, "first N HumanEval prompts", ge=1)
    max_new_tokens: int = option(96, "per-request limits of new tokens are drawn from [min, max]", ge=1)
    min_new_tokens: int = option(16, "per-request limits of new tokens are drawn from [min, max]", ge=1)
    batch_sizes: tuple[int, ...] = option((1, 2, 4, 8), "batch sizes")
    methods: tuple[str, ...] = option(("autoregressive", "sd", "anpd"), "methods (each with its defaults)")
    seed: int = option(0, "seed of the per-request limits", ge=0)


def limits(cfg: BatchBenchConfig) -> list[int]:
    if cfg.min_new_tokens > cfg.max_new_tokens:
        raise SpecrtError(f"--min-new-tokens {cfg.min_new_tokens} exceeds --max-new-tokens {cfg.max_new_tokens}")
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(cfg.min_new_tokens, cfg.max_new_tokens + 1, cfg.num_prompts).tolist()


def run_batch(cfg: BatchBenchConfig) -> dict:
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    prompts, caps = humaneval_prompts(cfg.num_prompts), limits(cfg)
    reference = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=caps)]
    configs = [(m, b, how) for m in cfg.methods for b in cfg.batch_sizes for how in BATCHINGS
               if b > 1 or how == "continuous"]  # (method, batch size, batching); at batch 1 the two are the same

    def run(method, batch, how):
        outs = pipe.generate(prompts, method=method, max_new_tokens=caps, batch_size=batch, batching=how)
        return (sum(len(o.token_ids) for o in outs), [o.stats.seconds.finished for o in outs],
                [o.token_ids for o in outs] == reference)

    seconds, last = timed_runs({c: (lambda c=c: run(*c)) for c in configs}, cfg.runs, 1, f"bench batch {cfg.label}")
    speed = {k: last[k][0] / statistics.median(seconds[k]) for k in configs}
    rows = []
    for (m, b, how) in configs:
        ar = speed.get(("autoregressive", b, how))
        static = speed.get((m, b, "static"))
        latency = np.array(last[(m, b, how)][1])
        rows.append({"method": m, "batch_size": b, "batching": how, "tokens_per_s": round(speed[(m, b, how)], 2),
                     "speedup_vs_ar": round(speed[(m, b, how)] / ar, 3) if ar else None,
                     "continuous_vs_static": round(speed[(m, b, how)] / static, 3) if how == "continuous" and static else None,
                     "latency_p50_s": round(float(np.percentile(latency, 50)), 3),
                     "latency_p95_s": round(float(np.percentile(latency, 95)), 3),
                     "same_tokens_as_ar": last[(m, b, how)][2], "runs_s": [round(s, 3) for s in seconds[(m, b, how)]]})
    data = {**header("batch", cfg), "rows": rows, "max_new_tokens_per_request": caps}
    write_report(cfg.out / f"batch-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### batch `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['min_new_tokens']}-{c['max_new_tokens']} "
             f"new tokens per request, greedy, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| method | batch | batching | tokens/s | vs AR | continuous / static | latency p50 (s) | p95 (s) | "
             "same tokens as AR |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        cs = "-" if r["continuous_vs_static"] is None else f"{r['continuous_vs_static']:.2f}x"
        vs = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['batching']} | {r['tokens_per_s']:.1f} | {vs} | {cs} | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | {'yes' if r['same_tokens_as_ar'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    for i, m in enumerate(methods):
        color = f"C{i}"
        for how, style in (("continuous", "o-"), ("static", "x--")):
            rows = sorted((r for r in data["rows"] if r["method"] == m and (r["batching"] == how or r["batch_size"] == 1)),
                          key=lambda r: r["batch_size"])
            ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], style, color=color, label=f"{m}, {how}")
    ax.set_xscale("log", base=2)
    finish_figure(fig, ax, path, "batch size", "tokens/s (all requests)", f"batch {data['label']}: throughput")

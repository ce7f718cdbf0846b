"""`specrt bench soak`: resident memory of one Pipeline over many generate calls with random prompt lengths.

Each batch size runs in a fresh process (so one series does not inherit another's peak): one Pipeline,
`num_calls` generate calls of `batch_size` prompts, each prompt a random span of 50..1900 tokens (by
default) of held-out standard-library text, `max_new_tokens` new tokens, greedy, made by `clients`
threads at once. RSS (/proc/self/status) is read after every call. A series passes when RSS grows by at
most `max_growth` from call `settle_calls` to the last call and never exceeds `max_rss_mb`. Writes JSON,
Markdown and a plot.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.report import BenchConfig, header, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import InvalidRequestError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends import BackendOptions


@dataclass(frozen=True)
class SoakConfig(BenchConfig, BackendOptions):
    max_new_tokens: int = option(16, "new tokens per prompt", ge=1)
    num_calls: int = option(400, "generate calls per batch size", ge=2)
    settle_calls: int = option(100, "growth is measured from this call on", ge=1)
    min_prompt_tokens: int = option(50, "shortest prompt", ge=1)
    max_prompt_tokens: int = option(1900, "longest prompt", ge=1)
    batch_sizes: tuple[int, ...] = option((1, 4), "one series (a fresh process) per batch size", ge=1, nonempty=True)
    method: str = option("sd", "decoding method")
    seed: int = option(0, "seed of the prompt lengths and offsets", ge=0)
    clients: int = option(1, "threads calling the one Pipeline concurrently", ge=1)
    max_growth: float = option(0.10, "pass: RSS at the last call / RSS at settle_calls - 1 is at most this", ge=0)
    max_rss_mb: float = option(1000.0, "pass: RSS never exceeds this many MB", gt=0)

    def __post_init__(self):
        super().__post_init__()
        if not self.min_prompt_tokens <= self.max_prompt_tokens:
            raise InvalidRequestError(f"min_prompt_tokens {self.min_prompt_tokens} > max_prompt_tokens {self.max_prompt_tokens}")
        if self.settle_calls >= self.num_calls:
            raise InvalidRequestError(f"settle_calls must be below num_calls, got {self.settle_calls} and {self.num_calls}")


def rss_mb() -> float:
    """Resident set size of this process now (Linux), else its peak so far."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def token_stream(pipe, min_tokens: int) -> np.ndarray:
    """Held-out standard-library text as one token stream of at least min_tokens tokens."""
    from specrt.checkpoints.corpus import load_corpus

    ids: list[int] = []
    for f in load_corpus()[1]:
        ids += pipe.encode(f.text)
        if len(ids) >= min_tokens:
            return np.asarray(ids, dtype=np.int64)
    raise ValueError(f"the held-out corpus has only {len(ids)} tokens, fewer than {min_tokens}")


def series(cfg: SoakConfig, batch_size: int) -> dict:
    """One batch size's series, in this process."""
    from specrt.runtime.pipeline import Pipeline

    t0 = time.perf_counter()
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    stream = token_stream(pipe, 4 * cfg.max_prompt_tokens)
    rng = np.random.default_rng(cfg.seed + batch_size)
    lengths = [rng.integers(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1, size=batch_size) for _ in range(cfg.num_calls)]
    calls = [[stream[s:s + k] for s, k in zip(rng.integers(0, len(stream) - n + 1), n)] for n in lengths]

    def call(prompts):
        pipe.generate(prompts, method=cfg.method, max_new_tokens=cfg.max_new_tokens, batch_size=batch_size)

    rss = [rss_mb()]
    t_calls = time.perf_counter()
    if cfg.clients == 1:
        for prompts in calls:
            call(prompts)
            rss.append(rss_mb())
    else:
        with ThreadPoolExecutor(cfg.clients) as ex:
            for future in as_completed([ex.submit(call, prompts) for prompts in calls]):
                future.result()
                rss.append(rss_mb())
    calls_s = time.perf_counter() - t_calls
    settled, last = rss[cfg.settle_calls], rss[-1]  # rss[i]: after the i-th call done (rss[0]: loaded, before any)
    growth = last / settled - 1
    return {"batch_size": batch_size, "rss_mb": [round(r, 1) for r in rss], "prompt_lengths": [n.tolist() for n in lengths],
            "rss_loaded_mb": round(rss[0], 1), "rss_settled_mb": round(settled, 1), "rss_last_mb": round(last, 1),
            "rss_peak_mb": round(max(rss), 1), "growth": round(growth, 4),
            "passed": bool(growth <= cfg.max_growth and max(rss) <= cfg.max_rss_mb),
            "calls_per_s": round(cfg.num_calls / calls_s, 3), "seconds": round(time.perf_counter() - t0, 1)}


def _child(cfg: SoakConfig, batch_size: int, queue) -> None:
    try:
        queue.put(series(cfg, batch_size))
    except BaseException as e:  # report it in the parent rather than hang it
        queue.put({"error": f"{type(e).__name__}: {e}"})


def run_soak(cfg: SoakConfig) -> dict:
    from specrt.errors import SpecrtError

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for b in cfg.batch_sizes:
        print(f"bench soak {cfg.label}: batch {b}, {cfg.num_calls} calls in a fresh process")
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(cfg, b, queue))
        proc.start()
        row = queue.get()
        proc.join()
        if "error" in row:
            raise SpecrtError(f"soak series at batch {b} failed: {row['error']}")
        rows.append(row)
    data = {**header("soak", cfg), "rows": rows, "passed": all(r["passed"] for r in rows)}
    write_report(cfg.out / f"soak-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### soak `{data['label']}`: {c['num_calls']} `{c['method']}` calls per batch size, prompts of "
             f"{c['min_prompt_tokens']}-{c['max_prompt_tokens']} tokens, {c['max_new_tokens']} new tokens, "
             f"backend {c['backend']}, {c['threads']} threads, {c.get('clients', 1)} client thread(s) ({data['date']})", "",
             f"| batch | RSS loaded (MB) | RSS after call {c['settle_calls']} | RSS after call {c['num_calls']} | growth | "
             f"peak (MB) | pass (growth <= {c['max_growth']:.0%}, peak <= {c['max_rss_mb']:.0f} MB) | calls/s | seconds |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['batch_size']} | {r['rss_loaded_mb']:.0f} | {r['rss_settled_mb']:.0f} | {r['rss_last_mb']:.0f} | "
                     f"{r['growth']:+.1%} | {r['rss_peak_mb']:.0f} | {'yes' if r['passed'] else 'NO'} | "
                     f"{r.get('calls_per_s', float('nan')):.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    c = data["config"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in data["rows"]:
        ax.plot(range(len(r["rss_mb"])), r["rss_mb"], lw=1, label=f"batch {r['batch_size']}")
    ax.axvline(c["settle_calls"], color="gray", ls=":", lw=1, label=f"call {c['settle_calls']}")
    ax.axhline(c["max_rss_mb"], color="tab:red", ls="--", lw=1, label=f"{c['max_rss_mb']:.0f} MB")
    ax.set_xlabel("generate calls")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"soak {data['label']}: {c['method']}, prompts {c['min_prompt_tokens']}-{c['max_prompt_tokens']} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    clients = data.get("config", {}).get("clients", 1)
    return "; ".join(f"batch {r['batch_size']}{f', {clients} client threads' if clients > 1 else ''}: "
                     f"**{r['rss_last_mb']:.0f} MB** resident at the end, {r['growth']:+.1%} over the run, "
                     f"{r['calls_per_s']:.2f} calls/s, {'passed' if r['passed'] else 'FAILED'}" for r in data["rows"])

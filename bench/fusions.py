"""`specrt bench fusions`: the ort backend's load-time merges of the projections that read one input, against each
other on this machine, in the same run.

Each setting of OrtBackend's `projections` (ort_fusions.fuse_projections: "qkv" the default, "all" merging a float
MLP's gate and up as well, "none") loads the bundle's target step graph (the exported one, a quantized variant with
--quant, the in-graph one with --kv-update inplace) in one process. A timed run is a step of T new tokens after
--context cached ones per setting, each T a median of --repeats steps as `specrt profile` times them
(calibration.latency.step_times), the settings in a new random order in every run; a row's figure is the median over
runs, and its ratio is against the first setting's in the same run. The tokens are not compared here: the
fusions are tested for the same function against the unfused graph. Writes JSON, Markdown and a plot.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.report import BenchConfig, header, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import InvalidRequestError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends.ort import PROJECTIONS


@dataclass(frozen=True)
class FusionsConfig(BenchConfig):
    projections: tuple[str, ...] = option(PROJECTIONS, "OrtBackend projections settings, each row against the first: "
                                                       "qkv (the default), all (a float MLP's gate and up merged "
                                                       "too), none", choices=PROJECTIONS)
    tokens: tuple[int, ...] = option((1, 8), "new tokens per step (T): one row each per setting")
    context: int = option(512, "cached tokens before each step", ge=0)
    repeats: int = option(15, "steps per timed run and T (their median is the run's figure)", ge=1)
    runs: int = option(6, "timed runs, settings interleaved in a new random order each, after one untimed", ge=1)
    quant: str | None = option(None, "a quantized variant of the step graphs (`specrt quantize`)")
    kv_update: str = option("runtime", "runtime: the exported step graphs; inplace: `specrt inplace`'s variants",
                            choices=("runtime", "inplace"))

    def __post_init__(self):
        super().__post_init__()
        if not self.projections or len(set(self.projections)) < len(self.projections):
            raise InvalidRequestError("--projections takes each setting once, at least one")
        if not self.tokens or min(self.tokens) < 1:
            raise InvalidRequestError(f"--tokens takes counts >= 1, got {self.tokens}")


def run_fusions(cfg: FusionsConfig) -> dict:
    from tqdm import tqdm

    from specrt.calibration.latency import step_times
    from specrt.runtime.backends.ort import OrtBackend
    from specrt.runtime.loader import resolve

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    r = resolve(cfg.bundle, "ort", cfg.threads, None, cfg.verify_mode, cfg.quant, cfg.kv_update)
    entry = r.manifest.models["target"]
    graph = Path(cfg.bundle) / (r.graphs.get("target") or entry.onnx)
    backends = {p: OrtBackend(entry, graph, cfg.threads, kv_update=cfg.kv_update, projections=p)
                for p in tqdm(cfg.projections, desc="load", unit="setting")}
    ms: dict[tuple[str, int], list[float]] = {(p, t): [] for p in cfg.projections for t in cfg.tokens}
    rng = np.random.default_rng(0)
    with tqdm(total=(cfg.runs + 1) * len(backends), desc=f"bench fusions {cfg.label}", unit="setting-run") as bar:
        for run in range(cfg.runs + 1):  # the first untimed
            for i in rng.permutation(len(cfg.projections)):
                p = cfg.projections[int(i)]
                runner = backends[p].runner()
                for t in cfg.tokens:
                    step = statistics.median(step_times(runner, 1, t, cfg.context, cfg.repeats, warmup=2))
                    if run:
                        ms[p, t].append(1000 * step)
                runner.close()
                bar.update()
    rows = []
    for p, backend in backends.items():
        for t in cfg.tokens:
            med = statistics.median(ms[p, t])
            first = statistics.median(ms[cfg.projections[0], t])
            rows.append({"projections": p, "tokens": t, "merged_matmuls": backend.merged_matmuls,
                         "step_ms": round(med, 3), "vs_first": round(med / first, 3),
                         "runs_ms": [round(v, 3) for v in ms[p, t]]})
    data = {**header("fusions", cfg), "graph": str(graph.relative_to(cfg.bundle)), "rows": rows}
    write_report(cfg.out / f"fusions-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### fusions `{data['label']}`: the target's step (`{data['graph']}`) by the ort backend's projection "
             f"merges, {c['threads']} threads, {c['context']} cached tokens, median of {c['runs']} interleaved runs "
             f"of {c['repeats']} steps ({data['date']})", "",
             "| projections merged | MatMuls merged away | new tokens | step (ms) | against the first row's |",
             "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['projections']} | {r['merged_matmuls']} | {r['tokens']} | {r['step_ms']:.2f} | "
                     f"{r['vs_first']:.2f}x |")
    lines += ["", "qkv: q, k and v merged (a weight-only variant's gate and up too), the ort backend's default; all: a "
                  "float MLP's gate and up too; none: every projection its own MatMul."]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = data["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    settings = list(dict.fromkeys(r["projections"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(settings)
    for i, p in enumerate(settings):
        got = {r["tokens"]: r["step_ms"] for r in rows if r["projections"] == p}
        ax.bar(np.arange(len(tokens)) + i * width, [got[t] for t in tokens], width, label=p)
    ax.set_xticks(np.arange(len(tokens)) + width * (len(settings) - 1) / 2, [f"T={t}" for t in tokens])
    ax.set_ylabel("target step (ms, median)")
    ax.set_title(f"fusions {data['label']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, title="projections merged")
    save_figure(fig, path)


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    first = data["rows"][0]["projections"]
    return "; ".join(f"{r['projections']} {r['vs_first']:.2f}x {first}'s step at T={r['tokens']}"
                     for r in data["rows"] if r["projections"] != first)

"""`specrt bench fusions`: the ort backend's load-time rewrites of a step graph against each other on this machine,
in the same run: the merges of the projections that read one input, the packing of token rows, and the huge pages
the weights are loaded into.

Each setting of OrtBackend's `projections` (ort_fusions.fuse_projections: "qkv" the default, "all" merging a float
MLP's gate and up as well, "none"), with packed token rows (packed_rows.py, the default) and, with --packing
packed,unpacked, without them (what a batch of one, which has no holes, pays for the packing's gathers), and with
--huge-pages on,off, with the weights left in the pages they were loaded into (huge_pages.py), loads the
bundle's target step graph (the exported one, a quantized variant with --quant, the in-graph one with --kv-update
inplace) in one process. A timed run is a step of T new tokens after --context cached ones per setting, each T a
median of --repeats steps as `specrt profile` times them (calibration.latency.step_times), the settings in a new
random order in every run; a row's figure is the median over runs, and its ratio is against the first setting's in
the same run. The tokens are not compared here: the fusions are tested for the same function against the unfused
graph. Writes JSON, Markdown and a plot.

--ops adds where each setting's step spends its time by operator type, from ONNX Runtime's own profiler: after the
timed runs, each setting loaded once more with profiling on (it slows the steps: nothing timed above runs with it),
--repeats steps per T as above, and per T the median over steps of each operator type's kernel time and of the
whole run, the difference being the session's work outside kernels.
"""

from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.report import BenchConfig, header, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends.ort import PROJECTIONS

PACKING = ("packed", "unpacked")
HUGE_PAGES = ("on", "off")


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
    packing: tuple[str, ...] = option(("packed",), "token rows packed (packed_rows.py, the default) or not "
                                                   "(--no-packed-rows), each with every projections setting",
                                      choices=PACKING)
    huge_pages: tuple[str, ...] = option(("on",), "the weights' memory backed by transparent huge pages (huge_pages.py, "
                                                  "the default) or as loaded (off), each with every setting above",
                                         choices=HUGE_PAGES)
    ops: bool = option(False, "also split each setting's step by operator type (ONNX Runtime's profiler, after the "
                              "timed runs)")

    def __post_init__(self):
        super().__post_init__()
        for name, given in (("projections", self.projections), ("packing", self.packing),
                            ("huge-pages", self.huge_pages)):
            if not given or len(set(given)) < len(given):
                raise InvalidRequestError(f"--{name} takes each setting once, at least one")
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
    settings = [(p, k, h) for p in cfg.projections for k in cfg.packing for h in cfg.huge_pages]
    backends = {(p, k, h): OrtBackend(entry, graph, cfg.threads, kv_update=cfg.kv_update, projections=p,
                                      pack_rows=k == "packed", huge_pages=h == "on")
                for p, k, h in tqdm(settings, desc="load", unit="setting")}
    ms: dict[tuple, list[float]] = {(s, t): [] for s in settings for t in cfg.tokens}
    rng = np.random.default_rng(0)
    with tqdm(total=(cfg.runs + 1) * len(backends), desc=f"bench fusions {cfg.label}", unit="setting-run") as bar:
        for run in range(cfg.runs + 1):  # the first untimed
            for i in rng.permutation(len(settings)):
                setting = settings[int(i)]
                runner = backends[setting].runner()
                for t in cfg.tokens:
                    step = statistics.median(step_times(runner, 1, t, cfg.context, cfg.repeats, warmup=2))
                    if run:
                        ms[setting, t].append(1000 * step)
                runner.close()
                bar.update()
    rows = []
    for (p, k, h), backend in backends.items():
        for t in cfg.tokens:
            med = statistics.median(ms[(p, k, h), t])
            first = statistics.median(ms[settings[0], t])
            rows.append({"projections": p, "packing": k, "huge_pages": h, "tokens": t,
                         "huge_page_mib": round(backend.huge_pages.bytes / 2**20, 1),
                         "merged_matmuls": backend.merged_matmuls,
                         "step_ms": round(med, 3), "vs_first": round(med / first, 3),
                         "runs_ms": [round(v, 3) for v in ms[(p, k, h), t]]})
    data = {**header("fusions", cfg), "graph": str(graph.relative_to(cfg.bundle)), "rows": rows}
    if cfg.ops:
        data["ops"] = profile_ops(cfg, entry, graph)
    write_report(cfg.out / f"fusions-{cfg.label}", data, markdown, plot)
    return data


WARMUP = 2  # untimed steps before each T's timed ones


def profile_ops(cfg: FusionsConfig, entry, graph: Path) -> list[dict]:
    """Per setting and T: the median run (ms) and each operator type's median kernel time (ms) over --repeats
    steps, from ONNX Runtime's profiler (op_times)."""
    import tempfile

    from tqdm import tqdm

    from specrt.calibration.latency import step_times
    from specrt.runtime.backends.ort import OrtBackend

    rows = []
    with tempfile.TemporaryDirectory(prefix="specrt-ops-") as scratch:
        for p, k, h in tqdm([(p, k, h) for p in cfg.projections for k in cfg.packing for h in cfg.huge_pages],
                            desc="profile ops", unit="setting"):
            backend = OrtBackend(entry, graph, cfg.threads, kv_update=cfg.kv_update, projections=p,
                                 pack_rows=k == "packed", huge_pages=h == "on", profile=Path(scratch) / f"{p}-{k}-{h}")
            with backend.runner() as runner:
                for t in cfg.tokens:
                    step_times(runner, 1, t, cfg.context, cfg.repeats, warmup=WARMUP)
            runs = op_times(json.loads(backend.end_profiling().read_text()))
            per_t = WARMUP + cfg.repeats
            if len(runs) != per_t * len(cfg.tokens):
                raise SpecrtError(f"ONNX Runtime's profile holds {len(runs)} runs, {per_t * len(cfg.tokens)} were made")
            for i, t in enumerate(cfg.tokens):
                timed = runs[i * per_t + WARMUP:(i + 1) * per_t]
                names = sorted({op for _, ops in timed for op in ops})
                ops = {op: round(statistics.median(ops.get(op, 0.0) for _, ops in timed), 3) for op in names}
                rows.append({"projections": p, "packing": k, "huge_pages": h, "tokens": t,
                             "run_ms": round(statistics.median(r for r, _ in timed), 3),
                             "ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    return rows


def op_times(trace: list[dict]) -> list[tuple[float, dict[str, float]]]:
    """An ONNX Runtime profile (its JSON trace: a "model_run" Session event per run, a Node event per kernel it
    ran) as (the run's ms, {operator type: kernel ms}) per run, in order."""
    runs = sorted((e["ts"], e["dur"]) for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run")
    starts = [ts for ts, _ in runs]
    ops: list[dict[str, int]] = [{} for _ in runs]
    for e in trace:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > runs[i][0] + runs[i][1]:
            continue  # a kernel outside any run (session initialisation)
        op = e.get("args", {}).get("op_name", "?")
        ops[i][op] = ops[i].get(op, 0) + e["dur"]  # microseconds
    return [(dur / 1e3, {op: us / 1e3 for op, us in o.items()}) for (_, dur), o in zip(runs, ops)]


def setting(r: dict) -> str:
    """A row's setting as its tables name it: the projections merged, "unpacked" where its token rows were not
    (results from before --packing were all packed), "huge pages off" where the weights were left as loaded (as in
    every result from before --huge-pages, whose rows say nothing of it)."""
    return (r["projections"] + (", unpacked" if r.get("packing", "packed") == "unpacked" else "")
            + (", huge pages off" if r.get("huge_pages") == "off" else ""))


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### fusions `{data['label']}`: the target's step (`{data['graph']}`) by the ort backend's load-time "
             f"rewrites, {c['threads']} threads, {c['context']} cached tokens, median of {c['runs']} interleaved runs "
             f"of {c['repeats']} steps ({data['date']})", "",
             "| setting | MatMuls merged away | new tokens | step (ms) | against the first row's |",
             "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {setting(r)} | {r['merged_matmuls']} | {r['tokens']} | {r['step_ms']:.2f} | "
                     f"{r['vs_first']:.2f}x |")
    lines += ["", "qkv: q, k and v merged (a weight-only variant's gate and up too), the ort backend's default; all: a "
                  "float MLP's gate and up too; none: every projection its own MatMul. Token rows packed (the default) "
                  "unless a setting says unpacked (--no-packed-rows)."]
    huge = [r for r in data["rows"] if r.get("huge_pages") == "on"]
    if huge:  # (rows from before --huge-pages say nothing: their weights were left as loaded)
        lines[-1] += (f" The weights' memory in transparent huge pages ({max(r['huge_page_mib'] for r in huge):.0f} "
                      "MiB collapsed, huge_pages.py) unless a setting says huge pages off.")
    lines += ops_table(data.get("ops"))
    return "\n".join(lines) + "\n"


TOP_OPS = 6  # operator types with a column of their own; the rest summed


def op_columns(ops: list[dict]) -> list[str]:
    """The operator types with the most kernel time over every row, most first (TOP_OPS of them)."""
    total: dict[str, float] = {}
    for r in ops:
        for op, ms in r["ops_ms"].items():
            total[op] = total.get(op, 0.0) + ms
    return sorted(total, key=lambda op: -total[op])[:TOP_OPS]


def op_shares(r: dict, columns: list[str]) -> dict[str, float]:
    """A row's step as shares of its run: each column's operator type, the other kernels, and the session's work
    outside kernels."""
    run, kernels = r["run_ms"], sum(r["ops_ms"].values())
    shares = {op: r["ops_ms"].get(op, 0.0) / run for op in columns}
    shares["other kernels"] = (kernels - sum(r["ops_ms"].get(op, 0.0) for op in columns)) / run
    shares["outside kernels"] = max(0.0, run - kernels) / run
    return shares


def ops_table(ops: list[dict] | None) -> list[str]:
    if not ops:
        return []
    columns = op_columns(ops)
    names = [*columns, "other kernels", "outside kernels"]
    lines = ["", "Where the step's time goes by operator type (ONNX Runtime's profiler, a separate profiled load; "
                 "median over steps; shares of the profiled run, whose time includes the profiler's own: compare it "
                 "with the step above):", "",
             "| setting | new tokens | profiled run (ms) | " + " | ".join(names) + " |",
             "|---|---:|---:|" + "---:|" * len(names)]
    for r in ops:
        shares = op_shares(r, columns)
        lines.append(f"| {setting(r)} | {r['tokens']} | {r['run_ms']:.2f} | "
                     + " | ".join(f"{shares[n]:.1%}" for n in names) + " |")
    return lines


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows, ops = data["rows"], data.get("ops")
    tokens = sorted({r["tokens"] for r in rows})
    settings = list(dict.fromkeys(setting(r) for r in rows))
    fig, axes = plt.subplots(1, 2 if ops else 1, figsize=(12 if ops else 6, 3.5), squeeze=False)
    ax = axes[0, 0]
    width = 0.8 / len(settings)
    for i, p in enumerate(settings):
        got = {r["tokens"]: r["step_ms"] for r in rows if setting(r) == p}
        ax.bar(np.arange(len(tokens)) + i * width, [got[t] for t in tokens], width, label=p)
    ax.set_xticks(np.arange(len(tokens)) + width * (len(settings) - 1) / 2, [f"T={t}" for t in tokens])
    ax.set_ylabel("target step (ms, median)")
    ax.set_title(f"fusions {data['label']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, title="setting")
    if ops:  # each profiled step stacked by operator type
        ax = axes[0, 1]
        columns = op_columns(ops)
        labels = [f"{setting(r)} T={r['tokens']}" for r in ops]
        left = np.zeros(len(ops))
        for name in [*columns, "other kernels", "outside kernels"]:
            share = np.array([op_shares(r, columns)[name] for r in ops])
            ax.barh(labels, share, left=left, label=name)
            left += share
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the profiled run")
        ax.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    save_figure(fig, path)


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    first = setting(data["rows"][0])
    return "; ".join(f"{setting(r)} {r['vs_first']:.2f}x {first}'s step at T={r['tokens']}"
                     for r in data["rows"] if setting(r) != first)

"""`specrt bench fusions`: the ort backend's load-time rewrites of a step graph against each other on this machine,
in the same run: the merges of the projections that read one input, the packing of token rows, the huge pages the
weights are loaded into, and the LM head over only the rows a step's caller reads (--logit-rows on,off: with --head
discard, as a prefill chunk, no row's).

Each setting of OrtBackend's `projections` (ort_fusions.fuse_projections: "qkv" the default, "all" merging a float
MLP's gate and up as well, "none"), with packed token rows (graphs/packed_rows.py, the default) and, with --packing
packed,unpacked, without them (what a batch of one, which has no holes, pays for the packing's gathers), and with
--huge-pages on,off, with the weights left in the pages they were loaded into (huge_pages.py), loads the
bundle's target step graph (`--role draft`: the draft's; the exported one, a quantized variant with --quant, the
in-graph one with --kv-update inplace) in one process. A timed run is a step of T new tokens after --context cached
ones per setting, each T a median of --repeats steps as `specrt profile` times them (calibration.latency.step_times),
the settings in a new random order in every run; a row's figure is the median over runs, and its ratio against the
first setting's is the median over runs of the ratio within each (bench.report.paired_ratio). The tokens are not
compared here: the fusions are tested for the same function against the unfused graph. Writes JSON, Markdown and a plot.

--peers llama-cpp adds llama.cpp's step of the same target at the precision matching ours (the GGUF conversion bench
e2e's llama-cpp rows decode; bench.peers.LlamaCppStep: T new tokens after --context cached ones, every row's logits
computed), timed in the same runs: where our autoregressive row and llama.cpp's differ, whether it is the step.

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

from specrt.bench.peers import PeerSources, llama_cpp_step
from specrt.bench.report import BenchConfig, header, paired_ratio, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.plotting import pyplot, save_figure
from specrt.contract import PROJECTIONS, ROLES

PACKING = ("packed", "unpacked")
PEER_STEPS = ("llama-cpp",)
HUGE_PAGES = ("on", "off")
LOGIT_ROWS = ("on", "off")
HEADS = ("logits", "discard")


@dataclass(frozen=True)
class FusionsConfig(BenchConfig, PeerSources):
    projections: tuple[str, ...] = option(PROJECTIONS, "OrtBackend projections settings, each row against the first: "
                                                       "qkv (the default), all (a float MLP's gate and up merged "
                                                       "too), none", choices=PROJECTIONS)
    tokens: tuple[int, ...] = option((1, 8), "new tokens per step (T): one row each per setting")
    role: str = option("target", "whose step graph: the target's or the draft's", choices=ROLES)
    context: int = option(512, "cached tokens before each step", ge=0)
    repeats: int = option(15, "steps per timed run and T (their median is the run's figure)", ge=1)
    runs: int = option(6, "timed runs, settings interleaved in a new random order each, after one untimed", ge=1)
    quant: str | None = option(None, "a quantized variant of the step graphs (`specrt quantize`)")
    kv_update: str = option("runtime", "runtime: the exported step graphs; inplace: `specrt inplace`'s variants",
                            choices=("runtime", "inplace"))
    packing: tuple[str, ...] = option(("packed",), "token rows packed (graphs/packed_rows.py, the default) or not "
                                                   "(--no-packed-rows), each with every projections setting",
                                      choices=PACKING)
    huge_pages: tuple[str, ...] = option(("on",), "the weights' memory backed by transparent huge pages (huge_pages.py, "
                                                  "the default) or as loaded (off), each with every setting above",
                                         choices=HUGE_PAGES)
    logit_rows: tuple[str, ...] = option(("on",), "the LM head over only the rows the step's caller reads "
                                                  "(graphs/logit_rows.py, the default) or over every row (off), each "
                                                  "with every setting above", choices=LOGIT_ROWS)
    head: str = option("logits", "what each step's caller reads: logits (every row's, as a verification) or discard "
                                 "(none, as a prefill chunk)", choices=HEADS)
    peers: tuple[str, ...] = option((), "peer runtimes whose step of the same model at the matching precision is timed "
                                        "beside ours in the same runs: llama-cpp (its GGUF conversion, as bench e2e's "
                                        "rows; '' for none)", choices=PEER_STEPS)
    ops: bool = option(False, "also split each setting's step by operator type (ONNX Runtime's profiler, after the "
                              "timed runs)")

    def __post_init__(self):
        super().__post_init__()
        for name, given in (("projections", self.projections), ("packing", self.packing),
                            ("huge-pages", self.huge_pages), ("logit-rows", self.logit_rows)):
            if not given or len(set(given)) < len(given):
                raise InvalidRequestError(f"--{name} takes each setting once, at least one")
        if not self.tokens or min(self.tokens) < 1:
            raise InvalidRequestError(f"--tokens takes counts >= 1, got {self.tokens}")


def run_fusions(cfg: FusionsConfig) -> dict:
    from tqdm import tqdm

    from specrt.calibration.latency import step_times
    from specrt.runtime.loader import resolve

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    r = resolve(cfg.bundle, backend="ort", threads=cfg.threads, verify=cfg.verify_mode, quant=cfg.quant,
                kv_update=cfg.kv_update)
    if cfg.peers and cfg.role != "target":
        raise InvalidRequestError("--peers times the peers' step of the target: give --role target")
    entry = r.manifest.models[cfg.role]
    graph = Path(cfg.bundle) / (r.graphs.get(cfg.role) or entry.onnx)
    settings = all_settings(cfg)
    backends = {s: load(cfg, entry, graph, *s) for s in tqdm(settings, desc="load", unit="setting")}
    peers = dict(llama_cpp_step(cfg.bundle, cfg, entry.dtype, cfg.quant, cfg.threads, cfg.context, max(cfg.tokens),
                                entry.vocab_size) for _ in cfg.peers)  # llama-cpp, the one choice
    timed = [*settings, *peers]  # our settings, then the peers' row names
    ms: dict[tuple, list[float]] = {(s, t): [] for s in timed for t in cfg.tokens}
    rng = np.random.default_rng(0)
    with tqdm(total=(cfg.runs + 1) * len(timed), desc=f"bench fusions {cfg.label}", unit="setting-run") as bar:
        for run in range(cfg.runs + 1):  # the first untimed
            for i in rng.permutation(len(timed)):
                key = timed[int(i)]
                runner = backends[key].runner() if key in backends else None
                for t in cfg.tokens:
                    times = step_times(runner, 1, t, cfg.context, cfg.repeats, warmup=2, head=cfg.head) if runner \
                        else peers[key].times(t, cfg.repeats, warmup=2)
                    if run:
                        ms[key, t].append(1000 * statistics.median(times))
                if runner:
                    runner.close()
                bar.update()

    def figures(key, t):
        return {"tokens": t, "step_ms": round(statistics.median(ms[key, t]), 3),
                "vs_first": round(paired_ratio(ms[key, t], ms[settings[0], t]), 3),
                "runs_ms": [round(v, 3) for v in ms[key, t]]}

    rows = []
    for (p, k, h, r), backend in backends.items():
        for t in cfg.tokens:
            rows.append({"projections": p, "packing": k, "huge_pages": h, "logit_rows": r,
                         "huge_page_mib": round(backend.huge_pages.bytes / 2**20, 1),
                         "merged_matmuls": backend.merged_matmuls, **figures((p, k, h, r), t)})
    rows += [{"peer": name, "merged_matmuls": None, **figures(name, t)} for name in peers for t in cfg.tokens]
    data = {**header("fusions", cfg), "graph": str(graph.relative_to(cfg.bundle)), "rows": rows,
            "ratios": "paired"}  # bench.report.paired_ratio (results from before: ratios of the rows' medians)
    if cfg.ops:
        data["ops"] = profile_ops(cfg, entry, graph)
    write_report(cfg.out / f"fusions-{cfg.label}", data, markdown, plot)
    return data


WARMUP = 2  # untimed steps before each T's timed ones


def all_settings(cfg: FusionsConfig) -> list[tuple[str, str, str, str]]:
    """(projections, packing, huge pages, logit rows) of every row, in the order given."""
    return [(p, k, h, r) for p in cfg.projections for k in cfg.packing for h in cfg.huge_pages for r in cfg.logit_rows]


def load(cfg: FusionsConfig, entry, graph: Path, projections: str, packing: str, huge_pages: str, logit_rows: str,
         profile: Path | None = None):
    from specrt.runtime.backends.ort import OrtBackend

    return OrtBackend(entry, graph, cfg.threads, kv_update=cfg.kv_update, projections=projections,
                      pack_rows=packing == "packed", huge_pages=huge_pages == "on", select_rows=logit_rows == "on",
                      profile=profile)


def profile_ops(cfg: FusionsConfig, entry, graph: Path) -> list[dict]:
    """Per setting and T: the median run (ms) and each operator type's median kernel time (ms) over --repeats
    steps, from ONNX Runtime's profiler (op_times)."""
    import tempfile

    from tqdm import tqdm

    from specrt.calibration.latency import step_times

    rows = []
    with tempfile.TemporaryDirectory(prefix="specrt-ops-") as scratch:
        for s in tqdm(all_settings(cfg), desc="profile ops", unit="setting"):
            p, k, h, r = s
            backend = load(cfg, entry, graph, *s, profile=Path(scratch) / "-".join(s))
            with backend.runner() as runner:
                for t in cfg.tokens:
                    step_times(runner, 1, t, cfg.context, cfg.repeats, warmup=WARMUP, head=cfg.head)
            runs = op_times(json.loads(backend.end_profiling().read_text()))
            per_t = WARMUP + cfg.repeats
            if len(runs) != per_t * len(cfg.tokens):
                raise SpecrtError(f"ONNX Runtime's profile holds {len(runs)} runs, {per_t * len(cfg.tokens)} were made")
            for i, t in enumerate(cfg.tokens):
                timed = runs[i * per_t + WARMUP:(i + 1) * per_t]
                names = sorted({op for _, ops in timed for op in ops})
                ops = {op: round(statistics.median(ops.get(op, 0.0) for _, ops in timed), 3) for op in names}
                rows.append({"projections": p, "packing": k, "huge_pages": h, "logit_rows": r, "tokens": t,
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
    if "peer" in r:
        return r["peer"]
    return (r["projections"] + (", unpacked" if r.get("packing", "packed") == "unpacked" else "")
            + (", huge pages off" if r.get("huge_pages") == "off" else "")
            + (", head on every row" if r.get("logit_rows") == "off" else ""))


def markdown(data: dict) -> str:
    c = data["config"]
    role = c.get("role", "target")
    lines = [f"### fusions `{data['label']}`: the {role}'s step (`{data['graph']}`) by the ort backend's load-time "
             f"rewrites, {c['threads']} threads, {c['context']} cached tokens, median of {c['runs']} interleaved runs "
             f"of {c['repeats']} steps ({data['date']})", "",
             "| setting | MatMuls merged away | new tokens | step (ms) | against the first row's |",
             "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        merged = "-" if r["merged_matmuls"] is None else r["merged_matmuls"]
        lines.append(f"| {setting(r)} | {merged} | {r['tokens']} | {r['step_ms']:.2f} | "
                     f"{r['vs_first']:.2f}x |")
    lines += ["", "qkv: q, k and v merged (a weight-only variant's gate and up too), the ort backend's default; all: a "
                  "float MLP's gate and up too; none: every projection its own MatMul. Token rows packed (the default) "
                  "unless a setting says unpacked (--no-packed-rows)."
              + (" Each step's logits discarded, as a prefill chunk's: the LM head runs on no row unless a setting "
                 "says head on every row." if c.get("head") == "discard" else "")]
    huge = [r for r in data["rows"] if r.get("huge_pages") == "on"]
    if huge:  # (rows from before --huge-pages say nothing: their weights were left as loaded)
        lines[-1] += (f" The weights' memory in transparent huge pages ({max(r['huge_page_mib'] for r in huge):.0f} "
                      "MiB collapsed, huge_pages.py) unless a setting says huge pages off.")
    peers = [r["peer"] for r in data["rows"] if "peer" in r]
    if peers:
        lines[-1] += (f" {', '.join(dict.fromkeys(peers))}: that runtime's step of the same target at the matching "
                      "precision (bench e2e's conversion), every new row's logits computed, timed in the same runs.")
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
    ax.set_ylabel(f"{data['config'].get('role', 'target')} step (ms, median)")
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

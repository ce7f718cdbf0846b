"""The committed bench results: which verb made each, the command that re-makes it, its rows in one shape and its
headline (each verb's own: bench/<verb>.py speed_rows and headline), rendered for docs/results.md, the README's
table (`specrt bench docs`) and the bench section of `specrt report`."""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

from specrt.config import to_flags

@dataclass(frozen=True)
class Verb:
    """A `specrt bench` verb: specrt.bench.<verb>'s config class and run function, its help line, and the title of its
    results' section (None: it writes no bench results)."""

    config: str
    run: str
    help: str
    title: str | None = None


VERBS = {
    "e2e": Verb("E2EConfig", "run_e2e", "end-to-end tokens/s against HF and Optimum baselines", "End to end"),
    "trees": Verb("TreesConfig", "run_trees", "measured vs predicted tokens/s per tree size (after tune)",
                  "Trees: measured vs predicted"),
    "ngram": Verb("NgramConfig", "run_ngram", "ANPD ablation over n-gram order N and draft length K", "ANPD ablation"),
    "mtad": Verb("MtadConfig", "run_mtad", "MTAD/MJSD speed and perplexity vs sd, tau and beam ablations", "MJSD / MTAD"),
    "soak": Verb("SoakConfig", "run_soak", "resident memory over many calls with random prompt lengths", "Memory soak"),
    "quant": Verb("QuantBenchConfig", "run_quant", "quantized variants: bytes, tokens/s, tokens per call, perplexity and "
                  "greedy agreement against the exported pair", "Quantized step graphs"),
    "ppd": Verb("PpdBenchConfig", "run_ppd", "PPD against AR, sd, dynamic and anpd; its trees' ablations; accepted "
                "length by distance (after `specrt ppd train`)", "PPD: parallel prompt decoding"),
    "batch": Verb("BatchBenchConfig", "run_batch", "throughput, request latency and the cost model's predictions by "
                  "batch size: continuous against static, unpadded against padded batches",
                  "Batching: continuous against static, unpadded against padded, and predicted"),
    "load": Verb("LoadBenchConfig", "run_load", "fresh process to first token: import, Pipeline.load and the first "
                 "token, against other bundles (--vs)", "Start-up: fresh process to first token"),
    "serve": Verb("ServeBenchConfig", "run_serve", "concurrent clients over a real Triton server (its generate endpoint, "
                  "its OpenAI route) against the same load in process and served one request at a time: throughput, "
                  "time to first token, inter-token latency", "Serving: a real Triton server against the same load in "
                  "process"),
    "fusions": Verb("FusionsConfig", "run_fusions", "the target's step by the ort backend's projection merges (q/k/v, "
                    "gate/up, none), interleaved in one run", "Load-time fusions: the step by the projections merged"),
    "kernels": Verb("KernelsConfig", "run_kernels", "where a target step's time goes, kernel by kernel "
                    "(torch.profiler): host work, weight GEMMs against the bandwidth roofline, other kernels, gaps",
                    "Kernels: where a target step's time goes"),
    "docs": Verb("DocsConfig", "run_docs", "the full results page and the README's results table, generated from "
                 "bench/results/*.json"),
}
RESULTS = {verb: v.title for verb, v in VERBS.items() if v.title}  # verb -> its results' section title


# -- commands --------------------------------------------------------------------------------------
def rebuild_command(prefix: str, cls, config: dict, bundle: Path | None = None) -> str:
    """The command that re-makes a result from the config it recorded (fields this specrt no longer has are
    dropped; lists become tuples), for `bundle` where given (else the bundle the config names)."""
    names = {f.name for f in fields(cls)}
    kw = {k: tuple(map(tuple, v)) if k == "sweeps" else tuple(v) if isinstance(v, list) else v
          for k, v in config.items() if k in names}
    if bundle is not None or "bundle" in kw:
        kw["bundle"] = Path(bundle if bundle is not None else kw["bundle"])
    return f"{prefix} {to_flags(cls(**kw))}".strip()


def bench_command(verb: str, data: dict) -> str:
    """A bench result's command: recorded by newer runs, rebuilt from its config for older ones."""
    if data.get("command"):
        return data["command"]
    cls = getattr(importlib.import_module(f"specrt.bench.{verb}"), VERBS[verb].config)
    return rebuild_command(f"specrt bench {verb}", cls, data.get("config", {}))


# -- bench results ---------------------------------------------------------------------------------
def bench_results(directory: Path) -> tuple[list[tuple[Path, str, dict]], list[Path]]:
    """(path, verb, data) of every bench report in `directory`, sorted by name; and the other JSON files."""
    found, others = [], []
    for path in sorted(Path(directory).glob("*.json")):
        verb = path.stem.split("-")[0]
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            others.append(path)
            continue
        if verb in RESULTS and isinstance(data, dict) and "rows" in data:
            found.append((path, verb, data))
        else:
            others.append(path)
    return found, others


def speed_rows(verb: str, data: dict) -> list[dict]:
    """A bench run's rows in one shape (the verb's own speed_rows: name, tokens/s, speedup over the run's own
    autoregressive baseline, tokens per target call, and what the verb also measured); [] for verbs without."""
    rows = getattr(importlib.import_module(f"specrt.bench.{verb}"), "speed_rows", None)
    return rows(data) if rows else []


def headline(verb: str, data: dict) -> str:
    """One line a README reader can take away from a bench run: the verb's own headline, computed from its rows."""
    return importlib.import_module(f"specrt.bench.{verb}").headline(data)


def bench_section(results: list[tuple[Path, str, dict]], page_dir: Path, level: int = 2) -> list[str]:
    """Every bench result under its verb's heading: its own Markdown, the command that re-makes it, its plot."""
    import os

    lines = []
    for verb, title in RESULTS.items():
        runs = [(p, d) for p, v, d in results if v == verb]
        if not runs:
            continue
        lines += [f"{'#' * level} {title}", ""]
        for path, data in runs:
            md = importlib.import_module(f"specrt.bench.{verb}").markdown(data).rstrip()
            if md.startswith("### "):  # each verb's Markdown starts with its run's heading
                md = "#" * (level + 1) + md[3:]
            lines += [md, "", f"Command: `{bench_command(verb, data)}` → `{path.as_posix()}`", ""]
            where = data.get("machine") or {}
            if where.get("cpu"):  # older results did not record the machine
                features = ", ".join(where.get("cpu_features") or []) or "none of those recorded"
                lines += [f"Ran on: {where['cpu']}, {where.get('cpus')} cores ({features})", ""]
            png = path.with_suffix(".png")
            if png.is_file():
                lines += [f"![{path.stem}]({Path(os.path.relpath(png, page_dir)).as_posix()})", ""]
    return lines


def results_table(results: list[tuple[Path, str, dict]], docs_page: str) -> list[str]:
    """The README's results table: a headline per committed bench result, its date and where its table is."""
    lines = ["| result | measured | date | command |", "|---|---|---|---|"]
    for path, verb, data in results:
        anchor = re.sub(r"[^\w\- ]", "", RESULTS[verb].lower()).replace(" ", "-")  # as GitHub makes heading anchors
        lines.append(f"| [`{path.stem}`]({docs_page}#{anchor}) | {headline(verb, data)} | {data.get('date', '-')} | "
                     f"`{bench_command(verb, data)}` |")
    return lines

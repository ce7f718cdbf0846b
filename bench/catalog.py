"""The committed bench results: which verb made each, the command that re-makes it, its rows in one shape and its
headline (each verb's own: bench/<verb>.py speed_rows and headline), rendered for docs/results.md, the README's
table (`specrt bench docs`) and the bench section of `specrt report`."""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import fields
from pathlib import Path

from specrt.config import to_flags

VERBS = {"e2e": ("E2EConfig", "End to end"), "trees": ("TreesConfig", "Trees: measured vs predicted"),
         "ngram": ("NgramConfig", "ANPD ablation"), "mtad": ("MtadConfig", "MJSD / MTAD"),
         "soak": ("SoakConfig", "Memory soak"), "quant": ("QuantBenchConfig", "Quantized step graphs"),
         "ppd": ("PpdBenchConfig", "PPD: parallel prompt decoding"),
         "batch": ("BatchBenchConfig", "Batching: continuous against static, unpadded against padded, and predicted"),
         "load": ("LoadBenchConfig", "Start-up: fresh process to first token"),
         "serve": ("ServeBenchConfig", "Serving: a real Triton server against the same load in process"),
         "fusions": ("FusionsConfig", "Load-time fusions: the step by the projections merged"),
         "kernels": ("KernelsConfig", "Kernels: where a target step's time goes")}


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
    cls = getattr(importlib.import_module(f"specrt.bench.{verb}"), VERBS[verb][0])
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
        if verb in VERBS and isinstance(data, dict) and "rows" in data:
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
    for verb, (_, title) in VERBS.items():
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
        anchor = re.sub(r"[^\w\- ]", "", VERBS[verb][1].lower()).replace(" ", "-")  # as GitHub makes heading anchors
        lines.append(f"| [`{path.stem}`]({docs_page}#{anchor}) | {headline(verb, data)} | {data.get('date', '-')} | "
                     f"`{bench_command(verb, data)}` |")
    return lines

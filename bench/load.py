"""`specrt bench load`: how long a program waits before its first token: importing the runtime
(`specrt.runtime.pipeline`, what `from specrt import Pipeline` imports), `Pipeline.load` (which imports the
backend's library, e.g. onnxruntime), and the first `generate` (one new token, what a first request pays on top of
its own work: arenas, first runs).

Every run is a fresh interpreter (bench/startup.py), as a program starting up is; the bundle's files are read once
untimed first, so every bundle is timed with them in the page cache alike (a restart, not a cold disk), and each
row starts once untimed (which records the hashes it checked). With `--vs`, other bundles are timed in the same
run, interleaved run by run in a new random order each time; each row's ratio is against the first bundle's.
Resident memory is read after the first token. Writes JSON, Markdown and a plot.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.report import BenchConfig, header, write_report
from specrt.bundle.machine import resolve_threads
from specrt.bundle.manifest import VERIFY_FLAGS
from specrt.config import option
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends import BackendOptions

PHASES = ("import_s", "load_s", "first_token_s")


@dataclass(frozen=True)
class LoadBenchConfig(BenchConfig, BackendOptions):
    vs: tuple[Path, ...] = option((), "other bundles timed in the same run, each row against --bundle's")
    num_prompts: int = option(1, "the first token is of HumanEval/0", cli=False)
    max_new_tokens: int = option(1, "one new token", cli=False)
    runs: int = option(5, "timed runs per bundle, each a fresh process, after one untimed (medians are reported)", ge=1)
    verify: tuple[str, ...] = option(("recorded",), "how the bundle's files are checked, one row per bundle and mode: "
                                                    "recorded (hashed unless hashed before as the same file: "
                                                    "Pipeline.load's default), full (every file hashed) or none")

    def __post_init__(self):
        super().__post_init__()
        if not self.verify or any(v not in VERIFY_FLAGS for v in self.verify):
            raise InvalidRequestError(f"--verify takes {', '.join(VERIFY_FLAGS)}, got {','.join(self.verify) or 'nothing'}")


def _spawned(cfg: LoadBenchConfig, bundle: Path, verify: str, prompt: str) -> dict:
    """One start-up in a fresh interpreter (bench/startup.py), timed there."""
    spec = {"bundle": str(bundle), "options": {**cfg.pipeline_options(), "verify": VERIFY_FLAGS[verify]}, "prompt": prompt}
    done = subprocess.run([sys.executable, "-m", "specrt.bench.startup", json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecrtError(f"bench load: {bundle} failed to start: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def layout(bundle: Path) -> dict:
    """What the load reads: the bytes of the step graphs the ort backend loads (with their external data), and which
    keep their weights beside the graph (as the manifest says export wrote them)."""
    from specrt.bundle.manifest import load_manifest

    m = load_manifest(bundle, verify=False)
    graphs = {role: m.models[role].onnx for role in ("target", "draft")}
    return {"graph_bytes": sum((Path(bundle) / rel).stat().st_size for rel in m.files
                               if any(rel.startswith(g) for g in graphs.values())),
            "external_data": [g for role, g in graphs.items() if m.export.get(role, {}).get("external_data")]}


def read_through(directory: Path) -> int:
    """Read every file under `directory` once (into the page cache); returns the bytes read."""
    total = 0
    for f in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                total += len(block)
    return total


def run_load(cfg: LoadBenchConfig) -> dict:
    from tqdm import tqdm

    from specrt.bench.prompts import humaneval_prompts

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    bundles = [Path(cfg.bundle), *map(Path, cfg.vs)]
    if len(set(b.resolve() for b in bundles)) < len(bundles):
        raise SpecrtError("bench load: --vs names --bundle or one bundle twice")
    for b in bundles:  # every file in the page cache before any timed run
        read_through(b)
    prompt = humaneval_prompts(1)[0]
    configs = [(b, v) for b in bundles for v in cfg.verify]
    times: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    rng = np.random.default_rng(0)
    with tqdm(total=(cfg.runs + 1) * len(configs), desc=f"bench load {cfg.label}", unit="start") as bar:
        for run in range(cfg.runs + 1):  # the first untimed: it records what it hashed (verify "recorded")
            for i in (range(len(configs)) if run == 0 else rng.permutation(len(configs))):
                got = _spawned(cfg, *configs[int(i)], prompt)
                if run:
                    times[int(i)].append(got)
                bar.update()
    rows = []
    for i, (b, verify) in enumerate(configs):
        runs = times[i]
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in (*PHASES, "rss_mb")}
        rows.append({"bundle": str(b), "verify": verify, **layout(b), **med,
                     "total_s": round(sum(med[k] for k in PHASES), 3),
                     "runs": [{k: round(r[k], 3) for k in (*PHASES, "rss_mb")} for r in runs],
                     "same_first_token": all(r["token"] == runs[0]["token"] for r in runs)})
    for r in rows:
        r["load_vs_first"] = round(r["load_s"] / rows[0]["load_s"], 3)
    data = {**header("load", cfg), "rows": rows}
    write_report(cfg.out / f"load-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### load `{data['label']}`: fresh process to first token, backend {c['backend']}, {c['threads']} threads, "
             f"median of {c['runs']} runs per bundle ({data['date']})", "",
             "| bundle | files checked | step graphs (MB) | weights beside the graph | import (s) | `Pipeline.load` (s) | "
             "first token (s) | total (s) | load / first row's | RSS (MB) |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| `{r['bundle']}` | {r.get('verify', 'recorded')} | {r['graph_bytes'] / 1e6:.0f} | "
                     f"{', '.join(r['external_data']) or 'no'} | "
                     f"{r['import_s']:.2f} | {r['load_s']:.2f} | {r['first_token_s']:.2f} | {r['total_s']:.2f} | "
                     f"{r['load_vs_first']:.2f}x | {r['rss_mb']:.0f} |")
    lines += ["", "Each run a fresh process; the bundles' files read once before the first, so the page cache holds them "
                  "(a restart, not a cold disk). Files checked against the manifest's sha256: recorded = those not "
                  "hashed before as the same file (`Pipeline.load`'s default), full = every one. First token: "
                  "`generate` of one new token from HumanEval/0."]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.6 * len(rows)))
    names = [f"{Path(r['bundle']).name or r['bundle']} ({r.get('verify', 'recorded')})" for r in rows]
    left = np.zeros(len(rows))
    for phase, color in zip(PHASES, ("C7", "C0", "C1")):
        widths = [r[phase] for r in rows]
        ax.barh(names, widths, left=left, color=color, label=phase.removesuffix("_s").replace("_", " "))
        left += widths
    ax.invert_yaxis()
    ax.set_xlabel("seconds from a fresh process (medians)")
    ax.set_title(f"load {data['label']}")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    modes = len(data["config"].get("verify", ())) > 1
    name = lambda r: f"`{r['bundle']}`" + (f" (verify {r['verify']})" if modes else "")  # noqa: E731
    first = data["rows"][0]
    text = f"{name(first)}: **{first['total_s']:.2f} s** to the first token (`Pipeline.load` {first['load_s']:.2f} s)"
    return "; ".join([text] + [f"{name(r)} {r['total_s']:.2f} s (load {r['load_vs_first']:.2f}x)"
                               for r in data["rows"][1:]])

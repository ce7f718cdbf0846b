"""What every bench verb shares: its base config, timed interleaved runs, and JSON + Markdown + PNG output."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.files import write_atomic
from specrt.bundle.manifest import BundleOptions
from specrt.config import option
from specrt.runtime.backends import ThreadOptions


@dataclass(frozen=True)
class BenchConfig(BundleOptions, ThreadOptions):
    """What every `specrt bench` verb takes; each verb's config extends it (and may change defaults)."""

    out: Path = option(Path("build/bench"), "results directory")
    label: str = option("demo", "name used in output files")
    num_prompts: int = option(10, "first N HumanEval prompts", ge=1)
    max_new_tokens: int = option(128, "new tokens per prompt", ge=1)
    runs: int = option(3, "timed runs after one untimed warm-up (medians are reported)", ge=1)


def machine_summary() -> dict:
    """Where a bench ran: the CPU model and the instruction-set extensions its step costs depend on (8-bit GEMMs on
    AVX-512 VNNI ran a one-token dynamic-int8 step of the inflated target in 0.37 of the float32 one's time on one
    2-core host, 0.54 on an AVX2 one: ad hoc timings), beside the platform."""
    from specrt.bundle.machine import cpu_features, cpu_model

    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "cpu": cpu_model(), "cpu_features": list(cpu_features())}


def write_report(stem: Path, data: dict, markdown: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> str:
    """Write stem.json, stem.md and stem.png (each atomically); returns (and prints) the Markdown."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(stem.with_suffix(".json"), json.dumps(data, indent=1) + "\n")
    md = markdown(data)
    write_atomic(stem.with_suffix(".md"), md)
    plot(data, stem.with_suffix(".png"))
    print(md)
    return md


def timed_runs(configs: dict, runs: int, warmup: int, desc: str, meter=None, joules: dict | None = None,
               on_pass: Callable[[dict, dict], None] | None = None) -> tuple[dict, dict]:
    """Run every config's callable `warmup` times untimed, then `runs` timed passes, interleaved so that
    drift hits all configs alike, each timed pass in a new random order (seeded): whatever one config leaves
    behind for the next (a grown arena, a cold cache) falls on a different one each pass, not always on the
    same neighbour. Returns ({name: [seconds per timed run]}, {name: last result}); with an available
    EnergyMeter, `joules` gets {name: [joules per timed run]}. `on_pass(seconds, last)` is called after each
    timed pass but the last (a bench that is cut off still leaves what it measured)."""
    from tqdm import tqdm

    seconds = {name: [] for name in configs}
    last = {}
    measure = meter is not None and meter.available and joules is not None
    names, rng = list(configs), np.random.default_rng(0)
    with tqdm(total=(warmup + runs) * len(configs), desc=desc, unit="config-run") as bar:
        for r in range(warmup + runs):
            for name in (names if r < warmup else [names[i] for i in rng.permutation(len(names))]):
                run = configs[name]
                if measure:
                    meter.start()
                t0 = time.perf_counter()
                last[name] = run()
                if r >= warmup:
                    seconds[name].append(time.perf_counter() - t0)
                    if measure:
                        joules.setdefault(name, []).append(meter.stop())
                bar.update()
            if on_pass is not None and warmup <= r < warmup + runs - 1:
                on_pass(seconds, last)
    return seconds, last


def header(verb: str, cfg) -> dict:
    """The fields every bench JSON starts with: label, date, the command that re-makes it, config, machine, and
    the sha256 of the bundle's manifest (how `specrt report` finds the runs made on a bundle's export)."""
    from specrt.bundle.manifest import MANIFEST, manifest_sha256
    from specrt.config import config_dict, to_flags

    made_from = manifest_sha256(cfg.bundle) if (Path(cfg.bundle) / MANIFEST).is_file() else None
    return {"label": cfg.label, "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"), "command": f"specrt bench {verb} {to_flags(cfg)}".strip(),
            "config": config_dict(cfg), "machine": machine_summary(), "bundle_manifest_sha256": made_from}


def paired_ratio(values: list[float], base_values: list[float]) -> float:
    """The median over timed runs of a row's figure over a baseline's in the same run (tokens/s, ms a step): rows
    interleaved within a run share the machine's drift between runs (on a shared VM, 10-30% from one minute to the
    next), which a ratio of two medians taken from different runs does not cancel. values, base_values: each timed
    run's figure, the same runs in the same order."""
    if len(values) != len(base_values) or not values:
        raise ValueError(f"paired runs must be as many and at least one, got {len(values)} and {len(base_values)}")
    return float(np.median([v / b for v, b in zip(values, base_values)]))


def runs_rate(seconds: list[float], tokens: int) -> list[float]:
    """Each run's tokens/s from its seconds for `tokens` new tokens."""
    return [tokens / s for s in seconds]


def speedup(seconds: dict, tokens: dict, name, base) -> float:
    """Config `name`'s tokens/s over config `base`'s, paired run by run (paired_ratio). seconds: timed_runs'
    {config: [seconds of each timed run]}; tokens: {config: new tokens per run}."""
    return paired_ratio(runs_rate(seconds[name], tokens[name]), runs_rate(seconds[base], tokens[base]))


def ratio_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def best_lossless(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """(our autoregressive row, our fastest lossless speculative row) of a bench's speed rows: each a dict of name,
    tokens_per_s, speedup (over the run's own AR), tokens_per_call, lossless, baseline (another runtime's row) and
    what the bench also measured."""
    ar = next((r for r in rows if r["name"] == "autoregressive"), None)
    ours = [r for r in rows if r["speedup"] is not None and r["name"] != "autoregressive"
            and not r.get("baseline") and r["lossless"]]
    return ar, (max(ours, key=lambda r: r["speedup"]) if ours else None)


def lossless_headline(rows: list[dict]) -> str:
    ar, best = best_lossless(rows)
    if ar is None or best is None:
        return "no speculative row"
    return (f"best lossless `{best['name']}` **{ratio_text(best['speedup'])}** our AR ({best['tokens_per_s']:.1f} vs "
            f"{ar['tokens_per_s']:.1f} tok/s)")

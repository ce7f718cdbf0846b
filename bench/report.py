"""Shared output of bench verbs: JSON + Markdown + PNG under one stem, and a headless pyplot."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class BenchConfig:
    """What every `specrt bench` verb takes (the CLI's add_bench_args); each verb's config extends it."""

    bundle: Path
    out: Path
    label: str = "demo"
    num_prompts: int = 10
    max_new_tokens: int = 128
    runs: int = 3
    threads: int = 2


def common_args(args) -> dict:
    """The BenchConfig fields from parsed add_bench_args arguments."""
    return {f.name: getattr(args, f.name) for f in fields(BenchConfig)}


def number_list(text: str, kind=int) -> tuple:
    """A comma list from the command line: "1,2,4" -> (1, 2, 4); "" -> ()."""
    return tuple(kind(x) for x in text.split(",") if x)


def config_dict(cfg) -> dict:
    """A frozen config dataclass as JSON-ready data (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}


def write_report(stem: Path, data: dict, markdown: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> str:
    """Write stem.json, stem.md and stem.png; returns (and prints) the Markdown."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    md = markdown(data)
    stem.with_suffix(".md").write_text(md)
    plot(data, stem.with_suffix(".png"))
    print(md)
    return md


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def finish_figure(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label, grid, legend to the right of the axes, then save_figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Lay out, write (PNG, 110 dpi) and release a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps legends placed outside the axes
    plt.close(fig)


def timed_runs(configs: dict, runs: int, warmup: int, desc: str) -> tuple[dict, dict]:
    """Run every config's callable `warmup` times untimed, then `runs` timed passes, interleaved so that
    drift hits all configs alike. Returns ({name: [seconds per timed run]}, {name: last result})."""
    import time

    from tqdm import tqdm

    seconds = {name: [] for name in configs}
    last = {}
    with tqdm(total=(warmup + runs) * len(configs), desc=desc, unit="config-run") as bar:
        for r in range(warmup + runs):
            for name, run in configs.items():
                t0 = time.perf_counter()
                last[name] = run()
                if r >= warmup:
                    seconds[name].append(time.perf_counter() - t0)
                bar.update()
    return seconds, last

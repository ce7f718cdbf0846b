"""`specrt demo` (what `make demo` runs): export the committed demo pair if needed, then compare our
methods on HumanEval prompts with the e2e bench (no external baselines)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from specrt.bench.e2e import OURS, VARIANTS, E2EConfig, run_e2e
from specrt.bundle.manifest import BundleOptions
from specrt.config import option
from specrt.runtime.backends import ThreadOptions


@dataclass(frozen=True)
class DemoConfig(BundleOptions, ThreadOptions):
    """The bundle is exported from the demo pair first if it holds no manifest."""

    num_prompts: int = option(10, "first N HumanEval prompts", ge=1)
    max_new_tokens: int = option(64, "new tokens per prompt", ge=1)


def demo_methods(bundle: Path) -> tuple[str, ...]:
    """The e2e rows of our methods, less the hardware-aware ones when the bundle has no latency profile."""
    from specrt.bundle.artifacts import LatencyProfile

    if (bundle / LatencyProfile.FILE).is_file():
        return OURS
    return tuple(m for m in OURS if not VARIANTS.get(m, ("", {}))[1].get("ngram_hardware_aware"))


def run_demo(cfg: DemoConfig) -> dict:
    from specrt.bench.prompts import humaneval_prompts
    from specrt.bundle.manifest import MANIFEST
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    if not (cfg.bundle / MANIFEST).is_file():
        print(f"exporting the demo pair to {cfg.bundle}")
        export_bundle(ExportConfig(out=cfg.bundle))
    methods = demo_methods(cfg.bundle)
    if methods != OURS:
        print(f"skipping {', '.join(m for m in OURS if m not in methods)}: run `specrt profile --bundle {cfg.bundle}` "
              "(a few minutes) to include it")
    data = run_e2e(E2EConfig(bundle=cfg.bundle, out=cfg.bundle.parent / "bench", label="make-demo",
                             num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens, runs=3,
                             threads=cfg.threads, methods=methods, baselines=()))
    prompt = humaneval_prompts(1)[0]
    out = Pipeline.load(cfg.bundle, threads=cfg.threads, verify=cfg.verify_mode).generate(prompt, max_new_tokens=cfg.max_new_tokens)
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print("sample (HumanEval/0, sd, greedy; the continuation in bold on a terminal):\n" + prompt[-200:] + bold + out.text + plain)
    return data

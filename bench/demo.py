"""`specrt demo` (what `make demo` runs): export the committed demo pair if needed, then compare our
methods on HumanEval prompts with the e2e bench (no external baselines)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from specrt.bench.e2e import OURS, VARIANTS, E2EConfig, run_e2e


@dataclass(frozen=True)
class DemoConfig:
    bundle: Path
    num_prompts: int = 10
    max_new_tokens: int = 64
    threads: int | None = 2
    backend: str = "ort"


def demo_methods(bundle: Path) -> tuple[str, ...]:
    """The e2e rows of our methods, less the hardware-aware ones when the bundle has no latency profile."""
    from specrt.bench.latency import LATENCY

    if (bundle / LATENCY).is_file():
        return OURS
    return tuple(m for m in OURS if not VARIANTS.get(m, ("", {}))[1].get("ngram_hardware_aware"))


def run_demo(cfg: DemoConfig) -> dict:
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.manifest import MANIFEST
    from specrt.models import DEMO_DIR

    if not (cfg.bundle / MANIFEST).is_file():
        print(f"exporting the demo pair to {cfg.bundle}")
        export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", out=cfg.bundle,
                                   tokenizer=DEMO_DIR / "tokenizer"))
    methods = demo_methods(cfg.bundle)
    if methods != OURS:
        print(f"skipping {', '.join(m for m in OURS if m not in methods)}: run `specrt profile --bundle {cfg.bundle}` "
              "(a few minutes) to include it")
    data = run_e2e(E2EConfig(bundle=cfg.bundle, out=cfg.bundle.parent / "bench", label="make-demo",
                             num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens, runs=3,
                             threads=cfg.threads or 2, methods=methods, baselines=()))
    from specrt.bench.prompts import humaneval_prompts
    from specrt.runtime.pipeline import Pipeline

    prompt = humaneval_prompts(1)[0]
    out = Pipeline.load(cfg.bundle, backend=cfg.backend, threads=cfg.threads).generate(prompt, max_new_tokens=cfg.max_new_tokens)
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print("sample (HumanEval/0, sd, greedy; the continuation in bold on a terminal):\n" + prompt[-200:] + bold + out.text + plain)
    return data

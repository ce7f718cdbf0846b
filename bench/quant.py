"""`specrt bench quant`: what each quantized variant of a bundle (`specrt quantize`) buys and costs, against the
exported (float) pair measured in the same run.

Per variant (both models quantized), on HumanEval prompts, greedy, batch 1: model bytes; tokens/s of each of
our rows (autoregressive and the lossless methods asked for; timed runs interleaved across every variant
and row, medians) and the ratio to the float pair's autoregressive; tokens per target call. Quality against
the float target, on held-out text (never HumanEval): the target's perplexity (teacher-forced) and the share
of positions where both targets' greedy choice agrees (teacher-forced, and over free-running greedy
continuations). And per variant, a float target with the quantized draft: tokens per target call against the
float pair's (does a quantized draft still guess as well?). Outputs JSON, Markdown and a PNG.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.e2e import VARIANTS, OurRunner
from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import BenchConfig, header, timed_runs, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.engines.quantize import graph_bytes
from specrt.plotting import pyplot, save_figure

FLOAT = "exported"  # the row of the pair as exported (float weights)


@dataclass(frozen=True)
class QuantBenchConfig(BenchConfig):
    num_prompts: int = option(5, "first N HumanEval prompts (speed)", ge=1)
    schemes: tuple[str, ...] = option(("int8-weights", "int4-weights", "static-int8"),
                                      "variants to measure (each made by `specrt quantize --scheme S`)")
    methods: tuple[str, ...] = option(("autoregressive", "sd", "dynamic-ngram"), "our rows: methods or e2e variants")
    quality_prompts: int = option(8, "held-out prompts for perplexity and greedy agreement", ge=1)
    quality_tokens: int = option(128, "greedy tokens compared per held-out prompt", ge=1)


def _quality(pipe, reference: dict | None, prompts: list[list[int]], cfg: QuantBenchConfig) -> dict:
    """Quality of pipe's target on held-out text against `reference` (the exported target's, or None when this is
    it): perplexity of the text (teacher-forced); the share of positions of the text where both targets' greedy
    choice is the same (teacher-forced top-1 agreement); and free-running greedy continuations of each prompt's
    first half, compared position by position (one early flip changes the rest of a continuation)."""
    from specrt.runtime.sampling import log_softmax
    from specrt.runtime.step_inputs import sequence_logits

    logps, top1 = [], []
    with pipe.target.runner() as runner:
        for p in prompts:
            logits = sequence_logits(runner, np.asarray(p[:-1], dtype=np.int64))  # [T - 1, V]
            logps.append(log_softmax(logits)[np.arange(len(p) - 1), np.asarray(p[1:])])
            top1.append(logits.argmax(-1))
    half = [p[: len(p) // 2] for p in prompts]
    outs = [o.token_ids for o in pipe.generate(half, method="autoregressive", max_new_tokens=cfg.quality_tokens)]
    out = {"perplexity": float(np.exp(-np.concatenate(logps).mean())), "top1": top1, "greedy": outs}
    if reference is not None:
        out["top1_agreement"] = float(np.mean(np.concatenate([a == b for a, b in zip(top1, reference["top1"])])))
        out["greedy_agreement"] = (sum(a == b for r, o in zip(reference["greedy"], outs) for a, b in zip(r, o))
                                   / sum(map(len, reference["greedy"])))
    else:
        out["top1_agreement"] = out["greedy_agreement"] = 1.0
    return out


def run_quant(cfg: QuantBenchConfig) -> dict:
    from specrt.bundle import artifacts
    from specrt.bundle.artifacts import QuantSet
    from specrt.checkpoints.corpus import validation_prompts
    from specrt.runtime.backends import load_backend
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    quant = artifacts.load(cfg.bundle, QuantSet).variants
    pipes = {FLOAT: Pipeline.load(cfg.bundle, threads=cfg.threads)}
    for s in cfg.schemes:
        pipes[s] = Pipeline.load(cfg.bundle, threads=cfg.threads, quant=s)  # refuses a scheme not made, saying how
    prompts = humaneval_prompts(cfg.num_prompts)
    runners = {}
    for variant, pipe in pipes.items():
        for m in cfg.methods:
            method, options = VARIANTS.get(m, (m, {}))
            runners[(variant, m)] = OurRunner(pipe, method, cfg, **options)
    seconds, last = timed_runs({k: (lambda r=r: r(prompts)) for k, r in runners.items()}, cfg.runs, 1,
                               f"bench quant {cfg.label}")
    base = pipes[FLOAT]
    held_out = validation_prompts(base.encode, cfg.quality_prompts, 2 * cfg.quality_tokens, seed=1)
    ref = _quality(base, None, held_out, cfg)
    rows = []
    ar0 = None
    for variant, pipe in pipes.items():
        q = _quality(pipe, ref, held_out, cfg) if variant != FLOAT else ref
        files = {r: (quant[variant][r].file if variant in quant and r in quant[variant] else
                     pipe.manifest["models"][r]["onnx"]) for r in ("target", "draft")}
        row = {"variant": variant, "target_mb": round(graph_bytes(cfg.bundle / files["target"]) / 2**20, 1),
               "draft_mb": round(graph_bytes(cfg.bundle / files["draft"]) / 2**20, 1),
               "quantize_s": round(sum(v.seconds for v in quant.get(variant, {}).values()), 1),
               "perplexity": round(q["perplexity"], 4),
               "perplexity_delta": round(q["perplexity"] / ref["perplexity"] - 1, 4),
               "top1_agreement": round(q["top1_agreement"], 4), "greedy_agreement": round(q["greedy_agreement"], 4),
               "methods": {}}
        for m in cfg.methods:
            outs, calls, _ = last[(variant, m)]
            tps = sum(map(len, outs)) / statistics.median(seconds[(variant, m)])
            if variant == FLOAT and m == "autoregressive":
                ar0 = tps
            row["methods"][m] = {"tokens_per_s": round(tps, 2), "runs_s": [round(x, 3) for x in seconds[(variant, m)]],
                                 "tokens_per_target_call": round(sum(map(len, outs)) / calls, 3) if calls else None}
        rows.append(row)
    for row in rows:
        for r in row["methods"].values():
            r["vs_exported_ar"] = round(r["tokens_per_s"] / ar0, 3) if ar0 else None
        best = max(row["methods"], key=lambda m: row["methods"][m]["tokens_per_s"])
        row["best"] = best
    # a float target with each quantized draft: tokens per target call (deterministic: one untimed pass)
    drafts = []
    for s in cfg.schemes:
        if "draft" not in quant.get(s, {}):
            continue
        mixed = Pipeline.load(cfg.bundle, threads=cfg.threads)
        mixed.draft = load_backend("ort", cfg.bundle, mixed.draft.entry, cfg.threads, "cpu", graph=quant[s]["draft"].file)
        for m in cfg.methods:
            if m == "autoregressive":
                continue
            method, options = VARIANTS.get(m, (m, {}))
            outs, calls, _ = OurRunner(mixed, method, cfg, **options)(prompts)
            float_calls = last[(FLOAT, m)][1]
            drafts.append({"draft": s, "method": m, "tokens_per_target_call": round(sum(map(len, outs)) / calls, 3),
                           "vs_exported_draft": round(float_calls / calls, 3)})
    data = {**header("quant", cfg), "rows": rows, "drafts": drafts}
    write_report(cfg.out / f"quant-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    methods = c["methods"]
    lines = [f"### quant `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, "
             f"greedy, batch 1, ONNX Runtime, {c['threads']} threads, median of {c['runs']} runs; quality on "
             f"{c['quality_prompts']} held-out prompts x {c['quality_tokens']} tokens ({data['date']})", "",
             "| variant | target MB | draft MB | " + " | ".join(f"{m} tok/s (vs exported AR)" for m in methods)
             + " | tokens/call (" + ", ".join(m for m in methods if m != "autoregressive") + ") | perplexity (delta) "
             "| top-1 as exported, teacher-forced | greedy continuation as exported | quantize s |",
             "|---|---:|---:|" + "---:|" * len(methods) + "---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        ms = r["methods"]
        speed = " | ".join(f"{ms[m]['tokens_per_s']:.1f} ({ms[m]['vs_exported_ar']:.2f}x)" for m in methods)
        top1 = f"{r['top1_agreement']:.1%}" if "top1_agreement" in r else "-"  # results before it was measured
        calls = ", ".join(f"{ms[m]['tokens_per_target_call']:.2f}" for m in methods
                          if m != "autoregressive" and ms[m]["tokens_per_target_call"])
        lines.append(f"| {r['variant']} | {r['target_mb']:.1f} | {r['draft_mb']:.1f} | {speed} | {calls} | "
                     f"{r['perplexity']:.3f} ({r['perplexity_delta']:+.1%}) | {top1} | {r['greedy_agreement']:.1%} | "
                     f"{r['quantize_s']:.1f} |")
    if data.get("drafts"):
        lines += ["", "Exported target with a quantized draft: tokens per target call (vs the exported draft's)", "",
                  "| draft | method | tokens/target call | vs exported draft |", "|---|---|---:|---:|"]
        lines += [f"| {d['draft']} | {d['method']} | {d['tokens_per_target_call']:.2f} | {d['vs_exported_draft']:.3f} |"
                  for d in data["drafts"]]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows, methods = data["rows"], data["config"]["methods"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([j + i * width for j in range(len(rows))], [r["methods"][m]["tokens_per_s"] for r in rows], width, label=m)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(rows))], [r["variant"] for r in rows])
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"quant {data['label']}: {data['config']['threads']} threads")
    ax.legend(fontsize=8)
    save_figure(fig, path)

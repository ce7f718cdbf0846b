"""`specrt bench quant`: what each quantized variant of a bundle buys and costs, against the float pair measured in
the same run.

Variants: on the ort backend `specrt quantize`'s step graphs (int8-weights, int4-weights, dynamic-int8,
static-int8); on the torch and static backends the PyTorch step's 8-bit projections (int8-wo, fp8; static: engines
built with `specrt build --quant S`). Per variant (both models quantized), on HumanEval prompts, greedy, batch 1: model
bytes; tokens/s of each of our rows (autoregressive and the lossless methods asked for; timed runs interleaved
across every variant and row, medians) and the ratio to the float pair's autoregressive; tokens per target call;
on a GPU, each row's energy per token (NVML) and its fraction of the variant's own roofline (its target's weight
bytes / the measured copy bandwidth). Quality against the float target, on held-out text (never HumanEval): the
target's perplexity (teacher-forced) and the share of positions where both targets' greedy choice agrees
(teacher-forced, and over free-running greedy continuations), each with its 5-95% interval over resamples of the
held-out prompts. And per variant, a float target with the quantized draft: tokens per target call against the
float pair's (does a quantized draft still guess as well?). `--reference-dtypes` adds the same quality figures for
the exported target cast to a float deployment dtype (bfloat16, float16) and run by PyTorch: what a user who
deploys in 16 bits already accepts, beside which a quantized variant's figures read. Outputs JSON, Markdown and a PNG.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.e2e import VARIANTS, OurRunner, run_weight_bytes
from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import BenchConfig, header, ratio_text, timed_runs, write_report
from specrt.bundle.artifacts.latency import roofline_ms
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.contract import TORCH_QUANT_SCHEMES
from specrt.errors import InvalidRequestError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends import KINDS, backend_kind

FLOAT = "exported"  # the row of the pair as exported (float weights)
REFERENCE_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class QuantBenchConfig(BenchConfig):
    num_prompts: int = option(5, "first N HumanEval prompts (speed)", ge=1)
    backend: str = option("ort", "ort = `specrt quantize`'s step graphs on ONNX Runtime; torch = the PyTorch step's "
                                 "8-bit projections, eager; static = the same in the bundle's engines (`specrt build "
                                 "--quant S` for each scheme, and once without)",
                          choices=tuple(n for n, k in KINDS.items() if k.engines is None or k.engines.PER_VARIANT))
    device: str | None = option(None, "torch and static: the device (default: CUDA where present; static: the engines')")
    schemes: tuple[str, ...] | None = option(None, "variants to measure (default: ort: int8-weights, int4-weights, "
                                                   "dynamic-int8, static-int8, each made by `specrt quantize "
                                                   "--scheme S`; torch and static: int8-wo, fp8)")
    methods: tuple[str, ...] = option(("autoregressive", "sd", "dynamic-ngram"), "our rows: methods or e2e variants")
    quality_prompts: int = option(8, "held-out prompts for perplexity and greedy agreement", ge=1)
    quality_tokens: int = option(128, "greedy tokens compared per held-out prompt", ge=1)
    reference_dtypes: tuple[str, ...] = option((), "quality only: the exported target cast to each of these dtypes "
                                                   "and run by PyTorch on the device the bench runs on: the figures a "
                                                   "16-bit float deployment reaches", choices=REFERENCE_DTYPES)

    def __post_init__(self):
        super().__post_init__()
        kind = backend_kind(self.backend)
        torch_schemes = kind.quant == "projections"
        if self.schemes is None:
            object.__setattr__(self, "schemes", TORCH_QUANT_SCHEMES if torch_schemes else
                               ("int8-weights", "int4-weights", "dynamic-int8", "static-int8"))
        wrong = [s for s in self.schemes if (s in TORCH_QUANT_SCHEMES) != torch_schemes]
        if wrong:
            raise InvalidRequestError(f"--schemes {','.join(wrong)}: the {self.backend} backend measures "
                                      + ("the PyTorch step's 8-bit projections (" + ", ".join(TORCH_QUANT_SCHEMES) + ")"
                                         if torch_schemes else "`specrt quantize`'s variants (int8-weights, "
                                         "int4-weights, dynamic-int8, static-int8, int8-qdq)"))
        if kind.host_cores and self.device not in (None, "cpu"):
            raise InvalidRequestError(f"--device {self.device}: the {self.backend} backend runs on the CPU")


def _quality(pipe, reference: dict | None, prompts: list[list[int]], cfg: QuantBenchConfig) -> dict:
    """Quality of pipe's target on held-out text against `reference` (the exported target's, or None when this is
    it): perplexity of the text (teacher-forced); the share of positions of the text where both targets' greedy
    choice is the same (teacher-forced top-1 agreement); and free-running greedy continuations of each prompt's
    first half, compared position by position (one early flip changes the rest of a continuation). Each agreement
    with its 5-95% interval over resamples of the prompts."""
    from specrt.calibration.acceptance import ratio_interval
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
    if reference is None:
        out["top1_agreement"] = out["greedy_agreement"] = 1.0
        return out
    for key, ours, theirs in (("top1", top1, reference["top1"]), ("greedy", outs, reference["greedy"])):
        same = [sum(int(a == b) for a, b in zip(r, o)) for r, o in zip(theirs, ours)]
        total = [len(r) for r in theirs]
        out[f"{key}_agreement"] = sum(same) / sum(total)
        out[f"{key}_interval"] = ratio_interval(same, total)
    # where each continuation first leaves the reference's (its length where it never does)
    out["first_divergence"] = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
                               for r, o in zip(reference["greedy"], outs)]
    return out


def _float_reference(cfg: QuantBenchConfig, dtype: str, device: str):
    """A pipeline whose target is the exported checkpoint cast to `dtype`, run by PyTorch on `device` (quality rows
    only)."""
    from specrt.runtime.backends import ModelSource, load_backend
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(cfg.bundle, backend="torch", threads=cfg.threads, device=device, verify=cfg.verify_mode)
    entry = replace(pipe.target.entry, dtype=dtype)
    pipe.target = None  # its weights go before the cast copy's come (a 7B-class target: 12 GB each)
    pipe.target = load_backend("torch", cfg.bundle, ModelSource(entry, cfg.threads, pipe.machine.device))
    return pipe


def _quality_row(q: dict, ref: dict) -> dict:
    row = {"perplexity": round(q["perplexity"], 4), "perplexity_delta": round(q["perplexity"] / ref["perplexity"] - 1, 4),
           "top1_agreement": round(q["top1_agreement"], 4), "greedy_agreement": round(q["greedy_agreement"], 4)}
    for key in ("top1_interval", "greedy_interval", "first_divergence"):
        if key in q:
            row[key] = [round(x, 4) for x in q[key]]
    return row


def _load(cfg: QuantBenchConfig, scheme: str | None):
    from specrt.runtime.pipeline import Pipeline

    # refuses a scheme not made (ort: `specrt quantize`; static: `specrt build --quant`), saying how
    return Pipeline.load(cfg.bundle, backend=cfg.backend, threads=cfg.threads, device=cfg.device, quant=scheme,
                         verify=cfg.verify_mode)


def _weights(cfg: QuantBenchConfig, pipe, variants: dict, variant: str, role: str) -> tuple[int, float]:
    """(bytes of the model's weights as this variant runs them, seconds its quantization took)."""
    if backend_kind(cfg.backend).quant == "projections":  # the PyTorch step, quantized when the backend loaded
        quant = getattr(pipe, role).quant
        return run_weight_bytes(pipe, role), quant.seconds if quant else 0.0
    v = variants.get(variant, {}).get(role)
    return run_weight_bytes(pipe, role), v.seconds if v else 0.0


def _quantized_draft(cfg: QuantBenchConfig, pipe, variants: dict, scheme: str):
    """The draft backend of variant `scheme`, or None where the variant has no draft."""
    from specrt.bundle import artifacts
    from specrt.runtime.backends import ModelSource, load_backend

    entry, device = pipe.draft.entry, pipe.machine.device
    kind = backend_kind(cfg.backend)
    if kind.step_graphs:
        v = variants.get(scheme, {}).get("draft")
        return None if v is None else load_backend(cfg.backend, cfg.bundle,
                                                   ModelSource(entry, cfg.threads, device, graph=v.file))
    engines = artifacts.load(cfg.bundle, kind.engines, quant=scheme) if kind.engines else None
    return load_backend(cfg.backend, cfg.bundle, ModelSource(entry, cfg.threads, device, engines, quant=scheme))


def run_quant(cfg: QuantBenchConfig) -> dict:
    from specrt.bench.hardware import EnergyMeter
    from specrt.bundle import artifacts
    from specrt.bundle.artifacts import QuantSet
    from specrt.calibration.latency import copy_bandwidth
    from specrt.checkpoints.corpus import validation_prompts

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    variants = artifacts.load(cfg.bundle, QuantSet).variants if backend_kind(cfg.backend).step_graphs else {}
    pipes = {FLOAT: _load(cfg, None)}
    for s in cfg.schemes:
        pipes[s] = _load(cfg, s)
    device = pipes[FLOAT].machine.device
    prompts = humaneval_prompts(cfg.num_prompts)
    runners = {}
    for variant, pipe in pipes.items():
        for m in cfg.methods:
            method, options = VARIANTS.get(m, (m, {}))
            runners[(variant, m)] = OurRunner(pipe, method, cfg, **options)
    meter, joules = EnergyMeter(device), {}
    seconds, last = timed_runs({k: (lambda r=r: r(prompts)) for k, r in runners.items()}, cfg.runs, 1,
                               f"bench quant {cfg.label}", meter, joules)
    bandwidth = copy_bandwidth(device, cfg.threads)
    base = pipes[FLOAT]
    held_out = validation_prompts(base.encode, cfg.quality_prompts, 2 * cfg.quality_tokens, seed=1)
    ref = _quality(base, None, held_out, cfg)
    rows = []
    ar0 = None
    for variant, pipe in pipes.items():
        q = _quality(pipe, ref, held_out, cfg) if variant != FLOAT else ref
        (target_bytes, target_s), (draft_bytes, draft_s) = (_weights(cfg, pipe, variants, variant, r)
                                                            for r in ("target", "draft"))
        kept = getattr(variants.get(variant, {}).get("target"), "kept", ())  # `specrt quantize --keep`
        row = {"variant": variant, "kept": list(kept), "target_mb": round(target_bytes / 2**20, 1),
               "draft_mb": round(draft_bytes / 2**20, 1),
               "quantize_s": round(target_s + draft_s, 1), "roofline_ms": round(roofline_ms(target_bytes, bandwidth), 3),
               **_quality_row(q, ref), "methods": {}}
        for m in cfg.methods:
            outs, calls = last[(variant, m)][:2]
            tokens = sum(map(len, outs))
            tps = tokens / statistics.median(seconds[(variant, m)])
            if variant == FLOAT and m == "autoregressive":
                ar0 = tps
            spent = joules.get((variant, m))
            row["methods"][m] = {"tokens_per_s": round(tps, 2), "runs_s": [round(x, 3) for x in seconds[(variant, m)]],
                                 "tokens_per_target_call": round(tokens / calls, 3) if calls else None,
                                 "roofline_fraction": round(tps * target_bytes / bandwidth, 4),
                                 "joules_per_token": round(statistics.median(spent) / tokens, 4) if spent else None}
        rows.append(row)
    for row in rows:
        for r in row["methods"].values():
            r["vs_exported_ar"] = round(r["tokens_per_s"] / ar0, 3) if ar0 else None
        best = max(row["methods"], key=lambda m: row["methods"][m]["tokens_per_s"])
        row["best"] = best
    # a float target with each quantized draft: tokens per target call (deterministic: one untimed pass)
    drafts = []
    for s in cfg.schemes:
        draft = _quantized_draft(cfg, base, variants, s)
        if draft is None:
            continue
        float_draft, base.draft = base.draft, draft
        try:
            for m in cfg.methods:
                if m == "autoregressive":
                    continue
                method, options = VARIANTS.get(m, (m, {}))
                outs, calls = OurRunner(base, method, cfg, **options)(prompts)[:2]
                drafts.append({"draft": s, "method": m, "tokens_per_target_call": round(sum(map(len, outs)) / calls, 3),
                               "vs_exported_draft": round(last[(FLOAT, m)][1] / calls, 3)})
        finally:
            base.draft = float_draft
    references = []  # quality only: the exported target in a 16-bit float dtype
    for dtype in cfg.reference_dtypes:
        q = _quality(_float_reference(cfg, dtype, device), ref, held_out, cfg)
        references.append({"dtype": dtype, **_quality_row(q, ref)})
    data = {**header("quant", cfg), "rows": rows, "drafts": drafts, "references": references,
            "device": pipes[FLOAT].machine.gpu or device, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "energy": meter.why_not or "NVML"}
    write_report(cfg.out / f"quant-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    methods = c["methods"]
    backend = c.get("backend", "ort")  # results before the torch backends were measured: ort
    kind = backend_kind(backend)
    where = f"{kind.title}, {c['threads']} threads" if kind.host_cores else f"{kind.title} on {data.get('device')}"
    energy = any(m.get("joules_per_token") for r in data["rows"] for m in r["methods"].values())
    lines = [f"### quant `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, "
             f"greedy, batch 1, {where}, median of {c['runs']} runs; quality on "
             f"{c['quality_prompts']} held-out prompts x {c['quality_tokens']} tokens ({data['date']})", "",
             "| variant | target MB | draft MB | " + " | ".join(f"{m} tok/s (vs exported AR)" for m in methods)
             + " | tokens/call (" + ", ".join(m for m in methods if m != "autoregressive") + ") | perplexity (delta) "
             "| top-1 as exported, teacher-forced | greedy continuation as exported | quantize s |"
             + (" best row: of roofline, J/token |" if energy else ""),
             "|---|---:|---:|" + "---:|" * len(methods) + "---:|---:|---:|---:|---:|" + ("---:|" if energy else "")]
    for r in data["rows"]:
        ms = r["methods"]
        speed = " | ".join(f"{ms[m]['tokens_per_s']:.1f} ({ms[m]['vs_exported_ar']:.2f}x)" for m in methods)
        best = ms[r["best"]]
        gpu = (f" {r['best']}: {best['roofline_fraction']:.1%} of {r['roofline_ms']} ms, "
               f"{best['joules_per_token']:.3f} J |" if energy else "")
        top1 = _agreement(r, "top1")
        calls = ", ".join(f"{ms[m]['tokens_per_target_call']:.2f}" for m in methods
                          if m != "autoregressive" and ms[m]["tokens_per_target_call"])
        name = r["variant"] + (f" ({', '.join(r['kept'])} in float)" if r.get("kept") else "")
        lines.append(f"| {name} | {r['target_mb']:.1f} | {r['draft_mb']:.1f} | {speed} | {calls} | "
                     f"{r['perplexity']:.3f} ({r['perplexity_delta']:+.1%}) | {top1} | {_agreement(r, 'greedy')} | "
                     f"{r['quantize_s']:.1f} |{gpu}")
    if energy:
        lines += ["", f"Roofline: each variant's target weight bytes / {data['copy_bandwidth_gb_s']} GB/s measured copy "
                      f"bandwidth; energy: {data['energy']}."]
    if any("greedy_interval" in r for r in data["rows"]):
        lines += ["", "Agreements in brackets: 5-95% over resamples of the held-out prompts. Where each greedy "
                      f"continuation first leaves the exported target's (token index; {c['quality_tokens']}: never): "
                  + "; ".join(f"{r['variant']} {', '.join(map(str, r['first_divergence']))}"
                              for r in data["rows"] if "first_divergence" in r) + "."]
    if data.get("references"):
        lines += ["", "For reference, the exported target cast to a 16-bit float dtype (PyTorch; quality only): what a "
                      "16-bit deployment of the same weights already moves", "",
                  "| dtype | perplexity (delta) | top-1 as exported, teacher-forced | greedy continuation as exported | "
                  "first divergence per prompt |", "|---|---:|---:|---:|---|"]
        lines += [f"| {r['dtype']} | {r['perplexity']:.3f} ({r['perplexity_delta']:+.1%}) | {_agreement(r, 'top1')} | "
                  f"{_agreement(r, 'greedy')} | {', '.join(map(str, r['first_divergence']))} |"
                  for r in data["references"]]
    if data.get("drafts"):
        lines += ["", "Exported target with a quantized draft: tokens per target call (vs the exported draft's)", "",
                  "| draft | method | tokens/target call | vs exported draft |", "|---|---|---:|---:|"]
        lines += [f"| {d['draft']} | {d['method']} | {d['tokens_per_target_call']:.2f} | {d['vs_exported_draft']:.3f} |"
                  for d in data["drafts"]]
    return "\n".join(lines) + "\n"


def _agreement(row: dict, key: str) -> str:
    """An agreement share with its interval where measured (results before either was measured: what they have)."""
    if f"{key}_agreement" not in row:
        return "-"
    interval = row.get(f"{key}_interval")
    return f"{row[f'{key}_agreement']:.1%}" + (f" [{interval[0]:.1%}-{interval[1]:.1%}]" if interval else "")


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


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    parts = []
    for r in data["rows"][1:]:  # the first row is the exported pair, the baseline
        ar = r["methods"].get("autoregressive", {}).get("vs_exported_ar")
        best = r["methods"].get(r["best"], {}).get("vs_exported_ar")
        parts.append(f"`{r['variant']}`: AR {ratio_text(ar)}, `{r['best']}` **{ratio_text(best)}** the exported AR, perplexity "
                     f"{r['perplexity_delta']:+.1%}, top-1 agreement {r.get('top1_agreement') or 0:.1%}")
    return "; ".join(parts)

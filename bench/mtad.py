"""`specrt bench mtad`: speed and quality of MTAD/MJSD against autoregressive and sd, with ablations.

Same HumanEval prompts, greedy (MJSD) unless --temperature is given, batch 1. For each configuration:
tokens/s (median of `runs` after a warm-up run), tokens per target call, and the perplexity of the
emitted tokens under the target. Ablations (MTAD Tables 10 and 11): tau at fixed beams, beams at fixed
tau. Writes JSON, Markdown and a plot (accepted tokens per call and perplexity against tau).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import config_dict, pyplot, save_figure, timed_runs, write_report


@dataclass(frozen=True)
class MtadConfig:
    bundle: Path
    out: Path
    label: str = "demo"
    num_prompts: int = 10
    max_new_tokens: int = 128
    runs: int = 3
    threads: int = 2
    gamma: int = 4
    num_beams: int = 4
    tau: float = 0.5
    taus: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    beams: tuple[int, ...] = (2, 4, 8)
    temperature: float = 0.0
    seed: int = 0


def configurations(cfg: MtadConfig) -> list[tuple[str, dict]]:
    confs = [("autoregressive", {}), (f"sd γ={cfg.gamma}", {"method": "sd", "num_draft_tokens": cfg.gamma})]
    for tau in cfg.taus:
        confs.append((f"mtad W={cfg.num_beams} τ={tau}", {"method": "mtad", "num_draft_tokens": cfg.gamma,
                                                         "num_beams": cfg.num_beams, "tau": tau}))
    for w in cfg.beams:
        if w != cfg.num_beams:
            confs.append((f"mtad W={w} τ={cfg.tau}", {"method": "mtad", "num_draft_tokens": cfg.gamma, "num_beams": w,
                                                     "tau": cfg.tau}))
    return [(name, {"method": "autoregressive", **kw}) if not kw else (name, kw) for name, kw in confs]


def run_mtad(cfg: MtadConfig) -> dict:
    from specrt.bench.quality import perplexity
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(cfg.bundle, threads=cfg.threads)
    prompts = humaneval_prompts(cfg.num_prompts)
    prompt_ids = [pipe.encode(p) for p in prompts]
    confs = configurations(cfg)
    seconds, results = timed_runs(
        {name: (lambda kw=kw: pipe.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                            seed=cfg.seed, **kw)) for name, kw in confs},
        cfg.runs, 1, f"bench mtad {cfg.label}")
    ar_speed = None
    rows = []
    for name, kw in confs:
        outs = results[name]
        tokens = sum(len(o.token_ids) for o in outs)
        speed = tokens / statistics.median(seconds[name])
        ar_speed = ar_speed or speed
        rows.append({"name": name, **{k: kw.get(k) for k in ("method", "num_beams", "tau")},
                     "tokens_per_s": round(speed, 2), "speedup_vs_ar": round(speed / ar_speed, 3),
                     "tokens_per_target_call": round(tokens / sum(o.stats["rounds"] for o in outs), 3),
                     "perplexity": round(perplexity(pipe, prompt_ids, [o.token_ids for o in outs]), 4),
                     "runs_s": [round(s, 3) for s in seconds[name]]})
    data = {"label": cfg.label, "date": time.strftime("%Y-%m-%d"), "config": config_dict(cfg), "rows": rows}
    write_report(cfg.out / f"mtad-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    mode = "greedy (MJSD)" if c["temperature"] == 0 else f"temperature {c['temperature']} (MTAD)"
    lines = [f"### MTAD `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, {mode}, "
             f"γ={c['gamma']}, batch 1, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| config | tokens/s | vs AR | tokens/target call | perplexity (target) |", "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{r['tokens_per_target_call']:.2f} | {r['perplexity']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    c = data["config"]
    rows = [r for r in data["rows"] if r["method"] == "mtad" and r["num_beams"] == c["num_beams"]]
    rows.sort(key=lambda r: r["tau"])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    taus = [r["tau"] for r in rows]
    ax.plot(taus, [r["tokens_per_target_call"] for r in rows], "o-", color="tab:blue", label="mtad tokens/target call")
    sd = next(r for r in data["rows"] if r["method"] == "sd")
    ax.axhline(sd["tokens_per_target_call"], color="tab:blue", ls=":", label="sd tokens/target call")
    ax.set_xlabel("tau")
    ax.set_ylabel("tokens per target call")
    ax2 = ax.twinx()
    ax2.plot(taus, [r["perplexity"] for r in rows], "s--", color="tab:red", label="mtad perplexity")
    ax2.axhline(sd["perplexity"], color="tab:red", ls=":", label="sd perplexity")
    ax2.set_ylabel("perplexity under the target")
    ax.set_title(f"MTAD {data['label']}: W={c['num_beams']}, γ={c['gamma']}")
    fig.legend(fontsize=7, loc="upper right")
    save_figure(fig, path)


def add_mtad_args(p: argparse.ArgumentParser) -> None:
    from specrt.cli import add_bench_args

    add_bench_args(p, num_prompts=10)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)


def main_from_args(args) -> dict:
    return run_mtad(MtadConfig(bundle=args.bundle, out=args.out, label=args.label, num_prompts=args.num_prompts,
                               max_new_tokens=args.max_new_tokens, runs=args.runs, threads=args.threads,
                               gamma=args.gamma, temperature=args.temperature))

"""`specrt bench mtad`: speed and quality of MTAD/MJSD against autoregressive and sd, with ablations.

Same HumanEval prompts, greedy (MJSD) unless --temperature is given, batch 1. For each configuration:
tokens/s (median of `runs` after a warm-up run), tokens per target call, and the perplexity of the
emitted tokens under the target. Ablations (MTAD Tables 10 and 11): tau for each (beams W, verified
beams k) sweep (k > 1: the top k beams verified as one tree), beams at fixed tau. A reference row,
untimed: exact multi-token joint greedy decoding (MJGD, the MJSD paper's section 3.1), i.e. the
target's own beam search of gamma tokens per step; MJSD approximates it, so its perplexity is the
quality to aim at. Writes JSON, Markdown and a plot (tokens per call and perplexity against tau).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import BenchConfig, header, speedup, timed_runs, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.plotting import pyplot, save_figure


@dataclass(frozen=True)
class MtadConfig(BenchConfig):
    gamma: int = option(4, "tokens per beam", ge=1)
    tau: float = option(0.5, "threshold of the beam-count rows", ge=0, le=1)
    taus: tuple[float, ...] = option((0.1, 0.3, 0.5, 0.7, 0.9), "thresholds of the sweeps", ge=0, le=1)
    beams: tuple[int, ...] = option((2, 8), "W run at tau with the best beam only ('' for none)", ge=1)
    sweeps: tuple[tuple[int, ...], ...] = option(((4, 1), (4, 4), (8, 8)), "W:k pairs run at every tau (k > 1: the top "
                                                                          "k of W beams verified as one tree)")
    reference_beams: int = option(8, "W of the exact MJGD reference row (0: none)", ge=0)
    temperature: float = option(0.0, "0: greedy (MJSD); > 0: beam sampling (MTAD)", ge=0)
    seed: int = option(0, "sampling seed", ge=0)


def configurations(cfg: MtadConfig) -> list[tuple[str, dict]]:
    confs = [("autoregressive", {}), (f"sd γ={cfg.gamma}", {"method": "sd", "num_draft_tokens": cfg.gamma})]
    for w, k in cfg.sweeps:
        tag = f" k={k} (tree)" if k > 1 else ""
        for tau in cfg.taus:
            confs.append((f"mtad W={w}{tag} τ={tau}", {"method": "mtad", "num_draft_tokens": cfg.gamma,
                                                      "num_beams": w, "tau": tau, "verify_beams": k}))
    for w in cfg.beams:
        if (w, 1) not in cfg.sweeps:
            confs.append((f"mtad W={w} τ={cfg.tau}", {"method": "mtad", "num_draft_tokens": cfg.gamma, "num_beams": w,
                                                     "tau": cfg.tau}))
    return [(name, {"method": "autoregressive", **kw}) if not kw else (name, kw) for name, kw in confs]


def run_mtad(cfg: MtadConfig) -> dict:
    from specrt.bench.quality import perplexity
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, threads=cfg.threads, verify=cfg.verify_mode)
    prompts = humaneval_prompts(cfg.num_prompts)
    prompt_ids = [pipe.encode(p) for p in prompts]
    confs = configurations(cfg)
    seconds, results = timed_runs(
        {name: (lambda kw=kw: pipe.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                            seed=cfg.seed, **kw)) for name, kw in confs},
        cfg.runs, 1, f"bench mtad {cfg.label}")
    tokens_of = {name: sum(len(o.token_ids) for o in results[name]) for name, _ in confs}
    rows = []
    for name, kw in confs:
        outs = results[name]
        tokens = tokens_of[name]
        speed = tokens / statistics.median(seconds[name])
        rows.append({"name": name, **{k: kw.get(k) for k in ("method", "num_beams", "tau")},
                     "verify_beams": kw.get("verify_beams", 1),
                     "tokens_per_s": round(speed, 2),
                     "speedup_vs_ar": round(speedup(seconds, tokens_of, name, confs[0][0]), 3),
                     "tokens_per_target_call": round(tokens / sum(o.stats.rounds for o in outs), 3),
                     "perplexity": round(perplexity(pipe, prompt_ids, [o.token_ids for o in outs]), 4),
                     "runs_s": [round(s, 3) for s in seconds[name]]})
    if cfg.reference_beams:
        rows.append(mjgd_reference(pipe, prompts, prompt_ids, cfg))
    data = {**header("mtad", cfg), "rows": rows, "ratios": "paired"}  # (bench.report.paired_ratio)
    write_report(cfg.out / f"mtad-{cfg.label}", data, markdown, plot)
    return data


def mjgd_reference(pipe, prompts, prompt_ids, cfg: MtadConfig) -> dict:
    """Exact MJGD: MJSD with the target as its own draft. Then q == p, every beam passes any tau < 1,
    and each round emits the target's best-of-W beam of gamma tokens plus its argmax after it."""
    import copy

    from specrt.bench.quality import perplexity

    exact = copy.copy(pipe)
    exact.draft = pipe.target
    outs = exact.generate(prompts, method="mtad", max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          seed=cfg.seed, num_draft_tokens=cfg.gamma, num_beams=cfg.reference_beams, tau=0.5)
    return {"name": f"MJGD reference: target beams W={cfg.reference_beams} (untimed)", "method": "mjgd",
            "num_beams": cfg.reference_beams, "tau": None, "verify_beams": 1, "tokens_per_s": None,
            "speedup_vs_ar": None, "tokens_per_target_call": None,
            "perplexity": round(perplexity(pipe, prompt_ids, [o.token_ids for o in outs]), 4), "runs_s": []}


def markdown(data: dict) -> str:
    c = data["config"]
    mode = "greedy (MJSD)" if c["temperature"] == 0 else f"temperature {c['temperature']} (MTAD)"
    lines = [f"### MTAD `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, {mode}, "
             f"γ={c['gamma']}, batch 1, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| config | tokens/s | vs AR | tokens/target call | perplexity (target) |", "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        if r["tokens_per_s"] is None:
            lines.append(f"| {r['name']} | - | - | - | {r['perplexity']:.3f} |")
            continue
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{r['tokens_per_target_call']:.2f} | {r['perplexity']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    c = data["config"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax2 = ax.twinx()
    sd = next(r for r in data["rows"] if r["method"] == "sd")
    for (w, k), marker in zip(c["sweeps"], "os^vD"):
        rows = sorted((r for r in data["rows"] if r["method"] == "mtad" and r["num_beams"] == w
                       and r.get("verify_beams", 1) == k), key=lambda r: r["tau"])
        taus = [r["tau"] for r in rows]
        what = f"W={w}, best beam" if k == 1 else f"W={w}, top {k} as a tree"
        ax.plot(taus, [r["tokens_per_target_call"] for r in rows], marker + "-", color="tab:blue", label=f"tokens/call, {what}")
        ax2.plot(taus, [r["perplexity"] for r in rows], marker + "--", color="tab:red", label=f"perplexity, {what}")
    ref = next((r for r in data["rows"] if r["method"] == "mjgd"), None)
    if ref:
        ax2.axhline(ref["perplexity"], color="tab:green", ls="-.", label=f"perplexity, exact MJGD W={ref['num_beams']}")
    ax.axhline(sd["tokens_per_target_call"], color="tab:blue", ls=":", label="sd tokens/target call")
    ax.set_xlabel("tau")
    ax.set_ylabel("tokens per target call")
    ax2.axhline(sd["perplexity"], color="tab:red", ls=":", label="sd perplexity")
    ax2.set_ylabel("perplexity under the target")
    ax.set_title(f"MTAD {data['label']}: γ={c['gamma']}")
    fig.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
    save_figure(fig, path)


def speed_rows(data: dict) -> list[dict]:
    """This bench's rows in the shape the reports read (bench.report.speed_rows' fields)."""
    rows = data["rows"]
    return [{"name": r["name"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup_vs_ar"],
             "tokens_per_call": r["tokens_per_target_call"], "lossless": False} for r in rows]


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    greedy = next((r for r in data["rows"] if r["method"] == "sd"), None)
    timed = [r for r in data["rows"] if r["tokens_per_s"] and r["method"] not in ("autoregressive", "sd")]
    if not timed:
        return "no timed MTAD row"
    best = min(timed, key=lambda r: r["perplexity"])
    text = f"lowest perplexity `{best['name']}` {best['perplexity']:.3f}"
    if greedy:
        text += (f" vs `sd` {greedy['perplexity']:.3f} (**{best['perplexity'] / greedy['perplexity'] - 1:+.1%}**), "
                 f"{best['tokens_per_s'] / greedy['tokens_per_s']:.2f}x `sd`'s tok/s")
    return text

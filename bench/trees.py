"""`specrt bench trees`: measured tokens/s at each tree size next to the tuner's prediction.

For a bundle that has been calibrated, profiled and tuned (`specrt calibrate/profile/tune`), decode the
same HumanEval prompts (greedy, batch 1 or `batch_size` sequences decoded together) with: no
speculation, rank-0 chains of 1..D tokens (and of a few longer widths, to compare with trees at equal
width), the calibrated best static tree of each size, dynamic trees (`method="dynamic"`, EAGLE-2 style:
shaped per round by the draft's own confidence; predicted from the accepted lengths calibration
measured) and merged trees (dynamic trees with n-gram drafts merged in, `ngram_tokens`; SpecInfer's
merge of several drafters' trees). Every configuration runs once untimed, then `runs` timed passes,
interleaved; we report medians of end-to-end and of decode tokens/s (prefill excluded: the tuner's
model predicts decoding, and one prompt's prefill is 5-15% of its time here), the tuner's predicted
tokens/s for the same configuration, the prediction error against decode tokens/s, tokens per target
call, and where the tuned choice lands among the measured ones.
Writes JSON, Markdown and a plot (like PPD Fig. 8b/c) under `out/`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import BenchConfig, best_lossless, header, lossless_headline, timed_runs, write_report
from specrt.bundle.artifacts import Acceptance, Plan
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.plotting import finish_figure, pyplot
from specrt.runtime.backends import BackendOptions

TREE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class TreesConfig(BenchConfig, BackendOptions):
    num_prompts: int = option(5, "first N HumanEval prompts", ge=1)
    tree_sizes: tuple[int, ...] = option(TREE_SIZES, "calibrated best static trees to measure (the tuned one always is)", ge=1)
    max_chain: int = option(8, "chains of 1..this many tokens are measured", ge=1)
    long_chains: tuple[int, ...] = option((12, 16), "chain lengths past the calibrated depth to measure, for "
                                                    "equal-width comparisons ('' for none)", ge=1)
    dynamic_sizes: tuple[int, ...] = option((4, 8, 12, 16), "dynamic tree sizes to measure ('' for none)", ge=1)
    merged_sizes: tuple[int, ...] = option((6, 8, 10), "dynamic tree sizes to measure with n-gram drafts merged in "
                                                      "('' for none)", ge=1)
    batch_size: int = option(1, "sequences per ragged batch; predictions and the tuned choice are the plan's for it",
                             ge=1)


def configurations(plan: Plan, acceptance: Acceptance, cfg: TreesConfig) -> list[dict]:
    curve = plan.curves[cfg.batch_size]
    predicted = {(r.kind, r.num_nodes): r.predicted_tokens_per_s for r in curve}
    trees = {t.num_nodes: t.paths for t in acceptance.trees}
    out = [{"name": "autoregressive", "kind": "autoregressive", "num_nodes": 0, "paths": None,
            "predicted": predicted[("autoregressive", 0)]}]
    for g in sorted({g for g in range(1, cfg.max_chain + 1) if ("chain", g) in predicted} | set(cfg.long_chains)):
        out.append({"name": f"chain {g}", "kind": "chain", "num_nodes": g, "paths": [[0] * d for d in range(1, g + 1)],
                    "predicted": predicted.get(("chain", g))})
    choice = plan.choices[cfg.batch_size].best
    sizes = sorted(set(cfg.tree_sizes) | ({choice.num_nodes} if choice.kind == "tree" else set()))
    for n in sizes:  # the tuned tree is always measured, whatever its size
        if n in trees and ("tree", n) in predicted:
            out.append({"name": f"tree {n}", "kind": "tree", "num_nodes": n, "paths": trees[n], "predicted": predicted[("tree", n)]})
    for kind, measure in (("dynamic", cfg.dynamic_sizes), ("merged", cfg.merged_sizes)):
        tuned = {choice.num_nodes} if choice.kind == kind else set()
        for n in sorted(set(measure) | tuned):
            out.append({"name": f"{kind} {n}", "kind": kind, "num_nodes": n, "paths": None,
                        "predicted": predicted.get((kind, n))})
    return out


def batch_prefill(outs, batch_size: int) -> float:
    """Prefill seconds of a generate call: each sequence of a batch records its whole batch's prefill, so
    count the first sequence of each batch only."""
    return sum(o.stats.seconds.prefill for o in outs[::batch_size])


def run_trees(cfg: TreesConfig) -> dict:
    from specrt.runtime.speculation import MERGE_NGRAM_TOKENS
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    plan, acceptance = pipe.evidence.plan(), pipe.evidence.acceptance()
    if cfg.batch_size not in plan.choices:
        raise SpecrtError(f"the plan was tuned for batch sizes {', '.join(map(str, plan.choices))}, not {cfg.batch_size}: "
                          f"re-run `specrt profile` and `specrt tune` with it")
    confs = configurations(plan, acceptance, cfg)
    prompts = humaneval_prompts(cfg.num_prompts)

    def run(c):
        kw = dict(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size)
        if c["kind"] in ("dynamic", "merged"):
            outs = pipe.generate(prompts, method="dynamic", num_draft_tokens=c["num_nodes"],
                                 ngram_tokens=MERGE_NGRAM_TOKENS if c["kind"] == "merged" else 0, **kw)
        elif c["paths"] is None:
            outs = pipe.generate(prompts, method="autoregressive", **kw)
        else:
            outs = pipe.generate(prompts, method="tree", tree=c["paths"], **kw)
        prefill = batch_prefill(outs, cfg.batch_size)
        rounds = sum(o.stats.rounds for o in outs)
        return sum(len(o.token_ids) for o in outs), rounds, [o.token_ids for o in outs], prefill, sum(o.stats.drafted for o in outs)

    seconds, last = timed_runs({c["name"]: (lambda c=c: run(c)) for c in confs}, cfg.runs, 1, f"bench trees {cfg.label}")
    for c in confs:
        c["tokens"], c["rounds"], c["ids"], prefill, c["drafted"] = last[c["name"]]
        # the last run's prefill, subtracted from each timed run (same prompts every run: prefill barely varies)
        c["decode_seconds"] = [t - prefill for t in seconds[c["name"]]]
    ref = confs[0]["ids"]
    rows = []
    for c in confs:
        measured = c["tokens"] / statistics.median(seconds[c["name"]])
        decode = c["tokens"] / statistics.median(c["decode_seconds"])
        rows.append({"name": c["name"], "kind": c["kind"], "num_nodes": c["num_nodes"],
                     "measured_tokens_per_s": round(measured, 2), "decode_tokens_per_s": round(decode, 2),
                     "predicted_tokens_per_s": None if c["predicted"] is None else round(c["predicted"], 2),
                     "prediction_error": None if c["predicted"] is None else round(c["predicted"] / decode - 1, 4),
                     "tokens_per_target_call": round(c["tokens"] / c["rounds"], 3),
                     "nodes_per_round": round(c["drafted"] / c["rounds"], 2),
                     "runs_s": [round(s, 3) for s in seconds[c["name"]]],
                     "same_tokens_as_autoregressive": c["ids"] == ref})
    choice = plan.choices[cfg.batch_size]
    tuned = "autoregressive" if choice.method == "autoregressive" else f"{choice.best.kind} {choice.best.num_nodes}"
    return report(cfg, rows, tuned)


def report(cfg: TreesConfig, rows: list[dict], tuned: str) -> dict:
    by_name = {r["name"]: r for r in rows}
    best = max(rows, key=lambda r: r["measured_tokens_per_s"])
    kinds = {k: [r for r in rows if r["kind"] == k] for k in ("chain", "tree", "dynamic", "merged")}

    def best_vs_best_chain(kind):
        if not kinds[kind] or not kinds["chain"]:
            return None
        return round(max(r["measured_tokens_per_s"] for r in kinds[kind]) / max(r["measured_tokens_per_s"] for r in kinds["chain"]), 4)

    def per_call_vs_chain(kind):
        # merged trees verify a varying number of nodes: compared with the chain of their rounded mean width
        def width(r):
            return round(r["nodes_per_round"]) if kind == "merged" else r["num_nodes"]

        return {str(r["num_nodes"]): round(r["tokens_per_target_call"] / by_name[f"chain {width(r)}"]["tokens_per_target_call"], 3)
                for r in kinds[kind] if f"chain {width(r)}" in by_name}

    summary = {
        "tuned_choice": tuned,
        "best_measured": best["name"],
        "tuned_vs_best_measured": round(by_name[tuned]["measured_tokens_per_s"] / best["measured_tokens_per_s"], 4) if tuned in by_name else None,
        "best_tree_vs_best_chain": best_vs_best_chain("tree"),
        "best_dynamic_vs_best_chain": best_vs_best_chain("dynamic"),
        "best_merged_vs_best_chain": best_vs_best_chain("merged"),
        "tokens_per_call_tree_vs_chain_same_width": per_call_vs_chain("tree"),
        "tokens_per_call_dynamic_vs_chain_same_width": per_call_vs_chain("dynamic"),
        "tokens_per_call_merged_vs_chain_same_width": per_call_vs_chain("merged"),
    }
    data = {**header("trees", cfg), "summary": summary, "rows": rows}
    write_report(cfg.out / f"trees-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c, s = data["config"], data["summary"]
    lines = [f"### trees `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, greedy, "
             f"batch {c.get('batch_size', 1)}, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| config | nodes | nodes verified/round | measured tok/s | decode tok/s | predicted (decode) | prediction error | "
             "tokens/target call | same tokens as AR |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        mark = " **(tuned)**" if r["name"] == s["tuned_choice"] else ""
        predicted = "-" if r["predicted_tokens_per_s"] is None else f"{r['predicted_tokens_per_s']:.1f}"
        error = "-" if r["prediction_error"] is None else f"{r['prediction_error']:+.1%}"
        per_round = "-" if r.get("nodes_per_round") is None else f"{r['nodes_per_round']:.1f}"
        lines.append(f"| {r['name']}{mark} | {r['num_nodes']} | {per_round} | {r['measured_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{predicted} | {error} | {r['tokens_per_target_call']:.2f} | {'yes' if r['same_tokens_as_autoregressive'] else 'NO'} |")
    lines += ["", f"- tuned choice: {s['tuned_choice']}; best measured: {s['best_measured']}; "
                  f"tuned / best measured = {s['tuned_vs_best_measured']}",
              f"- best static tree / best chain (measured tokens/s) = {s['best_tree_vs_best_chain']}; "
              f"best dynamic tree / best chain = {s.get('best_dynamic_vs_best_chain')}; "
              f"best merged tree (dynamic + n-gram drafts) / best chain = {s.get('best_merged_vs_best_chain')}",
              f"- tokens per target call, static tree / chain of the same width: {s['tokens_per_call_tree_vs_chain_same_width']}",
              f"- tokens per target call, dynamic tree / chain of the same width: {s.get('tokens_per_call_dynamic_vs_chain_same_width')}",
              f"- tokens per target call, merged tree (by its model nodes) / chain of its rounded mean verified width: "
              f"{s.get('tokens_per_call_merged_vs_chain_same_width')}"]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = (("tree", "tab:blue"), ("chain", "tab:orange"), ("dynamic", "tab:green"), ("merged", "tab:purple"))
    for kind, color in colors:
        rows = [r for r in data["rows"] if r["kind"] == kind]
        if not rows:
            continue
        # merged trees verify a varying number of nodes: placed at the measured mean per round
        ns = [r["nodes_per_round"] if kind == "merged" else r["num_nodes"] for r in rows]
        ax.plot(ns, [r["measured_tokens_per_s"] for r in rows], "o-", color=color, label=f"{kind}: measured")
        ax.plot(ns, [r["decode_tokens_per_s"] for r in rows], ".:", color=color, label=f"{kind}: measured, decode only")
        pred = [(x, r["predicted_tokens_per_s"]) for x, r in zip(ns, rows) if r["predicted_tokens_per_s"] is not None]
        if pred:
            ax.plot(*zip(*pred), "x--", color=color, label=f"{kind}: predicted (decode)")
    ar = next(r for r in data["rows"] if r["kind"] == "autoregressive")
    ax.axhline(ar["measured_tokens_per_s"], color="gray", lw=1, label="autoregressive: measured")
    tuned = next((r for r in data["rows"] if r["name"] == data["summary"]["tuned_choice"]), None)
    if tuned is not None:
        x = tuned["nodes_per_round"] if tuned["kind"] == "merged" else tuned["num_nodes"]
        ax.plot([max(x, 0.8)], [tuned["measured_tokens_per_s"]], "*", ms=16, color="tab:red", label="tuned choice")
    ax.set_xscale("log", base=2)
    finish_figure(fig, ax, path, "drafted tokens verified per step (tree size)", f"tokens/s (batch {data['config'].get('batch_size', 1)})",
                  f"trees {data['label']}: measured vs predicted")


def speed_rows(data: dict) -> list[dict]:
    """This bench's rows in the shape the reports read (bench.report.speed_rows' fields)."""
    rows = data["rows"]
    ar = next((r["measured_tokens_per_s"] for r in rows if r["kind"] == "autoregressive"), None)
    return [{"name": r["name"], "tokens_per_s": r["measured_tokens_per_s"],
             "speedup": round(r["measured_tokens_per_s"] / ar, 3) if ar else None,
             "tokens_per_call": r["tokens_per_target_call"], "predicted": r["predicted_tokens_per_s"],
             "decode_tokens_per_s": r["decode_tokens_per_s"], "prediction_error": r["prediction_error"],
             "lossless": bool(r["same_tokens_as_autoregressive"])} for r in rows]


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    rows = speed_rows(data)
    if best_lossless(rows)[1] is None:
        return lossless_headline(rows)
    s = data["summary"]
    errors = [r["prediction_error"] for r in rows if r["prediction_error"] is not None]
    return (f"batch {data['config'].get('batch_size', 1)}: tuned `{s['tuned_choice']}` / best measured = "
            f"**{s['tuned_vs_best_measured']}**; " + lossless_headline(rows) +
            (f"; predictions {min(errors):+.0%} to {max(errors):+.0%}" if errors else ""))

"""`specrt bench ngram`: ANPD ablation over the n-gram order N and draft length K (ANPD Fig. 3/4).

Same HumanEval prompts, greedy, batch 1; for each (N, K): tokens/s (median of `runs` after a warm-up
run), speedup over autoregressive measured in the same run, tokens per target call and the draft hit
ratio (accepted / drafted tokens). Beyond the paper, at order `tree_order`: the same K as n-gram trees
of up to b continuations per node (`tree_branches`), and chains and 2-way trees that draft no token
whose estimated path probability is below `min_prob` (so K is a cap, not a quota), and hardware-aware
chains and 2-way trees of up to `hw_length` nodes that verify, per round, the best-first prefix the
bundle's latency profile says pays (needs `specrt profile` on this machine; `hw_length` 0: no such
rows). Writes JSON, Markdown and a plot of speedup against K per N (trees dashed, pruned dotted,
hardware-aware stars).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import BenchConfig, header, lossless_headline, speedup, timed_runs, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.plotting import finish_figure, pyplot


@dataclass(frozen=True)
class NgramConfig(BenchConfig):
    orders: tuple[int, ...] = option((2, 3, 4, 5, 6), "n-gram orders N to try", ge=2)
    lengths: tuple[int, ...] = option((1, 3, 5, 7, 9), "draft lengths K to try", ge=1)
    tree_branches: tuple[int, ...] = option((2, 3), "continuations per node of the n-gram trees to try ('' for none)", ge=1)
    tree_order: int = option(5, "N of the tree, pruned and hardware-aware rows", ge=2)
    min_prob: float = option(0.2, "pruned rows: chains and 2-way trees drafting no token below this (0: no such rows)",
                             ge=0, le=1)
    hw_length: int = option(16, "hardware-aware rows: node cap of their chains and 2-way trees (0: no such rows)", ge=0)


def run_ngram(cfg: NgramConfig) -> dict:
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, threads=cfg.threads, verify=cfg.verify_mode)
    prompts = humaneval_prompts(cfg.num_prompts)
    # (method, N, K, branches, min prob, hardware-aware)
    confs = ([("autoregressive", None, None, 1, 0.0, False)]
             + [("anpd", n, k, 1, 0.0, False) for n in cfg.orders for k in cfg.lengths]
             + [("anpd", cfg.tree_order, k, b, 0.0, False) for b in cfg.tree_branches for k in cfg.lengths]
             + ([("anpd", cfg.tree_order, k, b, cfg.min_prob, False) for b in (1, 2) for k in cfg.lengths] if cfg.min_prob else [])
             + ([("anpd", cfg.tree_order, cfg.hw_length, b, 0.0, True) for b in (1, 2)] if cfg.hw_length else []))

    def run(method, n, k, b, min_prob, hw):
        kw = {} if method == "autoregressive" else dict(num_draft_tokens=k, ngram_n=n, ngram_branches=b,
                                                        ngram_min_prob=min_prob, ngram_hardware_aware=hw)
        outs = pipe.generate(prompts, method=method, max_new_tokens=cfg.max_new_tokens, **kw)
        drafted = sum(o.stats.drafted for o in outs)
        accepted = sum(o.stats.accepted for o in outs)
        return (sum(len(o.token_ids) for o in outs), sum(o.stats.rounds for o in outs),
                accepted / drafted if drafted else 0.0, [o.token_ids for o in outs])

    seconds, stats = timed_runs({c: (lambda c=c: run(*c)) for c in confs}, cfg.runs, 1, f"bench ngram {cfg.label}")
    tokens_of = {c: stats[c][0] for c in confs}
    rows = []
    for c in confs:
        tokens, rounds, hit, ids = stats[c]
        speed = tokens / statistics.median(seconds[c])
        rows.append({"method": c[0], "n": c[1], "k": c[2], "branches": c[3], "min_prob": c[4], "hardware_aware": c[5],
                     "tokens_per_s": round(speed, 2),
                     "speedup_vs_ar": round(speedup(seconds, tokens_of, c, confs[0]), 3),
                     "tokens_per_target_call": round(tokens / rounds, 3),
                     "draft_hit_ratio": round(hit, 4), "same_tokens_as_ar": ids == stats[confs[0]][3],
                     "runs_s": [round(s, 3) for s in seconds[c]]})
    data = {**header("ngram", cfg), "rows": rows, "ratios": "paired"}  # (bench.report.paired_ratio)
    write_report(cfg.out / f"ngram-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### ANPD ablation `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, "
             f"greedy, batch 1, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| method | N | K | branches | min prob (hw: hardware-aware) | tokens/s | vs AR | tokens/target call | draft hit ratio | same tokens as AR |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        b = r.get("branches", 1)
        what = "-" if r["method"] == "autoregressive" else (f"{b} (tree)" if b > 1 else "1 (chain)")
        mp = "-" if r["method"] == "autoregressive" else ("hw" if r.get("hardware_aware") else f"{r.get('min_prob', 0.0):g}")
        lines.append(f"| {r['method']} | {r['n'] or '-'} | {r['k'] or '-'} | {what} | {mp} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{r['tokens_per_target_call']:.2f} | {r['draft_hit_ratio']:.1%} | {'yes' if r['same_tokens_as_ar'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for n in data["config"]["orders"]:
        rows = [r for r in data["rows"] if r["n"] == n and r.get("branches", 1) == 1 and not r.get("min_prob")
                and not r.get("hardware_aware")]
        ax.plot([r["k"] for r in rows], [r["speedup_vs_ar"] for r in rows], "o-", label=f"N = {n}")
    for b in data["config"].get("tree_branches", ()):
        rows = [r for r in data["rows"] if r.get("branches", 1) == b and not r.get("min_prob") and not r.get("hardware_aware")]
        ax.plot([r["k"] for r in rows], [r["speedup_vs_ar"] for r in rows], "s--",
                label=f"N = {data['config']['tree_order']}, tree of {b} continuations per node")
    for b in (1, 2):
        rows = [r for r in data["rows"] if r.get("branches", 1) == b and r.get("min_prob")]
        if rows:
            what = "chain" if b == 1 else f"tree of {b} per node"
            ax.plot([r["k"] for r in rows], [r["speedup_vs_ar"] for r in rows], "^:",
                    label=f"N = {data['config']['tree_order']}, {what}, min prob {rows[0]['min_prob']:g}")
    for r in (r for r in data["rows"] if r.get("hardware_aware")):
        what = "chain" if r["branches"] == 1 else f"tree of {r['branches']} per node"
        ax.plot([r["k"]], [r["speedup_vs_ar"]], "*", ms=12, label=f"N = {r['n']}, {what}, hardware-aware (K: cap)")
    ax.axhline(1.0, color="gray", lw=1)
    finish_figure(fig, ax, path, "draft tokens per step (K: chain length or tree nodes)", "speedup over autoregressive",
                  f"ANPD {data['label']}: speedup by N and K")


def speed_rows(data: dict) -> list[dict]:
    """This bench's rows in the shape the reports read (bench.report.speed_rows' fields)."""
    rows = data["rows"]
    return [{"name": " ".join(str(r[k]) for k in ("method", "n", "k") if r.get(k) is not None),
             "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup_vs_ar"],
             "tokens_per_call": r["tokens_per_target_call"], "lossless": r.get("same_tokens_as_ar") in (True, 1)}
            for r in rows]


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    return lossless_headline(speed_rows(data))

"""`specrt bench ppd` (after `specrt ppd train`): PPD against our other methods and its own ablations.

Same HumanEval prompts, greedy, batch 1, every row in one process (interleaved timed runs, medians):
autoregressive, the comparison methods (sd, dynamic, anpd by default), PPD at the size the latency
profile picks (where this machine is profiled) and at each `--budgets` size, and at the picked size the
paper's ablations at that size (at least 2ek + 1 rows, so that the naive tree has a candidate): the sparse
tree, the naive tree (every node carries all k prompt tokens, no pruning) and a random tree (the sparse
tree's candidates and number of prompt tokens, placed at random). With `--temperature` > 0, also AR and the picked
PPD tree sampled at that temperature, PPD verified both ways: lossless one-hot rejection and typical acceptance (not
lossless; its speedup is against the sampled AR). Per row: tokens/s, speedup over AR,
tokens per target call, and for PPD rows the share of rounds accepting at least d candidates (d = 1..k:
accepted length by distance). From ppd.json: guess accuracy by distance for the trained prompt tokens, the
untrained ones and the no-prompt-token baseline (the last position's own logits), the accepted length per
round each predicts for the picked tree (the trained tokens' paths as measured together, and every table as if
its distances were independent) beside the measured one, added parameters, bytes and training time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.report import (BenchConfig, best_lossless, header, lossless_headline, ratio_text, speedup, timed_runs,
                                 write_report)
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import BundleError, SpecrtError
from specrt.plotting import finish_figure, pyplot
from specrt.runtime.backends import BackendOptions


@dataclass(frozen=True)
class PpdBenchConfig(BenchConfig, BackendOptions):
    methods: tuple[str, ...] = option(("sd", "dynamic", "anpd"), "methods to compare with (defaults of each)")
    budgets: tuple[int, ...] = option((4, 8, 16, 32), "PPD tree sizes measured besides the picked one ('' for none)", ge=1)
    ablations: bool = option(True, "also the naive and random trees at the picked size")
    temperature: float = option(0.7, "also AR and the picked PPD tree sampled at this temperature, PPD verified by "
                                     "lossless rejection and by typical acceptance (0: none)", ge=0)


def _row_stats(outs) -> tuple[int, int, np.ndarray, list]:
    """(new tokens, target decode steps, accepted-length histogram summed, token ids) of one generate call."""
    hist = np.zeros(65)
    for o in outs:
        for length, rounds in o.stats.accepted_hist.items():
            hist[min(length, 64)] += rounds
    return sum(len(o.token_ids) for o in outs), sum(o.stats.rounds for o in outs), hist, [o.token_ids for o in outs]


def run_ppd(cfg: PpdBenchConfig) -> dict:
    from specrt.engines.ppd_trees import PathModel, naive_tree, random_tree, score, sparse_tree
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    tokens = pipe.prompt_tokens
    if tokens is None:
        raise SpecrtError(pipe.prompt_tokens_refused)
    prompts = humaneval_prompts(cfg.num_prompts)
    picked = pipe.evidence.ppd_tree(pipe.prompt_tokens, 1)
    model = PathModel.of(tokens)
    configs = {"autoregressive": ("autoregressive", {})}
    configs.update({m: (m, {}) for m in cfg.methods})
    configs[f"ppd (picked: {picked.budget} rows)"] = ("ppd", {"ppd_budget": picked.budget})
    configs.update({f"ppd {b} rows": ("ppd", {"ppd_budget": b}) for b in cfg.budgets
                    if b != picked.budget and any(t.budget == b for t in tokens.trees)})
    trees, e = {}, tokens.num_ensemble
    ablation = max(picked.budget, 2 * e * tokens.num_prompt_tokens + 1)  # the naive tree needs a candidate at least
    if cfg.ablations:
        sparse = sparse_tree(model, ablation, e)
        trees = {"sparse": sparse, "naive": naive_tree(model, ablation, e), "random": random_tree(model, sparse, e, seed=0)}
        for what, t in trees.items():
            configs[f"ppd {what} tree ({ablation} rows)"] = (
                "ppd", {"ppd_tree": {"paths": [list(p) for p in t.paths], "prompts": list(t.prompts)}})

    sampled = f"T={cfg.temperature:g}"
    if cfg.temperature:
        sampling = {"temperature": cfg.temperature, "seed": 0}
        configs[f"autoregressive, {sampled}"] = ("autoregressive", sampling)
        for acceptance in ("exact", "typical"):
            configs[f"ppd {acceptance}, {sampled} (picked)"] = (
                "ppd", {**sampling, "ppd_budget": picked.budget, "ppd_acceptance": acceptance})

    def run(method, options):
        return _row_stats(pipe.generate(prompts, method=method, max_new_tokens=cfg.max_new_tokens, **options))

    seconds, stats = timed_runs({n: (lambda c=c: run(*c)) for n, c in configs.items()}, cfg.runs, 1, f"bench ppd {cfg.label}")
    def speed(name):
        return stats[name][0] / statistics.median(seconds[name])

    base_ids = stats["autoregressive"][3]
    k = tokens.num_prompt_tokens
    rows = []
    for name, (method, options) in configs.items():
        n, rounds, hist, ids = stats[name]
        hot = bool(options.get("temperature"))  # sampled rows: against the sampled AR; token identity does not apply
        at_least = [round(float(hist[d:].sum() / max(1, hist.sum())), 4) for d in range(1, k + 1)]
        rows.append({"name": name, "method": method, "tokens_per_s": round(speed(name), 2),
                     "speedup_vs_ar": round(speedup(seconds, {k: v[0] for k, v in stats.items()}, name,
                                                    f"autoregressive, {sampled}" if hot else "autoregressive"), 3),
                     "temperature": options.get("temperature", 0.0), "acceptance": options.get("ppd_acceptance"),
                     "tokens_per_target_call": round(n / rounds, 3),
                     "accepted_at_least": at_least if method == "ppd" else None,
                     "same_tokens_as_ar": None if hot else ids == base_ids, "runs_s": [round(s, 3) for s in seconds[name]]})
    # the trained tokens' paths as measured together; the other tables as products (all they have)
    predicted = {what: round(score(m, list(picked.paths), list(picked.prompts), e)[0], 4)
                 for what, m in (("trained", model), ("trained, if independent", PathModel(tokens.accuracy)),
                                 ("untrained, if independent", PathModel(tokens.initial_accuracy)),
                                 ("no prompt tokens, if independent", PathModel(tokens.baseline_accuracy)))}
    predicted.update({f"{what} tree of {ablation} rows": t.expected_accepted for what, t in trees.items()})
    try:  # what `specrt calibrate` measured by decoding this tree on its own prompts, where it did
        calibrated = pipe.evidence.acceptance().ppd_measured(tokens).get(picked.budget)
    except BundleError:
        calibrated = None
    picked_row = next(r for r in rows if r["name"] == f"ppd (picked: {picked.budget} rows)")
    entry = pipe.target.entry
    added = k * e * tokens.hidden_size
    summary = {
        "picked_budget": picked.budget, "picked_rows": picked.rows, "picked_prompts": list(picked.prompts),
        "accuracy": {"trained": tokens.accuracy, "untrained": tokens.initial_accuracy,
                     "no prompt tokens": tokens.baseline_accuracy},
        "predicted_accepted_per_round": predicted,
        "calibrated_accepted_per_round": calibrated and calibrated.expected_accepted,
        "calibrated_interval": calibrated and calibrated.accepted_interval,
        "measured_accepted_per_round": round(picked_row["tokens_per_target_call"] - 1, 4),
        "added_parameters": added, "added_fraction": round(added / entry.num_params, 8), "added_bytes": added * 4,
        "training_seconds": tokens.training.get("seconds") or tokens.training.get("source", {}).get("seconds"),
        "trained_from": tokens.training.get("from"),
    }
    data = {**header("ppd", cfg), "summary": summary, "rows": rows, "ratios": "paired"}  # (bench.report.paired_ratio)
    write_report(cfg.out / f"ppd-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c, s = data["config"], data["summary"]
    k = len(s["accuracy"]["trained"])
    hot = "; rows marked T= sample at that temperature (vs the sampled AR; typical acceptance is not lossless)" \
        if c.get("temperature") else ""
    lines = [f"### PPD `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['max_new_tokens']} new tokens, greedy{hot}, "
             f"batch 1, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| row | tokens/s | vs AR | tokens/target call | " + " | ".join(f"rounds accepting >= {d}" for d in range(1, k + 1))
             + " | same tokens as AR |", "|---|---:|---:|---:|" + "---:|" * k + "---:|"]
    for r in data["rows"]:
        shares = r["accepted_at_least"] or [None] * k
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | {r['tokens_per_target_call']:.2f} | "
                     + " | ".join("-" if v is None else f"{v:.1%}" for v in shares)
                     + f" | {({True: 'yes', False: 'NO', None: '-'})[r['same_tokens_as_ar']]} |")
    lines += ["", "| guess of distance | trained top-1 | untrained top-1 | no prompt tokens top-1 | trained top-"
                  f"{len(s['accuracy']['trained'][0])} |", "|---:|---:|---:|---:|---:|"]
    for d in range(k):
        a, u, b = (s["accuracy"][w][d] for w in ("trained", "untrained", "no prompt tokens"))
        lines.append(f"| {d + 2} | {a[0]:.1%} | {u[0]:.1%} | {b[0]:.1%} | {sum(a):.1%} |")
    p = s["predicted_accepted_per_round"]
    lines += ["", f"- picked tree: {s['picked_budget']} rows budget, {s['picked_rows']} rows, prompt tokens of root and "
                  f"candidates {s['picked_prompts']}",
              "- candidates accepted per round that each accuracy table predicts for the picked tree: " +
              ", ".join(f"{w} {v:.3f}" for w, v in p.items())
              + (f"; `specrt calibrate` decoded {s['calibrated_accepted_per_round']:.3f}"
                 + (" [{:.3f}-{:.3f}]".format(*s["calibrated_interval"]) if s.get("calibrated_interval") else "")
                 if s.get("calibrated_accepted_per_round") is not None else "")
              + (f"; measured {s['measured_accepted_per_round']:.3f}" if "measured_accepted_per_round" in s else ""),
              f"- added parameters: {s['added_parameters']} ({s['added_fraction']:.6%} of the target's), "
              f"{s['added_bytes']} bytes; training {s['training_seconds']} s"
              + (f" (prompt tokens trained on `{s['trained_from']}`)" if s.get("trained_from") else "")]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.8))
    rows = data["rows"]
    colors = ["tab:purple" if r["method"] == "ppd" else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), [r["speedup_vs_ar"] for r in rows], color=colors, label="speedup over autoregressive")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=35, ha="right", fontsize=7)
    ax.axhline(1.0, color="gray", lw=1)
    finish_figure(fig, ax, path, "", "speedup over autoregressive", f"PPD {data['label']}: against our methods")


def speed_rows(data: dict) -> list[dict]:
    """This bench's rows in the shape the reports read (bench.report.speed_rows' fields)."""
    rows = data["rows"]
    return [{"name": r["name"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup_vs_ar"],
             "tokens_per_call": r["tokens_per_target_call"], "lossless": r["same_tokens_as_ar"]} for r in rows]


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    rows = speed_rows(data)
    if best_lossless(rows)[1] is None:
        return lossless_headline(rows)
    picked = next(r for r in rows if r["name"].startswith("ppd (picked"))
    return (f"PPD (picked size) **{ratio_text(picked['speedup'])}** our AR, {picked['tokens_per_call']:.2f} tokens per "
            f"target call, no draft model; " + lossless_headline(rows))

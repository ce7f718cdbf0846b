"""`specrt bench batch`: throughput and per-request latency by batch size; continuous against static batching,
unpadded against padded batches, measured against the batch cost model.

HumanEval prompts (their lengths vary) with per-request limits of new tokens drawn between
`--min-new-tokens` and `--max-new-tokens` (seeded), greedy, every configuration in one process
(interleaved timed runs, medians): for each method and batch size, continuous batching (a finished
sequence's place goes to the next prompt between rounds) and static batching (batches that wait for
their slowest sequence); for the `--padded` methods also the vanilla padded batches EMS-SD measures
itself against (every target KV cache padded with masked slots to the batch's longest, and every target step's
holes computed as real rows where unpadded batches leave them out on a backend that packs rows; same tokens). Per
row: tokens/s, speedup over autoregressive at the same batch size and batching, continuous over static,
unpadded over padded and the padding ratio (padding slots per new token), p50 / p95 request latency (from
the call's start to a request's last token: waiting included, as a server's client sees it), whether every
request's tokens are the single-sequence autoregressive ones, and the cost model's prediction where the
bundle has the artifacts for one (acceptance.json, a latency.json of this machine; `auto` and `tree` also
plan.json): each request's output walked through the tokens per round calibrated where each round starts
(acceptance grows along an output: short requests accept less) and the profiled round cost at each live batch
size, the batch draining as its sequences finish (runtime.cost.workload_ms), prefill included. Each row
also records the drafted tokens it accepted per round by where in the output rounds started, beside the
calibrated figures the prediction used (the plot's second panel, at each method's smallest batch size).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bench.prompts import humaneval_prompts
from specrt.bench.quality import describe_divergence, divergence, same_tokens
from specrt.bench.report import BenchConfig, header, speedup, timed_runs, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.plotting import finish_figure, pyplot
from specrt.runtime.backends import BackendOptions
from specrt.runtime.stats import POSITION_BUCKET

BATCHINGS = ("continuous", "static")


@dataclass(frozen=True)
class BatchBenchConfig(BenchConfig, BackendOptions):
    num_prompts: int = option(32, "first N HumanEval prompts", ge=1)
    max_new_tokens: int = option(96, "per-request limits of new tokens are drawn from [min, max]", ge=1)
    min_new_tokens: int = option(16, "per-request limits of new tokens are drawn from [min, max]", ge=1)
    batch_sizes: tuple[int, ...] = option((1, 2, 4, 8, 16), "batch sizes", ge=1, nonempty=True)
    methods: tuple[str, ...] = option(("autoregressive", "sd", "tree", "dynamic", "anpd", "auto"),
                                      "methods (each with its defaults; auto: needs the bundle's plan.json)")
    padded: tuple[str, ...] = option(("sd",), "methods also run as padded batches (EMS-SD's vanilla baseline)")
    batchings: tuple[str, ...] = option(BATCHINGS, "continuous and/or static batching")
    seed: int = option(0, "seed of the per-request limits", ge=0)


def limits(cfg: BatchBenchConfig) -> list[int]:
    if cfg.min_new_tokens > cfg.max_new_tokens:
        raise SpecrtError(f"--min-new-tokens {cfg.min_new_tokens} exceeds --max-new-tokens {cfg.max_new_tokens}")
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(cfg.min_new_tokens, cfg.max_new_tokens + 1, cfg.num_prompts).tolist()


def _check(cfg: BatchBenchConfig, pipe) -> None:
    from specrt.runtime.methods import make_method

    for m in cfg.methods:
        make_method(m, {})  # an unknown method is refused before anything runs
    alien = [m for m in cfg.padded if m not in cfg.methods]
    if alien:
        raise SpecrtError(f"--padded {','.join(alien)}: not among --methods {','.join(cfg.methods)}")
    bad = [b for b in cfg.batchings if b not in BATCHINGS]
    if bad or not cfg.batchings:
        raise SpecrtError(f"--batchings takes {' and/or '.join(BATCHINGS)}, got {','.join(cfg.batchings) or 'none'}")
    if "auto" in cfg.methods and not pipe.evidence.has_plan():
        raise SpecrtError(f"method auto needs {pipe.bundle}/plan.json: run `specrt calibrate`, `specrt profile` and "
                          f"`specrt tune` on the bundle, or leave auto out of --methods")


def run_batch(cfg: BatchBenchConfig) -> dict:
    from specrt.calibration.acceptance import ratio_interval
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    _check(cfg, pipe)
    prompts, caps = humaneval_prompts(cfg.num_prompts), limits(cfg)
    reference = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=caps)]
    # (method, batch size, batching, padded); at batch 1 the batchings are the same and nothing is padded
    configs = [(m, b, how, pad) for m in cfg.methods for pad in ((False, True) if m in cfg.padded else (False,))
               for b in cfg.batch_sizes for how in cfg.batchings
               if (b > 1 or (how == cfg.batchings[0] and not pad))]

    def run(method, batch, how, padded):
        outs = pipe.generate(prompts, method=method, max_new_tokens=caps, batch_size=batch, batching=how, padded=padded)
        rounds, accepted = Counter(), Counter()
        for o in outs:
            rounds.update(o.stats.rounds_by_position)
            accepted.update(o.stats.accepted_by_position)
        by_position = [round(accepted[b] / rounds[b], 3) if rounds[b] else None for b in range(max(rounds, default=-1) + 1)]
        return (sum(len(o.token_ids) for o in outs), [o.stats.seconds.finished for o in outs],
                [o.token_ids for o in outs], sum(o.stats.padded for o in outs),
                sum(o.stats.rounds for o in outs), by_position,
                ratio_interval([len(o.token_ids) for o in outs], [o.stats.rounds for o in outs]))

    seconds, last = timed_runs({c: (lambda c=c: run(*c)) for c in configs}, cfg.runs, 1, f"bench batch {cfg.label}")
    speed = {k: last[k][0] / statistics.median(seconds[k]) for k in configs}
    tokens_of = {k: last[k][0] for k in configs}
    prompt_ids = [pipe.encode(p) for p in prompts]
    requests = [(len(ids), len(t)) for ids, t in zip(prompt_ids, reference)]
    diverged = {k: divergence(pipe, prompt_ids, reference, last[k][2]) for k in configs}
    predict, why_not = predictor(pipe, requests)
    rows = []
    for (m, b, how, pad) in configs:
        key = (m, b, how, pad)
        ar = next((k for k in (("autoregressive", b, how, False), ("autoregressive", b, cfg.batchings[0], False))
                   if k in speed), None)
        static = (m, b, "static", pad) if (m, b, "static", pad) in speed else None
        unpadded = (m, b, how, False)
        latency = np.array(last[key][1])
        predicted, per_round, by_position = (None, None, ()) if pad else predict(m, b, how)
        rows.append({"method": m, "batch_size": b, "batching": how, "padded": pad,
                     "tokens_per_s": round(speed[key], 2),
                     "speedup_vs_ar": round(speedup(seconds, tokens_of, key, ar), 3) if ar else None,
                     "continuous_vs_static": round(speedup(seconds, tokens_of, key, static), 3)
                     if how == "continuous" and static and b > 1 else None,
                     "unpadded_vs_padded": round(speedup(seconds, tokens_of, unpadded, key), 3) if pad else None,
                     "padding_ratio": round(last[key][3] / last[key][0], 3),
                     "tokens_per_round": round(last[key][0] / max(1, last[key][4]), 3),
                     # its 5-95% interval over resamples of the requests: how much the text alone moves it
                     "tokens_per_round_interval": [round(v, 3) for v in last[key][6]],
                     "predicted_tokens_per_round": round(per_round, 3) if per_round else None,
                     "predicted_tokens_per_s": round(predicted, 2) if predicted else None,
                     # drafted tokens accepted per round by the bucket of POSITION_BUCKET output positions a round started at
                     "accepted_by_position": last[key][5],
                     "predicted_accepted_by_position": [round(a, 3) for a in by_position],
                     "prediction_error": round(speed[key] / predicted - 1, 3) if predicted else None,
                     "latency_p50_s": round(float(np.percentile(latency, 50)), 3),
                     "latency_p95_s": round(float(np.percentile(latency, 95)), 3),
                     "same_tokens_as_ar": last[key][2] == reference, "divergence": diverged[key],
                     "runs_s": [round(s, 3) for s in seconds[key]]})
    data = {**header("batch", cfg), "rows": rows, "max_new_tokens_per_request": caps, "predictions": why_not or "ok",
            "ratios": "paired",  # (bench.report.paired_ratio)
            "auto": auto_summary(rows, pipe if "auto" in cfg.methods else None)}
    write_report(cfg.out / f"batch-{cfg.label}", data, markdown, plot)
    return data


def auto_summary(rows: list[dict], pipe) -> list[dict]:
    """Per batch size and batching: what `auto` ran (the plan's choice), its tokens/s against AR's and against the
    best unpadded row measured."""
    if pipe is None:
        return []
    from specrt.calibration.tune import describe_auto

    out = []
    for r in (r for r in rows if r["method"] == "auto"):
        peers = [q for q in rows if (q["batch_size"], q["batching"]) == (r["batch_size"], r["batching"]) and not q["padded"]]
        best = max(peers, key=lambda q: q["tokens_per_s"])
        ar = next((q for q in peers if q["method"] == "autoregressive"), None)
        out.append({"batch_size": r["batch_size"], "batching": r["batching"],
                    "chosen": describe_auto(pipe.evidence.plan(), r["batch_size"]),
                    "tokens_per_s": r["tokens_per_s"], "vs_ar": r["speedup_vs_ar"] if ar else None,
                    "best": best["method"], "vs_best": round(r["tokens_per_s"] / best["tokens_per_s"], 3)})
    return out


def predictor(pipe, requests: list[tuple[int, int]]):
    """(predict(method, batch size, batching) -> (tokens/s, tokens per round, accepted per round by bucket of output
    positions) or (None, None, ()), why there are no predictions or None): the cost model over this workload (prompt
    tokens, new tokens per request) for the methods it has a calibration of."""
    from specrt.bundle.artifacts import CurvePoint
    from specrt.calibration.acceptance import position_acceptance
    from specrt.runtime.cost import chain_expectation, joining_prefill_ms, rounds_needed, tree_expectation, workload_ms
    from specrt.runtime.speculation import point_cost_ms, speculation_kind
    from specrt.errors import BundleError
    from specrt.runtime.methods import DEFAULT_TREE, Anpd, Dynamic, Sd

    try:
        acceptance, latency = pipe.evidence.acceptance(), pipe.evidence.latency()
    except BundleError as e:  # said with the bundle as given: no machine path in a committed result
        return (lambda *a: (None, None, ())), str(e).replace(str(Path(pipe.bundle).resolve()), str(pipe.bundle))
    p = np.array(acceptance.depth_rank)
    plan = pipe.evidence.plan() if pipe.evidence.has_plan() else None
    backends = {"target": pipe.target, "draft": pipe.draft}

    def point(method: str, batch: int) -> CurvePoint | None:
        if method == "autoregressive":
            return CurvePoint("autoregressive", 0, 0.0, 0.0, 0.0, 0.0)
        if method == "sd":
            g = Sd.num_draft_tokens
            return CurvePoint("chain", g, chain_expectation(p, g), 0.0, 0.0, 0.0, paths=tuple((0,) * d for d in range(1, g + 1)))
        if method == "tree":
            paths = plan.choice_for(batch).best_static.paths if plan else DEFAULT_TREE
            return CurvePoint("tree", len(paths), tree_expectation(p, paths), 0.0, 0.0, 0.0, paths=paths)
        if method == "dynamic":
            width, depth = Dynamic().shape
            m = next((m for m in speculation_kind("dynamic").measured_trees(acceptance)
                      if (m.num_nodes, m.width, m.depth, m.ngram_tokens) ==
                      (Dynamic.num_draft_tokens, width, depth, 0)), None)
            return m and CurvePoint("dynamic", m.num_nodes, m.expected_accepted, 0.0, 0.0, 0.0, width=width, depth=depth)
        if method == "anpd":
            m = next((m for m in speculation_kind("ngram").measured_trees(acceptance)
                      if m.num_nodes == Anpd.num_draft_tokens), None)
            return m and CurvePoint("ngram", m.num_nodes, m.expected_accepted, 0.0, 0.0, 0.0)
        if method == "auto" and plan is not None and speculation_kind(plan.choice_for(batch).best.kind).cost:
            return plan.choice_for(batch).best
        return None  # ppd (weighed apart), mtad: no prediction here

    def predict(method: str, batch: int, batching: str) -> tuple[float | None, float | None, tuple[float, ...]]:
        c = point(method, batch)
        if c is None:
            return None, None, ()
        roles = ("target", "draft") if speculation_kind(c.kind).draft_model else ("target",)
        by_position = position_acceptance(acceptance, c)
        rounds = lambda new: rounds_needed(new, c.expected_accepted, by_position, acceptance.position_bucket)  # noqa: E731

        def prefill(lens, running):
            return sum(joining_prefill_ms(latency, role, lens, running, backends[role]) for role in roles)

        try:
            ms = workload_ms(lambda live, context: sum(point_cost_ms(acceptance, latency.at_context(context), live, c)),
                             rounds, requests, batch, batching, prefill)
        except SpecrtError:
            return None, None, ()  # a batch size or step beyond the profile
        new_tokens = sum(new for _, new in requests)
        return new_tokens / (ms / 1e3), new_tokens / sum(rounds(new) for _, new in requests), by_position

    return predict, None


def _name(r: dict) -> str:
    return r["method"] + (" (padded)" if r.get("padded") else "")


def markdown(data: dict) -> str:
    c = data["config"]
    lines = [f"### batch `{data['label']}`: {c['num_prompts']} HumanEval prompts, {c['min_new_tokens']}-{c['max_new_tokens']} "
             f"new tokens per request, greedy, {c['threads']} threads, median of {c['runs']} runs ({data['date']})", "",
             "| method | batch | batching | tokens/s | vs AR | continuous / static | unpadded / padded | padding ratio | "
             "predicted tokens/s | tokens per round (predicted) | latency p50 (s) | p95 (s) | same tokens as AR |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        pred = ("-" if r.get("predicted_tokens_per_s") is None else
                f"{r['predicted_tokens_per_s']:.1f} ({r['prediction_error']:+.0%})")
        spread = r.get("tokens_per_round_interval")
        per_round = "-" if r.get("tokens_per_round") is None else f"{r['tokens_per_round']:.2f}" + (
            f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread and spread[0] != spread[1] else "") + (
            f" ({r['predicted_tokens_per_round']:.2f})" if r.get("predicted_tokens_per_round") else "")
        lines.append(f"| {_name(r)} | {r['batch_size']} | {r['batching']} | {r['tokens_per_s']:.1f} | "
                     f"{x(r['speedup_vs_ar'])} | {x(r['continuous_vs_static'])} | {x(r.get('unpadded_vs_padded'))} | "
                     f"{r.get('padding_ratio', 0):.2f} | {pred} | {per_round} | {r['latency_p50_s']:.2f} | "
                     f"{r['latency_p95_s']:.2f} | {same_tokens(r['same_tokens_as_ar'], r.get('divergence'))} |")
    differ = [f"- {_name(r)} at batch {r['batch_size']}, {r['batching']}: {describe_divergence(r['divergence'])}"
              for r in data["rows"] if r.get("divergence")]
    lines += [""] + differ if differ else []
    if data.get("auto"):
        lines += ["", "| batch | batching | `auto` ran | tokens/s | vs AR | best measured | auto / best |",
                  "|---:|---|---|---:|---:|---|---:|"]
        lines += [f"| {a['batch_size']} | {a['batching']} | {a['chosen']} | {a['tokens_per_s']:.1f} | "
                  f"{'-' if a['vs_ar'] is None else format(a['vs_ar'], '.2f') + 'x'} | {a['best']} | {a['vs_best']:.2f} |"
                  for a in data["auto"]]
    if data.get("predictions", "ok") != "ok":
        lines += ["", f"No predictions: {data['predictions']}"]
    else:
        lines += ["", "Predicted: the batch cost model over this workload (each output walked through the tokens per "
                      "round calibrated where each round starts, profiled round cost at each live batch size as the "
                      "batch drains, prefill included); in brackets, measured / predicted - 1. Tokens per round in "
                      "square brackets: the 5-95% interval over resamples of the requests (how much which prompts were "
                      "drawn moves it). Padding ratio: padding slots in the target KV cache per new token."]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": (3, 2)})
    names = list(dict.fromkeys(_name(r) for r in data["rows"]))
    for i, name in enumerate(names):
        color = f"C{i}"
        for how, style in (("continuous", "o-"), ("static", "x--")):
            rows = sorted((r for r in data["rows"] if _name(r) == name and (r["batching"] == how or r["batch_size"] == 1)),
                          key=lambda r: r["batch_size"])
            if len(rows) < 2 and not any(r["batching"] == how for r in rows):
                continue
            ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], style, color=color,
                    label=f"{name}, {how}")
            pred = [r for r in rows if r.get("predicted_tokens_per_s")]
            ax.plot([r["batch_size"] for r in pred], [r["predicted_tokens_per_s"] for r in pred], "+" if how == "continuous"
                    else "1", color=color, markersize=9, linestyle="none")
        # what the cost model's acceptance input looks like against what this run accepted (its smallest batch)
        first = min((r for r in data["rows"] if _name(r) == name), key=lambda r: r["batch_size"])
        measured = [(POSITION_BUCKET * b, a) for b, a in enumerate(first.get("accepted_by_position") or ()) if a is not None]
        if measured and name != "autoregressive" and not first["padded"]:  # padded rows accept what unpadded ones do
            acc.plot(*zip(*measured), "o-", color=color, label=name)
            predicted = first.get("predicted_accepted_by_position") or ()
            acc.plot([POSITION_BUCKET * b for b in range(len(predicted))], predicted, ":", color=color)
    ax.set_xscale("log", base=2)
    ax.text(0.01, 0.01, "+ / 1: predicted (continuous / static)", transform=ax.transAxes, fontsize=7)
    acc.set_xlabel("output position a round starts at")
    acc.set_ylabel("drafted tokens accepted per round")
    acc.set_title("measured (o) and calibrated (dotted)")
    acc.grid(alpha=0.3)
    acc.legend(fontsize=7)
    finish_figure(fig, ax, path, "batch size", "tokens/s (all requests)", f"batch {data['label']}: throughput")


def speed_rows(data: dict) -> list[dict]:
    """This bench's rows in the shape the reports read (bench.report.speed_rows' fields)."""
    rows = data["rows"]
    return [{"name": f"{r['method']}{' (padded)' if r.get('padded') else ''}, batch {r['batch_size']}, {r['batching']}",
             "tokens_per_s": r["tokens_per_s"],
             "speedup": r["speedup_vs_ar"], "tokens_per_call": None, "lossless": r["same_tokens_as_ar"]}
            for r in rows]


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    largest = max(r["batch_size"] for r in data["rows"])
    at = [r for r in data["rows"] if r["batch_size"] == largest]
    parts = [f"`{r['method']}` {r['continuous_vs_static']:.2f}x" for r in at
             if r["continuous_vs_static"] is not None and not r.get("padded")]
    padded = [f"`{r['method']}` {r['unpadded_vs_padded']:.2f}x ({r['batching']})" for r in at
              if r.get("unpadded_vs_padded") is not None]
    errors = [r["prediction_error"] for r in data["rows"] if r.get("prediction_error") is not None]
    auto = data.get("auto") or []
    same = all(r["same_tokens_as_ar"] for r in data["rows"])
    out = [f"continuous / static batching at batch {largest}: " + ", ".join(parts)] if parts else []
    out += [f"unpadded / padded at batch {largest}: {', '.join(padded)}"] if padded else []
    out += [f"predictions {min(errors):+.0%} to {max(errors):+.0%}"] if errors else []
    if auto and all(a["vs_ar"] for a in auto):
        out.append(f"`auto` {min(a['vs_ar'] for a in auto):.2f}x-{max(a['vs_ar'] for a in auto):.2f}x AR, "
                   f"{min(a['vs_best'] for a in auto):.2f}-{max(a['vs_best'] for a in auto):.2f} of the best row")
    out.append("every request's tokens as single-sequence AR's" if same else "SOME TOKENS DIFFER FROM AR")
    return "; ".join(out)

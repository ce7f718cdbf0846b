"""`specrt tune` (after `specrt calibrate` and `specrt profile`): pick, per batch size, the speculation with
the best predicted speed, if it beats no speculation by a margin (`min_gain`, 15%: the size of the cost model's
errors), else no speculation.

For each candidate, one round emits E[accepted] + 1 tokens per sequence and costs what specrt.runtime.cost
says, so the predicted speed is batch * (E[accepted] + 1) / cost (E over the calibration's outputs, or with
`--max-new-tokens N` over outputs of N tokens, walked through the acceptance calibrated where each round starts:
short outputs accept less, ANPD's most of all) (PPD section 4's hardware-aware pruning,
with the Sequoia/Medusa tree construction). Candidates: the calibrated best static trees of 1..64 nodes,
the rank-0 chains of 1..max_depth tokens, the dynamic and merged trees and ANPD's n-gram drafts whose
acceptance calibration measured by decoding, PPD's sparse trees where the bundle has prompt tokens, and no
speculation (L_target(batch, 1) + host work per token), which wins where drafting does
not pay. The plan is stamped with the machine the latency profile was measured on and the hashes of the
acceptance and latency files it was made from.

Variants (`--variants exported,static-int8`): each variant of the step graphs is weighed on its own evidence
(quant/S/acceptance.json and quant/S/latency.json, from `specrt calibrate --quant S` and `specrt profile --variants
exported,S`, which times the variants side by side: profiled minutes apart, on a loaded machine, their costs drift
apart more than 8-bit weights change them on the tiny pair), and the plan
picks the one with the best predicted speed over the tuned batch sizes (geometric mean); a quantized variant
only where that beats the exported graphs by min_gain too, since it decodes other tokens. plan.json names
the variant (`quant`) and what each was predicted to do; `auto` runs on a pipeline loaded with that variant
(`quant="plan"`). Each variant weighed also gets its own plan, plans/<variant>.json (VariantPlan): a pipeline loaded
with a variant plan.json did not pick runs `auto` on that one, so that tuning one variant does not undo another's
(`make bench-peers` and `make bench-peers-int8` tune the exported graphs and the int8 twin in turn).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import (EXPORTED, Acceptance, CurvePoint, LatencyProfile, Plan, PlanChoice, PromptTokens,
                                    Stamp, VariantPlan, variant_quant)
from specrt.calibration.acceptance import position_acceptance
from specrt.bundle.manifest import BundleOptions
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.runtime.cost import ppd_round_cost_ms, rounds_needed, weighed_ppd_trees
from specrt.runtime.speculation import SPECULATION, point_cost_ms, speculation_kind, trees_by_batch


@dataclass(frozen=True)
class TuneConfig(BundleOptions):
    batch_sizes: tuple[int, ...] = option((1, 2, 4, 8), "batch sizes to tune for (each must be profiled)", ge=1, nonempty=True)
    # bench/results/batch-tiny-min-gain-5pct: tuned with 0.05, the tiny pair ran ANPD at batch 8, predicted at 1.09x
    # AR, at 0.88x (its n-gram acceptance on the held-out text overstated HumanEval's): a gain inside the cost
    # model's error band (+-15%) is no reason to speculate
    min_gain: float = option(0.15, "speculate only where predicted at least this much faster than no speculation "
                                   "(0.15: 15%, the cost model's error band); below it, autoregressive", ge=0)
    new_tokens: int | None = option(None, "tokens your requests typically generate: each candidate's acceptance over "
                                          "outputs of that length (it grows along an output: n-gram drafts copy what "
                                          "the output said); default: the calibration's average over its outputs",
                                    ge=1, flag="max-new-tokens")
    context: int | None = option(None, "tokens your requests typically have cached (prompt and output so far): every "
                                       "step priced at the KV capacity that takes (a step attends over all of it), "
                                       "between the profiled contexts; default: their average", ge=1)
    variants: tuple[str, ...] = option((EXPORTED,), "variants of the step graphs to weigh, each calibrated on its "
                                                    "own (`specrt calibrate --quant S`) and profiled (best side by "
                                                    "side: `specrt profile --variants exported,S`): exported and "
                                                    "quantized schemes (`specrt quantize`). The plan "
                                                    "picks one for every batch size; a quantized one only where "
                                                    "predicted min_gain faster than the exported graphs (it computes "
                                                    "other tokens: list one only where that is acceptable)")


def candidates(acceptance: Acceptance) -> list[CurvePoint]:
    """Every speculation the tuner weighs from calibration (costs still 0), kind by kind (runtime/speculation.py):
    static trees, chains, measured trees."""
    return [c for kind in SPECULATION.values() if kind.candidates for c in kind.candidates(acceptance)]


def workload_accepted(acceptance: Acceptance, point: CurvePoint, new_tokens: int | None) -> float:
    """Drafted tokens a round of the candidate accepts on average over outputs of `new_tokens` tokens, walked through
    the acceptance calibrated where each round starts (None: the calibration's average over its own outputs)."""
    if new_tokens is None:
        return point.expected_accepted
    by_position = position_acceptance(acceptance, point)
    return new_tokens / rounds_needed(new_tokens, point.expected_accepted, by_position, acceptance.position_bucket,
                                      whole=False) - 1


def weigh(acceptance: Acceptance, latency: LatencyProfile, batch: int,
          prompt_tokens: PromptTokens | None = None, new_tokens: int | None = None) -> list[CurvePoint]:
    """Candidates with their predicted cost and speed at one batch size; autoregressive first. With PPD's
    prompt tokens, their sparse trees too (no draft: a round is one target step of the tree's rows; as calibrate
    measured them, else as their training-time table predicts). `new_tokens`: each candidate's acceptance over
    outputs of that length (workload_accepted; PPD's trees by the table keep their average, predicted without
    positions)."""
    ar = CurvePoint("autoregressive", 0, 0.0, 0.0, 0.0, 0.0)
    target_1, host_1 = point_cost_ms(acceptance, latency, batch, ar)
    rows = [replace(ar, predicted_tokens_per_s=batch * 1e3 / (target_1 + host_1), target_ms=target_1, draft_ms=host_1)]
    for c in candidates(acceptance):
        try:
            target_ms, draft_ms = point_cost_ms(acceptance, latency, batch, c)
        except SpecrtError:
            continue  # beyond the profiled token counts for this batch size
        c = replace(c, expected_accepted=workload_accepted(acceptance, c, new_tokens))
        speed = batch * 1e3 * (c.expected_accepted + 1) / (target_ms + draft_ms)
        rows.append(replace(c, predicted_tokens_per_s=round(speed, 4), target_ms=round(target_ms, 4),
                            draft_ms=round(draft_ms, 4), expected_accepted=round(c.expected_accepted, 6)))
    measured = acceptance.ppd_measured(prompt_tokens)
    for tree, accepted, tree_rows in weighed_ppd_trees(prompt_tokens, measured) if prompt_tokens is not None else ():
        try:
            target_ms, host_ms = ppd_round_cost_ms(latency, batch, tree, tree_rows)
        except SpecrtError:
            continue  # beyond the profiled token counts for this batch size
        c = CurvePoint("ppd", tree.budget, accepted, 0.0, 0.0, 0.0, paths=tree.paths)
        if measured:  # measured by output position too
            c = replace(c, expected_accepted=workload_accepted(acceptance, c, new_tokens))
        speed = batch * 1e3 * (c.expected_accepted + 1) / (target_ms + host_ms)
        rows.append(replace(c, predicted_tokens_per_s=round(speed, 4), target_ms=round(target_ms, 4),
                            draft_ms=round(host_ms, 4), expected_accepted=round(c.expected_accepted, 6)))
    return rows


def usable_prompt_tokens(bundle, latency: LatencyProfile) -> PromptTokens | None:
    """PPD's prompt tokens, where the bundle has valid ones and the profiled machine can run them (not a quantized
    variant: the prompt tokens are rows of the exported target graph)."""
    if not (bundle / PromptTokens.FILE).is_file() or (latency.stamp.machine and latency.stamp.machine.quant):
        return None
    return artifacts.load(bundle, PromptTokens)


def evidence(bundle: Path, variant: str) -> tuple[Acceptance, LatencyProfile]:
    """A variant's acceptance.json and latency.json, refused where either was measured on another variant."""
    quant = variant_quant(variant)
    acceptance = artifacts.load(bundle, Acceptance, quant=quant)
    latency = artifacts.load(bundle, LatencyProfile, quant=quant)
    flag = f" --quant {quant}" if quant else ""
    for what, measured, verb in ((Acceptance.file(quant), acceptance.config.get("quant"), "calibrate"),
                                 (LatencyProfile.file(quant), latency.stamp.machine and latency.stamp.machine.quant,
                                  "profile")):
        if measured != quant:
            raise SpecrtError(f"{bundle / what} was measured on {measured or 'the exported graphs'}, not on "
                              f"{variant}: re-run `specrt {verb} --bundle {bundle}{flag}`")
    return acceptance, latency


def choose(cfg: TuneConfig, acceptance: Acceptance, latency: LatencyProfile, prompt_tokens: PromptTokens | None):
    """(choices, curves) by batch size on one variant's evidence."""
    missing = [b for b in cfg.batch_sizes if b not in latency.batch_sizes()]
    if missing:
        raise SpecrtError(f"batch size(s) {', '.join(map(str, missing))} were not profiled (profiled: "
                          f"{', '.join(map(str, latency.batch_sizes()))}): re-run `specrt profile` with --batch-sizes")
    choices, curves = {}, {}
    for batch in cfg.batch_sizes:
        rows = weigh(acceptance, latency, batch, prompt_tokens, cfg.new_tokens)
        best = max(rows, key=lambda r: r.predicted_tokens_per_s)
        if best.predicted_tokens_per_s < (1 + cfg.min_gain) * rows[0].predicted_tokens_per_s:
            best = rows[0]  # too close to call: no speculation
        best_static = max((r for r in rows if speculation_kind(r.kind).static), key=lambda r: r.predicted_tokens_per_s)
        choices[batch] = PlanChoice(speculation_kind(best.kind).method, best, best_static,
                                    round(best.predicted_tokens_per_s / rows[0].predicted_tokens_per_s, 3))
        curves[batch] = tuple(rows)
    return choices, curves


def tune(cfg: TuneConfig) -> Plan:
    bundle = Path(cfg.bundle)
    if not cfg.variants or len(set(cfg.variants)) < len(cfg.variants):
        raise SpecrtError(f"variants must name each variant once, e.g. {EXPORTED},static-int8; got {list(cfg.variants)}")
    weighed, inputs = {}, {}
    for variant in cfg.variants:
        acceptance, latency = evidence(bundle, variant)
        prompt_tokens = usable_prompt_tokens(bundle, latency)
        priced = latency if cfg.context is None else latency.at_context(cfg.context)
        weighed[variant] = (latency, *choose(cfg, acceptance, priced, prompt_tokens))
        quant = variant_quant(variant)
        inputs[variant] = [Acceptance.file(quant), LatencyProfile.file(quant)] + ([PromptTokens.FILE] if prompt_tokens
                                                                                   else [])
    machines = {replace(latency.stamp.machine, quant=None) for latency, _, _ in weighed.values()}
    if len(machines) > 1:
        raise SpecrtError("the variants were profiled with different machines, backends or threads ("
                          + "; ".join(f"{v}: {w[0].stamp.machine.describe()}" for v, w in weighed.items())
                          + "): profile each here with the same flags")
    speeds = {v: {b: c.best.predicted_tokens_per_s for b, c in choices.items()} for v, (_, choices, _) in weighed.items()}

    def score(variant: str) -> float:  # geometric mean over the tuned batch sizes
        return float(np.exp(np.mean(np.log(list(speeds[variant].values())))))

    picked = max(weighed, key=score)
    if picked != EXPORTED and EXPORTED in weighed and score(picked) < (1 + cfg.min_gain) * score(EXPORTED):
        picked = EXPORTED  # a quantized target decodes other tokens: only for a gain beyond the model's error
    for variant, (latency, choices, curves) in weighed.items():  # each variant's own plan (VariantPlan)
        stamp = Stamp.make(bundle, latency.stamp.machine, inputs=tuple(inputs[variant]))
        artifacts.save(bundle, VariantPlan(stamp=stamp, choices=choices, curves=curves, quant=variant_quant(variant),
                                           new_tokens=cfg.new_tokens, context=cfg.context), variant_quant(variant))
    latency, choices, curves = weighed[picked]
    every = tuple(dict.fromkeys(name for names in inputs.values() for name in names))
    plan = Plan(stamp=Stamp.make(bundle, latency.stamp.machine, inputs=every), choices=choices,
                curves=curves, quant=variant_quant(picked), new_tokens=cfg.new_tokens, context=cfg.context,
                variants={v: {b: round(x, 4) for b, x in speed.items()} for v, speed in speeds.items()})
    artifacts.save(bundle, plan)
    return plan


def describe_point(kind: str, num_nodes: int, ngram_tokens: int = 0) -> str:
    """A candidate in words: "dynamic tree of 8 nodes + up to 7 n-gram drafts that pay", "no speculation"."""
    return speculation_kind(kind).words(num_nodes, ngram_tokens)


def describe_auto(plan: Plan, batch_size: int) -> str:
    """What `auto` runs for a call of batch_size, in words: the choice for that size, or the static tree of each
    tuned size up to it (runtime.methods.Auto follows the live batch size where every one of those is a tree)."""
    trees = trees_by_batch(plan, batch_size)
    if trees is not None:
        return "static trees by live batch size: " + ", ".join(
            f"{t.num_nodes} node{'' if t.num_nodes == 1 else 's'} at {b}" for b, t in trees.items())
    best = plan.choice_for(batch_size).best
    return describe_point(best.kind, best.num_nodes, best.ngram_tokens)


def describe_plan(plan: Plan) -> str:
    lines = []
    if plan.variants and len(plan.variants) > 1:
        picked = plan.quant or EXPORTED
        lines.append(f"variant: {picked} (predicted tokens/s by batch size: " + "; ".join(
            f"{v} " + ", ".join(f"{x:.1f}" for x in speed.values()) for v, speed in plan.variants.items()) + ")")
    if plan.new_tokens:
        lines.append(f"tuned for outputs of {plan.new_tokens} tokens")
    if plan.context:
        lines.append(f"tuned for steps at {plan.context} cached tokens")
    for batch, c in plan.choices.items():
        best = c.best
        what = describe_point(best.kind, best.num_nodes, best.ngram_tokens)
        lines.append(f"batch {batch}: {what}: predicted {best.predicted_tokens_per_s:.1f} tokens/s, "
                     f"{c.predicted_speedup:.2f}x autoregressive")
    return "\n".join(lines)

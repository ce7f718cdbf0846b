"""`specrt tune` (after `specrt calibrate` and `specrt profile`): pick, per batch size, the speculation tree (or none) with the best predicted speed.

For a tree of n nodes with expected accepted drafted tokens f(n) (acceptance.json) and profiled step
latencies L (latency.json), one round emits f(n) + 1 tokens per sequence and costs

    L_target(batch, n + 1)                       verify the root and every node in one step
    + L_draft(batch, 1) + sum_levels L_draft(batch, nodes fed at that level)   draft the tree level by level
    + H(n)                                       the runtime's host work per round (profiled at batch 1)

so the predicted speed is batch * (f(n) + 1) / cost (PPD section 4's hardware-aware pruning, with the
Sequoia/Medusa tree construction). Candidates are the calibrated best trees of 1..64 nodes, the chains
of 1..max_depth tokens and the dynamic trees whose acceptance calibration measured (f(n) and draft calls
per round as measured; each call after the root's feeds up to W beams: L_draft(batch, W); host work as
profiled for dynamic trees), also with n-gram drafts merged in (kind "merged"; the target step is costed
at the expected widest tree of the batch under the measured histogram of nodes per round); no
speculation (L_target(batch, 1) per token) is always a candidate, and wins where drafting does not pay.
The plan records the machine, backend and bundle it was tuned for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from specrt.bench.latency import host_ms, latency_ms, load_latency
from specrt.calibration.acceptance import chain_expectation, load_acceptance
from specrt.errors import SpecrtError
from specrt.runtime.plan import PLAN, plan_fingerprint
from specrt.runtime.tree import TreeSpec


@dataclass(frozen=True)
class TuneConfig:
    bundle: Path
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)


def round_cost_ms(latency: dict, batch: int, spec: TreeSpec) -> tuple[float, float]:
    """(target ms, draft + host ms) of one round with this tree."""
    target = latency_ms(latency, "target", batch, len(spec) + 1)
    draft = latency_ms(latency, "draft", batch, 1)  # the pending (bonus) token and the root's children
    for level in spec.levels[:-1]:
        fed = int(sum(spec.num_children[i + 1] > 0 for i in level))
        draft += latency_ms(latency, "draft", batch, fed)
    return target, draft + host_ms(latency, len(spec))


def step_width(dyn: dict, batch: int) -> float:
    """Expected drafted tokens per sequence in one target step of `batch` sequences: a ragged step is as
    wide as its widest tree, so the expected maximum of `batch` draws from the calibrated histogram of
    nodes per round (independent sequences); the mean at batch 1. Without a histogram: the mean, else
    num_nodes (older calibrations)."""
    import numpy as np

    hist = dyn.get("nodes_hist")
    if not hist:
        return dyn.get("nodes_per_round", dyn["num_nodes"])
    widths = np.array(sorted(int(k) for k in hist))
    cdf = np.cumsum([hist[str(k)] for k in widths]) / sum(hist.values())
    below = np.concatenate(([0.0], cdf[:-1]))
    return float(np.sum(widths * (cdf ** batch - below ** batch)))


def dynamic_round_cost_ms(latency: dict, batch: int, dyn: dict) -> tuple[float, float]:
    """(target ms, draft + host ms) of one round with a dynamic tree (a calibration `dynamic` entry, or a
    `merged` one: n-gram drafts merged in)."""
    merged = bool(dyn.get("ngram_tokens"))
    target = latency_ms(latency, "target", batch, step_width(dyn, batch) + 1)
    draft = latency_ms(latency, "draft", batch, 1)  # the pending tokens, whose logits are the root's
    draft += max(0.0, dyn["draft_calls_per_round"] - 1) * latency_ms(latency, "draft", batch, dyn["width"])
    return target, draft + host_ms(latency, dyn["num_nodes"], "merged" if merged else "dynamic")


def candidates(acceptance: dict) -> list[dict]:
    """Calibrated best trees and rank-0 chains, each with its expected accepted tokens."""
    import numpy as np

    p = np.array(acceptance["depth_rank"])
    out = [{"kind": "tree", "paths": t["paths"], "expected_accepted": t["expected_accepted"]} for t in acceptance["trees"]]
    for g in range(1, p.shape[0] + 1):
        out.append({"kind": "chain", "paths": [[0] * d for d in range(1, g + 1)], "expected_accepted": chain_expectation(p, g)})
    return out


def tune(cfg: TuneConfig) -> dict:
    acceptance, latency = load_acceptance(cfg.bundle), load_latency(cfg.bundle)
    from specrt.calibration.acceptance import _manifest_hash

    if acceptance.get("manifest_sha256") != _manifest_hash(cfg.bundle):
        raise SpecrtError(f"{cfg.bundle}/acceptance.json was calibrated for another export of this bundle: "
                          "re-run `specrt calibrate`")
    choices, curves = {}, {}
    for batch in cfg.batch_sizes:
        ar = batch * 1e3 / (latency_ms(latency, "target", batch, 1) + host_ms(latency, 0))
        rows = [{"kind": "autoregressive", "num_nodes": 0, "expected_accepted": 0.0, "predicted_tokens_per_s": ar,
                 "target_ms": latency_ms(latency, "target", batch, 1), "draft_ms": host_ms(latency, 0)}]
        measured = [{"kind": kind, **d} for kind in ("dynamic", "merged") for d in acceptance.get(kind, [])]
        for c in candidates(acceptance) + measured:
            try:
                if c["kind"] in ("dynamic", "merged"):
                    target_ms, draft_ms = dynamic_round_cost_ms(latency, batch, c)
                else:
                    target_ms, draft_ms = round_cost_ms(latency, batch, TreeSpec.from_paths(c["paths"]))
            except SpecrtError:
                continue  # beyond the profiled token counts for this batch size
            speed = batch * 1e3 * (c["expected_accepted"] + 1) / (target_ms + draft_ms)
            rows.append({**{k: c[k] for k in ("kind", "paths", "width", "depth", "ngram_tokens", "ngram_min_prob") if k in c},
                         "num_nodes": len(c["paths"]) if "paths" in c else c["num_nodes"],
                         "expected_accepted": c["expected_accepted"], "predicted_tokens_per_s": speed,
                         "target_ms": target_ms, "draft_ms": draft_ms})
        best = max(rows, key=lambda r: r["predicted_tokens_per_s"])
        # what method="tree" uses: the best static tree or chain
        best_tree = max((r for r in rows if r["kind"] in ("tree", "chain")), key=lambda r: r["predicted_tokens_per_s"])
        choices[str(batch)] = {
            "method": {"autoregressive": "autoregressive", "dynamic": "dynamic", "merged": "dynamic"}.get(best["kind"], "tree"),
            "kind": best["kind"], "num_nodes": best["num_nodes"], "paths": best.get("paths"),
            "width": best.get("width"), "depth": best.get("depth"),
            "ngram_tokens": best.get("ngram_tokens", 0), "ngram_min_prob": best.get("ngram_min_prob"),
            "predicted_tokens_per_s": round(best["predicted_tokens_per_s"], 2),
            "predicted_speedup": round(best["predicted_tokens_per_s"] / ar, 3),
            "best_tree": {"kind": best_tree["kind"], "num_nodes": best_tree["num_nodes"], "paths": best_tree["paths"],
                          "predicted_tokens_per_s": round(best_tree["predicted_tokens_per_s"], 2)},
        }
        curves[str(batch)] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "paths"}
                              for r in rows]
    plan = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **plan_fingerprint(cfg.bundle, latency),
            "choices": choices, "curves": curves}
    (cfg.bundle / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def describe_plan(plan: dict) -> str:
    lines = []
    for batch, c in plan["choices"].items():
        if c["method"] == "autoregressive":
            what = "no speculation (drafting does not pay here)"
        else:
            what = f"{'dynamic tree' if c['kind'] in ('dynamic', 'merged') else c['kind']} of {c['num_nodes']} nodes"
            if c.get("ngram_tokens"):
                what += f" + up to {c['ngram_tokens']} n-gram drafts"
        lines.append(f"batch {batch}: {what}: predicted {c['predicted_tokens_per_s']:.1f} tokens/s, "
                     f"{c['predicted_speedup']:.2f}x autoregressive")
    return "\n".join(lines)

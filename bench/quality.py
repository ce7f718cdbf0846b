"""Output quality: perplexity of generated tokens under the target (the MTAD/MJSD papers' metric), and where a
method's greedy tokens leave autoregressive decoding's, how close to a tie the target was there."""

from __future__ import annotations

import numpy as np


def token_logprobs(pipe, prompt_ids, new_ids) -> np.ndarray:
    """log p_target(new_ids[i] | prompt, new_ids[:i]) for each new token, by one teacher-forced step."""
    from specrt.runtime.sampling import log_softmax
    from specrt.runtime.step_inputs import sequence_logits

    seq = np.asarray(list(prompt_ids) + list(new_ids), dtype=np.int64)
    with pipe.target.runner() as runner:
        logits = sequence_logits(runner, seq[:-1])  # [T - 1, V]
    rows = log_softmax(logits[len(prompt_ids) - 1:])
    return rows[np.arange(len(new_ids)), np.asarray(new_ids)]


def perplexity(pipe, prompts_ids, outputs_ids) -> float:
    """exp(-mean log-likelihood) over all generated tokens of all prompts (pooled, like the papers)."""
    logps = np.concatenate([token_logprobs(pipe, p, o) for p, o in zip(prompts_ids, outputs_ids) if len(o)])
    return float(np.exp(-logps.mean()))


def divergence(pipe, prompts_ids, reference, outputs) -> dict | None:
    """None where every output is the reference's tokens; else {"requests": how many differ, "max_gap": the largest
    target logit gap, teacher-forced over the reference's tokens, between the reference's token and the other
    output's at the first position they differ (None where one output only stops earlier), "tolerance": the parity
    tolerance of the target's dtype at those rows' largest logit (contract.parity_tolerance), "ties": every gap within
    its row's}. Two correct computations of one step may differ by that tolerance (a step of another shape, batched,
    padded or verifying a tree, sums in another order), so within it the two tokens are a rounding tie that greedy
    decoding may break either way; beyond it the method changed the output."""
    from specrt.contract import PARITY_TOL, parity_tolerance
    from specrt.runtime.step_inputs import sequence_logits

    gaps, tols = [], []  # the gap at each differing request, and the tolerance of its row's logits
    per_unit = PARITY_TOL[pipe.target.entry.dtype]
    for prompt, ref, out in zip(prompts_ids, reference, outputs):
        if list(ref) == list(out):
            continue
        j = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if j is None:
            gaps.append(None)
            continue
        with pipe.target.runner() as runner:
            row = sequence_logits(runner, np.asarray(list(prompt) + list(ref[:j]), dtype=np.int64))[-1]
        gaps.append(float(row[ref[j]] - row[out[j]]))
        tols.append(parity_tolerance(per_unit, float(np.abs(row).max())))
    if not gaps:
        return None
    known = [abs(g) for g in gaps if g is not None]
    worst = None if len(known) < len(gaps) else max(known)
    return {"requests": len(gaps), "max_gap": None if worst is None else round(worst, 6),
            "tolerance": round(max(tols, default=per_unit), 6), "dtype": pipe.target.entry.dtype,
            "ties": worst is not None and all(abs(g) <= t for g, t in zip(gaps, tols))}


def gap_shift(pipe, other, prompts_ids, outputs) -> float:
    """The largest change `other`'s target makes to the gap between any two tokens' logits against `pipe`'s,
    teacher-forced over the outputs: the most, over positions, of max - min of the difference of their logit rows.
    With `other` the same target with 8-bit weights, how far quantizing the weights moves a greedy choice here: a
    runtime that quantizes them its own way may pick otherwise where the target's gap is within it."""
    from specrt.runtime.step_inputs import sequence_logits

    worst = 0.0
    for prompt, out in zip(prompts_ids, outputs):
        if not len(out):
            continue
        seq = np.asarray(list(prompt) + list(out[:-1]), dtype=np.int64)
        with pipe.target.runner() as a, other.target.runner() as b:
            diff = sequence_logits(b, seq)[len(prompt) - 1:] - sequence_logits(a, seq)[len(prompt) - 1:]
        worst = max(worst, float((diff.max(axis=-1) - diff.min(axis=-1)).max()))
    return worst


def quantization_ties(div: dict, shift: float, weights: str, ours: str) -> dict:
    """A peer's divergence whose weights are quantized its own way (`weights`, e.g. Q8_0) against our `ours` variant,
    judged against `shift` (gap_shift of our variant against the float graphs): within it, a quantization tie."""
    return {**div, "other_weights": weights, "ours": ours, "quant_shift": round(shift, 6),
            "quant_ties": div["max_gap"] is not None and div["max_gap"] <= shift}


def same_tokens(same: bool, div: dict | None) -> str:
    """A table cell: yes, NO (rounding tie) or NO."""
    if same:
        return "yes"
    return "NO (rounding tie)" if div and div["ties"] else "NO (quantization tie)" if div and div.get("quant_ties") \
        else "NO"


def describe_divergence(div: dict) -> str:
    gap = "an output that stops early" if div["max_gap"] is None else \
        f"largest target logit gap at the first differing token {div['max_gap']:.4f}"
    head = f"{div['requests']} request(s) differ from AR; {gap}"
    if div.get("quant_shift") is not None and not div["ties"]:
        verdict = "within it, so quantization ties, not a method's change" if div["quant_ties"] else \
            "beyond it, so more than quantizing explains"
        return (f"{head}; 8-bit weights move this target's logit gaps by up to {div['quant_shift']:.4f} here (our "
                f"{div['ours']} against the float graphs, over these outputs), and {div['other_weights']} quantizes "
                f"them its own way: {verdict}")
    verdict = "rounding ties, not lost tokens" if div["ties"] else \
        f"{div['other_weights']} quantizes the weights its own way, so beyond float rounding: not a method's change" \
        if div.get("other_weights") else "beyond rounding: the method changed the output"
    return f"{head} ({div['dtype']} parity tolerance {div['tolerance']:g}): {verdict}"

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
    tolerance of the target's dtype, "ties": max_gap within it}. Two correct computations of one step may differ
    by that tolerance (a step of another shape, batched, padded or verifying a tree, sums in another order), so
    within it the two tokens are a rounding tie that greedy decoding may break either way; beyond it the method
    changed the output."""
    from specrt.contract import PARITY_TOL
    from specrt.runtime.step_inputs import sequence_logits

    gaps = []
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
    if not gaps:
        return None
    tol = PARITY_TOL[pipe.target.entry.dtype]
    known = [abs(g) for g in gaps if g is not None]
    worst = None if len(known) < len(gaps) else max(known)
    return {"requests": len(gaps), "max_gap": None if worst is None else round(worst, 6), "tolerance": tol,
            "dtype": pipe.target.entry.dtype, "ties": worst is not None and worst <= tol}


def same_tokens(same: bool, div: dict | None) -> str:
    """A table cell: yes, NO (rounding tie) or NO."""
    return "yes" if same else "NO (rounding tie)" if div and div["ties"] else "NO"


def describe_divergence(div: dict) -> str:
    gap = "an output that stops early" if div["max_gap"] is None else \
        f"largest target logit gap at the first differing token {div['max_gap']:.4f}"
    verdict = "rounding ties, not lost tokens" if div["ties"] else \
        f"{div['other_weights']} quantizes the weights its own way, so beyond float rounding: not a method's change" \
        if div.get("other_weights") else "beyond rounding: the method changed the output"
    return (f"{div['requests']} request(s) differ from AR; {gap} ({div['dtype']} parity tolerance {div['tolerance']:g}): "
            f"{verdict}")

"""Output quality: perplexity of generated tokens under the target (the MTAD/MJSD papers' metric)."""

from __future__ import annotations

import numpy as np


def token_logprobs(pipe, prompt_ids, new_ids) -> np.ndarray:
    """log p_target(new_ids[i] | prompt, new_ids[:i]) for each new token, by one teacher-forced step."""
    from specrt.runtime.step_inputs import feed_rows

    seq = np.asarray(list(prompt_ids) + list(new_ids), dtype=np.int64)
    cache = pipe.target.new_cache(1)
    logits = feed_rows(pipe.target, cache, [seq[:-1]])[0].astype(np.float64)  # [T - 1, V]
    rows = logits[len(prompt_ids) - 1:]
    rows = rows - rows.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(rows).sum(axis=-1))
    return rows[np.arange(len(new_ids)), np.asarray(new_ids)] - logz


def perplexity(pipe, prompts_ids, outputs_ids) -> float:
    """exp(-mean log-likelihood) over all generated tokens of all prompts (pooled, like the papers)."""
    logps = np.concatenate([token_logprobs(pipe, p, o) for p, o in zip(prompts_ids, outputs_ids) if len(o)])
    return float(np.exp(-logps.mean()))

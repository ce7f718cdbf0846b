"""Output quality: perplexity of generated tokens under the target (the MTAD/MJSD papers' metric)."""

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

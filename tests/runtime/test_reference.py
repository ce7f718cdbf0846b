"""The one-loop reference (runtime/reference.py) is the oracle: greedy speculative decoding there gives greedy
autoregressive decoding's tokens, and the runtime's Scheduler gives the reference's, on both backends."""

import pytest


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_the_scheduler_gives_the_reference_loops_tokens(pipelines, humaneval, backend):
    from specrt.runtime.reference import reference_sd

    pipe = pipelines[backend]
    prompts = humaneval[:6]
    ours = pipe.generate(prompts, method="sd", max_new_tokens=40, num_draft_tokens=3, batch_size=3)
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=40)
    for prompt, o, a in zip(prompts, ours, ar):
        ref = reference_sd(pipe.target, pipe.draft, pipe.encode(prompt), 40, k=3, eos_id=pipe.eos_id)
        assert ref == o.token_ids == a.token_ids
    assert sum(o.stats.accepted for o in ours) > 40  # guesses were accepted: the equality is not vacuous


def test_the_reference_stops_at_the_end_token_and_the_limit(pipelines, humaneval):
    from specrt.runtime.reference import reference_sd

    pipe = pipelines["ort"]
    ids = pipe.encode(humaneval[0])
    full = reference_sd(pipe.target, pipe.draft, ids, 24, k=4)
    assert len(full) == 24 and reference_sd(pipe.target, pipe.draft, ids, 7, k=4) == full[:7]
    assert reference_sd(pipe.target, pipe.draft, ids, 24, k=4, eos_id=full[5]) == full[:full.index(full[5]) + 1]

"""bench.quality.divergence: where a method's greedy tokens leave AR's, and whether the target was at a tie there."""

import numpy as np
import pytest


def test_divergence_measures_the_targets_logit_gap_at_the_first_difference(demo_bundle):
    from specrt.bench.quality import describe_divergence, divergence, same_tokens
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.step_inputs import sequence_logits

    pipe = Pipeline.load(demo_bundle, threads=2)
    prompts = ["def add(a, b):", "import os\n"]
    ids = [pipe.encode(p) for p in prompts]
    ref = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=12)]
    assert divergence(pipe, ids, ref, [list(r) for r in ref]) is None
    assert same_tokens(True, None) == "yes"

    # the second request takes the target's runner-up at token 5: the gap there is top-1 minus top-2
    with pipe.target.runner() as runner:
        row = sequence_logits(runner, np.asarray(ids[1] + ref[1][:5], dtype=np.int64))[-1]
    second = int(np.argsort(row)[-2])
    other = [list(ref[0]), ref[1][:5] + [second] + ref[1][6:]]
    div = divergence(pipe, ids, ref, other)
    tol = 1e-4 * max(1.0, float(np.abs(row).max()))  # per unit of the row's largest logit
    assert div["requests"] == 1 and div["dtype"] == "float32" and div["tolerance"] == pytest.approx(tol, abs=1e-6)
    assert div["max_gap"] == pytest.approx(float(row[ref[1][5]] - row[second]), abs=1e-5) and div["max_gap"] > 0
    assert div["ties"] is (div["max_gap"] <= tol)
    assert same_tokens(False, div) == ("NO (rounding tie)" if div["ties"] else "NO")
    assert "1 request(s) differ from AR" in describe_divergence(div)
    # beyond rounding: a method changed the output, unless the row is a peer whose weights are quantized its own way
    beyond = {**div, "ties": False}
    assert describe_divergence(beyond).endswith("the method changed the output")
    assert describe_divergence({**beyond, "other_weights": "Q8_0"}).endswith(
        "Q8_0 quantizes the weights its own way, so beyond float rounding: not a method's change")

    # an output that only stops early has no differing token: not a tie
    short = divergence(pipe, ids, ref, [list(ref[0]), ref[1][:4]])
    assert short["max_gap"] is None and not short["ties"] and same_tokens(False, short) == "NO"
    assert "stops early" in describe_divergence(short)


def test_a_peers_own_8bit_weights_are_judged_against_what_8bit_weights_move_here():
    from specrt.bench.quality import describe_divergence, quantization_ties, same_tokens

    div = {"requests": 3, "max_gap": 0.0676, "tolerance": 1e-4, "dtype": "float32", "ties": False}
    tie = quantization_ties(div, 0.41, "Q8_0", "int8-weights")
    assert tie["quant_ties"] and same_tokens(False, tie) == "NO (quantization tie)"
    assert describe_divergence(tie) == (
        "3 request(s) differ from AR; largest target logit gap at the first differing token 0.0676; 8-bit weights "
        "move this target's logit gaps by up to 0.4100 here (our int8-weights against the float graphs, over these "
        "outputs), and Q8_0 quantizes them its own way: within it, so quantization ties, not a method's change")
    beyond = quantization_ties(div, 0.05, "Q8_0", "int8-weights")
    assert not beyond["quant_ties"] and same_tokens(False, beyond) == "NO"
    assert describe_divergence(beyond).endswith("beyond it, so more than quantizing explains")
    short = quantization_ties({**div, "max_gap": None}, 0.41, "Q8_0", "int8-weights")  # stops early: no tie
    assert not short["quant_ties"]

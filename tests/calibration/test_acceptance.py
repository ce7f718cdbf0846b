import numpy as np
import pytest

from specrt.calibration.acceptance import best_trees, chain_expectation, depth_rank_table


def test_depth_rank_table_conditions_on_accepted_parents():
    # ranks along one trajectory; K = 2 (rank >= 2 is a miss)
    ranks = [np.array([0, 1, 5, 0])]
    p, support = depth_rank_table(ranks, max_depth=2, max_rank=2)
    # depth 1: every start position counts: ranks 0, 1, 5, 0 -> p[0] = [2/4, 1/4]
    assert support[0] == 4 and p[0].tolist() == [0.5, 0.25]
    # depth 2: starts whose first rank hit (s = 0, 1, 3) and that have a next position (s = 0, 1)
    assert support[1] == 2 and p[1].tolist() == [0.0, 0.5]  # next ranks: 1 (hit, rank 1), 5 (miss)


def test_tables_by_output_position_count_the_rounds_that_start_there(monkeypatch):
    from specrt.bundle.artifacts import CurvePoint
    from specrt.calibration import acceptance as acc

    monkeypatch.setattr(acc, "POSITION_BUCKET", 2)
    ranks = [np.array([5, 5, 0, 1, 0, 0])]  # misses at output positions 0-1, hits after
    tables = acc.depth_rank_by_position(ranks, max_depth=2, max_rank=2, new_tokens=6)  # buckets [0,2) [2,4) [4,6)
    assert tables.shape == (3, 2, 2)
    assert tables[0, 0].tolist() == [0.0, 0.0]  # starts 0, 1: misses
    assert tables[1, 0].tolist() == [0.5, 0.5] and tables[1, 1].tolist() == [0.5, 0.5]  # starts 2, 3 -> next 1, 0
    assert tables[2, 0].tolist() == [1.0, 0.0] and tables[2, 1].tolist() == [1.0, 0.0]  # starts 4, 5; depth 2 from 4
    # the last bucket is every later start: with 2 buckets for 4 tokens, starts 2..5 pool
    pooled = acc.depth_rank_by_position(ranks, max_depth=1, max_rank=2, new_tokens=4)
    assert pooled[1, 0].tolist() == [0.75, 0.25]
    a = type("A", (), {"depth_rank_by_position": tables.tolist(), "measured": {}})()
    chain = CurvePoint("chain", 2, 0.0, 0.0, 0.0, 0.0, paths=((0,), (0, 0)))
    assert acc.position_acceptance(a, chain) == pytest.approx((0.0, 0.5 + 0.25, 1.0 + 1.0))
    assert acc.position_acceptance(a, CurvePoint("ppd", 4, 0.0, 0.0, 0.0, 0.0)) == ()


def test_rounds_walk_each_output_through_the_acceptance_where_rounds_start():
    from specrt.runtime.cost import rounds_needed

    assert rounds_needed(10, 0.0) == 10  # autoregressive: a token a round
    assert rounds_needed(10, 2.0) == 4  # positions 0 -> 3 -> 6 -> 9 -> 12
    # no acceptance before position 4, then 3 drafted tokens a round: 0 1 2 3 | 4 8 (12)
    assert rounds_needed(12, 9.0, (0.0, 3.0), bucket=4) == 6
    assert rounds_needed(12, 9.0, (0.0, 0.0, 3.0), bucket=4) == 9  # 8 rounds of 1 token to position 8, then 12
    assert rounds_needed(1, 2.0) == 1
    assert rounds_needed(10, 2.0, whole=False) == pytest.approx(3 + 1 / 3)  # 0 -> 9, then a third of 9 -> 12


def test_best_trees_are_nested_and_greedy():
    p = np.array([[0.8, 0.1], [0.5, 0.2], [0.9, 0.05]])
    trees = best_trees(p, max_nodes=5)
    assert [t.num_nodes for t in trees] == [1, 2, 3, 4, 5]
    # path probabilities: (0,) .8, (0,0) .4, (0,0,0) .36, (0,1) .16, (0,1,0) .144 > (1,) .1
    assert trees[-1].paths == ((0,), (0, 0), (0, 0, 0), (0, 1), (0, 1, 0))
    assert trees[-1].expected_accepted == pytest.approx(0.8 + 0.4 + 0.36 + 0.16 + 0.144)
    for small, big in zip(trees, trees[1:]):
        assert big.paths[:-1] == small.paths
    assert chain_expectation(p, 3) == pytest.approx(0.8 + 0.4 + 0.36)


def test_calibration_is_deterministic_for_a_seed(demo_bundle, tmp_path):
    import shutil

    from dataclasses import replace

    from specrt.bundle import artifacts
    from specrt.bundle.artifacts import Acceptance
    from specrt.calibration.acceptance import CalibrationConfig, calibrate

    copy = tmp_path / "b"
    shutil.copytree(demo_bundle, copy)
    cfg = CalibrationConfig(bundle=copy, num_prompts=4, new_tokens=24, max_depth=4, max_rank=4, max_nodes=8, seed=1,
                            dynamic_sizes=(2, 6), merged_sizes=(6,), ngram_sizes=(3, 7))
    a = calibrate(cfg, progress=False)
    b = calibrate(cfg, progress=False)
    assert (a.depth_rank, a.trees, a.measured) == (b.depth_rank, b.trees, b.measured)
    assert list(a.measured) == ["dynamic", "merged", "ngram"]  # the demo bundle has no prompt tokens: no PPD
    assert artifacts.load(copy, Acceptance) == b  # what was saved is what loads
    assert 0 < a.depth_rank[0][0] <= 1
    # dynamic trees are measured by decoding: at most `depth` drafted tokens accepted per round, and at
    # most one draft call per depth (fewer where the search stops early)
    dynamic, merged, ngram = (a.measured[k] for k in ("dynamic", "merged", "ngram"))
    assert [(d.num_nodes, d.width, d.depth) for d in dynamic] == [(2, 4, 2), (6, 4, 6)]
    for d in dynamic:
        assert 0 < d.expected_accepted <= d.depth and 1 <= d.draft_calls_per_round <= d.depth
        assert d.nodes_per_round <= d.num_nodes
        hist = d.nodes_hist
        assert max(hist) <= d.num_nodes and sum(k * v for k, v in hist.items()) / sum(hist.values()) == pytest.approx(
            d.nodes_per_round, abs=1e-4)
    # merged with up to 16 n-gram drafts: more nodes verified per round than the model's 6 (some merge away)
    (m,) = merged
    (d6,) = [d for d in dynamic if d.num_nodes == 6]
    assert (m.num_nodes, m.ngram_tokens) == (6, 16) and 6 < m.nodes_per_round <= 22
    assert m.expected_accepted > d6.expected_accepted
    # ANPD's n-gram drafts, measured by decoding: no draft calls, at most K drafted (and accepted) per round
    assert [(g.num_nodes, g.draft_calls_per_round) for g in ngram] == [(3, 0.0), (7, 0.0)]
    assert all(0 <= g.expected_accepted <= g.nodes_per_round <= g.num_nodes for g in ngram)
    # by where rounds start in the output (24 tokens: buckets [0, 16) and [16, 24)), each bucket's figure within
    # what a round can accept; tables per bucket of the same shape as the pooled one
    assert a.position_bucket == 16 and np.array(a.depth_rank_by_position).shape == (2, 4, 4)
    for m in dynamic + merged + ngram:
        assert len(m.accepted_by_position) == 2 and all(0 <= x <= m.depth for x in m.accepted_by_position)
        # how far the 4 prompts drawn move each figure: an interval around it
        assert m.accepted_interval[0] <= m.expected_accepted <= m.accepted_interval[1]
    c = calibrate(replace(cfg, seed=2), progress=False)
    assert c.depth_rank != a.depth_rank


def test_calibration_on_your_own_prompts(demo_bundle, tmp_path):
    """--prompts FILE: the prompts a user's traffic looks like, recorded with their hash, whole unless
    --prompt-tokens cuts them; a bad file in one line."""
    import json
    import shutil
    from dataclasses import replace

    from specrt.bundle.manifest import sha256_file
    from specrt.calibration.acceptance import HELD_OUT_PROMPT_TOKENS, CalibrationConfig, calibrate
    from specrt.runtime.pipeline import Pipeline
    from specrt.checkpoints.corpus import read_prompts
    from specrt.errors import SpecrtError

    copy = tmp_path / "b"
    shutil.copytree(demo_bundle, copy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):\n", "import os\n", "x = 1")))
    cfg = CalibrationConfig(bundle=copy, num_prompts=2, new_tokens=12, max_depth=2, max_rank=2, max_nodes=3,
                            dynamic_sizes=(), merged_sizes=(), ngram_sizes=(3,), prompts=prompts)
    a = calibrate(cfg, progress=False)
    assert a.config["prompts"] == str(prompts) and a.config["prompts_sha256"] == sha256_file(prompts)
    assert a.num_positions == 2 * 12  # each prompt's 12 decoded tokens, whatever the prompt's length
    stdlib = calibrate(CalibrationConfig(**{**vars(cfg), "prompts": None}), progress=False)
    assert stdlib.depth_rank != a.depth_rank and "prompts_sha256" not in stdlib.config
    # the prompts whole unless --prompt-tokens cuts them: the context changes what the target writes
    long = tmp_path / "long.jsonl"
    body = "".join(f"    total = total + values[{i}] * {i}\n" for i in range(12))
    long.write_text(json.dumps({"prompt": f"def weighted(values):\n    total = 0\n{body}    return"}) + "\n")
    whole = replace(cfg, prompts=long, num_prompts=1)
    assert len(Pipeline.load(copy).encode(read_prompts(long, 1)[0])) > 2 * HELD_OUT_PROMPT_TOKENS
    a = calibrate(whole, progress=False)
    seen = lambda acc: (acc.depth_rank, acc.measured["ngram"])  # noqa: E731
    assert seen(calibrate(replace(whole, prompt_tokens=10 ** 6), progress=False)) == seen(a)
    assert seen(calibrate(replace(whole, prompt_tokens=HELD_OUT_PROMPT_TOKENS), progress=False)) != seen(a)
    assert read_prompts(prompts, 3)[2] == "x = 1"
    with pytest.raises(SpecrtError, match="has 3 prompt\\(s\\); --num-prompts asks for 4"):
        read_prompts(prompts, 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(SpecrtError, match="line 2: expected a JSON object with a \"prompt\" string"):
        read_prompts(bad, 2)
    with pytest.raises(SpecrtError, match="cannot read it"):
        read_prompts(tmp_path / "missing.jsonl", 1)


def test_ratio_interval_is_the_spread_of_the_pooled_rate_over_resampled_items():
    from specrt.calibration.acceptance import ratio_interval

    # every item at the same rate: no spread, whatever their sizes
    assert ratio_interval([2, 4, 6], [1, 2, 3]) == (2.0, 2.0)
    # the pooled rate (sums over items, not a mean of rates) lies inside; more items of the same spread narrow it
    rng = np.random.default_rng(3)
    rates, sizes = rng.uniform(1, 3, 400), rng.integers(10, 100, 400)
    few = ratio_interval(rates[:20] * sizes[:20], sizes[:20])
    many = ratio_interval(rates * sizes, sizes)
    assert few[0] < (rates[:20] * sizes[:20]).sum() / sizes[:20].sum() < few[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 2  # 20x the items: about 1/sqrt(20) the width
    lo50, hi50 = ratio_interval(rates * sizes, sizes, level=0.5)
    assert many[0] < lo50 < hi50 < many[1]
    assert ratio_interval(rates * sizes, sizes) == many  # seeded
    with pytest.raises(ValueError, match="as many numerators as denominators"):
        ratio_interval([1, 2], [1])


def test_temperature_fit_recovers_the_temperature_that_generated_the_choices():
    from specrt.calibration.acceptance import fitted_temperature, nll_by_temperature
    from specrt.contract import UNSCORED_LOGIT

    rng = np.random.default_rng(0)
    rows = rng.normal(size=(4000, 50)) * 2.0
    for t0 in (0.5, 2.0):
        x = rows / t0
        probs = np.exp(x - x.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        true = np.array([rng.choice(50, p=p) for p in probs])
        fitted = fitted_temperature(nll_by_temperature(rows, true))
        assert abs(fitted / t0 - 1) < 0.1
        # a draft whose head leaves ids unscored (contract.HEAD_VOCABULARY): the rows whose true token it cannot
        # draft are left out, not counted as a likelihood of 1e-30-odd that no temperature can move
        narrow = np.concatenate([rows, np.full((len(rows), 10), UNSCORED_LOGIT)], axis=1)
        missed = np.concatenate([true, 50 + rng.integers(0, 10, 400)])
        narrow = np.concatenate([narrow, narrow[:400]])
        nll = nll_by_temperature(narrow, missed)
        assert np.isfinite(nll).all() and nll.max() < 1e6
        np.testing.assert_allclose(nll, nll_by_temperature(rows, true))
    # no position scored at all: nothing to fit, so the draft's own logits (not the grid's first temperature, 0.1)
    assert fitted_temperature(nll_by_temperature(narrow[-400:], missed[-400:])) == 1.0

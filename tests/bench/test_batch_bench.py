"""`specrt bench batch` and what it rests on: per-request limits of new tokens and per-request latency."""

import pytest

from specrt.errors import InvalidRequestError, SpecrtError


def test_per_request_limits_and_latency(pipelines, humaneval):
    pipe = pipelines["ort"]
    outs = pipe.generate(humaneval[:3], method="sd", max_new_tokens=[3, 9, 5], batch_size=2)
    for o, cap in zip(outs, (3, 9, 5)):  # each request's own limit (or an EOS before it)
        assert len(o.token_ids) == cap if o.finish_reason == "length" else len(o.token_ids) < cap
    assert all(0 < o.stats.seconds.finished <= o.stats.seconds.total for o in outs)
    alone = [pipe.generate(p, method="autoregressive", max_new_tokens=m).token_ids for p, m in zip(humaneval[:3], (3, 9, 5))]
    assert [o.token_ids for o in outs] == alone
    with pytest.raises(InvalidRequestError, match="max_new_tokens has 2 entries for 3 prompts"):
        pipe.generate(humaneval[:3], max_new_tokens=[3, 4])
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be an integer >= 1"):
        pipe.generate(humaneval[:2], max_new_tokens=[3, 0])


def test_bench_batch_rows(demo_bundle, tmp_path):
    from specrt.bench.batch import BatchBenchConfig, run_batch
    from specrt.bench.catalog import headline

    cfg = BatchBenchConfig(bundle=demo_bundle, out=tmp_path, label="t", num_prompts=5, min_new_tokens=4,
                           max_new_tokens=12, batch_sizes=(1, 2), methods=("autoregressive", "sd"), runs=1, threads=2)
    data = run_batch(cfg)
    keys = [(r["method"], r["batch_size"], r["batching"], r["padded"]) for r in data["rows"]]
    assert keys == [("autoregressive", 1, "continuous", False), ("autoregressive", 2, "continuous", False),
                    ("autoregressive", 2, "static", False), ("sd", 1, "continuous", False),
                    ("sd", 2, "continuous", False), ("sd", 2, "static", False),
                    ("sd", 2, "continuous", True), ("sd", 2, "static", True)]
    assert all(r["same_tokens_as_ar"] for r in data["rows"])
    assert all(r["latency_p50_s"] <= r["latency_p95_s"] for r in data["rows"])
    row = data["rows"][4]
    assert row["continuous_vs_static"] == pytest.approx(row["tokens_per_s"] / data["rows"][5]["tokens_per_s"], rel=1e-2)
    padded = data["rows"][6]
    assert padded["unpadded_vs_padded"] == pytest.approx(row["tokens_per_s"] / padded["tokens_per_s"], rel=1e-2)
    assert padded["padding_ratio"] > 0 and row["padding_ratio"] == 0
    assert data["predictions"].startswith("no acceptance.json")  # the bare export has no cost model
    assert all(r["predicted_tokens_per_s"] is None for r in data["rows"])
    # accepted per round where rounds started (outputs of 4-12 tokens: one bucket); AR accepts nothing
    assert [r["accepted_by_position"] for r in data["rows"][:3]] == [[0.0]] * 3
    sd1 = data["rows"][3]
    assert len(sd1["accepted_by_position"]) == 1 and 0 < sd1["accepted_by_position"][0] <= 4
    assert sd1["tokens_per_round"] > 1 and sd1["predicted_accepted_by_position"] == []
    low, high = sd1["tokens_per_round_interval"]
    assert low <= sd1["tokens_per_round"] <= high and low < high  # 5 prompts of their own acceptance
    assert data["rows"][0]["tokens_per_round_interval"] == [1.0, 1.0]
    assert len(data["max_new_tokens_per_request"]) == 5 and (tmp_path / "batch-t.md").is_file()
    assert "| sd (padded) | 2 | static |" in (tmp_path / "batch-t.md").read_text()
    assert headline("batch", data).startswith("continuous / static batching at batch 2: `autoregressive` ")
    with pytest.raises(SpecrtError, match="method auto needs"):
        run_batch(BatchBenchConfig(bundle=demo_bundle, out=tmp_path, methods=("auto",), padded=()))


def test_batch_predictions_follow_the_workload(tmp_path):
    """The workload model: a batch that drains runs its last rounds at the smaller sizes; static batches wait for
    their slowest; prefill is paid per group of requests admitted together, as wide as its longest prompt."""
    from specrt.runtime.cost import prefill_ms
    from tests.fakes import write_latency
    from specrt.runtime.cost import workload_ms

    cost = lambda live, context: 10.0 + live  # noqa: E731  ms per round at a live batch size
    rounds = lambda new: new // 2  # noqa: E731
    requests = [(5, 4), (5, 8), (5, 2)]  # (prompt tokens, new tokens), 2 tokens per round: 2, 4, 1 rounds
    # continuous, batch 2: rounds at live 2 until the first finishes (2 rounds), then the third joins
    # (live 2 for 1 round), then the second alone (1 round)
    assert workload_ms(cost, rounds, requests, 2, "continuous", lambda *a: 0.0) == pytest.approx(2 * 12 + 12 + 11)
    # static: [0, 1] take 2 rounds at live 2 then 2 alone; [2] 1 round alone
    assert workload_ms(cost, rounds, requests, 2, "static", lambda *a: 0.0) == pytest.approx(2 * 12 + 2 * 11 + 11)
    # prefill per group admitted together (and how many sequences run beside it): static [0, 1] then [2]
    groups = []
    workload_ms(cost, rounds, requests, 2, "static", lambda lens, running: groups.append((lens, running)) or 0.0)
    assert groups == [([5, 5], 0), ([5], 0)]
    groups.clear()
    workload_ms(cost, rounds, [(3, 4), (7, 8), (9, 2)], 2, "continuous",
                lambda lens, running: groups.append((lens, running)) or 0.0)
    assert groups == [([3, 7], 0), ([9], 1)]  # the third joins the second, still running
    # each stretch of rounds at the context its longest live sequence has cached midway through it: (prompt 3, 4
    # new, 2 rounds) and (7, 8, 4) for 2 rounds: the second at 7 + 8 * 1/4; then (7, 8) with 2 rounds left and
    # (9, 2, 1 round) for 1: 7 + 8 * 5/8 beats 9 + 2 * 1/2; then (7, 8) alone for its last round: 7 + 8 * 7/8
    contexts = []
    workload_ms(lambda live, context: contexts.append((live, context)) or 0.0, rounds, [(3, 4), (7, 8), (9, 2)], 2,
                "continuous", lambda *a: 0.0)
    assert contexts == [(2, 9.0), (2, 12.0), (1, 14.0)]
    contexts.clear()  # the cache does not shrink: the short request left alone runs at the long one's 22 tokens
    workload_ms(lambda live, context: contexts.append((live, context)) or 0.0, rounds, [(20, 2), (3, 8)], 2, "static",
                lambda *a: 0.0)
    assert contexts == [(2, 21.0), (1, 22.0)]
    (tmp_path / "manifest.json").write_text("{}")
    lat = write_latency(tmp_path, lambda n: 2.0 * n, batches=(1, 2), max_tokens=8)  # 2 ms per token row
    assert prefill_ms(lat, "target", [10]) == pytest.approx(20.0)
    assert prefill_ms(lat, "target", [10, 4]) == pytest.approx(2 * 10 * 2.0)  # padded to the longest
    # a static cache prefills a joining sequence beside the running one, stepped as an empty row: two rows wide
    assert prefill_ms(lat, "target", [10], running=1) == pytest.approx(2 * 10 * 2.0)
    # joining a running batch: in a cache of their own (dynamic), in place (static), or one by one alone (an engine's
    # admission cache); with nothing running, every kind prefills the batch together
    from types import SimpleNamespace

    from specrt.runtime.cost import joining_prefill_ms

    dynamic, beside, alone = (SimpleNamespace(static_cache=s, admits_alone=a)
                              for s, a in ((False, False), (True, False), (True, True)))
    assert joining_prefill_ms(lat, "target", [10, 4], 1, dynamic) == pytest.approx(2 * 10 * 2.0)
    assert joining_prefill_ms(lat, "target", [10, 4], 1, beside) == pytest.approx(3 * 10 * 2.0)
    assert joining_prefill_ms(lat, "target", [10, 4], 1, alone) == pytest.approx((10 + 4) * 2.0)
    assert joining_prefill_ms(lat, "target", [10, 4], 0, alone) == pytest.approx(2 * 10 * 2.0)


def test_batch_predictions_price_the_running_rows_of_a_static_cache_prefill(tmp_path):
    """On engines without an admission cache (Backend.static_cache, not admits_alone) a request joining a running
    batch is prefilled beside it: the prediction pays the running rows too, where a request joins a running batch
    (continuous) and nowhere else; with one (the static backend), it pays what a cache of its own would."""
    from types import SimpleNamespace

    from specrt.bench.batch import predictor
    from tests.fakes import write_acceptance, write_latency

    (tmp_path / "manifest.json").write_text("{}")
    acc = write_acceptance(tmp_path, [[0.6, 0.2]] * 4)
    lat = write_latency(tmp_path, lambda n: 2.0 * n, batches=(1, 2), max_tokens=64)  # 2 ms per token row
    requests = [(40, 8), (40, 24), (40, 8)]  # the third joins the second, still running, at batch 2

    def predict(static: bool, batching: str, alone: bool = False) -> float:
        backend = SimpleNamespace(static_cache=static, admits_alone=alone)
        evidence = SimpleNamespace(acceptance=lambda: acc, latency=lambda: lat, has_plan=lambda: False)
        pipe = SimpleNamespace(evidence=evidence, bundle=tmp_path, target=backend, draft=backend)
        return predictor(pipe, requests)[0]("autoregressive", 2, batching)[0]

    assert predict(True, "continuous") < predict(False, "continuous") == predict(True, "continuous", alone=True)
    assert predict(True, "static") == predict(False, "static")  # each static batch starts empty

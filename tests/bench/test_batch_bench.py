"""`specrt bench batch` and what it rests on: per-request limits of new tokens and per-request latency."""

import pytest

from specrt.errors import InvalidRequestError


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
    from specrt.bench.reporting import headline

    cfg = BatchBenchConfig(bundle=demo_bundle, out=tmp_path, label="t", num_prompts=5, min_new_tokens=4,
                           max_new_tokens=12, batch_sizes=(1, 2), methods=("autoregressive", "sd"), runs=1, threads=2)
    data = run_batch(cfg)
    keys = [(r["method"], r["batch_size"], r["batching"]) for r in data["rows"]]
    assert keys == [("autoregressive", 1, "continuous"), ("autoregressive", 2, "continuous"), ("autoregressive", 2, "static"),
                    ("sd", 1, "continuous"), ("sd", 2, "continuous"), ("sd", 2, "static")]
    assert all(r["same_tokens_as_ar"] for r in data["rows"])
    assert all(r["latency_p50_s"] <= r["latency_p95_s"] for r in data["rows"])
    row = data["rows"][4]
    assert row["continuous_vs_static"] == pytest.approx(row["tokens_per_s"] / data["rows"][5]["tokens_per_s"], rel=1e-2)
    assert len(data["max_new_tokens_per_request"]) == 5 and (tmp_path / "batch-t.md").is_file()
    assert headline("batch", data).startswith("continuous / static batching at batch 2: `autoregressive` ")

"""`specrt bench serve`: clients over a real tritonserver, in process, and one request at a time, in one run (the
server files as tests/serving/test_serve.py has them; skipped, saying why, only where they cannot be installed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specrt.errors import SpecrtError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("client,route", [("http", "generate"), ("grpc", "openai")])
def test_bench_serve_measures_every_way_and_checks_every_answer(demo_bundle, tmp_path, client, route):
    from specrt.bench.catalog import headline
    from specrt.bench.serve import ServeBenchConfig, run_serve
    from specrt.serving.tritonserver import locate

    try:
        locate(ROOT / "build" / "tritonserver")
    except SpecrtError as e:
        if os.environ.get("SPECRT_REQUIRE_TRITON"):
            raise
        pytest.skip(f"no Triton server here: {e}")
    cfg = ServeBenchConfig(bundle=demo_bundle, out=tmp_path, label="t", threads=2, clients=(1, 3), requests_per_client=2,
                           num_prompts=3, max_new_tokens=12, runs=1, max_batch=4, client=client, route=route,
                           server_dir=ROOT / "build" / "tritonserver")
    data = run_serve(cfg)
    rows = {(r["way"], r["clients"]): r for r in data["rows"]}
    ways = ("served", "in-process", "served-one-at-a-time") + (("served-openai",) if route == "openai" else ())
    assert set(rows) == {(w, n) for w in ways for n in (1, 3)}
    for r in rows.values():
        assert r["failed"] == 0 and r["wrong"] == 0 and r["requests"] == 2 * r["clients"]
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
    assert rows["in-process", 3]["vs_in_process"] == 1.0
    assert rows["served", 3]["vs_one_at_a_time"] == pytest.approx(
        rows["served", 3]["tokens_per_s"] / rows["served-one-at-a-time", 3]["tokens_per_s"], rel=1e-2)
    # where the CPU goes: each way's own processes, the decode loop's work where it runs
    for (way, _), r in rows.items():
        cpu = r["cpu_ms_per_request"]
        assert set(cpu) == {"clients", "cores"} | ({"tritonserver", "decode loop"} if way != "in-process" else set()) \
            | ({"route"} if way == "served-openai" else set()), (way, cpu)
        assert all(v >= 0 for v in cpu.values()) and 0 < cpu["cores"] <= os.cpu_count() + 0.5
        assert (cpu["decode loop"] if way != "in-process" else cpu["clients"]) > 0
    md = (tmp_path / "serve-t.md").read_text()
    assert "| way | clients | clients | route | tritonserver | decode loop | total | cores busy |" in md
    assert md.startswith("### serve `t`: sd, greedy, 12 new tokens a request") and (tmp_path / "serve-t.png").is_file()
    assert headline("serve", data).startswith("3 clients over Triton: **") and "every answer right" in headline("serve", data)
    if route == "openai":  # its tokens read back from the route (return_token_ids) and checked as the others'
        assert rows["served-openai", 3]["vs_generate"] == pytest.approx(
            rows["served-openai", 3]["tokens_per_s"] / rows["served", 3]["tokens_per_s"], rel=1e-2)
        assert "the OpenAI route" in headline("serve", data)

"""bench e2e: speedups and the ANPD-vs-prompt-lookup ratio are computed from the same run's rows."""

import warnings
from dataclasses import replace

import pytest

from specrt.bench.e2e import E2EConfig, MethodResult, report
from specrt.errors import SpecrtError


def result(name, seconds, tokens=100, calls=0, outputs=None):
    return MethodResult(name, [seconds, seconds * 1.2, seconds * 0.9], tokens, calls, outputs=outputs or [[1, 2]])


def test_ngram_speedup_is_compared_with_prompt_lookup_speedup(tmp_path):
    results = {r.name: r for r in [result("autoregressive", 1.0, calls=100), result("anpd", 0.5, calls=40),
                                   result("anpd-hw", 0.4, calls=30), result("sd", 0.6, calls=35),
                                   result("hf", 4.0), result("hf-lookup", 2.5, outputs=[[1, 3]])]}
    data = report(E2EConfig(bundle=tmp_path, out=tmp_path, label="t"), results)
    # anpd 2.0x our AR, prompt lookup 1.6x HF generate: 1.25; the tree 2.5x: 1.5625; sd is no n-gram method
    assert data["summary"]["ngram_speedup_over_hf_lookup_speedup"] == {"anpd": 1.25, "anpd-hw": 1.562}
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["anpd"]["tokens_per_target_call"] == 2.5 and rows["hf-lookup"]["same_tokens_as_ours_ar"] == 0.0
    assert "anpd 1.25x, anpd-hw 1.56x" in (tmp_path / "e2e-t.md").read_text()


def test_demo_runs_hardware_aware_rows_only_on_a_profiled_bundle(tmp_path):
    from specrt.bench.demo import demo_methods
    from specrt.bench.e2e import OURS

    assert "anpd-hw" in OURS and "anpd-hw" not in demo_methods(tmp_path)
    assert set(OURS) - set(demo_methods(tmp_path)) == {"anpd-hw"}
    (tmp_path / "latency.json").write_text("{}")
    assert demo_methods(tmp_path) == OURS


def test_timed_passes_interleave_every_config_in_a_new_order_each():
    from specrt.bench.report import timed_runs

    calls = []
    configs = {name: (lambda name=name: calls.append(name) or name.upper()) for name in "abcdefgh"}
    seconds, last = timed_runs(configs, 3, 1, "t")
    assert calls[:8] == list("abcdefgh")  # the untimed pass in the given order
    passes = [calls[8 * i:8 * (i + 1)] for i in range(1, 4)]
    assert all(sorted(p) == list("abcdefgh") for p in passes) and len({tuple(p) for p in passes}) == 3
    assert all(len(s) == 3 for s in seconds.values()) and last == {n: n.upper() for n in "abcdefgh"}


def test_after_each_timed_pass_but_the_last_what_was_measured_is_handed_on():
    from specrt.bench.report import timed_runs

    seen = []
    configs = {name: (lambda name=name: name) for name in "ab"}
    timed_runs(configs, 3, 1, "t", on_pass=lambda seconds, last: seen.append(({k: len(v) for k, v in seconds.items()},
                                                                             dict(last))))
    assert seen == [({"a": 1, "b": 1}, {"a": "a", "b": "b"}), ({"a": 2, "b": 2}, {"a": "a", "b": "b"})]


def test_a_run_leaves_its_rows_after_each_timed_pass(demo_bundle, tmp_path, monkeypatch):
    """A bench cut off (a lent GPU's budget) keeps what it measured: the report is written after the first of two
    timed passes, marked partial, and again, whole, at the end."""
    import specrt.bench.e2e as e2e

    written = []
    monkeypatch.setattr(e2e, "write_report", lambda stem, data, md, plot: written.append((data, md(data))))
    cfg = E2EConfig(bundle=demo_bundle, out=tmp_path, label="t", num_prompts=1, max_new_tokens=8, runs=2,
                    warmup_runs=0, methods=("autoregressive", "sd"), baselines=(), threads=1)
    e2e.run_e2e(cfg)
    (first, first_md), (last, _) = written
    assert first["partial"] == "1 of 2 timed runs" and "- partial: 1 of 2 timed runs" in first_md
    assert [len(r["runs_s"]) for r in first["rows"]] == [1, 1] and "partial" not in last
    assert [len(r["runs_s"]) for r in last["rows"]] == [2, 2] and last["rows"][1]["same_tokens_as_ours_ar"] == 1
    for r in last["rows"]:  # one prompt: its time to first token and its decode fit in the slowest pass
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0, r
        assert r["ttft_ms"] + r["tpot_ms"] * (r["tokens"] - 1) <= 1e3 * max(r["runs_s"]) * 1.01, r
    assert "| TTFT ms | TPOT ms |" in written[-1][1]


def test_a_run_interleaves_the_rows_prompt_by_prompt_and_joins_each_rows_prompts(demo_bundle, tmp_path, monkeypatch):
    """Drift on a shared machine falls on every row alike: each runner decodes one prompt per call, and a run's
    (row, prompt) calls come in a new random order; a row's run is its prompts' outputs, in prompt order, and their
    seconds summed."""
    import specrt.bench.e2e as e2e
    from specrt.bench.decoded import Decoded
    from specrt.bench.prompts import humaneval_prompts

    prompts, calls = humaneval_prompts(3), []

    def runner(name):
        def run(given):
            assert len(given) == 1
            i = prompts.index(given[0])
            calls.append((name, i))
            return Decoded([[i, i + 1]], first_s=(0.001,), decode_s=(0.002,))
        return run

    monkeypatch.setattr(e2e, "build_runners", lambda cfg, pipe: ({n: runner(n) for n in "xy"}, {}))
    bandwidths = iter([50e9, 40e9])  # the machine's memory slower after the runs than before
    monkeypatch.setattr("specrt.calibration.latency.copy_bandwidth", lambda *a: next(bandwidths))
    cfg = E2EConfig(bundle=demo_bundle, out=tmp_path, label="t", num_prompts=3, runs=2, warmup_runs=1, baselines=(),
                    threads=1)
    data = e2e.run_e2e(cfg)
    assert data["roofline"]["copy_bandwidth_gb_s"] == 50.0 and data["roofline"]["copy_bandwidth_gb_s_after"] == 40.0
    assert "copy bandwidth 50.0 GB/s before the runs, 40.0 GB/s after the runs" in (tmp_path / "e2e-t.md").read_text()
    runs = [calls[6 * r:6 * (r + 1)] for r in range(3)]
    assert all(sorted(run) == [(n, i) for n in "xy" for i in range(3)] for run in runs)
    grouped = (list("xxxyyy"), list("yyyxxx"))
    assert runs[1] != runs[2] and any([n for n, _ in run] not in grouped for run in runs[1:])  # rows mixed in a run
    for row in data["rows"]:
        assert row["tokens"] == 6 and len(row["runs_s"]) == 2 and row["ttft_ms"] == 1.0 and row["tpot_ms"] == 2.0
    pages = data["roofline"]["huge_pages"]  # what went into huge pages, or why nothing did (huge_pages.py)
    assert pages.endswith(" MiB") or pages == "no region to collapse" or pages.startswith("the kernel refused")
    assert f"our target's weights in huge pages: {pages}" in (tmp_path / "e2e-t.md").read_text()


def test_a_run_says_when_its_latency_profile_was_measured_in_another_state_of_the_machine():
    from types import SimpleNamespace

    from specrt.calibration.latency import profiled_bandwidth
    from specrt.errors import BundleError

    def pipe(bandwidth):
        def latency():
            if bandwidth is None:
                raise BundleError("no latency.json")
            return SimpleNamespace(copy_bandwidth=bandwidth)
        return SimpleNamespace(evidence=SimpleNamespace(latency=latency))

    assert profiled_bandwidth(pipe(None), 50e9) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profiled_bandwidth(pipe(45e9), 50e9) == 45.0  # within a quarter: no warning
    with pytest.warns(RuntimeWarning, match="measured at 26.4 GB/s of copy bandwidth, this run's at 55.4"):
        assert profiled_bandwidth(pipe(26.4e9), 55.4e9) == 26.4


def test_the_prompts_can_start_past_the_first_of_the_set(demo_bundle, tmp_path, monkeypatch):
    import specrt.bench.e2e as e2e
    from specrt.bench.decoded import Decoded
    from specrt.bench.prompts import humaneval_prompts

    given = []

    def run(prompts):
        given.extend(prompts)
        return Decoded([[1, 2]], first_s=(0.001,), decode_s=(0.002,))

    monkeypatch.setattr(e2e, "build_runners", lambda cfg, pipe: ({"x": run}, {}))
    cfg = E2EConfig(bundle=demo_bundle, out=tmp_path, label="t", num_prompts=2, first_prompt=3, runs=1, warmup_runs=0,
                    baselines=(), threads=1)
    e2e.run_e2e(cfg)
    assert set(given) == set(humaneval_prompts(5)[3:])  # prompts 3 and 4
    assert "2 HumanEval prompts (from prompt 3)," in (tmp_path / "e2e-t.md").read_text()
    with pytest.raises(SpecrtError, match="asked for 2 HumanEval prompts from 163; there are 164"):
        e2e.run_e2e(replace(cfg, first_prompt=163))


def test_time_to_first_token_and_per_output_token_of_a_pass():
    from specrt.bench.decoded import Decoded, PromptClock, latencies, timed

    d = Decoded([[1, 2, 3], [4], [5, 6]], first_s=(0.010, 0.030, 0.020), decode_s=(0.004, 0.0, 0.002))
    ttft, tpot = latencies(d)
    assert ttft == 20.0 and abs(tpot - 2.0) < 1e-9  # 6 ms over the 3 tokens after each first
    assert latencies(Decoded([[1]])) == (None, None)  # a runner that timed nothing

    def one(p, clock):
        if p:
            clock.token()
            clock.token()  # only the first counts
        return [1] * p

    outs, first, rest = timed([2, 0], one)
    assert outs == [[1, 1], []] and len(first) == len(rest) == 2
    assert rest[1] == 0.0 and first[1] >= 0  # no new token: all of it counts as waiting for the first
    clock = PromptClock()
    clock.token()
    a, b = clock.done()
    assert a >= 0 and b >= 0


def test_peer_rows_are_compared_with_ours_but_never_counted_as_ours(tmp_path):
    """A peer's speculative row may be the fastest lossless row of a run: it is compared with our best, not taken
    for it."""
    from specrt.bench.e2e import headline

    cfg = E2EConfig(out=tmp_path, label="peers")
    ar = [[1, 2, 3, 4]]
    data = report(cfg, {r.name: r for r in [result("autoregressive", 4.0, 400, 400, ar), result("sd", 2.0, 400, 150, ar),
                                            result("ort-genai (fp32)", 3.0, 400, 0, ar),
                                            result("ort-genai-ngram (fp32)", 1.0, 400, 0, ar)]})
    peer = data["summary"]["peers"]["ort-genai"]
    assert (peer["ar"], peer["best"], peer["ours"]) == ("ort-genai (fp32)", "ort-genai-ngram (fp32)",
                                                        {"ar": "autoregressive", "best": "sd"})
    assert peer["our_ar_vs_its_ar"] == 0.75 and peer["our_best_vs_its_best"] == 0.5
    text = headline(data)
    assert text.startswith("best lossless `sd` **2.00x** our AR")
    assert "0.50x ONNX Runtime GenAI's best speculative, our AR 0.75x its AR" in text
    alone = report(cfg, {r.name: r for r in [result("autoregressive", 4.0, 400, 400, ar),
                                             result("ort-genai (fp32)", 3.0, 400, 0, ar)]})
    assert headline(alone) == "our AR alone: 0.75x ONNX Runtime GenAI's AR"


def test_ratios_pair_each_timed_run_so_a_slow_spell_of_one_row_does_not_decide_them(tmp_path):
    """Rows are interleaved within a run, so a ratio is taken within each run and its median over runs reported: one
    run in which our row alone met a slow spell (3.0 s where the peer took 1.8) does not make it the slower row."""
    from specrt.bench.report import paired_ratio, runs_rate

    assert paired_ratio([1.0, 3.0, 2.0], [1.1, 1.8, 2.2]) == pytest.approx(1 / 1.1)
    assert paired_ratio(runs_rate([1.0, 3.0, 2.0], 100), runs_rate([1.1, 1.8, 2.2], 100)) == pytest.approx(1.1)
    assert runs_rate([2.0], 200) == [100.0]
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
    ar = [[1, 2]]
    rows = [MethodResult("autoregressive", [1.0, 3.0, 2.0], 100, 100, outputs=ar),
            MethodResult("sd", [0.5, 1.0, 1.0], 100, 40, outputs=ar),
            MethodResult("llama-cpp (f32)", [1.1, 1.8, 2.2], 100, 0, outputs=ar)]
    data = report(E2EConfig(out=tmp_path, label="paired"), {r.name: r for r in rows})
    by = {r["method"]: r for r in data["rows"]}
    assert by["llama-cpp (f32)"]["tokens_per_s"] > by["autoregressive"]["tokens_per_s"]  # its median run is faster
    assert by["llama-cpp (f32)"]["speedup_vs_ours_ar"] == pytest.approx(1 / 1.1, abs=1e-3)  # ... but not run by run
    assert by["sd"]["speedup_vs_ours_ar"] == 2.0
    assert data["summary"]["peers"]["llama-cpp"]["our_ar_vs_its_ar"] == pytest.approx(1.1)


def test_our_rows_say_where_their_time_goes(demo_bundle, tmp_path):
    """Each of our rows splits its last timed run's wall time into prefill, target steps, draft model steps, host
    work in the rounds and the rest: shares that add up to the whole, a draft model's only where one drafts."""
    from specrt.bench.e2e import run_e2e

    cfg = E2EConfig(bundle=demo_bundle, threads=2, num_prompts=2, max_new_tokens=24, runs=1, warmup_runs=0,
                    methods=("autoregressive", "sd", "anpd"), num_draft_tokens=(4,), baselines=(), out=tmp_path,
                    label="where")
    rows = {r["method"]: r for r in run_e2e(cfg)["rows"]}
    for r in rows.values():
        shares = r["time_shares"]
        assert set(shares) == {"prefill", "target", "draft_model", "host", "other"}
        assert all(v >= 0 for v in shares.values()) and sum(shares.values()) == pytest.approx(1, abs=0.01), shares
        assert shares["target"] > shares["host"] and r["host_fraction"] == shares["host"]
        assert r["target_step_ms"] > 0 and r["rows_per_step"] >= r["tokens_per_target_call"] >= 1
    assert rows["autoregressive"]["rows_per_step"] == 1 and rows["autoregressive"]["time_shares"]["draft_model"] == 0
    assert rows["sd"]["time_shares"]["draft_model"] > 0 and 1 < rows["sd"]["rows_per_step"] <= 5
    assert rows["anpd"]["time_shares"]["draft_model"] == 0  # n-gram drafts: no model
    md = (tmp_path / "e2e-where.md").read_text()
    table = md[md.index("Where the time goes"):]
    assert "| prefill | target steps | draft model | host | outside rounds |" in table
    assert all(f"| {m} | " in table for m in rows)


def test_a_gpu_run_names_its_engines_compile_and_puts_our_ar_beside_hfs_compiled_generate(tmp_path):
    """Issue 57's baseline: HF's static-cache compiled generate, in the same run as our AR on compiled engines."""
    from specrt.bench.e2e import headline

    ar = [[1, 2, 3, 4]]
    roofline = {"device": "NVIDIA H200", "weight_bytes": 12e9, "copy_bandwidth_gb_s": 4200.0, "ms_per_token": 2.857,
                "tokens_per_s": 350.0, "energy": "NVML", "compiled": "tuned"}
    data = report(E2EConfig(out=tmp_path, label="gpu"), {r.name: r for r in [
        result("autoregressive", 2.0, 400, 400, ar), result("anpd", 1.0, 400, 180, ar),
        result("hf-compile", 2.6, 400, 0, ar)]}, roofline=roofline)
    assert "backend ort (layers compiled: tuned), NVIDIA H200" in (tmp_path / "e2e-gpu.md").read_text()
    assert "our AR 1.30x HF's static-cache compiled `generate`" in headline(data)

"""`specrt quantize`: 8-bit (and 4-bit) variants of the step graphs for ONNX Runtime, run with quant=...
A quantized target is a different model: lossless methods must be token-identical to greedy autoregressive
decoding of the same quantized target, which needs every row of a step computed on its own."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import LatencyProfile, QuantSet
from specrt.errors import BundleError, InvalidRequestError, SpecrtError

SCHEMES = ("int8-weights", "int4-weights", "dynamic-int8", "static-int8", "int8-qdq", "fp8-qdq")


@pytest.fixture(scope="module")
def quant_bundle(demo_bundle, tmp_path_factory):
    from specrt.engines.quantize import QuantizeConfig, quantize

    b = tmp_path_factory.mktemp("quant") / "b"
    shutil.copytree(demo_bundle, b)
    for scheme in SCHEMES:
        quantize(QuantizeConfig(bundle=b, scheme=scheme, calibration_prompts=4, prompt_tokens=64), progress=False)
    return b


def test_every_scheme_is_recorded_with_what_it_was_made_from(quant_bundle):
    from specrt.bundle.manifest import sha256_file

    q = artifacts.load(quant_bundle, QuantSet)
    assert sorted(q.variants) == sorted(SCHEMES)  # a later scheme keeps the earlier ones
    m = json.loads((quant_bundle / "manifest.json").read_text())
    for scheme, roles in q.variants.items():
        for role, v in roles.items():
            assert v.file == f"quant/{scheme}/{role}.onnx" and sha256_file(quant_bundle / v.file) == v.sha256
            assert v.source_sha256 == m["files"][f"{role}.onnx"]
            assert v.bytes < v.source_bytes
            # the projections, MLP and head: 7 per layer + 1; the rotary products stay float
            assert v.quantized_nodes == 7 * m["models"][role]["num_layers"] + 1
            assert (v.calibration is not None) == (scheme in ("static-int8", "int8-qdq", "fp8-qdq"))
    assert q.variants["static-int8"]["target"].calibration["prompts"] == 4
    assert q.variants["int4-weights"]["target"].bytes < q.variants["int8-weights"]["target"].bytes


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_row_of_a_quantized_step_is_computed_on_its_own(quant_bundle, scheme):
    """What losslessness needs: a token's logits do not depend on the other tokens of its step."""
    import onnxruntime as ort

    s = ort.InferenceSession(str(quant_bundle / f"quant/{scheme}/target.onnx"), providers=["CPUExecutionProvider"])
    feeds = text_feeds(quant_bundle, np.random.default_rng(0), 1, 6, 20)
    full = s.run(None, feeds)[0]
    one = dict(feeds, input_ids=feeds["input_ids"][:, :1], position_ids=feeds["position_ids"][:, :1],
               attention_mask=feeds["attention_mask"][:, :1, :21])
    assert np.abs(s.run(None, one)[0][0, 0] - full[0, 0]).max() < 1e-4


@pytest.mark.parametrize("scheme", ["int8-weights", "int4-weights"])
def test_merged_weight_only_projections_compute_what_the_variant_does(quant_bundle, scheme):
    """The ort backend's load-time merge of MatMulNBits nodes that read one input (q, k, v; gate, up): their packed
    weights, scales and zero points joined on N, the outputs split back."""
    import onnx
    import onnxruntime as ort

    from specrt.graphs.parity import PARITY_TOL
    from specrt.graphs.ort_fusions import fuse_projections

    m = json.loads((quant_bundle / "manifest.json").read_text())["models"]["target"]
    model = onnx.load(str(quant_bundle / f"quant/{scheme}/target.onnx"))
    before = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert fuse_projections(model, quant_bundle / "quant" / scheme, inline=True) == (3 * m["num_layers"], {})
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == before - 3 * m["num_layers"]
    merged = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = text_feeds(quant_bundle, np.random.default_rng(1), 2, 5, 12)
    for want, got in zip(plain.run(None, feeds), merged.run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=0, atol=PARITY_TOL["float32"])


def text_feeds(bundle, rng, batch: int, num_tokens: int, capacity: int) -> dict:
    """A step's feeds from real text, the cache holding the target's own K/V (graphs.parity.real_feeds)."""
    from specrt.graphs.parity import real_feeds, text_tokens
    from specrt.model.checkpoint import load_checkpoint, load_tokenizer
    from specrt.model.step import StepModule

    module = StepModule(load_checkpoint(bundle / "hf/target")).eval()
    tokens = text_tokens(load_tokenizer(bundle / "tokenizer"), module.hf.config.vocab_size)
    return real_feeds(module, tokens, rng, (module.num_layers, module.num_kv_heads, module.head_dim), batch,
                      num_tokens, capacity)


def _matmul_graph(w: np.ndarray, opset: int):
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", w.shape[0]])
    ys = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["B", "T", w.shape[1]]) for i in range(2)]
    nodes = [helper.make_node("MatMul", ["x", "w"], [f"y{i}"], name="ab"[i]) for i in range(2)]
    graph = helper.make_graph(nodes, "g", [x], ys, [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [17, 18])
def test_dynamic_int8_quantizes_each_row_by_its_own_range(opset):
    """What dynamic-int8 computes, against numpy: a scale per row of x (127 levels a side) and per column of w (63);
    an input two MatMuls share is quantized once; a row of zeros stays zeros (no NaN)."""
    import onnxruntime as ort

    from specrt.graphs.quantize import quantize_rows

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    w[:, 3] = 0  # a column of zeros
    model = _matmul_graph(w, opset)
    quantize_rows(model, ["a", "b"])
    assert [n.op_type for n in model.graph.node].count("ReduceMax") == 1
    assert [n.op_type for n in model.graph.node].count("MatMulInteger") == 2
    assert "w" not in {t.name for t in model.graph.initializer}  # the float weight is gone
    x = rng.standard_normal((2, 3, 64)).astype(np.float32) * np.array([1, 100, 0.01], np.float32)[:, None]
    x[1, 2] = 0
    y0, y1 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    ws = np.abs(w).max(0) / 63
    ws[3] = 1e-30 / 63
    xs = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30) / 127
    expect = (np.round(x / xs) @ np.round(w / ws)) * ws * xs
    assert np.array_equal(y0, y1) and np.isfinite(y0).all() and (y0[1, 2] == 0).all()
    np.testing.assert_allclose(y0, expect, rtol=1e-5, atol=1e-6 * np.abs(expect).max())
    exact = x @ w  # and close to the float product, row by row, at any row's scale
    assert (np.abs(y0 - exact).max(-1) <= 0.03 * np.abs(exact).max(-1) + 1e-6).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lossless_methods_on_a_quantized_pair_equal_its_autoregressive(quant_bundle, scheme, humaneval, pipelines):
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(quant_bundle, threads=2, quant=scheme)
    assert pipe.machine.quant == scheme and "--quant " + scheme in pipe.machine.flags()
    prompts = humaneval[:6]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=24)]
    fp32 = [o.token_ids for o in pipelines["ort"].generate(prompts, method="autoregressive", max_new_tokens=24)]
    assert ar != fp32  # it is another model
    for kw in (dict(method="sd"), dict(method="tree"), dict(method="dynamic", num_draft_tokens=6),
               dict(method="anpd"), dict(method="sd", ngram_tokens=5)):
        got = pipe.generate(prompts, max_new_tokens=24, batch_size=3, **kw)
        assert [o.token_ids for o in got] == ar, kw


def test_quantized_variants_are_refused_where_they_cannot_run(quant_bundle, fp16_bundle, tmp_path):
    from specrt.engines.quantize import QuantizeConfig, quantize
    from specrt.runtime.pipeline import Pipeline

    with pytest.raises(InvalidRequestError, match="the torch backend quantizes its projections with int8-wo or fp8; `specrt quantize`'s variants"):
        Pipeline.load(quant_bundle, backend="torch", device="cpu", quant="int8-weights")
    b = tmp_path / "b"
    shutil.copytree(quant_bundle, b)
    q = artifacts.load(b, QuantSet)
    artifacts.save(b, QuantSet(stamp=q.stamp, variants={"int8-weights": q.variants["int8-weights"]}))
    with pytest.raises(BundleError, match="has no static-int8 variant \\(it has: int8-weights\\): run `specrt quantize "
                                          "--bundle .* --scheme static-int8`"):
        Pipeline.load(b, quant="static-int8")
    (b / "quant/int8-weights/draft.onnx").write_bytes(b"changed")
    with pytest.raises(BundleError, match="draft.onnx is missing or changed since `specrt quantize` wrote it"):
        Pipeline.load(b, quant="int8-weights")
    with pytest.raises(SpecrtError, match="exported in float16: quantize a float32 export"):
        quantize(QuantizeConfig(bundle=fp16_bundle), progress=False)


def test_a_latency_profile_of_a_quantized_pair_is_not_one_of_the_exported_pair(quant_bundle):
    from specrt.bundle.machine import Machine

    fp32, q = Machine.here("ort", 2), Machine.here("ort", 2, quant="int8-weights")
    assert fp32 != q and "int8-weights step graphs" in q.describe()


def test_bench_quant_reports_every_variant_against_the_exported_pair(quant_bundle, tmp_path):
    from specrt.bench.catalog import bench_results, bench_section, headline
    from specrt.bench.quant import QuantBenchConfig, markdown, run_quant

    cfg = QuantBenchConfig(bundle=quant_bundle, out=tmp_path, label="t", num_prompts=1, max_new_tokens=16, runs=1,
                           quality_prompts=2, quality_tokens=16, threads=2, schemes=("int8-weights", "int4-weights"),
                           reference_dtypes=("bfloat16",))
    data = run_quant(cfg)
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["exported", "int8-weights", "int4-weights"]
    exported = rows["exported"]
    assert exported["perplexity_delta"] == 0 and exported["greedy_agreement"] == 1.0
    assert exported["methods"]["autoregressive"]["vs_exported_ar"] == 1.0
    assert rows["int4-weights"]["target_mb"] < rows["int8-weights"]["target_mb"] < exported["target_mb"]
    for r in rows.values():
        assert r["best"] in cfg.methods and r["methods"]["sd"]["tokens_per_target_call"] > 1
        assert 0 <= r["greedy_agreement"] <= 1 and r["perplexity"] > 1
    for r in [rows["int4-weights"], *data["references"]]:  # agreements against the exported target, with intervals
        for key in ("top1", "greedy"):
            lo, hi = r[f"{key}_interval"]
            assert 0 <= lo <= r[f"{key}_agreement"] <= hi <= 1
        assert len(r["first_divergence"]) == 2 and all(0 <= i <= 16 for i in r["first_divergence"])
        assert (min(r["first_divergence"]) == 16) == (r["greedy_agreement"] == 1)
    bf16, = data["references"]  # the exported target in bfloat16: the same model up to rounding
    assert bf16["dtype"] == "bfloat16" and abs(bf16["perplexity_delta"]) < 0.05 and bf16["top1_agreement"] > 0.8
    assert "| bfloat16 |" in markdown(data) and "Where each greedy continuation first leaves" in markdown(data)
    assert {(d["draft"], d["method"]) for d in data["drafts"]} == {(s, m) for s in cfg.schemes
                                                                  for m in ("sd", "dynamic-ngram")}
    assert "| int4-weights |" in "\n".join(bench_section(bench_results(tmp_path)[0], tmp_path))
    assert "`int4-weights`: AR " in headline("quant", data)


def test_histogram_calibration_is_recorded_and_stays_lossless(demo_bundle, tmp_path, humaneval):
    from specrt.engines.quantize import QuantizeConfig, quantize
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    q = quantize(QuantizeConfig(bundle=b, scheme="static-int8", model="target", calibration_method="percentile",
                                calibration_prompts=4, prompt_tokens=64), progress=False)
    assert q.variants["static-int8"]["target"].calibration["method"] == "percentile"
    pipe = Pipeline.load(b, threads=2, quant="static-int8")
    ar = pipe.generate(humaneval[:2], max_new_tokens=12)
    assert [g.token_ids for g in pipe.generate(humaneval[:2], method="sd", max_new_tokens=12)] == [g.token_ids for g in ar]


def test_an_acceptance_measured_on_one_variant_is_refused_by_another(quant_bundle, tmp_path):
    from specrt.runtime.pipeline import Pipeline
    from tests.fakes import write_acceptance

    b = tmp_path / "b"
    shutil.copytree(quant_bundle, b)
    write_acceptance(b, [[0.5, 0.2]], quant="int4-weights")  # lies beside the variant's graphs
    assert (b / "quant/int4-weights/acceptance.json").is_file() and not (b / "acceptance.json").exists()
    assert Pipeline.load(b, threads=2, quant="int4-weights").evidence.acceptance().config["quant"] == "int4-weights"
    with pytest.raises(BundleError, match=r"no quant/int8-weights/acceptance.json in .*: run `specrt calibrate "
                                          r"--bundle .* --quant int8-weights` first"):
        Pipeline.load(b, threads=2, quant="int8-weights").evidence.acceptance()
    acc = write_acceptance(b, [[0.5, 0.2]])
    artifacts.save(b, replace(acc, config={"quant": "int4-weights"}))  # one measured before variants had places
    with pytest.raises(BundleError, match="measured on the int4-weights variant, this pipeline runs the exported step "
                                          "graphs: re-run `specrt calibrate --bundle .*`"):
        Pipeline.load(b, threads=2).evidence.acceptance()


def _variant_evidence(bundle, variant_ms: float, threads: int = 2):
    """The exported pair at 10 ms a target step, variant int8-weights at `variant_ms`, the same acceptance."""
    from specrt.bundle.machine import Machine
    from tests.fakes import write_acceptance, write_latency

    for quant, ms in ((None, 10.0), ("int8-weights", variant_ms)):
        write_acceptance(bundle, [[0.6, 0.2]] * 4, quant=quant)
        write_latency(bundle, lambda n, ms=ms: ms * (1 + 0.01 * n), batches=(1, 2),
                      machine=Machine.here("ort", threads if quant else 2, quant=quant))


def test_tune_weighs_variants_and_auto_runs_the_one_the_plan_picked(quant_bundle, tmp_path, humaneval):
    from specrt.calibration.tune import TuneConfig, describe_plan, tune
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(quant_bundle, b)
    _variant_evidence(b, variant_ms=4.0)
    assert (b / "latency.json").is_file() and (b / "quant/int8-weights/latency.json").is_file()
    only = tune(TuneConfig(bundle=b, batch_sizes=(1, 2)))  # default: the exported graphs alone
    assert only.quant is None and list(only.variants) == ["exported"]
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1, 2), variants=("exported", "int8-weights")))
    assert plan.quant == "int8-weights" and plan.stamp.machine.quant == "int8-weights"
    assert set(plan.stamp.inputs) == {"acceptance.json", "latency.json", "quant/int8-weights/acceptance.json",
                                      "quant/int8-weights/latency.json"}
    for batch in (1, 2):  # same acceptance, 2.5x cheaper target steps (the draft's cost is the same)
        assert 2.0 < plan.variants["int8-weights"][batch] / plan.variants["exported"][batch] <= 2.5
    assert describe_plan(plan).startswith("variant: int8-weights (predicted tokens/s by batch size: exported ")
    from specrt.bench.report_sections import recommendation
    from specrt.bench.reporting import collect

    facts = collect(b)  # the report shows the picked variant's evidence and says which it picked
    assert facts["plan"]["quant"] == "int8-weights" and facts["machine"]["quant"] == "int8-weights"
    assert "the plan picked **int8-weights** (load with `--quant int8-weights`)" in "\n".join(recommendation(facts))
    assert facts["plan"]["command"].endswith("--variants exported,int8-weights")
    pipe = Pipeline.load(b, threads=2, quant="plan")
    assert pipe.machine.quant == "int8-weights"
    prompts = humaneval[:3]
    auto = pipe.generate(prompts, method="auto", max_new_tokens=12)
    assert [g.token_ids for g in auto] == [g.token_ids for g in pipe.generate(prompts, max_new_tokens=12)]
    # the exported graphs were weighed too: loaded without the variant, `auto` runs their own plan
    exported = Pipeline.load(b, threads=2)
    own = exported.evidence.plan()
    assert own.quant is None and own.variants is None and set(own.stamp.inputs) == {"acceptance.json", "latency.json"}
    assert [g.token_ids for g in exported.generate(prompts[:1], method="auto", max_new_tokens=8)] == \
        [g.token_ids for g in exported.generate(prompts[:1], max_new_tokens=8)]
    status = dict(artifacts.status(b, exported.machine))  # `specrt inspect`: the pick is fine, and not the one run
    assert status["plan.json"] == ("ok: picked the int8-weights variant (quant='plan' runs it); this machine runs the "
                                   "exported step graphs, on plans/exported.json")
    assert status["plans/exported.json"] == "ok"
    assert dict(artifacts.status(b, pipe.machine))["plan.json"] == "ok"
    (b / "plans/exported.json").unlink()  # with no plan of its own, the pick is refused for it, saying what to load
    with pytest.raises(BundleError, match="picked the int8-weights variant, this pipeline runs the exported step "
                                          r"graphs: load with quant='int8-weights' \(--quant int8-weights\) or "
                                          "quant='plan'"):
        Pipeline.load(b, threads=2).generate(prompts[:1], method="auto", max_new_tokens=4)
    _variant_evidence(b, variant_ms=4.5)  # the variant's evidence changed: the plan is stale
    with pytest.raises(BundleError, match="made from an earlier (quant/int8-weights/)?(acceptance|latency).json"):
        pipe.evidence.plan()


def test_gap_shift_bounds_how_far_8bit_weights_move_a_gap_between_two_tokens(quant_bundle, humaneval):
    from specrt.bench.quality import gap_shift
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.step_inputs import sequence_logits

    floats, q8 = (Pipeline.load(quant_bundle, threads=2, quant=q) for q in (None, "int8-weights"))
    ids = [floats.encode(p) for p in humaneval[:2]]
    outs = [g.token_ids for g in floats.generate(humaneval[:2], max_new_tokens=10)]
    assert gap_shift(floats, floats, ids, outs) == 0.0  # the same computation moves nothing
    shift = gap_shift(floats, q8, ids, outs)
    assert shift > 1e-3
    seq = np.asarray(ids[0] + outs[0][:-1], dtype=np.int64)
    rows = []
    for pipe in (floats, q8):
        with pipe.target.runner() as runner:
            rows.append(sequence_logits(runner, seq)[len(ids[0]) - 1:])
    top2 = np.argsort(rows[0], axis=-1)[:, -2:]  # every position's gap between the float graphs' top two tokens
    gaps = [np.take_along_axis(r, top2, axis=-1) @ np.array([-1.0, 1.0]) for r in rows]
    assert np.abs(gaps[1] - gaps[0]).max() <= shift + 1e-6
    assert np.abs(gaps[1] - gaps[0]).max() > 0


def test_e2e_judges_a_quantized_peers_other_tokens_against_what_8bit_weights_move(quant_bundle, tmp_path,
                                                                                   monkeypatch):
    """A peer quantizing the weights its own way (llama.cpp's Q8_0) may take another token where our int8 variant's
    gap is small: e2e measures how far 8-bit weights move this target's gaps and says whether the difference is
    within it. The peer here is ours with one token changed (llama.cpp's build is not in CI)."""
    import specrt.bench.e2e as e2e
    from specrt.bench.decoded import Decoded, timed

    def peer_runners(cfg, pipe, names):
        def one(prompt, clock):
            out = list(pipe.generate([prompt], max_new_tokens=cfg.max_new_tokens)[0].token_ids)
            out[2] = (out[2] + 1) % pipe.target.entry.vocab_size  # another token at the third position
            for _ in out:
                clock.token()
            return out

        def run(prompts):
            outs, first_s, decode_s = timed(prompts, one)
            return Decoded(outs, first_s=first_s, decode_s=decode_s)

        return {"llama-cpp (Q8_0)": run}, {}

    monkeypatch.setattr(e2e, "peer_runners", peer_runners)
    cfg = e2e.E2EConfig(bundle=quant_bundle, threads=2, quant="int8-weights", num_prompts=2, max_new_tokens=8, runs=1,
                        warmup_runs=0, methods=("autoregressive",), baselines=("llama-cpp",), out=tmp_path, label="q")
    data = e2e.run_e2e(cfg)
    div = next(r for r in data["rows"] if r["method"] == "llama-cpp (Q8_0)")["divergence"]
    assert div["requests"] == 2 and div["other_weights"] == "Q8_0" and div["ours"] == "int8-weights"
    assert div["quant_shift"] > 1e-3 and div["quant_ties"] is (div["max_gap"] <= div["quant_shift"])
    assert "8-bit weights move this target's logit gaps by up to" in (tmp_path / "e2e-q.md").read_text()


def test_tuning_one_variant_keeps_the_plan_tuned_for_another(quant_bundle, tmp_path):
    """`make bench-peers` tunes the exported graphs, `make bench-peers-int8` the int8 twin alone: plan.json is then
    the twin's, and a pipeline of the exported graphs still runs `auto` on the plan tuned for them."""
    from specrt.bundle.artifacts import Plan, VariantPlan
    from specrt.calibration.tune import TuneConfig, tune
    from specrt.runtime.pipeline import Pipeline
    from tests.fakes import write_latency

    b = tmp_path / "b"
    shutil.copytree(quant_bundle, b)
    _variant_evidence(b, variant_ms=4.0)
    first = tune(TuneConfig(bundle=b, batch_sizes=(1, 2)))
    second = tune(TuneConfig(bundle=b, batch_sizes=(1, 2), variants=("int8-weights",)))
    assert first.quant is None and second.quant == "int8-weights"
    assert artifacts.load(b, Plan, here=False).quant == "int8-weights"
    assert sorted(p.name for p in (b / "plans").iterdir()) == ["exported.json", "int8-weights.json"]
    kept = Pipeline.load(b, threads=2).evidence.plan()
    assert isinstance(kept, VariantPlan) and kept.choices == first.choices
    assert kept.stamp.inputs == first.stamp.inputs
    assert Pipeline.load(b, threads=2, quant="int8-weights").evidence.plan().choices == second.choices
    write_latency(b, lambda n: 12.0 * (1 + 0.01 * n), batches=(1, 2))  # the exported graphs re-profiled since
    with pytest.raises(BundleError, match=r"plans/exported.json was made from an earlier latency.json"):
        Pipeline.load(b, threads=2).evidence.plan()


def test_variants_are_profiled_side_by_side_each_into_its_own_profile(quant_bundle, tmp_path):
    from specrt.calibration.latency import ProfileConfig, profile
    from specrt.calibration.tune import TuneConfig, tune
    from tests.fakes import write_acceptance

    b = tmp_path / "b"
    shutil.copytree(quant_bundle, b)
    cfg = ProfileConfig(bundle=b, threads=2, batch_sizes=(1,), contexts=(32,), num_tokens=(1, 4), repeats=1, warmup=0,
                        passes=1, variants=("exported", "int4-weights"))
    got = profile(cfg, progress=False)
    assert list(got) == [None, "int4-weights"]
    assert artifacts.load(b, LatencyProfile).stamp.machine.quant is None
    q = artifacts.load(b, LatencyProfile, quant="int4-weights")
    assert q.stamp.machine.quant == "int4-weights" and q.models["target"][1][32].keys() == {1, 4}
    for quant in (None, "int4-weights"):
        write_acceptance(b, [[0.6, 0.2]] * 2, quant=quant)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=("exported", "int4-weights"), min_gain=0))
    assert set(plan.variants) == {"exported", "int4-weights"}
    with pytest.raises(InvalidRequestError, match="give --quant .* or --variants .*, not both"):
        ProfileConfig(bundle=b, quant="int4-weights", variants=("exported", "int4-weights"))


def test_a_quantized_variant_is_picked_only_for_a_gain_beyond_min_gain(quant_bundle, tmp_path):
    from specrt.calibration.tune import TuneConfig, tune

    b = tmp_path / "b"
    shutil.copytree(quant_bundle, b)
    _variant_evidence(b, variant_ms=9.0)  # 1.11x: inside the cost model's error band
    both = ("exported", "int8-weights")
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=both)).quant is None
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=both, min_gain=0.05)).quant == "int8-weights"
    assert tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=("int8-weights",))).quant == "int8-weights"
    with pytest.raises(SpecrtError, match="name each variant once"):
        tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=("exported", "exported")))
    with pytest.raises(BundleError, match=r"no quant/int4-weights/acceptance.json .* --quant int4-weights` first"):
        tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=("exported", "int4-weights")))
    _variant_evidence(b, variant_ms=4.0, threads=1)
    with pytest.raises(SpecrtError, match="profiled with different machines, backends or threads"):
        tune(TuneConfig(bundle=b, batch_sizes=(1,), variants=both))


def test_keep_leaves_the_down_projections_and_the_head_in_float(demo_bundle, tmp_path, humaneval):
    from specrt.engines.quantize import QuantizeConfig, quantize
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    q = quantize(QuantizeConfig(bundle=b, scheme="int8-weights", keep=("down", "head")), progress=False)
    layers = json.loads((b / "manifest.json").read_text())["models"]["target"]["num_layers"]
    v = q.variants["int8-weights"]["target"]
    assert v.quantized_nodes == 6 * layers and v.kept == ("down", "head")  # of 7 per layer + the head
    pipe = Pipeline.load(b, threads=2, quant="int8-weights")
    ar = [o.token_ids for o in pipe.generate(humaneval[:3], method="autoregressive", max_new_tokens=16)]
    assert [o.token_ids for o in pipe.generate(humaneval[:3], method="sd", max_new_tokens=16, batch_size=2)] == ar
    with pytest.raises(InvalidRequestError, match="--keep takes each of down, head at most once, got up"):
        QuantizeConfig(bundle=b, keep=("up",))


def test_e2e_prices_the_roofline_of_a_variant_by_its_own_weights(quant_bundle, tmp_path):
    """bench e2e --quant: the roofline reads the weights the variant's step graph holds, not the float export's."""
    from specrt.bench.e2e import E2EConfig, run_e2e
    from specrt.engines.quantize import graph_bytes

    cfg = E2EConfig(bundle=quant_bundle, out=tmp_path, label="t", num_prompts=1, max_new_tokens=8, runs=1,
                    warmup_runs=0, methods=("autoregressive",), baselines=(), quant="int8-weights", threads=1)
    roofline = run_e2e(cfg)["roofline"]
    variant = quant_bundle / artifacts.load(quant_bundle, QuantSet).variants["int8-weights"]["target"].file
    want = graph_bytes(variant, streamed=True)  # < graph_bytes(variant): the demo's untied input table, a row a step
    assert roofline["weight_bytes"] == want < min(graph_bytes(variant), graph_bytes(quant_bundle / "target.onnx", True))

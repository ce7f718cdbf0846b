"""`specrt inplace`: the step graphs' in-graph KV update (ONNX TensorScatter + Attention, opset 24), run by the
ort backend with kv_update="inplace" (each layer as ONNX Runtime's GroupQueryAttention kernel). The same function
as the exported graphs: every method gives the tokens it gives there, and the new K/V land in the runtime's cache
in place."""

import shutil

import numpy as np
import pytest

from specrt import contract
from specrt.bundle import artifacts
from specrt.bundle.artifacts import InPlaceGraphs
from specrt.errors import BundleError, InvalidRequestError


@pytest.fixture(scope="module")
def inplace_pipe(inplace_bundle):
    from specrt.runtime.pipeline import Pipeline

    return Pipeline.load(inplace_bundle, threads=2, kv_update="inplace")


def test_the_graphs_are_recorded_checked_and_made_of_the_standard_operators(inplace_bundle):
    import onnx

    from specrt.bundle.manifest import sha256_file

    made = artifacts.load(inplace_bundle, InPlaceGraphs)
    assert sorted(made.graphs) == ["draft", "target"]
    for role, g in made.graphs.items():
        assert g.file == f"inplace/{role}.onnx" and sha256_file(inplace_bundle / g.file) == g.sha256
        assert g.opset == 24 and g.parity["checked"] and g.parity["max_logit_err"] <= 1e-4
        model = onnx.load(str(inplace_bundle / g.file), load_external_data=False)
        layers = model.graph.node
        ops = [n.op_type for n in layers]
        num_layers = sum(1 for n in model.graph.input if n.name.startswith("past_key."))
        assert ops.count("TensorScatter") == 2 * num_layers and ops.count("Attention") == num_layers
        assert "Concat" not in {n.op_type for n in layers if any("past_" in i for i in n.input)}  # no cache copy
        assert [i.name for i in model.graph.input] == contract.input_names(num_layers, "inplace")
        assert [o.name for o in model.graph.output] == contract.output_names(num_layers, "inplace")


def test_parity_fails_on_a_graph_that_writes_every_sequence_at_slot_0(inplace_bundle, tmp_path):
    """The check the verb runs can fail: a graph ignoring write_indices puts new K/V over the cached ones."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from specrt.graphs.parity import check_parity, text_tokens
    from specrt.model.checkpoint import load_checkpoint, load_tokenizer
    from specrt.model.step import StepModule

    model = onnx.load(str(inplace_bundle / "inplace/draft.onnx"))
    model.graph.node.insert(0, helper.make_node("Mul", [contract.WRITE_INDICES, "zero"], ["zeroed"]))
    model.graph.initializer.append(helper.make_tensor("zero", onnx.TensorProto.INT64, [], [0]))
    for node in model.graph.node:
        if node.op_type == "TensorScatter":
            node.input[2] = "zeroed"
    onnx.save(model, str(tmp_path / "wrong.onnx"))
    session = ort.InferenceSession(str(tmp_path / "wrong.onnx"), providers=["CPUExecutionProvider"])
    module = StepModule(load_checkpoint(inplace_bundle / "hf/draft", "float32")).eval()
    tokens = text_tokens(load_tokenizer(inplace_bundle / "tokenizer"), module.hf.config.vocab_size)
    assert not check_parity(session, module, tokens, kv_update="inplace").ok()
    good = ort.InferenceSession(str(inplace_bundle / "inplace/draft.onnx"), providers=["CPUExecutionProvider"])
    assert check_parity(good, module, tokens, kv_update="inplace").ok()


def test_a_step_writes_its_new_kv_into_the_runtime_cache_where_the_sequences_end(inplace_pipe, pipelines):
    """The same step on both variants: same logits; the in-graph one leaves the new K/V at each sequence's length
    (the rest of the cache untouched), and committing them moves nothing."""
    from specrt.runtime.kv_cache import CacheRows
    from specrt.runtime.step_inputs import pack_step

    layers = inplace_pipe.target.entry.num_layers
    # ONNX Runtime runs each layer's TensorScatter and Attention nodes as one GroupQueryAttention kernel, which
    # rotates q and k itself and reads them packed, as the merged projection's rows (graphs/ort_fusions.py)
    assert inplace_pipe.target.grouped_attention == inplace_pipe.target.kernel_rotary == layers
    assert inplace_pipe.target.packed_qkv == layers
    plain, graph = pipelines["ort"].target.runner(), inplace_pipe.target.runner()
    caches = [r.new_cache(2) for r in (plain, graph)]
    for cache in caches:
        cache.reserve(16)
    cached = np.random.default_rng(0).standard_normal(caches[0].buffer.shape).astype(caches[0].buffer.dtype)
    for cache in caches:  # the same cached K/V (garbage beyond each length): sequences of 5 and 2 tokens
        cache.buffer[...] = cached
        cache.lengths[:] = (5, 2)
    rows = [np.array([7, 8, 9]), np.array([10, 11, 12])]
    positions = [np.arange(5, 8), np.arange(2, 5)]
    before = caches[1].buffer.copy()
    logits, new_kv = plain.step(*pack_step(caches[0], rows, positions), caches[0])
    logits_g, rows_g = graph.step(*pack_step(caches[1], rows, positions), caches[1])
    assert isinstance(rows_g, CacheRows) and list(rows_g.starts) == [5, 2]
    assert np.abs(logits - logits_g).max() < 1e-4
    buf = caches[1].buffer
    for b, start in enumerate((5, 2)):
        assert np.abs(buf[:, :, b, :, start:start + 3] - new_kv[:, :, b]).max() < 1e-5
        assert np.array_equal(buf[:, :, b, :, :start], before[:, :, b, :, :start])
        assert np.array_equal(buf[:, :, b, :, start + 3:], before[:, :, b, :, start + 3:])
    written = buf.copy()
    caches[1].append_rows(rows_g, 0, [0, 2])  # a tree path: row 2 moves next to row 0
    caches[1].append(rows_g, [0, 3])
    assert list(caches[1].lengths) == [7, 5]
    assert np.array_equal(buf[:, :, 0, :, 6], written[:, :, 0, :, 7]) and np.array_equal(buf[:, :, 1], written[:, :, 1])
    with pytest.raises(ValueError, match="committed into the cache they were written to"):
        caches[0].append(rows_g, [1, 1])
    plain.close()
    graph.close()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_lossless_methods_give_autoregressive_tokens_with_the_in_graph_update(inplace_pipe, pipelines, humaneval,
                                                                            batch_size):
    prompts = humaneval[:5]
    ar = [o.token_ids for o in pipelines["ort"].generate(prompts, method="autoregressive", max_new_tokens=24)]
    for kw in (dict(method="autoregressive"), dict(method="sd"), dict(method="tree"),
               dict(method="dynamic", num_draft_tokens=6), dict(method="anpd"), dict(method="sd", ngram_tokens=5)):
        got = inplace_pipe.generate(prompts, max_new_tokens=24, batch_size=batch_size, **kw)
        assert [o.token_ids for o in got] == ar, kw
    mtad = dict(method="mtad", max_new_tokens=24, batch_size=batch_size)  # lossy, but the same function either way
    assert [o.token_ids for o in inplace_pipe.generate(prompts, **mtad)] == \
        [o.token_ids for o in pipelines["ort"].generate(prompts, **mtad)]


def test_without_packed_rows_a_ragged_in_graph_batch_writes_its_holes_where_nobody_reads_them(
        inplace_bundle, inplace_pipe, pipelines, humaneval):
    """--no-packed-rows: the holes of a ragged batch are computed, and the in-graph step writes their K/V past each
    sequence's end, in slots its commit never keeps."""
    from specrt.runtime.pipeline import Pipeline

    plain = Pipeline.load(inplace_bundle, threads=2, kv_update="inplace", packed_rows=False)
    assert not plain.target.packs_rows and plain.target.grouped_attention == inplace_pipe.target.grouped_attention
    prompts = humaneval[:5]
    ar = [o.token_ids for o in pipelines["ort"].generate(prompts, method="autoregressive", max_new_tokens=24)]
    for kw in (dict(method="anpd"), dict(method="dynamic", num_draft_tokens=6)):
        got = plain.generate(prompts, max_new_tokens=24, batch_size=3, **kw)
        assert [o.token_ids for o in got] == ar, kw


def test_a_rewrite_onnx_runtime_refuses_leaves_the_graph_as_exported(inplace_bundle, pipelines, monkeypatch):
    """Where ONNX Runtime will not load the layers rewritten into GroupQueryAttention, the backend says why and loads
    the in-graph graph as it was exported, which decodes the same tokens."""
    import specrt.graphs.ort_attention as attention
    from specrt.runtime.pipeline import Pipeline

    rewrite = attention.fuse_grouped_attention

    def refused(model, *args):
        made = rewrite(model, *args)
        for node in model.graph.node:
            if node.op_type == "GroupQueryAttention":  # a head count the kernel refuses as it is made
                next(a for a in node.attribute if a.name == "num_heads").i = 0
        return made

    monkeypatch.setattr(attention, "fuse_grouped_attention", refused)
    with pytest.warns(RuntimeWarning, match="refused .*GroupQueryAttention .*: loading it as exported"):
        pipe = Pipeline.load(inplace_bundle, threads=2, kv_update="inplace")
    assert pipe.target.grouped_attention == pipe.target.kernel_rotary == pipe.target.packed_qkv == 0
    assert pipe.target.grouped_attention_refused
    prompts = [[5, 9, 200, 31, 7] * 4, [11, 12, 13]]
    want = [o.token_ids for o in pipelines["ort"].generate(prompts, method="autoregressive", max_new_tokens=12)]
    assert [o.token_ids for o in pipe.generate(prompts, method="sd", max_new_tokens=12, batch_size=2)] == want


def test_the_in_graph_update_is_refused_where_it_cannot_run(inplace_bundle, demo_bundle, tmp_path):
    from specrt.bundle.machine import Machine
    from specrt.runtime.pipeline import Pipeline

    with pytest.raises(BundleError, match="no inplace.json in .*: run `specrt inplace --bundle "):
        Pipeline.load(demo_bundle, kv_update="inplace")
    with pytest.raises(InvalidRequestError, match="kv_update='inplace' runs on the backends ort and trt \\(its engines built with --kv-update inplace\\), not 'torch'"):
        Pipeline.load(inplace_bundle, backend="torch", device="cpu", kv_update="inplace")
    with pytest.raises(InvalidRequestError, match="kv_update must be one of runtime, inplace"):
        Pipeline.load(inplace_bundle, kv_update="both")
    b = tmp_path / "b"
    shutil.copytree(inplace_bundle, b)
    (b / "inplace/target.onnx").write_bytes(b"changed")
    with pytest.raises(BundleError, match="target.onnx is missing or changed since `specrt inplace` wrote it"):
        Pipeline.load(b, kv_update="inplace")
    pipe = Pipeline.load(inplace_bundle, threads=2, kv_update="inplace")
    assert "has no PPD prompt tokens: run `specrt ppd train" in pipe.prompt_tokens_refused  # PPD runs in-graph too
    here = Machine.here("ort", 2, kv_update="inplace")
    assert here != Machine.here("ort", 2) and "--kv-update inplace" in here.flags()  # a profile of its own


def test_the_cli_makes_them_and_runs_them(inplace_bundle, tmp_path, capsys):
    from specrt.cli import main

    b = tmp_path / "b"
    shutil.copytree(inplace_bundle, b)
    (b / "inplace.json").unlink()
    shutil.rmtree(b / "inplace")
    assert main(["inplace", "--bundle", str(b), "--model", "draft"]) == 0
    out = capsys.readouterr().out
    assert "draft: inplace/draft.onnx (opset 24" in out and "parity vs PyTorch over 6 cases of real text" in out
    assert sorted(artifacts.load(b, InPlaceGraphs).graphs) == ["draft"]
    with pytest.raises(BundleError, match="has no in-graph step graph of its target: run `specrt inplace"):
        from specrt.runtime.pipeline import Pipeline

        Pipeline.load(b, kv_update="inplace")


def test_bench_e2e_runs_in_graph_rows_beside_the_runtime_ones(inplace_bundle, tmp_path):
    from specrt.bench.e2e import E2EConfig, run_e2e
    from specrt.errors import SpecrtError

    cfg = E2EConfig(bundle=inplace_bundle, out=tmp_path, label="t", num_prompts=2, max_new_tokens=12, runs=1,
                    warmup_runs=0, methods=("autoregressive", "sd"), in_graph=("autoregressive", "sd"), baselines=(),
                    threads=2)
    rows = {r["method"]: r for r in run_e2e(cfg)["rows"]}
    assert list(rows) == ["autoregressive", "sd", "autoregressive (in-graph)", "sd (in-graph)"]
    assert all(r["same_tokens_as_ours_ar"] == 1.0 for r in rows.values())
    assert rows["sd (in-graph)"]["tokens_per_target_call"] == rows["sd"]["tokens_per_target_call"]
    with pytest.raises(SpecrtError, match="in-graph row 'anpd' is not one of this run's rows"):
        E2EConfig(bundle=inplace_bundle, methods=("sd",), in_graph=("anpd",))


def test_a_quantized_twin_of_the_in_graph_graphs_decodes_the_quantized_exported_graphs_tokens(inplace_bundle,
                                                                                             tmp_path, capsys):
    """`specrt quantize --kv-update inplace`: the in-graph graphs' int8-weights twin, recorded beside the exported
    graphs' variant and checked against the in-graph graphs it was made from, computes what the exported graphs'
    variant does: the same tokens for every lossless method, through the GroupQueryAttention kernel."""
    from specrt.bundle.artifacts import QuantSet
    from specrt.bundle.manifest import sha256_file
    from specrt.cli import main
    from specrt.engines.quantize import QuantizeConfig, quantize
    from specrt.export.inplace import InPlaceConfig, in_place
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(inplace_bundle, b)
    with pytest.raises(BundleError, match="no quant.json in .*: run `specrt quantize"):
        Pipeline.load(b, kv_update="inplace", quant="int8-weights")
    quantize(QuantizeConfig(bundle=b, scheme="int8-weights"), progress=False)
    with pytest.raises(BundleError, match="has no in-graph int8-weights variant .*--kv-update inplace`"):
        Pipeline.load(b, kv_update="inplace", quant="int8-weights")
    # the target's twin alone: the draft runs its float in-graph graph (its q, k, v merged; the twin's gate/up too)
    quantize(QuantizeConfig(bundle=b, scheme="int8-weights", kv_update="inplace", model="target"), progress=False)
    half = Pipeline.load(b, threads=1, kv_update="inplace", quant="int8-weights")
    assert (half.target.merged_matmuls, half.draft.merged_matmuls) == (3 * half.target.entry.num_layers,
                                                                       2 * half.draft.entry.num_layers)
    assert half.draft.grouped_attention == half.draft.entry.num_layers
    assert main(["quantize", "--bundle", str(b), "--kv-update", "inplace", "--scheme", "int8-weights"]) == 0
    assert "run it with --quant int8-weights --kv-update inplace" in capsys.readouterr().out
    q = artifacts.load(b, QuantSet)
    graphs = artifacts.load(b, InPlaceGraphs).graphs
    assert sorted(q.variants) == sorted(q.in_graph) == ["int8-weights"]  # the exported graphs' variant is kept
    for role, v in q.in_graph["int8-weights"].items():
        assert v.file == f"quant/int8-weights/inplace/{role}.onnx" and v.source_sha256 == graphs[role].sha256
        assert sha256_file(b / v.file) == v.sha256 and v.bytes < v.source_bytes
    exported = Pipeline.load(b, threads=2, quant="int8-weights")
    twin = Pipeline.load(b, threads=2, kv_update="inplace", quant="int8-weights")
    layers = twin.target.entry.num_layers
    assert twin.target.grouped_attention == twin.target.packed_qkv == layers  # q, k, v of one MatMulNBits
    # the roofline a bench prices (bench.e2e.run_weight_bytes) reads the twin's own weights
    from specrt.bench.e2e import run_weight_bytes
    from specrt.engines.quantize import graph_bytes

    assert run_weight_bytes(twin) == graph_bytes(b / q.in_graph["int8-weights"]["target"].file, streamed=True) \
        < graph_bytes(b / graphs["target"].file, streamed=True)
    prompts = [[5, 9, 200, 31, 7] * 4, [11, 12, 13]]
    want = [o.token_ids for o in exported.generate(prompts, method="autoregressive", max_new_tokens=16)]
    for method in ("autoregressive", "sd", "anpd"):
        for batch_size in (1, 2):
            got = twin.generate(prompts, method=method, max_new_tokens=16, batch_size=batch_size)
            assert [o.token_ids for o in got] == want, (method, batch_size)
    with pytest.raises(InvalidRequestError, match="--scheme static-int8 calibrates on the exported step graphs"):
        QuantizeConfig(bundle=b, scheme="static-int8", kv_update="inplace")
    # the in-graph draft made again, its weights in a file beside it this time (another graph file): its twin is stale
    in_place(InPlaceConfig(bundle=b, model="draft", external_data="always"), progress=False)
    with pytest.raises(BundleError, match="quantized from an earlier in-graph draft graph .*--kv-update inplace`"):
        Pipeline.load(b, kv_update="inplace", quant="int8-weights")

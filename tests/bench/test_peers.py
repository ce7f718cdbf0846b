"""Peer runtimes in `specrt bench e2e`, run for real: ONNX Runtime GenAI converts the bundle's own checkpoints and
decodes the same prompts in the same run. Rows produced and token identity asserted, never timing. CI installs
onnxruntime-genai (the dev extra) and requires these tests to run (SPECRT_REQUIRE_PEERS=1)."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from specrt.bench.peers import llama_cpp_missing, ort_genai_missing, ort_genai_models, ort_genai_precision

MISSING = ort_genai_missing()
needs_ort_genai = pytest.mark.skipif(MISSING is not None and os.environ.get("SPECRT_REQUIRE_PEERS") != "1",
                                     reason=str(MISSING))
LLAMA_CPP = Path("build/peers/llama.cpp")  # `make peers`: CI leaves llama.cpp's half-hour build out
LLAMA_MISSING = llama_cpp_missing(LLAMA_CPP)


@needs_ort_genai
def test_ort_genai_rows_decode_our_ars_tokens_in_the_same_run(demo_bundle, tmp_path):
    from specrt.bench.e2e import E2EConfig, run_e2e

    cfg = E2EConfig(bundle=demo_bundle, threads=2, num_prompts=3, max_new_tokens=24, runs=1, warmup_runs=0,
                    methods=("autoregressive", "sd", "anpd"), baselines=("ort-genai", "ort-genai-sd", "ort-genai-ngram"),
                    out=tmp_path / "out", label="peers", peer_cache=tmp_path / "cache")
    data = run_e2e(cfg)
    rows = {r["method"]: r for r in data["rows"]}
    peers = ["ort-genai (fp32)", "ort-genai-sd (fp32)", "ort-genai-ngram (fp32)"]
    assert list(rows) == ["autoregressive", "sd", "anpd", *peers]
    for name in peers:  # same weights, greedy: the same tokens, or a difference explained by a logit gap
        assert rows[name]["same_tokens_as_ours_ar"] == 1 or rows[name]["divergence"]["ties"], rows[name]
        assert rows[name]["tokens"] == rows["autoregressive"]["tokens"]
        assert rows[name]["ttft_ms"] > 0 and rows[name]["tpot_ms"] > 0, rows[name]  # timed as our rows are
    peer = data["summary"]["peers"]["ort-genai"]
    assert peer["ar"] == "ort-genai (fp32)" and peer["best"] in peers[1:]
    assert peer["ours"]["ar"] == "autoregressive" and peer["our_ar_vs_its_ar"] > 0
    md = (tmp_path / "out" / "e2e-peers.md").read_text()
    assert "vs ONNX Runtime GenAI (same run): our AR" in md


@needs_ort_genai
def test_conversions_are_cached_per_export_and_precision_and_written_whole(demo_bundle, tmp_path):
    first = ort_genai_models(demo_bundle, tmp_path, "fp32", progress=False)
    stamp = (first["target"] / "model.onnx").stat().st_mtime_ns
    assert ort_genai_models(demo_bundle, tmp_path, "fp32", progress=False) == first  # not converted again
    assert (first["target"] / "model.onnx").stat().st_mtime_ns == stamp
    assert first["draft"] != first["target"] and (first["draft"] / "genai_config.json").is_file()

    broken = tmp_path / "broken"
    shutil.copytree(demo_bundle, broken, ignore=shutil.ignore_patterns("*.onnx*"))
    (broken / "hf" / "target" / "config.json").write_text("{}")
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="model builder could not convert .*hf/target"):
        ort_genai_models(broken, tmp_path / "c2", "fp32", progress=False)
    left = [p.name for p in (tmp_path / "c2").rglob("*")]
    assert "target" not in left and not [n for n in left if n.endswith(".tmp")], left  # nothing half-written, no scraps


def test_precision_is_matched_to_ours_or_the_peer_is_skipped_saying_why():
    assert ort_genai_precision("float32", None) == ("fp32", "fp32")
    assert ort_genai_precision("float32", "int8-weights") == ("int8", "int8 weights")
    assert ort_genai_precision("float16", None)[0] is None  # the CPU wheel has no fp16 CPU model


@pytest.mark.skipif(LLAMA_MISSING is not None, reason=str(LLAMA_MISSING))
def test_llama_cpp_rows_decode_our_ars_tokens_in_the_same_run(demo_bundle, tmp_path):
    from specrt.bench.e2e import E2EConfig, run_e2e

    cfg = E2EConfig(bundle=demo_bundle, threads=2, num_prompts=3, max_new_tokens=24, runs=1, warmup_runs=0,
                    methods=("autoregressive", "anpd"), baselines=("llama-cpp", "llama-cpp-sd", "llama-cpp-lookup"),
                    out=tmp_path / "out", label="llama", peer_cache=tmp_path / "cache",
                    llama_cpp_source=LLAMA_CPP.resolve())
    data = run_e2e(cfg)
    rows = {r["method"]: r for r in data["rows"]}
    for name in ("llama-cpp (f32)", "llama-cpp-sd (f32)", "llama-cpp-lookup (f32)"):
        assert rows[name]["same_tokens_as_ours_ar"] == 1 or rows[name]["divergence"]["ties"], rows[name]
    assert data["summary"]["peers"]["llama-cpp"]["ar"] == "llama-cpp (f32)"


@pytest.mark.skipif(LLAMA_MISSING is not None, reason=str(LLAMA_MISSING))
def test_llama_cpp_draft_model_drafts_its_greedy_continuation_whatever_its_cache_held(demo_bundle, tmp_path):
    from llama_cpp import Llama

    from specrt.bench.peers import _llama_draft_model, llama_cpp_model

    gguf = llama_cpp_model(demo_bundle, tmp_path, LLAMA_CPP.resolve(), "f32", progress=False, role="draft")
    assert gguf.name == "draft.gguf"
    alone = Llama(model_path=str(gguf), n_ctx=256, n_threads=2, verbose=False)
    prompt = alone.tokenize(b"def add(a, b):\n    return", add_bos=False)
    greedy = []
    for token in alone.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        greedy.append(int(token))
        if len(greedy) == 10:
            break
    draft = _llama_draft_model()(gguf, threads=2, context=256, num_tokens=4)
    assert draft(np.asarray(prompt)).tolist() == greedy[:4]
    # the verifier took two drafts and its own next token: the cache keeps what still matches, drops the rest
    assert draft(np.asarray(prompt + greedy[:3])).tolist() == greedy[3:7]
    other = draft(np.asarray(prompt[:-1] + [prompt[-1] ^ 1]))  # a different last token: drafts from there
    fresh = _llama_draft_model()(gguf, threads=2, context=256, num_tokens=4)
    assert other.tolist() == fresh(np.asarray(prompt[:-1] + [prompt[-1] ^ 1])).tolist()
    near_full = _llama_draft_model()(gguf, threads=2, context=len(prompt) + 2, num_tokens=4)
    assert near_full(np.asarray(prompt)).tolist() == greedy[:2]  # no more than its context holds


def test_only_a_gpt2_byte_level_tokenizer_is_named_gpt2_for_the_gguf_converter(demo_bundle, tmp_path):
    from specrt.bench.gguf_convert import gpt2_byte_level

    original = json.loads((demo_bundle / "tokenizer" / "tokenizer.json").read_text())
    path = tmp_path / "tokenizer.json"
    for edit, expected in [({}, True), ({"normalizer": {"type": "NFC"}}, False),
                           ({"pre_tokenizer": {"type": "Metaspace"}}, False),
                           ({"model": {**original["model"], "byte_fallback": True}}, False),
                           ({"model": {**original["model"], "type": "Unigram"}}, False)]:
        path.write_text(json.dumps({**original, **edit}))
        assert gpt2_byte_level(path) is expected, edit
    path.write_text("{")
    assert gpt2_byte_level(path) is False


def test_a_peer_that_cannot_run_is_skipped_saying_why(demo_bundle, tmp_path):
    from specrt.bench.e2e import E2EConfig, run_e2e

    cfg = E2EConfig(bundle=demo_bundle, threads=2, num_prompts=1, max_new_tokens=4, runs=1, warmup_runs=0,
                    methods=("autoregressive",), baselines=("llama-cpp", "llama-cpp-lookup"), out=tmp_path,
                    label="skip", llama_cpp_source=tmp_path / "nowhere")
    data = run_e2e(cfg)
    assert [r["method"] for r in data["rows"]] == ["autoregressive"]
    assert set(data["skipped"]) == {"llama-cpp", "llama-cpp-lookup"}
    assert all(("llama-cpp-python is not installed" in why or "no llama.cpp GGUF converter" in why)
               for why in data["skipped"].values())


@needs_ort_genai
def test_on_the_real_smollm2_chat_answers_end_alike_and_count_alike(smollm2_bundle, tmp_path):
    """Chat prompts through SmolLM2's template: the answers stop at <|im_end|>, which our token ids keep and ONNX
    Runtime GenAI's sequence leaves out; the row puts it back, so the answers compare and count alike."""
    from specrt.bench.e2e import E2EConfig, run_e2e

    cfg = E2EConfig(bundle=smollm2_bundle, threads=2, num_prompts=2, max_new_tokens=72, runs=1, warmup_runs=0,
                    prompt_set="chat", methods=("autoregressive", "anpd"), baselines=("ort-genai", "ort-genai-ngram"),
                    out=tmp_path / "out", label="chat", peer_cache=tmp_path / "cache")
    data = run_e2e(cfg)
    rows = {r["method"]: r for r in data["rows"]}
    ours = rows["autoregressive"]
    assert ours["tokens"] < 2 * 72  # the first answer ends before the limit (67 tokens), at the end token
    for name in ("ort-genai (fp32)", "ort-genai-ngram (fp32)"):
        assert rows[name]["same_tokens_as_ours_ar"] == 1, rows[name]
        assert rows[name]["tokens"] == ours["tokens"]
    assert "2 chat prompts" in (tmp_path / "out" / "e2e-chat.md").read_text()


@pytest.mark.skipif(LLAMA_MISSING is not None, reason=str(LLAMA_MISSING))
def test_a_llama_cpp_row_runs_the_real_gguf_as_shipped(smollm2, smollm2_bundle, tmp_path):
    from specrt.bench.e2e import E2EConfig, run_e2e
    from specrt.checkpoints.real import REAL_MODELS

    gguf = smollm2.parent / "downloads" / REAL_MODELS["smollm2-135m"].gguf
    cfg = E2EConfig(bundle=smollm2_bundle, threads=2, num_prompts=2, max_new_tokens=16, runs=1, warmup_runs=0,
                    methods=("autoregressive",), baselines=(), original_gguf=gguf, out=tmp_path / "out", label="q4",
                    peer_cache=tmp_path / "cache", llama_cpp_source=LLAMA_CPP.resolve())
    rows = {r["method"]: r for r in run_e2e(cfg)["rows"]}
    row = rows["llama-cpp-gguf (Q4_1, as shipped)"]
    assert row["tokens"] > 0 and row["tpot_ms"] > 0
    if row["divergence"]:  # its own 4-bit weights: other tokens are not a method's change
        assert row["divergence"]["other_weights"] == "Q4_1"


@needs_ort_genai
def test_ort_genai_decodes_a_gemma3_checkpoint_transformers_5_wrote(tmp_path):
    """A Gemma 3 config as transformers 5 writes it (RoPE per layer type; onnxruntime-genai 0.18's own Gemma 3 builder
    fails on it with KeyError 'rope_type') converts through bench/ort_genai_builder.py and decodes our AR's tokens,
    though the whole text is shorter than the window its cache must hold (which was where its decode stopped)."""
    from specrt.bench.e2e import E2EConfig, run_e2e
    from specrt.checkpoints import DEMO_DIR
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from tests.export.test_architectures import _tiny

    _tiny("gemma3", tmp_path / "gemma3", sliding_window=512, max_position_embeddings=1024)
    assert "sliding_attention" in json.loads((tmp_path / "gemma3" / "config.json").read_text())["rope_parameters"]
    export_bundle(ExportConfig(target=tmp_path / "gemma3", draft=tmp_path / "gemma3", out=tmp_path / "b",
                               tokenizer=DEMO_DIR / "tokenizer"), progress=False)
    cfg = E2EConfig(bundle=tmp_path / "b", threads=2, num_prompts=2, max_new_tokens=16, runs=1, warmup_runs=0,
                    methods=("autoregressive",), baselines=("ort-genai",), out=tmp_path / "out", label="gemma3",
                    peer_cache=tmp_path / "cache")
    rows = {r["method"]: r for r in run_e2e(cfg)["rows"]}
    assert rows["ort-genai (fp32)"]["same_tokens_as_ours_ar"] == 1, rows["ort-genai (fp32)"]
    assert rows["ort-genai (fp32)"]["tokens"] == rows["autoregressive"]["tokens"] == 2 * 16

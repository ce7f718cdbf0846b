"""Other Llama-family architectures end to end: export, then greedy decoding equal to the checkpoint's own
`generate` (Qwen2: attention bias, tied embeddings; Mistral: a sliding window shorter than the context,
enforced by the runtime's mask; Qwen3: per-head QK-norm; OLMo 2: QK-norm over the projections, norms after
attention and MLP; Granite: embedding, attention, residual and logit multipliers; Gemma 2: soft-capping,
per-layer windows; Gemma 3: per-head QK-norm, per-layer windows and a RoPE per layer type, `linear` scaling on
its global layers; Llama 3.x: `llama3` RoPE scaling and tied embeddings; Qwen3 with `yarn` scaling), and the
step's logits equal to the checkpoint's own forward."""

import pytest

from specrt.checkpoints import DEMO_DIR


def _tiny(kind: str, out, **extra):
    import torch
    import transformers

    common = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
               "mistral": ("MistralConfig", "MistralForCausalLM", {}),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
               "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
               "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 6.0, "attention_multiplier": 0.1,
                                                                  "residual_multiplier": 0.3, "logits_scaling": 4.0}),
               "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
               "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
               "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 6,
                                                                "query_pre_attn_scalar": 16,
                                                                "attn_logit_softcapping": 5.0,
                                                                "final_logit_softcapping": 3.0}),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 6,
                                                                    "query_pre_attn_scalar": 16,
                                                                    "layer_types": ["sliding_attention", "full_attention"],
                                                                    "rope_local_base_freq": 100.0, "rope_scaling": {
                                                                        "rope_type": "linear", "factor": 8.0}}),
               "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "rope_scaling": {
                   "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
               "llama3": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_scaling": {
                   "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}})}
    config_class, model_class, own = classes[kind]
    config = getattr(transformers, config_class)(**{**common, **own, **extra})
    config._attn_implementation = "eager"  # the reference: transformers 4.x's SDPA path skips Gemma 2's soft-capping
    model = getattr(transformers, model_class)(config)
    torch.manual_seed(0)
    for p in model.parameters():  # sharp logits: greedy choices far from ties
        torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(out)
    return model.eval()


FAMILIES = ["qwen2", "qwen3", "olmo2", "granite", "phi3", "phi4-mini", "gemma2", "gemma3", "llama3"]


@pytest.mark.parametrize("kind,extra", [(k, {}) for k in FAMILIES] + [("mistral", {"sliding_window": 8})])
def test_export_and_greedy_decoding_match_the_checkpoint(tmp_path, kind, extra):
    import torch

    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    model = _tiny(kind, tmp_path / kind, **extra)
    manifest = export_bundle(ExportConfig(target=tmp_path / kind, draft=tmp_path / kind, out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer"), progress=False)
    assert manifest.models["target"].sliding_window == extra.get("sliding_window")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 4096, (1, n), generator=gen) for n in (30, 17)]  # a ragged batch of two
    with torch.no_grad():
        want = [model.generate(p, do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, p.shape[1]:].tolist()
                for p in prompts]
    ids = [p[0].tolist() for p in prompts]
    for backend in ("ort", "torch"):
        pipe = Pipeline.load(tmp_path / "b", backend=backend, threads=2, device="cpu")
        for method in ("autoregressive", "sd", "tree", "anpd"):
            for batch_size in (1, 2):  # one at a time, then the two as a ragged batch
                got = [o.token_ids for o in pipe.generate(ids, method=method, max_new_tokens=20, batch_size=batch_size)]
                assert got == want, (backend, method, batch_size)
    prompt = prompts[0]
    want = want[0]
    if extra.get("sliding_window"):  # the window matters here: without it in the mask, decoding differs
        pipe.target.entry = pipe.draft.entry = type(pipe.target.entry)(**{**pipe.target.entry.__dict__, "sliding_window": None})
        assert pipe.generate([prompt[0].tolist()], method="autoregressive", max_new_tokens=20)[0].token_ids != want


@pytest.mark.parametrize("kind,extra", [("qwen3", {}), ("phi4-mini", {}),  # the kernel's rotation; ours (partial)
                                        ("gemma3", {})]  # windows on some layers: each its own mask, in the graph
                         + [pytest.param(k, e, marks=pytest.mark.slow)  # ~40 s each: `pytest -m slow`
                            for k, e in [("qwen2", {}), ("olmo2", {}), ("granite", {}), ("llama3", {}),
                                         ("mistral", {"sliding_window": 8})]])
def test_the_in_graph_kv_update_decodes_the_checkpoints_tokens(tmp_path, kind, extra):
    """The in-graph step graphs (`specrt inplace`), each layer run by ONNX Runtime's GroupQueryAttention kernel
    (ort_attention.fuse_grouped_attention): every lossless method gives the checkpoint's greedy tokens, one at a time
    and as a ragged batch (tree rows, a sliding window and partial RoPE reach the kernel through its bias and our
    rotated keys)."""
    import torch

    from specrt.export.inplace import InPlaceConfig, in_place
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    model = _tiny(kind, tmp_path / kind, **extra)
    export_bundle(ExportConfig(target=tmp_path / kind, draft=tmp_path / kind, out=tmp_path / "b",
                               tokenizer=DEMO_DIR / "tokenizer"), progress=False)
    in_place(InPlaceConfig(bundle=tmp_path / "b"), progress=False)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 4096, (1, n), generator=gen) for n in (23, 11)]
    with torch.no_grad():
        want = [model.generate(p, do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, p.shape[1]:].tolist()
                for p in prompts]
    pipe = Pipeline.load(tmp_path / "b", threads=2, kv_update="inplace")
    assert pipe.target.grouped_attention == pipe.draft.grouped_attention == 2  # both layers of both models
    # the kernel rotates whole heads (partial RoPE stays in the graph)
    assert pipe.target.kernel_rotary == (0 if kind == "phi4-mini" else 2)
    # q, k and v read as the merged projection's rows, biases merged too (Qwen2); not where q and k are normed
    # after their projection (Qwen3, OLMo 2, Gemma 3) or the checkpoint projects them as one (Phi-4-mini)
    assert pipe.target.packed_qkv == (0 if kind in ("qwen3", "olmo2", "phi4-mini", "gemma3") else 2)
    ids = [p[0].tolist() for p in prompts]
    for method in ("autoregressive", "sd", "tree", "anpd"):
        for batch_size in (1, 2):
            got = [o.token_ids for o in pipe.generate(ids, method=method, max_new_tokens=16, batch_size=batch_size)]
            assert got == want, (method, batch_size)


@pytest.mark.parametrize("projections", ["none", "all"])
@pytest.mark.parametrize("kind", FAMILIES + ["qwen3-yarn"])
def test_the_step_computes_the_checkpoints_logits(tmp_path, kind, projections):
    """The step module against the family's own forward, in float32: a ragged pair of sequences through a
    cache, each token's logits within 1e-4 of the checkpoint's (the export checks the ONNX graph against the step);
    so too with its projections merged (the static engines' default), q, k and v and gate and up each one linear
    whose weights the separate ones view (Phi-3's come merged)."""
    import torch

    from specrt.model.quant import module_bytes
    from specrt.model.step import StepModule

    model = _tiny(kind, tmp_path / kind)
    step = StepModule(model).eval()
    before = module_bytes(step)
    step.fuse_projections(projections)
    merged = step.merged_projections()
    assert len(merged) == (0 if projections == "none" or kind.startswith("phi") else 2 * step.num_layers)
    for layer, qkv in zip(model.model.layers, merged[::2]):
        w = layer.self_attn.k_proj.weight
        assert w.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()
    assert module_bytes(step) == before  # the weights are not copied twice
    ids = torch.randint(1, 4096, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits.float()
        layers, hkv, dim = step.num_layers, step.num_kv_heads, step.head_dim
        empty = [torch.zeros(2, hkv, 0, dim) for _ in range(2 * layers)]
        causal = torch.ones(12, 12, dtype=torch.bool).tril()[None].expand(2, 12, 12)
        first = step(ids[:, :7], torch.arange(7)[None].expand(2, 7), causal[:, :7, :7], *empty)
        past = list(first[1:])
        mask = causal[:, 7:, :]  # the last 5 tokens see the 7 cached and themselves, causally
        rest = step(ids[:, 7:], torch.arange(7, 12)[None].expand(2, 5), mask, *past)
    got = torch.cat([first[0], rest[0]], dim=1)
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_rope_that_changes_with_the_sequence_length_is_refused_in_one_line():
    import transformers

    from specrt.errors import UnsupportedModelError
    from specrt.model.step import check_supported

    config = transformers.Phi3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                     max_position_embeddings=256, original_max_position_embeddings=64,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                   "long_factor": [2.0] * 8})
    with pytest.raises(UnsupportedModelError, match="'longrope' RoPE scaling changes with the sequence length"):
        check_supported(config)


def test_an_encoder_gemma3_is_refused_in_one_line():
    import transformers

    from specrt.errors import UnsupportedModelError
    from specrt.model.step import check_supported

    config = transformers.Gemma3TextConfig(num_hidden_layers=1, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="'gemma3_text' with use_bidirectional_attention is an encoder"):
        check_supported(config)


def test_a_checkpoint_windowing_some_layers_only_is_refused_in_one_line(tmp_path):
    import transformers

    from specrt.errors import UnsupportedModelError
    from specrt.model.checkpoint import sliding_window

    config = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    with pytest.raises(UnsupportedModelError, match="windows some layers only \\(2 of 4 sliding"):
        sliding_window(config)


def test_the_in_graph_kv_update_refuses_what_its_attention_node_cannot_do(tmp_path):
    from specrt.errors import UnsupportedModelError
    from specrt.model.step import InPlaceStepModule

    with pytest.raises(UnsupportedModelError, match="'gemma2': the in-graph KV update's Attention node has no "
                                                    "score soft-capping"):
        InPlaceStepModule(_tiny("gemma2", tmp_path / "g"))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k in ("gemma2", "phi4-mini", "olmo2") else pytest.mark.slow)
                                  for k in FAMILIES + ["mistral"]])
def test_float16_export_passes_parity(tmp_path, kind):
    """Each family's step graph in float16 against its step module (export's own parity check, within float16's
    documented tolerance); three families in the default suite, every one with -m slow."""
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.graphs.parity import PARITY_TOL

    _tiny(kind, tmp_path / kind)
    manifest = export_bundle(ExportConfig(target=tmp_path / kind, draft=tmp_path / kind, out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer", dtype="float16"), progress=False)
    assert all(p["max_logit_err"] <= PARITY_TOL["float16"] for p in manifest.parity.values())
    assert manifest.models["target"].dtype == "float16"


def test_a_draft_of_another_family_sharing_the_tokenizer_speculates_for_the_target(tmp_path):
    """A Llama draft for a Qwen3 target (the tokenizer check is all a pair needs): sd gives the target's own greedy
    tokens."""
    import torch

    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    target = _tiny("qwen3", tmp_path / "target")
    _tiny("llama3", tmp_path / "draft")
    manifest = export_bundle(ExportConfig(target=tmp_path / "target", draft=tmp_path / "draft", out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer"), progress=False)
    assert (manifest.models["target"].model_type, manifest.models["draft"].model_type) == ("qwen3", "llama")
    prompt = torch.randint(1, 4096, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = target.generate(prompt, do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, 24:].tolist()
    pipe = Pipeline.load(tmp_path / "b", threads=2)
    for method in ("sd", "tree", "dynamic"):
        assert pipe.generate([prompt[0].tolist()], method=method, max_new_tokens=16)[0].token_ids == want, method


def test_an_image_text_gemma3_checkpoint_exports_its_language_model(tmp_path):
    """A `gemma3` checkpoint (Gemma 3 4B and up: a vision tower beside the language model) exports as its text model:
    the bundle says gemma3_text, and greedy decoding equals the whole checkpoint's own `generate` on text."""
    import torch
    import transformers

    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    text = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=6,
                query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                rope_local_base_freq=100.0, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(tmp_path / "g")
    manifest = export_bundle(ExportConfig(target=tmp_path / "g", draft=tmp_path / "g", out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer"), progress=False)
    assert manifest.models["target"].model_type == "gemma3_text"
    prompt = torch.randint(1, 4096, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model.eval().generate(prompt, do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, 20:].tolist()
    pipe = Pipeline.load(tmp_path / "b", threads=2)
    for method in ("autoregressive", "sd"):
        assert pipe.generate([prompt[0].tolist()], method=method, max_new_tokens=16)[0].token_ids == want, method

"""Other Llama-family architectures end to end: export, then greedy decoding equal to the checkpoint's own
`generate` (Qwen2: attention bias, tied embeddings; Mistral: a sliding window shorter than the context,
enforced by the runtime's mask)."""

import pytest

from specrt.checkpoints import DEMO_DIR


def _tiny(kind: str, out, **extra):
    import torch
    import transformers

    common = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, **extra)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common, **extra)
        model = transformers.MistralForCausalLM(config)
    torch.manual_seed(0)
    for p in model.parameters():  # sharp logits: greedy choices far from ties
        torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("kind,extra", [("qwen2", {}), ("mistral", {"sliding_window": 8})])
def test_export_and_greedy_decoding_match_the_checkpoint(tmp_path, kind, extra):
    import torch

    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    model = _tiny(kind, tmp_path / kind, **extra)
    manifest = export_bundle(ExportConfig(target=tmp_path / kind, draft=tmp_path / kind, out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer"), progress=False)
    assert manifest["models"]["target"]["sliding_window"] == extra.get("sliding_window")
    prompt = torch.randint(1, 4096, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(prompt, do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, 30:].tolist()
    pipe = Pipeline.load(tmp_path / "b", threads=2)
    for method in ("autoregressive", "sd"):
        got = pipe.generate([prompt[0].tolist()], method=method, max_new_tokens=20)[0].token_ids
        assert got == want, method
    if extra.get("sliding_window"):  # the window matters here: without it in the mask, decoding differs
        pipe.target.entry = pipe.draft.entry = type(pipe.target.entry)(**{**pipe.target.entry.__dict__, "sliding_window": None})
        assert pipe.generate([prompt[0].tolist()], method="autoregressive", max_new_tokens=20)[0].token_ids != want

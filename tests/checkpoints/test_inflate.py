import pytest
import torch

from specrt.checkpoints import DEMO_DIR
from specrt.checkpoints.inflate import PRESETS, InflateConfig, inflate, inflate_model
from specrt.errors import SpecrtError
from specrt.model.checkpoint import load_checkpoint


def test_inflated_target_computes_the_same_logits(tmp_path):
    model = load_checkpoint(DEMO_DIR / "target")
    cfg = InflateConfig(src=DEMO_DIR / "target", out=tmp_path, hidden_size=384, intermediate_size=1024,
                        num_layers=4, num_heads=6)
    big = inflate_model(model, cfg).eval()
    assert sum(p.numel() for p in big.parameters()) > 1.5 * sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, big(ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    # the added capacity is real (random), not zero, and no two layers share a tensor's bytes
    # (an exporter would merge identical initializers into one buffer and cut the weight traffic)
    assert big.model.layers[-1].mlp.down_proj.weight.abs().mean() > 1e-3
    for name in ("self_attn.o_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"):
        tensors = [layer.get_submodule(name).weight for layer in big.model.layers]
        assert not any(torch.equal(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1:]), name


def test_inflate_refuses_to_shrink():
    model = load_checkpoint(DEMO_DIR / "target")
    with pytest.raises(SpecrtError, match="only grow"):
        inflate_model(model, InflateConfig(src=DEMO_DIR, out=DEMO_DIR, hidden_size=64, num_heads=1))


def test_presets_and_overrides():
    assert InflateConfig(preset="7b").sizes() == (4096, 11008, 32, 64) == PRESETS["7b"]
    assert InflateConfig(preset="1b", num_layers=4).sizes() == (2048, 5632, 4, 32)
    assert InflateConfig().sizes() == PRESETS["150m"]
    # fitted to a source's heads where the preset's do not divide: SmolLM2's 64-dim heads in groups of 3
    assert InflateConfig(preset="7b").sizes(head_dim=64, groups=3) == (4032, 11008, 32, 63)
    assert InflateConfig(preset="7b").sizes(head_dim=128, groups=4) == (4096, 11008, 32, 32)
    assert InflateConfig(preset="7b").sizes(head_dim=64, groups=1) == PRESETS["7b"]  # fits: unchanged
    assert InflateConfig(preset="7b", num_heads=60).sizes(head_dim=64, groups=3) == (4096, 11008, 32, 60)  # given


def test_a_real_checkpoint_inflates_to_the_same_function(smollm2, tmp_path):
    """SmolLM2's first layers (real weights: tied embeddings, 9 heads in groups of 3, RoPE base 1e5) inflated: the same
    logits, and a checkpoint written whole (its tokenizer and chat template beside it)."""
    import json

    from tests.conftest import first_layers

    src = first_layers(smollm2, tmp_path / "src", 4)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2 / f).is_file():
            (src / f).write_bytes((smollm2 / f).read_bytes())
    cfg = InflateConfig(src=src, out=tmp_path / "big", hidden_size=768, intermediate_size=2048, num_layers=6,
                        num_heads=12, device="cpu")
    inflate(cfg)
    assert json.loads((tmp_path / "big" / "inflate.json").read_text())["sizes"] == [768, 2048, 6, 12]
    assert (tmp_path / "big" / "tokenizer.json").is_file() and not list(tmp_path.glob(".big.tmp-*"))
    small, big = load_checkpoint(src), load_checkpoint(tmp_path / "big")
    assert big.config.tie_word_embeddings and big.config.num_key_value_heads == 4
    ids = torch.randint(0, small.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits
    assert (a - b).abs().max() < 1e-4 * a.abs().max(), (a - b).abs().max()


def test_float16_inflation_writes_a_checkpoint_with_the_same_function(tmp_path):
    import json

    cfg = InflateConfig(out=tmp_path / "big", hidden_size=384, intermediate_size=1024, num_layers=3, num_heads=6,
                        dtype="float16", device="cpu")
    inflate(cfg)
    record = json.loads((tmp_path / "big" / "inflate.json").read_text())
    assert record["sizes"] == [384, 1024, 3, 6] and record["device"] == "cpu" and record["dtype"] == "float16"
    big, small = load_checkpoint(tmp_path / "big", "float16"), load_checkpoint(DEMO_DIR / "target")
    assert next(big.parameters()).dtype == torch.float16
    ids = torch.randint(0, small.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits.float()
    assert (a - b).abs().max() < 0.1 and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_an_inflated_head_beside_its_inflated_target_computes_what_the_head_computes(eagle_head, tmp_path):
    """An EAGLE head grown by the options that grow its target (the demo target's head, as call real grows a real
    target's): fed the inflated target's hidden states it gives the head's logits, and hidden states of the head's
    first d dims, the rest exactly zero; its record, head vocabulary and held-out prompts come along."""
    import json

    from specrt.contract import EAGLE_HEAD, HEAD_VOCABULARY
    from specrt.model.eagle import assemble_eagle

    head_dir = eagle_head[0].dest
    sizes = dict(hidden_size=384, intermediate_size=1024, num_layers=4, num_heads=6, device="cpu")
    inflate(InflateConfig(src=DEMO_DIR / "target", out=tmp_path / "target", **sizes))
    inflate(InflateConfig(src=head_dir, out=tmp_path / "head", **sizes))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config[EAGLE_HEAD]["hidden_size"] == 384 and config[EAGLE_HEAD]["inflated_from"] == str(head_dir)
    assert config[HEAD_VOCABULARY] == json.loads((head_dir / "config.json").read_text())[HEAD_VOCABULARY]
    assert {"eagle.json", "validation-prompts.jsonl", "inflate.json"} <= {f.name for f in (tmp_path / "head").iterdir()}
    heads = []
    for target_dir, head in ((DEMO_DIR / "target", head_dir), (tmp_path / "target", tmp_path / "head")):
        target = load_checkpoint(target_dir)
        heads.append((target, assemble_eagle(head, target)))
    d = heads[0][0].config.hidden_size
    ids = torch.randint(0, heads[0][0].config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    out = []
    with torch.no_grad():
        for target, head in heads:
            features = target.model(ids).last_hidden_state  # after the final norm: contract.HIDDEN
            rows = head.fc(torch.cat([head.model.embed_tokens(ids[:, 1:]), features[:, :-1]], dim=-1))
            hidden = head.model(inputs_embeds=rows).last_hidden_state
            out.append((features, head.lm_head(hidden), hidden))
    (f_small, logits_small, h_small), (f_big, logits_big, h_big) = out
    assert torch.allclose(f_big[..., :d], f_small, atol=1e-4) and not f_big[..., d:].any()
    assert (logits_big - logits_small).abs().max() < 1e-4 * logits_small.abs().max()
    assert torch.allclose(h_big[..., :d], h_small, atol=1e-4) and not h_big[..., d:].any()
    assert heads[1][1].model.layers[0].mlp.down_proj.weight.abs().mean() > 1e-3  # added capacity real, not zero


def test_a_head_is_refused_where_its_target_would_shrink(eagle_head, tmp_path):
    with pytest.raises(SpecrtError, match="only grow"):
        inflate(InflateConfig(src=eagle_head[0].dest, out=tmp_path / "head", hidden_size=64, num_heads=1,
                              device="cpu"))

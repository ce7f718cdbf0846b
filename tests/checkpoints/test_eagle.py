"""`specrt models eagle`: a head that extends the target's own hidden state; every depth of its chains computed at
once is what feeding each chain in turn computes, and trained on the target's text it guesses the target's tokens."""

from __future__ import annotations

import json

import pytest

SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 96, "rms_norm_eps": 1e-5, "rope_theta": 1e4}


def test_every_depth_at_once_is_each_chain_fed_in_turn():
    import torch

    from specrt.checkpoints.eagle_head import EagleHead

    torch.manual_seed(0)
    head = EagleHead(SHAPE).eval()
    embed = torch.randn(40, 64)
    features, tokens = torch.randn(2, 9, 64), torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        outs = head.chain(embed, features, tokens, 3)
        for p in (0, 3, 5):
            fed_f, fed_t = features[:, :p + 1], tokens[:, :p + 1]
            for d in range(1, 4):  # depth d at p: the chain's inputs so far, its own last prediction fed back
                last = head.chain(embed, fed_f, fed_t, 1)[0][:, -1]
                torch.testing.assert_close(last, outs[d - 1][:, p], rtol=1e-4, atol=1e-5)
                fed_f = torch.cat([fed_f, last[:, None]], 1)
                fed_t = torch.cat([fed_t, tokens[:, p + d:p + d + 1]], 1)
        # a depth-2 prediction does not read the true features after its start
        changed = features.clone()
        changed[:, 5:] = 0
        torch.testing.assert_close(head.chain(embed, changed, tokens, 2)[1][:, 3], outs[1][:, 3])


@pytest.fixture(scope="module")
def made(eagle_head):
    return eagle_head


def test_the_head_learns_to_guess_the_targets_tokens_and_is_kept(made):
    from specrt.checkpoints.draft import PROMPTS
    from specrt.checkpoints.eagle import RECORD, make_eagle
    from specrt.contract import EAGLE_HEAD as KIND
    from specrt.contract import HEAD_VOCABULARY

    cfg, record = made
    before, after = record["before"], record["after"]
    assert after["first_guess"] > before["first_guess"] + 0.1, record
    assert after["accepted_per_round"] > after["first_guess"] + 0.05 and after["depth"] == 3  # deeper guesses land
    assert set(after["by_kind"]) == {"code", "prose"}  # source windows are not the target's writing
    assert json.loads((cfg.dest / RECORD).read_text()) == record
    held_out = [json.loads(line) for line in (cfg.dest / PROMPTS).read_text().splitlines()]  # for calibrate --prompts
    assert len(held_out) >= cfg.val_prompts and all(p["prompt"] for p in held_out)
    config = json.loads((cfg.dest / "config.json").read_text())
    assert len(config[HEAD_VOCABULARY]) == 512 and config[KIND]["key"] == record["key"]
    stamp = (cfg.dest / "model.safetensors").stat().st_mtime_ns
    assert make_eagle(cfg, progress=False) == record  # the same inputs: kept
    assert (cfg.dest / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_head_keeps_the_text_it_learnt_from_for_the_ngram_prior(made):
    import numpy as np

    from specrt.checkpoints import teacher
    from specrt.checkpoints.draft import TEXT

    cfg, record = made
    corpus, train = teacher.build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("train"), cfg.cache, "train",
                                         progress=False)
    assert train["key"] == record["teacher"]["train"]["key"]
    with np.load(cfg.dest / TEXT) as z:  # what a bundle's prior is made of (call real carries it with the head)
        assert (z["ids"] == corpus.ids).all() and (z["offsets"] == corpus.offsets).all()


def test_the_saved_head_is_the_trained_one_by_hugging_face_names(made):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specrt.checkpoints.eagle import Features, acceptance, target_features
    from specrt.contract import EAGLE_HEAD as KIND
    from specrt.checkpoints.eagle_head import EagleHead
    from specrt.checkpoints.teacher import build_corpus
    from specrt.contract import HEAD_VOCABULARY

    cfg, record = made
    weights = load_file(str(cfg.dest / "model.safetensors"))
    assert {"fc.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight"} <= set(weights)
    config = json.loads((cfg.dest / "config.json").read_text())
    head = EagleHead({k: v for k, v in config[KIND].items() if k not in ("target", "key")})
    head.load_state_dict(weights)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32)
    val, _ = build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("validation"), cfg.cache, "validation",
                          progress=False)
    data = target_features(target, val, cfg.seq_len)
    assert isinstance(data, Features) and len(data.ids) == sum(k != "source" for k in val.kinds)
    again = acceptance(head, data, target.get_input_embeddings().weight.detach(),
                       target.get_output_embeddings().weight.detach(), config[HEAD_VOCABULARY], cfg.eval_depth)
    assert again == record["after"]


def test_a_target_that_is_not_a_checkpoint_is_refused(tmp_path):
    from specrt.checkpoints.eagle import EagleConfig, make_eagle
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="not a Hugging Face checkpoint"):
        make_eagle(EagleConfig(target=tmp_path, cache=tmp_path / "cache"), progress=False)


def test_a_device_pytorch_cannot_use_is_refused_by_either_writer_in_one_line(tmp_path):
    from specrt.checkpoints import DEMO_DIR
    from specrt.checkpoints.draft import DraftConfig, make_draft
    from specrt.checkpoints.eagle import EagleConfig, make_eagle
    from specrt.errors import SpecrtError

    for make, config in ((make_draft, DraftConfig), (make_eagle, EagleConfig)):
        cfg = config(target=DEMO_DIR / "target", tokenizer=DEMO_DIR / "tokenizer", out=tmp_path / make.__name__,
                     cache=tmp_path / "cache", device="nodevice")
        with pytest.raises(SpecrtError, match="^--device nodevice: PyTorch .* cannot use it here"):
            make(cfg, progress=False)
        assert not (tmp_path / "cache").exists()  # refused before any text is written


@pytest.mark.gpu
def test_a_head_trains_on_a_gpu_and_is_saved_for_the_cpu(made, tmp_path):
    """`specrt models eagle --device cuda` (a lent GPU's distill call): the target's text, its features and the head's
    training on the device, the head it saves as good as the CPU's."""
    from dataclasses import replace

    import torch
    from safetensors.torch import load_file

    from specrt.checkpoints.eagle import make_eagle

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg, cpu = made
    record = make_eagle(replace(cfg, out=tmp_path / "head", cache=tmp_path / "cache", device="cuda"), progress=False)
    assert record["device"] == "cuda" and record["key"] == cpu["key"]  # the device is recorded, not keyed
    assert record["after"]["first_guess"] > record["before"]["first_guess"] + 0.1, record
    assert {t.device.type for t in load_file(str(tmp_path / "head" / "model.safetensors")).values()} == {"cpu"}


def test_neither_writer_replaces_a_directory_it_did_not_make(made, tmp_path):
    from dataclasses import replace

    from specrt.checkpoints.draft import DraftConfig, make_draft
    from specrt.checkpoints.eagle import make_eagle
    from specrt.errors import SpecrtError

    cfg, _ = made
    with pytest.raises(SpecrtError, match="is a non-empty directory that is not a draft"):  # the head's directory
        make_draft(DraftConfig(target=cfg.target, tokenizer=cfg.tokenizer, out=cfg.dest, cache=cfg.cache), False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(SpecrtError, match="is a non-empty directory that is not a head"):
        make_eagle(replace(cfg, out=mine), progress=False)
    assert (mine / "notes.txt").read_text() == "mine" and (cfg.dest / "eagle.json").is_file()


def test_a_heads_rope_is_its_targets_and_a_gemma3_targets_global_layers(tmp_path):
    """The head's RoPE base: a Llama target's; a Gemma 3 target's global layers' (transformers 5 keys its RoPE by layer
    type), whose attention reads every position as the head's does, not the sliding layers'."""
    from specrt.checkpoints import DEMO_DIR
    from specrt.checkpoints.eagle_head import head_shape
    from specrt.model.checkpoint import load_config
    from tests.export.test_architectures import _tiny

    gemma3 = _tiny("gemma3", tmp_path / "g").config
    assert gemma3.rope_parameters["sliding_attention"]["rope_theta"] == 100.0  # the test's local base
    assert head_shape(gemma3)["rope_theta"] == gemma3.rope_parameters["full_attention"]["rope_theta"] != 100.0
    demo = load_config(DEMO_DIR / "target")
    assert head_shape(demo)["rope_theta"] == demo.rope_parameters["rope_theta"]

"""What PPD's prompt tokens train and are measured on: the target's own greedy continuations, of training prompts
(corpus own) and of held-out windows or your own prompts."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import PromptTokens
from specrt.engines.ppd import PpdConfig, train_prompt_tokens
from specrt.errors import SpecrtError



def test_guess_accuracy_is_scored_against_the_targets_own_greedy_continuation():
    """PPD's guesses are verified against the target's argmax after its own tokens, so the accuracy tables (and the
    trees built from them) score guesses on greedy continuations of held-out windows, not on the text."""
    import torch

    from specrt.checkpoints import DEMO_DIR
    from specrt.engines.ppd import greedy_windows
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    module = StepModule(load_checkpoint(DEMO_DIR / "target", "float32", "cpu")).eval()
    windows = np.random.default_rng(0).integers(0, 4096, (3, 24))
    g = greedy_windows(module, windows.tolist(), 12, batch=2)
    assert g.shape == (3, 24) and (g[:, :12] == windows[:, :12]).all()
    assert (g[:, 12:] != windows[:, 12:]).any()
    # teacher-forced over whole windows, each token of the second half is the argmax after the tokens before it
    past = [torch.zeros(3, module.num_kv_heads, 0, module.head_dim) for _ in range(2 * module.num_layers)]
    with torch.no_grad():
        logits = module(torch.from_numpy(g), torch.arange(24).expand(3, 24),
                        torch.ones(3, 24, 24, dtype=torch.bool).tril(), *past)[0]
    assert (logits[:, 11:-1].argmax(-1).numpy() == g[:, 12:]).all()


def test_the_own_corpus_trains_on_the_targets_greedy_continuations_of_training_prompts(demo_bundle):
    """corpus "own": each window is the last quarter-window of a mixed training prompt and the target's own greedy
    tokens after it (what decoding reads), never a validation prompt."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from specrt.checkpoints import DEMO_DIR
    from specrt.checkpoints.prompt_mix import mixed_prompts
    from specrt.engines.ppd import PpdConfig, greedy_windows, training_windows
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    module = StepModule(load_checkpoint(DEMO_DIR / "target", "float32", "cpu")).eval()
    tokenizer = Tokenizer.from_file(str(demo_bundle / "tokenizer" / "tokenizer.json"))
    encode = (lambda text: tokenizer.encode(text).ids)
    cfg = PpdConfig(bundle=demo_bundle, corpus="own", window=32, batch_size=2)
    windows = np.array(training_windows(cfg, module, demo_bundle / "tokenizer", encode))
    assert windows.shape == (64, 32)
    assert (greedy_windows(module, windows.tolist(), 8) == windows).all()  # past 8 prompt tokens: the target's own
    train = {tuple(encode(p.text)[-8:]) for p in mixed_prompts(AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer"),
                                                               128, "train")}
    assert {tuple(w[:8]) for w in windows.tolist()} <= train
    stdlib = np.array(training_windows(PpdConfig(bundle=demo_bundle, window=32, batch_size=2), module,
                                       demo_bundle / "tokenizer", encode))
    assert stdlib.shape == (64, 32) and (greedy_windows(module, stdlib.tolist(), 8) != stdlib).any()


def test_accuracy_is_measured_on_your_own_prompts(ppd_bundle, tmp_path):
    """--prompts: the validation windows end in the user's prompts (no training: --prompts-from), the file's hash is
    recorded, and too few prompts long enough for the window are refused in one line."""
    import json

    from specrt.bench.prompts import humaneval_prompts
    from specrt.bundle.manifest import sha256_file

    b = tmp_path / "b"
    shutil.copytree(ppd_bundle, b)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in humaneval_prompts(20)[10:]))
    cfg = PpdConfig(bundle=b, prompts_from=ppd_bundle, prompts=prompts, val_windows=6, window=64, budgets=(4,))
    t = train_prompt_tokens(cfg, progress=False)
    assert t.training["validation"] == {"prompts_sha256": sha256_file(prompts)}
    assert t.accuracy != artifacts.load(ppd_bundle, PromptTokens).accuracy  # other text, other accuracy
    assert "corpus_sha256" in artifacts.load(ppd_bundle, PromptTokens).training["validation"]
    with pytest.raises(SpecrtError, match="has 10 prompt\\(s\\) of at least 32 tokens \\(--window 64 / 2\\); "
                                          "--val-windows asks for 11"):
        train_prompt_tokens(replace(cfg, val_windows=11), progress=False)
    # each window: the prompt's last --window / 2 tokens, then --max-new-tokens for the target's own continuation
    from tokenizers import Tokenizer

    from specrt.engines.ppd import validation_windows

    encode = Tokenizer.from_file(str(b / "tokenizer" / "tokenizer.json")).encode
    windows = validation_windows(replace(cfg, new_tokens=40), lambda text: encode(text).ids)
    long_enough = [ids for ids in (encode(p).ids for p in humaneval_prompts(20)[10:]) if len(ids) >= 32]
    assert [w[:32] for w in windows] == [ids[-32:] for ids in long_enough[:6]] and {len(w) for w in windows} == {72}

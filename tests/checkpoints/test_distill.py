"""`specrt models distill`: a draft trained on its target's distributions agrees with it more often on held-out text,
and is written whole beside its record."""

from __future__ import annotations

import json

import pytest

from specrt.checkpoints import DEMO_DIR
from specrt.errors import SpecrtError


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The demo target, a random tiny draft over its vocabulary, and a corpus of a few stdlib files."""
    import shutil

    from specrt.checkpoints.corpus import is_validation, stdlib_root
    from specrt.checkpoints.train import ModelConfig, build_model

    root = tmp_path_factory.mktemp("distill")
    vocab, eos = 4096, 0
    build_model(ModelConfig(32, 64, 1, 2, 1), vocab, eos, seed=2).save_pretrained(root / "draft")
    corpus = root / "corpus"
    corpus.mkdir()
    picked = {True: [], False: []}  # small top-level modules, some of them in the held-out split
    for path in sorted(stdlib_root().glob("*.py")):
        held_out = is_validation(path.name)
        if path.stat().st_size < 40_000 and len(picked[held_out]) < (2 if held_out else 12):
            picked[held_out].append(path)
    for path in picked[True] + picked[False]:
        shutil.copy(path, corpus / path.name)
    return root


def test_distilling_raises_the_drafts_agreement_with_its_target_on_held_out_text(tiny_pair):
    from transformers import AutoModelForCausalLM

    from specrt.checkpoints.corpus import load_corpus
    from specrt.checkpoints.distill import DistillConfig, distill

    train, val = load_corpus(tiny_pair / "corpus")
    assert train and val  # the path-hash split holds some of the files out
    out = tiny_pair / "out" / "draft"
    cfg = DistillConfig(target=DEMO_DIR / "target", draft=tiny_pair / "draft", out=out, corpus=tiny_pair / "corpus",
                        steps=40, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=5, eval_windows=16, threads=1)
    record = distill(cfg, progress=False)
    before, after = record["before"], record["after"]
    assert after["kl"] < 0.8 * before["kl"], record
    assert after["top1_agreement"] > before["top1_agreement"], record
    assert json.loads((out / "distill.json").read_text())["after"] == after
    draft = AutoModelForCausalLM.from_pretrained(out)  # a checkpoint the exporter reads as any other
    assert draft.config.vocab_size == 4096 and not list(out.parent.glob(".draft.*"))  # nothing left beside it


def test_a_draft_over_another_vocabulary_or_a_missing_checkpoint_is_refused(tiny_pair, tmp_path):
    from specrt.checkpoints.distill import DistillConfig, distill
    from specrt.checkpoints.train import ModelConfig, build_model

    build_model(ModelConfig(32, 64, 1, 2, 1), 512, 0, seed=3).save_pretrained(tmp_path / "small")
    with pytest.raises(SpecrtError, match="the target's vocabulary has 4096 tokens and the draft's 512"):
        distill(DistillConfig(target=DEMO_DIR / "target", draft=tmp_path / "small", out=tmp_path / "o"),
                progress=False)
    with pytest.raises(SpecrtError, match="is not a Hugging Face checkpoint directory"):
        distill(DistillConfig(target=tmp_path / "nowhere", draft=DEMO_DIR / "draft", out=tmp_path / "o"),
                progress=False)
    assert not (tmp_path / "o").exists()

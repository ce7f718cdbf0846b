"""`specrt models draft`: the target's own text with its top-k predictions (teacher.py), cached by what made it; a
new draft distilled on it agrees with the target more, is kept while its inputs hold, and drafts losslessly."""

from __future__ import annotations

import json

import pytest

from specrt.checkpoints import DEMO_DIR


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A 64-wide one-layer draft for the demo target, distilled for 80 steps on a small teacher corpus."""
    from specrt.checkpoints.draft import DraftConfig, make_draft

    root = tmp_path_factory.mktemp("draft")
    cfg = DraftConfig(target=DEMO_DIR / "target", tokenizer=DEMO_DIR / "tokenizer", out=root / "draft",
                      cache=root / "cache", prompts=48, new_tokens=32, source_windows=16, window=64, top_k=8,
                      gen_batch=8, hidden=64, layers=1, steps=80, batch_size=8, lr=1e-2, val_prompts=8, threads=2)
    return cfg, make_draft(cfg, progress=False)


def test_the_teacher_corpus_holds_the_targets_greedy_tokens_and_is_read_back(made, monkeypatch):
    from specrt.checkpoints import teacher

    cfg, _ = made
    corpus, record = teacher.build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("validation"), cfg.cache,
                                          "validation", progress=False)
    assert set(corpus.kinds) == {"code", "prose", "source"}  # the demo tokenizer has no chat template
    for s in range(len(corpus)):
        ids, first, rows = corpus.sequence(s)
        top = corpus.topk_ids[rows]
        assert (corpus.topk_logp[rows][:, :-1] >= corpus.topk_logp[rows][:, 1:]).all()  # best first
        if corpus.kinds[s] != "source":  # generated greedily: each prediction's best is the token that follows
            assert first + len(top) == len(ids) - 1 and (top[:, 0] == ids[first + 1:]).all()
    monkeypatch.setattr(teacher, "_generate", lambda *a: pytest.fail("the cached corpus was made again"))
    again, same = teacher.build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("validation"), cfg.cache,
                                       "validation", progress=False)
    assert same == record and (again.ids == corpus.ids).all()


def test_the_new_draft_agrees_with_its_target_more_and_is_kept(made):
    from specrt.checkpoints.draft import RECORD, make_draft

    cfg, record = made
    before, after = record["before"], record["after"]
    assert after["top1_agreement"] > before["top1_agreement"] + 0.1, record
    assert after["loss"] < before["loss"]
    assert json.loads((cfg.dest / RECORD).read_text()) == record
    stamp = (cfg.dest / "model.safetensors").stat().st_mtime_ns
    assert make_draft(cfg, progress=False) == record  # the same inputs: kept
    assert (cfg.dest / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_new_draft_drafts_for_its_target_losslessly(made, tmp_path):
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    cfg, record = made
    export_bundle(ExportConfig(target=cfg.target, draft=cfg.dest, tokenizer=cfg.tokenizer_dir, out=tmp_path / "b",
                               exporter="torchscript"), progress=False)
    pipe = Pipeline.load(tmp_path / "b", threads=2)
    prompts = ["def fibonacci(n):\n", "import os\n\n"]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=24)]
    got = pipe.generate(prompts, method="sd", max_new_tokens=24)
    assert [o.token_ids for o in got] == ar
    assert sum(o.stats.accepted for o in got) > 0


def test_the_prompt_mix_takes_turns_until_a_kind_runs_out_and_says_when_all_do():
    from transformers import AutoTokenizer

    from specrt.checkpoints.prompt_mix import mixed_prompts
    from specrt.errors import SpecrtError

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer")  # no chat template: code and prose
    few = mixed_prompts(tokenizer, 6, "validation")
    assert [p.kind for p in few] == ["code", "prose"] * 3
    with pytest.raises(SpecrtError, match=r"asked for 100000 validation prompts; the mix has (\d+) \(code \d+, prose "):
        mixed_prompts(tokenizer, 100_000, "validation")
    prose = sum(p.kind == "prose" for p in mixed_prompts(tokenizer, 20, "validation"))
    assert prose == 10
    assert mixed_prompts(tokenizer, 6, "validation") == few  # seeded
    assert not {p.text for p in few} & {p.text for p in mixed_prompts(tokenizer, 200, "train")}


def test_another_held_out_set_is_measured_again_not_trained_again(made, tmp_path):
    import shutil
    from dataclasses import replace

    from specrt.checkpoints.draft import PROMPTS, make_draft

    cfg, record = made
    shutil.copytree(cfg.dest, tmp_path / "draft")
    again = make_draft(replace(cfg, out=tmp_path / "draft", val_prompts=4), progress=False)
    assert again["key"] == record["key"] and again["history"] == record["history"]  # the same weights
    assert again["after"]["predictions"] < record["after"]["predictions"]  # measured on the other set
    assert len((tmp_path / "draft" / PROMPTS).read_text().splitlines()) == 4


def test_the_draft_keeps_the_text_it_learnt_from_for_the_ngram_prior(made):
    import numpy as np

    from specrt.checkpoints import teacher
    from specrt.checkpoints.draft import TEXT

    cfg, record = made
    corpus, train = teacher.build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("train"), cfg.cache, "train",
                                         progress=False)
    assert train["key"] == record["teacher"]["train"]["key"]
    with np.load(cfg.dest / TEXT) as z:
        assert (z["ids"] == corpus.ids).all() and (z["offsets"] == corpus.offsets).all()


def test_a_half_precision_draft_is_another_artifact_and_still_drafts(made, tmp_path):
    from dataclasses import replace

    from safetensors import safe_open

    from specrt.checkpoints.draft import make_draft

    cfg, record = made
    half = replace(cfg, out=tmp_path / "half", save_dtype="float16", steps=4)
    got = make_draft(half, progress=False)
    assert got["key"] != record["key"] and got["config"]["save_dtype"] == "float16" and got["device"] == "cpu"
    with safe_open(str(tmp_path / "half" / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.float16"}


def test_a_time_limit_cuts_the_steps_to_what_fits_and_keys_the_draft_by_them(made, tmp_path):
    from dataclasses import replace

    from specrt.checkpoints.draft import PACE_STEPS, draft_key, make_draft

    cfg, record = made
    full = replace(cfg, out=tmp_path / "full", steps=400)
    cut = make_draft(replace(full, out=tmp_path / "cut", time_limit=0.001), progress=False)  # no time left after the pace
    assert cut["steps_run"] == PACE_STEPS and cut["time_limited"].startswith(f"{PACE_STEPS} of 400 steps")
    assert cut["key"] == draft_key(replace(full, steps=PACE_STEPS), cut["teacher"]["train"]["key"])
    assert cut["history"][-1]["step"] == PACE_STEPS - 1
    roomy = make_draft(replace(full, out=tmp_path / "roomy", steps=30, time_limit=3600), progress=False)
    assert roomy["steps_run"] == 30 and "time_limited" not in roomy
    assert roomy["key"] == draft_key(replace(full, steps=30), roomy["teacher"]["train"]["key"])  # the limit not keyed


def test_a_draft_whose_head_scores_the_most_frequent_ids_learns_and_drafts_losslessly(made, tmp_path):
    from dataclasses import replace

    import numpy as np

    from specrt.checkpoints import teacher
    from specrt.checkpoints.draft import make_draft
    from specrt.contract import HEAD_VOCABULARY
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    cfg, whole = made
    small = replace(cfg, out=tmp_path / "small", head_vocab=512)
    record = make_draft(small, progress=False)
    config = json.loads((small.dest / "config.json").read_text())
    kept = config[HEAD_VOCABULARY]
    assert len(kept) == len(set(kept)) == 512 == record["head_vocabulary"]["size"]
    assert kept[0] == config["eos_token_id"]  # its end token first, whatever its count
    corpus, _ = teacher.build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("train"), cfg.cache, "train",
                                     progress=False)
    assert set(np.argsort(-np.bincount(corpus.ids))[:100].tolist()) <= set(kept)  # the text's most frequent ids
    assert 0.5 < record["head_vocabulary"]["scored_share_of_held_out_predictions"] < 1
    assert record["key"] != whole["key"]
    assert record["after"]["top1_agreement"] > record["before"]["top1_agreement"] + 0.1, record

    export_bundle(ExportConfig(target=cfg.target, draft=small.dest, tokenizer=cfg.tokenizer_dir, out=tmp_path / "b"),
                  progress=False)
    pipe = Pipeline.load(tmp_path / "b", threads=2)
    prompts = ["def fibonacci(n):\n", "import os\n\n"]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=24)]
    got = pipe.generate(prompts, method="sd", max_new_tokens=24, batch_size=2)
    assert [o.token_ids for o in got] == ar and sum(o.stats.accepted for o in got) > 0
    every = make_draft(replace(small, out=tmp_path / "every", head_vocab=4096, steps=4), progress=False)
    assert "head_vocabulary" not in every  # a vocabulary of no more ids: its head scores them all
    assert HEAD_VOCABULARY not in json.loads((tmp_path / "every" / "config.json").read_text())

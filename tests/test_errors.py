"""Bad input gets one clear error (a SpecrtError subclass; the CLI prints one line, no traceback)."""

import json
import shutil
import subprocess
import sys

import pytest

from specrt.errors import BundleError, InvalidRequestError, SpecrtError, UnsupportedModelError
from specrt.models import DEMO_DIR
from specrt.runtime.pipeline import Pipeline


def test_missing_bundle(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        Pipeline.load(tmp_path / "nope")
    with pytest.raises(BundleError, match="manifest.json is missing"):
        Pipeline.load(tmp_path)


def test_corrupt_bundle(demo_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(demo_bundle, copy)
    with open(copy / "draft.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\0\0\0\0")
    with pytest.raises(BundleError, match="draft.onnx does not match its sha256"):
        Pipeline.load(copy)
    (copy / "draft.onnx").unlink()
    with pytest.raises(BundleError, match="missing draft.onnx"):
        Pipeline.load(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        Pipeline.load(copy)


def _export(tmp_path, target, draft, tokenizer=DEMO_DIR / "tokenizer"):
    from specrt.export.onnx_export import ExportConfig, export_bundle

    return export_bundle(ExportConfig(target=target, draft=draft, out=tmp_path / "out", tokenizer=tokenizer), progress=False)


def test_unsupported_architecture(tmp_path):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2' is not supported"):
        _export(tmp_path, ckpt, DEMO_DIR / "draft")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(SpecrtError, match="no config.json"):
        _export(tmp_path, tmp_path, DEMO_DIR / "draft")


def test_tokenizer_mismatch(tmp_path):
    from transformers import AutoTokenizer

    draft = tmp_path / "draft"
    shutil.copytree(DEMO_DIR / "draft", draft)
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer")
    tok.add_tokens(["<extra_token>"])
    vocab = json.loads(tok.backend_tokenizer.to_str())
    vocab["added_tokens"][0]["content"] = "<|other|>"  # same size, different token at id 0
    (draft / "tokenizer.json").write_text(json.dumps(vocab))
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_DIR / "tokenizer" / f, draft / f)
    with pytest.raises(SpecrtError, match="tokenizers differ"):
        _export(tmp_path, DEMO_DIR / "target", draft)


def test_vocab_size_mismatch(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(DEMO_DIR / "draft", draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["vocab_size"] += 8
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecrtError, match="vocabularies differ"):
        _export(tmp_path, DEMO_DIR / "target", draft)


def test_prompt_longer_than_context(pipelines):
    pipe = pipelines["ort"]
    with pytest.raises(InvalidRequestError, match="more than the context"):
        pipe.generate("x " * (pipe.max_context + 10), max_new_tokens=4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(method="beam"), "unknown method"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(num_draft_tokens=0), "num_draft_tokens"),
    (dict(batch_size=0), "batch_size"),
    (dict(method="tree", tree=[(0, 1)]), "invalid tree"),
    (dict(num_beam=4), "unknown method option.*num_beams"),
    (dict(method="mtad", num_beams=2, verify_beams=3), "verify_beams"),
    (dict(method="anpd", ngram_branches=0), "ngram_branches"),
    (dict(method="anpd", ngram_min_prob=1.5), "ngram_min_prob"),
    (dict(method="dynamic", tree_depth=0), "tree_depth"),
    (dict(method="anpd", ngram_hardware_aware="yes"), "ngram_hardware_aware"),
    (dict(method="dynamic", draft_temperature=0.0), "draft_temperature"),
    (dict(method="dynamic", draft_temperature="hot"), "draft_temperature"),
    (dict(method="dynamic", ngram_tokens=-1), "ngram_tokens must be"),
    (dict(method="anpd", ngram_tokens=4), "ngram_tokens merges"),
    (dict(method="dynamic", ngram_tokens=4, ngram_hardware_aware=True), "anpd' alone"),
])
def test_invalid_parameters(pipelines, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        pipelines["ort"].generate("def f():", **kwargs)


def test_invalid_prompts(pipelines):
    pipe = pipelines["ort"]
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        pipe.generate([""])
    with pytest.raises(InvalidRequestError, match="token ids"):
        pipe.generate([[1, 2, 10**7]])
    with pytest.raises(InvalidRequestError, match="no prompts"):
        pipe.generate([])


def test_cli_prints_one_line_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "specrt", "generate", "--bundle", str(tmp_path / "missing"), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"specrt: error: bundle directory {tmp_path / 'missing'} does not exist "
                                             "(create one with `specrt export`)"]

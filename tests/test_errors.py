"""Bad input gets one clear error (a SpecrtError subclass; the CLI prints one line, no traceback)."""

import json
import shutil
import subprocess
import sys

import pytest

from specrt.errors import BundleError, InvalidRequestError, SpecrtError, UnsupportedModelError
from specrt.checkpoints import DEMO_DIR
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


def test_export_of_an_unsupported_family_is_one_line_and_exit_2(tmp_path, capsys):
    from specrt.cli import main

    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert main(["export", "--target", str(ckpt), "--draft", str(DEMO_DIR / "draft"),
                 "--tokenizer", str(DEMO_DIR / "tokenizer"), "--out", str(tmp_path / "b")]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("export:")]
    assert len(said) == 1 and "gemma3_text" in said[0]
    assert said[0].startswith("specrt: error: model_type='gpt2' is not supported by the step-graph exporter (supported: ")


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
    vocab = len(AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer"))  # the draft's added tokens come after it
    with pytest.raises(SpecrtError, match=f"tokenizers differ: id {vocab} is no token in the target, '<\\|other\\|>' "
                                          "in the draft; id"):
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
    (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
    (dict(temperature="0.5"), "temperature must be a finite number >= 0, got '0.5'"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be a finite number in \\(0, 1\\]"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(top_k=1.5), "top_k must be an integer >= 0, got 1.5"),
    (dict(seed=-1), "seed must be an integer >= 0, got -1"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(method="beam"), "unknown method 'beam'"),
    (dict(method=None), "unknown method None"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer"),
    (dict(num_draft_tokens=0), "num_draft_tokens must be an integer >= 1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(progress="yes"), "progress must be True or False"),
    (dict(method="tree", tree=[(0, 1)]), "invalid tree"),
    (dict(num_beam=4), "unknown method option\\(s\\) num_beam \\(sd takes: .*num_draft_tokens"),
    (dict(method="sd", tau=0.3), "option\\(s\\) tau do not apply to method 'sd'"),
    (dict(method="autoregressive", num_draft_tokens=4), "num_draft_tokens do not apply to method 'autoregressive' "
                                                        "\\(autoregressive takes: no options\\)"),
    (dict(method="auto", tree=[(0,)]), "tree do not apply to method 'auto'"),
    (dict(method="sd", ngram_n=3), "ngram_n apply to merged n-gram drafts: give ngram_tokens > 0"),
    (dict(method="mtad", num_beams=2, verify_beams=3), "verify_beams must be an integer in \\[1, num_beams=2\\]"),
    (dict(method="anpd", ngram_branches=0), "ngram_branches must be an integer >= 1"),
    (dict(method="anpd", ngram_min_prob=1.5), "ngram_min_prob must be a finite number in \\[0, 1\\]"),
    (dict(method="dynamic", tree_depth=0), "tree_depth must be an integer >= 1"),
    (dict(method="anpd", ngram_hardware_aware="yes"), "ngram_hardware_aware must be True or False"),
    (dict(method="dynamic", draft_temperature=0.0), "draft_temperature must be a finite number > 0"),
    (dict(method="dynamic", draft_temperature="hot"), "draft_temperature must be a finite number"),
    (dict(method="dynamic", ngram_tokens=-1), "ngram_tokens must be an integer >= 0"),
    (dict(method="anpd", ngram_tokens=4), "ngram_tokens do not apply to method 'anpd'"),
    (dict(method="dynamic", ngram_hardware_aware=True), "ngram_hardware_aware apply to merged n-gram drafts: give "
                                                        "ngram_tokens > 0"),
    # refused before a drafter or a tree is built (a chain of 100000 built its O(n^2) mask for minutes, then died)
    (dict(method="sd", num_draft_tokens=100000), "sd with num_draft_tokens=100000 feeds 100001 tokens a round, more "
                                                 "than the 1024 a round may hold"),
    (dict(method="mtad", num_draft_tokens=100, num_beams=100), "mtad with num_draft_tokens=100, num_beams=100 feeds "
                                                               "9902 tokens"),
    (dict(method="dynamic", num_draft_tokens=8, num_beams=400), "dynamic with num_beams=400 feeds 2802 tokens"),
    (dict(method="tree", tree=[[0]] * 2000), "tree with a tree of 2000 nodes feeds 2001 tokens"),
    (dict(method="sd", ngram_tokens=1100), "sd with ngram_tokens=1100 feeds 1105 tokens"),
])
def test_invalid_parameters(pipelines, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        pipelines["ort"].generate("def f():", **kwargs)


@pytest.mark.parametrize("prompts,match", [
    ([""], "empty prompt"),
    ([[1, 2, 10**7]], "prompt token ids must be in \\[0, 4096\\), got 10000000"),
    ([[-1]], "got -1"),
    ([], "no prompts given"),
    (123, "prompts must be a string or a list of prompts .*got int"),
    (None, "got NoneType"),
    (b"def f():", "got bytes"),
    ({"def f():": 1}, "got dict"),
    ([1, 2, 3], "flat sequence of token ids: pass \\[ids\\] for one token-id prompt"),
    ([[1.0, 2.0]], "a prompt must be a string or a sequence of integer token ids, got a sequence holding 1.0"),
    ([[True, 2]], "holding True"),
    ([None], "got NoneType"),
    ([b"x"], "got bytes"),
    (["a\ud800b"], "the prompt is not valid Unicode text: surrogates not allowed at character 1 \\('\\\\ud800'\\)"),
])
def test_invalid_prompts(pipelines, prompts, match):
    with pytest.raises(InvalidRequestError, match=match):
        pipelines["ort"].generate(prompts, max_new_tokens=2)


def test_token_id_prompts_of_any_integer_kind(pipelines):
    import numpy as np

    pipe = pipelines["ort"]
    ids = pipe.encode("def f():")
    want = pipe.generate([ids], max_new_tokens=4)[0].token_ids
    assert pipe.generate([np.asarray(ids, dtype=np.int32)], max_new_tokens=4)[0].token_ids == want
    assert pipe.generate([tuple(np.int64(t) for t in ids)], max_new_tokens=4)[0].token_ids == want
    assert pipe.generate(np.asarray([ids]), max_new_tokens=4)[0].token_ids == want  # a 2-D array: one prompt per row


def test_stream_takes_one_prompt_and_checks_arguments_before_the_first_piece(pipelines):
    pipe = pipelines["ort"]
    with pytest.raises(InvalidRequestError, match="stream takes one prompt .* got a list of 2 prompts"):
        pipe.stream(["a", "b"])
    with pytest.raises(InvalidRequestError, match="temperature"):
        pipe.stream("a", temperature=-1)  # raised by the call itself, not when iterating


@pytest.mark.parametrize("kwargs,match", [
    (dict(threads=0), "threads must be an integer >= 1"),
    (dict(threads=1.5), "threads must be an integer >= 1"),
    (dict(threads=10000), "threads=10000 is more than 4 per core of the .* this process may use"),  # it hung
    (dict(backend="tensorrt"), "unknown backend 'tensorrt' \\(choose from ort, torch, static, trt\\)"),
    (dict(device="cuda:0"), "device 'cuda:0': the ort backend runs on the CPU"),
    (dict(backend="torch", device="gpu"), "device 'gpu' is not a device PyTorch knows"),
    (dict(backend="torch", device=0), "device must be a string"),
])
def test_invalid_load_arguments(demo_bundle, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        Pipeline.load(demo_bundle, **kwargs)


def test_a_cuda_device_without_cuda_is_one_clear_error(demo_bundle):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidRequestError, match="device 'cuda:0': PyTorch .* finds no CUDA device on this machine"):
        Pipeline.load(demo_bundle, backend="torch", device="cuda:0")


def test_cli_prints_one_line_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "specrt", "generate", "--bundle", str(tmp_path / "missing"), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"specrt: error: bundle directory {tmp_path / 'missing'} does not exist "
                                             "(create one with `specrt export`)"]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specrt", *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,match", [
    (["generate", "--prompt", "x", "--seed", "-1"], "argument --seed: the value must be an integer >= 0, got -1"),
    (["generate", "--prompt", "x", "--threads", "0"], "argument --threads: the value must be an integer >= 1"),
    (["generate", "--prompt", "x", "--threads", "10000"], "--threads=10000 is more than 4 per core"),
    (["generate", "--prompt", "x", "--method", "sd", "--tau", "0.2"], "tau do not apply to method 'sd'"),
    (["generate", "--prompt", "x", "--max-new-tokens", "ten"], "argument --max-new-tokens: invalid int value: 'ten'"),
    (["generate", "--prompt", "x", "--method", "tree", "--tree", "[[0], [1"], "argument --tree: invalid JSON"),
    (["profile", "--batch-sizes", "1,x"], "argument --batch-sizes: invalid list of int: '1,x'"),
    (["profile", "--batch-sizes", ""], "--batch-sizes must hold at least one int, got none"),
    (["generate", "--prompt", "x", "--device", "cuda:0"], "device 'cuda:0': the ort backend runs on the CPU"),
    (["build", "--token-profiles", "8,4"], "--token-profiles must be distinct integers >= 1 in ascending order"),
    (["generate", "--prompt", "x", "--backend", "static"], "no engines.json in .*: run `specrt build --bundle"),
])
def test_cli_errors_are_one_line_with_status_2(demo_bundle, args, match):
    import re

    r = _cli(*args, "--bundle", demo_bundle)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(match, lines[0]), lines[0]


def test_a_truncated_plan_is_refused_with_what_to_run(demo_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(demo_bundle, copy)
    (copy / "plan.json").write_text('{"format": 1, "stamp": {"manifest_sha')
    r = _cli("generate", "--bundle", copy, "--prompt", "x", "--method", "auto")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "plan.json is not valid JSON (truncated or edited?" in r.stderr and "re-run `specrt tune --bundle" in r.stderr

"""Shared fixtures: bundles exported once per test session from the committed demo pair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specrt.checkpoints import DEMO_DIR


def _export(out, target="target", draft="draft", dtype="float32", exporter="auto"):
    from specrt.export.onnx_export import ExportConfig, export_bundle

    export_bundle(ExportConfig(target=DEMO_DIR / target, draft=DEMO_DIR / draft, out=out,
                               tokenizer=DEMO_DIR / "tokenizer", dtype=dtype, exporter=exporter), progress=False)
    return out


@pytest.fixture(scope="session")
def demo_bundle(tmp_path_factory):
    """The demo pair exported as a user would (the dynamo exporter), parity checks on (the export raises if parity
    fails)."""
    return _export(tmp_path_factory.mktemp("bundle") / "demo")


@pytest.fixture(scope="session")
def self_draft_bundle(tmp_path_factory):
    """Target drafting for itself: every greedy draft is accepted, which stresses the bookkeeping."""
    return _export(tmp_path_factory.mktemp("bundle") / "self", draft="target", exporter="torchscript")  # faster


@pytest.fixture(scope="session")
def fp16_bundle(tmp_path_factory):
    """The demo pair with float16 weights, activations and K/V (parity checked at export)."""
    return _export(tmp_path_factory.mktemp("bundle") / "fp16", dtype="float16", exporter="torchscript")


@pytest.fixture(scope="session")
def eagle_head(tmp_path_factory):
    """(EagleConfig, record) of an EAGLE head trained briefly on the demo target's text (~20 s)."""
    from specrt.checkpoints.eagle import EagleConfig, make_eagle

    root = tmp_path_factory.mktemp("eagle")
    cfg = EagleConfig(target=DEMO_DIR / "target", tokenizer=DEMO_DIR / "tokenizer", out=root / "eagle",
                      cache=root / "cache", prompts=48, new_tokens=32, source_windows=8, window=64, top_k=4,
                      gen_batch=8, steps=120, batch_size=8, lr=3e-3, val_prompts=8, threads=2, head_vocab=512,
                      depth=2, eval_depth=3)
    return cfg, make_eagle(cfg, progress=False)


@pytest.fixture(scope="session")
def eagle_bundle(eagle_head, tmp_path_factory):
    """The demo target with that head as its draft (the target's step gives its hidden states)."""
    return _export(tmp_path_factory.mktemp("bundle") / "eagle", draft=eagle_head[0].dest, exporter="torchscript")


@pytest.fixture(scope="session")
def humaneval():
    from specrt.bench.prompts import humaneval_prompts

    return humaneval_prompts(20)


@pytest.fixture(scope="session")
def pipelines(demo_bundle):
    from specrt.runtime.pipeline import Pipeline

    return {b: Pipeline.load(demo_bundle, backend=b, threads=2) for b in ("ort", "torch")}


@pytest.fixture(scope="session")
def ppd_bundle(demo_bundle, tmp_path_factory):
    """The demo bundle with PPD's prompt tokens, briefly trained (30 steps: enough for some guesses to be right)."""
    import shutil

    from specrt.engines.ppd import PpdConfig, train_prompt_tokens

    b = tmp_path_factory.mktemp("ppd") / "b"
    shutil.copytree(demo_bundle, b)
    train_prompt_tokens(PpdConfig(bundle=b, steps=30, lr=0.01, val_windows=8, budgets=(2, 4, 8, 16)), progress=False)
    return b


@pytest.fixture(scope="session")
def inplace_bundle(demo_bundle, tmp_path_factory):
    """The demo bundle with its in-graph step graphs (`specrt inplace`: kv_update="inplace")."""
    import shutil

    from specrt.export.inplace import InPlaceConfig, in_place

    b = tmp_path_factory.mktemp("inplace") / "b"
    shutil.copytree(demo_bundle, b)
    in_place(InPlaceConfig(bundle=b), progress=False)
    return b


# -- real checkpoints (specrt models real): made once into build/real and kept between runs -------------------------
REAL_DIR = Path(__file__).resolve().parents[1] / "build" / "real"


def real_checkpoint(name: str) -> Path:
    """`specrt models real NAME` into build/real/NAME (kept while its record holds). Where the package index cannot be
    reached the test is skipped, saying so, unless SPECRT_REQUIRE_REAL=1 (.ci/run sets it: there it must run)."""
    from specrt.checkpoints.real import RealConfig, make_real
    from specrt.errors import SpecrtError

    try:
        return make_real(RealConfig(name=name, out=REAL_DIR / name, downloads=REAL_DIR / "downloads"), progress=False)
    except SpecrtError as e:
        if "cannot be reached" in str(e) and os.environ.get("SPECRT_REQUIRE_REAL") != "1":
            pytest.skip(str(e))
        raise


def first_layers(checkpoint: Path, out: Path, num_layers: int) -> Path:
    """The checkpoint cut to its first layers: a draft sharing its tokenizer, which agrees with it on a quarter of the
    tokens (rejections exercise every rollback path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    cut = {"layer_types": config.layer_types[:num_layers]} if getattr(config, "layer_types", None) else {}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, num_hidden_layers=num_layers, **cut)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2():
    return real_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2, tmp_path_factory):
    """SmolLM2-135M-Instruct with its first two layers as the draft, exported as a user would (defaults: the dynamo
    exporter, parity checks on)."""
    from specrt.export.onnx_export import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("smollm2")
    draft = first_layers(smollm2, root / "draft", 2)
    export_bundle(ExportConfig(target=smollm2, draft=draft, out=root / "bundle"), progress=False)
    return root / "bundle"


@pytest.fixture(scope="session")
def gemma3_bundle(tmp_path_factory):
    """Gemma 3 270M with its first two layers as the draft (a 262144-token vocabulary: 1 GB in float32), exported with
    the defaults: for tests marked slow."""
    from specrt.export.onnx_export import ExportConfig, export_bundle

    target = real_checkpoint("gemma3-270m")
    root = tmp_path_factory.mktemp("gemma3")
    draft = first_layers(target, root / "draft", 2)
    export_bundle(ExportConfig(target=target, draft=draft, out=root / "bundle"), progress=False)
    return root / "bundle"

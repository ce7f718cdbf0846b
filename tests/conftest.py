"""Shared fixtures: bundles exported once per test session from the committed demo pair."""

from __future__ import annotations

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

"""Step-graph parity against PyTorch: random ragged batches, random trees, prefill (S = 0)."""

import json

import onnxruntime as ort
import pytest

from specrt import contract
from specrt.bundle.manifest import MANIFEST
from specrt.checkpoints import DEMO_DIR
from specrt.graphs.parity import PARITY_TOL, check_parity, text_tokens
from specrt.model.checkpoint import load_checkpoint, load_tokenizer
from specrt.model.step import StepModule


@pytest.mark.parametrize("role", ["target", "draft"])
def test_onnx_matches_pytorch(demo_bundle, role):
    sess = ort.InferenceSession(str(demo_bundle / f"{role}.onnx"), providers=["CPUExecutionProvider"])
    step = StepModule(load_checkpoint(DEMO_DIR / role)).eval()
    tokens = text_tokens(load_tokenizer(DEMO_DIR / "tokenizer"), step.hf.config.vocab_size)
    report = check_parity(sess, step, tokens, num_cases=10, seed=123)
    assert report.cases == 10 and report.rows > 10
    assert report.ok() and report.max_logit_err <= PARITY_TOL["float32"], report  # the demo's logits are small
    assert report.top1_agreement == 1.0


def test_step_module_matches_hf_forward():
    """Causal mask over an empty cache reproduces the checkpoint's own forward; an incremental step too."""
    import torch

    model = load_checkpoint(DEMO_DIR / "target")
    step = StepModule(model).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        empty = [torch.zeros(2, step.num_kv_heads, 0, step.head_dim) for _ in range(2 * step.num_layers)]
        causal = torch.tril(torch.ones(12, 12, dtype=torch.bool)).expand(2, 12, 12)
        pos = torch.arange(12).expand(2, 12)
        first = step(ids[:, :8], pos[:, :8], causal[:, :8, :8], *empty)
        mask = torch.cat([torch.ones(2, 4, 8, dtype=torch.bool), causal[:, 8:, 8:]], dim=-1)
        second = step(ids[:, 8:], pos[:, 8:], mask, *first[1:])
    assert torch.allclose(first[0], ref[:, :8], atol=1e-5)
    assert torch.allclose(second[0], ref[:, 8:], atol=1e-5)


def test_manifest_records_versions_io_and_hashes(demo_bundle):
    m = json.loads((demo_bundle / MANIFEST).read_text())
    assert {"specrt", "onnx", "onnxruntime", "torch", "transformers"} <= m["versions"].keys()
    assert m["models"]["target"]["num_params"] > m["models"]["draft"]["num_params"]
    assert {"target.onnx", "draft.onnx", "tokenizer/tokenizer.json"} <= m["files"].keys()
    assert m["parity"]["target"]["max_logit_err"] <= PARITY_TOL["float32"]
    sess = ort.InferenceSession(str(demo_bundle / "target.onnx"), providers=["CPUExecutionProvider"])
    layers = m["models"]["target"]["num_layers"]
    assert [i.name for i in sess.get_inputs()] == contract.input_names(layers)
    assert [o.name for o in sess.get_outputs()] == contract.output_names(layers)

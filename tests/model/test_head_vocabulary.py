"""A draft whose LM head scores some of the vocabulary (contract.HEAD_VOCABULARY): the ids it keeps scored as the
whole head scores them, the rest at UNSCORED_LOGIT, in PyTorch and in its step graph alike; the graph's parity check
holds and still catches a graph that scores an id it should not; and it drafts losslessly on both backends, with
token rows packed or not."""

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from specrt import contract
from specrt.bundle.manifest import load_manifest
from specrt.checkpoints import DEMO_DIR
from specrt.errors import UnsupportedModelError
from specrt.graphs.parity import check_parity, text_tokens
from specrt.model.checkpoint import load_checkpoint, load_tokenizer
from specrt.model.step import StepModule


def _with_head_vocabulary(out, kept):
    shutil.copytree(DEMO_DIR / "draft", out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, contract.HEAD_VOCABULARY: [int(i) for i in kept]}))
    return out


@pytest.fixture(scope="module")
def kept():
    vocab = json.loads((DEMO_DIR / "draft" / "config.json").read_text())["vocab_size"]
    return np.random.default_rng(0).permutation(vocab)[:vocab // 3]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, kept):
    from specrt.export.onnx_export import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("head-vocabulary")
    draft = _with_head_vocabulary(root / "draft", kept)
    export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=draft, tokenizer=DEMO_DIR / "tokenizer",
                               out=root / "bundle"), progress=False)
    return root


def _step(ids, step):
    causal = torch.tril(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool)).expand(*ids.shape, ids.shape[1])
    empty = [torch.zeros(ids.shape[0], step.num_kv_heads, 0, step.head_dim) for _ in range(2 * step.num_layers)]
    with torch.no_grad():
        return step(ids, torch.arange(ids.shape[1]).expand(*ids.shape), causal, *empty)[0]


def test_the_kept_ids_are_scored_as_the_whole_head_scores_them_and_the_rest_unscored(bundle, kept):
    whole = StepModule(load_checkpoint(DEMO_DIR / "draft")).eval()
    some = StepModule(load_checkpoint(bundle / "draft")).eval()
    ids = torch.randint(0, whole.hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    want, got = _step(ids, whole), _step(ids, some)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got[..., kept], want[..., kept], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(want.shape[-1]), kept)
    assert (got[..., rest] == contract.UNSCORED_LOGIT).all()
    assert (torch.softmax(got, -1)[..., rest] == 0).all()  # never drafted, at any temperature
    assert np.isin(got.argmax(-1).numpy(), kept).all()


@pytest.mark.parametrize("bad", [[], [3, 3], [-1, 2], [10**6]], ids=["empty", "repeated", "negative", "too-large"])
def test_a_head_vocabulary_that_is_no_set_of_ids_is_refused(tmp_path, bad):
    draft = _with_head_vocabulary(tmp_path / "draft", bad)
    with pytest.raises(UnsupportedModelError, match=contract.HEAD_VOCABULARY):
        StepModule(load_checkpoint(draft))


def test_its_graph_passes_parity_and_one_scoring_an_id_it_does_not_keep_fails(bundle, kept, tmp_path):
    step = StepModule(load_checkpoint(bundle / "draft")).eval()
    tokens = text_tokens(load_tokenizer(DEMO_DIR / "tokenizer"), step.hf.config.vocab_size)
    path = bundle / "bundle" / load_manifest(bundle / "bundle").models["draft"].onnx
    good = check_parity(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), step, tokens, seed=1)
    assert good.ok() and good.top1_agreement == 1.0, good
    assert good.logit_scale < 1e3  # the unscored ids are not the scale the tolerance grows with
    model = onnx.load(str(path))
    tensors = [t for t in model.graph.initializer] + [n.attribute[0].t for n in model.graph.node
                                                       if n.op_type == "Constant" and n.attribute[0].name == "value"]
    ids = next(t for t in tensors if np.array_equal(numpy_helper.to_array(t), kept))  # where the scores are written
    wrong = numpy_helper.to_array(ids).copy()
    wrong[0] = np.setdiff1d(np.arange(step.hf.config.vocab_size), kept)[0]  # an id it does not keep gets a score
    ids.CopyFrom(numpy_helper.from_array(wrong, ids.name))
    onnx.save(model, str(tmp_path / "wrong.onnx"))
    bad = check_parity(ort.InferenceSession(str(tmp_path / "wrong.onnx"), providers=["CPUExecutionProvider"]), step,
                       tokens, seed=1)
    assert not bad.ok() and bad.max_logit_err > 1e29, bad


@pytest.mark.parametrize("backend,packed", [("ort", True), ("ort", False), ("torch", True)],
                         ids=["ort", "ort-unpacked", "torch"])
def test_it_drafts_losslessly_one_at_a_time_and_in_a_ragged_batch(bundle, backend, packed):
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle / "bundle", backend=backend, threads=2, device="cpu", packed_rows=packed)
    prompts = ["def fibonacci(n):\n", "import os\n\nclass Walker:\n", "x = ["]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=32)]
    for method in ("sd", "tree", "dynamic"):
        for batch_size in (1, 3):
            got = pipe.generate(prompts, method=method, max_new_tokens=32, batch_size=batch_size)
            assert [o.token_ids for o in got] == ar, (method, batch_size)
            assert sum(o.stats.accepted for o in got) > 0

"""Nothing a CUDA path runs is left on the host: each of them builds its step on `meta`, a device that holds no data
and refuses, as CUDA does, any op that mixes it with a host tensor. The PyTorch steps (eager, static engines, their
8-bit variants, with and without PPD's prompt tokens), the TensorRT build's reference step and PPD's training loss
run here wholly on meta; a host tensor anywhere in them raises "Tensor on device meta is not on the expected device
cpu"."""

import numpy as np
import pytest
import torch

from specrt.bundle.manifest import load_manifest
from specrt.checkpoints import DEMO_DIR
from specrt.model.checkpoint import load_checkpoint
from specrt.model.quant import load_step_module
from specrt.model.step import InPlaceStepModule, StepModule
from tests.kernels import quant_schemes

META = torch.device("meta")


def _feeds(module, batch=2, num_tokens=3, past=4):
    ids = torch.zeros((batch, num_tokens), dtype=torch.int64, device=META)
    pos = torch.zeros((batch, num_tokens), dtype=torch.int64, device=META)
    kv = [torch.zeros((batch, module.num_kv_heads, past, module.head_dim), device=META)
          for _ in range(2 * module.num_layers)]
    return ids, pos, kv


@pytest.mark.parametrize("prompt_tokens", [False, True])
@pytest.mark.parametrize("quant", [None, *quant_schemes("meta")])
def test_the_step_module_runs_wholly_on_the_weights_device(quant, prompt_tokens):
    prompts = np.zeros((4, 256), dtype=np.float32) if prompt_tokens else None
    module, _ = load_step_module(DEMO_DIR / "target", "float32", "meta", prompts, quant)
    assert {t.device for t in (*module.parameters(), *module.buffers())} == {META}
    ids, pos, kv = _feeds(module)
    mask = torch.ones((2, 3, 4 + 3), dtype=torch.bool, device=META)
    with torch.inference_mode():
        logits, *new_kv = module(ids, pos, mask, *kv)
    assert logits.device == META and logits.shape == (2, 3, module.hf.config.vocab_size)
    assert {t.device for t in new_kv} == {META}


def test_the_in_graph_step_runs_wholly_on_the_weights_device():
    module = InPlaceStepModule(load_checkpoint(DEMO_DIR / "target", "float32", "meta")).eval()
    ids, pos, kv = _feeds(module, past=16)
    mask = torch.ones((2, 3, 16), dtype=torch.bool, device=META)
    with torch.inference_mode():
        logits, *present = module(ids, pos, mask, torch.tensor([1, 2], device=META), *kv)
    assert logits.device == META and {t.device for t in present} == {META}


def _engines(bundle, quant):
    from specrt.bundle.artifacts import EngineSet, Stamp

    return EngineSet(stamp=Stamp.make(bundle), kind="static", token_profiles=(1, 4), batch_buckets=(1, 2), capacity=32,
                     spans=(16, 32), slots=1, device="meta", device_name=None, compute_capability=None, versions={},
                     cuda_graphs=False, build_seconds={}, parity={}, quant=quant, weight_bytes={}, compile=None)


@pytest.mark.parametrize("quant", [None, *quant_schemes("meta")])
@pytest.mark.parametrize("backend", ["torch", "static"])
def test_the_torch_backends_load_and_step_on_the_device(demo_bundle, backend, quant):
    """What `specrt build` and a CUDA pipeline load (the eager step, or the static engines' every shape and cache,
    float or 8-bit), then a step through a runner with the device-argmax head (nothing brought to the host)."""
    from specrt.runtime.backends.pytorch import TorchBackend
    from specrt.runtime.backends.static import StaticTorchBackend

    entry = load_manifest(demo_bundle).models["target"]
    hf_dir = demo_bundle / entry.hf_dir
    if backend == "torch":
        model = TorchBackend(entry, hf_dir, "meta", 1, quant=quant)
    else:
        model = StaticTorchBackend(entry, hf_dir, "meta", 1, _engines(demo_bundle, quant))
    with model.runner() as runner:
        cache = runner.new_cache(2)
        ids = np.zeros((2, 3), dtype=np.int64)
        mask = np.ones((2, 3, cache.capacity + 3), dtype=bool)
        tokens, new_kv = runner.step(ids, ids, mask, cache, head="device-argmax")
    assert tokens.device == META and tokens.shape == (2, 3) and new_kv.device == META
    assert {t.device for t in (*model.module.parameters(), *model.module.buffers())} == {META}


def test_ppd_training_computes_its_loss_and_gradient_on_the_device():
    """`specrt ppd train --device cuda`'s step: the prompt tokens' initial rows, the step over windows with prompt
    blocks, the distillation loss and its gradient, all on the weights' device."""
    from specrt.engines.ppd import _initial, distillation_loss

    k, e = 2, 2
    module = StepModule(load_checkpoint(DEMO_DIR / "target", "float32", "meta")).eval()
    module.prompt_embeddings = torch.nn.Parameter(_initial(module, k, e, seed=0))
    windows = np.arange(2 * 16, dtype=np.int64).reshape(2, 16)
    points = np.array([[4, 8], [5, 9]])
    weights = torch.tensor([1.0, 0.8], device=META)
    loss = distillation_loss(module, windows, points, k, e, module.hf.config.vocab_size, weights)
    loss.backward()
    assert loss.device == META and module.prompt_embeddings.grad.device == META


def test_inflating_a_checkpoint_builds_it_where_the_source_lies():
    """`specrt models inflate --device cuda` (the GPU session's first stage) makes its model on the source's device."""
    from specrt.checkpoints.inflate import InflateConfig, inflate_model

    src = load_checkpoint(DEMO_DIR / "target", "float32", "meta")
    big = inflate_model(src, InflateConfig(hidden_size=384, intermediate_size=1024, num_layers=3, num_heads=6))
    assert {p.device for p in big.parameters()} == {META}

"""`specrt build` (backend static): static-shape engines for both models of a bundle -> engines.json.

The engines are the step module at static shapes (backend "static", runtime/backends/static.py): one
per batch bucket and token-count profile, over one static KV capacity; on CUDA each is warmed up and
captured as a CUDA graph. A CUDA graph cannot be written to disk, so the backend captures them again when
the bundle is loaded. Building does it once on this device to check it: every shape captures (CUDA) or
runs (CPU); a padded static step computes what the eager step computes on the same random feeds (max
|logit| difference per model, within the export's parity tolerance for the dtype per unit of the largest
logit); and it records the
table, the device, its compute capability and the library versions, so that the bundle refuses these
engines on another GPU or library version.

`--compile default|max-autotune` runs the decoder layers through torch.compile first (runtime/backends/static.py):
compiled at build to check them against the eager step, and again wherever the bundle is loaded in a new process
(a compiled graph, like a CUDA graph, is not stored; build_seconds, which includes the build's compiles, bounds it
roughly: inductor's disk cache makes a later compile on the same machine cheaper).

`--quant int8-wo|fp8` builds engines whose projections are 8-bit (model/quant.py), checked against the eager step
of the same quantized module, at quant/S/engines.json beside the float engines (load with --quant S).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import EngineSet, Stamp, environment
from specrt.bundle.machine import resolve_threads
from specrt.bundle.manifest import load_manifest
from specrt.engines.config import BuildConfig
from specrt.errors import SpecrtError
from specrt.runtime.backends import resolve_device


def check_engine_step(backend, rng: np.random.Generator, shapes, tokens: np.ndarray, module=None,
                      per_unit: float | None = None):
    """A ParityReport (graphs.parity.compare) of an engine backend's step against the eager step module, over feeds
    from real text (`tokens`, graphs.parity.text_tokens, with the module's own caches) of the given (batch, new
    tokens) shapes at each of the engines' attention spans (random ragged cache lengths up to it, random token
    trees). `module`: the eager StepModule on the backend's device (default: the backend's own, which the static
    backend has), or any function of the step's inputs giving its outputs; `per_unit`: the tolerance per unit of
    the largest logit (default: the export's parity tolerance for the dtype)."""
    import torch

    from specrt import contract
    from specrt.graphs.parity import compare, real_feeds

    e, capacity = backend.entry, backend.engines.capacity
    module = backend.module if module is None else module
    dims = (e.num_layers, e.num_kv_heads, e.head_dim)
    in_graph = getattr(backend.engines, "kv_update", "runtime") == "inplace"
    # contexts up to each attention span (random lengths up to it: the shorter spans are exercised too)
    cases = [(b, t, s) for b, t in shapes for s in backend.engines.spans]
    candidate, reference = [], []
    with backend.runner() as runner:
        for batch, num_tokens, span in cases:
            # an in-graph engine writes the step's rows into the cache: room for them past the longest sequence
            room = capacity - num_tokens if in_graph else span
            # compiled layers (--compile) are checked against eager ones
            with module.eager() if hasattr(module, "eager") else nullcontext():
                feeds = real_feeds(module, tokens, rng, dims, batch, num_tokens, room, np.dtype(e.dtype),
                                   backend.device)
            cache = runner.new_cache(batch)
            cache.reserve(capacity)  # a growing cache (trt) to the engines' capacity; a static one has it already
            for layer in range(e.num_layers):
                for k, name in enumerate((contract.past_key(layer), contract.past_value(layer))):
                    cache.buffer[layer, k, :, :, :room] = torch.from_numpy(feeds[name]).to(backend.device)
            cache.lengths[:] = feeds[contract.ATTENTION_MASK][:, 0, :room].sum(axis=1)
            ids, pos, mask = (feeds[n] for n in (contract.INPUT_IDS, contract.POSITION_IDS, contract.ATTENTION_MASK))
            step_mask = mask
            if not in_graph and room < capacity:  # the step's mask spans the whole cache, unseen past the room
                step_mask = np.zeros((batch, num_tokens, capacity + num_tokens), dtype=bool)
                step_mask[:, :, :room], step_mask[:, :, capacity:] = mask[:, :, :room], mask[:, :, room:]
            fed = [feeds[contract.FEATURES]] if contract.FEATURES in feeds else []  # a draft head's
            static_logits, _ = runner.step(ids, pos, step_mask, cache, **({"features": fed[0]} if fed else {}))
            with torch.inference_mode(), module.eager() if hasattr(module, "eager") else nullcontext():
                past = [torch.from_numpy(feeds[n]).to(backend.device) for n in contract.input_names(e.num_layers)[3:]]
                eager = module(*(torch.from_numpy(a).to(backend.device) for a in (ids, pos, mask, *fed)), *past)[0]
            # a copy: an engine's output buffer is the next step's too
            candidate.append({contract.LOGITS: np.array(static_logits, dtype=np.float32, copy=True)})
            reference.append({contract.LOGITS: eager.float().cpu().numpy()})
    return compare(candidate, reference, e.dtype, per_unit)


def check_shapes(cfg: BuildConfig) -> list[tuple[int, int]]:
    """(batch, new tokens) an engine build checks: a full shape, a padded profile and a padded batch bucket (where
    the table has room for them)."""
    return sorted({(1, 1), (cfg.batch_buckets[-1], cfg.token_profiles[-1]),
                   (max(1, cfg.batch_buckets[-1] - 1), max(1, cfg.token_profiles[-1] - 3))})


# How far a step with 8-bit activations may differ from its reference, per unit of the largest logit: TensorRT
# running Q/DQ graphs against ONNX Runtime running them, and a padded static step with FP8 projections against its
# eager step. Both quantize the same activations, but where a kernel for another shape sums in another order and one
# activation lands on the neighbouring 8-bit step, the logits move by that step's share (measured on the demo
# target's FP8 engines on the CPU: 9.1e-2 at a largest logit of 14.6, 6e-3 per unit). Not yet measured on a real
# TensorRT build (none runs here): the fake's engines run the graph itself.
QUANT_TOL = 5e-2


def check_tolerance(what: str, report, reference: str = "its eager step") -> None:
    """Refuse an engine whose step differs from its reference beyond the report's tolerance (the export's parity
    tolerance for the dtype per unit of the largest logit: rounding error grows with the logits' magnitude, and a
    float16 GPU kernel picked for a padded shape may sum in another order than the eager shape's; QUANT_TOL for a
    step whose activations are quantized), or whose top tokens differ beyond a tie."""
    if not report.ok():
        raise SpecrtError(f"{what} differs from {reference}: {report}")


def build_static(cfg: BuildConfig, progress: bool = True) -> EngineSet:
    from tqdm import tqdm

    from specrt.graphs.parity import text_tokens
    from specrt.model.checkpoint import load_tokenizer
    from specrt.model.quant import module_bytes
    from specrt.runtime.backends.static import StaticTorchBackend

    device = resolve_device("static", cfg.device)
    threads = resolve_threads(cfg.threads)
    manifest = load_manifest(cfg.bundle, cfg.verify_mode)
    engines = EngineSet(stamp=Stamp.make(cfg.bundle), kind="static", token_profiles=cfg.token_profiles,
                        batch_buckets=cfg.batch_buckets, capacity=cfg.capacity, spans=cfg.attention_spans(),
                        slots=cfg.slots, device=device,
                        **environment(device), cuda_graphs=device.startswith("cuda"), build_seconds={}, parity={},
                        quant=cfg.quant, weight_bytes={}, compile=cfg.compile,
                        projections="none" if cfg.quant else cfg.projections or "all")
    rng = np.random.default_rng(0)
    tokenizer = load_tokenizer(cfg.bundle / manifest.tokenizer)
    seconds, parity, weight_bytes = {}, {}, {}
    for role in tqdm(("target", "draft"), desc="build", unit="model", disable=not progress):
        entry = manifest.models[role]
        t0 = time.perf_counter()
        backend = StaticTorchBackend(entry, cfg.bundle / entry.hf_dir, device, threads, engines)
        report = check_engine_step(backend, rng, check_shapes(cfg), text_tokens(tokenizer, entry.vocab_size),
                                   per_unit=QUANT_TOL if cfg.quant == "fp8" else None)
        check_tolerance(f"the {role}'s static step", report)
        seconds[role], parity[role] = round(time.perf_counter() - t0, 3), report.max_logit_err
        weight_bytes[role] = module_bytes(backend.module, streamed=True)
        del backend
    engines = replace(engines, build_seconds=seconds, parity=parity, weight_bytes=weight_bytes)
    artifacts.save(cfg.bundle, engines, quant=cfg.quant)
    return engines

"""`specrt build`: static-shape engines ("graphs") for both models of a bundle -> engines.json.

The engines are the step module at static shapes (backend "graphs", runtime/backends/static.py): one
per batch bucket and token-count profile, over one static KV capacity; on CUDA each is warmed up and
captured as a CUDA graph. A CUDA graph cannot be written to disk, so the backend captures them again when
the bundle is loaded. Building does it once on this device to check it: every shape captures (CUDA) or
runs (CPU); a padded static step computes what the eager step computes on the same random feeds (max
|logit| difference per model, within the export's parity tolerance for the dtype per unit of the largest
logit); and it records the
table, the device, its compute capability and the library versions, so that the bundle refuses these
engines on another GPU or library version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import EngineSet, Stamp, environment
from specrt.bundle.machine import resolve_threads
from specrt.bundle.manifest import BundleOptions, load_manifest, model_entry
from specrt.config import option
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.runtime.backends import ThreadOptions, resolve_device


@dataclass(frozen=True)
class BuildConfig(BundleOptions, ThreadOptions):
    device: str | None = option(None, "where the engines run: cpu (static steps, no graphs) or cuda[:N] (CUDA graphs; "
                                      "default where present)")
    token_profiles: tuple[int, ...] = option((1, 8, 16, 32, 64, 128), "the largest new-token count of each profile "
                                                                       "(the largest is also the prefill chunk)")
    batch_buckets: tuple[int, ...] = option((1, 2, 4), "the largest batch of each bucket")
    capacity: int = option(2048, "static KV cache capacity: positions per sequence (prompt + new tokens + drafts)", ge=1)
    slots: int = option(1, "calls served at once: each holds a static cache per model (a model drafting for itself "
                           "needs 2)", ge=1)

    def __post_init__(self):
        super().__post_init__()
        for name in ("token_profiles", "batch_buckets"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise InvalidRequestError(f"{name} must be distinct integers >= 1 in ascending order, got {values!r}")


def check_static_step(backend, rng: np.random.Generator, shapes) -> tuple[float, float]:
    """(max |logit| difference between the static (padded) step and the eager step module, max |logit| of the
    eager step) over random feeds of the given (batch, new tokens) shapes at the engines' capacity (random
    ragged cache lengths, random token trees: graphs.parity's feeds)."""
    import torch

    from specrt import contract
    from specrt.graphs.parity import random_feeds

    e, capacity = backend.entry, backend.engines.capacity
    worst = scale = 0.0
    with backend.runner() as runner:
        for batch, num_tokens in shapes:
            feeds = random_feeds(rng, e.num_layers, e.num_kv_heads, e.head_dim, e.vocab_size, batch, num_tokens,
                                 capacity, np.dtype(e.dtype))
            cache = runner.new_cache(batch)
            for layer in range(e.num_layers):
                for k, name in enumerate((contract.past_key(layer), contract.past_value(layer))):
                    cache.buffer[layer, k] = torch.from_numpy(feeds[name])
            ids, pos, mask = (feeds[n] for n in (contract.INPUT_IDS, contract.POSITION_IDS, contract.ATTENTION_MASK))
            static_logits, _ = runner.step(ids, pos, mask, cache)
            with torch.inference_mode():
                past = [torch.from_numpy(feeds[n]).to(backend.device) for n in contract.input_names(e.num_layers)[3:]]
                eager = backend.module(*(torch.from_numpy(a).to(backend.device) for a in (ids, pos, mask)), *past)[0]
            eager = eager.float().cpu().numpy()
            worst = max(worst, float(np.abs(static_logits - eager).max()))
            scale = max(scale, float(np.abs(eager).max()))
    return worst, scale


def build(cfg: BuildConfig, progress: bool = True) -> EngineSet:
    from tqdm import tqdm

    from specrt.graphs.parity import PARITY_TOL
    from specrt.runtime.backends.static import StaticTorchBackend

    device = resolve_device("graphs", cfg.device)
    threads = resolve_threads(cfg.threads)
    manifest = load_manifest(cfg.bundle)
    engines = EngineSet(stamp=Stamp.make(cfg.bundle), kind="graphs", token_profiles=cfg.token_profiles,
                        batch_buckets=cfg.batch_buckets, capacity=cfg.capacity, slots=cfg.slots, device=device,
                        **environment(device), cuda_graphs=device.startswith("cuda"), build_seconds={}, parity={})
    rng = np.random.default_rng(0)
    # a full shape, a padded profile and a padded batch bucket (where the table has room for them)
    shapes = {(1, 1), (cfg.batch_buckets[-1], cfg.token_profiles[-1]),
              (max(1, cfg.batch_buckets[-1] - 1), max(1, cfg.token_profiles[-1] - 3))}
    seconds, parity = {}, {}
    for role in tqdm(("target", "draft"), desc="build", unit="model", disable=not progress):
        entry = model_entry(manifest, role)
        t0 = time.perf_counter()
        backend = StaticTorchBackend(entry, cfg.bundle / entry.hf_dir, device, threads, engines)
        err, scale = check_static_step(backend, rng, sorted(shapes))
        # rounding error grows with the logits' magnitude: the tolerance is per unit of the largest logit (a float16
        # GPU kernel picked for a padded shape may sum in another order than the eager shape's)
        tol = PARITY_TOL[entry.dtype] * max(1.0, scale)
        if err > tol:
            raise SpecrtError(f"the {role}'s static step differs from its eager step by {err:.2e} (tolerance {tol:.2e}: "
                              f"{PARITY_TOL[entry.dtype]} per unit of the largest logit, {scale:.1f})")
        seconds[role], parity[role] = round(time.perf_counter() - t0, 3), err
        del backend
    engines = replace(engines, build_seconds=seconds, parity=parity)
    artifacts.save(cfg.bundle, engines)
    return engines

"""TrtBackend (backend "trt"): a model's step graph as a TensorRT engine (`specrt build --backend trt`).

The plan holds one optimization profile per token-count range of the bundle's profile table (trt-engines.json,
TrtEngineSet), repeated per slot. Each slot is one execution context per profile, all on one scratch buffer
(a slot's steps run one after another); a runner takes a slot for its lifetime (slots.SlotPool), so two
concurrent calls never share a context or a profile. A step of B sequences and T new tokens:

    context = slot's context for the smallest profile >= T
    set_input_shape for every input whose shape changed since that context's last step
    set_tensor_address: token inputs copied into the slot's device buffers; past_key/past_value bound in
        place to the runtime's KV cache (torch tensors on the device); logits and new K/V written into the
        slot's preallocated output buffers (contiguous views of the largest step's size)
    execute_async_v3 on the device's current torch stream; logits come back to the host (one copy)

Engines built with --kv-update inplace (from `specrt inplace`'s graphs, TensorRT >= 10.15) write each step's K/V
into the cache themselves (IKVCacheUpdateLayer): each slot then holds a static cache of the engines' capacity,
the step's mask is moved to the cache's slots (contract.in_graph_mask), write_indices are the sequences'
lengths, each present_key/present_value output is bound to its past input's address (TensorRT requires the
aliasing), and the step returns CacheRows for the runtime to commit where they lie.

Written against the documented TensorRT 10/11 Python API (name-based I/O). It has not run on a machine with
TensorRT: specrt's tests drive it with a recording fake of the tensorrt module (tests/fake_tensorrt.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt import contract
from specrt.bundle.artifacts import TrtEngineSet
from specrt.bundle.manifest import ModelEntry
from specrt.errors import BundleError, InvalidRequestError, SpecrtError
from specrt.runtime.backends.base import copy_input
from specrt.runtime.backends.slots import EngineBackend, SlotPool
from specrt.runtime.kv_cache import CacheRows, KVCache

MIN_TENSORRT = (10, 1)  # ICudaEngine.device_memory_size_v2, IExecutionContext.set_device_memory


class TensorRTUnavailableError(SpecrtError):
    """TensorRT's Python package does not import here, or is older than specrt's API needs."""


def import_tensorrt():
    """The tensorrt module, or one line saying why not and what still runs."""
    elsewhere = ("the ONNX step graphs run with --backend ort, and `specrt build` (backend static) makes CUDA-graph "
                 "engines without TensorRT")
    try:
        import tensorrt
    except (ImportError, OSError) as e:
        raise TensorRTUnavailableError(f"TensorRT's Python package does not import here ({e}): install TensorRT 10.1 or "
                                       f"newer (e.g. `pip install tensorrt-cu12` from NVIDIA's index); {elsewhere}"
                                       ) from None
    version = getattr(tensorrt, "__version__", "0")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < MIN_TENSORRT:
        raise TensorRTUnavailableError(f"TensorRT {version} is older than 10.1, whose I/O and memory API "
                                       f"(set_tensor_address, execute_async_v3, set_device_memory) specrt uses; {elsewhere}")
    return tensorrt


def make_logger(trt):
    """A tensorrt.ILogger that keeps errors (to say why a parse, build or load failed) and drops the chatter."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(str(msg))

    return Logger()


class _Slot:
    """One caller's execution contexts (one per profile), their scratch memory and the step's device buffers."""

    def __init__(self, backend: "TrtBackend", index: int):
        torch, e, eng = backend.torch, backend.entry, backend.engines
        engine, dev = backend.engine, backend.device
        trt = backend.trt
        bmax, tmax, cap = eng.batch_buckets[-1], eng.token_profiles[-1], eng.capacity
        self.scratch = torch.empty(max(1, int(engine.device_memory_size_v2)), dtype=torch.uint8, device=dev)
        self.contexts = []
        for t in range(len(eng.token_profiles)):
            ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if ctx is None:
                raise SpecrtError(f"TensorRT could not create an execution context for the {e.role}'s engine")
            ctx.set_device_memory(self.scratch.data_ptr(), self.scratch.numel())
            if not ctx.set_optimization_profile_async(index * len(eng.token_profiles) + t, backend.stream()):
                raise BundleError(f"the {e.role}'s TensorRT plan has no profile {index * len(eng.token_profiles) + t}: "
                                  f"it does not match trt-engines.json (rebuild it)")
            self.contexts.append(ctx)
        self.shapes: list[dict] = [{} for _ in self.contexts]  # per context: input name -> shape last set
        self.addresses: list[dict] = [{} for _ in self.contexts]  # per context: tensor name -> address last set
        self.ids = torch.zeros(bmax * tmax, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(bmax * tmax, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(bmax * tmax * (cap + tmax), dtype=torch.bool, device=dev)
        self.logits = torch.zeros(bmax * tmax * e.vocab_size, dtype=torch.float32, device=dev)
        self.new_kv = torch.zeros(e.num_layers * 2 * bmax * e.num_kv_heads * tmax * e.head_dim, dtype=backend.dtype,
                                  device=dev)
        self.kv = self.write = None
        if eng.kv_update == "inplace":  # the static cache the engine writes, and where each sequence's rows go
            self.kv = backend.allocate((e.num_layers, 2, bmax, e.num_kv_heads, cap, e.head_dim))
            self.write = torch.zeros(bmax, dtype=torch.int64, device=dev)
            self.new_kv = None


def _view(flat, shape):
    """A contiguous view of the first prod(shape) elements of a flat buffer."""
    return flat[: int(np.prod(shape))].view(shape)


class TrtBackend(EngineBackend):
    name = "trt"

    def __init__(self, entry: ModelEntry, bundle: Path, device: str, engines: TrtEngineSet):
        import torch

        super().__init__(entry)
        self.trt = trt = import_tensorrt()
        self.torch, self.engines = torch, engines
        self.device = torch.device(device)
        self.dtype = getattr(torch, entry.dtype)
        self.max_step_tokens = engines.token_profiles[-1]
        self.static_cache = engines.kv_update == "inplace"  # else each call's cache grows like ONNX Runtime's
        # a sequence joining a running batch is prefilled alone in the static store's next free row: TensorRT binds
        # the cache's address per step, so that row is a cache of its own (KVCache.row_view)
        self.admits_alone = self.static_cache
        path = Path(bundle) / engines.plans[entry.role]
        if not path.is_file() or path.stat().st_size != engines.plan_bytes[entry.role]:
            raise BundleError(f"{path} is missing or not the plan trt-engines.json describes (truncated or replaced?): "
                              f"re-run `{engines.command(bundle)}`")
        self.logger = make_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        if engines.version_compatible:
            self.runtime.engine_host_code_allowed = True  # the plan carries TensorRT's lean runtime: a trusted file
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            why = self.logger.errors[-1] if self.logger.errors else "no reason given"
            raise BundleError(f"TensorRT {trt.__version__} cannot load {path} ({why}): re-run "
                              f"`{engines.command(bundle)}` here (the ONNX step graphs still run with --backend ort)")
        expected = engines.slots * len(engines.token_profiles)
        if self.engine.num_optimization_profiles != expected:
            raise BundleError(f"{path} has {self.engine.num_optimization_profiles} optimization profiles, "
                              f"trt-engines.json says {expected}: re-run `{engines.command(bundle)}`")
        if entry.max_positions < engines.capacity:
            raise BundleError(f"the engines' capacity {engines.capacity} exceeds the {entry.role}'s maximum context of "
                              f"{entry.max_positions}: re-run `{engines.command(bundle)}` with a smaller --capacity")
        self._slots = SlotPool([_Slot(self, i) for i in range(engines.slots)], entry.role, engines.command(bundle))

    def stream(self) -> int:
        """The CUDA stream TensorRT runs on: the device's current torch stream (0 off CUDA)."""
        if self.device.type != "cuda":
            return 0
        return self.torch.cuda.current_stream(self.device).cuda_stream

    def _new_cache(self, slot: _Slot, batch: int, bucket: int) -> KVCache:
        self.engines.for_batch(batch)  # refuse a batch the profiles do not cover, before any step
        e = self.entry
        return KVCache(self.allocate, e.num_layers, batch, e.num_kv_heads, e.head_dim, self.engines.capacity, bucket,
                       e.sliding_window, static=slot.kv)

    def _admission_cache(self, slot: _Slot, batch: KVCache) -> KVCache:
        return batch.row_view()

    def _run(self, slot: _Slot, input_ids, position_ids, attention_mask, cache: KVCache):
        torch, e = self.torch, self.entry
        in_graph = self.engines.kv_update == "inplace"
        batch, num_tokens = input_ids.shape
        capacity = cache.capacity
        if capacity < 1:
            raise ValueError("a TensorRT step needs a cache of capacity >= 1 (reserve before the step)")
        self.engines.for_batch(batch)
        p = self.engines.token_profiles.index(self.engines.for_tokens(num_tokens))
        ctx, shapes, addresses = slot.contexts[p], slot.shapes[p], slot.addresses[p]
        ids = _view(slot.ids, (batch, num_tokens))
        pos = _view(slot.pos, (batch, num_tokens))
        copy_input(torch, ids, input_ids)  # queued behind the steps before it (copy_input)
        copy_input(torch, pos, position_ids)
        logits = _view(slot.logits, (batch, num_tokens, e.vocab_size))
        tensors = {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos, contract.LOGITS: logits}
        if in_graph:
            starts = cache.lengths.copy()
            if int(starts.max(initial=0)) + num_tokens > capacity:
                raise InvalidRequestError(f"context of {int(starts.max()) + num_tokens} tokens exceeds the engines' "
                                          f"static capacity of {capacity} (rebuild them with a larger --capacity)")
            mask = _view(slot.mask, (batch, num_tokens, capacity))
            copy_input(torch, mask, contract.in_graph_mask(attention_mask, starts, capacity), np.bool_)
            write = _view(slot.write, (batch,))
            copy_input(torch, write, starts)
            tensors[contract.WRITE_INDICES] = write
        else:
            mask = _view(slot.mask, (batch, num_tokens, capacity + num_tokens))
            copy_input(torch, mask, attention_mask, np.bool_)
            new_kv = _view(slot.new_kv, (e.num_layers, 2, batch, e.num_kv_heads, num_tokens, e.head_dim))
        tensors[contract.ATTENTION_MASK] = mask
        for layer in range(e.num_layers):
            keys, values = cache.layer_views(layer)
            tensors[contract.past_key(layer)], tensors[contract.past_value(layer)] = keys, values
            if in_graph:  # written in place: TensorRT needs the output at its cache input's address
                tensors[contract.present_key(layer)], tensors[contract.present_value(layer)] = keys, values
            else:
                tensors[contract.new_key(layer)], tensors[contract.new_value(layer)] = new_kv[layer, 0], new_kv[layer, 1]
        for name in contract.input_names(e.num_layers, self.engines.kv_update):
            shape = tuple(tensors[name].shape)
            if shapes.get(name) != shape:
                if not ctx.set_input_shape(name, shape):
                    raise SpecrtError(f"the {e.role}'s TensorRT engine refuses {name} of shape {shape} in profile "
                                      f"{p} (trt-engines.json and the plan disagree: rebuild the engines)")
                shapes[name] = shape
        for name, tensor in tensors.items():
            ptr = tensor.data_ptr()
            if addresses.get(name) != ptr:
                ctx.set_tensor_address(name, ptr)
                addresses[name] = ptr
        if not ctx.execute_async_v3(self.stream()):
            why = self.logger.errors[-1] if self.logger.errors else "no reason given"
            raise SpecrtError(f"TensorRT failed to run the {e.role}'s step ({why})")
        return logits, (CacheRows(cache, starts, num_tokens) if in_graph else new_kv)

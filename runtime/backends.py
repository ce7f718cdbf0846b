"""Backends run one step graph under the step contract (specrt.contract); the runtime owns the cache.

    backend.step(input_ids, position_ids, attention_mask, cache) -> (logits, new_kv)
        input_ids       [B, T] int64        (numpy)
        position_ids    [B, T] int64        (numpy)
        attention_mask  [B, T, S + T] bool  (numpy; S = cache.capacity)
        logits          [B, T, V] float32   (numpy, valid until this backend's next step)
        new_kv          [L, 2, B, Hkv, T, D] (the backend's array kind; valid until its next step)

`OrtBackend` binds the cache buffers and preallocated output buffers in place (IOBinding), so a step
allocates nothing cache-sized. `TorchBackend` runs the same StepModule that was exported, on CUDA when
present. TensorRT engines will get a `TrtBackend` with the same signature.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from specrt import contract
from specrt.manifest import ModelEntry
from specrt.runtime.kv_cache import KVCache


class Backend(ABC):
    name: str

    def __init__(self, entry: ModelEntry):
        self.entry = entry
        self.busy_seconds = 0.0  # wall time spent inside step() since creation
        self.num_steps = 0

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache):
        """Run one step; returns (logits [B, T, V] numpy, new_kv [L, 2, B, Hkv, T, D])."""
        t0 = time.perf_counter()
        out = self._run(input_ids, position_ids, attention_mask, cache)
        self.busy_seconds += time.perf_counter() - t0
        self.num_steps += 1
        return out

    @abstractmethod
    def allocate(self, shape: tuple[int, ...]):
        """A zero-filled float array of the backend's kind (used for the KV cache)."""

    @abstractmethod
    def _run(self, input_ids, position_ids, attention_mask, cache: KVCache):
        """The backend-specific step (see step)."""

    def new_cache(self, batch: int, bucket: int = 128) -> KVCache:
        e = self.entry
        return KVCache(self.allocate, e.num_layers, batch, e.num_kv_heads, e.head_dim, e.max_positions, bucket)


class _GrowingBuffer:
    """A flat buffer handed out as contiguous views of any shape; grows, never shrinks."""

    def __init__(self, dtype=np.float32):
        self._flat = np.empty(0, dtype=dtype)

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if size > self._flat.size:
            self._flat = np.empty(max(size, 2 * self._flat.size), dtype=self._flat.dtype)
        return self._flat[:size].reshape(shape)


class OrtBackend(Backend):
    name = "ort"

    def __init__(self, entry: ModelEntry, onnx_path: Path, threads: int | None = None,
                 providers: list[str] | None = None, spin: bool | None = None):
        import onnxruntime as ort

        super().__init__(entry)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        # Each session has its own intra-op pool whose threads spin after a run. The draft runs
        # between target steps on the same cores, so its pool must not spin (measured on 2 cores:
        # spinning draft threads nearly halve the target's speed); the target's pool keeps spinning,
        # which saves the wake-up latency of its next step.
        if spin is None:
            spin = entry.role != "draft"
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        self.session = ort.InferenceSession(str(onnx_path), sess_options=opts,
                                            providers=providers or ["CPUExecutionProvider"])
        self._binding = self.session.io_binding()
        self._logits = _GrowingBuffer()
        self._new_kv = _GrowingBuffer(np.dtype(entry.dtype))
        self._bound_cache = None  # (buffer, shape) whose layers are bound as past_key/past_value
        self._bound_out = None  # (logits, new_kv) arrays bound as outputs

    def allocate(self, shape):
        return np.zeros(shape, dtype=np.dtype(self.entry.dtype))

    def _bind_in(self, name: str, arr: np.ndarray) -> None:
        self._binding.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)

    def _bind_out(self, name: str, arr: np.ndarray) -> None:
        self._binding.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)

    def _run(self, input_ids, position_ids, attention_mask, cache):
        # Bindings persist across runs: only what changed since the last step is re-bound
        # (token inputs every step; the cache after it grew or shrank; outputs when B or T changed).
        e = self.entry
        batch, num_tokens = input_ids.shape
        self._bind_in(contract.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        self._bind_in(contract.POSITION_IDS, np.ascontiguousarray(position_ids, dtype=np.int64))
        self._bind_in(contract.ATTENTION_MASK, np.ascontiguousarray(attention_mask, dtype=np.bool_))
        bound = self._bound_cache
        if bound is None or bound[0] is not cache.buffer or bound[1] != cache.buffer.shape:
            for layer in range(e.num_layers):
                keys, values = cache.layer_views(layer)
                self._bind_in(contract.past_key(layer), keys)
                self._bind_in(contract.past_value(layer), values)
            self._bound_cache = (cache.buffer, cache.buffer.shape)
        logits = self._logits.view((batch, num_tokens, e.vocab_size))
        new_kv = self._new_kv.view((e.num_layers, 2, batch, e.num_kv_heads, num_tokens, e.head_dim))
        out = self._bound_out
        if out is None or out[0].shape != logits.shape or out[0].ctypes.data != logits.ctypes.data \
                or out[1].ctypes.data != new_kv.ctypes.data:
            self._bind_out(contract.LOGITS, logits)
            for layer in range(e.num_layers):
                self._bind_out(contract.new_key(layer), new_kv[layer, 0])
                self._bind_out(contract.new_value(layer), new_kv[layer, 1])
            self._bound_out = (logits, new_kv)
        self.session.run_with_iobinding(self._binding)
        return logits, new_kv


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, entry: ModelEntry, hf_dir: Path, device: str | None = None, threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from specrt.export.step_module import StepModule

        super().__init__(entry)
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, entry.dtype)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=self.dtype)
        self.module = StepModule(model).eval().to(self.device)

    def allocate(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _run(self, input_ids, position_ids, attention_mask, cache):
        torch = self.torch
        e = self.entry
        past = []
        for layer in range(e.num_layers):
            past += cache.layer_views(layer)
        with torch.inference_mode():
            out = self.module(torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(self.device),
                              torch.from_numpy(np.ascontiguousarray(position_ids, dtype=np.int64)).to(self.device),
                              torch.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.bool_)).to(self.device),
                              *past)
            new_kv = torch.stack(out[1:]).unflatten(0, (e.num_layers, 2))  # [L, 2, B, Hkv, T, D]
            logits = out[0].float().cpu().numpy()
        return logits, new_kv


BACKENDS = ("ort", "torch")


def load_backend(kind: str, bundle: Path, entry: ModelEntry, threads: int | None = None, device: str | None = None) -> Backend:
    if kind == "ort":
        return OrtBackend(entry, bundle / entry.onnx, threads=threads)
    if kind == "torch":
        return TorchBackend(entry, bundle / entry.hf_dir, device=device, threads=threads)
    raise ValueError(f"unknown backend {kind!r} (choose from {', '.join(BACKENDS)})")

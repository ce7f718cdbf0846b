"""Backends run one step graph under the step contract (specrt.contract); the runtime owns the cache.

    runner = backend.runner()                  # one per caller: its own bindings and output buffers
    runner.step(input_ids, position_ids, attention_mask, cache, head="logits") -> (logits, new_kv)
        input_ids       [B, T] int64        (numpy; or a "device-argmax" head's tokens from a runner of the same
                                            backend, used where they lie)
        position_ids    [B, T] int64        (numpy)
        attention_mask  [B, T, S + T] bool  (numpy; S = cache.capacity)
        logits          [B, T, V] float32   (numpy, valid until this runner's next step); what `head` asks of them:
                        "argmax": [B, T] int64, each row's argmax (greedy verification needs no more); "discard":
                        None (prefill); "device-argmax": the argmax left where the logits lie (a torch tensor on a
                        device backend; numpy where the logits are host arrays), nothing waiting for the step: fed to
                        a later step as its input_ids (a greedy draft chain) or brought over once by Runner.to_host;
                        TopLogProbs(k, temperature): a TopK of each row's k likeliest tokens and
                        their log-probabilities (a greedy beam search). A backend whose logits live on a device
                        reduces them there, so only what the head keeps crosses to the host ([B, T] int64 instead
                        of [B, T, V] float32: with a 128K vocabulary, 8 bytes a row instead of 512 KB)
        new_kv          [L, 2, B, Hkv, T, D] (the backend's array kind; valid until this runner's next step)
    runner.step(..., features=[B, T, H])         a draft head's step (ModelEntry.features; contract.FEATURES)
    runner.last_hidden                           [B, T, H] the last step's hidden states where its graph gives them
                                                 (ModelEntry.hidden), as the backend holds them, valid until its next
                                                 step; else None

A Backend is the loaded model (an ONNX Runtime session, a torch module): shared, thread-safe. A Runner
is one caller's handle on it, never shared between threads: the Pipeline makes one per generate call,
so concurrent calls never see each other's bindings or buffers, and each counts its own steps and time.
`close()` gives back what the runner holds (a static-shape engine's slot); the Pipeline closes its
runners at the end of each call.
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from specrt.bundle.manifest import ModelEntry
from specrt.errors import InvalidRequestError
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.sampling import logsumexp, top_k


# what of a step's logits comes back to the host (module docstring)
HEADS = ("logits", "argmax", "device-argmax", "discard")


@dataclass(frozen=True)
class TopLogProbs:
    """A head: each row's k likeliest tokens under softmax(logits / temperature) and their log-probabilities, as a
    TopK. A beam search of width k reads no more: the best k extensions of any set of beams are among their
    parents' k best tokens each."""

    k: int
    temperature: float = 1.0


@dataclass(frozen=True)
class TopK:
    """What TopLogProbs keeps of logits [..., V]: log-probabilities [..., k] (float64, best first) and their tokens
    [..., k] int64; indexes like the logits it stands for, over every axis but the last."""

    values: np.ndarray
    tokens: np.ndarray

    def __getitem__(self, index) -> "TopK":
        return TopK(self.values[index], self.tokens[index])


def top_log_probs(logits: np.ndarray, head: TopLogProbs) -> TopK:
    """TopLogProbs on host logits: the top k of the tempered logits (log softmax ranks as they do), their log
    probabilities in float64 from one logsumexp a row (not a log softmax of the whole vocabulary)."""
    x = logits / head.temperature
    top = top_k(x, head.k).astype(np.int64)
    return TopK(np.take_along_axis(x, top, axis=-1).astype(np.float64) - logsumexp(x)[..., None], top)


class Backend(ABC):
    name: str
    max_step_tokens: int | None = None  # the most new tokens per sequence one step may carry (None: any)
    # its caches live at fixed addresses (engines): a sequence joining a batch is prefilled alone (admits_alone) in
    # an admission cache of the engine's (Runner.admission_cache), or else in place beside the running ones,
    # stepped as empty rows (a prefill step as wide as the whole batch; step_inputs.admit)
    static_cache: bool = False
    admits_alone: bool = False
    # holes (contract.HOLE_POSITION) are left out of its token-wise work, so a ragged step costs about what its real
    # rows do, not B x its widest sequence's (OrtBackend: graphs/packed_rows.py)
    packs_rows: bool = False
    # its step's logits are host arrays (ONNX Runtime's): the head is host work, timed as such, not as the model's;
    # a backend whose logits lie on a device (torch, engines) waits for its step in the head (the copy)
    host_logits: bool = True
    # its step computes logits only for the rows asked (_run's rows [B, R]: [B, R, V] logits), so a prefill runs no
    # LM head and a draft fed several rows one row's (OrtBackend: graphs/logit_rows.py)
    selects_rows: bool = False
    # it feeds a draft head's features and returns a step's hidden states where the graph has them (ModelEntry.features,
    # ModelEntry.hidden): _run takes features= and returns (logits, new_kv, hidden)
    feature_steps: bool = False
    gives_hidden: bool = False  # its steps return their hidden states (the graph or module it runs has them)

    def __init__(self, entry: ModelEntry):
        self.entry = entry

    @property
    def max_context(self) -> int:
        """The longest context (prompt + new tokens + drafts) a sequence may reach on this backend."""
        return self.entry.max_positions

    def runner(self) -> "Runner":
        return Runner(self, self._new_binding())

    def _new_binding(self):
        """Per-runner state (e.g. ONNX Runtime's IOBinding and its output buffers); None if stateless."""
        return None

    def _release(self, binding) -> None:
        """Give back what a runner's binding holds (called once, by Runner.close)."""

    def _new_cache(self, binding, batch: int, bucket: int) -> KVCache:
        e = self.entry
        return KVCache(self.allocate, e.num_layers, batch, e.num_kv_heads, e.head_dim, e.max_positions, bucket,
                       e.sliding_window, release=self.release_store)

    def _admission_cache(self, binding, batch: KVCache) -> KVCache | None:
        """A static backend's (admits_alone): an empty one-sequence cache where a sequence joining the running
        `batch` is prefilled alone before `batch.extend` takes it: at fixed addresses of its own (its slots are
        then copied in), or the batch store's next free row itself (KVCache.row_view: nothing to copy)."""
        return None

    def release_store(self, store) -> None:
        """Take back a KV store a cache gave up (OrtBackend pools them); by default it is simply dropped."""

    @abstractmethod
    def allocate(self, shape: tuple[int, ...]):
        """A zero-filled float array of the backend's kind (used for the KV cache)."""

    @abstractmethod
    def _run(self, binding, input_ids, position_ids, attention_mask, cache: KVCache):
        """The backend-specific step (see the module docstring), with the runner's binding: (logits [B, T, V] as the
        backend holds them, new_kv); _head brings them to the host. A backend that selects_rows takes `rows=` [B, R]
        too (the rows of each sequence whose logits it computes: [B, R, V]); one with feature_steps takes `features=`
        where its graph reads them and returns (logits, new_kv, hidden [B, T, H] or None)."""

    def _wait(self) -> None:
        """Wait until the steps this backend queued have ended (Runner.wait): its steps end before they return."""

    def _pick(self, logits, pick):
        """Row pick[b] of each sequence's logits [B, T, V] -> [B, V] (Runner.step); these are numpy."""
        return logits[np.arange(len(pick)), np.asarray(pick, dtype=np.int64)]

    def _head(self, logits, head):
        """The step's logits on the host as `head` asks (module docstring); these are numpy already."""
        if isinstance(head, TopLogProbs):
            return top_log_probs(logits, head)
        if head in ("argmax", "device-argmax"):  # the host is where these logits lie
            return logits.argmax(axis=-1)
        return None if head == "discard" else logits


def torch_wait(backend) -> None:
    """Backend._wait of a backend on torch buffers (backend.torch, backend.device): a GPU's queue drained."""
    if backend.device.type == "cuda":
        backend.torch.cuda.synchronize(backend.device)


def torch_head(logits, head):
    """Backend._head for logits held in a torch tensor (on a GPU, or the CPU): reduced where they lie, so that only
    what the head keeps crosses to the host."""
    import torch

    if head == "discard":
        return None
    with torch.inference_mode():
        if isinstance(head, TopLogProbs):
            x = torch.log_softmax((logits.float() / head.temperature).double(), dim=-1)  # as the host path
            values, tokens = x.topk(min(head.k, x.shape[-1]), dim=-1)  # sorted, best first
            return TopK(values.cpu().numpy(), tokens.cpu().numpy())
        if head == "device-argmax":
            return logits.argmax(dim=-1)  # queued behind the step; nothing waits for it
        return (logits.argmax(dim=-1) if head == "argmax" else logits.float()).cpu().numpy()


def _host_tensor(torch, x: np.ndarray, dtype, pinned: bool):
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=dtype))
    return t.pin_memory() if pinned else t


def torch_input(torch, x, device, dtype=np.int64):
    """A step input as a torch tensor on `device`. A "device-argmax" head's tensor is used where it lies. A host array
    bound for a CUDA device is staged in pinned (page-locked) memory and copied without blocking: the copy queues
    behind the steps already launched, where a blocking one would first wait for all of them (ATen copies host memory
    to a device with cudaMemcpyAsync then cudaStreamSynchronize unless non_blocking) and so stall every step on the
    one before it. The pinned block is not reused before its copy ran (PyTorch's caching host allocator records it)."""
    if not isinstance(x, np.ndarray):
        return x.to(device)
    cuda = torch.device(device).type == "cuda"
    return _host_tensor(torch, x, dtype, cuda).to(device, non_blocking=cuda)


def copy_input(torch, buffer, x, dtype=np.int64) -> None:
    """Copy a step input into an engine's buffer (a fixed address a CUDA graph or a TensorRT context reads), without
    blocking as torch_input: a host array staged in pinned memory on CUDA, a device head's tensor where it lies."""
    if isinstance(x, np.ndarray):
        x = _host_tensor(torch, x, dtype, buffer.is_cuda)
    buffer.copy_(x, non_blocking=True)


def torch_pick(torch, logits, pick):
    """logits [B, T, V] (a torch tensor) -> [B, V], row pick[b] of each sequence, chosen where they lie (the row
    indices copied over as a step's inputs are, without blocking)."""
    rows = torch_input(torch, np.asarray(pick, dtype=np.int64), logits.device)
    return logits[torch.arange(len(pick), device=logits.device), rows]


class Runner:
    def __init__(self, backend: Backend, binding):
        self.backend = backend
        self.entry = backend.entry
        self.max_step_tokens = backend.max_step_tokens
        self._binding = binding
        # gives the binding back once: on close(), or when the runner is garbage collected unclosed
        self._release = weakref.finalize(self, backend._release, binding)
        self.busy_seconds = 0.0  # wall time of the model inside step() since creation (a host-side head is not)
        self.num_steps = 0
        # the last step's logits [B, T, V] as the backend holds them (a tensor on its device, or numpy), whatever its
        # head brought to the host (None after a "discard" step; [B, 1, V] after a step with `pick` on a backend that
        # selects_rows): valid until the next step (a drafter reads rows of them where they lie)
        self.last_logits = None
        self.last_hidden = None  # the last step's hidden states [B, T, H] where its graph gives them (module docstring)

    @property
    def gives_hidden(self) -> bool:
        """Whether its steps give their hidden states (last_hidden): what a feature-level draft head reads."""
        return self.backend.gives_hidden

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache,
             head: "str | TopLogProbs" = "logits", pick: np.ndarray | None = None, features=None):
        """Run one step; returns (logits [B, T, V] numpy, or what `head` keeps of them (HEADS), new_kv [L, 2, B, Hkv,
        T, D]). `pick` [B]: one row of each sequence (e.g. its last fed token's), the only one the head reads:
        logits [B, V] (or what the head keeps of them), chosen where the logits lie. `features` [B, T, H]: a draft
        head's (ModelEntry.features), required there and refused elsewhere."""
        if head not in HEADS and not isinstance(head, TopLogProbs):
            raise ValueError(f"head must be one of {', '.join(HEADS)} or a TopLogProbs, got {head!r}")
        rows = {}  # the rows whose logits are read, where the backend computes only those
        if self.backend.selects_rows and (head == "discard" or pick is not None):
            rows["rows"] = np.zeros((len(input_ids), 0), np.int64) if pick is None \
                else np.asarray(pick, dtype=np.int64)[:, None]
        reads = getattr(self.entry, "features", False)
        if (features is not None) != reads:
            raise InvalidRequestError(f"the {self.entry.role}'s step {'reads' if reads else 'has no'} features (a "
                                      "draft head's input: the hidden state before each new token)")
        if features is not None:
            if not self.backend.feature_steps:
                raise InvalidRequestError(f"the {self.backend.name} backend does not run draft heads that read "
                                          "features")
        fed = {} if features is None else {"features": features}
        t0 = time.perf_counter()
        logits, new_kv, *hidden = self.backend._run(self._binding, input_ids, position_ids, attention_mask, cache,
                                                    **rows, **fed)
        self.last_hidden = hidden[0] if hidden else None
        t1 = time.perf_counter()
        self.last_logits = None if head == "discard" else logits  # a prefill's are not kept alive past its step
        if pick is not None:  # (the one row computed, where the backend chose it)
            logits = self.backend._pick(logits, np.zeros(len(pick), np.int64) if rows else pick)
        logits = self.backend._head(logits, head)
        # a device backend's head waits for its step, except "device-argmax" (to_host waits for it later)
        self.busy_seconds += (t1 if self.backend.host_logits else time.perf_counter()) - t0
        self.num_steps += 1
        return logits, new_kv

    def wait(self) -> None:
        """Wait for this runner's steps to end on the device (a "discard" head returns before a GPU's step has
        ended: a prefill, timed alone, must wait for it), counted as busy time as a head's wait is."""
        t0 = time.perf_counter()
        self.backend._wait()
        self.busy_seconds += time.perf_counter() - t0

    def to_host(self, tokens) -> np.ndarray:
        """A "device-argmax" head's tokens (or anything computed from them where they lie) on the host: the one wait
        for the steps that made them, counted as this runner's busy time as a device head's wait is."""
        if isinstance(tokens, np.ndarray):
            return tokens
        t0 = time.perf_counter()
        out = tokens.cpu().numpy()
        self.busy_seconds += time.perf_counter() - t0
        return out

    def new_cache(self, batch: int, bucket: int = 128) -> KVCache:
        return self.backend._new_cache(self._binding, batch, bucket)

    def admission_cache(self, batch: KVCache) -> KVCache | None:
        """Where a sequence joining this runner's static `batch` is prefilled alone (Backend._admission_cache), or
        None where the backend has none (a dynamic cache's new sequences get a cache of their own from new_cache)."""
        return self.backend._admission_cache(self._binding, batch)

    def close(self) -> None:
        """Give back what this runner holds; it must not step afterwards. Idempotent."""
        self._release()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""StaticTorchBackend (backend "static"): the step module at static shapes, replayed as CUDA graphs on CUDA.

The bundle's engines.json (EngineSet, made by `specrt build`) fixes a table of token-count profiles (e.g.
1, 8, 16, 32, 64, 128), of batch buckets (e.g. 1, 2, 4) and one static KV capacity C. A step of B
sequences and T new tokens runs at the smallest bucket >= B and the smallest profile >= T: rows past T
and sequences past B are holes (token 0, position 0, seeing only themselves), whose outputs nobody reads
or commits, so padding changes no real row (tested). Attention spans (`build --spans`, e.g. 256, 512, then
C) bound what a step reads of the cache: a step whose sequences' cached contexts all fit span s attends over
the cache's first s slots only (the rows any mask may show lie below each sequence's length), so attention
costs what the context needs, not C; each store reaches the largest profile's slots past C, so that a step
writes its new rows past the span and attends over them in place (StepLayer's room). Every mask is
[Bb, Tp, s + Tp] and every input, cache view and output lives at a fixed address, which is what a CUDA graph
replays: on CUDA each (bucket, profile, span) is warmed up and captured once when the backend loads; on the CPU
the same static steps run eagerly (no graphs), which is how the padding, the spans and the static cache are
tested without a GPU.

With `specrt build --compile MODE` (EngineSet.compile) each decoder layer runs through torch.compile first, one
compiled graph per shape serving every layer (PyTorch's regional compilation), compiled when the backend loads
(in the captures' warm-up on CUDA): the CUDA graphs then replay inductor's fused kernels instead of the eager
step's. On an H200 the captured eager one-token step of the 7b shape took 9.55 ms where the measured bandwidth allows
2.8 ms (docs/gpu.md): the fused kernels are what would close that gap; these per-layer compiles are not yet measured
on a GPU.

Concurrency: each of the engine's `slots` holds one static cache and the static inputs of every shape;
a runner takes a slot for its lifetime (slots.SlotPool) and further calls wait for one. A call that
needs two runners of one backend (a model drafting for itself) needs two slots.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from specrt.bundle.artifacts import EngineSet
from specrt.bundle.manifest import ModelEntry
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.runtime.backends.base import copy_input
from specrt.runtime.backends.slots import EngineBackend, SlotPool
from specrt.runtime.kv_cache import KVCache


def _compile_layers(torch, module, engines: EngineSet) -> None:
    """The step module's decoder layers through torch.compile (StepModule.compile_layers), one graph per step shape
    (dynamic=False: each shape's kernels specialised to it, as its CUDA graph replays them), every layer sharing it;
    fullgraph: a layer that would not compile whole fails the build instead of running partly eager. `max-autotune`
    leaves out inductor's own CUDA graphs: the backend captures the whole step itself; `tuned` is the default mode with
    coordinate-descent tuning (contract.TORCH_COMPILE_MODES)."""
    import torch._dynamo

    shapes = (len(engines.batch_buckets) + 1) * len(engines.token_profiles) * len(engines.spans)  # + admission
    for name in ("recompile_limit", "cache_size_limit"):
        # past this many shapes of one code object dynamo stops compiling it and runs it eagerly, silently
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), shapes + 8))
    if engines.compile == "tuned":
        module.compile_layers("default", dynamic=False, fullgraph=True, inductor={"coordinate_descent_tuning": True})
        return
    mode = "max-autotune-no-cudagraphs" if engines.compile == "max-autotune" else engines.compile
    module.compile_layers(mode, dynamic=False, fullgraph=True)


@contextmanager
def _compiling(torch, engines: EngineSet, role: str):
    """Where the compiled layers first run (their compile): a failure of torch.compile's is one line saying so."""
    if engines.compile is None:
        yield
        return
    import torch._dynamo

    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as e:  # a graph break under fullgraph, an inductor failure
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise SpecrtError(f"torch.compile could not compile the {role}'s decoder layers ({why}): rebuild the engines "
                          f"without --compile") from e


class _Shape:
    """Static inputs, cache views and (on CUDA) the captured graph of one (batch bucket, token profile, attention
    span): the step attends over the first `span` slots of the static cache (views of it, at fixed addresses)."""

    def __init__(self, backend: "StaticTorchBackend", kv, batch: int, tokens: int, span: int):
        torch = backend.torch
        e = backend.entry
        self.backend, self.batch, self.tokens, self.span = backend, batch, tokens, span
        self.ids = torch.zeros((batch, tokens), dtype=torch.int64, device=backend.device)  # [Bb, Tp]
        self.pos = torch.zeros((batch, tokens), dtype=torch.int64, device=backend.device)  # [Bb, Tp]
        self.mask = torch.zeros((batch, tokens, span + tokens), dtype=torch.bool, device=backend.device)
        # [Bb, Hkv, span + Tp, D] each: the store's first span slots, then Tp where the step writes its new rows (past
        # every sequence's length: all lie within the span), so that attention reads them all in place (room)
        self.past = [kv[layer, k, :batch, :, :span + tokens] for layer in range(e.num_layers) for k in (0, 1)]
        # a draft head's features [Bb, Tp, H] (ModelEntry.features)
        self.features = [torch.zeros((batch, tokens, e.hidden_size), dtype=backend.dtype, device=backend.device)] \
            if e.features else []
        self.graph = None
        self.out = None  # (logits [Bb, Tp, V], new_kv [L, 2, Bb, Hkv, Tp, D], hidden [Bb, Tp, H] or None) of the graph

    def forward(self):
        torch = self.backend.torch
        layers = self.backend.entry.num_layers
        with torch.inference_mode():
            out = self.backend.module(self.ids, self.pos, self.mask, *self.features, *self.past, room=True)
            hidden = out[-1] if self.backend.gives_hidden else None
            return out[0], torch.stack(out[1:1 + 2 * layers]).unflatten(0, (layers, 2)), hidden

    def capture(self, stream, pool) -> None:
        """Warm up on the capture stream (libraries create their handles outside the capture), then capture.

        cuBLAS keeps one workspace per handle and stream, made at the warm-up, outside the graph's pool; a graph
        captured over it keeps its address, and whoever clears the workspaces later (inductor's CUDA graphs do, at
        every recording: torch.compile(mode="reduce-overhead"), HF generate's static-cache compile) frees memory the
        graph still writes: another tensor's, or, once the allocator hands it back, none (an H200 replayed ours into
        "illegal memory access" after HF's compiled generate). So the workspaces are cleared before the capture, for
        cuBLAS to make the graph's own in its pool (which lives as long as the graph), and after it, so that no later
        work on this stream writes into the pool."""
        torch = self.backend.torch
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(stream.device)
        clear = torch._C._cuda_clearCublasWorkspaces
        clear()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.out = self.forward()
        clear()

    def run(self):
        if self.graph is None or self.backend.graphs_paused:
            return self.forward()
        self.graph.replay()
        return self.out


class _Slot:
    """One static KV cache [L, 2, Bmax, Hkv, C, D] and the shapes that read it; and one admission cache
    [L, 2, 1, Hkv, C, D] with one-sequence shapes of its own, where a sequence joining a running batch is
    prefilled alone (a prefill in place would step every running sequence as an empty row: a step as wide as
    the batch, for one prompt) before its slots are copied into the batch's rows."""

    def __init__(self, backend: "StaticTorchBackend"):
        e, eng = backend.entry, backend.engines
        # each store reaches the largest profile's slots past the capacity: a step's new rows at the largest span
        room = eng.capacity + eng.token_profiles[-1]
        store = backend.allocate((e.num_layers, 2, eng.batch_buckets[-1], e.num_kv_heads, room, e.head_dim))
        self.kv = store[:, :, :, :, :eng.capacity]  # the cache the runtime holds
        self.shapes = {(b, t, s): _Shape(backend, store, b, t, s)
                       for b in eng.batch_buckets for t in eng.token_profiles for s in eng.spans}
        admission = backend.allocate((e.num_layers, 2, 1, e.num_kv_heads, room, e.head_dim))
        self.admission = admission[:, :, :, :, :eng.capacity]
        self.admission_shapes = {(t, s): _Shape(backend, admission, 1, t, s)
                                 for t in eng.token_profiles for s in eng.spans}

    def all_shapes(self):
        return [*self.shapes.values(), *self.admission_shapes.values()]


class StaticTorchBackend(EngineBackend):
    name = "static"
    static_cache = True
    admits_alone = True
    feature_steps = True

    def __init__(self, entry: ModelEntry, hf_dir: Path, device: str, threads: int, engines: EngineSet,
                 prompt_embeddings=None):
        import torch

        from specrt.model.quant import load_step_module

        super().__init__(entry)
        torch.set_num_threads(threads)
        self.torch, self.engines = torch, engines
        self.device = torch.device(device)
        self.dtype = getattr(torch, entry.dtype)
        # the engines' quantization scheme (`specrt build --quant`): the projections as 8-bit linears
        self.module, self.quant = load_step_module(hf_dir, entry.dtype, device, prompt_embeddings, engines.quant,
                                                   entry.hidden)
        self.gives_hidden = self.module.hidden
        self.module.fuse_projections(engines.projections)
        if engines.compile is not None:
            _compile_layers(torch, self.module, engines)
        self.max_step_tokens = engines.token_profiles[-1]
        if entry.max_positions < engines.capacity:
            raise InvalidRequestError(f"the engines' capacity {engines.capacity} exceeds the {entry.role}'s maximum "
                                      f"context of {entry.max_positions}: rebuild with a smaller --capacity")
        self._slots = SlotPool([_Slot(self) for _ in range(engines.slots)], entry.role, engines.command(
            Path(hf_dir).parents[len(Path(entry.hf_dir).parts) - 1]))
        self.cuda_graphs = self.device.type == "cuda"
        self.graphs_paused = False
        with _compiling(torch, engines, entry.role):
            if engines.compile is not None and not self.cuda_graphs:  # compile every shape now, not mid-decode
                with torch.inference_mode():
                    for shape in next(iter(self._slots)).all_shapes():
                        shape.forward()
            if self.cuda_graphs:
                stream = torch.cuda.Stream(self.device)
                for slot in self._slots:
                    # one memory pool per slot: a slot's graphs run one after another (a graph's outputs are read
                    # before its slot's next step), but two slots' graphs may run at once and must not share memory
                    pool = torch.cuda.graph_pool_handle()
                    for shape in slot.all_shapes():
                        shape.capture(stream, pool)
                torch.cuda.synchronize(self.device)

    @contextmanager
    def without_graphs(self):
        """Steps launch the captured shapes' kernels one by one from the host instead of replaying their graphs (the
        same module, inputs and kernels): where a profiler sees the operator and input shapes behind each kernel, which
        a graph's replay hides (bench/kernels.py)."""
        self.graphs_paused = True
        try:
            yield
        finally:
            self.graphs_paused = False

    def _new_cache(self, slot: _Slot, batch: int, bucket: int) -> KVCache:
        self.engines.for_batch(batch)  # refuse a batch no bucket holds, before any step
        e = self.entry
        return KVCache(self.allocate, e.num_layers, batch, e.num_kv_heads, e.head_dim, self.engines.capacity, bucket,
                       e.sliding_window, static=slot.kv)

    def _admission_cache(self, slot: _Slot, batch: KVCache) -> KVCache:
        e = self.entry
        return KVCache(self.allocate, e.num_layers, 1, e.num_kv_heads, e.head_dim, self.engines.capacity,
                       window=e.sliding_window, static=slot.admission)

    def _run(self, slot: _Slot, input_ids, position_ids, attention_mask, cache: KVCache, features=None):
        torch = self.torch
        batch, num_tokens = input_ids.shape
        capacity = self.engines.capacity
        if cache.capacity != capacity:
            raise ValueError(f"a static step needs the engine's static cache (capacity {capacity}), got {cache.capacity}")
        # the cached rows every sequence's mask may show lie below its length (pack_step): the span holds them all
        span = self.engines.for_context(int(cache.lengths.max(initial=0)))
        if cache.store is slot.admission:  # one sequence joining a running batch (step_inputs.admit)
            shape = slot.admission_shapes[(self.engines.for_tokens(num_tokens), span)]
        else:
            shape = slot.shapes[(self.engines.for_batch(batch), self.engines.for_tokens(num_tokens), span)]
        ids = np.zeros((shape.batch, shape.tokens), dtype=np.int64)  # [Bb, Tp]; holes: token 0, position 0
        pos = np.zeros((shape.batch, shape.tokens), dtype=np.int64)
        device_ids = not isinstance(input_ids, np.ndarray)  # a "device-argmax" head's tokens: copied where they lie
        if not device_ids:
            ids[:batch, :num_tokens] = input_ids
        pos[:batch, :num_tokens] = position_ids
        mask = np.zeros((shape.batch, shape.tokens, span + shape.tokens), dtype=bool)  # [Bb, Tp, span + Tp]
        mask[:batch, :num_tokens, :span] = attention_mask[:, :, :span]
        mask[:batch, :num_tokens, span:span + num_tokens] = attention_mask[:, :, capacity:]
        rows = np.arange(shape.tokens)
        mask[:, rows, span + rows] = True  # every row sees itself: real rows already do, holes see nothing else
        copy_input(torch, shape.ids, ids)  # queued behind the steps before it, not waiting for them (copy_input)
        if device_ids:
            copy_input(torch, shape.ids[:batch, :num_tokens], input_ids)
        copy_input(torch, shape.pos, pos)
        copy_input(torch, shape.mask, mask, np.bool_)
        if features is not None and isinstance(features, np.ndarray):  # holes read zeros
            fed = np.zeros(shape.features[0].shape, np.float32)
            fed[:batch, :num_tokens] = features
            copy_input(torch, shape.features[0], fed, np.float32)
        elif features is not None:  # a head's own hidden outputs: copied where they lie, behind the step before
            shape.features[0].zero_()
            copy_input(torch, shape.features[0][:batch, :num_tokens], features)
        logits, new_kv, hidden = shape.run()
        return (logits[:batch, :num_tokens], new_kv[:, :, :batch, :, :num_tokens],
                None if hidden is None else hidden[:batch, :num_tokens])

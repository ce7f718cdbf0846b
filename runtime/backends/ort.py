"""OrtBackend: a step graph in an ONNX Runtime session (CPU by default).

Each runner binds the cache buffers and its own preallocated output buffers in place (IOBinding), so a
step allocates nothing cache-sized, and re-binds only what changed since its last step. One session
serves every runner: ONNX Runtime's Run is thread-safe.

Memory stays flat over any mix of prompt lengths (`specrt bench soak`): the runtime bounds every step's
shape (prefill goes in chunks, step_inputs.PREFILL_CHUNK), so the arena stops growing once it has seen
the largest one; the memory-pattern planner, which keeps an allocation plan per input shape, is off.

Every step graph is loaded with packed token rows (graphs/packed_rows.py, applied in memory as the session is made): a
ragged step's holes are left out of its projections and MLPs (unless pack_rows=False, for a deployment that decodes
one sequence at a time and so has no holes); with its float32 RMSNorms (and the residual adds before them) fused
into ONNX Runtime's own norm kernels; and with the projections that read one input (q, k, v; a weight-only
variant's gate and up) merged into one MatMul each (graphs/ort_fusions.py).

The memory the session loaded the weights into is then backed by transparent huge pages where the kernel allows
(huge_pages.py): a memory-bound step streams them all, with 512x fewer TLB misses.

kv_update "inplace" runs the in-graph variant of a step graph (`specrt inplace`; contract.py): the runner
translates the step's mask [B, T, S + T] to the cache's slots [B, T, C] (new token j of sequence b at slot
lengths[b] + j), binds write_indices = the lengths, and binds each present_key/present_value output to the
same memory as its past input, so ONNX Runtime's TensorScatter writes the new K/V into the runtime's cache in
place. The step returns CacheRows: the runtime then commits the accepted rows where they already are. Where this
ONNX Runtime has it (1.32), each layer's TensorScatter and Attention nodes run as one GroupQueryAttention kernel
(graphs/ort_attention.py: fuse_grouped_attention), which writes in place the same way and reads only the slots up to each
sequence's end.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np

from specrt import contract
from specrt.bundle.manifest import ModelEntry
from specrt.errors import BundleError, InvalidRequestError
from specrt.graphs.logit_rows import bound_rows
from specrt.runtime.backends.base import Backend
from specrt.runtime.backends.huge_pages import HugePages
from specrt.runtime.kv_cache import CacheRows, StorePool




class _GrowingBuffer:
    """A flat buffer handed out as contiguous views of any shape; grows, never shrinks (lives as long as
    its runner)."""

    def __init__(self, dtype=np.float32):
        self._flat = np.empty(0, dtype=dtype)

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if size > self._flat.size:
            self._flat = np.empty(max(size, 2 * self._flat.size), dtype=self._flat.dtype)
        return self._flat[:size].reshape(shape)


class _Binding:
    def __init__(self, session, dtype):
        self.io = session.io_binding()
        self.logits = _GrowingBuffer()
        self.new_kv = _GrowingBuffer(dtype)
        self.bound_cache = None  # (buffer, shape) whose layers are bound as past_key/past_value
        self.bound_out = None  # (logits, new_kv) arrays bound as outputs
        self.mask = _GrowingBuffer(np.bool_)  # kv_update "inplace": the mask over the cache's slots
        self.rows = {}  # the rows whose logits a step computes (graphs/logit_rows.py): alive while bound
        self.hidden = _GrowingBuffer()  # contract.HIDDEN, where the graph gives it
        self.features = None  # contract.FEATURES as bound: alive while bound

    def bind_in(self, name: str, arr: np.ndarray) -> None:
        self.io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)

    def bind_out(self, name: str, arr: np.ndarray) -> None:
        self.io.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)


class OrtBackend(Backend):
    name = "ort"
    feature_steps = True
    fused_norms = 0  # RMSNorms fused into ONNX Runtime's SimplifiedLayerNormalization kernel (ort_fusions.py)
    merged_matmuls = 0  # MatMuls merged into another that reads the same input (ort_fusions.py)
    grouped_attention = 0  # in-graph layers run by ONNX Runtime's GroupQueryAttention kernel (ort_attention.py)
    kernel_rotary = 0  # of those, the layers whose q and k the kernel rotates
    packed_qkv = 0  # of those, the layers whose q, k and v the kernel reads as one MatMul's rows
    grouped_attention_refused = None  # why ONNX Runtime refused the rewrite (the graph then runs as exported)
    selects_rows = False  # its LM head runs on the rows the runner reads (graphs/logit_rows.py)
    logit_rows = None  # where it does, the inputs that name them (select_logit_rows' form)
    _merged = None  # while the session loads: the merged weights it is given

    def __init__(self, entry: ModelEntry, onnx_path: Path, threads: int, spin: bool | None = None,
                 kv_update: str = "runtime", projections: str = "qkv", profile: Path | None = None,
                 pack_rows: bool = True, huge_pages: bool = True, select_rows: bool = True):
        """projections: which weight MatMuls reading one input are merged (ort_fusions.fuse_projections): "qkv" (q, k
        and v; a weight-only variant's gate and up too), "all" (a float MLP's gate and up too) or "none"; `specrt
        bench fusions` times them against each other. profile: a folder where ONNX Runtime's profiler records every
        run's kernels (end_profiling); it slows each step, so only a bench that times nothing with it sets it.
        pack_rows: False loads the graph without packed token rows (a ragged step then computes its holes).
        huge_pages: back the memory the session loads its weights into with transparent huge pages (huge_pages.py;
        False, as loaded: what `specrt bench fusions --huge-pages` compares). select_rows: the LM head only over the
        rows a step's caller reads (graphs/logit_rows.py: none for a prefill, each sequence's last for a draft fed
        several); False computes every row's."""
        import onnxruntime as ort

        if projections not in contract.PROJECTIONS:
            raise InvalidRequestError(f"projections must be one of {', '.join(contract.PROJECTIONS)}, got {projections!r}")
        super().__init__(entry)
        self.kv_update, self.projections, self.profile, self.pack = kv_update, projections, profile, pack_rows
        self.select_rows = select_rows
        self.onnx_path = Path(onnx_path)  # the step graph this session runs (a variant's, an in-graph one's)
        self.pool = StorePool(np.dtype(entry.dtype))  # KV stores given up, reused by the next (kv_cache.StorePool)
        # Each session has its own intra-op pool whose threads spin after a run. The draft runs between target
        # steps on the same cores, so its pool must not spin (spinning draft threads take the cores the target's
        # next step needs); the target's pool keeps spinning, which saves the wake-up latency of its next step.
        if spin is None:
            spin = entry.role != "draft"
        for grouped in ([True, False] if kv_update == "inplace" else [False]):
            try:
                with HugePages(huge_pages) as pages:
                    self.session = self._session(Path(onnx_path), threads, spin, grouped)
                # a target's graphs have them where its draft is a head (ModelEntry.hidden)
                self.gives_hidden = any(o.name == contract.HIDDEN for o in self.session.get_outputs())
                self.huge_pages = pages  # what was collapsed into huge pages (.bytes), or why nothing was (.reason)
                return
            except Exception as e:  # onnxruntime raises its own exception types
                why = str(e).strip().splitlines()[0][:200]
                if grouped and self.grouped_attention:  # our rewrite refused: the graph as exported still runs
                    self.grouped_attention_refused = why
                    self.grouped_attention = self.kernel_rotary = self.packed_qkv = 0
                    warnings.warn(f"ONNX Runtime {ort.__version__} refused {onnx_path} with its layers rewritten into "
                                  f"GroupQueryAttention ({why}): loading it as exported", RuntimeWarning, stacklevel=2)
                    continue
                if kv_update != "inplace":
                    raise
                raise BundleError(f"ONNX Runtime {ort.__version__} cannot load the in-graph step graph {onnx_path} "
                                  f"({why}): it needs opset 24's TensorScatter and Attention (ONNX Runtime 1.32 runs "
                                  "them); load with kv_update='runtime'") from None

    def _session(self, onnx_path: Path, threads: int, spin: bool, grouped: bool):
        """The step graph's session, its layers rewritten into GroupQueryAttention where `grouped` (and ONNX Runtime
        has the kernel's right-padded chunks)."""
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        opts.enable_mem_pattern = False  # it keeps a plan per input shape: memory grows with each new one
        if self.profile is not None:
            Path(self.profile).mkdir(parents=True, exist_ok=True)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(self.profile) / self.entry.role)
        try:
            with tempfile.TemporaryDirectory(prefix="specrt-packed-", ignore_cleanup_errors=True) as scratch:
                source = self._packed(onnx_path, opts, Path(scratch), grouped)
                return ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
        finally:
            self._merged = None

    def _packed(self, onnx_path: Path, opts, scratch: Path, grouped: bool = False):
        """The step graph with packed token rows (graphs/packed_rows.py), its norms fused into ONNX Runtime's kernels and
        its projections merged (ort_fusions.py), for ONNX Runtime to load: where its weights are external data, the
        graph serialized (the merged weights given to the session in memory, the others read from beside the
        original file); else written to `scratch` with its weights as external data (serializing hundreds of MB
        through protobuf takes seconds and several times the memory; the file is read back at disk speed). The path
        itself where nothing changed."""
        import onnx
        import onnxruntime as ort

        from specrt.graphs.logit_rows import select_logit_rows
        from specrt.graphs.ort_attention import fuse_grouped_attention, grouped_attention_available
        from specrt.graphs.ort_fusions import fuse_projections, fuse_rms_norms, fuse_skip_norms
        from specrt.graphs.packed_rows import pack_rows

        try:
            model = onnx.load(str(onnx_path), load_external_data=False)
        except Exception:  # protobuf's DecodeError and OSError alike: let ONNX Runtime say what it finds
            return str(onnx_path)
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        self.packs_rows = self.pack and pack_rows(model)
        self.fused_norms = fuse_rms_norms(model)
        if self.fused_norms:
            fuse_skip_norms(model)
        self.merged_matmuls, merged = fuse_projections(model, onnx_path.parent, inline=not external,
                                                       pairs=self.projections == "all") \
            if self.projections != "none" else (0, {})
        if grouped and grouped_attention_available():
            self.grouped_attention, self.kernel_rotary, self.packed_qkv = fuse_grouped_attention(
                model, self.entry.num_heads, self.entry.max_positions, onnx_path.parent)
        self.logit_rows = select_logit_rows(model) if self.select_rows else None
        self.selects_rows = self.logit_rows is not None
        if merged:  # copied into the session as it loads: kept alive until then (__init__ drops them)
            self._merged = [ort.OrtValue.ortvalue_from_numpy(a) for a in merged.values()], merged
            opts.add_external_initializers(list(merged), self._merged[0])
        if not (self.packs_rows or self.fused_norms or self.merged_matmuls or self.grouped_attention
                or self.selects_rows):
            return str(onnx_path)
        if external:
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          str(onnx_path.resolve().parent))
            return model.SerializeToString()
        dest = scratch / onnx_path.name
        onnx.save_model(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dest.name + ".data", size_threshold=1024)
        return str(dest)

    def end_profiling(self) -> Path:
        """Stop ONNX Runtime's profiler (`profile` set) and return the JSON trace it wrote: one event per run and per
        kernel a run ran (bench.fusions.op_times reads it)."""
        if self.profile is None:
            raise InvalidRequestError("this backend was loaded without profile=: ONNX Runtime records nothing")
        return Path(self.session.end_profiling())

    def allocate(self, shape):
        return self.pool.allocate(shape)

    def release_store(self, store) -> None:
        self.pool.release(store)

    def _new_binding(self) -> _Binding:
        return _Binding(self.session, np.dtype(self.entry.dtype))

    def _run(self, binding: _Binding, input_ids, position_ids, attention_mask, cache, rows=None, features=None):
        if self.kv_update == "inplace":
            return self._run_in_place(binding, input_ids, position_ids, attention_mask, cache, rows, features)
        # Bindings persist across a runner's steps: only what changed since its last step is re-bound
        # (token inputs every step; the cache after it grew or shrank; outputs when B or T changed).
        e = self.entry
        batch, num_tokens = input_ids.shape
        binding.bind_in(contract.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_in(contract.POSITION_IDS, np.ascontiguousarray(position_ids, dtype=np.int64))
        binding.bind_in(contract.ATTENTION_MASK, np.ascontiguousarray(attention_mask, dtype=np.bool_))
        self._bind_cache(binding, cache, in_place=False)
        logits = binding.logits.view((batch, self._bind_rows(binding, position_ids, rows), e.vocab_size))
        new_kv = binding.new_kv.view((e.num_layers, 2, batch, e.num_kv_heads, num_tokens, e.head_dim))
        out = binding.bound_out
        if out is None or out[0].shape != logits.shape or out[0].ctypes.data != logits.ctypes.data \
                or out[1].shape != new_kv.shape or out[1].ctypes.data != new_kv.ctypes.data:
            binding.bind_out(contract.LOGITS, logits)
            for layer in range(e.num_layers):
                binding.bind_out(contract.new_key(layer), new_kv[layer, 0])
                binding.bind_out(contract.new_value(layer), new_kv[layer, 1])
            binding.bound_out = (logits, new_kv)
        hidden = self._bind_hidden(binding, batch, num_tokens, features)
        self.session.run_with_iobinding(binding.io)
        return logits, new_kv, hidden

    def _bind_hidden(self, binding: _Binding, batch: int, num_tokens: int, features):
        """Bind a draft head's features and the hidden states output where the graph has them; the latter's array."""
        if features is not None:
            binding.features = np.ascontiguousarray(features, dtype=np.float32)
            binding.bind_in(contract.FEATURES, binding.features)
        if not self.gives_hidden:
            return None
        hidden = binding.hidden.view((batch, num_tokens, self.entry.hidden_size))
        binding.bind_out(contract.HIDDEN, hidden)  # every step: its view moves with B and T (a call, not a copy)
        return hidden

    def _bind_cache(self, binding: _Binding, cache, in_place: bool) -> None:
        """Bind the cache's layers as past_key/past_value (and, in place, as present_key/present_value), unless
        the same buffer is bound already."""
        bound = binding.bound_cache
        if bound is not None and bound[0] is cache.buffer and bound[1] == cache.buffer.shape:
            return
        for layer in range(self.entry.num_layers):
            for k, array in enumerate(cache.layer_views(layer)):
                binding.bind_in((contract.past_key, contract.past_value)[k](layer), array)
                if in_place:
                    binding.bind_out((contract.present_key, contract.present_value)[k](layer), array)
        binding.bound_cache = (cache.buffer, cache.buffer.shape)

    def _bind_rows(self, binding: _Binding, position_ids, rows) -> int:
        """Bind the rows whose logits the step computes (selects_rows: every row where `rows` is None, else rows
        [B, R]); returns how many a sequence gets."""
        if not self.selects_rows:
            return position_ids.shape[1]
        binding.rows = bound_rows(position_ids, rows, self.logit_rows)
        for name, array in binding.rows.items():
            binding.bind_in(name, array)
        return position_ids.shape[1] if rows is None else np.shape(rows)[1]

    def _run_in_place(self, binding: _Binding, input_ids, position_ids, attention_mask, cache, rows=None,
                      features=None):
        e = self.entry
        batch, num_tokens = input_ids.shape
        starts = cache.lengths.copy()
        cache.reserve(int(starts.max(initial=0)) + num_tokens)  # every row of the step is written, drafts included
        mask = contract.in_graph_mask(attention_mask, starts, cache.capacity,
                                      binding.mask.view((batch, num_tokens, cache.capacity)))
        binding.bind_in(contract.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_in(contract.POSITION_IDS, np.ascontiguousarray(position_ids, dtype=np.int64))
        binding.bind_in(contract.ATTENTION_MASK, mask)
        binding.bind_in(contract.WRITE_INDICES, starts)
        self._bind_cache(binding, cache, in_place=True)
        logits = binding.logits.view((batch, self._bind_rows(binding, position_ids, rows), e.vocab_size))
        out = binding.bound_out
        if out is None or out[0].shape != logits.shape or out[0].ctypes.data != logits.ctypes.data:
            binding.bind_out(contract.LOGITS, logits)
            binding.bound_out = (logits, None)
        hidden = self._bind_hidden(binding, batch, num_tokens, features)
        self.session.run_with_iobinding(binding.io)
        return logits, CacheRows(cache, starts, num_tokens), hidden

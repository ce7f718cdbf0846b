"""`specrt build`: what to build (BuildConfig); engines/build.py hands it to the backend that builds it.

    backend static  engines/static.py  the step module at static shapes, CUDA graphs on CUDA -> engines.json
    backend trt     engines/trt.py     TensorRT plans of the step ONNX                       -> trt-engines.json

Both share the profile table: token-count profiles (a step of T new tokens runs at the smallest profile
>= T), batch buckets, a KV capacity and slots (calls served at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from specrt.bundle.artifacts import HARDWARE_COMPATIBILITY
from specrt.bundle.manifest import BundleOptions
from specrt.config import option
from specrt.contract import KV_UPDATES, PROJECTIONS, TORCH_COMPILE_MODES, TORCH_QUANT_SCHEMES
from specrt.errors import InvalidRequestError
from specrt.runtime.backends import ThreadOptions, backend_kind
from specrt.runtime.backends.kinds import ENGINE_BACKENDS, kinds_that


@dataclass(frozen=True)
class BuildConfig(BundleOptions, ThreadOptions):
    backend: str = option("static", "static = the step module at static shapes, captured as CUDA graphs on CUDA (eager "
                                    "on the CPU); trt = TensorRT plans of the step ONNX (TensorRT >= 10.1, CUDA)",
                          choices=ENGINE_BACKENDS)
    device: str | None = option(None, "where the engines run: cpu (static only: the static steps run eagerly, no CUDA graphs) or cuda[:N] "
                                      "(default where present)")
    token_profiles: tuple[int, ...] = option((1, 8, 16, 32, 64, 128), "the largest new-token count of each profile "
                                                                       "(the largest is also the prefill chunk)", ge=1, nonempty=True)
    batch_buckets: tuple[int, ...] = option((1, 2, 4), "the largest batch of each bucket (trt: its profiles cover "
                                                       "batch 1 to the largest)", ge=1, nonempty=True)
    capacity: int = option(2048, "KV cache capacity: positions per sequence (prompt + new tokens + drafts)", ge=1)
    spans: tuple[int, ...] | None = option(None, "static: attention spans below the capacity, ascending (e.g. "
                                                 "256,512,1024): a step whose sequences' cached contexts fit one "
                                                 "attends over that many slots of the static cache, not all of them, "
                                                 "so attention costs what the context needs; each span adds a set of "
                                                 "shapes to capture (and compile). Default: 512, 1024, ... below the "
                                                 "capacity; '' for none", ge=1)
    slots: int = option(1, "calls served at once: each holds a static cache (static) or execution contexts (trt) per "
                           "model (a model drafting for itself needs 2)", ge=1)
    hardware_compatibility: str = option("none", "trt: GPUs the plans may run on besides this one's model: "
                                                 "ampere_plus (any GPU of compute capability >= 8.0) or "
                                                 "same_compute_capability (recent TensorRT releases); none is fastest",
                                         choices=HARDWARE_COMPATIBILITY)
    version_compatible: bool = option(False, "trt: plans that later TensorRT versions also run (TensorRT's lean "
                                             "runtime goes in the plan; may be slower)")
    workspace_mib: int | None = option(None, "trt: the builder's workspace limit in MiB (default: TensorRT's, the "
                                             "device's memory)", ge=1)
    kv_update: str = option("runtime", "trt: runtime = from the exported step graphs (the runtime writes the K/V); "
                                       "inplace = from `specrt inplace`'s graphs: the engine writes each step's K/V into "
                                       "a static cache of --capacity in place (IKVCacheUpdateLayer + IAttention, "
                                       "TensorRT >= 10.15)", choices=KV_UPDATES)
    quant: str | None = option(None, "static: 8-bit projections, int8-wo (INT8 weight-only) or fp8 (FP8 e4m3 weights "
                                     "and activations, row-wise scales; compute capability >= 8.9); trt: build from a "
                                     "quantized variant's step graphs: int8-qdq or fp8-qdq (`specrt quantize --scheme S`), "
                                     "TensorRT's explicit INT8 / FP8 from symmetric Q/DQ (strongly typed: no precision "
                                     "flags; FP8: compute capability >= 8.9)")
    compile: str | None = option(None, "graphs: run each decoder layer through torch.compile before the CUDA graphs "
                                       "are captured, one compile per step shape serving every layer: default, or "
                                       "max-autotune (inductor's kernel autotuning, without CUDA graphs of its own; "
                                       "a longer build), or tuned (coordinate-descent tuning: on CUDA a one-row "
                                       "matmul becomes a tuned Triton reduction); checked against the eager step "
                                       "like every engine",
                                 choices=TORCH_COMPILE_MODES)
    projections: str | None = option(None, "static: merge the projections that read one input into one matmul: qkv "
                                           "(q, k and v), all (the MLP's gate and up too; the default: at one token "
                                           "each is one kernel over one matrix instead of several) or none; 8-bit "
                                           "projections (--quant) stay apart", choices=PROJECTIONS)

    def __post_init__(self):
        super().__post_init__()
        for name in ("token_profiles", "batch_buckets", "spans"):
            values = getattr(self, name)
            if values is None and name == "spans":
                continue
            if (not values and name != "spans") or min(values, default=1) < 1 or list(values) != sorted(set(values)):
                raise InvalidRequestError(f"{name} must be distinct integers >= 1 in ascending order, got {values!r}")
        if self.spans and self.spans[-1] >= self.capacity:
            raise InvalidRequestError(f"spans must lie below the capacity ({self.capacity}), which is the last span, "
                                      f"got {self.spans!r}")
        kind = backend_kind(self.backend)
        if self.spans and not kind.attention_spans:
            raise InvalidRequestError(f"--spans sets the attention spans of the {kinds_that(lambda k: k.attention_spans)} "
                                      f"engines; the {self.backend} engines' profiles range over the cache size already "
                                      f"(--backend {self.backend} takes no --spans)")
        if self.kv_update != "runtime" and not kind.kv_update_built:
            raise InvalidRequestError(f"--kv-update {self.kv_update} builds "
                                      f"{kinds_that(lambda k: k.kv_update_built, title=True)} engines (--backend "
                                      f"{kinds_that(lambda k: k.kv_update_built)}); the "
                                      f"{kinds_that(lambda k: k.step_graphs and not k.engines)} backend runs the "
                                      "in-graph step graphs without a build (`specrt inplace`, then --kv-update inplace)")
        if kind.quant == "projections" and self.quant not in (None, *TORCH_QUANT_SCHEMES):
            raise InvalidRequestError(f"--quant {self.quant}: the {self.backend} engines quantize their projections with "
                                      f"{' or '.join(TORCH_QUANT_SCHEMES)} (`specrt quantize`'s variants run on the "
                                      f"{kinds_that(lambda k: k.step_graphs)} backend, or in "
                                      f"{kinds_that(lambda k: k.engines is not None and k.quant == 'graphs', title=True)}"
                                      " engines with --backend "
                                      f"{kinds_that(lambda k: k.engines is not None and k.quant == 'graphs')})")
        if self.compile is not None and not kind.compiles_layers:
            raise InvalidRequestError(f"--compile compiles the {kinds_that(lambda k: k.compiles_layers)} engines' "
                                      f"layers with torch.compile; the {self.backend} builder compiles its engines itself "
                                      f"(--backend {self.backend} takes no --compile)")
        if self.projections is not None and not kind.compiles_layers:
            raise InvalidRequestError(f"--projections merges the {kinds_that(lambda k: k.compiles_layers)} engines' "
                                      f"projections; the {self.backend} builder fuses its engines' layers itself "
                                      f"(--backend {self.backend} takes no --projections)")
        if kind.quant == "graphs" and self.quant is not None and (self.quant in TORCH_QUANT_SCHEMES
                                                                   or self.kv_update == "inplace"):
            raise InvalidRequestError(f"--quant with --backend {self.backend} builds {kind.title} engines from a quantized "
                                      "variant's Q/DQ graphs (`specrt quantize`; --kv-update runtime); the "
                                      f"{kinds_that(lambda k: k.step_graphs)} backend runs the variants without a build")
        if self.kv_update == "inplace" and self.token_profiles[-1] > self.capacity:
            raise InvalidRequestError(f"the largest token profile ({self.token_profiles[-1]}) exceeds the capacity "
                                      f"({self.capacity}): an in-graph step writes all its rows into the cache")

    def attention_spans(self) -> tuple[int, ...]:
        """The engines' attention spans, ascending, the capacity last (`spans`; default: powers of two from 512 below
        the capacity; TensorRT: the capacity alone)."""
        if self.spans is not None:
            return (*self.spans, self.capacity)
        if not backend_kind(self.backend).attention_spans:
            return (self.capacity,)
        return (*(s for s in (512 << i for i in range(32)) if s < self.capacity), self.capacity)

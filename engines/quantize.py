"""`specrt quantize`: 8-bit variants of a bundle's step graphs for ONNX Runtime on the CPU -> quant/<scheme>/,
quant.json (QuantSet).

On the CPU a memory-bound target is bound by the bytes of its weights, so 8-bit weights are the largest speed
lever there. Schemes, all through onnxruntime.quantization (the library ONNX Runtime ships: already a
dependency and the runtime that runs the result; Optimum's ORTQuantizer drives the same functions for Hugging
Face models, and its current release pins transformers < 4.58):

    int8-weights  weight-only: each weight MatMul becomes MatMulNBits with 8-bit weights in blocks of 32
                  (symmetric, a scale per block); activations stay float (int8 compute inside the kernel,
                  accuracy level 4, quantizes each row's blocks on its own). No calibration.
    int4-weights  the same with 4-bit weights: half the bytes again, more rounding.
    dynamic-int8  dynamic: each row of a weight MatMul's input quantized to uint8 when the step runs, with its own
                  scale (max |x| of the row / 127, zero point 128); weights int8 per output channel in 7 bits
                  (-63..63); MatMulInteger, its int32 result rescaled to float by both scales. 7 bits because
                  x86 without AVX-VNNI multiplies uint8 by int8 in pairs summed in 16 bits (255 * 63 * 2 fits,
                  255 * 127 * 2 saturates): with 7-bit weights every product is exact on every CPU, so a variant
                  computes the same tokens everywhere (ONNX Runtime's quantize_dynamic calls this reduce_range).
                  Ad hoc, inflated target (not bench figures): 8-bit weights saturated (95.5% teacher-forced
                  top-1 agreement with fp32 on held-out text against 97.1% with 7 bits); 8-bit weights as uint8
                  (exact uint8 x uint8 kernels) agreed 98.1% against 97.6% on 24 x 256 tokens but were slower in
                  an ad hoc timing on 2 AVX2 cores, and int8 activations far slower (no bench row measures
                  either: the uint8 x int8 kernels are ONNX Runtime's fast path). No calibration.
    static-int8   QDQ: weights int8 per channel, the weight MatMuls' activations uint8 with ranges calibrated
                  on held-out text (the held-out stdlib files acceptance calibration reads; never HumanEval).
                  uint8 activations because ONNX Runtime's x86 8-bit GEMM multiplies uint8 by int8 (with int8
                  activations the inflated target's steps were far slower in an ad-hoc timing; not a bench figure).
    int8-qdq      the same calibration, symmetric: int8 activations and weights, every zero point 0: TensorRT's
                  explicit INT8 (`specrt build --backend trt --quant int8-qdq`), which takes only symmetric Q/DQ.
                  ONNX Runtime runs it too (slowly on x86, see above), which is how it is checked here.
    fp8-qdq       FP8 e4m3 Q/DQ, one scale per weight tensor and per activation tensor (onnxruntime's float8
                  quantization calibrates ranges only with its Distribution method, on the same held-out text):
                  TensorRT's explicit FP8 (`--quant fp8-qdq`; compute capability >= 8.9, e.g. H100). ONNX Runtime
                  runs it on the CPU as float after each DequantizeLinear, which is how it is checked here (slowly).

Not offered: onnxruntime's own dynamic quantization (quantize_dynamic: DynamicQuantizeLinear + MatMulInteger). It
quantizes a step's activations with one scale over all its rows, so a token's logits depend on which other tokens
share its step: a verify step of T tokens does not compute what T autoregressive steps compute, and no speculative
method can be lossless on it (on the demo target one row's logits moved by up to 0.9 between a step of 1 token
and of 6; `sd` diverged from autoregressive). dynamic-int8 is the same idea with a scale per row. Every scheme here
computes each row on its own (tested).

Quantized: the MatMuls that multiply by a weight (projections, MLP, LM head). Kept in float: attention's
Q·K and P·V (no weights), the rotary embedding's rotate-half product (a signed permutation matrix: 8-bit
activations would only add error to every position), norms, and the KV cache, which stays in the graph's
float dtype, so the step contract is unchanged. A quantized target is a different model: lossless methods
are token-identical to greedy autoregressive decoding of the same quantized target (tested).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt import contract
from specrt.bundle import artifacts
from specrt.bundle.artifacts import InPlaceGraphs, QuantSet, QuantVariant, Stamp
from specrt.bundle.manifest import BundleOptions, ModelEntry, load_manifest, sha256_file
from specrt.config import option
from specrt.errors import BundleError, InvalidRequestError, SpecrtError
from specrt.graphs.passes import data_file, graph_bytes, save_graph
from specrt.graphs.quantize import quantize_rows, role_of, weight_matmuls

SCHEMES = ("int8-weights", "int4-weights", "dynamic-int8", "static-int8", "int8-qdq", "fp8-qdq")
# what TensorRT builds from (`specrt build --backend trt --quant S`): explicit quantization, Q/DQ with zero points 0
# (TensorRT's quantization is symmetric: docs "Working with Quantized Types"); MatMulNBits is ONNX Runtime's own op
TRT_SCHEMES = ("int8-qdq", "fp8-qdq")
BLOCK = 32  # weights per quantization block (int8-weights, int4-weights)
QUANT_DIR = "quant"
IN_GRAPH_DIR = "inplace"  # quant/<scheme>/inplace/: the scheme's twins of the in-graph step graphs
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")  # onnxruntime.quantization.CalibrationMethod's
KEEP_ROLES = ("down", "head")  # projections --keep leaves in float
UNCALIBRATED = ("int8-weights", "int4-weights", "dynamic-int8")  # the schemes that never run the graph


@dataclass(frozen=True)
class QuantizeConfig(BundleOptions):
    model: str = option("both", "which step graphs: target, draft or both", choices=("target", "draft", "both"))
    scheme: str = option("int8-weights", "int8-weights / int4-weights (weight-only, activations float), "
                                         "dynamic-int8 (weights int8, each row of activations quantized when a "
                                         "step runs), static-int8 (QDQ, activation ranges calibrated on held-out "
                                         "text), int8-qdq (the same, symmetric: for TensorRT's explicit INT8) or "
                                         "fp8-qdq (FP8 e4m3 Q/DQ, per-tensor scales: for TensorRT's explicit FP8)",
                         choices=SCHEMES)
    calibration_prompts: int = option(16, "static schemes: held-out prompts the activation ranges are measured on", ge=1)
    prompt_tokens: int = option(128, "static schemes: tokens per calibration prompt", ge=16)
    seed: int = option(0, "static schemes: seed of the held-out prompts' offsets", ge=0)
    keep: tuple[str, ...] = option((), "projections left in float, by role: down (the MLP's down projection, whose "
                                       "input SiLU(gate) * up holds the outliers per-tensor activation ranges lose most "
                                       "on) and/or head (the LM head)")
    calibration_method: str = option("minmax", "static-int8, int8-qdq: activation ranges from the extremes seen "
                                               "(minmax), a histogram's 99.999th percentile (percentile) or its "
                                               "entropy-optimal clip (entropy)", choices=CALIBRATION_METHODS)
    kv_update: str = option("runtime", "runtime: quantize the exported step graphs; inplace: their in-graph variants "
                                       "(`specrt inplace`; schemes without calibration), run with --kv-update inplace",
                            choices=("runtime", "inplace"))

    def __post_init__(self):
        super().__post_init__()
        if self.kv_update == "inplace" and self.scheme not in UNCALIBRATED:
            raise InvalidRequestError(f"--scheme {self.scheme} calibrates on the exported step graphs' steps: quantize "
                                      f"the in-graph variants with one of {', '.join(UNCALIBRATED)}")
        if any(r not in KEEP_ROLES for r in self.keep) or len(set(self.keep)) < len(self.keep):
            raise InvalidRequestError(f"--keep takes each of {', '.join(KEEP_ROLES)} at most once, got "
                                      f"{','.join(self.keep)}")


class _CalibrationReader:
    """Step-graph feeds from held-out text for onnxruntime's calibrator: each prompt's first half as a prefill
    (empty cache), then its second half against the first half's K/V (what decode steps see). `uniform`: the
    second halves only, every feed of one shape (onnxruntime's histogram calibrators stack what they collect)."""

    def __init__(self, session, entry: ModelEntry, prompts: list[list[int]], uniform: bool = False):
        self._feeds = []
        for ids in prompts:
            half = len(ids) // 2
            first, past = self._step(session, entry, ids[:half], None)
            if not uniform:
                self._feeds.append(first)
            self._feeds.append(self._step(session, entry, ids[half:], past)[0])
        self._iter = iter(self._feeds)

    @staticmethod
    def _step(session, entry: ModelEntry, ids: list[int], past):
        t, s = len(ids), 0 if past is None else past[0].shape[2]
        dtype = np.dtype(entry.dtype)
        feeds = {contract.INPUT_IDS: np.asarray([ids], dtype=np.int64),
                 contract.POSITION_IDS: np.arange(s, s + t, dtype=np.int64)[None],
                 contract.ATTENTION_MASK: np.concatenate([np.ones((t, s), bool), np.tril(np.ones((t, t), bool))], 1)[None]}
        for layer in range(entry.num_layers):
            for k, name in enumerate((contract.past_key(layer), contract.past_value(layer))):
                empty = np.zeros((1, entry.num_kv_heads, 0, entry.head_dim), dtype)
                feeds[name] = empty if past is None else past[2 * layer + k]
        out = session.run(None, feeds)
        return feeds, out[1:]

    def get_next(self):
        return next(self._iter, None)

    def rewind(self):
        self._iter = iter(self._feeds)


def quantize_graph(src: Path, dest: Path, entry: ModelEntry, cfg: QuantizeConfig, encode=None) -> QuantVariant:
    """Write the `cfg.scheme` variant of the step graph `src` to `dest`."""
    import onnx
    import onnxruntime
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    t0 = time.perf_counter()
    external = data_file(src).is_file()
    model = onnx.load(str(src), load_external_data=True)
    quantize, keep = weight_matmuls(model)
    if cfg.keep:  # by role, from the weight's shape
        from specrt.model.checkpoint import load_config

        hf = load_config(Path(cfg.bundle) / entry.hf_dir)
        dims = {t.name: t.dims for t in model.graph.initializer}
        nodes = {n.name: n for n in model.graph.node}
        kept = [n for n in quantize if role_of(dims[nodes[n].input[1]], hf.hidden_size, hf.intermediate_size,
                                               hf.vocab_size) in cfg.keep]
        quantize, keep = [n for n in quantize if n not in kept], keep + kept
    if not quantize:
        raise SpecrtError(f"{src} has no MatMul with a weight initializer to quantize")
    calibration = None
    if cfg.scheme in ("int8-weights", "int4-weights"):
        q = MatMulNBitsQuantizer(model, bits=8 if cfg.scheme == "int8-weights" else 4, block_size=BLOCK,
                                 is_symmetric=True, accuracy_level=4, nodes_to_exclude=keep,
                                 op_types_to_quantize=("MatMul",))
        q.process()
        q.model.save_model_to_file(str(dest), external)
    elif cfg.scheme == "dynamic-int8":
        quantize_rows(model, quantize)
        save_graph(model, dest, external)
    else:
        from onnxruntime.quantization import CalibrationMethod

        from specrt.checkpoints.corpus import corpus_hash, load_corpus, validation_prompts

        prompts = validation_prompts(encode, cfg.calibration_prompts, cfg.prompt_tokens, cfg.seed)
        fp8 = cfg.scheme == "fp8-qdq"
        method = "distribution" if fp8 else cfg.calibration_method  # onnxruntime's only float8 calibration
        session = onnxruntime.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        reader = _CalibrationReader(session, entry, prompts, uniform=method != "minmax")
        del session
        symmetric = cfg.scheme == "int8-qdq"
        types = ((QuantType.QFLOAT8E4M3FN, QuantType.QFLOAT8E4M3FN) if fp8 else
                 (QuantType.QInt8 if symmetric else QuantType.QUInt8, QuantType.QInt8))
        quantize_static(str(src), str(dest), reader, quant_format=QuantFormat.QDQ, activation_type=types[0],
                        weight_type=types[1], per_channel=not fp8,
                        nodes_to_quantize=quantize, nodes_to_exclude=keep, op_types_to_quantize=["MatMul"],
                        use_external_data_format=external,
                        calibrate_method={"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
                                          "entropy": CalibrationMethod.Entropy,
                                          "distribution": CalibrationMethod.Distribution}[method],
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric else {})
        calibration = {"corpus_sha256": corpus_hash(load_corpus()[1]), "prompts": cfg.calibration_prompts,
                       "prompt_tokens": cfg.prompt_tokens, "seed": cfg.seed, "method": method}
    return QuantVariant(file="", bytes=graph_bytes(dest), sha256=sha256_file(dest), source_sha256=sha256_file(src),
                        source_bytes=graph_bytes(src), quantized_nodes=len(quantize),
                        seconds=round(time.perf_counter() - t0, 2), calibration=calibration, kept=tuple(cfg.keep))


def quantize(cfg: QuantizeConfig, progress: bool = True) -> QuantSet:
    """Quantize the chosen step graphs of cfg.bundle; returns quant.json's content (earlier schemes kept)."""
    from tokenizers import Tokenizer
    from tqdm import tqdm

    bundle = Path(cfg.bundle)
    manifest = load_manifest(bundle, cfg.verify_mode)
    roles = contract.ROLES if cfg.model == "both" else (cfg.model,)
    entries = {role: manifest.models[role] for role in roles}
    for e in entries.values():
        if not e.onnx:
            raise BundleError(f"{bundle} has no ONNX step graphs (exported with --no-onnx): re-export it with them")
        if e.dtype != "float32":
            raise SpecrtError(f"the {e.role} was exported in {e.dtype}: quantize a float32 export (ONNX Runtime's CPU "
                              "8-bit kernels take float32 activations)")
    tok = Tokenizer.from_file(str(bundle / manifest.tokenizer / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    previous = QuantSet(stamp=Stamp.make(bundle), variants={})
    if (bundle / QuantSet.FILE).is_file():
        try:
            previous = artifacts.load(bundle, QuantSet)
        except BundleError:
            pass  # made for another export: its variants are stale
    sources = {role: e.onnx for role, e in entries.items()}
    relative = f"{QUANT_DIR}/{cfg.scheme}"
    if cfg.kv_update == "inplace":  # the in-graph variants inplace.json names (each twin records its source's sha256)
        in_graph = artifacts.load(bundle, InPlaceGraphs).graphs
        missing = [role for role in roles if role not in in_graph]
        if missing:
            raise BundleError(f"{bundle} has no in-graph step graph of its {' and '.join(missing)}: run "
                              f"`specrt inplace --bundle {bundle}` first")
        sources, relative = {role: in_graph[role].file for role in roles}, f"{relative}/{IN_GRAPH_DIR}"
    scheme_dir = bundle / relative
    staging = bundle / QUANT_DIR / f".{cfg.scheme}-{int(time.time() * 1e6)}"
    staging.mkdir(parents=True)
    made = {}
    try:
        for role in tqdm(roles, desc=f"quantize ({cfg.scheme})", unit="model", disable=not progress):
            made[role] = quantize_graph(bundle / sources[role], staging / f"{role}.onnx", entries[role], cfg, encode)
        scheme_dir.mkdir(parents=True, exist_ok=True)
        for role, v in made.items():  # the scheme's other models stay as they were
            for f in staging.glob(f"{role}.onnx*"):
                f.replace(scheme_dir / f.name)
            made[role] = replace(v, file=f"{relative}/{role}.onnx")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    sets = {k: {s: dict(v) for s, v in getattr(previous, k).items()} for k in ("variants", "in_graph")}
    sets["in_graph" if cfg.kv_update == "inplace" else "variants"].setdefault(cfg.scheme, {}).update(made)
    result = QuantSet(stamp=Stamp.make(bundle), **sets)
    artifacts.save(bundle, result)
    return result

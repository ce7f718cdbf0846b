"""`specrt build --backend trt`: TensorRT plans of both models' step graphs -> trt/<role>-<sha>.plan, trt-engines.json.

For each model, from the bundle's step ONNX (the plain step contract, which every TensorRT version parses):

    network   a strongly typed network (the ONNX's types are the engine's: float16 / bfloat16 / float32
              as exported), parsed by TensorRT's ONNX parser from the file (external data included)
    profiles  one optimization profile per token-count range of the profile table: a step of T new tokens
              runs in the profile of the smallest entry >= T; each covers batch 1..largest bucket and KV
              capacity 1..--capacity (the runtime's cache grows in buckets up to it), opt at batch 1, the
              range's largest T and half the capacity. The table is repeated once per slot: concurrent
              execution contexts never share a profile (TensorRT's rule for dynamic shapes).
    config    workspace limit, hardware compatibility level, version compatibility (as asked)
    --quant   int8-qdq / fp8-qdq: from `specrt quantize`'s symmetric Q/DQ graphs instead. TensorRT's explicit
              quantization: in a strongly typed network the Q/DQ nodes say where INT8 or FP8 runs, and no precision
              flag is set (TensorRT docs, "Explicit Quantization"; FP8 needs compute capability >= 8.9); checked
              against ONNX Runtime running the same graphs
    check     each plan is loaded by the trt backend and its steps compared with the eager step module on
              random feeds (padded profiles included): within the export's parity tolerance for the dtype

Plans are written under content-addressed names, then trt-engines.json (atomically) names them: a build
interrupted at any point leaves the previous engines usable. Plans no artifact names are removed after.

Written against the documented TensorRT 10/11 Python API; it has not run on these machines (TensorRT does
not install here). Its orchestration is tested with a recording fake of the tensorrt module.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from specrt import contract
from specrt.bundle import artifacts
from specrt.bundle.artifacts import Stamp, TrtEngineSet, environment
from specrt.files import write_atomic
from specrt.bundle.manifest import ModelEntry, load_manifest, sha256_file
from specrt.engines.config import BuildConfig
from specrt.engines.static import QUANT_TOL, check_engine_step, check_shapes, check_tolerance
from specrt.errors import BundleError, SpecrtError
from specrt.graphs.passes import graph_bytes
from specrt.runtime.backends import resolve_device
from specrt.runtime.backends.trt import import_tensorrt, make_logger

PLAN_DIR = "trt"
Shape = tuple[int, ...]


IN_GRAPH_TENSORRT = (10, 15)  # the first release importing ONNX TensorScatter and Attention (opset 24)


def profile_ranges(cfg: BuildConfig, entry: ModelEntry) -> tuple[dict[str, tuple[Shape, Shape, Shape]], ...]:
    """Per token-count profile: (min, opt, max) of each input class (input_ids and position_ids share one,
    every past_key/past_value another). kv_update "inplace": the cache's capacity is static (IKVCacheUpdateLayer
    needs it), the mask spans it, and write_indices [B] is one more input."""
    bmax, cap, hkv, d = cfg.batch_buckets[-1], cfg.capacity, entry.num_kv_heads, entry.head_dim
    s_opt = max(1, cap // 2)
    ranges, lo = [], 1
    for hi in cfg.token_profiles:
        if cfg.kv_update == "inplace":
            ranges.append({
                "tokens": ((1, lo), (1, hi), (bmax, hi)),
                contract.ATTENTION_MASK: ((1, lo, cap), (1, hi, cap), (bmax, hi, cap)),  # [B, T, C]
                contract.WRITE_INDICES: ((1,), (1,), (bmax,)),  # [B]
                "past": ((1, hkv, cap, d), (1, hkv, cap, d), (bmax, hkv, cap, d)),  # [B, Hkv, C, D]
            })
        else:
            ranges.append({
                "tokens": ((1, lo), (1, hi), (bmax, hi)),  # input_ids, position_ids [B, T]
                contract.ATTENTION_MASK: ((1, lo, 1 + lo), (1, hi, s_opt + hi), (bmax, hi, cap + hi)),  # [B, T, S + T]
                "past": ((1, hkv, 1, d), (1, hkv, s_opt, d), (bmax, hkv, cap, d)),  # past_key/past_value [B, Hkv, S, D]
            })
        lo = hi + 1
    return tuple(ranges)


def _input_class(name: str) -> str:
    if name in (contract.INPUT_IDS, contract.POSITION_IDS):
        return "tokens"
    return name if name in (contract.ATTENTION_MASK, contract.WRITE_INDICES) else "past"


def make_progress_monitor(trt, role: str, disable: bool):
    """A tensorrt.IProgressMonitor showing the builder's phases as progress bars (TensorRT >= 10.0)."""
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.bars: dict[str, tqdm] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.bars[phase_name] = tqdm(total=num_steps, desc=f"{role}: {phase_name}", leave=False, unit="step",
                                         disable=disable, position=len(self.bars) + 1)

        def step_complete(self, phase_name, step):
            bar = self.bars.get(phase_name)
            if bar is not None:
                bar.update(step + 1 - bar.n)
            return True  # go on building

        def phase_finish(self, phase_name):
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return Monitor()


def compile_plan(trt, onnx_path: Path, entry: ModelEntry, cfg: BuildConfig, progress: bool = True):
    """The serialized plan (tensorrt.IHostMemory) of one model's step graph."""
    logger = make_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)] or logger.errors or ["no reason given"]
        raise SpecrtError(f"TensorRT {trt.__version__} cannot parse {onnx_path}: {errors[0]}"
                          + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(names) != sorted(contract.input_names(entry.num_layers, cfg.kv_update)):
        redo = "re-run `specrt inplace`" if cfg.kv_update == "inplace" else "re-export the bundle"
        raise BundleError(f"{onnx_path} does not have the step contract's inputs (found {', '.join(names[:5])}...): "
                          f"{redo}")
    config = builder.create_builder_config()
    if cfg.workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mib << 20)
    if cfg.hardware_compatibility != "none":
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel,
                                                      cfg.hardware_compatibility.upper())
    if cfg.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = make_progress_monitor(trt, entry.role, disable=not progress)
    ranges = profile_ranges(cfg, entry)
    for slot in range(cfg.slots):
        for t, shapes in enumerate(ranges):
            profile = builder.create_optimization_profile()
            for name in names:
                profile.set_shape(name, *shapes[_input_class(name)])
            index = config.add_optimization_profile(profile)
            if index != slot * len(ranges) + t:
                raise SpecrtError(f"TensorRT refused optimization profile {slot * len(ranges) + t} of the {entry.role} "
                                  f"({logger.errors[-1] if logger.errors else 'no reason given'})")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise SpecrtError(f"TensorRT {trt.__version__} could not build the {entry.role}'s engine: "
                          f"{logger.errors[-1] if logger.errors else 'no reason given'}")
    return plan


def _write_plan(bundle: Path, role: str, plan) -> tuple[str, int, str]:
    """Write a plan under a content-addressed name; (path relative to the bundle, bytes, sha256)."""
    data = memoryview(plan)
    digest = hashlib.sha256(data).hexdigest()
    rel = f"{PLAN_DIR}/{role}-{digest[:16]}.plan"
    (bundle / PLAN_DIR).mkdir(exist_ok=True)
    write_atomic(bundle / rel, data)
    return rel, data.nbytes, digest


def _remove_unnamed_plans(bundle: Path, keep: dict[str, str]) -> None:
    for path in (bundle / PLAN_DIR).glob("*.plan"):
        if f"{PLAN_DIR}/{path.name}" not in keep.values():
            path.unlink(missing_ok=True)


def _in_graph_sources(trt, bundle: Path) -> dict[str, str]:
    """role -> the in-graph step graph (`specrt inplace`) to build from, refusing a TensorRT too old to import it."""
    from specrt.bundle.artifacts import InPlaceGraphs

    version = tuple(int(p) for p in trt.__version__.split(".")[:2] if p.isdigit())
    if version < IN_GRAPH_TENSORRT:
        raise SpecrtError(f"TensorRT {trt.__version__} cannot import the in-graph KV update (ONNX TensorScatter and "
                          "Attention, opset 24: TensorRT >= 10.15): build with --kv-update runtime, or upgrade")
    graphs = artifacts.load(bundle, InPlaceGraphs).graphs
    for role in contract.ROLES:
        g = graphs.get(role)
        if g is None or not (bundle / g.file).is_file() or sha256_file(bundle / g.file) != g.sha256:
            raise BundleError(f"{bundle} has no in-graph step graph of its {role} as `specrt inplace` wrote it: re-run "
                              f"`specrt inplace --bundle {bundle}`")
    return {role: graphs[role].file for role in contract.ROLES}


FP8_COMPUTE_CAPABILITY = (8, 9)  # TensorRT's FP8 kernels: Ada and Hopper onwards ("Working with Quantized Types")
TRT_INT8 = "int8-qdq"


def _quantized_sources(bundle: Path, scheme: str) -> dict[str, str]:
    """role -> the quantized step graph TensorRT builds from, refusing schemes it does not import."""
    from specrt.bundle.artifacts import QuantSet
    from specrt.engines.quantize import TRT_SCHEMES

    if scheme not in TRT_SCHEMES:
        why = ("ONNX Runtime's MatMulNBits, an operator TensorRT does not import" if scheme.endswith("-weights") else
               "MatMulInteger on activations quantized as the step runs, where TensorRT builds from Q/DQ"
               if scheme == "dynamic-int8" else
               "Q/DQ with uint8 activations and non-zero zero points, where TensorRT takes symmetric Q/DQ only")
        raise SpecrtError(f"{scheme} is {why}: quantize with `specrt quantize --bundle {bundle} --scheme "
                          f"{TRT_INT8}` (or fp8-qdq) and build --quant {TRT_INT8}")
    return artifacts.load(bundle, QuantSet).graphs(bundle, scheme)


def onnx_reference(path: Path, entry: ModelEntry):
    """A step callable (torch tensors in, (logits, new K/V...) out) that runs a step graph in ONNX Runtime on the CPU: what a
    plan built from a quantized graph is checked against (the eager module computes the float model)."""
    import onnxruntime
    import torch

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = contract.input_names(entry.num_layers)  # the order the step module takes them in

    outputs = contract.output_names(entry.num_layers)

    def step(*tensors):
        feeds = {n: t.cpu().numpy() for n, t in zip(names, tensors)}
        return tuple(torch.from_numpy(out) for out in session.run(outputs, feeds))

    return step


def build_trt(cfg: BuildConfig, progress: bool = True) -> TrtEngineSet:
    trt = import_tensorrt()  # first: without TensorRT, one line and nothing else happens
    return build_plans(trt, cfg, resolve_device("trt", cfg.device), progress)


def build_plans(trt, cfg: BuildConfig, device: str, progress: bool = True) -> TrtEngineSet:
    """Build, write, check and record the plans of both models with this tensorrt module on `device`."""
    import torch
    from tqdm import tqdm

    from specrt.graphs.parity import text_tokens
    from specrt.model.checkpoint import load_checkpoint, load_tokenizer
    from specrt.model.step import StepModule
    from specrt.runtime.backends.trt import TrtBackend

    bundle = Path(cfg.bundle)
    manifest = load_manifest(bundle, cfg.verify_mode)
    entries = {role: manifest.models[role] for role in contract.ROLES}
    graphs = {role: e.onnx for role, e in entries.items()}
    if cfg.kv_update == "inplace":
        graphs = _in_graph_sources(trt, bundle)
    quantized = _quantized_sources(bundle, cfg.quant) if cfg.quant else {}
    cc = environment(device)["compute_capability"]
    if cfg.quant == "fp8-qdq" and cc is not None and tuple(int(x) for x in cc.split(".")) < FP8_COMPUTE_CAPABILITY:
        raise SpecrtError(f"FP8 plans need a GPU of compute capability >= 8.9 (Ada, Hopper or newer); {device} is {cc}: "
                          f"build --quant {TRT_INT8} here")
    graphs.update(quantized)  # a variant of one model only: the other's exported graph
    for role, graph in graphs.items():
        if not graph:
            raise BundleError(f"{bundle} has no ONNX step graphs (exported with --no-onnx), which TensorRT builds from: "
                              "re-export it with them")
    plans, sizes, digests, seconds = {}, {}, {}, {}
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # the builder and runtime use the current device
    for role in tqdm(contract.ROLES, desc="build (trt)", unit="model", disable=not progress):
        t0 = time.perf_counter()
        plan = compile_plan(trt, bundle / graphs[role], entries[role], cfg, progress)
        plans[role], sizes[role], digests[role] = _write_plan(bundle, role, plan)
        del plan
        seconds[role] = round(time.perf_counter() - t0, 3)
    engines = TrtEngineSet(
        stamp=Stamp.make(bundle), kind="trt", token_profiles=cfg.token_profiles, batch_buckets=cfg.batch_buckets,
        capacity=cfg.capacity, spans=cfg.attention_spans(), slots=cfg.slots, device=device,
        **environment(device, tensorrt=True),
        cuda_graphs=False, build_seconds=seconds, parity={}, plans=plans, plan_bytes=sizes, plan_sha256=digests,
        profiles={role: profile_ranges(cfg, e) for role, e in entries.items()},
        hardware_compatibility=cfg.hardware_compatibility, version_compatible=cfg.version_compatible,
        workspace_bytes=(cfg.workspace_mib or 0) << 20, kv_update=cfg.kv_update, quant=cfg.quant, compile=None,
        weight_bytes={role: graph_bytes(bundle / g, streamed=True) for role, g in graphs.items()})
    rng, parity = np.random.default_rng(0), {}
    tokenizer = load_tokenizer(bundle / load_manifest(bundle, verify=False).tokenizer)
    for role, entry in entries.items():
        backend = TrtBackend(entry, bundle, device, engines)
        if role in quantized:  # the same Q/DQ graph in ONNX Runtime, not the float model
            module = onnx_reference(bundle / quantized[role], entry)
        else:
            module = StepModule(load_checkpoint(bundle / entry.hf_dir, entry.dtype, device)).eval()
        report = check_engine_step(backend, rng, check_shapes(cfg), text_tokens(tokenizer, entry.vocab_size), module,
                                   per_unit=QUANT_TOL if role in quantized else None)
        check_tolerance(f"the {role}'s TensorRT step", report,
                        f"ONNX Runtime running its {cfg.quant} graph" if role in quantized else "its eager step")
        parity[role] = report.max_logit_err
        del backend, module
    engines = replace(engines, parity=parity)
    artifacts.save(bundle, engines)
    _remove_unnamed_plans(bundle, plans)
    return engines

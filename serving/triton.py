"""`specrt triton --bundle B --out REPO`: a Triton Inference Server model repository for a bundle.

    REPO/specrt_target/config.pbtxt, 1/model.onnx      each step graph as an onnxruntime_onnx model (the step
    REPO/specrt_draft/...                              contract's tensors; its external data file beside it)
    REPO/specrt_target_trt/config.pbtxt, 1/model.plan  where the bundle has TensorRT engines: tensorrt_plan
    REPO/specrt_draft_trt/...                          models, one instance group per slot with its profiles
    REPO/specrt/config.pbtxt, 1/model.py               specrt's decode loop (serving/triton_model.py), a
                                                       decoupled Python-backend model batching requests
                                                       continuously and streaming text

The layout and configuration fields follow Triton's model repository and model configuration documentation. The
decode-loop model is what `specrt serve` runs on a real tritonserver (serving/tritonserver.py: the nvidia-pytriton
wheel's, which has the Python backend only); the step-graph and TensorRT models load on a full Triton, whose ONNX
Runtime and TensorRT backends serve them to clients of their own (ensembles, BLS), and are checked here by parsing
their configs with tritonclient's model_config protobuf.

The repository is written next to REPO and swapped into place (bundle.files.replace_dir); a directory that is
neither empty nor a repository specrt wrote is never replaced. Model files are hard links to the bundle's where
the filesystem allows (copies elsewhere): the repository is cheap, and a re-export of the bundle does not change
what an existing repository serves.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from specrt import contract
from specrt.bundle import artifacts
from specrt.bundle.artifacts import TrtEngineSet
from specrt.files import UMASK, replace_dir, write_atomic
from specrt.bundle.manifest import VERIFY_FLAGS, BundleOptions, ModelEntry, load_manifest, manifest_sha256
from specrt.config import field_types, option, unwrap_optional
from specrt.errors import SpecrtError
from specrt.runtime.backends import BackendOptions, backend_kind

MARKER = "specrt-triton.json"  # a file at the repository's top level (Triton looks only at directories there)
DECODE_MODEL = "specrt"
# the decode-loop model's optional inputs (serving/triton_model.py) -> Triton data type
DECODE_INPUTS = {"MAX_NEW_TOKENS": "INT32", "METHOD": "STRING", "TEMPERATURE": "FP32", "TOP_K": "INT32", "TOP_P": "FP32",
                 "SEED": "INT64", "STREAM": "BOOL"}
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


@dataclass(frozen=True)
class TritonConfig(BundleOptions, BackendOptions):
    """The backend options are those the decode-loop model loads the bundle with (Pipeline.load's)."""

    out: Path = option(Path("build/triton"), "model repository directory (created, or replaced if specrt wrote it)")
    method: str = option("sd", "the method a request that names none gets")
    max_batch: int = option(8, "sequences one continuously batched loop decodes at once (more requests wait for a "
                               "place)", ge=1)
    stream_interval_ms: float = option(20.0, "a streamed request gets at most one response per this many ms (the "
                                             "rounds accepted meanwhile come as one piece; the first goes out at once): "
                                             "every response is a round trip from the Python backend to the server "
                                             "(0: one per round)", ge=0)
    instances: int = option(1, "decode-loop model instances: processes, each loading the bundle and batching the "
                               "requests Triton gives it (on the ort backend --threads, default every core, is split "
                               "between them)", ge=1)
    step_kind: str = option("cpu", "where Triton runs the ONNX step-graph models (onnxruntime_onnx)",
                            choices=("cpu", "gpu"))

    @classmethod
    def part_of(cls, cfg) -> "TritonConfig":
        """The repository's options of a config that extends these (serve's, triton --k8s's)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


# -- config.pbtxt (protobuf text format) --------------------------------------------------------------
def _text(value, indent: int) -> str:
    pad = "  " * indent
    if isinstance(value, dict):
        return "{\n" + "".join(f"{pad}  {k}{_field(v, indent + 1)}\n" for k, v in value.items()) + pad + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value[1:] if value.startswith("=") else json.dumps(value)  # "=X": an enum constant X
    return str(value)


def _field(value, indent: int) -> str:
    if isinstance(value, list):
        if value and isinstance(value[0], dict):
            return ": [\n" + ",\n".join("  " * (indent + 1) + _text(v, indent + 1) for v in value) + "\n" + \
                "  " * indent + "]"
        return ": [ " + ", ".join(_text(v, indent) for v in value) + " ]"
    return (" " if isinstance(value, dict) else ": ") + _text(value, indent)


def pbtxt(config: dict) -> str:
    """A model configuration as protobuf text (strings quoted; "=NAME" is the enum constant NAME)."""
    return "".join(f"{k}{_field(v, 0)}\n" for k, v in config.items())


# -- the models ---------------------------------------------------------------------------------------
def _tensors(entry: ModelEntry) -> tuple[list[dict], list[dict]]:
    kv = "=" + TRITON_DTYPES[entry.dtype]
    h, d = entry.num_kv_heads, entry.head_dim
    inputs = [{"name": contract.INPUT_IDS, "data_type": "=TYPE_INT64", "dims": [-1, -1]},
              {"name": contract.POSITION_IDS, "data_type": "=TYPE_INT64", "dims": [-1, -1]},
              {"name": contract.ATTENTION_MASK, "data_type": "=TYPE_BOOL", "dims": [-1, -1, -1]}]
    outputs = [{"name": contract.LOGITS, "data_type": "=TYPE_FP32", "dims": [-1, -1, entry.vocab_size]}]
    for layer in range(entry.num_layers):
        inputs += [{"name": n, "data_type": kv, "dims": [-1, h, -1, d]}
                   for n in (contract.past_key(layer), contract.past_value(layer))]
        outputs += [{"name": n, "data_type": kv, "dims": [-1, h, -1, d]}
                    for n in (contract.new_key(layer), contract.new_value(layer))]
    return inputs, outputs


def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dest)


def _step_model(repo: Path, bundle: Path, entry: ModelEntry, kind: str) -> str:
    name = f"specrt_{entry.role}"
    inputs, outputs = _tensors(entry)
    _link(bundle / entry.onnx, repo / name / "1" / "model.onnx")
    data = bundle / f"{entry.onnx}.data"
    if data.is_file():  # the graph names its external data file: it keeps that name, beside model.onnx
        _link(data, repo / name / "1" / data.name)
    config = {"name": name, "platform": "onnxruntime_onnx", "max_batch_size": 0, "input": inputs, "output": outputs,
              "instance_group": [{"kind": "=KIND_" + kind.upper(), "count": 1}]}
    write_atomic(repo / name / "config.pbtxt", pbtxt(config))
    return name


def _trt_model(repo: Path, bundle: Path, entry: ModelEntry, engines: TrtEngineSet) -> str:
    name = f"specrt_{entry.role}_trt"
    inputs, outputs = _tensors(entry)
    _link(bundle / engines.plans[entry.role], repo / name / "1" / "model.plan")
    per_slot = len(engines.token_profiles)
    gpu = int(engines.device.split(":")[1]) if ":" in engines.device else 0
    groups = [{"name": f"slot{s}", "kind": "=KIND_GPU", "count": 1, "gpus": [gpu],
               "profile": [str(s * per_slot + t) for t in range(per_slot)]} for s in range(engines.slots)]
    config = {"name": name, "platform": "tensorrt_plan", "max_batch_size": 0, "input": inputs, "output": outputs,
              "instance_group": groups, "default_model_filename": "model.plan"}
    write_atomic(repo / name / "config.pbtxt", pbtxt(config))
    return name


def load_parameters(cfg: TritonConfig) -> dict[str, str]:
    """The decode-loop model's parameters (config.pbtxt) that say how it loads the bundle: every backend option and
    --verify, as strings (an option left at None is left out); pipeline_options reads them back."""
    values = {f.name: getattr(cfg, f.name) for f in fields(BackendOptions)}
    values["verify"] = cfg.verify
    return {k: ("true" if v else "false") if isinstance(v, bool) else str(v) for k, v in values.items() if v is not None}


def pipeline_options(params: dict[str, str]) -> dict:
    """Pipeline.load's keyword arguments from the decode-loop model's parameters (load_parameters)."""
    types = field_types(BackendOptions)
    values = {}
    for f in fields(BackendOptions):
        text = params.get(f.name)
        if text is not None:
            kind = unwrap_optional(types[f.name])[0]
            values[f.name] = text == "true" if kind is bool else kind(text)
    return {**BackendOptions(**values).pipeline_options(), "verify": VERIFY_FLAGS[params.get("verify", "recorded")]}


def _decode_model(repo: Path, bundle: Path, cfg: TritonConfig) -> str:
    src = Path(__file__).with_name("triton_model.py")
    (repo / DECODE_MODEL / "1").mkdir(parents=True)
    shutil.copyfile(src, repo / DECODE_MODEL / "1" / "model.py")
    params = {"bundle": str(bundle.resolve()), **load_parameters(cfg), "method": cfg.method,
              "max_batch": str(cfg.max_batch), "stream_interval_ms": f"{cfg.stream_interval_ms:g}"}
    host = backend_kind(cfg.backend).host_cores
    if cfg.instances > 1 and host:  # instances on host cores share them: --threads split between them
        from specrt.bundle.machine import resolve_threads

        params["threads"] = str(max(1, resolve_threads(cfg.threads) // cfg.instances))
    config = {
        "name": DECODE_MODEL, "backend": "python", "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": True},
        "input": [{"name": "PROMPT", "data_type": "=TYPE_STRING", "dims": [1]}] + [
            {"name": n, "data_type": "=TYPE_" + t, "dims": [1], "optional": True} for n, t in DECODE_INPUTS.items()],
        "output": [{"name": "TEXT", "data_type": "=TYPE_STRING", "dims": [1]},
                   {"name": "TOKEN_IDS", "data_type": "=TYPE_INT64", "dims": [-1]},
                   {"name": "FINISH_REASON", "data_type": "=TYPE_STRING", "dims": [1]},
                   {"name": "PROMPT_TOKENS", "data_type": "=TYPE_INT64", "dims": [1]},
                   {"name": "TARGET_STEPS", "data_type": "=TYPE_INT64", "dims": [1]}],
        # a host backend runs on host cores; the others place themselves on the device they are given
        "instance_group": [{"kind": "=KIND_CPU" if host else "=KIND_MODEL", "count": cfg.instances}],
        "parameters": [{"key": k, "value": {"string_value": v}} for k, v in params.items() if v],
    }
    write_atomic(repo / DECODE_MODEL / "config.pbtxt", pbtxt(config))
    return DECODE_MODEL


def write_repository(cfg: TritonConfig) -> dict:
    """Write the repository; returns what it holds (also its MARKER file): the bundle, its manifest's sha256, the
    models, and the backend each needs."""
    from specrt.runtime.methods import METHODS

    if cfg.method not in METHODS:
        raise SpecrtError(f"unknown method {cfg.method!r} (choose from {', '.join(METHODS)})")
    bundle, out = Path(cfg.bundle), Path(cfg.out)
    manifest = load_manifest(bundle, cfg.verify_mode)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise SpecrtError(f"{out} exists and is not a model repository specrt wrote: refusing to replace it (choose "
                          "another --out, or empty it)")
    entries = [manifest.models[role] for role in contract.ROLES]
    if not all(e.onnx for e in entries):
        raise SpecrtError(f"{bundle} has no ONNX step graphs (exported with --no-onnx): re-export it with them")
    if backend_kind(cfg.backend).host_cores:  # what the model will load, refused here rather than in the server's log
        # (the device backends run where Triton runs, which need not be this machine: they are checked as it loads)
        from specrt.runtime.loader import resolve

        resolve(bundle, **cfg.pipeline_options())
    # the engines run where Triton runs, which need not be here: checked against the bundle, not this machine
    engines = artifacts.load(bundle, TrtEngineSet, here=False) if (bundle / TrtEngineSet.FILE).is_file() else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~UMASK)
    try:
        # model -> the Triton backend that runs it (a server loads those it has)
        backends = {_step_model(tmp, bundle, e, cfg.step_kind): "onnxruntime" for e in entries}
        if engines is not None:
            backends.update({_trt_model(tmp, bundle, e, engines): "tensorrt" for e in entries})
        backends[_decode_model(tmp, bundle, cfg)] = "python"
        info = {"bundle": str(bundle.resolve()), "manifest_sha256": manifest_sha256(bundle), "models": list(backends),
                "backends": backends}
        write_atomic(tmp / MARKER, json.dumps(info, indent=1) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info

"""`specrt inplace`: step graphs that write their K/V into the cache in place -> inplace/<role>.onnx, inplace.json.

The exported step graphs return the K/V of their T new tokens and the runtime copies the accepted rows into
its cache (DESIGN.md's contract). Their attention concatenates the whole cached K/V with the new rows in
every layer of every step, and no engine can fuse that into an attention kernel reading the cache where it
lies. The in-graph variant (contract.py, kv_update "inplace") takes the cache at its capacity C and the slots
to write at, and in each layer writes the new K/V into the cache with ONNX's TensorScatter and attends over
the updated cache with ONNX's Attention (opset 24), both standard operators:

    ONNX Runtime (1.32 here, CPU) runs TensorScatter in place when present_key.{l} is bound to past_key.{l}'s
                                  memory (the ort backend does), and Attention as one kernel
    TensorRT (>= 10.15)           imports TensorScatter as IKVCacheUpdateLayer (the cache input must have a
                                  static capacity and the output shares its memory) and Attention as IAttention
                                  (a fused kernel), per onnx-tensorrt's operator table (docs/operators.md)

The runtime is unchanged: the backend turns each step's mask [B, T, S + T] into the cache's slots [B, T, C],
and commits the accepted rows where the graph wrote them (KVCache.CacheRows). Rejected rows stay as garbage
beyond each sequence's length, as drafted rows always have.

Each graph is exported from the bundle's hf/ checkpoint by the dynamo exporter (TorchScript has no
TensorScatter), checked in ONNX Runtime against the PyTorch step module on the export's random trees and
ragged batches (graphs.parity, in-graph feeds), then written atomically: graphs under a fresh directory
swapped in, then inplace.json.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from specrt import contract
from specrt.bundle import artifacts
from specrt.bundle.artifacts import InPlaceGraph, InPlaceGraphs, Stamp
from specrt.bundle.manifest import BundleOptions, load_manifest, sha256_file
from specrt.config import option
from specrt.errors import BundleError, SpecrtError
from specrt.export.onnx_export import EXTERNAL_DATA

INPLACE_DIR = "inplace"


@dataclass(frozen=True)
class InPlaceConfig(BundleOptions):
    model: str = option("both", "which step graphs: target, draft or both", choices=("target", "draft", "both"))
    external_data: str = option("auto", "keep the weights in a <graph>.data file beside each graph: auto = over 64 MiB "
                                        "of weights (as specrt export)", choices=EXTERNAL_DATA)


def export_in_place(bundle: Path, role: str, dest: Path, external_data: str = "auto") -> InPlaceGraph:
    """Export and check one model's in-graph variant into `dest` (relative file name filled in by the caller)."""
    import onnxruntime

    from specrt.export.onnx_export import export_step_graph
    from specrt.graphs.parity import check_parity, text_tokens
    from specrt.graphs.passes import graph_bytes
    from specrt.model.checkpoint import load_checkpoint, load_tokenizer
    from specrt.model.eagle import step_module

    manifest = load_manifest(bundle, verify=False)
    entry = manifest.models[role]
    t0 = time.perf_counter()
    model = load_checkpoint(bundle / entry.hf_dir, entry.dtype)
    done = export_step_graph(model, dest, exporter="dynamo", external_data=external_data, kv_update="inplace",
                             hidden=entry.hidden)
    if entry.dtype == "bfloat16":  # ONNX Runtime has no bfloat16 kernels on the CPU: nothing here can check it
        parity = {"cases": 0, "checked": False, "why": "bfloat16: ONNX Runtime has no bfloat16 CPU kernels"}
    else:
        opts = onnxruntime.SessionOptions()
        opts.log_severity_level = 3  # TensorScatter warns on every copy the check's unbound outputs cause
        session = onnxruntime.InferenceSession(str(dest), opts, providers=["CPUExecutionProvider"])
        tokens = text_tokens(load_tokenizer(bundle / manifest.tokenizer), model.config.vocab_size)
        report = check_parity(session, step_module(model, entry.hidden).eval(), tokens, kv_update="inplace")
        del session
        if not report.ok():
            raise SpecrtError(f"the {role}'s in-graph step graph does not match PyTorch: {report}")
        parity = {**report.record(), "checked": True}
    return InPlaceGraph(file="", bytes=graph_bytes(dest), sha256=sha256_file(dest), opset=done["opset"],
                        parity=parity, seconds=round(time.perf_counter() - t0, 2))


def in_place(cfg: InPlaceConfig, progress: bool = True) -> InPlaceGraphs:
    """Write the chosen models' in-graph variants into cfg.bundle; returns inplace.json's content (a model not
    re-made keeps its earlier graph while that was made for this export)."""
    from tqdm import tqdm

    bundle = Path(cfg.bundle)
    manifest = load_manifest(bundle, cfg.verify_mode)
    roles = contract.ROLES if cfg.model == "both" else (cfg.model,)
    previous = {}
    if (bundle / InPlaceGraphs.FILE).is_file():
        try:
            previous = dict(artifacts.load(bundle, InPlaceGraphs).graphs)
        except BundleError:
            previous = {}  # made for another export: stale
    for role in roles:
        if not manifest.models[role].hf_dir:
            raise BundleError(f"{bundle} holds no checkpoint of its {role} to export from: re-export it")
    staging = bundle / f".{INPLACE_DIR}-{int(time.time() * 1e6)}"
    staging.mkdir()
    made = {}
    try:
        for role in tqdm(roles, desc="in-graph KV update", unit="model", disable=not progress):
            made[role] = export_in_place(bundle, role, staging / f"{role}.onnx", cfg.external_data)
        final = bundle / INPLACE_DIR
        final.mkdir(exist_ok=True)
        for role, graph in made.items():  # the other model's graph stays as it was
            for f in final.glob(f"{role}.onnx*"):
                f.unlink()
            for f in staging.glob(f"{role}.onnx*"):
                f.replace(final / f.name)
            made[role] = InPlaceGraph(**{**graph.__dict__, "file": f"{INPLACE_DIR}/{role}.onnx"})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = InPlaceGraphs(stamp=Stamp.make(bundle), graphs={**previous, **made})
    artifacts.save(bundle, result)
    return result


"""Export a target + draft pair of local Hugging Face checkpoints into a specrt bundle.

    export_bundle(ExportConfig(target=..., draft=..., out=...))

writes the two step graphs (specrt.model.step), the tokenizer, copies of the checkpoints and
manifest.json, after checking that the two models can be paired (same tokenizer, same vocabulary)
and that each ONNX graph matches PyTorch on random trees and ragged batches.

Atomic: the bundle is built in a temporary directory next to `out` and swapped into place at the end
(specrt.files.replace_dir), so an interrupted export (an error, Ctrl-C, a kill) leaves the old
bundle as it was. A re-export replaces the whole directory: artifacts made from the old export
(acceptance, latency profile, plan) go with it.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specrt import contract
from specrt.files import UMASK, check_replaceable, replace_dir
from specrt.bundle.manifest import MANIFEST, Manifest, ModelEntry, hash_tree, write_manifest
from specrt.checkpoints import DEMO_DIR
from specrt.config import Config, option
from specrt.errors import SpecrtError
from specrt.model.checkpoint import DTYPES, check_pair, has_tokenizer, load_checkpoint, load_config, load_tokenizer, sliding_window
from specrt.version import __version__

TMP_PREFIX = ".specrt-export-"
EXPORTERS = ("auto", "dynamo", "torchscript")
EXTERNAL_DATA = ("auto", "always", "never")
# external_data="auto": weights above 64 MiB. A protobuf file holds at most 2 GiB, and loading a step graph packs its
# token rows (graphs/packed_rows.py): a graph whose weights lie beside it is parsed without them and
# handed to ONNX Runtime, which reads them from the .data file; one that holds them is parsed and written out whole
EXTERNAL_DATA_BYTES = 64 << 20


@dataclass(frozen=True)
class ExportConfig(Config):
    target: Path = option(DEMO_DIR / "target", "target checkpoint directory (default: the demo target)")
    draft: Path = option(DEMO_DIR / "draft", "draft checkpoint directory (default: the demo draft)")
    out: Path = option(Path("build/demo"), "bundle directory (created, or replaced if it holds a bundle)")
    tokenizer: Path | None = option(None, "tokenizer directory (default: the target's, else the demo's for the demo pair)")
    opset: int = option(18, "ONNX opset (the dynamo exporter needs >= 18)", ge=14)
    exporter: str = option("auto", "auto = the dynamo exporter (torch.export), falling back to the TorchScript one "
                                   "where it cannot export the step module; or either one", choices=EXPORTERS)
    external_data: str = option("auto", "keep the weights in a <graph>.data file beside each step graph (ONNX "
                                        "external data): auto = over 64 MiB of weights (one file holds at most 2 GiB, and "
                                        "such a graph loads several times faster)",
                                choices=EXTERNAL_DATA)
    check: bool = option(True, "check each step graph against PyTorch after export", flag="parity-check")
    onnx: bool = option(True, "write the ONNX step graphs: the ort backend runs them; torch and graphs run the hf/ "
                              "copies, so a GPU bundle of a large model may go without (--no-onnx)")
    dtype: str = option("float32", "weights, activations and K/V cache (float16 and bfloat16 are meant for GPUs; "
                                   "logits stay float32)", choices=DTYPES)

    def tokenizer_dir(self) -> Path:
        if self.tokenizer:
            return self.tokenizer
        if not has_tokenizer(self.target) and self.target.resolve().is_relative_to(DEMO_DIR.resolve()):
            return DEMO_DIR / "tokenizer"
        return self.target


IN_GRAPH_OPSET = 24  # TensorScatter, the in-graph cache update, is an opset-24 operator


def _example_inputs(step, dtype, kv_update: str = "runtime") -> tuple:
    """Inputs of a shape no dimension is 0 or 1 on (the dynamo exporter would specialize it)."""
    import torch

    batch, num_tokens, capacity = 2, 3, 5
    ids = torch.zeros((batch, num_tokens), dtype=torch.int64)
    pos = torch.arange(num_tokens).expand(batch, num_tokens).contiguous()
    past = [torch.zeros((batch, step.num_kv_heads, capacity, step.head_dim), dtype=dtype)
            for _ in range(2 * step.num_layers)]
    features = (torch.zeros((batch, num_tokens, step.fc.out_features), dtype=dtype),) if step.reads_features else ()
    if kv_update == "inplace":  # mask over the cache's slots; the new tokens are written at slots 1..3 and 2..4
        mask = torch.ones((batch, num_tokens, capacity), dtype=torch.bool)
        return (ids, pos, mask, torch.tensor([1, 2]), *features, *past)
    mask = torch.ones((batch, num_tokens, capacity + num_tokens), dtype=torch.bool)
    return (ids, pos, mask, *features, *past)


def _export_torchscript(step, args, path: Path, opset: int) -> None:
    import torch

    num_layers = step.num_layers
    dyn = {contract.INPUT_IDS: {0: "batch", 1: "num_tokens"},
           contract.POSITION_IDS: {0: "batch", 1: "num_tokens"},
           contract.ATTENTION_MASK: {0: "batch", 1: "num_tokens", 2: "capacity_plus_tokens"},
           contract.LOGITS: {0: "batch", 1: "num_tokens"},
           contract.FEATURES: {0: "batch", 1: "num_tokens"}, contract.HIDDEN: {0: "batch", 1: "num_tokens"}}
    for layer in range(num_layers):
        for name in (contract.past_key(layer), contract.past_value(layer)):
            dyn[name] = {0: "batch", 2: "capacity"}
        for name in (contract.new_key(layer), contract.new_value(layer)):
            dyn[name] = {0: "batch", 2: "num_tokens"}
    # over 2 GiB of weights the TorchScript exporter writes external data (a file per tensor) beside `path`
    dyn = {k: v for k, v in dyn.items() if k in step.input_names + step.output_names}
    torch.onnx.export(step, args, str(path), input_names=step.input_names,
                      output_names=step.output_names, dynamic_axes=dyn, opset_version=opset,
                      dynamo=False, do_constant_folding=True)


def _export_dynamo(step, args, path: Path, opset: int, kv_update: str = "runtime") -> None:
    import logging
    import warnings

    import torch
    from torch.export import Dim

    batch, tokens, capacity = Dim("batch"), Dim("num_tokens"), Dim("capacity")
    past = tuple({0: batch, 2: capacity} for _ in range(2 * step.num_layers))
    features = ({0: batch, 1: tokens},) if step.reads_features else ()
    if kv_update == "inplace":
        dyn = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch, 1: tokens, 2: capacity}, {0: batch},
               *features, past)
    else:
        dyn = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch, 1: tokens, 2: Dim("capacity_plus_tokens")},
               *features, past)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "torchvision is not installed" and other notes on ops a step never uses
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(step, args, dynamo=True, dynamic_shapes=dyn, opset_version=opset,
                                        input_names=step.input_names, output_names=step.output_names,
                                        optimize=True, verbose=False)
    finally:
        quiet.setLevel(level)
    program.save(str(path), external_data=True)


def export_step_graph(model, path: Path, opset: int = 18, exporter: str = "auto",
                      external_data: str = "auto", kv_update: str = "runtime", hidden: bool = False) -> dict:
    """Export the model's StepModule to `path` (and `path`.data when its weights go to external data), checked
    and shape-inferred. exporter "auto" is the dynamo exporter (torch.export + onnxscript), falling back to the
    TorchScript one where it fails. Returns what was done: {"exporter", "external_data", and "fallback": why}.

    kv_update "inplace": the InPlaceStepModule (contract.py's in-graph variant) at opset >= 24, dynamo only (the
    TorchScript exporter has no TensorScatter). hidden: with the last hidden state as an output (contract.HIDDEN);
    a feature-level draft head (model/eagle.py) is exported with its features and hidden state."""
    import shutil
    import tempfile

    import torch

    from specrt.graphs.passes import data_file, finalize_graph
    from specrt.model.eagle import step_module

    if exporter not in EXPORTERS or external_data not in EXTERNAL_DATA or kv_update not in contract.KV_UPDATES:
        raise SpecrtError(f"exporter must be one of {EXPORTERS}, external_data one of {EXTERNAL_DATA} and kv_update "
                          f"one of {contract.KV_UPDATES}")
    if kv_update == "inplace":
        if exporter == "torchscript":
            raise SpecrtError("the in-graph KV update is exported by the dynamo exporter only (TorchScript has no "
                              "TensorScatter)")
        exporter, opset = "dynamo", max(opset, IN_GRAPH_OPSET)
    step = step_module(model, hidden, kv_update=kv_update).eval()
    dtype = next(model.parameters()).dtype
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = external_data == "always" or (external_data == "auto" and weight_bytes > EXTERNAL_DATA_BYTES)
    done = {"exporter": "torchscript" if exporter == "torchscript" else "dynamo", "external_data": external}
    args = _example_inputs(step, dtype, kv_update)
    raw_dir = Path(tempfile.mkdtemp(prefix=".raw-", dir=path.parent))  # the raw export and its external data
    try:
        raw = raw_dir / path.name
        with torch.no_grad():
            if done["exporter"] == "dynamo":
                try:
                    done["opset"] = max(opset, 18)
                    _export_dynamo(step, args, raw, done["opset"], kv_update)
                except Exception as e:  # noqa: BLE001 - any failure of torch.export/onnxscript: fall back
                    if exporter == "dynamo":
                        raise SpecrtError(f"the dynamo exporter cannot export the {model.config.model_type} step "
                                          f"module: {str(e).strip().splitlines()[0]} (try --exporter torchscript)"
                                          ) from None
                    for f in raw_dir.iterdir():
                        f.unlink()
                    done.update(exporter="torchscript", fallback=str(e).strip().splitlines()[0][:300])
            if done["exporter"] == "torchscript":
                done["opset"] = opset
                _export_torchscript(step, args, raw, opset)
        finalize_graph(raw, path, external)
        if external:
            os.chmod(data_file(path), 0o666 & ~UMASK)  # onnx creates it 0600; a plain file would get this
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    return done


def _entry(role: str, model, onnx_rel: str, hf_rel: str, dtype: str, hidden: bool) -> ModelEntry:
    c = model.config
    features = getattr(model, "fc", None) is not None
    return ModelEntry(
        role=role, onnx=onnx_rel, hf_dir=hf_rel, model_type=c.model_type,
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size, max_positions=c.max_position_embeddings, sliding_window=sliding_window(c), dtype=dtype,
        num_params=sum(p.numel() for p in model.parameters()),
        hidden=hidden or features, features=features, hidden_size=c.hidden_size if hidden or features else 0,
    )


def _remove_stale_temporaries(parent: Path) -> None:
    """Temporary directories left by exports that were killed (their process is gone)."""
    for d in parent.glob(f"{TMP_PREFIX}*"):
        try:
            pid = int(d.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


def check_inputs(cfg: ExportConfig) -> None:
    """Refuse missing inputs by their flag, before the minute of imports and loading an export starts with."""
    for flag, path in (("--target", cfg.target), ("--draft", cfg.draft)):
        if not Path(path).is_dir():
            raise SpecrtError(f"{flag} {path}: no such directory (a Hugging Face checkpoint directory)")
        if not (Path(path) / "config.json").is_file():
            raise SpecrtError(f"{flag} {path} is not a Hugging Face checkpoint directory (no config.json)")
    if not has_tokenizer(cfg.tokenizer_dir()):
        raise SpecrtError(f"no tokenizer in {cfg.tokenizer_dir()}"
                          + (" (the --tokenizer given)" if cfg.tokenizer else " (the --target's; give one with "
                                                                              "--tokenizer DIR)"))


def export_bundle(cfg: ExportConfig, progress: bool = True) -> Manifest:
    from tqdm import tqdm

    check_inputs(cfg)
    out = Path(cfg.out)
    check_replaceable(out, MANIFEST, "a specrt bundle")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes 0700; the bundle gets what a plain mkdir would give it
    stages = tqdm(total=7, desc="export", disable=not progress, unit="stage")
    try:
        manifest = _build(cfg, tmp, stages)
        replace_dir(tmp, out)
    finally:
        stages.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _check_graph(role: str, path: Path, model, dtype: str, external: bool, tokens, hidden: bool = False) -> dict:
    """Parity of the step graph in ONNX Runtime against the PyTorch step module on feeds from real text (`tokens`)
    with the model's own caches, random trees and ragged batches (graphs.parity). A bfloat16 graph is checked as its
    float32 copy (ONNX Runtime has no bfloat16 kernels on the CPU) against the module in float32 on the same bfloat16
    weights: `model` is upcast in place."""
    import onnxruntime

    from specrt.graphs.parity import check_parity
    from specrt.graphs.passes import data_file, upcast_bfloat16
    from specrt.model.eagle import step_module

    check_dtype = dtype
    if dtype == "bfloat16":
        upcast = path.with_name(f".{role}-float32.onnx")
        upcast_bfloat16(path, upcast, external)
        path, check_dtype = upcast, "float32"
        model.float()
    try:
        sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        report = check_parity(sess, step_module(model, hidden).eval(), tokens)
        del sess
    finally:
        if dtype == "bfloat16":
            path.unlink(missing_ok=True)
            data_file(path).unlink(missing_ok=True)
    if not report.ok():
        raise SpecrtError(f"{role} step graph does not match PyTorch: {report}")
    return {**report.record(), "computed_in": check_dtype}


def _build(cfg: ExportConfig, dest: Path, stages) -> Manifest:
    """Write a complete bundle into the (empty) directory `dest`."""
    import onnx
    import onnxruntime
    import torch
    import transformers

    from tqdm import tqdm

    from specrt.graphs.parity import text_tokens

    from specrt.contract import eagle_shape
    from specrt.model.eagle import assemble_eagle

    tokenizer = load_tokenizer(cfg.tokenizer_dir())
    # a feature-level draft head reads the target's hidden states through the target's own tables: paired by making
    head = eagle_shape(cfg.draft) is not None
    if not head:
        draft_tok = load_tokenizer(cfg.draft) if has_tokenizer(cfg.draft) else None
        check_pair(load_config(cfg.target), load_config(cfg.draft), tokenizer, draft_tok)
    target = load_checkpoint(cfg.target, cfg.dtype)
    draft = assemble_eagle(cfg.draft, target, getattr(torch, cfg.dtype)) if head \
        else load_checkpoint(cfg.draft, cfg.dtype)
    stages.update()
    tokenizer.save_pretrained(dest / "tokenizer")
    models, export, parity = {}, {}, {}
    for role, model, src in (("target", target, cfg.target), ("draft", draft, cfg.draft)):
        onnx_rel, hf_rel = (f"{role}.onnx" if cfg.onnx else ""), f"hf/{role}"
        t0 = time.perf_counter()
        how = {}
        if cfg.onnx:
            stages.set_postfix_str(f"{role}: step graph ({cfg.exporter} exporter)")
            how = export_step_graph(model, dest / onnx_rel, cfg.opset, cfg.exporter, cfg.external_data,
                                    hidden=head and role == "target")
            if "fallback" in how:
                tqdm.write(f"{role}: the dynamo exporter cannot export it ({how['fallback']}); exported with the "
                           "TorchScript exporter")
        stages.update()
        stages.set_postfix_str(f"{role}: checkpoint copy")
        model.save_pretrained(dest / hf_rel, safe_serialization=True)
        stages.update()
        models[role] = _entry(role, model, onnx_rel, hf_rel, cfg.dtype, head and role == "target")
        if cfg.check and cfg.onnx:
            stages.set_postfix_str(f"{role}: parity in ONNX Runtime")
            parity[role] = _check_graph(role, dest / onnx_rel, model, cfg.dtype, how["external_data"],
                                        text_tokens(tokenizer, model.config.vocab_size), head and role == "target")
        stages.update()
        export[role] = {"export_seconds": round(time.perf_counter() - t0, 2), "source": src.name, **how}
    onnx_files = [f for role in contract.ROLES for f in (f"{role}.onnx", f"{role}.onnx.data") if (dest / f).is_file()]
    manifest = Manifest(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        versions={"specrt": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "python": platform.python_version()},
        tokenizer="tokenizer",
        eos_token_id=tokenizer.eos_token_id,
        models=models,
        export=export,
        io={"inputs": contract.input_names(target.config.num_hidden_layers)[:3] + ["past_key.{l}", "past_value.{l}"],
            "outputs": [contract.LOGITS, "new_key.{l}", "new_value.{l}"]},
        parity=parity,
        files=hash_tree(dest, ["tokenizer", "hf"] + onnx_files, record=True),  # dest: staging, written once
    )
    write_manifest(dest, manifest)
    return manifest

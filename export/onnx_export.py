"""Export a target + draft pair of local Hugging Face checkpoints into a specrt bundle.

    export_bundle(ExportConfig(target=..., draft=..., out=...))

writes the two step graphs (specrt.model.step), the tokenizer, copies of the checkpoints and
manifest.json, after checking that the two models can be paired (same tokenizer, same vocabulary)
and that each ONNX graph matches PyTorch on random trees and ragged batches.

Atomic: the bundle is built in a temporary directory next to `out` and swapped into place at the end
(specrt.bundle.files.replace_dir), so an interrupted export (an error, Ctrl-C, a kill) leaves the old
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
from specrt.bundle.files import UMASK, replace_dir
from specrt.bundle.manifest import MANIFEST, MANIFEST_FORMAT, ModelEntry, hash_tree, write_manifest
from specrt.checkpoints import DEMO_DIR
from specrt.config import Config, option
from specrt.errors import SpecrtError
from specrt.model.checkpoint import DTYPES, check_pair, has_tokenizer, load_checkpoint, load_config, load_tokenizer, sliding_window
from specrt.version import __version__

TMP_PREFIX = ".specrt-export-"


@dataclass(frozen=True)
class ExportConfig(Config):
    target: Path = option(DEMO_DIR / "target", "target checkpoint directory (default: the demo target)")
    draft: Path = option(DEMO_DIR / "draft", "draft checkpoint directory (default: the demo draft)")
    out: Path = option(Path("build/demo"), "bundle directory (created, or replaced if it holds a bundle)")
    tokenizer: Path | None = option(None, "tokenizer directory (default: the target's, else the demo's for the demo pair)")
    opset: int = option(17, "ONNX opset", ge=14)
    check: bool = option(True, "check each step graph against PyTorch after export", flag="parity-check")
    onnx: bool = option(True, "write the ONNX step graphs: the ort backend runs them; torch and graphs run the hf/ "
                              "copies, so a GPU bundle of a large model may go without (--no-onnx)")
    dtype: str = option("float32", "weights, activations and K/V cache (float16 is meant for GPUs; logits stay float32)",
                        choices=DTYPES)

    def tokenizer_dir(self) -> Path:
        if self.tokenizer:
            return self.tokenizer
        if not has_tokenizer(self.target) and self.target.resolve().is_relative_to(DEMO_DIR.resolve()):
            return DEMO_DIR / "tokenizer"
        return self.target


def export_step_graph(model, path: Path, opset: int = 17) -> None:
    import torch

    from specrt.model.step import StepModule

    step = StepModule(model).eval()
    num_layers = step.num_layers
    batch, num_tokens, capacity = 2, 3, 5
    ids = torch.zeros((batch, num_tokens), dtype=torch.int64)
    pos = torch.arange(num_tokens).expand(batch, num_tokens).contiguous()
    mask = torch.ones((batch, num_tokens, capacity + num_tokens), dtype=torch.bool)
    dtype = next(model.parameters()).dtype
    past = [torch.zeros((batch, step.num_kv_heads, capacity, step.head_dim), dtype=dtype) for _ in range(2 * num_layers)]
    dyn = {contract.INPUT_IDS: {0: "batch", 1: "num_tokens"},
           contract.POSITION_IDS: {0: "batch", 1: "num_tokens"},
           contract.ATTENTION_MASK: {0: "batch", 1: "num_tokens", 2: "capacity_plus_tokens"},
           contract.LOGITS: {0: "batch", 1: "num_tokens"}}
    for layer in range(num_layers):
        for name in (contract.past_key(layer), contract.past_value(layer)):
            dyn[name] = {0: "batch", 2: "capacity"}
        for name in (contract.new_key(layer), contract.new_value(layer)):
            dyn[name] = {0: "batch", 2: "num_tokens"}
    with torch.no_grad():
        torch.onnx.export(
            step, (ids, pos, mask, *past), str(path),
            input_names=contract.input_names(num_layers),
            output_names=contract.output_names(num_layers),
            dynamic_axes=dyn, opset_version=opset, dynamo=False, do_constant_folding=True,
        )


def _entry(role: str, model, onnx_rel: str, hf_rel: str, dtype: str) -> ModelEntry:
    c = model.config
    return ModelEntry(
        role=role, onnx=onnx_rel, hf_dir=hf_rel, model_type=c.model_type,
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size, max_positions=c.max_position_embeddings, sliding_window=sliding_window(c), dtype=dtype,
        num_params=sum(p.numel() for p in model.parameters()),
    )


def _check_destination(out: Path) -> None:
    """Refuse to replace a directory that is not a bundle and not empty: nothing of the user's is lost."""
    if out.exists() and not out.is_dir():
        raise SpecrtError(f"{out} exists and is not a directory")
    if out.is_dir() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise SpecrtError(f"{out} is a non-empty directory that is not a specrt bundle: refusing to replace it "
                          "(choose another --out, or empty it)")


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


def export_bundle(cfg: ExportConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    out = Path(cfg.out)
    _check_destination(out)
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


def _build(cfg: ExportConfig, dest: Path, stages) -> dict:
    """Write a complete bundle into the (empty) directory `dest`."""
    import onnx
    import onnxruntime
    import torch
    import transformers

    from specrt.graphs.parity import PARITY_TOL, check_parity
    from specrt.graphs.passes import check_and_infer
    from specrt.model.step import StepModule

    tokenizer = load_tokenizer(cfg.tokenizer_dir())
    draft_tok = load_tokenizer(cfg.draft) if has_tokenizer(cfg.draft) else None
    check_pair(load_config(cfg.target), load_config(cfg.draft), tokenizer, draft_tok)
    target, draft = load_checkpoint(cfg.target, cfg.dtype), load_checkpoint(cfg.draft, cfg.dtype)
    stages.update()
    tokenizer.save_pretrained(dest / "tokenizer")
    models, export, parity = {}, {}, {}
    for role, model, src in (("target", target, cfg.target), ("draft", draft, cfg.draft)):
        stages.set_postfix_str(f"{role}: onnx")
        onnx_rel, hf_rel = (f"{role}.onnx" if cfg.onnx else ""), f"hf/{role}"
        t0 = time.perf_counter()
        if cfg.onnx:
            export_step_graph(model, dest / onnx_rel, cfg.opset)
            check_and_infer(dest / onnx_rel)
        stages.update()
        model.save_pretrained(dest / hf_rel, safe_serialization=True)
        stages.update()
        if cfg.check and cfg.onnx:
            stages.set_postfix_str(f"{role}: parity")
            sess = onnxruntime.InferenceSession(str(dest / onnx_rel), providers=["CPUExecutionProvider"])
            report = check_parity(sess, StepModule(model).eval())
            tol = PARITY_TOL[cfg.dtype]
            if not report.ok(tol):
                raise SpecrtError(f"{role} step graph does not match PyTorch: {report} (tolerance {tol})")
            parity[role] = {"cases": report.cases, "max_logit_err": report.max_logit_err, "max_kv_err": report.max_kv_err}
        stages.update()
        models[role] = _entry(role, model, onnx_rel, hf_rel, cfg.dtype).__dict__
        export[role] = {"export_seconds": round(time.perf_counter() - t0, 2), "source": src.name}
    manifest = {
        "format": MANIFEST_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"specrt": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "tokenizer": "tokenizer",
        "eos_token_id": tokenizer.eos_token_id,
        "models": models,
        "export": export,
        "io": {"inputs": contract.input_names(target.config.num_hidden_layers)[:3] + ["past_key.{l}", "past_value.{l}"],
               "outputs": [contract.LOGITS, "new_key.{l}", "new_value.{l}"]},
        "parity": parity,
        "files": hash_tree(dest, ["tokenizer", "hf"] + (["target.onnx", "draft.onnx"] if cfg.onnx else [])),
    }
    write_manifest(dest, manifest)
    return manifest

"""Export a target + draft pair of local Hugging Face checkpoints into a specrt bundle.

    export_bundle(ExportConfig(target=..., draft=..., out=...))

writes the two step graphs (export/step_module.py), the tokenizer, copies of the checkpoints and
manifest.json, after checking that the two models can be paired (same tokenizer, same vocabulary)
and that each ONNX graph matches PyTorch on random trees and ragged batches.
"""

from __future__ import annotations

import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from specrt import __version__, contract
from specrt.errors import SpecrtError, UnsupportedModelError
from specrt.manifest import ModelEntry, hash_tree, write_manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = ("float32", "float16")
PARITY_TOL = {"float32": 1e-4, "float16": 5e-2}  # max |onnx - torch| over logits and new K/V


@dataclass(frozen=True)
class ExportConfig:
    target: Path  # Hugging Face checkpoint directory
    draft: Path
    out: Path  # bundle directory (created or overwritten)
    tokenizer: Path | None = None  # default: the target's directory
    opset: int = 17
    check: bool = True  # parity against PyTorch after export
    dtype: str = "float32"  # weights, activations and K/V; logits are always float32


def load_config(path: Path):
    """The checkpoint's config, refused early if the exporter cannot handle its architecture."""
    from transformers import AutoConfig

    from specrt.export.step_module import check_supported

    if not (path / "config.json").is_file():
        raise SpecrtError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"{path}: cannot read config.json ({e})") from None
    check_supported(config)
    return config


def load_checkpoint(path: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise SpecrtError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    load_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=getattr(torch, dtype))
    except (OSError, RuntimeError, ValueError) as e:
        raise SpecrtError(f"cannot load the checkpoint in {path}: {str(e).splitlines()[0]}") from None
    return model.eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise SpecrtError(f"no tokenizer in {path} (give one with --tokenizer DIR)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def check_pair(target_config, draft_config, tokenizer, draft_tokenizer=None) -> None:
    """Refuse a pair that cannot share token ids."""
    tv, dv = target_config.vocab_size, draft_config.vocab_size
    if tv != dv:
        raise SpecrtError(f"draft and target vocabularies differ (target vocab_size={tv}, draft vocab_size={dv}); "
                          "speculative decoding needs one tokenizer for both")
    if len(tokenizer) > tv:
        raise SpecrtError(f"tokenizer has {len(tokenizer)} tokens but the target's vocab_size is {tv}")
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SpecrtError("draft and target tokenizers differ (their vocabularies map tokens to different ids)")


def export_step_graph(model, path: Path, opset: int = 17) -> None:
    import torch

    from specrt.export.step_module import StepModule

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
        vocab_size=c.vocab_size, max_positions=_max_context(c), dtype=dtype,
        num_params=sum(p.numel() for p in model.parameters()),
    )


def _max_context(config) -> int:
    """The longest context a step graph may see: max positions, or the sliding window if smaller."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return min(config.max_position_embeddings, window) if window else config.max_position_embeddings


def export_bundle(cfg: ExportConfig, progress: bool = True) -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers
    from tqdm import tqdm

    from specrt.export.parity import check_parity
    from specrt.export.step_module import StepModule
    from specrt.graphs.passes import check_and_infer

    cfg.out.mkdir(parents=True, exist_ok=True)
    stages = tqdm(total=7, desc="export", disable=not progress, unit="stage")
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.target)
    draft_tok = load_tokenizer(cfg.draft) if any((cfg.draft / f).is_file() for f in TOKENIZER_FILES) else None
    check_pair(load_config(cfg.target), load_config(cfg.draft), tokenizer, draft_tok)
    target, draft = load_checkpoint(cfg.target, cfg.dtype), load_checkpoint(cfg.draft, cfg.dtype)
    stages.update()
    tok_dir = cfg.out / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    tokenizer.save_pretrained(tok_dir)
    models, parity = {}, {}
    for role, model, src in (("target", target, cfg.target), ("draft", draft, cfg.draft)):
        stages.set_postfix_str(f"{role}: onnx")
        onnx_rel, hf_rel = f"{role}.onnx", f"hf/{role}"
        t0 = time.perf_counter()
        export_step_graph(model, cfg.out / onnx_rel, cfg.opset)
        check_and_infer(cfg.out / onnx_rel)
        stages.update()
        hf_dst = cfg.out / hf_rel
        shutil.rmtree(hf_dst, ignore_errors=True)
        model.save_pretrained(hf_dst, safe_serialization=True)
        stages.update()
        if cfg.check:
            stages.set_postfix_str(f"{role}: parity")
            sess = onnxruntime.InferenceSession(str(cfg.out / onnx_rel), providers=["CPUExecutionProvider"])
            report = check_parity(sess, StepModule(model).eval())
            tol = PARITY_TOL[cfg.dtype]
            if not report.ok(tol):
                raise SpecrtError(f"{role} step graph does not match PyTorch: {report} (tolerance {tol})")
            parity[role] = {"cases": report.cases, "max_logit_err": report.max_logit_err, "max_kv_err": report.max_kv_err}
        stages.update()
        models[role] = _entry(role, model, onnx_rel, hf_rel, cfg.dtype).__dict__ | {"export_seconds": round(time.perf_counter() - t0, 2),
                                                                            "source": src.name}
    manifest = {
        "format": contract.MANIFEST_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"specrt": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "tokenizer": "tokenizer",
        "eos_token_id": tokenizer.eos_token_id,
        "models": {role: {k: v for k, v in m.items() if k in ModelEntry.__dataclass_fields__} for role, m in models.items()},
        "export": {role: {"export_seconds": m["export_seconds"], "source": m["source"]} for role, m in models.items()},
        "io": {"inputs": contract.input_names(target.config.num_hidden_layers)[:3] + ["past_key.{l}", "past_value.{l}"],
               "outputs": [contract.LOGITS, "new_key.{l}", "new_value.{l}"]},
        "parity": parity,
        "files": hash_tree(cfg.out, ["tokenizer", "target.onnx", "draft.onnx", "hf"]),
    }
    write_manifest(cfg.out, manifest)
    stages.close()
    return manifest

"""Function-preserving inflation of a Llama checkpoint to a memory-bound size.

The tiny demo target is overhead-bound (a step costs about as much for 64 tokens as for 1), so it cannot
show what speculation buys on real hardware. Inflating it keeps its exact function while giving it the
weight traffic of a ~150M-parameter model:

- hidden dims d -> D: the original residual stream lives in dims [0, d); added dims stay exactly zero
  because nothing writes there (embedding columns and o_proj / down_proj rows for [d, D) are zero);
- RMSNorm: with D - d zero dims, mean(x^2) shrinks by d/D, so norm weights on [0, d) are scaled by
  sqrt(d/D) and eps by d/D, which makes every normalised value exactly the original's;
- added attention heads (and every head of an added layer, placed after the original ones) get value
  projections that read only the zero dims [d, D), so their values, and their outputs, are exactly
  zero; added MLP units likewise get up projections that read only zero dims, so act(gate) * up = 0;
- every other weight is random (N(0, 0.02)): the output projections of added capacity too, since they
  multiply exact zeros. So the model costs what a dense model of its size costs, and no two layers
  hold byte-identical tensors that an exporter could merge into one cache-resident buffer.

Logits equal the original's up to float rounding (tests/checkpoints/test_inflate.py). The target's hidden state after
its final norm is the original's in dims [0, d) and zero beyond, so an EAGLE head that reads it is grown by the same
rules (inflate_head) and drafts for the inflated target what it drafts for the original.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from specrt.checkpoints import DEMO_DIR, copy_tokenizer
from specrt.config import Config, option
from specrt.contract import EAGLE_FC as FC, EAGLE_HEAD, eagle_shape
from specrt.errors import SpecrtError
from specrt.files import replace_dir, write_json_atomic


# (hidden, intermediate, layers, heads) of the shapes the benches use: a CPU-sized target, and 1B- and 7B-class ones
PRESETS = {"150m": (768, 3072, 16, 12), "1b": (2048, 5632, 22, 32), "7b": (4096, 11008, 32, 64)}


@dataclass(frozen=True)
class InflateConfig(Config):
    src: Path = option(DEMO_DIR / "target", "Hugging Face Llama checkpoint to inflate (default: the demo target), or "
                                            "an EAGLE head (`specrt models eagle`), grown as its target is by the same "
                                            "options")
    out: Path = option(Path("build/inflated/target"), "where the inflated checkpoint goes")
    preset: str = option("150m", "the shape: 150m (CPU benches), 1b or 7b (GPU benches); the four sizes below override "
                                 "it", choices=tuple(PRESETS))
    hidden_size: int | None = option(None, "hidden size", ge=1, flag="hidden")
    intermediate_size: int | None = option(None, "MLP intermediate size", ge=1, flag="intermediate")
    num_layers: int | None = option(None, "layers", ge=1, flag="layers")
    num_heads: int | None = option(None, "attention heads", ge=1, flag="heads")
    dtype: str = option("float32", "weights' dtype (float16 halves a GPU model's memory; the function is kept up to "
                                   "its rounding)", choices=("float32", "float16", "bfloat16"))
    device: str | None = option(None, "where to build it: cpu or cuda[:N] (default: CUDA where present; a 7B-class "
                                      "model in float32 needs 28 GB)")
    seed: int = option(0, "seed of the random weights of added capacity", ge=0)
    std: float = option(0.02, "standard deviation of those weights", gt=0)

    def sizes(self, head_dim: int | None = None, groups: int = 1) -> tuple[int, int, int, int]:
        """(hidden, intermediate, layers, heads): the preset's, where not given. With the source's `head_dim` and GQA
        `groups`, a preset's heads and hidden size (neither given) are fitted to them where they do not fit already:
        the most heads, a multiple of `groups`, of `head_dim` each within the preset's hidden size (SmolLM2's 64-dim
        heads in groups of 3 make the 7b preset's 4096 into 63 heads and 4032)."""
        given = (self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads)
        hidden, intermediate, layers, heads = (g if g is not None else p for g, p in zip(given, PRESETS[self.preset]))
        fits = head_dim is None or (heads * head_dim == hidden and heads % groups == 0)
        if not fits and self.hidden_size is None and self.num_heads is None:
            heads = hidden // head_dim // groups * groups
            hidden = heads * head_dim
        return hidden, intermediate, layers, heads


def _fit(cfg: InflateConfig, old: tuple[int, int, int, int], head_dim: int, groups: int) -> tuple[int, int, int, int]:
    """The configured (hidden, intermediate, layers, heads) for a source of sizes `old`, refused where they would
    shrink it or do not divide into its heads."""
    big, intermediate, num_layers, num_heads = cfg.sizes(head_dim, groups)
    if any(n < o for n, o in zip((big, intermediate, num_layers, num_heads), old)):
        raise SpecrtError("inflate can only grow a model (hidden, intermediate, layers and heads must not shrink)")
    if num_heads * head_dim != big or num_heads % groups:
        raise SpecrtError(f"num_heads * head_dim ({num_heads} * {head_dim}) must equal hidden_size ({big}) "
                          f"and num_heads must be a multiple of the GQA group size {groups}")
    return big, intermediate, num_layers, num_heads


def _copy_layer(layer, src: dict, pre: str, scale: float) -> None:
    """Decoder layer `pre` of the source's weights `src` into the first dims of the inflated `layer` (its other weights
    random already): its heads first, its MLP units first, added heads' values and added units' up projections
    reading nothing, and nothing written to the residual stream's added dims."""
    attn, mlp = layer.self_attn, layer.mlp
    d = src[pre + "input_layernorm.weight"].shape[0]
    q_rows, kv_rows = src[pre + "self_attn.q_proj.weight"].shape[0], src[pre + "self_attn.k_proj.weight"].shape[0]
    inter = src[pre + "mlp.gate_proj.weight"].shape[0]
    attn.o_proj.weight[d:] = 0  # never write the added dims of the residual stream
    mlp.down_proj.weight[d:] = 0
    layer.input_layernorm.weight[:d] = src[pre + "input_layernorm.weight"] * scale
    layer.post_attention_layernorm.weight[:d] = src[pre + "post_attention_layernorm.weight"] * scale
    attn.q_proj.weight[:q_rows, :d] = src[pre + "self_attn.q_proj.weight"]
    attn.k_proj.weight[:kv_rows, :d] = src[pre + "self_attn.k_proj.weight"]
    attn.v_proj.weight[:kv_rows, :d] = src[pre + "self_attn.v_proj.weight"]
    attn.v_proj.weight[kv_rows:, :d] = 0  # added heads: zero values
    attn.o_proj.weight[:d, :q_rows] = src[pre + "self_attn.o_proj.weight"]
    mlp.gate_proj.weight[:inter, :d] = src[pre + "mlp.gate_proj.weight"]
    mlp.up_proj.weight[:inter, :d] = src[pre + "mlp.up_proj.weight"]
    mlp.up_proj.weight[inter:, :d] = 0  # added units: zero up projection
    mlp.down_proj.weight[:d, :inter] = src[pre + "mlp.down_proj.weight"]


def _built(make, cfg: InflateConfig, device):
    """`make()`'s module built in the configured dtype on `device`, every weight N(0, std) (cfg.seed)."""
    import torch

    torch.manual_seed(cfg.seed)
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(getattr(torch, cfg.dtype))
        with torch.device(device):
            module = make().eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, cfg.std)
    return module


def inflate_model(model, cfg: InflateConfig):
    """A new LlamaForCausalLM computing the same logits as `model`, at the configured size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    old = model.config
    if old.model_type != "llama":
        raise SpecrtError(f"inflate handles Llama checkpoints, got model_type={old.model_type!r}")
    head_dim = getattr(old, "head_dim", None) or old.hidden_size // old.num_attention_heads
    groups = old.num_attention_heads // old.num_key_value_heads
    d = old.hidden_size
    big, intermediate, num_layers, num_heads = _fit(
        cfg, (d, old.intermediate_size, old.num_hidden_layers, old.num_attention_heads), head_dim, groups)
    new_cfg = LlamaConfig(**{**old.to_dict(), "hidden_size": big, "intermediate_size": intermediate,
                             "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
                             "num_key_value_heads": num_heads // groups, "head_dim": head_dim,
                             "rms_norm_eps": old.rms_norm_eps * d / big, "dtype": cfg.dtype})
    # built where the source is: on a GPU, in seconds
    new = _built(lambda: LlamaForCausalLM(new_cfg), cfg, next(model.parameters()).device)
    scale = math.sqrt(d / big)
    src = dict(model.named_parameters())

    with torch.no_grad():
        new.model.embed_tokens.weight[:, d:] = 0
        new.model.embed_tokens.weight[:, :d] = src["model.embed_tokens.weight"]
        new.lm_head.weight[:, :d] = model.lm_head.weight  # the embeddings where they are tied (SmolLM2's)
        new.model.norm.weight[:d] = src["model.norm.weight"] * scale
        for i, layer in enumerate(new.model.layers):
            if i >= old.num_hidden_layers:  # an added layer: values and up projections read zeros only
                layer.self_attn.o_proj.weight[d:] = 0
                layer.mlp.down_proj.weight[d:] = 0
                layer.self_attn.v_proj.weight[:, :d] = 0
                layer.mlp.up_proj.weight[:, :d] = 0
                continue
            _copy_layer(layer, src, f"model.layers.{i}.", scale)
    new.generation_config = model.generation_config
    return new


def inflate_head(cfg: InflateConfig, device: str) -> tuple[dict, dict]:
    """A trained EAGLE head (`specrt models eagle`'s directory, cfg.src) grown by the options that grow its target:
    its layer as inflate_model grows a target's, its final norm scaled alike, and its `fc` [D, 2D] reading the first
    d dims of the embedding and of the features where the head's read them and writing the first d only. Beside its
    target inflated by the same options it computes what the head computes beside the original: the same logits,
    and hidden states of the same first d dims, the rest exactly zero. Returns (weights, config.json)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = json.loads((cfg.src / "config.json").read_text())
    shape = config[EAGLE_HEAD]
    d, head_dim = shape["hidden_size"], shape["head_dim"]
    groups = shape["num_attention_heads"] // shape["num_key_value_heads"]
    big, intermediate, _, num_heads = _fit(
        cfg, (d, shape["intermediate_size"], 1, shape["num_attention_heads"]), head_dim, groups)
    grown = {"hidden_size": big, "intermediate_size": intermediate, "num_attention_heads": num_heads,
             "num_key_value_heads": num_heads // groups, "rms_norm_eps": shape["rms_norm_eps"] * d / big}
    llama = LlamaConfig(**{k: v for k, v in {**shape, **grown}.items() if k not in ("target", "key")},
                        num_hidden_layers=1)
    layer = _built(lambda: LlamaDecoderLayer(llama, 0), cfg, device)
    src = {k: v.to(device=device, dtype=torch.float32)
           for k, v in load_file(str(cfg.src / "model.safetensors")).items()}
    scale = math.sqrt(d / big)
    dtype = getattr(torch, cfg.dtype)
    with torch.no_grad():
        _copy_layer(layer, src, "model.layers.0.", scale)
        norm = torch.empty(big, device=device).normal_(0.0, cfg.std)
        norm[:d] = src["model.norm.weight"] * scale
        fc = torch.empty(big, 2 * big, device=device).normal_(0.0, cfg.std)
        fc[d:] = 0  # the residual stream's added dims stay zero
        fc[:d, :d], fc[:d, big:big + d] = src[FC][:, :d], src[FC][:, d:]  # [embedding; features], each's first d
    weights = {f"model.layers.0.{k}": v for k, v in layer.state_dict().items()}
    weights.update({"model.norm.weight": norm, FC: fc})
    weights = {k: v.to(dtype).contiguous().cpu() for k, v in weights.items()}
    return weights, {**config, EAGLE_HEAD: {**shape, **grown, "inflated_from": str(cfg.src)}}


def inflate(cfg: InflateConfig) -> Path:
    """The checkpoint cfg.src inflated into cfg.out, whole or not at all, with inflate.json: a target (inflate_model,
    its tokenizer copied), or an EAGLE head (inflate_head: the files beside its weights copied)."""
    import torch

    if not (cfg.src / "config.json").is_file():
        raise SpecrtError(f"{cfg.src} is not a Hugging Face checkpoint directory (no config.json)")
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecrtError(f"device {device!r}: PyTorch {torch.__version__} finds no CUDA device on this machine")
    tmp = cfg.out.parent / f".{cfg.out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if eagle_shape(cfg.src) is not None:
        from safetensors.torch import save_file

        weights, config = inflate_head(cfg, device)
        tmp.mkdir(parents=True)
        save_file(weights, str(tmp / "model.safetensors"))
        for f in cfg.src.iterdir():  # its training record and held-out prompts: the function they measured is kept
            if f.is_file() and f.name not in ("config.json", "model.safetensors", "inflate.json"):
                shutil.copyfile(f, tmp / f.name)
        write_json_atomic(tmp / "config.json", config)
        shape = config[EAGLE_HEAD]
        sizes = (shape["hidden_size"], shape["intermediate_size"], 1, shape["num_attention_heads"])
        num_params = sum(v.numel() for v in weights.values())
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.src, local_files_only=True,
                                                     dtype=torch.float32).eval().to(device)
        new = inflate_model(model, cfg)
        c = new.config
        sizes = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
        new.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer(cfg.src, tmp)
        num_params = sum(p.numel() for p in new.parameters())
    write_json_atomic(tmp / "inflate.json", {"src": str(cfg.src), "num_params": num_params, "device": device,
                                             "sizes": sizes, **{k: v for k, v in cfg.__dict__.items()
                                                                if k not in ("src", "out")}})
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    replace_dir(tmp, cfg.out)  # a reader sees the whole checkpoint or none: an interrupted inflate leaves no half
    print(f"inflated {cfg.src} -> {cfg.out}: {num_params / 1e6:.1f}M params")
    return cfg.out

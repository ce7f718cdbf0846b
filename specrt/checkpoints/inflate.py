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

Logits equal the original's up to float rounding (tests/checkpoints/test_inflate.py).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from specrt.checkpoints import DEMO_DIR, copy_tokenizer
from specrt.config import Config, option
from specrt.errors import SpecrtError
from specrt.files import replace_dir, write_json_atomic


# (hidden, intermediate, layers, heads) of the shapes the benches use: a CPU-sized target, and 1B- and 7B-class ones
PRESETS = {"150m": (768, 3072, 16, 12), "1b": (2048, 5632, 22, 32), "7b": (4096, 11008, 32, 64)}


@dataclass(frozen=True)
class InflateConfig(Config):
    src: Path = option(DEMO_DIR / "target", "Hugging Face Llama checkpoint to inflate (default: the demo target)")
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


def inflate_model(model, cfg: InflateConfig):
    """A new LlamaForCausalLM computing the same logits as `model`, at the configured size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    old = model.config
    head_dim = getattr(old, "head_dim", None) or old.hidden_size // old.num_attention_heads
    groups = old.num_attention_heads // old.num_key_value_heads
    big, intermediate, num_layers, num_heads = cfg.sizes(head_dim, groups)
    d = old.hidden_size
    if old.model_type != "llama":
        raise SpecrtError(f"inflate handles Llama checkpoints, got model_type={old.model_type!r}")
    if big < d or intermediate < old.intermediate_size or num_layers < old.num_hidden_layers \
            or num_heads < old.num_attention_heads:
        raise SpecrtError("inflate can only grow a model (hidden, intermediate, layers and heads must not shrink)")
    if num_heads * head_dim != big or num_heads % groups:
        raise SpecrtError(f"num_heads * head_dim ({num_heads} * {head_dim}) must equal hidden_size ({big}) "
                          f"and num_heads must be a multiple of the GQA group size {groups}")
    new_cfg = LlamaConfig(**{**old.to_dict(), "hidden_size": big, "intermediate_size": intermediate,
                             "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
                             "num_key_value_heads": num_heads // groups, "head_dim": head_dim,
                             "rms_norm_eps": old.rms_norm_eps * d / big, "dtype": cfg.dtype})
    torch.manual_seed(cfg.seed)
    device = next(model.parameters()).device  # built where the source is: on a GPU, in seconds
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(getattr(torch, cfg.dtype))
        with torch.device(device):
            new = LlamaForCausalLM(new_cfg).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    scale = math.sqrt(d / big)
    src = dict(model.named_parameters())

    with torch.no_grad():
        for p in new.parameters():
            p.normal_(0.0, cfg.std)
        new.model.embed_tokens.weight[:, d:] = 0
        new.model.embed_tokens.weight[:, :d] = src["model.embed_tokens.weight"]
        new.lm_head.weight[:, :d] = model.lm_head.weight  # the embeddings where they are tied (SmolLM2's)
        new.model.norm.weight[:d] = src["model.norm.weight"] * scale
        q_rows, kv_rows = old.num_attention_heads * head_dim, old.num_key_value_heads * head_dim
        inter = old.intermediate_size
        for i, layer in enumerate(new.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj.weight[d:] = 0  # never write the added dims of the residual stream
            mlp.down_proj.weight[d:] = 0
            if i >= old.num_hidden_layers:  # an added layer: values and up projections read zeros only
                attn.v_proj.weight[:, :d] = 0
                mlp.up_proj.weight[:, :d] = 0
                continue
            pre = f"model.layers.{i}."
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
    new.generation_config = model.generation_config
    return new


def inflate(cfg: InflateConfig) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    if not (cfg.src / "config.json").is_file():
        raise SpecrtError(f"{cfg.src} is not a Hugging Face checkpoint directory (no config.json)")
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecrtError(f"device {device!r}: PyTorch {torch.__version__} finds no CUDA device on this machine")
    model = AutoModelForCausalLM.from_pretrained(cfg.src, local_files_only=True, dtype=torch.float32).eval().to(device)
    new = inflate_model(model, cfg)
    c = new.config
    sizes = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
    tmp = cfg.out.parent / f".{cfg.out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
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

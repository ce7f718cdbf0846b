"""StepModule: a Hugging Face Llama-family model (Llama, Mistral, Qwen2/3, OLMo 2, Granite, Phi-3, Gemma 2/3;
`Family`) rewritten to the step contract.

It reuses the checkpoint's own submodules (embeddings, norms, projections, MLP, rotary embedding, head)
and replaces only the attention core, so that the mask is the caller's general boolean mask
[B, T, S + T] (chains, trees, holes, ragged batches) instead of a causal mask built inside the graph,
and so that only the K/V of the T new tokens comes out. The same module is exported to ONNX and run by
TorchBackend, so both backends compute the same function.

Prompt tokens (PPD): `prompt_embeddings` [P, hidden] are extra rows of the input embedding table, looked up by
ids V .. V + P - 1; the head still scores the first V tokens only (logits [B, T, V]). The step contract does
not change: a prompt token is an input id like any other.

Invariants: a row whose mask is all False produces finite garbage (never NaN), and is never read.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from specrt import contract
from specrt.contract import HEAD_VOCABULARY, SUPPORTED_MODEL_TYPES, UNSCORED_LOGIT, rotate_half_matrix
from specrt.errors import UnsupportedModelError
from specrt.model.step_ops import grouped_matmul, merged_linear, rope, scatter_rows


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported by the step-graph exporter "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for kind in rope_types(config):
        if kind in ("dynamic", "longrope"):
            raise UnsupportedModelError(f"{kind!r} RoPE scaling changes with the sequence length (longrope: its short "
                                        "and long factors) and cannot be a static step graph")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"model_type={model_type!r} with use_bidirectional_attention is an encoder "
                                    "(EmbeddingGemma): it does not decode, so there is no step graph to export")


def rope_parameters(config) -> dict:
    """The config's RoPE parameters (transformers 5: rope_parameters; 4.x: rope_scaling), {} without any."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rope_types(config) -> set[str]:
    """The RoPE kinds a config uses: one, or one per layer type (Gemma 3 in transformers 5: its rope_parameters keyed
    by layer type)."""
    params = rope_parameters(config)
    each = [p for p in params.values() if isinstance(p, dict)] or [params]
    return {p.get("rope_type", p.get("type")) or "default" for p in each}


@dataclass(frozen=True)
class Family:
    """What an architecture of the Llama family changes in the step: one StepModule for all, each family a few
    switches and constants read from its config (family_of), not a copy of the module."""

    qk_norm: str | None = None  # RMSNorm of queries and keys before RoPE: "head" over each head (Qwen3), "projection"
    #                             over the whole projection (OLMo 2)
    post_norm: bool = False  # norms after attention and after the MLP, none before them (OLMo 2)
    embedding_multiplier: float = 1.0  # the input embeddings scaled (Granite)
    residual_multiplier: float = 1.0  # attention's and the MLP's outputs scaled before each residual add (Granite)
    logits_scaling: float = 1.0  # the logits divided by it (Granite)
    fused_qkv: bool = False  # one qkv_proj, split into queries, keys and values (Phi-3)
    partial_rotary_factor: float = 1.0  # RoPE on this share of each head's dimensions, the rest passed (Phi-4-mini)
    sandwich_norm: bool = False  # norms before and after attention and the MLP (Gemma 2: pre/post_feedforward)
    attn_softcap: float | None = None  # attention scores capped: cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits capped the same way (Gemma 2)
    # per layer: the sliding window its attention is limited to, in the graph (None: the whole context); () where
    # every layer sees what the runtime's mask allows (a window common to all layers is the runtime's: Mistral)
    layer_windows: tuple[int | None, ...] = ()
    # per layer: its layer type, where each type has its own RoPE (Gemma 3: local layers another base, global ones
    # scaled); () where one RoPE serves every layer
    layer_ropes: tuple[str, ...] = ()


def family_of(config) -> Family:
    """The Family of a supported checkpoint's config (check_supported first)."""
    kind = config.model_type
    if kind == "qwen3":
        return Family(qk_norm="head")
    if kind == "olmo2":
        return Family(qk_norm="projection", post_norm=True)
    if kind == "phi3":
        factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return Family(fused_qkv=True, partial_rotary_factor=float(factor or 1.0))
    if kind in ("gemma2", "gemma3_text"):
        windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in config.layer_types)
        gemma3 = kind == "gemma3_text"
        return Family(embedding_multiplier=float(config.hidden_size) ** 0.5, sandwich_norm=True,
                      attn_softcap=config.attn_logit_softcapping, final_softcap=config.final_logit_softcapping,
                      layer_windows=windows if any(windows) else (), qk_norm="head" if gemma3 else None,
                      layer_ropes=tuple(config.layer_types) if gemma3 else ())
    if kind == "granite":
        return Family(embedding_multiplier=float(config.embedding_multiplier),
                      residual_multiplier=float(config.residual_multiplier), logits_scaling=float(config.logits_scaling))
    return Family()


def _rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R with x @ R == cat(-x[..., D/2:], x[..., :D/2]) (contract.rotate_half_matrix): one MatMul in the graph
    instead of Slice, Slice, Neg and Concat (the tiny demo models are bound by per-op overhead)."""
    return torch.from_numpy(rotate_half_matrix(head_dim))


class StepModule(nn.Module):
    """forward(input_ids, position_ids, attention_mask, *past) -> (logits, *new_kv), flat per layer; with `hidden`,
    (logits, *new_kv, hidden): the last hidden state [B, T, H] after the final norm too (contract.HIDDEN).

    Each decoder layer runs as a StepLayer (`layer_steps`), the unit `compile_layers` hands to torch.compile."""

    reads_features = False  # its step takes contract.FEATURES (model/eagle.py)
    kv_update = "runtime"  # who writes the new K/V into the cache (contract.KV_UPDATES): InPlaceStepModule's graph

    def __init__(self, hf_model, prompt_embeddings: torch.Tensor | None = None, hidden: bool = False):
        super().__init__()
        self.hidden = hidden
        config = hf_model.config
        check_supported(config)
        self.hf = hf_model
        self.family = family_of(config)
        if hasattr(hf_model.model.embed_tokens, "embed_scale"):  # transformers 5's Gemma: the table scales itself
            self.family = replace(self.family, embedding_multiplier=1.0)
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = next(hf_model.parameters())
        rotary_dim = int(self.head_dim * self.family.partial_rotary_factor)
        # on the weights' device: a CUDA step multiplying by a host matrix fails at its first op
        self.register_buffer("rotate_half", _rotate_half_matrix(rotary_dim).to(weight.device, weight.dtype),
                             persistent=False)
        # PPD's prompt tokens: a parameter (trained by `specrt ppd train`, everything else frozen) or None
        self.prompt_embeddings = None if prompt_embeddings is None else nn.Parameter(
            prompt_embeddings.to(weight.device, weight.dtype), requires_grad=False)
        # a plain list, not submodules: the layers' parameters keep their one name (hf.model.layers.N...), in
        # state dicts and exported graphs alike
        self.layer_steps = [StepLayer(layer, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim,
                                      self.family) for layer in hf_model.model.layers]
        self._layer_calls = list(self.layer_steps)  # what forward calls: the layers, or their compiled versions
        self.register_buffer("head_rows", None, persistent=False)
        self.register_buffer("head_ids", None, persistent=False)
        kept = getattr(config, HEAD_VOCABULARY, None)
        if kept is not None:
            self._keep_head_rows(kept)

    def _keep_head_rows(self, kept) -> None:
        """The LM head over the token ids `kept` only (contract.HEAD_VOCABULARY): their rows of the head's weight
        [K, hidden] and the ids themselves [K], where their logits are scattered among the vocabulary's."""
        head = self.hf.lm_head
        vocab = head.weight.shape[0]
        ids = torch.as_tensor(kept, dtype=torch.long)
        if ids.ndim != 1 or not 0 < len(ids) < vocab or int(ids.min()) < 0 or int(ids.max()) >= vocab \
                or len(torch.unique(ids)) != len(ids) or getattr(head, "bias", None) is not None:
            raise UnsupportedModelError(f"{HEAD_VOCABULARY} must list distinct token ids below the vocabulary's "
                                        f"{vocab}, fewer than all, for an LM head without a bias")
        weight = head.weight.detach()
        self.head_vocab = vocab
        self.register_buffer("head_rows", weight[ids.to(weight.device)].clone(), persistent=False)
        self.register_buffer("head_ids", ids.to(weight.device), persistent=False)

    def fuse_projections(self, which: str) -> None:
        """Merge each layer's projections that read one input (StepLayer.fuse_projections; which: "qkv", "all" or
        "none")."""
        if which != "none":
            for layer in self.layer_steps:
                layer.fuse_projections(which)

    def merged_projections(self) -> list[nn.Linear]:
        """The linears fuse_projections made (not submodules: their weights keep the separate linears' names)."""
        return [m for s in self.layer_steps for m in (s.qkv_proj, s.gate_up_proj) if m is not None]

    def compile_layers(self, mode: str | None, **options) -> None:
        """Run each decoder layer through torch.compile (`mode`: its mode; None: eagerly again). The layers share
        one code object and, with their parameters as graph inputs (PyTorch >= 2.5's default), one compiled graph
        per input shape: compiling one layer compiles them all (PyTorch's "regional compilation" recipe), so the
        cost does not grow with depth. `options`: torch.compile's other arguments (dynamic, fullgraph), and `inductor`:
        inductor's options, which replace the mode's (torch.compile takes one or the other)."""
        if mode is None:
            self._layer_calls = list(self.layer_steps)
            return
        inductor = options.pop("inductor", None)
        how = {"options": inductor} if inductor else {"mode": mode}
        self._layer_calls = [torch.compile(layer, **how, **options) for layer in self.layer_steps]

    @property
    def compiled(self) -> bool:
        return self._layer_calls[0] is not self.layer_steps[0]

    @contextmanager
    def eager(self):
        """Inside the block the layers run eagerly (a compiled step's reference; not for concurrent callers)."""
        calls, self._layer_calls = self._layer_calls, list(self.layer_steps)
        try:
            yield self
        finally:
            self._layer_calls = calls

    def embed(self, input_ids):
        """[B, T, hidden] embeddings of token ids and (ids >= V) prompt tokens."""
        table, scale = self.hf.model.embed_tokens, self.family.embedding_multiplier
        if self.prompt_embeddings is None:
            x = table(input_ids)
        else:
            # two lookups and a select, not one lookup in the two tables concatenated: that would copy the whole
            # vocabulary's embeddings every step
            vocab = table.weight.shape[0]
            prompt = input_ids >= vocab
            words = table(torch.where(prompt, 0, input_ids))
            prompts = nn.functional.embedding(torch.where(prompt, input_ids - vocab, 0), self.prompt_embeddings)
            x = torch.where(prompt[..., None], prompts, words)
        return x if scale == 1.0 else x * scale

    @property
    def input_names(self) -> list[str]:
        return contract.input_names(self.num_layers, self.kv_update, self.reads_features)

    @property
    def output_names(self) -> list[str]:
        return contract.output_names(self.num_layers, self.kv_update, self.hidden)

    def forward(self, input_ids, position_ids, attention_mask, *past, room: bool = False):
        # input_ids, position_ids: [B, T]; attention_mask: [B, T, S + T] bool
        # past: past_key.0, past_value.0, past_key.1, ... each [B, Hkv, S, D]; with room, [B, Hkv, S + T, D], the
        # new rows written into the last T slots (StepLayer.forward)
        return self._step(self.embed(input_ids), position_ids, attention_mask, past, room)

    def _step(self, x, position_ids, attention_mask, past, room: bool):
        """The step from the new tokens' input rows x [B, T, hidden] on."""
        ropes = self._ropes(x, position_ids)
        # scores, bias and softmax are float32 whatever the weights' dtype (no fp16 overflow to -inf)
        bias = torch.where(attention_mask, 0.0, torch.finfo(torch.float32).min)[:, None, None]  # [B, 1, 1, T, S + T]
        cached = past[0].shape[2] - (position_ids.shape[1] if room else 0)
        biases = {w: bias.masked_fill(far[:, None, None], torch.finfo(torch.float32).min)
                  for w, far in self._far(position_ids, cached, new=True).items()}
        new_kv = []
        for layer_idx, layer in enumerate(self._layer_calls):
            window = self.family.layer_windows[layer_idx] if self.family.layer_windows else None
            x, k, v = layer(x, *ropes[layer_idx], biases.get(window, bias), self.rotate_half, past[2 * layer_idx],
                            past[2 * layer_idx + 1], room)
            new_kv += [k, v]
        x = self.hf.model.norm(x)
        return (self._logits(x), *new_kv) + ((x,) if self.hidden else ())

    def _far(self, position_ids, slots: int, new: bool = False) -> dict:
        """{window: [B, T, K] bool} of the family's windowed layers: True where a key is `window` or more positions
        before its query. The keys: `slots` cache slots, each holding the position of its index (the runtime appends
        accepted rows in order, from position 0), then with `new` the new tokens, at position_ids."""
        if not self.family.layer_windows:
            return {}
        keys = torch.arange(slots, device=position_ids.device)[None].expand(position_ids.shape[0], slots)
        distance = position_ids[:, :, None] - (torch.cat([keys, position_ids], dim=1) if new else keys)[:, None, :]
        return {w: distance >= w for w in set(self.family.layer_windows) if w is not None}

    def _ropes(self, x, position_ids):
        """[(cos, sin) [B, 1, 1, T, D] of each layer] of the new tokens (x: their rows [B, T, hidden])."""
        model, types = self.hf.model, self.family.layer_ropes
        if not types:
            tables = {None: model.rotary_emb(x, position_ids)}  # [B, T, D] each
        elif hasattr(model, "rotary_emb_local"):  # transformers 4.x's Gemma 3: a second module for the local layers
            tables = {"full_attention": model.rotary_emb(x, position_ids),
                      "sliding_attention": model.rotary_emb_local(x, position_ids)}
        else:
            tables = {t: model.rotary_emb(x, position_ids, t) for t in set(types)}
        tables = {t: (cos[:, None, None], sin[:, None, None]) for t, (cos, sin) in tables.items()}
        return [tables[types[i] if types else None] for i in range(self.num_layers)]

    def _logits(self, x):
        """The LM head's logits of the final norm's output x."""
        kept = self.head_rows is not None
        logits = (nn.functional.linear(x, self.head_rows) if kept else self.hf.lm_head(x)).float()  # [B, T, V or K]
        scaling, cap = self.family.logits_scaling, self.family.final_softcap
        logits = logits if scaling == 1.0 else logits / scaling
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        if not kept:
            return logits
        # [B, T, V]: every id unscored, then the K scored ones written in (a scatter of K columns; a gather of all V
        # columns took ONNX Runtime 6x as long: one element copy per id)
        rows = logits.shape[:-1]
        return logits.new_full((*rows, self.head_vocab), UNSCORED_LOGIT).scatter(
            -1, self.head_ids.expand(*rows, -1), logits)


class StepLayer(nn.Module):
    """One decoder layer of the step: forward(x, cos, sin, bias, rotate_half, past_key, past_value) -> (x, new key,
    new value), attending to the past and the new tokens under the additive float32 `bias` [B, 1, 1, T, S + T]."""

    def __init__(self, layer, num_kv_heads: int, groups: int, head_dim: int, family: Family = Family()):
        super().__init__()
        self.layer = layer
        self.num_kv_heads, self.groups, self.head_dim, self.family = num_kv_heads, groups, head_dim, family
        self.qkv_proj = self.gate_up_proj = None  # the projections merged (fuse_projections), or None

    def fuse_projections(self, which: str) -> None:
        """Merge the projections that read one input into one linear over their weights side by side (which:
        contract.PROJECTIONS): q, k and v, and with "all" the MLP's gate and up: at one token a step is a chain of
        matrix-vector products, and a merged one is one kernel reading one matrix. The separate linears' weights
        become views of the merged one's (no second copy). Projections that are not plain linears of one input size
        and dtype (8-bit ones, model/quant.py) stay apart, as does an MLP whose forward is not
        down(act(gate(x)) * up(x)) on a probe row."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        if which in ("qkv", "all") and not self.family.fused_qkv and self.qkv_proj is None:
            self.qkv_proj = merged_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        names = ("gate_proj", "up_proj", "down_proj", "act_fn")
        if which == "all" and self.gate_up_proj is None and all(hasattr(mlp, n) for n in names) \
                and getattr(mlp.gate_proj, "out_features", None) == getattr(mlp.up_proj, "out_features", 0):
            probe = torch.randn((1, 1, mlp.gate_proj.in_features), generator=torch.Generator().manual_seed(0))
            probe = probe.to(mlp.gate_proj.weight.device, mlp.gate_proj.weight.dtype)
            with torch.no_grad():
                before = mlp(probe)
                self.gate_up_proj = merged_linear([mlp.gate_proj, mlp.up_proj])
                if self.gate_up_proj is not None and not torch.allclose(
                        self.mlp(probe), before, rtol=1e-2, atol=1e-2 * float(before.abs().max())):
                    self.gate_up_proj = None

    def mlp(self, x):
        if self.gate_up_proj is None:
            return self.layer.mlp(x)
        mlp = self.layer.mlp
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def forward(self, x, cos, sin, bias, rotate_half, past_key, past_value, room: bool = False):
        """room: past_key and past_value reach T slots past the cached ones (the static engines' cache views): the new
        keys and values are written there, and attention reads the cache and them in place, joined without a copy."""
        layer = self.layer
        q, k, v = self.qkv(x, cos, sin, rotate_half)
        if room:
            new = k.shape[2]
            past_key[:, :, -new:].copy_(k)
            past_value[:, :, -new:].copy_(v)
            keys, values = past_key, past_value  # [B, Hkv, S + T, D]
            past_key, past_value = past_key[:, :, :-new], past_value[:, :, :-new]
        # float32: the cache and the new tokens are attended to apart, under one softmax (the scores joined, not
        # the keys and values), so a step reads the cache where it lies instead of copying all of it next to the T
        # new rows in every layer. Half precision keeps one product over the joined cache: there, summing the
        # values in two parts split where the cache ends rounds a token differently in a one-token step than in a
        # verify step (the split moves), which flipped greedy tokens of the float16 bundle; it takes a KV head's
        # query heads as rows of one product over it (grouped_matmul). Float32 keeps a product per query head: with
        # the heads as rows, a verify step's rows came out a bit off a one-token step's, which 8-bit activations (fp8)
        # round to another step, and lossless methods' tokens left AR's.
        split = past_key.dtype == torch.float32
        if split:
            scores = torch.cat([torch.matmul(q, past_key.unsqueeze(2).transpose(3, 4)),
                                torch.matmul(q, k.unsqueeze(2).transpose(3, 4))], dim=-1)
        else:
            keys = keys if room else torch.cat([past_key, k], dim=2)
            scores = grouped_matmul(q, keys.transpose(2, 3))
        scores = scores.float() * layer.self_attn.scaling  # [B, Hkv, groups, T, S + T]
        cap = self.family.attn_softcap
        scores = (scores if cap is None else torch.tanh(scores / cap) * cap) + bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        if split:
            cached = past_key.shape[2]
            out = torch.matmul(probs[..., :cached], past_value.unsqueeze(2)) + \
                torch.matmul(probs[..., cached:], v.unsqueeze(2))  # [B, Hkv, groups, T, D]
        else:
            out = grouped_matmul(probs, values if room else torch.cat([past_value, v], dim=2))
        return self.end(x, out.permute(0, 3, 1, 2, 4)), k, v

    def qkv(self, x, cos, sin, rotate_half):
        """Rotated queries [B, Hkv, groups, T, D], keys and values [B, Hkv, T, D] of the layer.

        Grouped-query attention without repeating K/V: the `groups` query heads that share a KV head are laid
        out next to each other (query head h reads KV head h // groups, as ONNX's Attention and Hugging Face's
        repeat_kv do), and attend to that head's keys."""
        batch, num_tokens = x.shape[:2]
        attn, hkv, dim, family = self.layer.self_attn, self.num_kv_heads, self.head_dim, self.family
        h = x if family.post_norm else self.layer.input_layernorm(x)  # (sandwich: input_layernorm is the one before)
        merged = attn.qkv_proj if family.fused_qkv else self.qkv_proj
        if merged is not None:
            q, k, v = merged(h).split([hkv * self.groups * dim, hkv * dim, hkv * dim], dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        if family.qk_norm == "projection":
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.view(batch, num_tokens, hkv, self.groups, dim)
        k = k.view(batch, num_tokens, hkv, 1, dim)
        if family.qk_norm == "head":  # an RMSNorm over the last axis: each head's D
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.permute(0, 2, 3, 1, 4), k.permute(0, 2, 3, 1, 4)
        v = v.view(batch, num_tokens, hkv, dim).transpose(1, 2)
        return rope(q, cos, sin, rotate_half), rope(k, cos, sin, rotate_half).squeeze(2), v

    def end(self, x, out):
        """The rest of the decoder layer after attention; out: [B, T, H, D] (any view of that layout)."""
        layer, family, scale = self.layer, self.family, self.family.residual_multiplier
        a = layer.self_attn.o_proj(out.reshape(*x.shape[:2], -1))
        if family.post_norm or family.sandwich_norm:
            a = layer.post_attention_layernorm(a)
        x = x + (a if scale == 1.0 else a * scale)
        if family.post_norm:
            m = layer.post_feedforward_layernorm(self.mlp(x))
        elif family.sandwich_norm:
            m = layer.post_feedforward_layernorm(self.mlp(layer.pre_feedforward_layernorm(x)))
        else:
            m = self.mlp(layer.post_attention_layernorm(x))
        return x + (m if scale == 1.0 else m * scale)


class InPlaceStepModule(StepModule):
    """The step with the K/V cache updated inside the graph ("in-graph" cache update).

    forward(input_ids, position_ids, attention_mask, write_indices, *past) -> (logits, *present), flat per layer:

        attention_mask  [B, T, C] bool    which cache slots each new token sees; the new tokens' own K/V sit at
                                          slots write_indices[b] .. write_indices[b] + T - 1
        write_indices   [B] int64         where sequence b's new K/V are written (its cache length)
        past_key.{l}    [B, Hkv, C, D]    the cache at its full capacity C
        present_key.{l} [B, Hkv, C, D]    past with the new K/V written in: bound to the same memory as past

    In ONNX (opset 24) each layer is two TensorScatter nodes (the cache update) and one Attention node over the
    updated cache, the standard operators TensorRT >= 10.15 imports as IKVCacheUpdateLayer and IAttention and
    ONNX Runtime runs on the CPU (1.32 here; in place when present is bound to past's memory). Logits equal
    StepModule's for the same tokens, positions and visibility; the scores are computed in float32
    (softmax_precision) whatever the weights' dtype.
    """

    kv_update = "inplace"

    def __init__(self, hf_model, prompt_embeddings: torch.Tensor | None = None, hidden: bool = False):
        super().__init__(hf_model, prompt_embeddings, hidden)
        if self.family.attn_softcap is not None:
            raise UnsupportedModelError(f"model_type={hf_model.config.model_type!r}: the in-graph KV update's Attention "
                                        "node has no score soft-capping: use the runtime's KV update (export's graphs)")

    def forward(self, input_ids, position_ids, attention_mask, write_indices, *past):
        return self._step_in_place(self.embed(input_ids), position_ids, attention_mask, write_indices, past)

    def _step_in_place(self, x, position_ids, attention_mask, write_indices, past):
        ropes, mask, present = self._ropes(x, position_ids), attention_mask[:, None], []  # mask: [B, 1, T, C]
        masks = {w: mask & ~far[:, None] for w, far in self._far(position_ids, mask.shape[-1]).items()}
        for layer_idx, step in enumerate(self.layer_steps):
            q, k, v = step.qkv(x, *ropes[layer_idx], self.rotate_half)
            keys = scatter_rows(past[2 * layer_idx], k, write_indices)  # [B, Hkv, C, D]
            values = scatter_rows(past[2 * layer_idx + 1], v, write_indices)
            present += [keys, values]
            seen = masks.get(self.family.layer_windows[layer_idx], mask) if masks else mask
            out = torch.onnx.ops.attention(q.flatten(1, 2), keys, values, seen, scale=step.layer.self_attn.scaling,
                                           softmax_precision=1)[0]  # [B, H, T, D]; 1: ONNX's FLOAT
            x = step.end(x, out.transpose(1, 2))
        x = self.hf.model.norm(x)
        return (self._logits(x), *present) + ((x,) if self.hidden else ())

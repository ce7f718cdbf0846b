"""Parity of an exported step graph against its PyTorch StepModule on random, contract-valid feeds.

Feeds cover what the runtime will send: B > 1 with ragged cache lengths (garbage beyond each length,
masked out), random token trees in the new-token block (each node sees its ancestors and itself), and
capacity S = 0 (prefill). Each call draws fresh shapes from the generator it is given.

An in-graph variant (kv_update "inplace", contract.py) is checked against the same module on the same feeds,
rewritten to its inputs (`in_graph_feeds`): its logits must match, its present cache must hold the module's
new K/V at each sequence's write index, and every other slot must be as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt import contract

PARITY_TOL = contract.PARITY_TOL  # max |graph - torch| over logits and new K/V, per dtype


@dataclass(frozen=True)
class ParityReport:
    cases: int
    max_logit_err: float  # max |onnx - torch| over logits
    max_kv_err: float  # max |onnx - torch| over new K/V

    def ok(self, tol: float) -> bool:
        return self.max_logit_err <= tol and self.max_kv_err <= tol


def random_tree_mask(rng: np.random.Generator, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask [T, T] bool, depth [T]) of a random tree whose node i has a parent < i (or none)."""
    mask = np.zeros((num_tokens, num_tokens), dtype=bool)
    depth = np.zeros(num_tokens, dtype=np.int64)
    for i in range(num_tokens):
        parent = int(rng.integers(-1, i)) if i else -1
        if parent >= 0:
            mask[i] = mask[parent]
            depth[i] = depth[parent] + 1
        mask[i, i] = True
    return mask, depth


def random_feeds(rng: np.random.Generator, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                 batch: int, num_tokens: int, capacity: int, dtype=np.float32) -> dict[str, np.ndarray]:
    lengths = rng.integers(0, capacity + 1, size=batch)
    mask = np.zeros((batch, num_tokens, capacity + num_tokens), dtype=bool)
    positions = np.zeros((batch, num_tokens), dtype=np.int64)
    for b in range(batch):
        tree, depth = random_tree_mask(rng, num_tokens)
        mask[b, :, : lengths[b]] = True
        mask[b, :, capacity:] = tree
        positions[b] = lengths[b] + depth
    feeds = {
        contract.INPUT_IDS: rng.integers(0, vocab_size, size=(batch, num_tokens)).astype(np.int64),
        contract.POSITION_IDS: positions,
        contract.ATTENTION_MASK: mask,
    }
    shape = (batch, num_kv_heads, capacity, head_dim)
    for layer in range(num_layers):
        for name in (contract.past_key(layer), contract.past_value(layer)):
            # drawn as float32 (half the work and memory of float64: a 7B-class cache is ~0.5 G numbers a case)
            feeds[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    return feeds


def in_graph_feeds(feeds: dict[str, np.ndarray], num_layers: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The same step for an in-graph variant: capacity C = S + T (garbage beyond each length), the new tokens'
    slots at write_indices = each sequence's length."""
    mask = feeds[contract.ATTENTION_MASK]
    num_tokens = mask.shape[1]
    capacity = mask.shape[2] - num_tokens
    lengths = mask[:, 0, :capacity].sum(axis=1).astype(np.int64)  # each row sees exactly its sequence's cached slots
    out = {contract.INPUT_IDS: feeds[contract.INPUT_IDS], contract.POSITION_IDS: feeds[contract.POSITION_IDS],
           contract.ATTENTION_MASK: contract.in_graph_mask(mask, lengths, capacity + num_tokens),
           contract.WRITE_INDICES: lengths}
    for layer in range(num_layers):
        for name in (contract.past_key(layer), contract.past_value(layer)):
            past = feeds[name]
            garbage = rng.standard_normal((*past.shape[:2], num_tokens, past.shape[3])).astype(past.dtype)
            out[name] = np.concatenate([past, garbage], axis=2)
    return out


def check_parity(session, step_module, num_cases: int = 6, seed: int = 0, kv_update: str = "runtime") -> ParityReport:
    """Run `num_cases` random feeds through an onnxruntime session and the StepModule; report errors.
    kv_update "inplace": the session runs the in-graph variant (contract.py) of the same step."""
    import torch

    rng = np.random.default_rng(seed)
    m = step_module
    vocab = m.hf.config.vocab_size
    dtype = np.dtype(str(next(m.parameters()).dtype).removeprefix("torch."))
    names = contract.output_names(m.num_layers, kv_update)
    logit_err = kv_err = 0.0
    shapes = [(1, 1, 0), (2, 5, 0)] + [
        (int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 40))) for _ in range(max(0, num_cases - 2))
    ]
    for batch, num_tokens, capacity in shapes[:num_cases]:
        feeds = random_feeds(rng, m.num_layers, m.num_kv_heads, m.head_dim, vocab, batch, num_tokens, capacity, dtype)
        with torch.no_grad():
            ref = m(*(torch.from_numpy(feeds[n]) for n in contract.input_names(m.num_layers)))
        wanted = [r.float().numpy() for r in ref[1:]]
        if kv_update == "inplace":
            feeds = in_graph_feeds(feeds, m.num_layers, rng)
            slots = feeds[contract.WRITE_INDICES][:, None] + np.arange(num_tokens)  # [B, T]
            wanted = []  # the past with the module's new K/V written at each sequence's slots
            for i, new in enumerate(ref[1:]):
                present = feeds[contract.input_names(m.num_layers, kv_update)[4 + i]].astype(np.float32)
                present[np.arange(batch)[:, None], :, slots] = new.float().numpy().transpose(0, 2, 1, 3)
                wanted.append(present)
        onnx_out = session.run(names, feeds)
        # Compare only rows that can be read: every row here sees at least itself.
        logit_err = max(logit_err, float(np.abs(onnx_out[0] - ref[0].float().numpy()).max()))
        for got, want in zip(onnx_out[1:], wanted):
            kv_err = max(kv_err, float(np.abs(got.astype(np.float32) - want).max()))
    return ParityReport(len(shapes[:num_cases]), logit_err, kv_err)

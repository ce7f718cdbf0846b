"""Shared fakes for orchestration tests: step "models" that need no ONNX export, and a Pipeline over them.

- MarkovBackend: next-token logits depend on the current token only (a bigram table). Beam search over
  it has a closed form, so drafters can be checked against exhaustive enumeration.
- PathBackend: logits depend on the current token and on the token before it *as this row sees it*:
  the visible slot (past or new, per the attention mask) with the highest position below the row's
  own. K/V hold (token, position), so a runtime that commits the wrong rows, builds a wrong mask or
  wrong positions, or mixes up sequences of a batch gets different logits: greedy speculative decoding
  over it equals greedy autoregressive decoding only if the bookkeeping is right.
- fake_pipeline(...): a Pipeline whose target and draft are such backends, over a directory standing in
  for a bundle (for artifacts), with a character tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.bundle.machine import Machine
from specrt.bundle.manifest import Manifest, ModelEntry, write_manifest
from specrt.runtime.backends import Backend
from specrt.runtime.pipeline import Pipeline


def entry(role: str, vocab: int, max_positions: int = 512, head_dim: int = 1) -> ModelEntry:
    return ModelEntry(role, "", "", "llama", 1, 1, 1, head_dim, vocab, max_positions, "float32", 0)


class MarkovBackend(Backend):
    """A hand-built 'model' whose next-token logits depend only on the current token (a bigram table)."""

    name = "markov"

    def __init__(self, table, role: str = "draft"):
        self.table = np.asarray(table, dtype=np.float32)  # [V, V]
        super().__init__(entry(role, self.table.shape[0], 256))

    def allocate(self, shape):
        return np.zeros(shape, dtype=np.float32)

    def _run(self, binding, input_ids, position_ids, attention_mask, cache):
        b, t = input_ids.shape
        return self.table[input_ids], np.zeros((1, 2, b, 1, t, 1), np.float32)


class PathBackend(Backend):
    """logits[row] = table[previous visible token + 1, token] (previous: -1 before the first token)."""

    name = "path"

    def __init__(self, table, role: str = "target", max_positions: int = 512):
        self.table = np.asarray(table, dtype=np.float32)  # [V + 1, V, V]
        super().__init__(entry(role, self.table.shape[1], max_positions, head_dim=2))
        self.calls = 0

    def allocate(self, shape):
        return np.zeros(shape, dtype=np.float32)

    def _run(self, binding, input_ids, position_ids, attention_mask, cache):
        self.calls += 1
        past = cache.buffer[0, 0, :, 0]  # [B, S, 2]: (token, position) of each cached slot
        tokens = np.concatenate([past[..., 0], input_ids.astype(np.float32)], axis=1)  # [B, S + T]
        positions = np.concatenate([past[..., 1], position_ids.astype(np.float32)], axis=1)  # [B, S + T]
        below = positions[:, None, :] < position_ids[:, :, None]  # [B, T, S + T]
        seen = np.where(attention_mask & below, positions[:, None, :], -1.0)  # [B, T, S + T]
        prev = np.take_along_axis(tokens, seen.argmax(axis=-1), axis=1)  # [B, T] the latest visible token
        prev = np.where(seen.max(axis=-1) >= 0, prev, -1).astype(np.int64)
        logits = self.table[prev + 1, input_ids]  # [B, T, V]
        kv = np.stack([input_ids, position_ids], axis=-1).astype(np.float32)  # [B, T, 2]
        new_kv = np.broadcast_to(kv[None, None, :, None], (1, 2, *kv.shape[:1], 1, *kv.shape[1:])).copy()
        return logits, new_kv


def path_table(vocab: int, seed: int, sharpness: float = 3.0) -> np.ndarray:
    """A random second-order table [V + 1, V, V]; larger sharpness makes greedy choices clearer."""
    return np.random.default_rng(seed).normal(size=(vocab + 1, vocab, vocab)).astype(np.float32) * sharpness


def noisy_copy(table: np.ndarray, noise: float, seed: int) -> np.ndarray:
    """A draft that mostly agrees with the target: the target's table plus noise."""
    return table + np.random.default_rng(seed).normal(size=table.shape).astype(np.float32) * noise


class CharTokenizer:
    """Text <-> ids, one character per token (ids are code points modulo the vocabulary)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False):
        class Encoding:
            ids = [ord(c) % self.vocab for c in text]
        return Encoding()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def fake_pipeline(tmp_path: Path, target: Backend, draft: Backend, eos_id: int | None = None) -> Pipeline:
    """A Pipeline over fake backends; tmp_path stands in for the bundle (a manifest is written there)."""
    manifest = Manifest(created="", tokenizer="tokenizer", eos_token_id=eos_id,
                        models={role: m.entry for role, m in (("target", target), ("draft", draft))}, files={})
    write_manifest(tmp_path, manifest)
    return Pipeline(tmp_path, manifest, CharTokenizer(target.entry.vocab_size), target, draft,
                    Machine.here("ort", 1), bucket=16)


# -- synthetic artifacts ------------------------------------------------------------------------------
def write_latency(bundle: Path, target_ms, draft_ms=lambda n: 0.1, batches=(1,), machine: Machine | None = None,
                  host_ms: dict | None = None, max_tokens: int = 16, host_batch: dict | None = None):
    """A latency.json from curves (ms at n new tokens, times the batch size), stamped for this bundle."""
    from specrt.bundle import artifacts
    from specrt.bundle.artifacts import LatencyProfile, Stamp

    ns = range(1, max_tokens + 1)
    models = {"target": {b: {128: {n: b * target_ms(n) for n in ns}} for b in batches},
              "draft": {b: {128: {n: b * draft_ms(n) for n in ns}} for b in batches}}
    machine = machine or Machine.here("ort", 2)
    lat = LatencyProfile(Stamp.make(bundle, machine), {}, models, host_ms or {}, copy_bandwidth=1e10,
                         host_batch=host_batch or {}, packed_rows=False, cache_bucket=1)
    artifacts.save(bundle, lat, quant=machine.quant)  # a quantized variant's beside its graphs
    return lat


FLAT_AND_STEEP = (("flat", lambda n: 10.0), ("steep", lambda n: 10.0 + 4.0 * (n - 1)))  # +40% of a step a token


def hardware_aware_drafted(pipe: Pipeline, bundle: Path, prompts, kw: dict, batch_sizes=(1,)) -> tuple[dict, list]:
    """Decode `prompts` with a hardware-aware method (`kw`) under a flat and a steep latency.json (FLAT_AND_STEEP), at
    each batch size, after checking it is refused without one; asserts each run token-identical to autoregressive.
    Returns the drafted tokens per round by profile name (at the first batch size), and the autoregressive outputs."""
    import pytest

    from specrt.errors import BundleError

    with pytest.raises(BundleError, match="no latency.json.*specrt profile --bundle .* --backend ort --threads 2"):
        pipe.generate(prompts[:1], **kw)
    ar = pipe.generate(prompts, method="autoregressive", max_new_tokens=kw["max_new_tokens"])
    drafted = {}
    for name, step_ms in FLAT_AND_STEEP:
        write_latency(bundle, step_ms, machine=pipe.machine)
        for batch in batch_sizes:
            outs = pipe.generate(prompts, batch_size=batch, **kw)
            assert [o.token_ids for o in outs] == [a.token_ids for a in ar], (name, batch)
            drafted.setdefault(name, sum(o.stats.drafted for o in outs) / sum(o.stats.rounds for o in outs))
    return drafted, ar


def write_acceptance(bundle: Path, depth_rank, dynamic=(), merged=(), max_nodes: int = 8, draft_temperature: float = 1.0,
                     ngram=(), quant: str | None = None, by_position=(), ppd=(), ppd_source=None):
    """An acceptance.json from a depth x rank table (and measured dynamic / merged trees / PPD trees of the prompt
    tokens whose identity is `ppd_source`), of variant `quant`; `by_position`: the tables by bucket of 16 output
    positions."""
    from specrt.bundle import artifacts
    from specrt.bundle.artifacts import Acceptance, Stamp
    from specrt.calibration.acceptance import best_trees, chain_expectation

    p = np.array(depth_rank, dtype=float)
    acc = Acceptance(Stamp.make(bundle), {"quant": quant} if quant else {}, 0, (), tuple(map(tuple, depth_rank)), (),
                     tuple(chain_expectation(p, g) for g in range(1, len(p) + 1)), draft_temperature, 0.0, 0.0,
                     tuple(best_trees(p, max_nodes)), {k: tuple(v) for k, v in (
                         ("dynamic", dynamic), ("merged", merged), ("ngram", ngram), ("ppd", ppd)) if v}, 0.0,
                     16, tuple(tuple(map(tuple, t)) for t in by_position), ppd_source)
    artifacts.save(bundle, acc, quant=quant)
    return acc


def measured_tree(num_nodes, width, depth, accepted, calls, per_round=None, hist=None, ngram_tokens=0, min_prob=None,
                  by_position=(), interval=(0.0, 0.0)):
    from specrt.bundle.artifacts import MeasuredTree

    return MeasuredTree(num_nodes, width, depth, accepted, calls, per_round if per_round is not None else num_nodes,
                        hist or {}, tuple(by_position), interval, ngram_tokens, min_prob)

"""Sampling parameters and the logit transforms shared by target and draft.

Lossless rejection sampling requires the draft distribution q and the target distribution p to be
warped identically (temperature, then top-k, then top-p); `warp` is the one place that does it, and
`log_softmax` the one place that normalises logits in log space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.config import Config, option


@dataclass(frozen=True)
class SamplingParams(Config):
    temperature: float = option(0.0, "sampling temperature (0 = greedy)", ge=0)
    top_k: int = option(0, "keep the k likeliest tokens (0 = all)", ge=0)
    top_p: float = option(1.0, "keep the smallest set of tokens whose probability reaches p (1 = all)", gt=0, le=1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


NEGLIGIBLE = 37.0  # exp(-37) < 1e-16: a term this far below a row's maximum adds less than float64 resolves to 1


def logsumexp(x: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, in float64: each row's maximum plus the log of the exps of the entries within
    NEGLIGIBLE of it. Every entry left out adds under 1e-16 to a sum of at least 1, so over any vocabulary (262144
    ids: under 3e-11) this is log_softmax's normalizer, at a comparison per entry and exps of only those near the top
    (few where the model is sure; never a head's unscored ids, contract.HEAD_VOCABULARY)."""
    rows = x.reshape(-1, x.shape[-1])
    top = rows.max(axis=-1).astype(np.float64)
    out = np.empty(len(rows))
    for i, row in enumerate(rows):
        out[i] = top[i] + np.log(np.exp(row[row >= top[i] - NEGLIGIBLE].astype(np.float64) - top[i]).sum())
    return out.reshape(x.shape[:-1])


TOP_K_BLOCK = 128  # entries of the last axis per block whose maximum top_k ranks first


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices [..., k] of the k largest entries along x's last axis, best first, ties to the smaller index; exact.

    Only the k blocks of TOP_K_BLOCK entries with the largest maxima (and the tail no block fills) are ranked: an
    entry above the k-th largest value raises its block's maximum above that value, which fewer than k blocks can
    share, so those blocks hold it (ranked as the entries are, ties to the earlier block: so do the entries tied at
    that value, in index order). Over a vocabulary that is one pass of maxima instead of a partition of every
    logit."""
    width = x.shape[-1]
    k = min(k, width)
    rows = x.reshape(-1, width)
    blocks = width // TOP_K_BLOCK
    if blocks >= 4 * k:
        maxima = rows[:, : blocks * TOP_K_BLOCK].reshape(len(rows), blocks, TOP_K_BLOCK).max(axis=-1)
        best = np.lexsort((np.broadcast_to(np.arange(blocks), maxima.shape), -maxima), axis=-1)[:, :k]
        cand = (best[:, :, None] * TOP_K_BLOCK + np.arange(TOP_K_BLOCK)).reshape(len(rows), -1)
        tail = np.arange(blocks * TOP_K_BLOCK, width)
        cand = np.concatenate([cand, np.broadcast_to(tail, (len(rows), len(tail)))], axis=1)
    else:
        cand = np.broadcast_to(np.arange(width), rows.shape)
    values = np.take_along_axis(rows, cand, axis=-1)
    order = np.lexsort((cand, -values), axis=-1)[:, :k]
    return np.take_along_axis(cand, order, axis=-1).reshape(*x.shape[:-1], k)


def log_probs(logits: np.ndarray, params: SamplingParams | None) -> np.ndarray:
    """log of the distribution a token is scored with: the raw softmax when greedy (or params is None), the
    warped one otherwise (-inf where warping removed a token)."""
    if params is None or params.greedy:
        return log_softmax(logits)
    with np.errstate(divide="ignore"):
        return np.log(warp(logits, params))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] (float64) after temperature, top-k and top-p; rows sum to 1."""
    x = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[..., -params.top_k, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-probs, axis=-1)
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p >= params.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def rng_of(rng, b: int) -> np.random.Generator:
    """Sequence b's generator, where `rng` is one Generator for a whole batch or a list of one per sequence (a
    server's requests, each with its own seed: its draws do not depend on what else shares its batch)."""
    return rng[b] if isinstance(rng, list) else rng


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector [V]."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))

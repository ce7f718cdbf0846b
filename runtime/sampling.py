"""Sampling parameters and the logit warping shared by target and draft.

Lossless rejection sampling requires the draft distribution q and the target distribution p to be
warped identically (temperature, then top-k, then top-p); `warp` is the one place that does it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 1 means no nucleus filter

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector [V]."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))

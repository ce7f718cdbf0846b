"""ppd.json (`specrt ppd train`): PPD's trained prompt tokens, their graph and sparse trees."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import ClassVar

from specrt.bundle.artifacts.base import Artifact
from specrt.bundle.codec import to_data
from specrt.errors import InvalidRequestError


@dataclass(frozen=True)
class PpdTree:
    """A PPD sparse tree for one budget (static pruning, PPD section 4.2.1): candidate tokens by child ranks (the
    top-k of the prompt token at that depth) and how many prompt tokens the root and each candidate carry."""

    budget: int  # step rows beyond the root allowed
    paths: tuple[tuple[int, ...], ...]  # candidates, as TreeSpec paths
    prompts: tuple[int, ...]  # [1 + len(paths)] prompt tokens carried by the root, then by each candidate (0..k)
    rows: int  # step rows beyond the root when every candidate is in play (<= budget)
    expected_rows: float  # the same, averaged over the steady state (fewer candidates after a short acceptance)
    expected_accepted: float  # candidates accepted per round in the steady state (R(T), PPD appendix A)


@dataclass(frozen=True)
class PathHit:
    """A candidate path of guess ranks (rank r_d of the guess of distance d + 1, d = 1..m) and the share of validation
    positions where every guess along it was right together (measured jointly: the guesses of one round are not
    independent, so the product of the per-distance accuracies can be far off)."""

    path: tuple[int, ...]
    accuracy: float


@dataclass(frozen=True)
class PromptTokens(Artifact):
    """PPD's prompt tokens (`specrt ppd train`): k prompt tokens x e ensemble prompt tokens (EPTs), extra rows of the
    target's input embedding table with ids V + (d - 1) * e + j (distance d = 1..k, EPT j = 0..e-1); a copy of the
    target's step graph holding them (ort); accuracy by distance on held-out text; sparse trees per budget."""

    FILE: ClassVar[str] = "ppd.json"
    FORMAT: ClassVar[int] = 2  # 2: path_accuracy
    COMMAND: ClassVar[str] = "specrt ppd train --bundle {bundle}"

    num_prompt_tokens: int  # k: prompt token d guesses the token d + 1 after the last accepted one
    num_ensemble: int  # e
    vocab_size: int  # V
    hidden_size: int
    embeddings: str  # .npy [k * e, hidden], relative to the bundle
    embeddings_sha256: str
    graph: str | None  # the target step graph with the prompt tokens (None: a bundle without ONNX graphs)
    graph_sha256: str | None
    parity: float | None  # max |logit| difference of that graph against the exported one on ordinary ids
    training: dict  # config, steps, loss curve, seconds, seed, corpus hash (or the bundle the tokens came from)
    accuracy: tuple[tuple[float, ...], ...]  # [k][K] P(rank r of prompt token d's guess is the true token)
    baseline_accuracy: tuple[tuple[float, ...], ...]  # [k][K] the same from the last position's own logits
    initial_accuracy: tuple[tuple[float, ...], ...]  # [k][K] the same with the untrained (initial) prompt tokens
    path_accuracy: tuple[PathHit, ...]  # every candidate path whose guesses were all right together at least once
    trees: tuple[PpdTree, ...]  # one per budget, ascending
    # the in-graph variant (`specrt inplace`) with the prompt tokens, where the bundle had one when they were trained;
    # made from the in-graph target graph of that sha256 (a later `specrt inplace` leaves it behind)
    inplace_graph: str | None = None
    inplace_graph_sha256: str | None = None
    inplace_source_sha256: str | None = None

    def identity(self) -> str:
        """What a measurement of these prompt tokens' trees rests on: the embeddings and the trees (sha256)."""
        return hashlib.sha256(json.dumps([self.embeddings_sha256, to_data(self.trees)]).encode()).hexdigest()

    def tree(self, budget: int | None = None) -> PpdTree:
        """The sparse tree of the largest budget <= `budget` (None: the largest built)."""
        fit = [t for t in self.trees if budget is None or t.budget <= budget]
        if not fit:
            raise InvalidRequestError(f"no PPD tree within {budget} rows (built: {', '.join(str(t.budget) for t in self.trees)})")
        return fit[-1]

"""plan.json (`specrt tune`): the speculation chosen per batch size, and the candidates weighed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from specrt.bundle.artifacts.acceptance import Acceptance
from specrt.bundle.artifacts.base import EXPORTED, Artifact
from specrt.bundle.artifacts.latency import LatencyProfile
from specrt.bundle.machine import Machine


@dataclass(frozen=True)
class CurvePoint:
    """One candidate the tuner weighed at one batch size."""

    kind: str  # "autoregressive", "chain", "tree", "dynamic", "merged", "ngram" (ANPD) or "ppd"
    num_nodes: int
    expected_accepted: float
    predicted_tokens_per_s: float
    target_ms: float  # predicted per round
    draft_ms: float  # drafting + host work per round
    paths: tuple[tuple[int, ...], ...] | None = None  # static trees and chains
    width: int | None = None  # dynamic and merged trees
    depth: int | None = None
    ngram_tokens: int = 0
    ngram_min_prob: float | None = None


@dataclass(frozen=True)
class PlanChoice:
    method: str  # what method="auto" runs: "autoregressive", "tree", "dynamic", "anpd" or "ppd"
    best: CurvePoint  # the fastest candidate predicted
    best_static: CurvePoint  # the fastest static tree or chain (what method="tree" uses)
    predicted_speedup: float  # over autoregressive at this batch size


@dataclass(frozen=True)
class Plan(Artifact):
    FILE: ClassVar[str] = "plan.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt tune --bundle {bundle}"

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        # a plan is made from acceptance.json (any machine) and latency.json (this machine)
        steps = {"missing": (Acceptance, LatencyProfile), "machine": (LatencyProfile,), "stale": ()}[reason]
        return " && ".join([c.command(bundle, machine) for c in steps] + [super().command(bundle, machine)])

    choices: dict[int, PlanChoice]  # batch size -> choice
    curves: dict[int, tuple[CurvePoint, ...]]  # batch size -> every candidate weighed
    quant: str | None = None  # the variant of the step graphs the choices are for (None: as exported)
    # with `tune --variants`: each variant weighed ("exported" or the scheme) -> batch size -> its best predicted
    # tokens/s (after the min_gain rule); None: tuned on one variant
    variants: dict[str, dict[int, float]] | None = None
    new_tokens: int | None = None  # tuned for outputs of this many tokens (`tune --max-new-tokens`); None: calibration's
    context: int | None = None  # tuned for steps at this many cached tokens (`tune --context`); None: profiled average

    def choice_for(self, batch_size: int) -> PlanChoice:
        """The choice of the largest tuned batch size <= batch_size (else the smallest)."""
        sizes = sorted(self.choices)
        fit = [b for b in sizes if b <= batch_size]
        return self.choices[fit[-1] if fit else sizes[0]]


@dataclass(frozen=True)
class VariantPlan(Plan):
    """One variant's own plan (plans/<variant>.json): what `specrt tune` chose for that variant of the step graphs
    alone, written beside plan.json for every variant it weighed. plan.json is the pick over the variants of the
    latest tune; a pipeline loaded with another variant (one tuned earlier, or weighed and not picked) runs `auto`
    on its own plan, so that tuning one variant does not undo another's."""

    @classmethod
    def file(cls, quant: str | None = None) -> str:
        return f"plans/{quant or EXPORTED}.json"

    @classmethod
    def variant_command(cls, bundle: Path, machine: Machine | None, reason: str, quant: str | None) -> str:
        return cls.command(bundle, machine, reason) + (f" --variants {quant}" if quant else "")

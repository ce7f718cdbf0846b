"""acceptance.json (`specrt calibrate`): how often the target accepts each drafter's guesses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from specrt.bundle.artifacts.base import Artifact

if TYPE_CHECKING:
    from specrt.bundle.artifacts.ppd import PromptTokens


@dataclass(frozen=True)
class TreeEstimate:
    """A calibrated best static tree under the product model."""

    num_nodes: int
    paths: tuple[tuple[int, ...], ...]  # child ranks from the root, in the order the greedy build added them
    expected_accepted: float  # drafted tokens accepted per round


@dataclass(frozen=True)
class MeasuredTree:
    """One size of a kind of speculation measured by decoding (runtime/speculation.Calibration): a dynamic tree
    (optionally with n-gram drafts merged in), ANPD's n-gram drafts alone, a PPD sparse tree."""

    num_nodes: int  # draft-model nodes per round (ANPD: n-gram drafted tokens, K)
    width: int  # beams expanded per depth
    depth: int
    expected_accepted: float  # drafted tokens accepted per round
    draft_calls_per_round: float
    nodes_per_round: float  # nodes verified per round (merged trees vary)
    nodes_hist: dict[int, int]  # nodes verified in a round -> rounds
    # drafted tokens accepted per round by the output position a round starts at, per bucket of
    # Acceptance.position_bucket positions (the last bucket: every later position)
    accepted_by_position: tuple[float, ...]
    # 5th-95th percentile of expected_accepted over resamples of the calibration prompts (calibration.acceptance.
    # ratio_interval): how far the text alone moves it
    accepted_interval: tuple[float, float]
    ngram_tokens: int = 0  # n-gram drafts merged in (0: a plain dynamic tree)
    ngram_min_prob: float | None = None


@dataclass(frozen=True)
class Acceptance(Artifact):
    FILE: ClassVar[str] = "acceptance.json"
    FORMAT: ClassVar[int] = 3  # 3: every measured kind in `measured` (2: a field each)
    COMMAND: ClassVar[str] = "specrt calibrate --bundle {bundle}"
    PER_VARIANT: ClassVar[bool] = True  # a quantized target accepts other drafts

    config: dict  # the CalibrationConfig it was made with
    num_positions: int
    rank_histogram: tuple[int, ...]  # [K + 1] draft rank of the target's token, ranks >= K pooled last
    depth_rank: tuple[tuple[float, ...], ...]  # [D][K] acceptance of rank r at depth d given an accepted parent
    depth_support: tuple[int, ...]  # [D] start positions each depth's estimate rests on
    chain_expected_accepted: tuple[float, ...]  # [D] for chains of 1..D tokens
    draft_temperature: float
    draft_nll_at_temperature_1: float
    draft_nll_at_draft_temperature: float
    trees: tuple[TreeEstimate, ...]
    # kind of speculation -> its sizes measured by decoding (runtime/speculation.py: the kinds with a Calibration;
    # ANPD's by K, PPD's by budget); a kind not measured has no entry
    measured: dict[str, tuple[MeasuredTree, ...]]
    seconds: float
    position_bucket: int  # output positions per bucket of the by-position estimates
    # [buckets][D][K]: depth_rank over the rounds that start in each bucket of output positions
    depth_rank_by_position: tuple[tuple[tuple[float, ...], ...], ...]
    # the PromptTokens.identity() of the prompt tokens whose PPD trees `measured` holds (their num_nodes: the budget;
    # width: candidates, depth: the deepest); None where the bundle had none then
    ppd_source: str | None = None

    def ppd_measured(self, tokens: "PromptTokens | None") -> dict[int, MeasuredTree]:
        """PPD's trees measured by decoding, by budget, where they are `tokens`' trees ({} where the prompt tokens
        were trained again, or their trees rebuilt, after this calibration)."""
        if tokens is None or not self.measured.get("ppd") or self.ppd_source != tokens.identity():
            return {}
        return {m.num_nodes: m for m in self.measured["ppd"]}

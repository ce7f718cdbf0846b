"""Per-sequence statistics of one generate call: calls, accepted lengths, stage timings."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

# output positions per bucket of Stats' by-position counts: acceptance grows along an output (n-gram drafts find
# more of the output to copy, the draft model gets more context), and the cost model predicts short requests with it
POSITION_BUCKET = 16


@dataclass
class StageSeconds:
    """Wall seconds by stage. prefill: the batch's prompts; per round, draft: drafting, draft_model: of that, the
    draft model's steps, target: the target step, host: round time outside any model call (draft or target);
    total: the whole batch; first and finished: when this sequence's first and last new tokens came, from the
    start of the call."""

    prefill: float = 0.0
    draft: float = 0.0
    draft_model: float = 0.0
    target: float = 0.0
    host: float = 0.0
    total: float = 0.0
    first: float = 0.0  # from the call's start to this sequence's first new token (time to first token, waiting included)
    finished: float = 0.0  # from the call's start to this sequence's last token (its latency, waiting included)


@dataclass
class RoundTimes:
    """What one decode round of a batch cost, shared by its sequences (Scheduler.run): drafting seconds, of them the
    draft model's, its draft steps, the target step's seconds, and the whole round's."""

    draft: float = 0.0
    draft_model: float = 0.0
    draft_calls: int = 0
    target: float = 0.0
    total: float = 0.0


@dataclass
class Stats:
    target_calls: int = 0  # target steps this sequence took part in (prefill included)
    draft_calls: int = 0  # draft model steps this sequence took part in (prefill included)
    prefill_draft_calls: int = 0  # of those, prefill steps
    accepted_hist: Counter = field(default_factory=Counter)  # drafted tokens accepted in a round -> rounds
    drafted: int = 0  # drafted tokens (tree nodes) proposed over all rounds
    drafted_hist: Counter = field(default_factory=Counter)  # drafted tokens verified in a round -> rounds
    # rounds, and drafted tokens they accepted, by the bucket (position // POSITION_BUCKET) of the output position the
    # round started at (the new tokens emitted before it)
    rounds_by_position: Counter = field(default_factory=Counter)
    accepted_by_position: Counter = field(default_factory=Counter)
    padded: int = 0  # masked slots padded into this sequence's target cache (padded batches only)
    seconds: StageSeconds = field(default_factory=StageSeconds)

    @property
    def rounds(self) -> int:
        """Decode steps of the target (prefill excluded)."""
        return sum(self.accepted_hist.values())

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted over all rounds."""
        return sum(k * v for k, v in self.accepted_hist.items())

    @property
    def mean_accepted(self) -> float:
        return self.accepted / max(1, self.rounds)

    @property
    def draft_hit_ratio(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add_round(self, drafted: int, accepted: int, position: int, times: RoundTimes) -> None:
        """Count a decode round this sequence took part in: `drafted` tokens verified, `accepted` of them, starting
        at output position `position`."""
        self.target_calls += 1
        self.drafted += drafted
        self.drafted_hist[drafted] += 1
        self.draft_calls += times.draft_calls
        self.accepted_hist[accepted] += 1
        self.rounds_by_position[position // POSITION_BUCKET] += 1
        self.accepted_by_position[position // POSITION_BUCKET] += accepted
        self.seconds.draft += times.draft
        self.seconds.draft_model += times.draft_model
        self.seconds.target += times.target
        self.seconds.host += times.total - times.draft_model - times.target

    def as_dict(self) -> dict:
        return {"target_calls": self.target_calls, "draft_calls": self.draft_calls,
                "prefill_draft_calls": self.prefill_draft_calls, "rounds": self.rounds,
                "drafted": self.drafted, "draft_hit_ratio": self.draft_hit_ratio,
                "accepted_hist": dict(sorted(self.accepted_hist.items())), "mean_accepted": self.mean_accepted,
                "drafted_hist": dict(sorted(self.drafted_hist.items())),
                "rounds_by_position": dict(sorted(self.rounds_by_position.items())),
                "accepted_by_position": dict(sorted(self.accepted_by_position.items())), "padded": self.padded,
                "seconds": asdict(self.seconds)}

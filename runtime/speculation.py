"""The kinds of speculation the tuner weighs and `auto` runs, each one registered object (DESIGN.md, "One home per
idea"): its name (a CurvePoint's kind), the method that runs it (whose `from_point` makes it from a plan's choice),
where calibration keeps its acceptance measured by decoding, the host work its rounds are priced by, what a round
costs and how it reads in words. The tuner, the cost model, `auto` and the report ask a kind; none compares its
name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specrt.bundle.artifacts import Acceptance, CurvePoint, LatencyProfile, Plan
from specrt.errors import SpecrtError
from specrt.runtime.cost import best_trees, chain_expectation, measured_round_cost_ms, ngram_round_cost_ms, round_cost_ms
from specrt.runtime.drafters.dynamic import tree_shape
from specrt.runtime.drafters.merge import MERGE_MIN_PROB
from specrt.runtime.tree import TreeSpec

MERGE_NGRAM_TOKENS = 16  # n-gram drafts merged into the dynamic trees that calibration and the tuner weigh


@dataclass(frozen=True)
class HostProfile:
    """How `specrt profile` measures a kind's host work per round (calibration/latency.py): the tree sizes it decodes
    with (SpeculationKind.decode) at batch 1 and above it."""

    sizes: tuple[int, ...]
    batched_sizes: tuple[int, ...]
    extra_rows: int = 0  # rows a round's target step holds beyond the root and the nodes (merged n-gram drafts)
    prompt_tokens: bool = False  # its sizes are PPD trees, measured where the bundle's prompt tokens built them


@dataclass(frozen=True)
class Calibration:
    """How `specrt calibrate` measures a kind by decoding (calibration/acceptance.py: measure_kind), where no depth x
    rank table predicts it (a tree that follows the draft's confidence, drafts that copy the text): each size decodes
    the calibration prompts, and one MeasuredTree a size is kept in Acceptance.measured under the kind's name."""

    title: str  # what calibrate prints its figures under, and by what they are sized
    tree: Callable[[Any, int], dict]  # (pipeline, size) -> the MeasuredTree fields naming the tree measured: width,
    # depth (and ngram_tokens, ngram_min_prob where n-gram drafts are merged in)
    flag: str | None = None  # calibrate's option with its sizes, where it has one (None there: `sizes`)
    sizes: Callable[[Any], tuple[int, ...]] | None = None  # pipeline -> the sizes measured where no option says
    temperature: bool = False  # decoded at the fitted draft temperature (its tree follows the draft's scores)
    by_position: bool = True  # the report plots its acceptance by output position


@dataclass(frozen=True)
class SpeculationKind:
    name: str
    method: str  # the method that runs it (runtime/methods.py: METHODS[method].from_point(point))
    words: Callable[[int, int], str]  # (nodes, n-gram drafts merged in) -> the candidate in words, for plans and reports
    # (acceptance, latency, batch, point) -> predicted (target ms, draft + host ms) of a round; None: weighed apart
    # (PPD's trees, priced from the bundle's prompt tokens: tune.weigh)
    cost: Callable[[Acceptance, LatencyProfile, float, CurvePoint], tuple[float, float]] | None
    # acceptance -> the tuner's candidates of this kind, their costs still 0 (None: weighed apart, or the baseline)
    candidates: Callable[[Acceptance], list[CurvePoint]] | None = None
    host: tuple[str, ...] = ("tree",)  # the host-work profiles (LatencyProfile.host_ms) its rounds are priced by,
    # the first one profiled
    calibration: Calibration | None = None  # how calibrate measures it by decoding; None: predicted from
    # calibration's depth-rank table (static trees), or nothing to measure
    static: bool = False  # a static tree of the draft model (a plan may follow the live batch size with these)
    host_profile: HostProfile | None = None  # how its host work is profiled, where its own is (else: see `host`)
    drafts: bool = True  # it drafts (all but autoregressive decoding)
    draft_model: bool = True  # its rounds step the draft model (not ANPD's n-grams, nor PPD's prompt tokens)
    # the generate keywords of a decode with a tree of this kind and size, as `specrt profile` and `specrt calibrate`
    # run it; None: neither runs it on its own
    decode: Callable[[int], dict] | None = None

    def measured_trees(self, acceptance: Acceptance) -> tuple:
        return acceptance.measured.get(self.name, ()) if self.calibration else ()


def _nodes(n: int) -> str:
    return f"{n} node{'' if n == 1 else 's'}"


def _measured(round_cost):
    """The cost of a candidate calibration measured by decoding: `round_cost` of its measured tree."""
    def cost(acceptance: Acceptance, latency: LatencyProfile, batch: float, point: CurvePoint):
        kind = SPECULATION[point.kind]
        tree = next(m for m in kind.measured_trees(acceptance)
                    if (m.num_nodes, m.ngram_tokens) == (point.num_nodes, point.ngram_tokens))
        return round_cost(latency, batch, tree, kind.host)
    return cost


def _dynamic_words(n: int, ngram_tokens: int) -> str:
    # a merged tree's n-gram drafts are those that pay each round (Dynamic.from_point), up to the calibrated number
    return f"dynamic tree of {_nodes(n)}" + (f" + up to {ngram_tokens} n-gram drafts that pay" if ngram_tokens else "")


def _dynamic_tree(pipe, num_nodes: int, ngram_tokens: int = 0) -> dict:
    """A dynamic tree's shape at this size (with the merged n-gram drafts' settings), as `method="dynamic"` draws it."""
    width, depth = tree_shape(num_nodes)
    return {"width": width, "depth": depth, **({"ngram_tokens": ngram_tokens, "ngram_min_prob": MERGE_MIN_PROB}
                                               if ngram_tokens else {})}


def _ppd_tree(pipe, budget: int) -> dict:
    tree = next(t for t in pipe.prompt_tokens.trees if t.budget == budget)
    return {"width": len(tree.paths), "depth": max(map(len, tree.paths), default=0)}


def _static_tree_decode(num_nodes: int) -> dict:
    """A static tree of this size from a fixed synthetic acceptance table: the shape calibration would build (0:
    autoregressive decoding)."""
    if num_nodes == 0:
        return {"method": "autoregressive"}
    return {"method": "tree", "tree": best_trees(np.array([[0.7, 0.15, 0.07, 0.03]] * 8), num_nodes)[-1].paths}


def _static_cost(acceptance, latency, batch, point):
    return round_cost_ms(latency, batch, TreeSpec.from_paths(point.paths))


def _trees(acceptance: Acceptance) -> list[CurvePoint]:
    """Calibration's best static trees (the product model over its depth-rank table)."""
    return [CurvePoint("tree", t.num_nodes, t.expected_accepted, 0.0, 0.0, 0.0, paths=t.paths) for t in acceptance.trees]


def _chains(acceptance: Acceptance) -> list[CurvePoint]:
    p = np.array(acceptance.depth_rank)
    return [CurvePoint("chain", g, chain_expectation(p, g), 0.0, 0.0, 0.0, paths=tuple((0,) * d for d in range(1, g + 1)))
            for g in range(1, p.shape[0] + 1)]


def _measured_points(name: str) -> Callable[[Acceptance], list[CurvePoint]]:
    """The trees calibration measured by decoding with this kind."""
    def points(acceptance: Acceptance) -> list[CurvePoint]:
        return [CurvePoint(name, m.num_nodes, m.expected_accepted, 0.0, 0.0, 0.0, width=m.width, depth=m.depth,
                           ngram_tokens=m.ngram_tokens, ngram_min_prob=m.ngram_min_prob)
                for m in SPECULATION[name].measured_trees(acceptance)]
    return points


SPECULATION: dict[str, SpeculationKind] = {k.name: k for k in (
    SpeculationKind("autoregressive", "autoregressive", lambda n, g: "no speculation (drafting does not pay here)",
                    lambda a, latency, b, p: (latency.step_ms("target", b, 1), latency.host(0, batch=b)),
                    drafts=False, draft_model=False),
    # the tuner weighs candidates in this order, the first of equally fast ones winning
    SpeculationKind("tree", "tree", lambda n, g: f"tree of {_nodes(n)}", _static_cost, _trees, static=True,
                    host_profile=HostProfile((0, 1, 4, 8, 16, 32, 63), (0, 4, 16, 63)), decode=_static_tree_decode),
    SpeculationKind("chain", "tree", lambda n, g: f"chain of {_nodes(n)}", _static_cost, _chains, static=True),
    SpeculationKind("dynamic", "dynamic", _dynamic_words, _measured(measured_round_cost_ms),
                    _measured_points("dynamic"), ("dynamic", "tree"),
                    Calibration("dynamic trees, by nodes", _dynamic_tree, "dynamic_sizes", temperature=True,
                                by_position=False),
                    host_profile=HostProfile((2, 8, 16, 32), (8, 32)),
                    decode=lambda n: {"method": "dynamic", "num_draft_tokens": n}),
    SpeculationKind("merged", "dynamic", _dynamic_words, _measured(measured_round_cost_ms),
                    _measured_points("merged"), ("merged", "dynamic", "tree"),
                    Calibration(f"dynamic trees with {MERGE_NGRAM_TOKENS} n-gram drafts merged in, by nodes",
                                lambda pipe, n: _dynamic_tree(pipe, n, MERGE_NGRAM_TOKENS), "merged_sizes",
                                temperature=True),
                    host_profile=HostProfile((2, 8, 16, 32), (8, 32), extra_rows=MERGE_NGRAM_TOKENS),
                    decode=lambda n: {"method": "dynamic", "num_draft_tokens": n, "ngram_tokens": MERGE_NGRAM_TOKENS}),
    SpeculationKind("ngram", "anpd", lambda n, g: f"ANPD: up to {n} n-gram drafted tokens (no draft model)",
                    _measured(ngram_round_cost_ms), _measured_points("ngram"), ("ngram", "tree"),
                    Calibration("ANPD, by K (n-gram drafted tokens)", lambda pipe, n: {"width": 1, "depth": n},
                                "ngram_sizes"),
                    # no draft model: a draft tree's bookkeeping would overstate ANPD's host work several times
                    host_profile=HostProfile((2, 5, 10, 20), (3, 10)),
                    decode=lambda n: {"method": "anpd", "num_draft_tokens": n}, draft_model=False),
    # its guesses come from the target's own step: a draft tree's bookkeeping overstated its host work 1.5-4x on the
    # demo pair
    SpeculationKind("ppd", "ppd", lambda n, g: f"PPD sparse tree of {n} rows (no draft model)", None, None,
                    ("ppd",), Calibration(
                        "PPD sparse trees of the bundle's prompt tokens, by step rows", _ppd_tree, "ppd_budgets",
                        # every tree `specrt ppd train` built, where the bundle has prompt tokens
                        lambda pipe: tuple(t.budget for t in pipe.prompt_tokens.trees) if pipe.prompt_tokens else (),
                        by_position=False),
                    host_profile=HostProfile((2, 8, 32), (4, 16), prompt_tokens=True),
                    decode=lambda n: {"method": "ppd", "ppd_budget": n}, draft_model=False),
)}


def speculation_kind(name: str) -> SpeculationKind:
    try:
        return SPECULATION[name]
    except KeyError:
        raise SpecrtError(f"unknown kind of speculation {name!r} (known: {', '.join(SPECULATION)}): a plan or "
                          "profile from another specrt version; re-run `specrt tune`") from None


def point_cost_ms(acceptance: Acceptance, latency: LatencyProfile, batch: float, point: CurvePoint) -> tuple[float, float]:
    """(target ms, draft + host ms) of one round of a tuner's candidate (not PPD's: ppd_round_cost_ms) at a batch size
    (between profiled ones: interpolated)."""
    return speculation_kind(point.kind).cost(acceptance, latency, batch, point)


def trees_by_batch(plan: Plan, batch_size: int) -> dict[int, CurvePoint] | None:
    """The static tree the plan chose at each tuned batch size <= batch_size, where there are several and every one is
    a static tree of the draft model (`auto` then drafts the tree of the live batch size each round); else None."""
    choices = {b: c for b, c in plan.choices.items() if b <= batch_size}
    if len(choices) > 1 and all(speculation_kind(c.best.kind).static for c in choices.values()):
        return {b: c.best for b, c in choices.items()}
    return None

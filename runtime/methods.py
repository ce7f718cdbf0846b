"""Methods as data: each is a Drafter + a Verifier (+ the tree the drafter fills) run by the Scheduler.

| method         | drafter                              | verifier                                  |
|----------------|--------------------------------------|-------------------------------------------|
| autoregressive | none                                 | argmax / sample                           |
| sd             | DraftModelDrafter, chain TreeSpec    | exact match / rejection sampling          |
| tree           | DraftModelDrafter, static TreeSpec   | exact match / one-hot rejection           |
| dynamic        | DynamicTreeDrafter (EAGLE-2 style)   | exact match / one-hot rejection           |
| auto           | what plan.json says for the batch    | as the chosen method                      |
|                | (a tree, dynamic tree, anpd, ppd or  |                                           |
|                | no speculation)                      |                                           |
| anpd           | NgramDrafter (no model), chain/tree  | exact match / one-hot rejection           |
| + ngram_tokens | sd/tree/dynamic/ppd's drafter merged | exact match / one-hot rejection           |
|                | with an NgramDrafter (MergedDrafter) |                                           |
| mtad           | BeamDrafter (best beam or top beams) | JointLikelihoodVerifier (not lossless)    |
| ppd            | PromptTokenDrafter: the target's own | exact match / one-hot rejection, or       |
|                | prompt-token guesses, sparse tree    | typical acceptance (not lossless)         |

Each method is a frozen dataclass of its own options (runtime/method_base.py: Method), their defaults, bounds and
help declared once next to its builder, registered by name in METHODS. `make_method(name, options)` refuses, by name, an option
the method does not take; the CLI derives its generation flags from these classes (specrt.cli).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from specrt.config import option
from specrt.errors import BundleError, InvalidRequestError
from specrt.runtime.drafters import (BeamDrafter, DraftModelDrafter, DynamicTreeDrafter, EagleDrafter, MergedDrafter,
                                     NgramDrafter, PromptTokenDrafter)
from specrt.runtime.drafters.dynamic import tree_shape
from specrt.runtime.drafters.merge import MERGE_MIN_PROB
from specrt.runtime.method_base import METHODS, Built, Method, MethodContext, make_method, register
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculation import SpeculationKind, trees_by_batch
from specrt.runtime.tree import TreeSpec
from specrt.runtime.verify import JointLikelihoodVerifier, TypicalVerifier, make_verifier

__all__ = ["METHODS", "Built", "Method", "MethodContext", "make_method", "runs_with"]

# A 16-node tree: best child chains to depth 5, second and third choices near the root (where the
# draft is least sure). The tuned plan's best static tree replaces it once `specrt tune` has run.
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0))


@register
@dataclass(frozen=True)
class Autoregressive(Method):
    name: ClassVar[str] = "autoregressive"
    summary: ClassVar[str] = "no drafting: one target step per token (the reference)"

    @classmethod
    def from_point(cls, point):
        return cls()

    def round_tokens(self):
        return 1

    def build(self, ctx, params, batch_size):
        return Built(None, make_verifier(params), self.round_tokens())


@dataclass(frozen=True)
class NgramOptions(Method):
    ngram_n: int = option(5, "highest n-gram order N of the n-gram memory", ge=2)
    ngram_branches: int = option(1, "continuations per node of an n-gram tree (1: a chain)", ge=1)
    ngram_hardware_aware: bool = option(False, "per round, verify the best-first n-gram drafts that pay off under the "
                                               "bundle's latency profile (latency.json), on top of any other drafter's "
                                               "nodes")
    ngram_prior: bool = option(True, "fall back on the bundle's n-gram prior (`specrt ngram prior`: the target's own "
                                     "text) where the text itself has not shown a context yet; no effect without one")
    # a drafted row costs ~7% of a one-token step on a 2-core CPU: drafts of the prior alone that are less likely
    # cost more rows than they return (bench/results e2e-smollm2-135m-*-prior)
    ngram_prior_min_prob: float = option(0.2, "no draft from the prior alone whose estimated path probability is "
                                              "lower", ge=0, le=1)

    def _ngram_costs(self, ctx: "MethodContext", num_tokens: int, batch_size: int) -> list[float] | None:
        """The hardware-aware n-gram drafter's round costs up to num_tokens drafted tokens in all, else None."""
        return ctx.evidence.ngram_round_costs(num_tokens, batch_size) if self.ngram_hardware_aware else None

    def _ngram_drafter(self, ctx: "MethodContext", num_tokens: int, min_prob: float, costs) -> NgramDrafter:
        prior = ctx.evidence.ngram_table(self.ngram_n) if self.ngram_prior else None
        return NgramDrafter(self.ngram_n, num_tokens, self.ngram_branches, min_prob, costs, prior,
                            self.ngram_prior_min_prob)


@dataclass(frozen=True)
class MergeOptions(NgramOptions):
    """n-gram drafts merged into the draft model's tree (SpecInfer's merge-based tree, MergedDrafter)."""

    ngram_tokens: int = option(0, "also draft up to this many tokens from an n-gram memory and verify both drafts "
                                  "as one tree (0: off)", ge=0)
    ngram_min_prob: float = option(MERGE_MIN_PROB, "with ngram_tokens: no n-gram draft whose estimated path "
                                                   "probability is lower", ge=0, le=1)

    def _validate(self):
        if not self.ngram_tokens:
            given = [f.name for f in fields(NgramOptions) if getattr(self, f.name) != f.default]
            if self.ngram_min_prob != MergeOptions.ngram_min_prob:
                given.append("ngram_min_prob")
            if given:
                raise InvalidRequestError(f"{', '.join(given)} apply to merged n-gram drafts: give ngram_tokens > 0 "
                                          f"with method {self.name!r}")

    def round_tokens(self):
        own = self._own_round_tokens()
        return None if own is None else own + self.ngram_tokens

    def _own_round_tokens(self) -> int | None:
        """round_tokens without the merged n-gram drafts."""
        return None

    def _merge(self, built: Built, ctx: MethodContext, params: SamplingParams, batch_size: int) -> Built:
        if not self.ngram_tokens:
            return built
        costs = self._ngram_costs(ctx, built.slack + self.ngram_tokens, batch_size)  # the other drafter's nodes first
        ngram = self._ngram_drafter(ctx, self.ngram_tokens, self.ngram_min_prob, costs)
        # the merged tree holds up to every node of both; the draft cache needs no more than before
        return Built(MergedDrafter([built.drafter, ngram]), built.verifier, built.slack + self.ngram_tokens)


def runs_with(kind: SpeculationKind, draft) -> bool:
    """Whether a speculation kind runs with this draft backend: every kind, but where the draft is a head on the
    target's hidden states (EAGLE: ModelEntry.features) only those whose method drafts with one (Method.with_head)."""
    return not draft.entry.features or METHODS[kind.method].with_head


def static_tree_built(method: Method, ctx: MethodContext, spec: TreeSpec | dict[int, TreeSpec],
                      params: SamplingParams) -> Built:
    """The draft model filling a static tree (or, by live batch size, one of several: DraftModelDrafter)."""
    largest = max(map(len, spec.values())) if isinstance(spec, dict) else len(spec)
    # a draft head reads the target's hidden states beside its tokens (ModelEntry.features): EAGLE's drafter
    kind = EagleDrafter if ctx.draft.entry.features else DraftModelDrafter
    return Built(kind(ctx.draft_runner(method), spec, ctx.bucket), make_verifier(params),
                 largest + 1)


@register
@dataclass(frozen=True)
class Sd(MergeOptions):
    name: ClassVar[str] = "sd"
    summary: ClassVar[str] = "the draft model drafts a chain; exact match or lossless rejection sampling"

    num_draft_tokens: int = option(4, "drafted chain length (gamma)", ge=1)

    def _own_round_tokens(self):
        return self.num_draft_tokens + 1

    def build(self, ctx, params, batch_size):
        if self.ngram_tokens and not params.greedy:
            raise InvalidRequestError("ngram_tokens needs deterministic drafts, but sd samples its chain when "
                                      "temperature > 0: use method 'tree' or 'dynamic'")
        return self._merge(static_tree_built(self, ctx, TreeSpec.chain(self.num_draft_tokens), params), ctx, params,
                           batch_size)


@register
@dataclass(frozen=True)
class Tree(MergeOptions):
    name: ClassVar[str] = "tree"
    summary: ClassVar[str] = "the draft model fills a static token tree verified in one target step"

    @classmethod
    def from_point(cls, point):
        return cls(tree=point.paths)

    tree: object = option(None, "paths of child ranks, e.g. [[0], [1], [0, 0]] (default: the tuned plan's best "
                                "static tree, else a built-in 16-node tree)", metavar="JSON")

    def _validate(self):
        super()._validate()
        if self.tree is not None and not isinstance(self.tree, TreeSpec):
            try:
                TreeSpec.from_paths(self.tree)
            except (ValueError, TypeError) as e:
                raise InvalidRequestError(f"invalid tree: {e}") from None

    def _own_round_tokens(self):
        if self.tree is None:
            return None
        return len(self.tree) + 1  # a TreeSpec's nodes, or its paths

    def spec(self, ctx: MethodContext, batch_size: int) -> TreeSpec:
        if isinstance(self.tree, TreeSpec):
            return self.tree
        if self.tree is not None:
            return TreeSpec.from_paths(self.tree)
        if ctx.evidence.has_plan():
            return TreeSpec.from_paths(ctx.evidence.plan().choice_for(batch_size).best_static.paths)
        return TreeSpec.from_paths(DEFAULT_TREE)

    def build(self, ctx, params, batch_size):
        return self._merge(static_tree_built(self, ctx, self.spec(ctx, batch_size), params), ctx, params, batch_size)


@register
@dataclass(frozen=True)
class Dynamic(MergeOptions):
    name: ClassVar[str] = "dynamic"
    summary: ClassVar[str] = "the likeliest nodes of the draft's beam search form a new tree each round (EAGLE-2)"
    with_head: ClassVar[bool] = False

    @classmethod
    def from_point(cls, point):
        # merged n-gram drafts: per round those that pay on this machine's profile (which the plan was tuned on), up
        # to the calibrated number; that choice replaces calibration's fixed floor on their path estimates
        merge = ({"ngram_tokens": point.ngram_tokens, "ngram_hardware_aware": True, "ngram_min_prob": 0.0}
                 if point.ngram_tokens else {})
        return cls(num_draft_tokens=point.num_nodes, num_beams=point.width, tree_depth=point.depth, **merge)

    num_draft_tokens: int = option(8, "tree nodes verified per round", ge=1)
    num_beams: int | None = option(None, "nodes expanded per depth (default: max(4, nodes // 4))", ge=1)
    tree_depth: int | None = option(None, "draft depth (default: min(nodes, 8))", ge=1)
    draft_temperature: float | None = option(None, "temperature of the draft's node scores (default: the calibrated "
                                                    "one in acceptance.json, else 1)", gt=0)

    @property
    def shape(self) -> tuple[int, int]:
        """(beams expanded per depth, depth)."""
        return tree_shape(self.num_draft_tokens, self.num_beams, self.tree_depth)

    def _own_round_tokens(self):
        width, depth = self.shape  # the verified nodes and root; the draft cache holds every fed beam node
        return max(self.num_draft_tokens + 1, width * (depth - 1) + 2)

    def build(self, ctx, params, batch_size):
        width, depth = self.shape
        temperature = self.draft_temperature or ctx.evidence.draft_temperature()
        drafter = DynamicTreeDrafter(ctx.draft_runner(self), self.num_draft_tokens, width, depth, ctx.bucket,
                                     temperature)
        return self._merge(Built(drafter, make_verifier(params), self._own_round_tokens()), ctx, params, batch_size)


@register
@dataclass(frozen=True)
class Anpd(NgramOptions):
    name: ClassVar[str] = "anpd"
    summary: ClassVar[str] = "adaptive multi-level n-gram drafts of the prompt and output, no draft model (ANPD)"

    @classmethod
    def from_point(cls, point):
        return cls(num_draft_tokens=point.num_nodes)

    num_draft_tokens: int = option(7, "K: n-gram drafted tokens (tree nodes) per round", ge=1)
    ngram_min_prob: float = option(0.0, "no n-gram draft whose estimated path probability is lower", ge=0, le=1)

    def round_tokens(self):
        return self.num_draft_tokens + 1

    def build(self, ctx, params, batch_size):
        k = self.num_draft_tokens
        drafter = self._ngram_drafter(ctx, k, self.ngram_min_prob, self._ngram_costs(ctx, k, batch_size))
        return Built(drafter, make_verifier(params), self.round_tokens())


@register
@dataclass(frozen=True)
class Mtad(Method):
    name: ClassVar[str] = "mtad"
    summary: ClassVar[str] = ("beam drafts accepted by joint likelihood (MJSD when greedy, beam sampling when not); "
                              "not lossless by design")
    with_head: ClassVar[bool] = False

    num_draft_tokens: int = option(4, "gamma: tokens per beam", ge=1)
    num_beams: int = option(4, "W: beams", ge=1)
    tau: float = option(0.5, "joint-likelihood threshold: accept the longest prefix with min(1, p/q) > tau", ge=0, le=1)
    verify_beams: int = option(1, "top beams verified as one tree (1: the best beam)", ge=1)

    def _validate(self):
        if self.verify_beams > self.num_beams:
            raise InvalidRequestError(f"verify_beams must be an integer in [1, num_beams={self.num_beams}], "
                                      f"got {self.verify_beams}")

    def round_tokens(self):
        # the target step holds root + the verified beams' nodes; the draft cache every beam node of every fed depth
        gamma, beams = self.num_draft_tokens, self.num_beams
        return max(self.verify_beams * gamma + 1, beams * (gamma - 1) + 2)

    def build(self, ctx, params, batch_size):
        drafter = BeamDrafter(ctx.draft_runner(self), self.num_beams, self.num_draft_tokens, ctx.bucket,
                              self.verify_beams)
        return Built(drafter, JointLikelihoodVerifier(self.tau), self.round_tokens())


@register
@dataclass(frozen=True)
class Ppd(MergeOptions):
    name: ClassVar[str] = "ppd"
    summary: ClassVar[str] = ("the target guesses for itself through trained prompt tokens (PPD, `specrt ppd train`), "
                              "verified as a sparse tree; no draft model")

    @classmethod
    def from_point(cls, point):
        return cls(ppd_budget=point.num_nodes)

    ppd_budget: int | None = option(None, "step rows per round beyond the root, candidates + prompt tokens (default: "
                                          "the size that maximises predicted speed on this machine's latency profile, "
                                          "else 16)", ge=1)
    ppd_tree: object = option(None, "a sparse tree of your own instead: {\"paths\": [[0], [1], [0, 0]], \"prompts\": "
                                    "[3, 1, 0, 0]} (candidates as child ranks; prompt tokens of the root, then of each "
                                    "candidate)", metavar="JSON")
    ppd_acceptance: str = option("exact", "exact: exact match, or lossless one-hot rejection when sampling; typical: "
                                          "Medusa's typical acceptance (temperature > 0 only; NOT lossless)",
                                 choices=("exact", "typical"))
    typical_epsilon: float = option(0.09, "typical acceptance: accept p(x) > min(epsilon, delta * exp(-entropy))",
                                    gt=0, le=1)
    typical_delta: float = option(0.3, "typical acceptance: delta of that threshold", gt=0, le=1)

    def _validate(self):
        super()._validate()
        if self.ngram_tokens and self.ppd_acceptance == "typical":
            raise InvalidRequestError("ngram_tokens merges n-gram drafts into trees verified by exact match (or lossless "
                                      "rejection): not with ppd_acceptance 'typical'")
        if self.ppd_acceptance != "typical":
            given = [f.name for f in fields(self) if f.name.startswith("typical_") and getattr(self, f.name) != f.default]
            if given:
                raise InvalidRequestError(f"{', '.join(given)} apply to typical acceptance: give ppd_acceptance "
                                          "'typical'")
        if self.ppd_tree is None:
            return
        if self.ppd_budget is not None:
            raise InvalidRequestError("give ppd_budget or ppd_tree, not both")
        tree = self.ppd_tree
        if not isinstance(tree, dict) or set(tree) != {"paths", "prompts"}:
            raise InvalidRequestError("ppd_tree must be {\"paths\": [...], \"prompts\": [...]}")
        try:
            TreeSpec.from_paths(tree["paths"]) if tree["paths"] else None
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid ppd_tree paths: {e}") from None
        prompts = tree["prompts"]
        if (not isinstance(prompts, (list, tuple)) or len(prompts) != len(tree["paths"]) + 1
                or not all(isinstance(m, int) and m >= 0 for m in prompts) or prompts[0] < 1):
            raise InvalidRequestError("ppd_tree prompts must be one count >= 0 per candidate after the root's (>= 1)")

    def _own_round_tokens(self):
        return None if self.ppd_budget is None else self.ppd_budget + 1

    def build(self, ctx, params, batch_size):
        tokens = ctx.prompt_tokens
        if tokens is None:
            raise BundleError(ctx.prompt_tokens_refused)
        if self.ppd_tree is not None:
            paths, prompts = [tuple(p) for p in self.ppd_tree["paths"]], list(self.ppd_tree["prompts"])
            k = tokens.num_prompt_tokens
            if max(prompts) > k or any(len(p) > k for p in paths):
                raise InvalidRequestError(f"ppd_tree: the bundle has {k} prompt tokens: no candidate deeper, no "
                                          "node with more")
        else:
            tree = tokens.tree(self.ppd_budget) if self.ppd_budget is not None else ctx.ppd_tree(batch_size)
            paths, prompts = tree.paths, tree.prompts
        drafter = PromptTokenDrafter(paths, prompts, tokens.vocab_size, tokens.num_prompt_tokens, tokens.num_ensemble)
        if self.ppd_acceptance == "typical":
            if params.greedy:
                raise InvalidRequestError("ppd_acceptance 'typical' needs temperature > 0 (greedy PPD verifies by "
                                          "exact match)")
            verifier = TypicalVerifier(self.typical_epsilon, self.typical_delta)
        else:
            verifier = make_verifier(params)
        return self._merge(Built(drafter, verifier, len(paths) + tokens.num_ensemble * sum(prompts) + 1), ctx, params,
                           batch_size)


@register
@dataclass(frozen=True)
class Auto(Method):
    name: ClassVar[str] = "auto"
    summary: ClassVar[str] = ("what the bundle's plan.json chose for the batch size (static or dynamic tree, ANPD, PPD, "
                              "or none; static trees follow the live batch size round by round)")

    def resolve(self, ctx: MethodContext, batch_size: int) -> Method:
        """The plan's choice for this batch size, as a concrete method."""
        choice = ctx.evidence.plan().choice_for(batch_size)
        return METHODS[choice.method].from_point(choice.best)

    def build(self, ctx, params, batch_size):
        """The plan's choice for batch_size; where the plan picked static trees at every tuned batch size up to it,
        the tree of the live batch size each round (a batch that drains or fills changes its tree)."""
        trees = trees_by_batch(ctx.evidence.plan(), batch_size)
        if trees is not None:
            return static_tree_built(self, ctx, {b: TreeSpec.from_paths(t.paths) for b, t in trees.items()}, params)
        return self.resolve(ctx, batch_size).build(ctx, params, batch_size)

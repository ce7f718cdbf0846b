"""Methods as data: each is a Drafter + a Verifier (+ the tree the drafter fills) run by the Scheduler.

| method         | drafter                              | verifier                                  |
|----------------|--------------------------------------|-------------------------------------------|
| autoregressive | none                                 | argmax / sample                           |
| sd             | DraftModelDrafter, chain TreeSpec    | exact match / rejection sampling          |
| tree           | DraftModelDrafter, static TreeSpec   | exact match / one-hot rejection           |
| dynamic        | DynamicTreeDrafter (EAGLE-2 style)   | exact match / one-hot rejection           |
| auto           | what plan.json says for the batch    | as the chosen method                      |
| anpd           | NgramDrafter (no model), chain/tree  | exact match / one-hot rejection           |
| + ngram_tokens | sd / tree / dynamic's drafter merged | exact match / one-hot rejection           |
|                | with an NgramDrafter (MergedDrafter) |                                           |
| mtad           | BeamDrafter (best beam or top beams) | JointLikelihoodVerifier (not lossless)    |
"""

from __future__ import annotations

from dataclasses import dataclass

from specrt.errors import InvalidRequestError
from specrt.runtime.beam import BeamDrafter, DynamicTreeDrafter
from specrt.runtime.drafters import DraftModelDrafter
from specrt.runtime.merge import MergedDrafter
from specrt.runtime.ngram import NgramDrafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import TreeSpec
from specrt.runtime.verify import JointLikelihoodVerifier, make_verifier

METHODS = ("autoregressive", "sd", "tree", "auto", "dynamic", "anpd", "mtad")
TREE_METHODS = ("autoregressive", "sd", "tree")
MERGE_METHODS = ("sd", "tree", "dynamic")  # whose drafts may be merged with n-gram drafts (ngram_tokens)
# n-gram drafts merged into a draft model's tree: none estimated below this. Ad hoc sweep on the inflated
# pair (8 HumanEval prompts, dynamic 8 + 7 n-gram tokens): 0.3 -> 150.7 tok/s, 0.2 -> 148.5, 0.5 -> 144.2
MERGE_MIN_PROB = 0.3
MERGE_NGRAM_TOKENS = 7  # n-gram drafts merged into the dynamic trees that calibration and the tuner weigh

# A 16-node tree: best child chains to depth 5, second and third choices near the root (where the
# draft is least sure). The tuned plan's best tree replaces it once `specrt tune` has run.
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0))


@dataclass(frozen=True)
class MethodConfig:
    name: str = "sd"
    num_draft_tokens: int | None = None  # sd and mtad: gamma (default 4); anpd: K (default 7); dynamic: nodes (8)
    tree: object = None  # tree: paths of child ranks or a TreeSpec (default: the plan's, else DEFAULT_TREE)
    ngram_n: int = 5  # anpd: highest n-gram order N
    num_beams: int | None = None  # mtad: beams W (default 4); dynamic: nodes expanded per depth (default
    # max(4, nodes // 4); `bench trees` on the inflated pair: 32 nodes accept 5.16 tokens/call with W = 8,
    # 4.81 with W = 4; 24 nodes 4.81 with W = 6, 4.78 with W = 4; bench/results/trees-inflated*.md)
    tau: float = 0.5  # mtad: joint-likelihood threshold
    verify_beams: int = 1  # mtad: the top beams the target verifies, as one tree (1: the best beam, a chain)
    ngram_branches: int = 1  # anpd: continuations per node of a best-first n-gram tree (1: the paper's chain)
    ngram_min_prob: float | None = None  # anpd: draft no token whose estimated path probability is lower
    # (default 0: all K); with ngram_tokens, default MERGE_MIN_PROB
    ngram_hardware_aware: bool = False  # anpd: per round, verify the best-first prefix of the drafted tokens
    # that maximises expected tokens per ms under the bundle's profiled target latency (latency.json)
    tree_depth: int | None = None  # dynamic: draft depth (default min(nodes, 8): the draft's rank-0 acceptance
    # is ~0.74 per depth on the demo pair, so a 9th level is reached < 7% of the time)
    draft_temperature: float | None = None  # dynamic: temperature of the node scores (default: calibrated)
    ngram_tokens: int = 0  # sd, tree, dynamic: also draft up to this many tokens from an ANPD n-gram memory
    # (ngram_n, ngram_branches, ngram_min_prob) and merge them into the draft model's tree (0: off)

    def __post_init__(self):
        if self.name not in METHODS:
            raise InvalidRequestError(f"unknown method {self.name!r} (choose from {', '.join(METHODS)})")
        k = self.num_draft_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise InvalidRequestError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
        if not isinstance(self.ngram_n, int) or self.ngram_n < 2:
            raise InvalidRequestError(f"ngram_n must be an integer >= 2, got {self.ngram_n!r}")
        if self.tree_depth is not None and (not isinstance(self.tree_depth, int) or self.tree_depth < 1):
            raise InvalidRequestError(f"tree_depth must be an integer >= 1, got {self.tree_depth!r}")
        if not isinstance(self.ngram_branches, int) or self.ngram_branches < 1:
            raise InvalidRequestError(f"ngram_branches must be an integer >= 1, got {self.ngram_branches!r}")
        if not isinstance(self.ngram_hardware_aware, bool):
            raise InvalidRequestError(f"ngram_hardware_aware must be True or False, got {self.ngram_hardware_aware!r}")
        if self.ngram_min_prob is not None and not 0 <= self.ngram_min_prob <= 1:
            raise InvalidRequestError(f"ngram_min_prob must be in [0, 1], got {self.ngram_min_prob}")
        if not isinstance(self.ngram_tokens, int) or isinstance(self.ngram_tokens, bool) or self.ngram_tokens < 0:
            raise InvalidRequestError(f"ngram_tokens must be an integer >= 0, got {self.ngram_tokens!r}")
        if self.ngram_tokens and self.name not in MERGE_METHODS:
            raise InvalidRequestError(f"ngram_tokens merges n-gram drafts into a draft model's tree: methods "
                                      f"{', '.join(MERGE_METHODS)}, not {self.name!r}")
        if self.ngram_tokens and self.ngram_hardware_aware:
            raise InvalidRequestError("ngram_hardware_aware applies to method 'anpd' alone, not to merged n-gram drafts "
                                      "(use ngram_min_prob)")
        if self.num_beams is not None and (not isinstance(self.num_beams, int) or self.num_beams < 1):
            raise InvalidRequestError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        beams = self.beams(4)
        if not isinstance(self.verify_beams, int) or not 1 <= self.verify_beams <= beams:
            raise InvalidRequestError(f"verify_beams must be an integer in [1, num_beams={beams}], got {self.verify_beams!r}")
        if not 0 <= self.tau <= 1:
            raise InvalidRequestError(f"tau must be in [0, 1], got {self.tau}")
        t = self.draft_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise InvalidRequestError(f"draft_temperature must be a number > 0, got {t!r}")

    @classmethod
    def create(cls, name: str, options: dict) -> "MethodConfig":
        """From keyword options, refusing unknown ones by name."""
        fields = [f for f in cls.__dataclass_fields__ if f != "name"]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise InvalidRequestError(f"unknown method option(s) {', '.join(unknown)} (choose from {', '.join(fields)})")
        return cls(name, **options)

    def draft_tokens(self, default: int) -> int:
        return default if self.num_draft_tokens is None else self.num_draft_tokens

    def beams(self, default: int) -> int:
        return default if self.num_beams is None else self.num_beams


def dynamic_shape(nodes: int, width: int | None = None, depth: int | None = None) -> tuple[int, int]:
    """(beams expanded per depth, depth) of a dynamic tree of `nodes` nodes, defaults where not given."""
    return width or max(4, nodes // 4), depth or min(nodes, 8)


def resolve_auto(pipe, batch_size: int) -> MethodConfig:
    """What the bundle's plan chose for this batch size, as a concrete method."""
    from specrt.runtime.plan import choice_for

    choice = choice_for(pipe.plan(), batch_size)
    if choice["method"] == "dynamic":
        return MethodConfig("dynamic", num_draft_tokens=choice["num_nodes"], num_beams=choice["width"],
                            tree_depth=choice["depth"], ngram_tokens=choice.get("ngram_tokens") or 0,
                            ngram_min_prob=choice.get("ngram_min_prob"))
    if choice["method"] == "tree":
        return MethodConfig("tree", tree=choice["paths"])
    return MethodConfig("autoregressive")


def tree_spec(pipe, method: MethodConfig, batch_size: int = 1) -> TreeSpec | None:
    """The static tree a tree method drafts (None for no speculation)."""
    from specrt.runtime.plan import PLAN, choice_for

    if method.name not in TREE_METHODS:
        raise InvalidRequestError(f"{method.name!r} does not draft a static tree (choose from {', '.join(TREE_METHODS)})")
    if method.name == "autoregressive":
        return None
    if method.name == "sd":
        return TreeSpec.chain(method.draft_tokens(4))
    tree = method.tree
    if isinstance(tree, TreeSpec):
        return tree
    if tree is None:
        tree = choice_for(pipe.plan(), batch_size)["best_tree"]["paths"] if (pipe.bundle / PLAN).is_file() else DEFAULT_TREE
    try:
        return TreeSpec.from_paths(tree)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid tree: {e}") from None


def step_costs(pipe, num_draft_tokens: int, batch_size: int) -> list[float]:
    """Profiled ms of a round verifying 0..num_draft_tokens drafted tokens per sequence: the target step
    of n + 1 tokens and the host work of an n-node tree, at the largest profiled batch size <= batch_size
    (a round's step costs what its widest sequence needs; each sequence is costed on that curve)."""
    from specrt.bench.latency import LATENCY, host_ms, latency_ms, load_latency
    from specrt.errors import BundleError, SpecrtError
    from specrt.machine import describe, fingerprint

    try:
        latency = load_latency(pipe.bundle)
    except SpecrtError as e:  # no latency.json: say what to run
        raise BundleError(f"ngram_hardware_aware needs the bundle's latency profile: {e}") from None
    here = fingerprint(pipe.backend_name, pipe.threads, pipe.device)
    if latency.get("machine") != here:
        raise BundleError(f"{pipe.bundle / LATENCY} was profiled on {describe(latency.get('machine', {}))}, but this is "
                          f"{describe(here)}: re-run `specrt profile` here")
    sizes = sorted(int(b) for b in latency["models"]["target"])
    batch = max([b for b in sizes if b <= batch_size] or sizes[:1])
    return [latency_ms(latency, "target", batch, n + 1) + host_ms(latency, n) for n in range(num_draft_tokens + 1)]


def draft_temperature(pipe) -> float:
    """The calibrated draft temperature (acceptance.json), 1.0 (raw draft scores) if not calibrated."""
    from specrt.calibration.acceptance import ACCEPTANCE, load_acceptance

    if not (pipe.bundle / ACCEPTANCE).is_file():
        return 1.0
    return float(load_acceptance(pipe.bundle).get("draft_temperature", 1.0))


def build(pipe, method: MethodConfig, params: SamplingParams, batch_size: int):
    """(drafter or None, verifier, slack): slack = context slots a round may use beyond the text."""
    if method.name == "auto":
        method = resolve_auto(pipe, batch_size)
    if method.ngram_tokens:
        if method.name == "sd" and not params.greedy:
            raise InvalidRequestError("ngram_tokens needs deterministic drafts, but sd samples its chain when "
                                      "temperature > 0: use method 'tree' or 'dynamic'")
        drafter, verifier, slack = _build(pipe, method, params, batch_size)
        ngram = NgramDrafter(method.ngram_n, method.ngram_tokens, method.ngram_branches,
                             MERGE_MIN_PROB if method.ngram_min_prob is None else method.ngram_min_prob)
        # the merged tree holds up to every node of both; the draft cache needs no more than before
        return MergedDrafter([drafter, ngram]), verifier, slack + method.ngram_tokens
    return _build(pipe, method, params, batch_size)


def _build(pipe, method: MethodConfig, params: SamplingParams, batch_size: int):
    if method.name == "anpd":
        k = method.draft_tokens(7)
        costs = step_costs(pipe, k, batch_size) if method.ngram_hardware_aware else None
        drafter = NgramDrafter(method.ngram_n, k, method.ngram_branches, method.ngram_min_prob or 0.0, costs)
        return drafter, make_verifier(params), k + 1
    if method.name == "mtad":
        gamma = method.draft_tokens(4)
        beams = method.beams(4)
        drafter = BeamDrafter(pipe.draft, beams, gamma, pipe.bucket, method.verify_beams)
        # the target step holds root + the verified beams' nodes; the draft cache every beam node of
        # every fed depth during a round
        slack = max(method.verify_beams * gamma + 1, beams * (gamma - 1) + 2)
        return drafter, JointLikelihoodVerifier(method.tau), slack
    if method.name == "dynamic":
        nodes = method.draft_tokens(8)
        width, depth = dynamic_shape(nodes, method.num_beams, method.tree_depth)
        temperature = method.draft_temperature or draft_temperature(pipe)
        drafter = DynamicTreeDrafter(pipe.draft, nodes, width, depth, pipe.bucket, temperature)
        return drafter, make_verifier(params), max(nodes + 1, width * (depth - 1) + 2)
    spec = tree_spec(pipe, method, batch_size)
    drafter = DraftModelDrafter(pipe.draft, spec, pipe.bucket) if spec is not None else None
    return drafter, make_verifier(params), (len(spec) + 1 if spec else 1)

"""Methods as data: each is a Drafter + a Verifier (+ the tree the drafter fills) run by the Scheduler.

| method         | drafter                              | verifier                                  |
|----------------|--------------------------------------|-------------------------------------------|
| autoregressive | none                                 | argmax / sample                           |
| sd             | DraftModelDrafter, chain TreeSpec    | exact match / rejection sampling          |
| tree           | DraftModelDrafter, static TreeSpec   | exact match / one-hot rejection           |
| auto           | what plan.json says for the batch    | as the chosen method                      |
| anpd           | NgramDrafter (no model)              | exact match / one-hot rejection           |
| mtad           | BeamDrafter                          | JointLikelihoodVerifier (not lossless)    |
"""

from __future__ import annotations

from dataclasses import dataclass

from specrt.errors import InvalidRequestError
from specrt.runtime.beam import BeamDrafter
from specrt.runtime.drafters import DraftModelDrafter
from specrt.runtime.ngram import NgramDrafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import TreeSpec
from specrt.runtime.verify import JointLikelihoodVerifier, make_verifier

METHODS = ("autoregressive", "sd", "tree", "auto", "anpd", "mtad")
TREE_METHODS = ("autoregressive", "sd", "tree", "auto")

# A 16-node tree: best child chains to depth 5, second and third choices near the root (where the
# draft is least sure). The tuned plan's best tree replaces it once `specrt tune` has run.
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0))


@dataclass(frozen=True)
class MethodConfig:
    name: str = "sd"
    num_draft_tokens: int | None = None  # sd and mtad: gamma (default 4); anpd: K (default 7)
    tree: object = None  # tree: paths of child ranks or a TreeSpec (default: the plan's, else DEFAULT_TREE)
    ngram_n: int = 5  # anpd: highest n-gram order N
    num_beams: int = 4  # mtad: beams W
    tau: float = 0.5  # mtad: joint-likelihood threshold

    def __post_init__(self):
        if self.name not in METHODS:
            raise InvalidRequestError(f"unknown method {self.name!r} (choose from {', '.join(METHODS)})")
        k = self.num_draft_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise InvalidRequestError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
        if not isinstance(self.ngram_n, int) or self.ngram_n < 2:
            raise InvalidRequestError(f"ngram_n must be an integer >= 2, got {self.ngram_n!r}")
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise InvalidRequestError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if not 0 <= self.tau <= 1:
            raise InvalidRequestError(f"tau must be in [0, 1], got {self.tau}")

    def draft_tokens(self, default: int) -> int:
        return default if self.num_draft_tokens is None else self.num_draft_tokens


def tree_spec(pipe, method: MethodConfig, batch_size: int = 1) -> TreeSpec | None:
    """The static tree a tree method drafts (None for no speculation)."""
    from specrt.runtime.plan import PLAN, choice_for

    if method.name not in TREE_METHODS:
        raise InvalidRequestError(f"{method.name!r} does not draft a static tree (choose from {', '.join(TREE_METHODS)})")
    if method.name == "autoregressive":
        return None
    if method.name == "sd":
        return TreeSpec.chain(method.draft_tokens(4))
    if method.name == "auto":
        choice = choice_for(pipe.plan(), batch_size)
        return None if choice["method"] == "autoregressive" else TreeSpec.from_paths(choice["paths"])
    tree = method.tree
    if isinstance(tree, TreeSpec):
        return tree
    if tree is None:
        tree = choice_for(pipe.plan(), batch_size)["best_tree"]["paths"] if (pipe.bundle / PLAN).is_file() else DEFAULT_TREE
    try:
        return TreeSpec.from_paths(tree)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid tree: {e}") from None


def build(pipe, method: MethodConfig, params: SamplingParams, batch_size: int):
    """(drafter or None, verifier, slack): slack = context slots a round may use beyond the text."""
    if method.name == "anpd":
        k = method.draft_tokens(7)
        return NgramDrafter(method.ngram_n, k), make_verifier(params), k + 1
    if method.name == "mtad":
        gamma = method.draft_tokens(4)
        drafter = BeamDrafter(pipe.draft, method.num_beams, gamma, pipe.bucket)
        # every beam node of every fed depth lives in the draft cache during a round
        return drafter, JointLikelihoodVerifier(method.tau), max(gamma + 1, method.num_beams * (gamma - 1) + 2)
    spec = tree_spec(pipe, method, batch_size)
    drafter = DraftModelDrafter(pipe.draft, spec, pipe.bucket) if spec is not None else None
    return drafter, make_verifier(params), (len(spec) + 1 if spec else 1)

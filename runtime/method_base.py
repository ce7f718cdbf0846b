"""What every method is: a frozen dataclass of its own options (Method) that builds a Drafter + Verifier (Built) from a
small typed context (MethodContext), registered by name in METHODS; runtime/methods.py holds the methods themselves."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from specrt.bundle.artifacts import CurvePoint
from specrt.config import Config
from specrt.errors import InvalidRequestError
from specrt.runtime.backends import Backend
from specrt.runtime.drafters import Drafter
from specrt.runtime.evidence import Evidence
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import TreeSpec
from specrt.runtime.verify import Verifier

# The most tokens a round may feed a model beyond the text: a draft's nodes, its scratch rows and the root. A round's
# masks grow with its square, so a request asking for a hundred thousand drafted tokens is refused here, at once, not
# by a MemoryError minutes into building them
MAX_ROUND_TOKENS = 1024


@dataclass(frozen=True)
class MethodContext:
    """What a method builds its drafter from (Pipeline.method_context): not the Pipeline itself."""

    draft: Backend  # the draft model: each build takes its own runner
    bucket: int  # KV-cache growth, in slots
    evidence: Evidence  # the bundle's plan, latency profile and acceptance on this machine
    prompt_tokens: object  # PPD's PromptTokens where the target holds them, else None
    prompt_tokens_refused: str  # why PPD cannot run where there are none

    def draft_runner(self, method: Method):
        """A runner of the draft model for `method`, refused where the draft is a feature-level head (EAGLE:
        ModelEntry.features) and the method does not draft with one (Method.with_head)."""
        if self.draft.entry.features and not method.with_head:
            raise InvalidRequestError(f"{method.name} drafts with a draft model's own steps, and this bundle's draft "
                                      "is a head on the target's hidden states (EAGLE): use sd or tree")
        return self.draft.runner()

    def ppd_tree(self, batch_size: int):
        return self.evidence.ppd_tree(self.prompt_tokens, batch_size)


@dataclass(frozen=True)
class Built:
    drafter: Drafter | None
    verifier: Verifier
    slack: int  # context slots a round may use beyond the text (drafted nodes, scratch rows)


@dataclass(frozen=True)
class Method(Config):
    name: ClassVar[str]
    summary: ClassVar[str]  # one line for help texts
    # it runs where the bundle's draft is a head on the target's hidden states (EAGLE; ModelEntry.features): all but
    # the methods whose rounds step a draft model on its own outputs alone (dynamic trees, MTAD's beams)
    with_head: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self._validate()
        tokens = self.round_tokens()
        if tokens is not None and tokens > MAX_ROUND_TOKENS:
            given = [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) != f.default]
            given = ", ".join(f"{k}={v}" if isinstance(v, (int, float)) else f"a {k} of {len(v)} nodes"
                              for k, v in given if isinstance(v, (int, float, list, tuple, TreeSpec)))
            raise InvalidRequestError(f"{self.name} with {given} feeds {tokens} tokens a round, more than the "
                                      f"{MAX_ROUND_TOKENS} a round may hold")

    def _validate(self) -> None:
        """Checks across options (bounds of single options are declared with them)."""

    def round_tokens(self) -> int | None:
        """The context slots a round needs beyond the text (Built.slack), from the options alone; None where only the
        bundle knows (a tuned tree)."""
        return None

    def build(self, ctx: MethodContext, params: SamplingParams, batch_size: int) -> Built:
        raise NotImplementedError

    @classmethod
    def from_point(cls, point: CurvePoint) -> "Method":
        """The method that runs a plan's choice (a CurvePoint whose kind runs this method: runtime/speculation.py)."""
        raise NotImplementedError(f"no kind of speculation the tuner weighs runs method {cls.name!r}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def make_method(name: str, options: dict) -> Method:
    """The method called `name` with these options, refusing unknown methods and options it does not take."""
    if not isinstance(name, str) or name not in METHODS:
        raise InvalidRequestError(f"unknown method {name!r} (choose from {', '.join(METHODS)})")
    cls = METHODS[name]
    taken = cls.option_names()
    alien = [k for k in options if k not in taken]
    if alien:
        known = {f for m in METHODS.values() for f in m.option_names()}
        unknown = [k for k in alien if k not in known]
        what = (f"unknown method option(s) {', '.join(unknown)}" if unknown else
                f"option(s) {', '.join(alien)} do not apply to method {name!r}")
        raise InvalidRequestError(f"{what} ({name} takes: {', '.join(taken) or 'no options'})")
    return cls(**options)

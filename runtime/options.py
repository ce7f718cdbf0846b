"""DecodeOptions: what every generate call (and each request of a Server) takes besides the method and sampling
parameters, declared once with their bounds."""

from __future__ import annotations

from dataclasses import dataclass

from specrt.config import Config, option
from specrt.errors import InvalidRequestError
from specrt.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class DecodeOptions(Config):
    """What every generate call takes besides the method and sampling parameters."""

    max_new_tokens: int = option(128, "new tokens per prompt, at most", ge=1)
    seed: int = option(0, "seed of the sampler (and of MTAD's beam sampling)", ge=0)
    batch_size: int = option(1, "prompts decoded together in one ragged batch (no KV padding)", ge=1)
    batching: str = option("continuous", "continuous: a finished sequence's place goes to the next prompt at once; "
                                         "static: batches of batch_size prompts, each run until its last sequence "
                                         "ends (the baseline continuous batching is measured against)",
                           choices=("continuous", "static"))
    padded: bool = option(False, "benchmarking only: vanilla batched speculation, every sequence's KV cache padded "
                                 "with masked slots to the batch's longest after prefill and after every round "
                                 "(EMS-SD's baseline; same tokens, more work)")


@dataclass(frozen=True)
class DecodeRequest(Config):
    """One request as a ServerPool takes it, checked as it is made (InvalidRequestError, whose `fields` name the input
    at fault): its prompt (a string or token ids: checked against the bundle when it is submitted), limit, method (None:
    the pool's default), sampling parameters and seed (None: the sampler of its server)."""

    prompt: object
    max_new_tokens: int = option(128, "new tokens, at most", ge=1)
    method: str | None = option(None, "the decoding method (runtime/methods.py)")
    sampling: object = option(SamplingParams(), "SamplingParams")
    seed: int | None = option(None, "the request's own sampler seed", ge=0)

    def __post_init__(self):
        from specrt.runtime.methods import METHODS

        super().__post_init__()
        if self.method is not None and self.method not in METHODS:
            raise InvalidRequestError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})",
                                      fields=("method",))
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}",
                                      fields=("sampling",))

    @classmethod
    def of(cls, prompt, max_new_tokens: int = 128, method: str | None = None, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> "DecodeRequest":
        """From flat inputs, as a client sends them: the sampling parameters built here, once."""
        return cls(prompt, max_new_tokens, method, SamplingParams(temperature, top_k, top_p), seed)

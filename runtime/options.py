"""DecodeOptions: what every generate call (and each request of a Server) takes besides the method and sampling
parameters, declared once with their bounds."""

from __future__ import annotations

from dataclasses import dataclass

from specrt.config import Config, option


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

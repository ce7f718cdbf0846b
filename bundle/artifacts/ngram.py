"""ngram-prior.json (`specrt ngram prior`): token sequences whose n-grams every sequence's n-gram drafter falls back on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specrt.bundle.artifacts.base import Artifact


@dataclass(frozen=True)
class NgramPrior(Artifact):
    """The sequences (an .npz of `ids`, end to end, and `offsets`) an NgramTable is made from when an n-gram method
    loads (runtime/drafters/ngram.py): the target's own greedy continuations of mixed prompts and the Python source it
    read (the teacher corpus, specrt/checkpoints/teacher.py), none of them a benchmark prompt."""

    FILE: ClassVar[str] = "ngram-prior.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt ngram prior --bundle {bundle}"

    data: str  # the .npz, relative to the bundle
    data_sha256: str
    vocab_size: int  # of the tokenizer the ids are of
    num_sequences: int
    num_tokens: int
    source: dict  # what made the sequences: the teacher corpus's record (key, config, sequences per kind, seconds)

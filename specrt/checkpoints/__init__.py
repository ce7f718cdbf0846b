"""Checkpoints specrt ships and makes: the committed demo pair (DEMO_DIR: tokenizer/, target/, draft/ and
training.json), its training (train.py) on the standard-library corpus (corpus.py), and the
function-preserving inflation of a checkpoint to a memory-bound size (inflate.py)."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"

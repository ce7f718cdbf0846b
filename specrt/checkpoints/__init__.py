"""Checkpoints specrt ships and makes: the committed demo pair (DEMO_DIR: tokenizer/, target/, draft/ and
training.json), its training (train.py) on the standard-library corpus (corpus.py), the function-preserving
inflation of a checkpoint to a memory-bound size (inflate.py), and a draft's distillation toward its target
(distill.py)."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"

"""Checkpoints specrt ships and makes: the committed demo pair (DEMO_DIR: tokenizer/, target/, draft/ and
training.json), its training (train.py) on the standard-library corpus (corpus.py), the function-preserving
inflation of a checkpoint to a memory-bound size (inflate.py), a draft's distillation toward its target
(distill.py), real checkpoints from their packages on the index (real.py), and a new draft for a target that has
none (draft.py), distilled on the target's own text (teacher.py) from mixed prompts (prompt_mix.py), or cut from its
first layers (cut.py)."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"

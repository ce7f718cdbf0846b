"""Checkpoints specrt ships and makes: the committed demo pair (DEMO_DIR: tokenizer/, target/, draft/ and
training.json), its training (train.py) on the standard-library corpus (corpus.py), the function-preserving
inflation of a checkpoint to a memory-bound size (inflate.py), a draft's distillation toward its target
(distill.py), real checkpoints from their packages on the index (real.py), and a new draft for a target that has
none (draft.py), distilled on the target's own text (teacher.py) from mixed prompts (prompt_mix.py), or cut from its
first layers (cut.py)."""

from pathlib import Path

from specrt.contract import TOKENIZER_FILES

DEMO_DIR = Path(__file__).parent / "demo"


def copy_tokenizer(src: Path, dest: Path) -> None:
    """The tokenizer files (and chat template) of checkpoint `src` that exist, into `dest`: a checkpoint made from
    another keeps its tokenizer."""
    for name in (*TOKENIZER_FILES, "chat_template.jinja"):
        if (Path(src) / name).is_file():
            (Path(dest) / name).write_bytes((Path(src) / name).read_bytes())

"""The demo corpus: the Python standard library source of the running interpreter; and users' own prompt files.

It is on every machine that runs specrt, needs no download, and is real code of the kind the
HumanEval benchmark asks for. Files are split into train / validation by a hash of their path
relative to the stdlib root, so the split is the same on every machine with the same Python version.
`corpus_hash` fingerprints exactly which bytes a model was trained on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError

VALIDATION_PERCENT = 2  # ~2% of files, chosen by path hash, are held out


@dataclass(frozen=True)
class CorpusFile:
    rel_path: str  # path relative to the stdlib root, '/'-separated
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < VALIDATION_PERCENT


def load_corpus(root: Path | None = None) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, validation) files, sorted by path; undecodable files are skipped. Read once per root and process (the
    standard library does not change under a running interpreter); each call gets its own lists."""
    train, val = _read_corpus(str(root or stdlib_root()))
    return list(train), list(val)


@functools.lru_cache(maxsize=4)
def _read_corpus(root_dir: str) -> tuple[tuple[CorpusFile, ...], tuple[CorpusFile, ...]]:
    root = Path(root_dir)
    train: list[CorpusFile] = []
    val: list[CorpusFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (val if is_validation(rel) else train).append(CorpusFile(rel, text))
    if not train or not val:
        raise RuntimeError(f"no Python sources found under {root}")
    return tuple(train), tuple(val)


def corpus_hash(files: list[CorpusFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.rel_path.encode())
        h.update(b"\0")
        h.update(f.text.encode())
    return h.hexdigest()


def corpus_windows(encode, num: int, length: int, seed: int, split: str = "validation") -> list[list[int]]:
    """`num` windows of `length` tokens cut at seeded offsets from the corpus's "train" or "validation" files."""
    import numpy as np

    from specrt.errors import SpecrtError

    train, val = load_corpus()
    files = val if split == "validation" else train
    rng = np.random.default_rng(seed)
    windows = []
    for i in rng.permutation(max(num * 4, len(files) if split == "train" else 0))[: num * 4]:
        f = files[int(i) % len(files)]
        ids = encode(f.text)
        if len(ids) < length + 8:
            continue
        start = int(rng.integers(0, len(ids) - length))
        windows.append(ids[start:start + length])
        if len(windows) == num:
            return windows
    raise SpecrtError(f"only {len(windows)} {split} windows of {length} tokens could be cut")


def validation_prompts(encode, num: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """`num` prompts of `prompt_tokens` tokens cut at seeded offsets from held-out stdlib files."""
    return corpus_windows(encode, num, prompt_tokens, seed, "validation")


def read_prompts(path: Path, num: int | None) -> list[str]:
    """The first `num` prompts (None: all) of a JSON Lines file of {"prompt": "..."} objects (a user's own text, for what
    depends on it: acceptance, PPD's accuracy); one clear line for a bad file."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SpecrtError(f"--prompts {path}: cannot read it ({e})") from None
    prompts = []
    for i, line in enumerate(lines[:num], start=1):
        try:
            prompt = json.loads(line)["prompt"]
        except (ValueError, KeyError, TypeError):
            raise SpecrtError(f"--prompts {path}, line {i}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(prompt, str) or not prompt:
            raise SpecrtError(f"--prompts {path}, line {i}: \"prompt\" must be a non-empty string")
        prompts.append(prompt)
    if num is not None and len(prompts) < num:
        raise SpecrtError(f"--prompts {path} has {len(prompts)} prompt(s); --num-prompts asks for {num}")
    return prompts

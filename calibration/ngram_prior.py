"""`specrt ngram prior`: the n-gram drafters' prior, ngram-prior.json, from the target's own text.

The sequences are the teacher corpus (specrt/checkpoints/teacher.py): the target's greedy continuations of mixed
prompts (code, prose, chat through its template; none of them a benchmark prompt) and windows of Python source, cached
under build/teacher by what made them, so a target whose draft `specrt models draft` distilled has its corpus already
(give that checkpoint as --target). Every n-gram method then falls back on their n-grams where the text it decodes has
not shown a context yet (runtime/drafters/ngram.py: NgramTable); `ngram_prior=False` turns it off per request.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import NgramPrior, Stamp
from specrt.bundle.manifest import BundleOptions, load_manifest, sha256_file
from specrt.checkpoints.teacher import TeacherConfig
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.files import write_atomic

DATA = "ngram-prior.npz"


@dataclass(frozen=True)
class NgramPriorConfig(TeacherConfig, BundleOptions):
    target: Path | None = option(None, "the target checkpoint that writes the corpus (default: the bundle's hf/ copy); "
                                       "the one `specrt models draft --target` used finds its corpus in the cache")
    corpus: Path | None = option(None, "take the sequences from this .npz (`ids` end to end and `offsets`: a teacher "
                                       "corpus, or another bundle's ngram-prior.npz of the same target) instead")
    cache: Path = option(Path("build/teacher"), "where teacher corpora are cached (shared with `specrt models draft`)")
    threads: int | None = option(None, "intra-op threads of the generation (default: every core)", ge=1)


def build_prior(cfg: NgramPriorConfig, progress: bool = True) -> NgramPrior:
    """Write the bundle's ngram-prior.json and its sequences (atomically); returns the artifact."""
    from specrt.checkpoints.teacher import build_corpus

    bundle = Path(cfg.bundle)
    manifest = load_manifest(bundle, verify=cfg.verify_mode)
    entry = manifest.models["target"]
    if cfg.corpus is not None:
        ids, offsets, source = _read_corpus(Path(cfg.corpus))
    else:
        target = cfg.target or bundle / entry.hf_dir
        if not (Path(target) / "config.json").is_file():
            raise SpecrtError(f"{target} is not a checkpoint (no config.json): give --target, the target's Hugging Face "
                              "checkpoint")
        tokenizer = target if cfg.target is not None else bundle / manifest.tokenizer
        teacher = TeacherConfig(**{f.name: getattr(cfg, f.name) for f in fields(TeacherConfig)})
        corpus, record = build_corpus(Path(target), Path(tokenizer), teacher, cfg.cache, "train", cfg.threads, progress)
        ids, offsets = corpus.ids, corpus.offsets
        source = {**{k: record[k] for k in ("key", "sequences", "seconds") if k in record}, "config": asdict(teacher),
                  "target": str(cfg.target) if cfg.target else entry.hf_dir}
    if int(ids.max()) >= entry.vocab_size:
        raise SpecrtError(f"the corpus has token id {int(ids.max())}, beyond the bundle's vocabulary of "
                          f"{entry.vocab_size}: it is another model's text than the bundle's target's")
    buf = io.BytesIO()
    np.savez(buf, ids=ids.astype(np.int32), offsets=offsets.astype(np.int64))
    write_atomic(bundle / DATA, buf.getvalue())
    prior = NgramPrior(Stamp.make(bundle), DATA, sha256_file(bundle / DATA), entry.vocab_size, len(offsets) - 1,
                       int(len(ids)), source)
    artifacts.save(bundle, prior)
    return prior


def _read_corpus(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(ids, offsets, what they came from) of an .npz of sequences, refused where it holds none."""
    try:
        with np.load(path) as z:
            ids, offsets = z["ids"], z["offsets"]
    except (OSError, KeyError, ValueError) as e:
        raise SpecrtError(f"--corpus {path}: not an .npz of `ids` and `offsets` ({e})") from None
    if ids.ndim != 1 or not len(ids) or offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 or \
            offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise SpecrtError(f"--corpus {path}: `offsets` do not split `ids` into sequences")
    return ids, offsets, {"corpus": path.name, "sha256": sha256_file(path)}


def describe(bundle: Path, prior: NgramPrior, max_n: int = 5) -> str:
    """What the prior holds, and per context length the contexts it knows and how often their most frequent next
    token came next (leave-one-out)."""
    from specrt.runtime.evidence import prior_table

    table = prior_table(str(Path(bundle) / prior.data), prior.data_sha256, max_n)
    kinds = ", ".join(f"{n} {k}" for k, n in prior.source.get("sequences", {}).items()) or prior.source.get("corpus")
    lines = [f"{Path(bundle) / NgramPrior.FILE}: {prior.num_tokens} tokens in {prior.num_sequences} sequences ({kinds})"]
    lines += [f"after {c} token(s): {len(t)} contexts, the most frequent next token right {h:.1%}"
              for c, (t, h) in enumerate(zip(table.tables, table.hits), start=1)]
    return "\n".join(lines)

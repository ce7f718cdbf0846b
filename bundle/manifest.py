"""The bundle manifest: one JSON file that says what a deployment directory holds.

Layout of a bundle (paths relative to it):

    manifest.json            this file's content (format, versions, models, I/O, hashes)
    tokenizer/               Hugging Face fast tokenizer shared by both models
    target.onnx, draft.onnx  step graphs (specrt.contract)
    hf/target, hf/draft      the source checkpoints (TorchBackend runs these)
    acceptance.json, latency.json, plan.json   typed artifacts made later (specrt.bundle.artifacts)

Every file listed under "files" carries its sha256; `load_manifest(..., verify=True)` checks them, so a truncated
or swapped file is refused with a message naming it. Hashing is what a load costs most after the weights
themselves (`Pipeline.load` of the inflated pair: 1.17 s hashing every file, 0.55 s with the hashes recorded, in
bench/results/load-inflated-startup; a 7B-class bundle's hf/ weights alone are 12 GB), so a
file hashed once is not hashed again while it stays the same file: .verified.json in the bundle records, per file,
the size, modification time (ns) and inode it had when it hashed to its digest (written where the bundle is
writable; a file modified within the last VERIFY_RACE_S of being hashed is not recorded, since a coarse clock could
miss a change in that time, as git's racily-clean index entries). Any write changes the modification time; what
it cannot catch is bits rotting in place under an unchanged one: `verify="full"` re-hashes every file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from specrt.files import write_atomic
from specrt.config import Config, option
from specrt.contract import ROLES
from specrt.errors import BundleError, InvalidRequestError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
VERIFIED = ".verified.json"  # rel path -> [size, mtime_ns, inode, sha256] of files hashed before (see above)
VERIFY_RACE_S = 2.0
VERIFY_MODES = (True, False, "full")
VERIFY_FLAGS = {"recorded": True, "full": "full", "none": False}  # --verify -> load_manifest(verify=...)
_verified_lock = threading.Lock()


@dataclass(frozen=True)
class BundleOptions(Config):
    """What every verb that reads a bundle takes (shared by their configs and CLI flags)."""

    bundle: Path = option(Path("build/demo"), "bundle directory made by `specrt export`")
    verify: str = option("recorded", "how the bundle's files are checked against their sha256 before use: recorded = "
                                     "those not hashed before as the same file (size, mtime, inode); full = every "
                                     "file (what catches bits rotting in place); none", choices=tuple(VERIFY_FLAGS))

    @property
    def verify_mode(self) -> bool | str:
        """--verify as load_manifest's and Pipeline.load's `verify`."""
        return VERIFY_FLAGS[self.verify]


@dataclass(frozen=True)
class ModelEntry:
    role: str  # "target" or "draft"
    onnx: str | None  # relative path of the step graph ("" or None: exported without ONNX graphs, --no-onnx)
    hf_dir: str  # relative path of the source checkpoint
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: str  # dtype of the K/V and activations, e.g. "float32"
    num_params: int
    sliding_window: int | None = None  # each token attends to the previous `sliding_window` positions only
    # its step's last hidden state is an output (contract.HIDDEN): a target whose draft reads it
    hidden: bool = False
    # its step reads the hidden state of each token's position before (contract.FEATURES): a feature-level draft head
    features: bool = False
    hidden_size: int = 0  # the width of those hidden states (0 where neither)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _recordable(st: os.stat_result) -> bool:
    return time.time() - st.st_mtime_ns / 1e9 > VERIFY_RACE_S


def _read_record(bundle: Path) -> dict:
    try:
        seen = json.loads((bundle / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return seen if isinstance(seen, dict) else {}


def _write_record(bundle: Path, seen: dict) -> None:
    try:
        write_atomic(bundle / VERIFIED, json.dumps(seen, indent=0, sort_keys=True) + "\n")
    except OSError:  # a read-only bundle: hashed again next time
        pass


def verify_files(bundle: str | Path, digests: dict[str, str], verify: bool | str = True) -> str | None:
    """The first of `digests` (path relative to the bundle -> sha256) that is missing or does not hash to its digest,
    or None: each one hashed unless .verified.json says it is the same file (size, mtime, inode) that hashed to that
    digest before; `verify="full"` hashes every one; False checks nothing. Records what it hashed. Thread-safe."""
    if verify not in VERIFY_MODES:
        raise InvalidRequestError(f"verify must be True, False or \"full\", got {verify!r}")
    if not verify:
        return None
    bundle = Path(bundle)
    with _verified_lock:
        seen = _read_record(bundle)
        changed, bad = False, None
        for rel, digest in digests.items():
            try:
                st = (bundle / rel).stat()
            except OSError:
                bad = rel
                break
            if verify != "full" and seen.get(rel) == [*_identity(st), digest]:
                continue
            if sha256_file(bundle / rel) != digest:
                bad, changed = rel, seen.pop(rel, None) is not None or changed  # no longer vouched for
                break
            if _recordable(st):
                seen[rel], changed = [*_identity(st), digest], True
        if changed:
            _write_record(bundle, seen)
    return bad


def hash_tree(bundle: Path, rel_paths: list[str], record: bool = False) -> dict[str, str]:
    """sha256 of every file under each relative path (file or directory). `record`: also in .verified.json, as
    verify_files records what it hashed, without its race window: only for files nothing writes once they are
    hashed (an export's staging directory), so that a bundle's first load need not hash them all again."""
    out, seen = {}, {}
    for rel in rel_paths:
        p = bundle / rel
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for f in files:
            key, st = f.relative_to(bundle).as_posix(), f.stat()
            out[key] = sha256_file(f)
            if _identity(f.stat()) == _identity(st):  # unchanged while it was hashed
                seen[key] = [*_identity(st), out[key]]
    if record:
        with _verified_lock:
            _write_record(bundle, {**_read_record(bundle), **seen})
    return out


def write_manifest(bundle: Path, manifest: Manifest) -> Path:
    path = bundle / MANIFEST
    write_atomic(path, json.dumps(manifest.to_data(), indent=1, sort_keys=True) + "\n")
    return path


def manifest_sha256(bundle: Path) -> str:
    """What every artifact made from a bundle is stamped with: the hash of its manifest."""
    return sha256_file(Path(bundle) / MANIFEST)


def load_manifest(bundle: str | Path, verify: bool | str = True) -> Manifest:
    bundle = Path(bundle)
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"bundle directory {bundle} does not exist (create one with `specrt export`)")
    if not path.is_file():
        raise BundleError(f"{bundle} is not a specrt bundle: {MANIFEST} is missing (re-run `specrt export`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise BundleError(f"{path} is not UTF-8 text (re-run `specrt export`)") from None
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON ({e}); re-run `specrt export`") from None
    manifest = Manifest.from_data(path, data)
    bad = verify_files(bundle, manifest.files, verify)
    if bad is not None and not (bundle / bad).is_file():
        raise BundleError(f"bundle {bundle} is missing {bad} (listed in {MANIFEST}); re-run `specrt export`")
    if bad is not None:
        raise BundleError(f"bundle {bundle}: {bad} does not match its sha256 in {MANIFEST} (corrupt or modified)")
    return manifest


_ENTRY_TYPES = {"str": str, "int": int, "int | None": (int, type(None)), "str | None": (str, type(None)), "bool": bool}


@dataclass(frozen=True)
class Manifest:
    """manifest.json, typed: what `specrt export` wrote and a load reads, its shape checked (Manifest.from_data)."""

    created: str  # when the export finished, %Y-%m-%dT%H:%M:%S%z
    tokenizer: str  # the tokenizer directory, relative to the bundle
    models: dict[str, ModelEntry]  # role -> its step graph, checkpoint and shape
    files: dict[str, str]  # every file of the bundle (relative path) -> its sha256
    eos_token_id: int | None = None
    versions: dict = field(default_factory=dict)  # package -> version the export ran with
    export: dict = field(default_factory=dict)  # role -> how it was exported (exporter, seconds, source)
    io: dict = field(default_factory=dict)  # the step graphs' input and output names
    parity: dict = field(default_factory=dict)  # role -> the exported graph's logit error against its checkpoint
    format: int = MANIFEST_FORMAT

    def to_data(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "models": {role: asdict(entry) for role, entry in self.models.items()}}

    @classmethod
    def from_data(cls, path: Path, data) -> Manifest:
        """The manifest of this JSON data, or a BundleError in one line naming the field of the wrong shape (a
        hand-edited or truncated file fails here, not as a KeyError deep in a load)."""
        def bad(what: str):
            return BundleError(f"{path}: {what}; re-run `specrt export`")

        if not isinstance(data, dict):
            raise bad(f"expected a JSON object, found {type(data).__name__}")
        if data.get("format") != MANIFEST_FORMAT:
            raise BundleError(f"{path}: manifest format {data.get('format')!r}, this specrt reads {MANIFEST_FORMAT}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise bad(f"fields this specrt does not know: {', '.join(sorted(unknown))}")
        if not isinstance(data.get("created"), str):
            raise bad('"created" is missing or not a string')
        if not isinstance(data.get("tokenizer"), str):
            raise bad('"tokenizer" (the tokenizer directory) is missing or not a string')
        files = data.get("files")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64
                                                  for k, v in files.items()):
            raise bad('"files" must map each file\'s path to its sha256 (64 hex digits)')
        models = data.get("models")
        if not isinstance(models, dict):
            raise bad('"models" is missing or not an object')
        for role in ROLES:
            entry = models.get(role)
            if not isinstance(entry, dict):
                raise BundleError(f"{path}: no {role!r} model in the manifest")
            for f in fields(ModelEntry):
                if f.name not in entry and f.default is MISSING:
                    raise bad(f"models.{role}.{f.name} is missing")
                if f.name in entry and (not isinstance(entry[f.name], _ENTRY_TYPES[f.type])
                                        or isinstance(entry[f.name], bool) != (f.type == "bool")):
                    raise bad(f"models.{role}.{f.name} is {entry[f.name]!r}, not {f.type}")
            unknown = set(entry) - {f.name for f in fields(ModelEntry)}
            if unknown:
                raise bad(f"models.{role} has fields this specrt does not know: {', '.join(sorted(unknown))}")
        eos = data.get("eos_token_id")
        if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool)):
            raise bad('"eos_token_id" is not an integer')
        for name in ("versions", "export", "io", "parity"):
            if not isinstance(data.get(name, {}), dict):
                raise bad(f'"{name}" is not an object')
        return cls(**{**data, "models": {role: ModelEntry(**models[role]) for role in ROLES}})

"""The stamp every artifact carries, variants, and the one place artifacts are saved, loaded and checked."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from specrt.bundle.codec import DataError, from_data, to_data
from specrt.files import write_json_atomic
from specrt.bundle.machine import Machine
from specrt.bundle.manifest import manifest_sha256, sha256_file, verify_files
from specrt.errors import BundleError, SpecrtError


@dataclass(frozen=True)
class Stamp:
    manifest_sha256: str  # of the bundle's manifest.json this was made from
    specrt_version: str
    created: str  # local time, ISO 8601
    machine: Machine | None = None  # where it was measured; None: valid on any machine
    inputs: dict[str, str] = field(default_factory=dict)  # artifact file -> the sha256 it was derived from

    @staticmethod
    def make(bundle: Path, machine: Machine | None = None, inputs: tuple[str, ...] = ()) -> "Stamp":
        from specrt.version import __version__

        return Stamp(manifest_sha256(bundle), __version__, time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine,
                     {name: sha256_file(Path(bundle) / name) for name in inputs})


EXPORTED = "exported"  # the name of the step graphs as exported among variants (quant None)


def variant_quant(variant: str) -> str | None:
    """The quant of a variant's name: None for the exported graphs, else the scheme."""
    return None if variant == EXPORTED else variant


def variant_words(quant: str | None) -> str:
    """A variant in an error message: "the int8-weights variant", "the exported step graphs"."""
    return f"the {quant} variant" if quant else "the exported step graphs"


@dataclass(frozen=True)
class Artifact:
    FILE: ClassVar[str]
    FORMAT: ClassVar[int]
    COMMAND: ClassVar[str]  # what makes it; {bundle} and {flags} (the machine's backend flags) are filled in
    # measured on one variant of the step graphs: the exported graphs' at FILE, quantized variant S's at
    # quant/S/FILE (beside its graphs), so that the tuner can weigh variants side by side
    PER_VARIANT: ClassVar[bool] = False

    stamp: Stamp

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        """What to run to (re)make it; `reason` is "missing", "machine" (measured elsewhere) or "stale"."""
        return cls.COMMAND.format(bundle=bundle, flags=machine.flags() if machine else "").replace("  ", " ").strip()

    @classmethod
    def file(cls, quant: str | None = None) -> str:
        """Where it lies in the bundle (relative): per variant of the step graphs for PER_VARIANT artifacts."""
        return f"quant/{quant}/{cls.FILE}" if quant and cls.PER_VARIANT else cls.FILE

    @classmethod
    def variant_command(cls, bundle: Path, machine: Machine | None, reason: str, quant: str | None) -> str:
        cmd = cls.command(bundle, machine, reason)
        return cmd + (f" --quant {quant}" if quant and cls.PER_VARIANT and f"--quant {quant}" not in cmd else "")

    def mismatch(self) -> str | None:
        """Why this artifact cannot be used in this process beyond its stamp (libraries, devices), or None."""
        return None


def save(bundle: Path, artifact: Artifact, quant: str | None = None) -> Path:
    """Write atomically into the bundle (a PER_VARIANT artifact: where variant `quant`'s lie); returns the path."""
    path = Path(bundle) / artifact.file(quant)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"format": artifact.FORMAT, **to_data(artifact)})
    return path


def load(bundle: Path, cls: type[Artifact], machine: Machine | None = None, here: bool = True,
         quant: str | None = None) -> Artifact:
    """The bundle's artifact of this type, checked against the bundle and (if given) this machine; and with
    `here`, against this process's libraries and devices (Artifact.mismatch: engines built elsewhere). A
    PER_VARIANT artifact is variant `quant`'s, else the machine's variant (Machine.quant)."""
    bundle = Path(bundle).resolve()
    if quant is None and machine is not None:
        quant = machine.quant
    name = cls.file(quant)
    path = bundle / name
    redo = f"re-run `{cls.variant_command(bundle, machine, 'stale', quant)}`"
    if not path.is_file():
        raise BundleError(f"no {name} in {bundle}: run `{cls.variant_command(bundle, machine, 'missing', quant)}` first")
    artifact = _parse(cls, path, redo)
    stamp = artifact.stamp
    if stamp.manifest_sha256 != manifest_sha256(bundle):
        raise BundleError(f"{path} was made for another export of this bundle (its manifest.json changed): {redo}")
    if machine is not None and stamp.machine is not None and stamp.machine != machine:
        raise BundleError(f"{path} was measured on {stamp.machine.describe()}, but this is {machine.describe()}: "
                          f"re-run `{cls.variant_command(bundle, machine, 'machine', quant)}` here")
    for input_name, digest in stamp.inputs.items():
        if verify_files(bundle, {input_name: digest}):
            raise BundleError(f"{path} was made from an earlier {input_name} (it changed or is gone since): {redo}")
    why = artifact.mismatch() if here else None
    if why:
        raise BundleError(f"{path} {why}: re-run `{cls.variant_command(bundle, machine, 'machine', quant)}` here")
    return artifact


def read(bundle: Path, cls: type[Artifact], quant: str | None = None) -> tuple[Artifact | None, str]:
    """The bundle's artifact of this type (of variant `quant`, for PER_VARIANT ones) for reading about it (a
    report), and "ok" or why `load` would refuse it (not counting this process's devices); the artifact is None
    only when it is missing or unreadable."""
    try:
        return load(bundle, cls, here=False, quant=quant), "ok"
    except SpecrtError as e:
        why = str(e)
    try:
        return _parse(cls, Path(bundle).resolve() / cls.file(quant), ""), why
    except (OSError, SpecrtError):
        return None, why


_PARSED: dict = {}  # (class, path) -> (file signature, artifact): a file read again only when it changed


def _parse(cls: type[Artifact], path: Path, redo: str) -> Artifact:
    """The artifact in `path`, parsed and type-checked (cached while the file's size, mtime and inode hold)."""
    st = path.stat()
    signature = (st.st_mtime_ns, st.st_size, st.st_ino)
    cached = _PARSED.get((cls, path))
    if cached is not None and cached[0] == signature:
        return cached[1]
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON (truncated or edited? {e}): {redo}") from None
    if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise BundleError(f"{path} has format {found!r}, this specrt reads format {cls.FORMAT}: {redo}")
    try:
        artifact = from_data(cls, {k: v for k, v in data.items() if k != "format"})
    except (DataError, TypeError, ValueError) as e:
        raise BundleError(f"{path} is malformed ({e}): {redo}") from None
    _PARSED[(cls, path)] = (signature, artifact)
    return artifact

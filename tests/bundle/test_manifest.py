"""The manifest's file hashes: checked on every load, each file hashed once while it stays the same file."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from specrt.errors import BundleError, InvalidRequestError


@pytest.fixture
def bundle(demo_bundle, tmp_path):
    from specrt.bundle.manifest import VERIFIED

    copy = tmp_path / "b"
    shutil.copytree(demo_bundle, copy)
    (copy / VERIFIED).unlink()  # the export's record: of the original files (other inodes), harmless but in the way
    old = time.time() - 60  # written a minute ago: past the race window
    for f in copy.rglob("*"):
        os.utime(f, (old, old))
    return copy


def counting(monkeypatch) -> list:
    from specrt.bundle import manifest

    hashed = []
    real = manifest.sha256_file

    def sha256_file(path):
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(manifest, "sha256_file", sha256_file)
    return hashed


def test_a_file_is_hashed_again_only_when_it_changed(bundle, monkeypatch):
    from specrt.bundle.manifest import VERIFIED, load_manifest

    hashed = counting(monkeypatch)
    files = json.loads((bundle / "manifest.json").read_text())["files"]
    load_manifest(bundle)
    assert sorted(hashed) == sorted(f.rsplit("/", 1)[-1] for f in files)  # every file, once
    assert set(json.loads((bundle / VERIFIED).read_text())) == set(files)
    hashed.clear()
    load_manifest(bundle)
    assert hashed == []  # the same files
    # rewritten (a new mtime) with the same bytes: hashed again, and still fine
    data = (bundle / "draft.onnx").read_bytes()
    (bundle / "draft.onnx").write_bytes(data)
    old = time.time() - 60
    os.utime(bundle / "draft.onnx", (old, old + 1))
    load_manifest(bundle)
    assert hashed == ["draft.onnx"]
    hashed.clear()
    load_manifest(bundle, verify="full")  # every file hashed, the record kept
    assert len(hashed) == len(files)
    hashed.clear()
    load_manifest(bundle)
    assert hashed == []
    # changed in place under its old identity (bit rot): only "full" looks
    stat = (bundle / "draft.onnx").stat()
    with open(bundle / "draft.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\1\2\3\4")
    os.utime(bundle / "draft.onnx", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    load_manifest(bundle)
    with pytest.raises(BundleError, match="draft.onnx does not match its sha256"):
        load_manifest(bundle, verify="full")
    # and once "full" found it, no later load trusts the record of it
    with pytest.raises(BundleError, match="draft.onnx does not match its sha256"):
        load_manifest(bundle)
    with pytest.raises(InvalidRequestError, match='verify must be True, False or "full", got \'yes\''):
        load_manifest(bundle, verify="yes")


def test_a_file_written_just_now_is_not_recorded_and_a_read_only_bundle_still_loads(bundle, monkeypatch):
    from specrt.bundle.manifest import VERIFIED, load_manifest
    from specrt.runtime.pipeline import Pipeline

    from specrt.bundle import manifest

    monkeypatch.setattr(manifest, "VERIFY_RACE_S", 30.0)  # the fixture's files are 60 s old; a stalled test stays safe
    hashed = counting(monkeypatch)
    (bundle / "draft.onnx").write_bytes((bundle / "draft.onnx").read_bytes())  # mtime now: a coarse clock's race
    load_manifest(bundle)
    assert "draft.onnx" not in json.loads((bundle / VERIFIED).read_text())
    hashed.clear()
    load_manifest(bundle)
    assert hashed == ["draft.onnx"]
    (bundle / VERIFIED).unlink()

    def read_only(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(manifest, "write_atomic", read_only)  # nowhere to record: every load hashes, none fails
    hashed.clear()
    Pipeline.load(bundle, threads=1)
    assert len(hashed) > 3 and not (bundle / VERIFIED).exists()


def test_an_export_records_what_it_hashed_so_the_first_load_hashes_nothing(tmp_path, monkeypatch):
    from specrt.bundle.manifest import VERIFIED, load_manifest
    from specrt.checkpoints import DEMO_DIR
    from specrt.export.onnx_export import ExportConfig, export_bundle

    m = export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", out=tmp_path / "b",
                                   tokenizer=DEMO_DIR / "tokenizer", exporter="torchscript"), progress=False)
    record = json.loads((tmp_path / "b" / VERIFIED).read_text())
    assert {rel: r[3] for rel, r in record.items()} == m["files"]
    hashed = counting(monkeypatch)
    load_manifest(tmp_path / "b")
    assert hashed == []
    (tmp_path / "b" / "tokenizer" / "tokenizer.json").write_text("{}")  # and what changes after is still caught
    with pytest.raises(BundleError, match="tokenizer/tokenizer.json does not match its sha256"):
        load_manifest(tmp_path / "b")

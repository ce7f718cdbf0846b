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
    assert {rel: r[3] for rel, r in record.items()} == m.files
    hashed = counting(monkeypatch)
    load_manifest(tmp_path / "b")
    assert hashed == []
    (tmp_path / "b" / "tokenizer" / "tokenizer.json").write_text("{}")  # and what changes after is still caught
    with pytest.raises(BundleError, match="tokenizer/tokenizer.json does not match its sha256"):
        load_manifest(tmp_path / "b")


def _edited(manifest: dict, edit) -> dict:
    m = json.loads(json.dumps(manifest))
    edit(m)
    return m


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "expected a JSON object, found list"),
    ('"a string"', "expected a JSON object, found str"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not UTF-8 text"),
    ("{", "is not valid JSON"),
    (lambda m: m.pop("tokenizer"), '"tokenizer" (the tokenizer directory) is missing'),
    (lambda m: m.update(files=[]), '"files" must map each file\'s path to its sha256'),
    (lambda m: m.update(models=None), '"models" is missing or not an object'),
    (lambda m: m["models"].pop("draft"), "no 'draft' model in the manifest"),
    (lambda m: m["models"]["target"].pop("num_layers"), "models.target.num_layers is missing"),
    (lambda m: m["models"]["target"].update(num_layers="2"), "models.target.num_layers is '2', not int"),
    (lambda m: m["models"]["draft"].update(vocab_size=True), "models.draft.vocab_size is True, not int"),
    (lambda m: m["models"]["draft"].update(colour="red"), "fields this specrt does not know: colour"),
    (lambda m: m.update(eos_token_id="0"), '"eos_token_id" is not an integer'),
    (lambda m: m.pop("created"), '"created" is missing or not a string'),
    (lambda m: m.update(parity=[1]), '"parity" is not an object'),
    (lambda m: m.update(colour="red"), "fields this specrt does not know: colour"),
])
def test_a_manifest_of_the_wrong_shape_is_one_line_naming_the_field(bundle, content, message, capsys):
    """Each was a raw AttributeError, KeyError or UnicodeDecodeError, from `specrt inspect` or a load."""
    from specrt.cli import main

    path = bundle / "manifest.json"
    if callable(content):
        content = json.dumps(_edited(json.loads(path.read_text()), content))
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code = main(["inspect", "--bundle", str(bundle)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_inspect_quant_plan_checks_the_variant_the_plan_picked_and_without_a_plan_says_so(bundle, capsys):
    """`inspect --quant plan` looked for quant/plan/*.json, a directory that never exists; it resolves the variant as
    Pipeline.load does."""
    from specrt.cli import main

    assert main(["inspect", "--bundle", str(bundle), "--quant", "plan"]) == 2
    err = capsys.readouterr().err
    assert "quant='plan' needs the bundle's plan" in err and "specrt calibrate" in err


def test_verify_full_on_the_cli_catches_an_edit_that_kept_the_files_identity(bundle, capsys):
    """An in-place edit that keeps a file's size and modification time passes the recorded hashes, by design;
    `--verify full` (on every verb that reads a bundle) hashes every file again and refuses it."""
    from specrt.cli import build_parser, main

    assert main(["inspect", "--bundle", str(bundle)]) == 0  # hashes, and records what it hashed
    path = bundle / "tokenizer" / "tokenizer_config.json"
    st = path.stat()
    text = path.read_bytes()
    with open(path, "r+b") as f:  # the same inode, the same size, the old modification time: bits rotting
        f.write(bytes([text[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    assert main(["inspect", "--bundle", str(bundle)]) == 0
    assert main(["inspect", "--bundle", str(bundle), "--verify", "full"]) == 2
    assert "tokenizer/tokenizer_config.json does not match its sha256" in capsys.readouterr().err
    parser = build_parser()

    def leaves(p, path=()):
        subs = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not subs:
            yield path, p
        for a in subs:
            for name, child in a.choices.items():
                yield from leaves(child, (*path, name))

    flags = {path: {s for a in p._actions for s in a.option_strings} for path, p in leaves(parser)}
    missing = [" ".join(v) for v, f in flags.items() if "--bundle" in f and "--verify" not in f]
    assert not missing, f"verbs reading a bundle without --verify: {missing}"


def test_the_typed_manifest_round_trips_what_export_wrote(bundle):
    from specrt.bundle.manifest import Manifest, ModelEntry, load_manifest

    data = json.loads((bundle / "manifest.json").read_text())
    manifest = load_manifest(bundle)
    assert isinstance(manifest.models["target"], ModelEntry) and manifest.files == data["files"]
    assert manifest.to_data() == data
    assert Manifest.from_data(bundle / "manifest.json", manifest.to_data()) == manifest

"""Export is atomic: an interrupted re-export leaves the old bundle intact; a finished one drops the old
bundle's artifacts; a directory that is not a bundle is never replaced."""

import shutil
import signal
import subprocess
import sys
import time

import pytest

from specrt.errors import SpecrtError
from specrt.runtime.pipeline import Pipeline


def _start_export(out):
    return subprocess.Popen([sys.executable, "-m", "specrt", "export", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_temporary(parent, proc, timeout=120):
    """Until the export has written something into its temporary directory."""
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        tmp = list(parent.glob(".specrt-export-*"))
        if tmp and any(p.is_file() for p in tmp[0].rglob("*")):
            return tmp[0]
        time.sleep(0.05)
    raise AssertionError(f"the export never wrote its temporary directory (exit {proc.poll()})")


def _files(bundle) -> dict:
    """The bundle's files and bytes, but for .verified.json: the cache of hashes already checked, which any verifying
    reader rewrites (a copied bundle's entries name the original's inodes: the re-export's check of it renews them)."""
    return {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*")
            if p.is_file() and p.name != ".verified.json"}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_re_export_leaves_the_old_bundle_intact(demo_bundle, tmp_path, sig):
    out = tmp_path / "b"
    shutil.copytree(demo_bundle, out)
    (out / "acceptance.json").write_text("{}")  # an artifact of the old export, kept with it
    before = _files(out)
    proc = _start_export(out)
    tmp = _wait_for_temporary(tmp_path, proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert _files(out) == before
    Pipeline.load(out)  # and its hashes still verify
    if sig == signal.SIGINT:
        assert not tmp.exists()  # cleaned up on the way out
    else:
        assert tmp.exists()  # a killed process cannot clean up: the next export does


def test_a_re_export_replaces_the_bundle_and_drops_stale_artifacts(demo_bundle, tmp_path):
    from specrt.export.onnx_export import ExportConfig, export_bundle

    out = tmp_path / "b"
    shutil.copytree(demo_bundle, out)
    for name in ("acceptance.json", "latency.json", "plan.json"):
        (out / name).write_text("{}")
    stale = tmp_path / ".specrt-export-999999999-abc"  # left by a killed export whose process is gone
    stale.mkdir()
    export_bundle(ExportConfig(out=out, check=False, exporter="torchscript"), progress=False)
    assert not any((out / name).exists() for name in ("acceptance.json", "latency.json", "plan.json"))
    assert not stale.exists() and not list(tmp_path.glob(".specrt-export-*"))
    Pipeline.load(out)
    from specrt.files import UMASK

    assert out.stat().st_mode & 0o777 == 0o777 & ~UMASK  # what mkdir would make, not mkdtemp's 0700


def test_a_directory_that_is_not_a_bundle_is_never_replaced(tmp_path):
    from specrt.export.onnx_export import ExportConfig, export_bundle

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpecrtError, match="non-empty directory that is not a specrt bundle: refusing to replace it"):
        export_bundle(ExportConfig(out=tmp_path, check=False), progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_bundle_without_onnx_serves_the_torch_backend_and_refuses_ort(tmp_path, humaneval):
    from specrt.errors import BundleError
    from specrt.export.onnx_export import ExportConfig, export_bundle

    manifest = export_bundle(ExportConfig(out=tmp_path / "b", onnx=False), progress=False)
    assert not list((tmp_path / "b").glob("*.onnx")) and manifest.models["target"].onnx == ""
    assert not any(f.endswith(".onnx") for f in manifest.files)
    with pytest.raises(BundleError, match="has no ONNX step graphs \\(exported with --no-onnx\\): load it with backend torch"):
        Pipeline.load(tmp_path / "b")
    pipe = Pipeline.load(tmp_path / "b", backend="torch", threads=2)
    ar = pipe.generate(humaneval[0], method="autoregressive", max_new_tokens=8)
    assert pipe.generate(humaneval[0], method="sd", max_new_tokens=8).token_ids == ar.token_ids

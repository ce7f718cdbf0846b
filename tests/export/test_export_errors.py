"""Missing export inputs are refused by their flag before any work starts (they once surfaced a minute in)."""

import shutil

import pytest

from specrt.checkpoints import DEMO_DIR


@pytest.mark.parametrize("flags, message", [
    (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such directory (a Hugging Face checkpoint directory)"),
    (["--draft", "{tmp}"], "--draft {tmp} is not a Hugging Face checkpoint directory (no config.json)"),
    (["--target", "{tmp}/bare"], "no tokenizer in {tmp}/bare (the --target's; give one with --tokenizer DIR)"),
    (["--target", "{tmp}/bare", "--tokenizer", "{tmp}"], "no tokenizer in {tmp} (the --tokenizer given)"),
])
def test_missing_inputs_are_refused_by_their_flag_before_any_work(flags, message, tmp_path, monkeypatch, capsys):
    import specrt.export.onnx_export as ex
    from specrt.cli import main

    (tmp_path / "bare").mkdir()
    shutil.copy(DEMO_DIR / "target" / "config.json", tmp_path / "bare")
    monkeypatch.setattr(ex, "_build", lambda *a: pytest.fail("the export started"))
    argv = ["export", *(f.format(tmp=tmp_path) for f in flags), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"specrt: error: {message.format(tmp=tmp_path)}"
    assert not (tmp_path / "out").exists()

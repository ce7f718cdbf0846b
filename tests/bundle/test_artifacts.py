"""Typed artifacts: what is saved is what loads, and every reason to distrust one is refused in one line."""

import json
import os

import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import (Acceptance, EngineSet, InPlaceGraphs, LatencyProfile, NgramPrior, Plan, PromptTokens,
                                     QuantSet, TrtEngineSet)
from specrt.files import UMASK, atomic_file, replace_dir, write_atomic
from specrt.bundle.machine import Machine
from specrt.errors import BundleError
from tests.fakes import write_acceptance, write_latency

HERE = Machine.here("ort", 2)


@pytest.fixture
def bundle(tmp_path):
    (tmp_path / "manifest.json").write_text('{"an": "export"}')
    return tmp_path


def test_round_trip_and_format_on_disk(bundle):
    lat = write_latency(bundle, lambda n: 1.0 + n, batches=(1, 2), host_ms={"tree": {0: 0.1, 8: 0.5}})
    assert artifacts.load(bundle, LatencyProfile, HERE) == lat
    data = json.loads((bundle / "latency.json").read_text())
    assert data["format"] == LatencyProfile.FORMAT and data["stamp"]["machine"]["threads"] == 2
    assert lat.step_ms("target", 2, 1.5) == pytest.approx(2 * 2.5)  # interpolated between profiled n
    assert not [p for p in bundle.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    from specrt.files import UMASK

    assert (bundle / "latency.json").stat().st_mode & 0o777 == 0o666 & ~UMASK  # as a plain write would make it


def test_the_tuner_reads_the_non_decreasing_fit_of_a_noisy_profile_and_the_file_keeps_what_was_measured(bundle):
    from specrt.bundle.artifacts import nondecreasing

    assert nondecreasing((1.0, 3.0, 2.0, 4.0)) == (1.0, 2.5, 2.5, 4.0)
    assert nondecreasing((3.0, 2.0, 1.0)) == (2.0, 2.0, 2.0)
    assert nondecreasing((1.0, 2.0, 2.0, 5.0)) == (1.0, 2.0, 2.0, 5.0)
    assert nondecreasing((1.0, 4.0, 3.0, 2.0, 6.0)) == (1.0, 3.0, 3.0, 3.0, 6.0)
    lat = write_latency(bundle, lambda n: {1: 1.0, 2: 0.6}.get(n, float(n)), max_tokens=4,
                        host_ms={"tree": {0: 0.1, 4: 0.9, 8: 0.5, 16: 2.0}})
    assert lat.step_ms("target", 1, 1) == pytest.approx(0.8) and lat.step_ms("target", 1, 2) == pytest.approx(0.8)
    assert lat.step_ms("target", 1, 3) == pytest.approx(3.0)
    assert lat.host(6) == pytest.approx(0.7) and lat.host(12) == pytest.approx(1.35)
    assert artifacts.load(bundle, LatencyProfile, HERE).models["target"][1][128][2] == 0.6


def test_a_profile_at_a_context_is_linear_between_the_profiled_ones(bundle):
    from dataclasses import replace

    lat = write_latency(bundle, lambda n: 1.0 + n, batches=(1, 2), max_tokens=4)
    models = {role: {b: {128: curve, 512: {n: ms + 4.0 for n, ms in curve.items()}} for b, (curve,) in
                     ((b, tuple(per.values())) for b, per in per_batch.items())} for role, per_batch in lat.models.items()}
    lat = replace(lat, models=models)
    assert lat.step_ms("target", 2, 1) == pytest.approx(2 * 2.0 + 2.0)  # without a context: their average
    assert lat.at_context(128).step_ms("target", 2, 1) == pytest.approx(4.0)
    assert lat.at_context(320).step_ms("target", 2, 1) == pytest.approx(6.0)  # halfway: halfway
    assert lat.at_context(40).step_ms("target", 1, 3) == pytest.approx(4.0)  # below the smallest: the smallest's
    assert lat.at_context(896).step_ms("draft", 1, 2) == pytest.approx(0.1 + 8.0)  # beyond: along the line
    falling = replace(lat, models={**models, "target": {1: {128: {1: 5.0}, 512: {1: 3.0}}}})
    assert falling.at_context(2048).step_ms("target", 1, 1) == pytest.approx(3.0)  # noise never makes it cheaper
    # caches grown by 128 slots: the profiled points held 256 and 640 slots (128 / 512 cached + 1 new token)
    bucketed = replace(lat, cache_bucket=128)
    assert bucketed.at_context(200).step_ms("target", 2, 1) == pytest.approx(4.0)  # 256 slots, as 128 cached
    assert bucketed.at_context(320).step_ms("target", 2, 1) == pytest.approx(4.0 + 4.0 / 3)  # 384: a third of the way
    # engines attending over spans of 256, 1024, 2048 slots: 128 and 512 cached run at 256 and 1024; 200 as 128
    spans = replace(lat, cache_bucket=2048, cache_spans=(256, 1024, 2048))
    assert spans.at_context(200).step_ms("target", 2, 1) == pytest.approx(4.0)
    assert spans.at_context(700).step_ms("target", 2, 1) == pytest.approx(8.0)  # as 512 cached: span 1024
    assert spans.at_context(300).step_ms("target", 2, 1) == pytest.approx(8.0)  # past 256: the next span's cost
    static = replace(lat, cache_bucket=1024)  # one capacity whatever the context: the profiled points averaged
    assert static.at_context(40).step_ms("target", 2, 1) == pytest.approx(6.0) == static.at_context(900).step_ms("target", 2, 1)


@pytest.mark.parametrize("corrupt,match", [
    (lambda p: p.unlink(), "no latency.json in .*: run `specrt profile --bundle .* --backend ort --threads 2` first"),
    (lambda p: p.write_text(p.read_text()[:50]), "is not valid JSON \\(truncated or edited\\?.*re-run `specrt profile"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "format": 1})),  # before bandwidth was recorded
     "has format 1, this specrt reads format 2: re-run `specrt profile"),
    (lambda p: p.write_text("[1, 2]"), "has format None"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "models": {"target": {"x": {}}}})),
     "is malformed \\(models.target.x: expected an integer key\\)"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "extra": 1})), "unexpected field\\(s\\) extra"),
    (lambda p: (p.parent / "manifest.json").write_text('{"another": "export"}'),
     "was made for another export of this bundle"),
])
def test_a_distrusted_latency_profile_is_refused_with_what_to_run(bundle, corrupt, match):
    write_latency(bundle, lambda n: 1.0)
    corrupt(bundle / "latency.json")
    with pytest.raises(BundleError, match=match):
        artifacts.load(bundle, LatencyProfile, HERE)


def test_a_rewritten_artifact_is_read_again(bundle):
    write_latency(bundle, lambda n: 1.0)
    assert artifacts.load(bundle, LatencyProfile).step_ms("target", 1, 1) == 1.0
    write_latency(bundle, lambda n: 2.0)  # parsed artifacts are cached only while their file is unchanged
    assert artifacts.load(bundle, LatencyProfile).step_ms("target", 1, 1) == 2.0


def test_machine_backend_threads_and_device_must_match(bundle):
    write_latency(bundle, lambda n: 1.0)
    for other in (Machine.here("ort", 4), Machine.here("torch", 2), Machine("Another CPU", 2, "x86_64", "ort", 2, "cpu")):
        with pytest.raises(BundleError, match="was measured on .* but this is .*re-run `specrt profile .*` here"):
            artifacts.load(bundle, LatencyProfile, other)
    assert artifacts.load(bundle, LatencyProfile)  # no machine given: not checked


def test_acceptance_is_valid_on_any_machine_but_not_for_another_export(bundle):
    acc = write_acceptance(bundle, [[0.8, 0.1]])
    assert acc.stamp.machine is None and artifacts.load(bundle, Acceptance, Machine.here("torch", 7)) == acc
    (bundle / "manifest.json").write_text('{"re": "exported"}')
    with pytest.raises(BundleError, match="another export.*specrt calibrate --bundle"):
        artifacts.load(bundle, Acceptance)


def test_status_lists_every_artifact(bundle):
    write_acceptance(bundle, [[0.8, 0.1]])
    status = dict(artifacts.status(bundle, HERE))
    assert status["acceptance.json"] == "ok" and status["latency.json"].startswith("no latency.json")
    assert "specrt calibrate" in status["plan.json"] and "specrt tune" in status["plan.json"]
    assert set(status) == {cls.FILE for cls in (Acceptance, LatencyProfile, Plan, EngineSet, TrtEngineSet, QuantSet,
                                                PromptTokens, InPlaceGraphs, NgramPrior)} | {"plans/exported.json"}
    assert status["plans/exported.json"].startswith("no plans/exported.json") and "specrt tune" in status[
        "plans/exported.json"]
    assert status["inplace.json"].startswith("no inplace.json") and "specrt inplace" in status["inplace.json"]
    assert status["ppd.json"].startswith("no ppd.json") and "specrt ppd train" in status["ppd.json"]
    assert status["ngram-prior.json"].startswith("no ngram-prior.json") and "specrt ngram prior" in status[
        "ngram-prior.json"]
    assert status["engines.json"].startswith("no engines.json") and "specrt build" in status["engines.json"]


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    write_atomic(path, "old")

    def fail(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_file_written_by_name_commits_only_when_its_writer_ends_well(tmp_path):
    path = tmp_path / "fig.png"
    write_atomic(path, "old")
    with pytest.raises(ValueError), atomic_file(path, suffix=".png") as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(".png") and tmp != path
        tmp.write_text("torn")
        raise ValueError("the writer failed")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["fig.png"]
    with atomic_file(path, suffix=".png") as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old"
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["fig.png"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~UMASK


def test_replace_dir_swaps_whole_directories(tmp_path):
    dest, new = tmp_path / "b", tmp_path / "new"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    new.mkdir()
    (new / "new.txt").write_text("new")
    replace_dir(new, dest)
    assert [p.name for p in dest.iterdir()] == ["new.txt"] and not new.exists()
    again = tmp_path / "again"
    again.mkdir()
    replace_dir(again, tmp_path / "fresh")  # no destination yet: a rename
    assert (tmp_path / "fresh").is_dir()


def test_nothing_commits_after_a_sigint_that_the_code_under_it_swallowed(tmp_path):
    import signal

    from specrt.files import interrupts_kept

    path, dest, new = tmp_path / "a.json", tmp_path / "b", tmp_path / "new"
    write_atomic(path, "old")
    new.mkdir()
    before = signal.getsignal(signal.SIGINT)
    with interrupts_kept():
        try:  # a library that catches the KeyboardInterrupt and goes on
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt, match="nothing is committed"):
            write_atomic(path, "new")
        with pytest.raises(KeyboardInterrupt, match="nothing is committed"):
            replace_dir(new, dest)
        with pytest.raises(KeyboardInterrupt, match="nothing is committed"), atomic_file(path) as tmp:
            tmp.write_text("new")
    assert path.read_text() == "old" and not dest.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "a.json", "new"]
    assert signal.getsignal(signal.SIGINT) is before
    write_atomic(path, "new")  # past the block, a SIGINT of before is forgotten
    assert path.read_text() == "new"

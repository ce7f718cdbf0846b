"""`specrt gpu-session`: call 1 rehearsed on the CPU at toy size (the stages a lent GPU runs, in the same order, with
the same verbs), and the session's own rules: a failed stage logged and the next one run, stages that need it
skipped, the budget kept, stamps resumed, everything packed after each stage."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from specrt.cli.gpu_session import Session, SessionConfig, Stage


def test_call_1_rehearsed_on_the_cpu_packs_an_e2e_table(tmp_path):
    from specrt.cli.gpu_session import run_session

    cfg = SessionConfig(call="1", out=tmp_path / "gpu", pack=tmp_path / "pack", device="cpu", shape="toy", quick=True,
                        budget=900)
    record = run_session(cfg)
    assert [(s["stage"], s["status"]) for s in record["stages"]] == [
        ("inflate", "ok"), ("export", "ok"), ("build", "ok"), ("gpu-test", "ok"), ("e2e", "ok"), ("kernels", "ok")]
    pack = tmp_path / "pack"
    e2e = json.loads((pack / "results" / "e2e-rehearsal-toy.json").read_text())
    rows = {r["method"]: r for r in e2e["rows"]}
    assert set(rows) == {"autoregressive", "sd", "anpd", "dynamic-ngram", "hf", "hf-assisted", "hf-lookup"}
    assert all(r["same_tokens_as_ours_ar"] == 1 for r in rows.values() if r["method"] != "hf-lookup")
    assert e2e["roofline"]["tokens_per_s"] > 0
    kernels = {r["kind"]: r for r in json.loads((pack / "results" / "kernels-rehearsal-toy.json").read_text())["rows"]}
    assert kernels["ar"]["weight_gemm_ms"] > 0 and kernels["verify"]["tokens"] == 8
    engines = json.loads((pack / "bundle" / "engines.json").read_text())
    assert (engines["batch_buckets"], engines["slots"], len(engines["spans"])) == ([1], 1, 1)  # the small build
    for f in ("session.json", "session.log", "bundle/manifest.json", "logs/e2e.log", "done/e2e.json",
              "results/env-1.json"):
        assert (pack / f).is_file(), f
    again = run_session(cfg)  # resumed: the artifacts are there, the measurement is stamped
    assert [s["status"] for s in again["stages"]] == ["made before"] * 3 + ["done before"] * 2


def _session(tmp_path, stages, monkeypatch, **kw):
    import specrt.cli.gpu_session as gs

    monkeypatch.setattr(gs, "stages", lambda cfg: stages)
    return Session(SessionConfig(call="2", out=tmp_path / "s", pack=tmp_path / "pack", device="cpu", **kw))


def test_a_failed_stage_is_logged_and_the_next_runs(tmp_path, monkeypatch):
    stages = [Stage("bad", ("no-such-verb",)), Stage("after-bad", ("--help",), needs=("bad",)),
              Stage("fine", ("--help",)), Stage("made", ("--help",), makes="fine.txt")]
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "fine.txt").write_text("here")
    record = _session(tmp_path, stages, monkeypatch).run()
    assert [s["status"] for s in record["stages"]] == ["failed (exit status 2)", "skipped: needs bad", "ok",
                                                       "made before"]
    assert "invalid choice: 'no-such-verb'" in (tmp_path / "pack" / "logs" / "bad.log").read_text()
    assert sorted(p.name for p in (tmp_path / "pack" / "done").iterdir()) == ["fine.json", "made.json"]
    assert json.loads((tmp_path / "pack" / "session.json").read_text())["stages"][2]["status"] == "ok"


def test_each_bundles_small_artifacts_are_packed_and_its_graphs_are_not(tmp_path, monkeypatch):
    session = _session(tmp_path, [], monkeypatch)
    for bundle in ("bundle", "bundle-real", "bundle-real.tmp"):
        for name in ("plan.json", "plans/exported.json", "plans/int8-weights.json",
                     "quant/int8-weights/acceptance.json", "target.onnx", "quant/int8-weights/target.onnx"):
            (tmp_path / "s" / bundle / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "s" / bundle / name).write_text("{}")
    session.log("packing")
    session.pack()
    packed = sorted(str(p.relative_to(tmp_path / "pack")) for p in (tmp_path / "pack").glob("bundle*/**/*")
                    if p.is_file())
    assert packed == sorted(f"{b}/{n}" for b in ("bundle", "bundle-real") for n in (
        "plan.json", "plans/exported.json", "plans/int8-weights.json", "quant/int8-weights/acceptance.json"))


def test_the_budget_is_kept(tmp_path, monkeypatch):
    slow = Stage("slow", ("models", "train", "--out", str(tmp_path / "never")))  # ~30 minutes on this CPU
    t0 = time.monotonic()
    record = _session(tmp_path, [slow, Stage("next", ("--help",))], monkeypatch, budget=8, min_stage=2).run()
    assert time.monotonic() - t0 < 30
    assert [s["status"] for s in record["stages"]] == ["cut at the budget", "not started: 0 s of the budget left"]
    assert not (tmp_path / "s" / "done" / "slow.json").exists()


@pytest.mark.parametrize("call, first", [("1", ("bench", "e2e", "--help")),
                                         ("real", ("build", "--help", "--compile", "tuned"))])
def test_the_tests_are_stopped_before_a_stage_that_times_the_device(call, first, tmp_path, monkeypatch):
    """Calls 1 and real test beside the stages that make their artifacts, never beside a bench or a tuning build."""
    import subprocess

    from specrt.cli.gpu_session import times_the_device

    assert not times_the_device(Stage("build", ("build", "--bundle", "b", "--compile", "default")))
    session = _session(tmp_path, [Stage("e2e", first, estimate_s=100)], monkeypatch, budget=103)
    log = tmp_path / "s" / "logs" / "gpu-test.log"

    def start():  # tests that would outlast the budget left to the bench
        log.write_text("still testing\n")
        return subprocess.Popen(["sleep", "60"], start_new_session=True), open(log, "ab")

    monkeypatch.setattr(session, "start_tests", start)
    session.cfg = dataclasses.replace(session.cfg, call=call)  # the call starts the tests
    t0 = time.monotonic()
    record = session.run()
    assert time.monotonic() - t0 < 30
    assert [(s["stage"], s["status"]) for s in record["stages"]] == [
        ("gpu-test", "stopped to leave the GPU to e2e"), ("e2e", "ok")]


def test_a_pack_can_be_one_archive(tmp_path, monkeypatch):
    """A lent machine returns 8 files: the whole pack as one .tar.gz, rewritten after each stage."""
    import tarfile

    record = _session(tmp_path, [Stage("fine", ("--help",))], monkeypatch, budget=60).run()
    assert record["stages"][0]["status"] == "ok"
    session = Session(SessionConfig(call="2", out=tmp_path / "s", pack=tmp_path / "out" / "gpu-2.tar.gz", device="cpu"))
    session.pack()
    with tarfile.open(tmp_path / "out" / "gpu-2.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"session.json", "session.log", "logs/fine.log", "done/fine.json", "results/env-2.json"} <= names
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["gpu-2.tar.gz"]  # no .tmp left


def test_cuda_without_a_gpu_says_how_to_rehearse(tmp_path):
    import torch

    from specrt.cli.gpu_session import run_session
    from specrt.errors import SpecrtError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SpecrtError, match="finds no CUDA device here \\(rehearse with --device cpu --shape toy"):
        run_session(SessionConfig(out=tmp_path))


@pytest.mark.parametrize("name, tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "4090"),
                                       ("Tesla T4", "t4"), ("Some Accelerator", "gpu")])
def test_results_are_labelled_with_the_gpu_they_ran_on(name, tag, monkeypatch, tmp_path):
    import torch

    from specrt.cli.gpu_session import stages

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    e2e = next(s for s in stages(SessionConfig(call="1", out=tmp_path)) if s.name == "e2e")
    assert e2e.argv[e2e.argv.index("--label") + 1] == f"{tag}-7b-graphs"


def test_the_real_and_tuned_calls_profile_before_they_bench_and_use_what_was_carried(tmp_path, monkeypatch):
    import specrt.cli.gpu_session as gs
    from specrt.cli.gpu_session import stages

    monkeypatch.setattr(gs, "gpu_tag", lambda device: "h200")  # no GPU here to name
    cfg = SessionConfig(call="real", out=tmp_path, device="cuda", real_gguf=tmp_path / "s.gguf",
                        real_draft=tmp_path / "d", real_prior=tmp_path / "p.npz")
    real = {s.name: s for s in stages(cfg)}
    assert list(real) == ["real", "inflate-real", "export-real", "build-real", "kernels-real", "e2e-real",
                          "e2e-real-chat"]  # no prior carried
    assert "autoregressive,sd,anpd,dynamic-ngram" in real["e2e-real"].argv
    (tmp_path / "p.npz").write_bytes(b"")
    real = {s.name: s for s in stages(cfg)}
    assert list(real)[3] == "prior-real" and real["prior-real"].argv[-2:] == ("--corpus", str(tmp_path / "p.npz"))
    assert "autoregressive,sd,anpd,anpd-noprior,dynamic-ngram" in real["e2e-real"].argv
    assert real["real"].argv[-4:] == ("--gguf", str(tmp_path / "s.gguf"), "--out", str(tmp_path / "real"))
    assert ("--preset", "7b") == real["inflate-real"].argv[-4:-2]  # fitted to SmolLM2's heads by inflate
    assert str(tmp_path / "d") in real["export-real"].argv and "default" in real["build-real"].argv
    assert ("--prompt-set", "chat") == real["e2e-real-chat"].argv[-4:-2]
    # code against HF's compiled static-cache generate (issue 57's baseline), chat against no HF row
    assert ("--baselines", "hf-compile") == real["e2e-real"].argv[-4:-2]
    assert ("--baselines", "") == real["e2e-real-chat"].argv[-6:-4]
    # tuned engines on a warm machine after the default's run: the same artifacts, a bundle copy and stages of its own
    tuned = {s.name: s for s in stages(dataclasses.replace(cfg, real_compile="tuned"))}
    assert list(tuned)[:4] == list(real)[:4] and list(tuned)[4:] == [
        "copy-real-tuned", "build-real-tuned", "kernels-real-tuned", "e2e-real-tuned", "e2e-real-chat-tuned"]
    assert tuned["copy-real-tuned"].argv == ("copy", str(tmp_path / "bundle-real"), str(tmp_path / "bundle-real-tuned"))
    assert ("--compile", "tuned") == tuned["build-real-tuned"].argv[-2:]
    assert str(tmp_path / "bundle-real-tuned") in tuned["e2e-real-tuned"].argv
    assert tuned["e2e-real-tuned"].argv[-1] == "h200-7b-smollm2-tuned"
    assert real["e2e-real"].argv[-1] == "h200-7b-smollm2"
    distill = {s.name: s for s in stages(dataclasses.replace(cfg, call="distill"))}
    assert list(distill) == ["real", "distill"] and distill["distill"].brings == "draft"
    assert distill["distill"].deadline == "--time-limit"  # the session gives it the seconds left
    assert ("--device", "cuda") == distill["distill"].argv[4:6] and "4096" in distill["distill"].argv
    # an EAGLE head carried as the draft: grown as the target is, exported in the draft's place, run by sd's rows
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text('{"specrt_eagle": {"hidden_size": 576}}')
    real = {s.name: s for s in stages(dataclasses.replace(cfg, real_draft=head))}
    assert list(real)[2:4] == ["inflate-head", "export-real"]
    grown = real["inflate-real"].argv[4:-1]  # the shape, dtype and device of the target's inflation, and --out
    assert real["inflate-head"].argv[3:] == (str(head), *grown, str(tmp_path / "real-head"))
    assert str(tmp_path / "real-head") in real["export-real"].argv and "inflate-head" in real["export-real"].needs
    assert "autoregressive,sd,anpd,anpd-noprior,sd-ngram" in real["e2e-real"].argv
    tuned = [s.name for s in stages(dataclasses.replace(cfg, call="tuned"))]
    assert tuned == ["inflate", "export", "copy-tuned", "build-tuned", "kernels-tuned", "e2e-tuned"]


def test_a_directory_brought_back_is_split_in_parts_that_join_and_stale_parts_go(tmp_path):
    import io
    import tarfile

    from specrt.cli.gpu_real import split_tar

    src = tmp_path / "draft"
    src.mkdir()
    (src / "weights.bin").write_bytes(bytes(range(256)) * 40)
    (src / "draft.json").write_text('{"key": "k"}')
    dest = tmp_path / "out" / "gpu-distill-draft.tar"
    dest.parent.mkdir()
    (dest.parent / "gpu-distill-draft.tar.part09").write_bytes(b"stale")
    parts = split_tar(src, dest, part_bytes=4096)
    assert [p.name for p in parts] == [f"gpu-distill-draft.tar.part{i:02d}" for i in range(len(parts))]
    assert len(parts) > 2 and all(p.stat().st_size <= 4096 for p in parts)
    assert sorted(p.name for p in dest.parent.iterdir()) == [p.name for p in parts]  # the stale part is gone
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        assert tar.extractfile("draft/weights.bin").read() == bytes(range(256)) * 40
        assert tar.extractfile("draft/draft.json").read() == b'{"key": "k"}'


def test_calls_distill_and_eagle_rehearsed_on_the_cpu_bring_back_a_draft_its_text_and_a_head(smollm2, tmp_path):
    """Call distill at rehearsal sizes: the real target's checkpoint (made before), a draft distilled on the device
    within the time the session gives it, and the draft (float16) with the text it learnt from packed beside the
    archive in parts that join; then call eagle: a head trained on that same cached text, brought back alike."""
    import io
    import tarfile

    import numpy as np

    from specrt.checkpoints.draft import RECORD, TEXT
    from specrt.cli.gpu_session import run_session

    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "real").symlink_to(smollm2)  # the GGUF's conversion is tests/checkpoints/test_real.py's
    cfg = SessionConfig(call="distill", out=tmp_path / "gpu", pack=tmp_path / "out" / "gpu-distill.tar.gz",
                        device="cpu", quick=True, real_gguf=tmp_path / "unused.gguf", budget=900)
    record = run_session(cfg)
    assert [(s["stage"], s["status"]) for s in record["stages"]] == [("real", "made before"), ("distill", "ok")]
    parts = sorted((tmp_path / "out").glob("gpu-distill-draft.tar.part*"))
    assert parts and all(p.stat().st_size <= 15 << 20 for p in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    draft = tmp_path / "back" / "draft"
    made = json.loads((draft / RECORD).read_text())
    assert made["device"] == "cpu" and made["config"]["save_dtype"] == "float16"
    assert made["teacher"]["train"]["sequences"]["chat"] == 2  # 6 prompts, the kinds in turn
    assert made["teacher"]["train"]["sequences"]["own-chat"] == 2  # and 2 requests it asked itself
    argv = next(s["argv"] for s in record["stages"] if s["stage"] == "distill")
    assert argv[-2] == "--time-limit" and 0 < float(argv[-1]) <= 900 - 60  # the budget left, less the margin
    with np.load(draft / TEXT) as z:
        assert len(z["offsets"]) == 6 + 2 + 2 + 1 and z["offsets"][-1] == len(z["ids"])  # 6 prompts, 2 own, 2 source
    with tarfile.open(tmp_path / "out" / "gpu-distill.tar.gz") as tar:
        assert {"done/real.json", "done/distill.json", "logs/distill.log"} <= set(tar.getnames())
    # then call eagle on the same (warm) machine: a head trained on the text call distill left in the cache
    from specrt.checkpoints.eagle import RECORD as HEAD

    cached = sorted(p.name for p in (tmp_path / "gpu" / "teacher").iterdir())
    record = run_session(dataclasses.replace(cfg, call="eagle", pack=tmp_path / "out" / "gpu-eagle.tar.gz"))
    assert [(s["stage"], s["status"]) for s in record["stages"]] == [("real", "made before"), ("eagle", "ok")]
    assert sorted(p.name for p in (tmp_path / "gpu" / "teacher").iterdir()) == cached  # no text written anew
    parts = sorted((tmp_path / "out").glob("gpu-eagle-eagle.tar.part*"))
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    head = json.loads((tmp_path / "back" / "eagle" / HEAD).read_text())
    assert head["device"] == "cpu" and head["teacher"]["train"]["key"] == made["teacher"]["train"]["key"]

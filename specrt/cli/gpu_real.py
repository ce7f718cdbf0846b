"""What a gpu-session call is (its config, its stages), and the calls on the real target (SmolLM2-135M-Instruct,
from its carried GGUF); specrt/cli/gpu_session.py runs them.

    real     the target inflated to the shape (its function kept), exported with its distilled draft (or its EAGLE
             head, inflated alike), compiled engines, kernels, and e2e on code and chat prompts: a real model's
             acceptance on a GPU
    distill  a draft distilled on the GPU (`specrt models draft --device cuda`): the target writes four times the
             text a 2-core CPU writes in 30 minutes, the draft trains on it, and the draft (float16) and its text come
             back beside the call's archive, split in parts a lent machine returns (docs/gpu.md says how to join them)
    eagle    an EAGLE head trained on the GPU (`specrt models eagle --device cuda`) on the same text, read from the
             cache call distill left on a warm machine (or written anew), brought back in parts the same way
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path

from specrt.config import Config, option
from specrt.contract import TORCH_COMPILE_MODES, eagle_shape
from specrt.files import write_atomic

CALLS = ("1", "2", "compiled", "tuned", "real", "distill", "eagle", "batch", "ppd", "quant", "export")
# call real at toy size: the least growth of SmolLM2-135M's shape (576 wide, 9 heads of 64 in groups of 3, 30 layers)
REAL_TOY = ("--hidden", "768", "--intermediate", "1536", "--layers", "30", "--heads", "12")
PART_BYTES = 15 << 20  # a directory brought back goes in parts of this size (a lent machine returns 16 MiB a file)
SHAPES = {"7b": ("--preset", "7b"), "1b": ("--preset", "1b"),
          "toy": ("--hidden", "384", "--intermediate", "1024", "--layers", "3", "--heads", "6")}


@dataclass(frozen=True)
class SessionConfig(Config):
    call: str = option("1", "which call: 1, 2, compiled, tuned, real, distill, eagle, batch, ppd, quant or export",
                       choices=CALLS)
    out: Path = option(Path("build/gpu"), "the session's directory: target, bundle, results, logs, stamps")
    pack: Path | None = option(None, "a directory every result, log, stamp and small artifact is copied to after each "
                                     "stage, or one .tar.gz of them (on a lent machine, which returns 8 files: "
                                     "$OUT/gpu-<call>.tar.gz)")
    device: str = option("cuda", "where the models run: cuda, or cpu for a rehearsal")
    shape: str = option("7b", "the inflated target's shape: 7b, 1b, or toy (a rehearsal)", choices=tuple(SHAPES))
    budget: float = option(540.0, "seconds this call may take, stages included (a lent machine's command may run "
                                  "600)", gt=0)
    min_stage: float = option(20.0, "a stage starts only with this many seconds of the budget left", ge=0)
    quick: bool = option(False, "rehearsal sizes: 1 prompt, 16 new tokens, 1 timed run per bench")
    tests: bool = option(True, "calls 1 and real: the tests marked gpu, in the background")
    real_gguf: Path = option(Path("build/carry/SmolLM2-135M-Instruct.Q4_1.gguf"), "calls real, distill, eagle: "
                                                                                  "SmolLM2-135M-Instruct's GGUF file "
                                                                                  "(carried: docs/gpu.md)")
    real_draft: Path = option(Path("build/carry/draft"), "call real: its draft (`specrt models draft`), carried, or "
                                                         "OUT/draft after call distill on the same machine; or an "
                                                         "EAGLE head (`specrt models eagle`), carried or OUT/eagle "
                                                         "after call eagle, inflated as the target is")
    real_prior: Path = option(Path("build/carry/ngram-prior.npz"), "call real: its n-gram prior's sequences (a real "
                                                                   "bundle's ngram-prior.npz, or a draft's or head's "
                                                                   "teacher-text.npz), carried; none: no prior")
    real_compile: str = option("default", "call real on CUDA: how its engines' decoder layers compile (`specrt build "
                                          "--compile`)", choices=TORCH_COMPILE_MODES)


@dataclass(frozen=True)
class Stage:
    name: str
    argv: tuple[str, ...]  # after `python -m specrt`; ("copy", SRC, DST): the bundle SRC hard-linked to DST
    makes: str | None = None  # an artifact (relative to the session's directory): run wherever it is missing
    needs: tuple[str, ...] = ()  # stages that must have ended well (now or in an earlier call)
    estimate_s: int = 60  # device-seconds at the 7b shape, by arithmetic; an H200 took about half (docs/gpu.md)
    brings: str | None = None  # a directory (relative to the session's) packed whole once the stage has made it
    deadline: str | None = None  # an option of its command the session gives the seconds it has left by (less a
    # margin): a stage that ends early rather than be stopped at the budget with nothing to show


def real_checkpoint(cfg: SessionConfig) -> Stage:
    """The real target's checkpoint, converted from the carried GGUF (checked against its pinned sha256)."""
    return Stage("real", ("models", "real", "smollm2-135m", "--gguf", str(cfg.real_gguf), "--out",
                          str(cfg.out / "real")), makes="real/config.json", estimate_s=40)


def teacher_sizes(cfg: SessionConfig) -> tuple[str, ...]:
    """The target's text in calls distill and eagle, the same in both: the second reads the first's cached corpora."""
    if cfg.quick:
        return ("--prompts", "6", "--own-chats", "2", "--new-tokens", "16", "--source-windows", "2", "--window", "64",
                "--gen-batch", "6", "--val-prompts", "3")
    # 4x the CPU default's text: 4096 of the 10734 training prompts the mix has and 2048 requests the target asks
    # itself, each continued 128 tokens
    return "--prompts", "4096", "--own-chats", "2048", "--gen-batch", "192", "--source-windows", "1024"


def distill_stages(cfg: SessionConfig) -> list[Stage]:
    """Call distill: the real target's checkpoint, then a draft distilled for it on the device."""
    out = cfg.out
    train = (("--steps", "3", "--batch-size", "2") if cfg.quick else
             ("--steps", "4000", "--batch-size", "64", "--positions", "48", "--warmup-steps", "100"))
    return [real_checkpoint(cfg),
            Stage("distill", ("models", "draft", "--target", str(out / "real"), "--device", cfg.device, "--out",
                              str(out / "draft"), "--cache", str(out / "teacher"), "--save-dtype", "float16",
                              *teacher_sizes(cfg), *train),
                  makes="draft/draft.json", needs=("real",), estimate_s=420, brings="draft", deadline="--time-limit")]


def eagle_stages(cfg: SessionConfig) -> list[Stage]:
    """Call eagle: the real target's checkpoint, then an EAGLE head trained for it on the device, on call distill's
    text (about as many passes over 4x the text as the CPU's head made over its own)."""
    out = cfg.out
    train = ("--steps", "3", "--batch-size", "2", "--eval-depth", "2") if cfg.quick else ("--steps", "4000",
                                                                                          "--batch-size", "24")
    return [real_checkpoint(cfg),
            Stage("eagle", ("models", "eagle", "--target", str(out / "real"), "--device", cfg.device, "--out",
                            str(out / "eagle"), "--cache", str(out / "teacher"), *teacher_sizes(cfg), *train),
                  makes="eagle/eagle.json", needs=("real",), estimate_s=240, brings="eagle")]


def real_stages(cfg: SessionConfig, kernels: tuple, sizes: tuple, tag: str) -> list[Stage]:
    """Call real: SmolLM2-135M-Instruct from its GGUF, inflated to the shape (its function kept), exported with its
    distilled draft or its EAGLE head, compiled engines (CUDA), kernels, and e2e on code and chat prompts: a real
    model's acceptance."""
    out, d = cfg.out, cfg.device
    cuda = d.startswith("cuda")
    # a non-default build (--real-compile tuned): engines of its own in a hard-linked copy of the bundle, its stages
    # and labels named for it, so that on a warm machine it follows a default call's run and reuses its artifacts
    mode = f"-{cfg.real_compile}" if cuda and cfg.real_compile != "default" else ""
    bundle, label, measured = str(out / "bundle-real"), f"{tag}-{cfg.shape}-smollm2{mode}", f"bundle-real{mode}"
    prior = cfg.real_prior.is_file()
    # a head reads the target's hidden states: grown as the target is, and drafting in sd's chains (with the n-gram
    # drafts merged in: sd-ngram) where a draft model also drafts dynamic trees
    head = eagle_shape(cfg.real_draft) is not None
    draft = str(out / "real-head") if head else str(cfg.real_draft)
    e2e = ("bench", "e2e", "--bundle", str(out / measured), "--backend", "static", "--out", str(out / "results"),
           *sizes, "--methods",
           "autoregressive,sd,anpd," + "anpd-noprior," * prior + ("sd-ngram" if head else "dynamic-ngram"))
    # a CPU compiles every shape for minutes, and runs a 0.2B float16 model slowly: float32 there
    compiled, dtype = (("--compile", cfg.real_compile), "float16") if cuda else ((), "float32")
    grow = ("--dtype", dtype, "--device", d, *(REAL_TOY if cfg.shape == "toy" else SHAPES[cfg.shape]))
    return [real_checkpoint(cfg),
            Stage("inflate-real", ("models", "inflate", "--src", str(out / "real"), *grow, "--out",
                                   str(out / "real-target")), makes="real-target/config.json",
                  needs=("real",), estimate_s=60),
            *[Stage("inflate-head", ("models", "inflate", "--src", str(cfg.real_draft), *grow, "--out",
                                     str(out / "real-head")), makes="real-head/config.json", estimate_s=20)] * head,
            Stage("export-real", ("export", "--target", str(out / "real-target"), "--draft", draft,
                                  "--out", bundle, "--dtype", dtype, "--no-onnx"),
                  makes="bundle-real/manifest.json", needs=("inflate-real",) + ("inflate-head",) * head,
                  estimate_s=90),
            *[Stage("prior-real", ("ngram", "prior", "--bundle", bundle, "--corpus", str(cfg.real_prior)),
                    makes="bundle-real/ngram-prior.json", needs=("export-real",), estimate_s=5)] * prior,
            *[Stage(f"copy-real{mode}", ("copy", bundle, str(out / measured)), makes=f"{measured}/manifest.json",
                    needs=("export-real",), estimate_s=5)] * bool(mode),
            # the profiles AR, sd (5 rows), dynamic-ngram (<= 16) and prefill chunks of 64 use (a compile per shape)
            Stage(f"build-real{mode}", ("build", "--bundle", str(out / measured), "--device", d, "--batch-buckets",
                                        "1", "--spans", "512", "--token-profiles", "1,8,16,64", *compiled),
                  makes=f"{measured}/engines.json", needs=(f"copy-real{mode}" if mode else "export-real",),
                  estimate_s=300 if mode else 150),
            Stage(f"kernels-real{mode}", (*kernels, "--bundle", str(out / measured), "--label", label),
                  needs=(f"build-real{mode}",), estimate_s=60),
            # code against HF's static-cache compiled generate (issue 57's baseline: a compile of its decode step, a
            # minute and a half on a 7B model), chat against none (HF's eager generate at 7B: a minute of the budget)
            Stage(f"e2e-real{mode}", (*e2e, "--baselines", "hf-compile", "--label", label),
                  needs=(f"build-real{mode}",), estimate_s=240),
            Stage(f"e2e-real-chat{mode}", (*e2e, "--baselines", "", "--prompt-set", "chat", "--label",
                                           f"{label}-chat"), needs=(f"build-real{mode}",), estimate_s=120)]


def split_tar(src: Path, dest: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """The directory `src` as one uncompressed tar (its name at the top), written as dest.part00, dest.part01, ... of
    at most `part_bytes` each (`cat dest.part* | tar x` joins them); parts left from a larger earlier write are
    removed. Returns the parts."""
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=src.name)
    data = buf.getvalue()
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        part = dest.with_name(f"{dest.name}.part{i:02d}")
        write_atomic(part, data[start:start + part_bytes])
        parts.append(part)
    for stale in dest.parent.glob(f"{dest.name}.part*"):
        if stale not in parts:
            stale.unlink()
    return parts

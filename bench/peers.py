"""Peer runtimes as same-run baselines of `specrt bench e2e` (and llama.cpp's step beside ours in `specrt bench
fusions --peers`): what a deployer would run instead of specrt.

ONNX Runtime GenAI (`onnxruntime-genai`): its model builder turns the bundle's own hf/ checkpoints into its ONNX
models (GroupQueryAttention, its own KV cache); `og.Generator` decodes them greedily, alone (`ort-genai`), with the
bundle's draft model speculating (`ort-genai-sd`, the draft's model as its config's `model.draft`) or with n-gram
lookup over the prompt and output (`ort-genai-ngram`). llama.cpp (`llama-cpp-python`): GGUF files made by llama.cpp's
own converter, decoded greedily alone (`llama-cpp`), with the bindings' prompt lookup drafts (`llama-cpp-lookup`) or
with the bundle's draft model as the drafter of the bindings' speculative loop (`llama-cpp-sd`). Conversions are
cached under `peer_cache`, keyed by the bundle manifest's sha256 and the precision, each written whole or not at all.

Every peer decodes the token ids our tokenizer makes of each prompt (so a difference in the output is the
runtime's, not a tokenizer's), greedily, with the same thread count and max_new_tokens as our rows. The precision
is matched to ours and named in the row: the exported float32 graphs against fp32, an int8 variant of ours
(`--quant int8-weights`) against the peer's 8-bit weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specrt.bench.decoded import Decoded, timed
from specrt.bench.report import paired_ratio, runs_rate
from specrt.bundle.manifest import manifest_sha256
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.files import commit, replace_dir

ORT_GENAI = ("ort-genai", "ort-genai-sd", "ort-genai-ngram")
LLAMA_CPP = ("llama-cpp", "llama-cpp-sd", "llama-cpp-lookup")
PEERS = ORT_GENAI + LLAMA_CPP
NGRAM_SIZE = 3  # ORT GenAI's n-gram lookup: the suffix length matched against the text so far
LOOKUP_NGRAM = 2  # llama-cpp-python's prompt lookup: the longest n-gram it matches (its default)


@dataclass(frozen=True)
class PeerSources:
    """Where a bench finds the peers' conversions of the bundle and llama.cpp's converter."""

    peer_cache: Path = option(Path("build/peers"), "where the peers' conversions of the bundle's checkpoints are kept "
                                                   "(made once per export and precision)")
    llama_cpp_source: Path = option(Path("build/peers/llama.cpp"), "llama.cpp's GGUF converter (convert_hf_to_gguf.py "
                                                                   "and its packages; `make peers` unpacks them)")
    original_gguf: Path | None = option(None, "the target's GGUF file as shipped (`specrt models real` keeps it in "
                                              "build/real/downloads): one more llama.cpp row, on it, as a llama.cpp "
                                              "user runs the model (another precision: its tokens may differ)")


def ort_genai_missing() -> str | None:
    """Why ONNX Runtime GenAI cannot run here, or None."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime-genai is not installed: `pip install 'specrt[peers]'` adds it"
    return None


def llama_cpp_missing(source: Path) -> str | None:
    """Why llama.cpp cannot run here, or None: the bindings, and the GGUF converter their sdist vendors (`make
    peers` builds the one and unpacks the other into build/peers)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed: `make peers` builds it (it compiles llama.cpp: long on few cores)"
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:  # installed without what it needs (a wheel installed --no-deps)
        return f"llama-cpp-python does not import ({e}): `make peers` installs it with its dependencies"
    if not (source / "convert_hf_to_gguf.py").is_file():
        return f"no llama.cpp GGUF converter in {source}: `make peers` unpacks it from the llama-cpp-python sdist"
    return None


def llama_cpp_precision(dtype: str, quant: str | None) -> tuple[str | None, str]:
    """(the GGUF converter's --outtype for our rows' precision, or None where it has none; in words)."""
    if quant is not None:
        return ("q8_0", "Q8_0") if quant.startswith("int8") else (None, f"our {quant} variant")
    return {"float32": ("f32", "f32"), "float16": ("f16", "f16"), "bfloat16": ("bf16", "bf16")}.get(dtype, (None, dtype))


def ort_genai_precision(dtype: str, quant: str | None) -> tuple[str | None, str]:
    """(the model builder's -p for our rows' precision, or None where it has none on the CPU; in words)."""
    if quant is not None:
        return ("int8", "int8 weights") if quant.startswith("int8") else (None, f"our {quant} variant")
    return ("fp32", "fp32") if dtype == "float32" else (None, dtype)


def _staged_source(bundle: Path, role: str, dest: Path) -> Path:
    """A directory the model builder reads as one checkpoint: the bundle's hf/<role> and its tokenizer, linked."""
    dest.mkdir(parents=True)
    for src in [*(bundle / "hf" / role).iterdir(), *(bundle / "tokenizer").iterdir()]:
        os.symlink(src.resolve(), dest / src.name)
    return dest


def _convert(bundle: Path, role: str, work: Path, command, made: str, dest: Path, failed: str,
             proof: str | None = None) -> None:
    """Run a peer's converter, `command(staged checkpoint, output path)`, on the bundle's hf/<role> staged in `work`,
    and move its output `work/made` (done where it has the file `proof`, else where it is a file) to `dest`: whole or
    not at all, `work` removed whatever happens; `failed` begins the error where it fails."""
    shutil.rmtree(work, ignore_errors=True)
    try:
        output = work / made
        r = subprocess.run(command(_staged_source(bundle, role, work / "src"), output), capture_output=True, text=True)
        done = (output / proof).is_file() if proof else output.is_file()
        if r.returncode != 0 or not done:
            tail = [line for line in (r.stderr or r.stdout).strip().splitlines() if line.strip()][-1:] or ["no output"]
            raise SpecrtError(f"{failed}: {tail[0]}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if output.is_dir():
            replace_dir(output, dest)
        else:
            commit(output, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ort_genai_models(bundle: Path, cache: Path, precision: str, progress: bool = True) -> dict[str, Path]:
    """{role: ORT GenAI model directory} of the bundle's target and draft at `precision`, converted once by the
    model builder (bench/ort_genai_builder.py) and cached under `cache`."""
    from tqdm import tqdm

    root = cache / f"ort-genai-{manifest_sha256(bundle)[:16]}-{precision}"
    out = {role: root / role for role in ("target", "draft")}
    todo = [role for role, d in out.items() if not (d / "genai_config.json").is_file()]
    for role in tqdm(todo, desc=f"ORT GenAI model builder ({precision})", unit="model", disable=not progress or not todo):
        src = bundle / "hf" / role
        _convert(bundle, role, root / f".{role}.tmp", lambda staged, made: [
            sys.executable, "-m", "specrt.bench.ort_genai_builder", "-i", str(staged), "-o", str(made),
            "-p", precision, "-e", "cpu", "-c", str(made.parent / "cache")],
            "model", out[role], f"ONNX Runtime GenAI's model builder could not convert {src} ({precision})",
            proof="genai_config.json")
    return out


def llama_cpp_model(bundle: Path, cache: Path, source: Path, outtype: str, progress: bool = True,
                    role: str = "target") -> Path:
    """The GGUF file of the bundle's `role` (target or draft) at `outtype`, converted once by llama.cpp's converter
    (bench.gguf_convert, from `source`) and cached under `cache`."""
    from tqdm import tqdm

    out = cache / f"llama-cpp-{manifest_sha256(bundle)[:16]}-{outtype}" / f"{role}.gguf"
    if out.is_file():
        return out
    with tqdm(total=1, desc=f"llama.cpp GGUF converter ({role}, {outtype})", unit="model", disable=not progress):
        _convert(bundle, role, out.parent / f".{role}.tmp", lambda staged, made: [
            sys.executable, "-m", "specrt.bench.gguf_convert", str(source), str(staged), str(made), outtype],
            f"{role}.gguf", out,
            f"llama.cpp's GGUF converter could not convert {bundle / 'hf' / role} ({outtype})")
    return out


def _llama_draft_model():
    """The class of llama-cpp-python's drafter backed by a draft model (made on first use: llama_cpp is optional)."""
    from llama_cpp import Llama, llama_get_logits_ith
    from llama_cpp.llama_speculative import LlamaDraftModel

    class LlamaModelDraft(LlamaDraftModel):
        """A draft model's greedy continuation as llama-cpp-python's drafter (its `Llama(draft_model=...)` hook; the
        bindings ship only a prompt-lookup one): called with the text so far, it returns up to `num_tokens` tokens,
        each the argmax of the draft's last logits (llama.h's llama_get_logits_ith, as its greedy sampler picks).
        Its own KV cache keeps the longest prefix it shares with that text, as llama.cpp's speculative example keeps
        the draft's."""

        def __init__(self, gguf: Path, threads: int, context: int, num_tokens: int):
            self.llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                             verbose=False)
            self.num_tokens, self.context, self.vocab = num_tokens, context, self.llm.n_vocab()

        def reset(self) -> None:
            self.llm.reset()

        def __call__(self, input_ids, /, **kwargs):
            import numpy as np

            ids = np.asarray(input_ids, dtype=np.intc)
            held = self.llm.input_ids[:min(self.llm.n_tokens, len(ids) - 1)]
            differ = np.flatnonzero(held != ids[:len(held)])
            self.llm.n_tokens = int(differ[0]) if len(differ) else len(held)  # eval drops the cache from here on
            self.llm.eval(ids[self.llm.n_tokens:].tolist())
            out, n = [], min(self.num_tokens, self.context - len(ids))  # no more than its context holds
            for i in range(n):
                out.append(int(np.ctypeslib.as_array(llama_get_logits_ith(self.llm.ctx, -1), (self.vocab,)).argmax()))
                if i + 1 < n:
                    self.llm.eval(out[-1:])
            return np.asarray(out, dtype=np.intc)

    return LlamaModelDraft


class LlamaCpp:
    """llama.cpp (llama-cpp-python) decoding one prompt at a time, greedily: alone, with its prompt lookup drafts
    (LlamaPromptLookupDecoding), or with a draft model's (`ggufs["draft"]`, drafting `draft_tokens` a round). Each
    prompt starts from empty KV caches: no prefix of an earlier call is reused."""

    def __init__(self, ggufs: dict[str, Path], mode: str, encode, threads: int, max_new_tokens: int, context: int,
                 draft_tokens: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = None
        if mode == "lookup":
            draft = LlamaPromptLookupDecoding(LOOKUP_NGRAM, draft_tokens)
        elif mode == "sd":
            draft = _llama_draft_model()(ggufs["draft"], threads, context, draft_tokens)
        self.llm = Llama(model_path=str(ggufs["target"]), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, verbose=False)
        self.resets = [self.llm.reset] + ([draft.reset] if mode == "sd" else [])
        self.encode, self.max_new_tokens, self.eos = encode, max_new_tokens, self.llm.token_eos()

    def __call__(self, prompts) -> Decoded:
        def one(p, clock):
            out = []
            for reset in self.resets:
                reset()
            for token in self.llm.generate(self.encode(p), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                           repeat_penalty=1.0):
                clock.token()
                out.append(int(token))
                if token == self.eos or len(out) == self.max_new_tokens:
                    break
            return out

        outs, first_s, decode_s = timed(prompts, one)
        return Decoded(outs, first_s=first_s, decode_s=decode_s)


class LlamaCppStep:
    """llama.cpp's step as `specrt profile` times ours (calibration.latency.step_times): T new tokens after `context`
    cached ones, the logits of every row computed (as a verification step needs them), the cache rolled back to the
    context after each step. The context is random token ids: contents do not change the cost."""

    def __init__(self, gguf: Path, threads: int, context: int, max_tokens: int, vocab_size: int):
        import numpy as np
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=context + max_tokens, n_batch=max(context, max_tokens, 1),
                         n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
        self.rng, self.vocab, self.context = np.random.default_rng(0), vocab_size, context
        self.llm.reset()
        if context:
            self.llm.eval(self._tokens(context))

    def _tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab, n)]

    def times(self, num_tokens: int, repeats: int, warmup: int) -> list[float]:
        """Seconds of `repeats` steps of `num_tokens` tokens after `warmup` untimed ones."""
        out = []
        for i in range(warmup + repeats):
            tokens = self._tokens(num_tokens)
            self.llm.n_tokens = self.context  # eval drops the cache from here on, then appends the step's rows
            t0 = time.perf_counter()
            self.llm.eval(tokens)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out


def llama_cpp_step(bundle: Path, sources: PeerSources, dtype: str, quant: str | None, threads: int, context: int,
                   max_tokens: int, vocab_size: int) -> tuple[str, LlamaCppStep]:
    """(its row name, llama.cpp's step) of the bundle's target at the precision matching ours; SpecrtError saying
    why where it cannot run here."""
    outtype, words = llama_cpp_precision(dtype, quant)
    why = llama_cpp_missing(sources.llama_cpp_source)
    if why or outtype is None:
        raise SpecrtError(why or f"llama.cpp has no precision matching {words}")
    gguf = llama_cpp_model(bundle, sources.peer_cache, sources.llama_cpp_source, outtype)
    return f"llama.cpp ({words})", LlamaCppStep(gguf, threads, context, max_tokens, vocab_size)


class OrtGenAI:
    """ONNX Runtime GenAI decoding one prompt at a time, greedily: alone, with a draft model, or with n-gram lookup.
    Called as e2e's runners are: prompts -> Decoded."""

    def __init__(self, models: dict[str, Path], mode: str, encode, threads: int, max_new_tokens: int,
                 draft_tokens: int, eos: int | None = None):
        import onnxruntime_genai as og

        self.og, self.encode, self.max_new_tokens, self.eos = og, encode, max_new_tokens, eos
        config = og.Config(str(models["target"]))
        session = {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}
        overlay: dict = {"model": {"decoder": session}}
        if mode == "sd":
            draft = json.loads((models["draft"] / "genai_config.json").read_text())["model"]["decoder"]
            draft["filename"] = os.path.relpath(models["draft"] / draft["filename"], models["target"])
            overlay["model"]["draft"] = {**draft, **session}
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)
        # a model with sliding-window layers (Gemma 3) needs a cache of at least its window: its length is then no
        # longer where the decode stops, the count of new tokens is
        decoder = json.loads((models["target"] / "genai_config.json").read_text())["model"]["decoder"]
        self.window = (decoder.get("sliding_window") or {}).get("window_size", 0)
        self.speculative = {"sd": {"max_draft_tokens": draft_tokens},
                            "ngram": {"ngram_size": NGRAM_SIZE, "max_draft_tokens": draft_tokens}}.get(mode)

    def __call__(self, prompts) -> Decoded:
        def one(p, clock):
            ids = self.encode(p)
            params = self.og.GeneratorParams(self.model)
            length = len(ids) + self.max_new_tokens
            params.set_search_options(max_length=max(length, self.window), do_sample=False)
            if self.speculative:
                params.set_speculative_options(**self.speculative)
            generator = self.og.Generator(self.model, params)
            generator.append_tokens(ids)
            while not generator.is_done():
                generator.generate_next_token()
                clock.token()
                if length < self.window and len(generator.get_sequence(0)) >= length:
                    break
            out = [int(t) for t in generator.get_sequence(0)[len(ids):length]]
            # its sequence leaves out the end token it stopped at, which ours keep (and which it generated and was
            # timed for): the same answer, counted alike
            if self.eos is not None and len(out) < self.max_new_tokens and (not out or out[-1] != self.eos):
                out.append(self.eos)
            return out

        outs, first_s, decode_s = timed(prompts, one)
        return Decoded(outs, first_s=first_s, decode_s=decode_s)


def gguf_file_type(path: Path) -> str:
    """A GGUF file's weight type as llama.cpp names it (Q4_1, Q4_K_M, F32, ...), from its metadata."""
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields["general.file_type"]
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except (ImportError, KeyError, ValueError):
        return path.name


def peer_runners(cfg, pipe, names) -> tuple[dict, dict]:
    """({row name: runner}, {skipped peer: why}) of the peers `names` for e2e's config and loaded Pipeline, and the
    llama.cpp row on the original GGUF where the config names one."""
    runners, skipped = {}, {}
    if getattr(cfg, "original_gguf", None) is not None:
        why = _why_not(llama_cpp_missing(cfg.llama_cpp_source), "as shipped", "", "llama.cpp", pipe)
        if not Path(cfg.original_gguf).is_file():
            why = f"no GGUF file at {cfg.original_gguf}"
        name = f"llama-cpp-gguf ({gguf_file_type(Path(cfg.original_gguf))}, as shipped)"
        if why:
            skipped[name] = why
        else:
            runners[name] = LlamaCpp({"target": Path(cfg.original_gguf)}, "ar", pipe.encode, pipe.machine.threads,
                                     cfg.max_new_tokens, pipe.max_context, 0)
    for build, family in ((_ort_genai_runners, ORT_GENAI), (_llama_cpp_runners, LLAMA_CPP)):
        wanted = [n for n in names if n in family]
        if wanted:
            made, why = build(cfg, pipe, wanted)
            runners.update(made)
            skipped.update({n: why for n in wanted} if why else {})
    return runners, skipped


def _why_not(missing: str | None, precision: str | None, words: str, what: str, pipe) -> str | None:
    """Why a peer cannot run beside this bench's rows: not installed, no precision matching ours, or another device."""
    if missing:
        return missing
    if precision is None:
        return f"{what} has no CPU precision matching {words}"
    if not pipe.machine.device.startswith("cpu"):
        return f"{what} runs on the CPU here (the PyPI wheel, the `make peers` build)"
    return None


def _ort_genai_runners(cfg, pipe, wanted: list[str]) -> tuple[dict, str | None]:
    precision, words = ort_genai_precision(pipe.target.entry.dtype, pipe.machine.quant)
    why = _why_not(ort_genai_missing(), precision, words, "ONNX Runtime GenAI", pipe)
    if why:
        return {}, why
    models = ort_genai_models(cfg.bundle, cfg.peer_cache, precision)
    runners = {}
    for name in wanted:
        mode = name.removeprefix("ort-genai").lstrip("-") or "ar"
        draft_tokens = cfg.num_draft_tokens[0] if mode == "sd" else cfg.prompt_lookup_tokens
        runners[f"{name} ({words})"] = OrtGenAI(models, mode, pipe.encode, pipe.machine.threads, cfg.max_new_tokens,
                                                draft_tokens, pipe.manifest.eos_token_id)
    return runners, None


def _llama_cpp_runners(cfg, pipe, wanted: list[str]) -> tuple[dict, str | None]:
    outtype, words = llama_cpp_precision(pipe.target.entry.dtype, pipe.machine.quant)
    why = _why_not(llama_cpp_missing(cfg.llama_cpp_source), outtype, words, "llama.cpp", pipe)
    if why:
        return {}, why
    roles = ("target", "draft") if "llama-cpp-sd" in wanted else ("target",)
    ggufs = {role: llama_cpp_model(cfg.bundle, cfg.peer_cache, cfg.llama_cpp_source, outtype, role=role)
             for role in roles}
    runners = {}
    for name in wanted:
        mode = name.removeprefix("llama-cpp").lstrip("-") or "ar"
        draft_tokens = cfg.num_draft_tokens[0] if mode == "sd" else cfg.prompt_lookup_tokens
        runners[f"{name} ({words})"] = LlamaCpp(ggufs, mode, pipe.encode, pipe.machine.threads, cfg.max_new_tokens,
                                                pipe.max_context, draft_tokens)
    return runners, None


PEER_FAMILIES = {"ort-genai": ("ONNX Runtime GenAI", ORT_GENAI), "llama-cpp": ("llama.cpp", LLAMA_CPP)}


def peer_summary(rows: list[dict], ours_ar: dict | None, ours_best: dict | None) -> dict:
    """{"peers": {family: ...}}: each peer's autoregressive row and fastest speculative row of this run against our
    autoregressive and our fastest lossless row (e2e's rows; ours as bench.report.best_lossless picks them), as
    ratios of tokens/s from the one run (bench.report.paired_ratio: the median of the ratios within each timed run);
    {} where no peer ran."""
    by_name = {r["method"]: r for r in rows}
    out = {}
    for family, (title, names) in PEER_FAMILIES.items():
        mine = [r for r in rows if r["method"].split()[0] in names]
        ar = next((r for r in mine if r["method"].split()[0] == family), None)
        spec = max((r for r in mine if r is not ar), key=lambda r: r["tokens_per_s"], default=None)
        if ar is None and spec is None:
            continue
        entry: dict = {"title": title, "ar": ar and ar["method"], "best": spec and spec["method"]}
        for key, theirs in (("ar", ar), ("best", spec)):
            for ours_key, ours in (("our_ar", ours_ar), ("our_best", ours_best)):
                if theirs and ours:
                    ours_row = by_name[ours["name"]]
                    rates = [runs_rate(r["runs_s"], r["tokens"]) for r in (ours_row, theirs)]
                    entry[f"{ours_key}_vs_its_{key}"] = round(paired_ratio(*rates), 3)
        entry["ours"] = {"ar": ours_ar and ours_ar["name"], "best": ours_best and ours_best["name"]}
        entry["same_tokens_as_ours_ar"] = {r["method"]: r["same_tokens_as_ours_ar"] for r in mine}
        out[family] = entry
    return {"peers": out} if out else {}


def peer_lines(summary: dict) -> list[str]:
    """The run's peer comparison in words, a line per peer."""
    lines = []
    for e in summary.get("peers", {}).values():
        parts = []
        if e.get("our_ar_vs_its_ar") is not None:
            parts.append(f"our AR {e['our_ar_vs_its_ar']:.2f}x its AR (`{e['ar']}`)")
        if e.get("our_best_vs_its_best") is not None:
            parts.append(f"our best lossless (`{e['ours']['best']}`) {e['our_best_vs_its_best']:.2f}x its best "
                         f"speculative (`{e['best']}`)")
        if e.get("our_best_vs_its_ar") is not None:
            parts.append(f"{e['our_best_vs_its_ar']:.2f}x its AR")
        lines.append(f"vs {e['title']} (same run): " + ", ".join(parts))
    return lines

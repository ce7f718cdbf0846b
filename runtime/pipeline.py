"""Pipeline: the embedded API.

    from specrt import Pipeline
    pipe = Pipeline.load("build/demo")                       # ONNX Runtime on the CPU
    out = pipe.generate(["def add(a, b):"], method="sd", max_new_tokens=64)
    out[0].text, out[0].token_ids, out[0].stats
    for piece in pipe.stream("def add(a, b):"): print(piece, end="")
    pipe.chat([{"role": "user", "content": "Hi"}]).text      # through the tokenizer's chat template (specrt/chat.py)
    with pipe.server(method="sd", max_batch=8) as server:    # requests arriving over time (runtime/server.py)
        request = server.submit("def add(a, b):", max_new_tokens=64)
        request.result().text

Methods (runtime/methods.py, `METHODS`) are Drafter + Verifier pairs run by the one Scheduler; each
method takes its own options as keyword arguments, and refuses, by name, options it does not take.
Greedy when temperature == 0, lossless rejection sampling otherwise (MTAD: beam sampling, not lossless).

A Pipeline is safe to use from several threads at once: the loaded models (Backends) are shared, and
each generate / stream call drafts and verifies with its own runners, KV caches and buffers.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.bundle.machine import Machine
from specrt.bundle.manifest import Manifest
from specrt.errors import InvalidRequestError
from specrt.runtime.backends import Backend
from specrt.runtime.detokenize import TextStream
from specrt.runtime.evidence import Evidence
from specrt.runtime.methods import Method, MethodContext, make_method
from specrt.runtime.options import DecodeOptions
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import Scheduler, SeqState
from specrt.runtime.stats import Stats

if TYPE_CHECKING:
    from specrt.runtime.server import Server


@dataclass
class Generation:
    text: str  # decoded new tokens (special tokens skipped)
    token_ids: list[int]  # new tokens only (EOS included when generation stopped at it)
    finish_reason: str  # "eos" or "length"
    prompt_tokens: int
    stats: Stats  # calls, accepted-length histogram, per-stage seconds (stats.as_dict() for JSON)


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _is_token_ids(p) -> bool:
    if isinstance(p, np.ndarray):
        return p.ndim == 1 and np.issubdtype(p.dtype, np.integer)
    return isinstance(p, (list, tuple)) and all(_is_token_id(t) for t in p)


class Pipeline:
    def __init__(self, bundle: Path, manifest: Manifest, tokenizer, target: Backend, draft: Backend, machine: Machine,
                 bucket: int = 128):
        self.bundle = Path(bundle)
        self.manifest = manifest
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.target = target  # Backend (shared; each call makes its own Runner)
        self.draft = draft
        self.machine = machine  # where this pipeline runs: backend, threads, device (artifacts are checked against it)
        self.evidence = Evidence(self.bundle, machine)  # its plan, latency profile and acceptance on this machine
        self.eos_id = manifest.eos_token_id
        self.bucket = bucket
        self.max_context = min(target.max_context, draft.max_context)
        self.prompt_tokens = None  # PPD's PromptTokens when the target backend holds them (`specrt ppd train`)
        self._chat_template = None  # specrt.chat.ChatTemplate, read on first use
        self.prompt_tokens_refused = f"{self.bundle} has no PPD prompt tokens: run `specrt ppd train --bundle {self.bundle}`"

    @classmethod
    def load(cls, bundle: str | Path, backend: str = "ort", threads: int | None = None, device: str | None = None,
             verify: bool | str = True, quant: str | None = None, kv_update: str = "runtime",
             packed_rows: bool = True) -> "Pipeline":
        """Open a bundle made by `specrt export`; `verify` checks its files against the manifest's sha256: True hashes
        those not hashed before as the same file (bundle/manifest.py: .verified.json), "full" every one, False none.

        threads: intra-op threads (default: every core this process may use); device: "cpu" or "cuda[:N]"
        (torch backend: default CUDA where present; static and trt: default the device the engines were built for);
        quant: a quantized variant of the step graphs (`specrt quantize`, e.g. "int8-weights"; ort backend): the
        models it has a variant for run it, the others their exported graph; "plan": the variant plan.json picked
        (`specrt tune --variants`), None: the exported graphs; kv_update: "runtime" (the exported
        graphs return new K/V, the runtime writes the accepted rows) or "inplace" (`specrt inplace`'s variants write
        them into the cache in place; ort backend, and trt engines built with --kv-update inplace); packed_rows (ort
        backend): a ragged batch's holes are left out of the step's token-wise work (graphs/packed_rows.py); False saves the
        packing's gathers where sequences are decoded one at a time (docs/batching.md), and its
        latency profile and plan are then this setting's own (Machine.packed_rows)."""
        from specrt.runtime.loader import resolve

        r = resolve(bundle, backend=backend, threads=threads, device=device, verify=verify, quant=quant,
                    kv_update=kv_update, packed_rows=packed_rows)
        pipe = cls(r.bundle, r.manifest, r.tokenizer, r.load_model("target"), r.load_model("draft"), machine=r.machine)
        pipe.prompt_tokens, pipe.prompt_tokens_refused = r.prompt_tokens, r.prompt_tokens_refused
        return pipe

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of one prompt: a string, or a sequence of token ids in [0, vocab)."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: the tokenizer would raise a bare TypeError
                raise InvalidRequestError(f"the prompt is not valid Unicode text: {e.reason} at character {e.start} "
                                          f"({prompt[e.start:e.end]!r})", fields=("prompt",)) from None
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        elif _is_token_ids(prompt):
            ids = [int(t) for t in prompt]
            vocab = self.target.entry.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}), got {bad}", fields=("prompt",))
        else:
            bad = next((t for t in prompt if not _is_token_id(t)), None) if isinstance(prompt, (list, tuple)) else None
            what = f"a sequence holding {bad!r}" if bad is not None else type(prompt).__name__
            raise InvalidRequestError(f"a prompt must be a string or a sequence of integer token ids, got {what}",
                                      fields=("prompt",))
        if not ids:
            raise InvalidRequestError("empty prompt: give at least one token", fields=("prompt",))
        return ids

    def _prompts(self, prompts) -> tuple[list, bool]:
        """(list of prompts, whether a single prompt was given)."""
        if isinstance(prompts, str):
            return [prompts], True
        if _is_token_ids(prompts) and len(prompts):
            raise InvalidRequestError("prompts is a flat sequence of token ids: pass [ids] for one token-id prompt")
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string or a list of prompts (strings or token-id lists), "
                                      f"got {type(prompts).__name__}")
        if not prompts:
            raise InvalidRequestError("no prompts given")
        return list(prompts), False

    def method_context(self) -> MethodContext:
        """What a method's builder may use: the draft model, the cache bucket, the evidence, PPD's prompt tokens."""
        return MethodContext(self.draft, self.bucket, self.evidence, self.prompt_tokens, self.prompt_tokens_refused)

    def scheduler(self, method: str, options: dict, params: SamplingParams, batch_size: int,
                  padded: bool = False) -> tuple[Scheduler, int]:
        """(a scheduler with its own runners, drafter and verifier; the context slots a round may use beyond the
        text) for one call or server: its caller closes it."""
        m: Method = make_method(method, options)
        built = m.build(self.method_context(), params, batch_size)
        try:
            return Scheduler(self.target.runner(), built.drafter, built.verifier, self.eos_id, self.bucket,
                             padded), built.slack
        except BaseException:
            if built.drafter is not None:
                built.drafter.close()
            raise

    def _prepare(self, method: str, options: dict, params: SamplingParams, decode: DecodeOptions, prompts: list,
                 per_prompt: list[int] | None = None):
        """(scheduler, sequences) for one call (its runners given back again if the prompts are refused)."""
        scheduler, slack = self.scheduler(method, options, params, decode.batch_size, decode.padded)
        try:
            return scheduler, self.sequences(prompts, per_prompt or [decode.max_new_tokens] * len(prompts), slack)
        except BaseException:
            scheduler.close()
            raise

    def sequences(self, prompts, max_new_tokens: list[int], slack: int) -> list[SeqState]:
        """One SeqState per prompt, each checked (InvalidRequestError, its `fields` naming the inputs at fault) against
        its limit and the context that `slack` draft slots leave."""
        seqs = []
        for i, (p, max_new_tokens) in enumerate(zip(prompts, max_new_tokens)):
            DecodeOptions(max_new_tokens)  # each limit checked as one
            ids = self.encode(p)
            need = len(ids) + max_new_tokens + slack
            if need > self.max_context:
                raise InvalidRequestError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} and {slack} draft slots "
                    f"it needs {need} positions, more than the context of {self.max_context}",
                    fields=("prompt", "max_new_tokens"))
            seqs.append(SeqState(i, ids, max_new_tokens, slack))
        return seqs

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], method: str = "sd",
                 max_new_tokens: int | Sequence[int] = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, batch_size: int = 1, batching: str = "continuous", padded: bool = False,
                 progress: bool = False, **options):
        """Generate for each prompt (a string or token ids); a single string returns one Generation.

        `options` are the method's own (see METHODS[method].option_names(), e.g. num_draft_tokens for sd);
        an option the method does not take is refused by name. Up to `batch_size` prompts are decoded at once
        in one ragged batch (no KV padding); with `batching="continuous"` a finished sequence's place goes to
        the next prompt between rounds, with "static" each batch runs until its last sequence ends. `padded`
        (benchmarking only) pads every sequence's KV cache to the batch's longest, as vanilla batched speculative
        decoding does (DecodeOptions.padded). `max_new_tokens` is one limit for every prompt, or a list of one
        per prompt."""
        prompts, single = self._prompts(prompts)
        params = SamplingParams(temperature, top_k, top_p)
        per_prompt = None
        if isinstance(max_new_tokens, (list, tuple)):
            if len(max_new_tokens) != len(prompts):
                raise InvalidRequestError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts")
            for m in max_new_tokens:
                DecodeOptions(m)  # each checked as one limit
            per_prompt, max_new_tokens = list(max_new_tokens), max(max_new_tokens)
        decode = DecodeOptions(max_new_tokens, seed, batch_size, batching, padded)
        if not isinstance(progress, bool):
            raise InvalidRequestError(f"progress must be True or False, got {progress!r}")
        scheduler, seqs = self._prepare(method, options, params, decode, prompts, per_prompt)
        rng = np.random.default_rng(seed)
        continuous = batching == "continuous"
        batches = [seqs] if continuous else [seqs[i:i + batch_size] for i in range(0, len(seqs), batch_size)]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(seqs), desc=method, unit="prompt")
        started = time.perf_counter()  # every request's latency counts from here, whichever batch it waits for
        try:
            for batch in batches:
                for s, _ in scheduler.run(batch, params, rng, max_batch=batch_size, started=started):
                    if bar is not None and s.finished:
                        bar.update()
        finally:
            scheduler.close()
            if bar is not None:
                bar.close()
        results = [self.generation(s) for s in seqs]
        return results[0] if single else results

    def chat_prompt(self, messages) -> str:
        """The prompt text of a conversation (dicts of role and content) through the bundle tokenizer's chat template,
        the assistant's turn opened; raises NoChatTemplate where the tokenizer has none."""
        from specrt.chat import ChatTemplate

        if self._chat_template is None:
            self._chat_template = ChatTemplate.of(self.bundle / self.manifest.tokenizer)
        return self._chat_template.render(messages)

    def chat(self, messages, method: str = "sd", **kwargs) -> Generation:
        """The assistant's reply to one conversation: generate (its keyword arguments) on chat_prompt(messages)."""
        return self.generate(self.chat_prompt(messages), method=method, **kwargs)

    def stream(self, prompt: str | Sequence[int], method: str = "sd", max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, **options) -> Iterator[str]:
        """Yield text pieces of one prompt's continuation as rounds are accepted (options: as generate).

        Arguments are checked when this is called, before the first piece is asked for."""
        if not (isinstance(prompt, str) or _is_token_ids(prompt)):
            n = len(prompt) if isinstance(prompt, (list, tuple)) else None
            what = f"a list of {n} prompts" if n is not None else type(prompt).__name__
            raise InvalidRequestError(f"stream takes one prompt (a string or token ids), got {what}: "
                                      "call it once per prompt, or use generate")
        params = SamplingParams(temperature, top_k, top_p)
        decode = DecodeOptions(max_new_tokens, seed, 1)
        scheduler, (seq,) = self._prepare(method, options, params, decode, [prompt])
        return self._stream(scheduler, seq, params, seed)

    def _stream(self, scheduler: Scheduler, seq: SeqState, params: SamplingParams, seed: int) -> Iterator[str]:
        """(An abandoned stream gives its runners back when it is garbage collected.)"""
        text = TextStream(self.decode)
        try:
            for _ in scheduler.run([seq], params, np.random.default_rng(seed)):
                piece = text.add(seq.new_tokens[len(text.ids):])
                if piece:
                    yield piece
        finally:
            scheduler.close()
        piece = text.add(seq.new_tokens[len(text.ids):], final=True)
        if piece:
            yield piece

    def server(self, method: str = "sd", max_batch: int = 8, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, sampling: SamplingParams | None = None, **options) -> Server:
        """A Server decoding requests submitted over time (`server.submit(prompt, max_new_tokens)`) in one
        continuously batched loop of up to `max_batch` sequences, on a thread of its own, with this method and
        these sampling parameters (`sampling`, or temperature, top_k and top_p) (runtime/server.py). Close it (or
        use it as a context manager) to give its runners back."""
        from specrt.runtime.server import Server

        DecodeOptions(seed=seed, batch_size=max_batch)  # checked as generate checks them
        params = SamplingParams(temperature, top_k, top_p) if sampling is None else sampling
        return Server(self, method, max_batch, params, seed, options)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def generation(self, s: SeqState) -> Generation:
        """What a finished sequence gives its caller."""
        ids = [int(t) for t in s.new_tokens]
        return Generation(self.decode(ids), ids, s.finish_reason, s.prompt_len, s.stats)

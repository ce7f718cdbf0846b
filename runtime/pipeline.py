"""Pipeline: the embedded API.

    pipe = Pipeline.load("build/demo")                       # ONNX Runtime on the CPU
    out = pipe.generate(["def add(a, b):"], method="sd", max_new_tokens=64)
    out[0].text, out[0].token_ids, out[0].stats
    for piece in pipe.stream("def add(a, b):"): print(piece, end="")

Methods are (drafter, verifier) pairs run by the one Scheduler: "autoregressive" has no drafter, "sd"
drafts a chain of `num_draft_tokens` with the draft model, "tree" fills a static token tree (`tree=`
paths of child ranks; default: the tuned plan's best tree, else DEFAULT_TREE) and verifies the whole
tree in one target step; "auto" does what the bundle's plan.json says for the batch size (a tree, a
chain, or no speculation); "dynamic" verifies the `num_draft_tokens` (default 8) likeliest nodes of
the draft's beam search, a tree shaped anew every round (EAGLE-2); "anpd" drafts up to
`num_draft_tokens` (default 7) tokens from a multi-level n-gram memory (orders 2..`ngram_n`, default
5) of the prompt and the text so far, with no model (`ngram_branches=b` > 1: a best-first tree with up
to b continuations per node; `ngram_min_prob`: no token estimated less likely); "mtad" drafts
`num_beams` beams of `num_draft_tokens` tokens with the draft model and accepts the longest prefix of
the best beam whose joint likelihood ratio min(1, p/q) exceeds `tau` (MJSD when greedy; not lossless
by design); `verify_beams=k` verifies the top k beams as one tree instead. With `ngram_tokens=k`, sd,
tree and dynamic also draft up to k tokens from an ANPD n-gram memory and verify the union of both
drafts as one tree (MergedDrafter). Greedy when temperature == 0, lossless rejection sampling otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import BundleError, InvalidRequestError
from specrt.manifest import load_manifest, model_entry
from specrt.runtime.backends import BACKENDS, load_backend
from specrt.runtime.methods import MethodConfig
from specrt.runtime.methods import build as build_method
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import Scheduler, SeqState

@dataclass
class Generation:
    text: str  # decoded new tokens (special tokens skipped)
    token_ids: list[int]  # new tokens only (EOS included when generation stopped at it)
    finish_reason: str  # "eos" or "length"
    prompt_tokens: int
    stats: dict  # Stats.as_dict(): calls, accepted-length histogram, per-stage seconds


class Pipeline:
    def __init__(self, bundle: Path, manifest: dict, tokenizer, target, draft, bucket: int = 128,
                 backend: str = "ort", threads: int | None = None, device: str | None = None):
        self.bundle = bundle
        self.manifest = manifest
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.target = target  # Backend
        self.draft = draft  # Backend
        self.eos_id = manifest.get("eos_token_id")
        self.bucket = bucket
        self.max_context = min(target.entry.max_positions, draft.entry.max_positions)
        self.backend_name, self.threads, self.device = backend, threads, device

    @classmethod
    def load(cls, bundle: str | Path, backend: str = "ort", threads: int | None = None, device: str | None = None,
             verify: bool = True) -> "Pipeline":
        """Open a bundle made by `specrt export`; `verify` re-hashes its files against the manifest."""
        from tokenizers import Tokenizer

        if backend not in BACKENDS:
            raise InvalidRequestError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
        bundle = Path(bundle)
        manifest = load_manifest(bundle, verify=verify)
        tok_file = bundle / manifest["tokenizer"] / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise BundleError(f"cannot read tokenizer {tok_file}: {e}") from None
        models = [load_backend(backend, bundle, model_entry(manifest, role), threads, device) for role in ("target", "draft")]
        return cls(bundle, manifest, tokenizer, *models, backend=backend, threads=threads, device=device)

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            ids = [int(t) for t in prompt]
            vocab = self.target.entry.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if not ids:
            raise InvalidRequestError("empty prompt: give at least one token")
        return ids

    def plan(self) -> dict:
        """The bundle's plan.json, refused unless it was tuned on this machine, backend and export."""
        from specrt.machine import fingerprint
        from specrt.runtime.plan import load_plan

        return load_plan(self.bundle, fingerprint(self.backend_name, self.threads, self.device))

    def _scheduler(self, method: MethodConfig, params: SamplingParams, batch_size: int) -> tuple[Scheduler, int]:
        drafter, verifier, slack = build_method(self, method, params, batch_size)
        return Scheduler(self.target, drafter, verifier, self.eos_id, self.bucket), slack

    def _sequences(self, prompts, max_new_tokens: int, slack: int) -> list[SeqState]:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        seqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p)
            need = len(ids) + max_new_tokens + slack
            if need > self.max_context:
                raise InvalidRequestError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} and {slack} draft slots "
                    f"it needs {need} positions, more than the context of {self.max_context}")
            seqs.append(SeqState(i, ids, max_new_tokens, slack))
        return seqs

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], method: str = "sd",
                 max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, batch_size: int = 1, progress: bool = False, **options):
        """Generate for each prompt (a string or token ids); a single string returns one Generation.

        `options` are the method's (MethodConfig fields: num_draft_tokens, tree, ngram_n, ngram_branches,
        ngram_min_prob, ngram_hardware_aware, ngram_tokens, num_beams, tau, verify_beams, tree_depth,
        draft_temperature); unknown ones are refused by name.
        Prompts are decoded `batch_size` at a time in one ragged batch (no KV padding).
        """
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if batch_size < 1:
            raise InvalidRequestError(f"batch_size must be >= 1, got {batch_size}")
        params = SamplingParams(temperature, top_k, top_p)
        scheduler, slack = self._scheduler(MethodConfig.create(method, options), params, batch_size)
        seqs = self._sequences(prompts, max_new_tokens, slack)
        rng = np.random.default_rng(seed)
        batches = [seqs[i:i + batch_size] for i in range(0, len(seqs), batch_size)]
        if progress:
            from tqdm import tqdm
            batches = tqdm(batches, desc=method, unit="batch")
        for batch in batches:
            for _ in scheduler.run(batch, params, rng):
                pass
        results = [self._result(s) for s in seqs]
        return results[0] if single else results

    def stream(self, prompt: str | Sequence[int], method: str = "sd", max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, **options) -> Iterator[str]:
        """Yield text pieces of one prompt's continuation as rounds are accepted (options: as generate)."""
        params = SamplingParams(temperature, top_k, top_p)
        scheduler, slack = self._scheduler(MethodConfig.create(method, options), params, 1)
        seq = self._sequences([prompt], max_new_tokens, slack)[0]
        shown = ""
        for _ in scheduler.run([seq], params, np.random.default_rng(seed)):
            text = self.decode(seq.new_tokens)
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        text = self.decode(seq.new_tokens)
        if len(text) > len(shown):
            yield text[len(shown):]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def _result(self, s: SeqState) -> Generation:
        ids = [int(t) for t in s.new_tokens]
        return Generation(self.decode(ids), ids, s.finish_reason, s.prompt_len, s.stats.as_dict())

"""`specrt bench e2e`: end-to-end tokens/s of our methods and of Hugging Face / Optimum baselines.

Same prompts (N of HumanEval's or of the chat set, the first N unless --first-prompt says where to start), greedy,
batch 1, same thread count, same checkpoints (the bundle's hf/ copies, on the same device in the bundle's dtype), in
one process. Each run decodes every prompt once
per method, one prompt at a time, the (method, prompt) pairs in a new random order each run, so that drift hits
all of them alike (a method's run is its prompts' seconds summed); we report the median over runs
after an untimed warm-up run (the first pass over new prompt lengths and cache sizes costs ONNX Runtime
about twice as much), and ratios against our own autoregressive measured in the same run. Beside them:
the roofline (bench/hardware.py: measured copy bandwidth / the target's weight bytes) and each row's
fraction of it, on a GPU the energy per token (NVML), and every row's time to first token and time per output
token, taken around each runtime alike (bench/decoded.py). Outputs JSON, Markdown and a PNG.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specrt.bench.decoded import STAGES, Decoded, joined, latencies, stage_seconds, timed
from specrt.bench.e2e_report import OURS, markdown, plot
from specrt.bench.peers import PEERS, PeerSources, peer_runners, peer_summary
from specrt.bench.prompts import PROMPT_SETS, bench_prompts
from specrt.bench.quality import divergence, gap_shift, quantization_ties
from specrt.bench.report import (BenchConfig, best_lossless, header, lossless_headline, paired_ratio, runs_rate,
                                 timed_runs, write_report)
from specrt.bundle.machine import resolve_threads
from specrt.runtime.speculation import MERGE_NGRAM_TOKENS
from specrt.config import option
from specrt.errors import SpecrtError
from specrt.runtime.backends import BackendOptions

# our rows that are a method with options: anpd as the paper sets it (N = 5, K = 7) and beyond it
# (anpd-hw: n-gram trees of 2 continuations per node, up to 16 nodes, each round verifying as many as the
# bundle's latency profile says pay; needs `specrt profile` on this machine); dynamic-ngram: dynamic trees
# of 8 nodes with up to 16 n-gram drafts merged in; sd-ngram (not a default row): a chain of 5 with the same
# n-gram drafts merged in, to tell the n-gram branch's share from the dynamic tree's; dynamic-ngram-hw (not a
# default row): dynamic-ngram with each round's n-gram drafts those that pay on the latency profile, as auto runs them;
# ppd-ngram-hw (not a default row): the same merge behind PPD's tree; -noprior (not default rows): without the
# bundle's n-gram prior
VARIANTS = {"anpd": ("anpd", {}), "dynamic": ("dynamic", {}),
            "dynamic-ngram": ("dynamic", {"ngram_tokens": MERGE_NGRAM_TOKENS}),
            "dynamic-ngram-hw": ("dynamic", {"ngram_tokens": MERGE_NGRAM_TOKENS, "ngram_min_prob": 0.0,
                                             "ngram_hardware_aware": True}),
            "sd-ngram": ("sd", {"num_draft_tokens": 5, "ngram_tokens": MERGE_NGRAM_TOKENS}),
            "ppd-ngram": ("ppd", {"ngram_tokens": MERGE_NGRAM_TOKENS}),
            "ppd-ngram-hw": ("ppd", {"ngram_tokens": MERGE_NGRAM_TOKENS, "ngram_min_prob": 0.0,
                                     "ngram_hardware_aware": True}),
            "anpd-hw": ("anpd", {"ngram_branches": 2, "num_draft_tokens": 16, "ngram_hardware_aware": True}),
            # the same without the bundle's n-gram prior (`specrt ngram prior`): drafts of the text alone
            "anpd-noprior": ("anpd", {"ngram_prior": False}),
            "ppd-ngram-noprior": ("ppd", {"ngram_tokens": MERGE_NGRAM_TOKENS, "ngram_prior": False})}
BASELINES = ("hf", "hf-assisted", "hf-lookup", "hf-compile", "optimum") + PEERS


@dataclass(frozen=True)
class E2EConfig(BenchConfig, BackendOptions, PeerSources):
    num_prompts: int = option(30, "the first N prompts of the set (after --first-prompt)", ge=1)
    first_prompt: int = option(0, "where in the set the prompts start: 5 with --num-prompts 5 benches prompts 5-9",
                               ge=0)
    prompt_set: str = option("humaneval", "humaneval: HumanEval's code prompts; chat: the chat prompts written here "
                                          "(bench/prompts.py), through the bundle tokenizer's chat template",
                             choices=PROMPT_SETS)
    warmup_runs: int = option(1, "untimed full passes over all prompts per row (first passes over new shapes are slower)",
                              ge=0)
    num_draft_tokens: tuple[int, ...] = option((4,), "sd chain lengths, one sd row each", ge=1, nonempty=True)
    methods: tuple[str, ...] = option(OURS, f"our rows: methods or variants ({', '.join(VARIANTS)})")
    baselines: tuple[str, ...] = option(BASELINES, f"baselines: {', '.join(BASELINES)} ('' for none; hf-compile (static "
                                                   "cache + torch.compile) runs on CUDA only, optimum where "
                                                   "optimum-onnx is installed, ort-genai* where onnxruntime-genai is, "
                                                   "llama-cpp* where `make peers` built llama-cpp-python: elsewhere "
                                                   "each is skipped, saying why)")
    prompt_lookup_tokens: int = option(10, "HF prompt lookup's prompt_lookup_num_tokens", ge=1)
    in_graph: tuple[str, ...] = option((), "our rows to run a second time with the in-graph KV update (`specrt "
                                           "inplace`; ort backend), as '<row> (in-graph)', beside the runtime's")

    def __post_init__(self):
        super().__post_init__()
        from specrt.runtime.methods import METHODS

        for m in self.methods:
            if m not in METHODS and m not in VARIANTS:
                raise SpecrtError(f"unknown e2e row {m!r} (methods: {', '.join(METHODS)}; variants: {', '.join(VARIANTS)})")
        for m in self.in_graph:
            if m not in self.methods:
                raise SpecrtError(f"in-graph row {m!r} is not one of this run's rows ({', '.join(self.methods)})")
        for b in self.baselines:
            if b not in BASELINES:
                raise SpecrtError(f"unknown baseline {b!r} (choose from {', '.join(BASELINES)})")


@dataclass
class MethodResult:
    name: str
    seconds: list[float] = field(default_factory=list)  # wall time of each run (all prompts)
    tokens: int = 0  # new tokens per run
    target_calls: int = 0  # target decode steps per run, prefill excluded (ours only)
    stage_seconds: dict | None = None  # the last run's seconds by stage (bench.decoded.STAGES; ours only)
    rows: int = 0  # token rows the target's decode steps verified per run (ours only)
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    joules: list[float] = field(default_factory=list)  # energy of each timed run (GPU, NVML), else empty
    divergence: dict | None = None  # where the outputs leave our AR's (bench.quality.divergence), else None
    ttft_ms: list[float] = field(default_factory=list)  # each timed run's median time to first token (bench.decoded)
    tpot_ms: list[float] = field(default_factory=list)  # each timed run's time per output token after the first

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s


class OurRunner:
    def __init__(self, pipe, method: str, cfg: E2EConfig, **options):
        from specrt.runtime.methods import make_method
        from specrt.runtime.sampling import SamplingParams

        # refuse a bad setting before any run
        built = make_method(method, options).build(pipe.method_context(), SamplingParams(), 1)
        if built.drafter is not None:
            built.drafter.close()  # give its runner back (a static engine's slot)
        self.pipe, self.method, self.cfg, self.options = pipe, method, cfg, options

    def __call__(self, prompts) -> Decoded:
        outs = self.pipe.generate(prompts, method=self.method, max_new_tokens=self.cfg.max_new_tokens, **self.options)
        calls = sum(o.stats.rounds for o in outs)  # decode steps of the target (prefill excluded)
        # one prompt at a time: each starts when the one before it finished (its first and last tokens are timed
        # from the call's start)
        ends = [0.0] + [o.stats.seconds.finished for o in outs]
        return Decoded([o.token_ids for o in outs], calls, stage_seconds(outs),
                       tuple(o.stats.seconds.first - start for o, start in zip(outs, ends)),
                       tuple(o.stats.seconds.finished - o.stats.seconds.first for o in outs),
                       rows=calls + sum(o.stats.drafted for o in outs))


class _HF:
    """HF generate on one prompt at a time; kwargs select plain / assisted / prompt lookup / static cache. A static
    cache is sized once, for the longest prompt (its first call, the warm-up, generates for that prompt first): every
    later prompt reuses that cache (transformers keeps the largest length asked for so far), so the decode step that
    generate compiles for it has one shape and compiles once, not once per prompt length."""

    def __init__(self, model, tokenizer, cfg: E2EConfig, **kwargs):
        self.model, self.tok, self.cfg, self.kwargs = model, tokenizer, cfg, kwargs
        self.sized = kwargs.get("cache_implementation") != "static"

    def __call__(self, prompts) -> Decoded:
        import torch

        if not self.sized:
            self.sized = True
            self([max(prompts, key=lambda p: len(self.tok(p)["input_ids"]))])

        def one(p, clock):
            ids = self.tok(p, return_tensors="pt").to(self.model.device)
            with torch.inference_mode():
                seq = self.model.generate(**ids, do_sample=False, max_new_tokens=self.cfg.max_new_tokens,
                                          pad_token_id=self.tok.eos_token_id, streamer=_Streamer(clock), **self.kwargs)
            # prompt lookup may overshoot max_new_tokens by a few tokens: truncate before comparing
            return seq[0, ids["input_ids"].shape[1]:][: self.cfg.max_new_tokens].tolist()

        outs, first_s, decode_s = timed(prompts, one)
        return Decoded(outs, first_s=first_s, decode_s=decode_s)


class _Streamer:
    """A transformers streamer (BaseStreamer's put/end) that marks a PromptClock at the first new tokens: generate
    puts the prompt first, then the new tokens as they come."""

    def __init__(self, clock):
        self.clock, self.prompt = clock, True

    def put(self, value) -> None:
        if self.prompt:
            self.prompt = False
        else:
            self.clock.token()

    def end(self) -> None:
        pass


def _optimum_model(hf_dir: Path, cache: Path, threads: int):
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    if not (cache / "config.json").is_file():
        model = ORTModelForCausalLM.from_pretrained(hf_dir, export=True, use_cache=True)
        model.save_pretrained(cache)
    return ORTModelForCausalLM.from_pretrained(cache, session_options=so, use_cache=True)


def optimum_missing() -> str | None:
    """Why the Optimum baseline cannot run here, or None."""
    try:
        import optimum.onnxruntime  # noqa: F401
    except ImportError as e:
        return (f"optimum-onnx is not installed ({e}); `pip install 'specrt[optimum]'` adds it where its transformers "
                "pin (< 4.58) can be met")
    return None


def our_runners(cfg: E2EConfig, pipe, methods, suffix: str = "") -> dict:
    """{row name: runner} of our rows `methods` on a loaded Pipeline, each name followed by `suffix`."""
    runners = {}
    for m in methods:
        if m == "sd":
            for g in cfg.num_draft_tokens:
                name = m if len(cfg.num_draft_tokens) == 1 else f"{m} γ={g}"
                runners[name + suffix] = OurRunner(pipe, m, cfg, num_draft_tokens=g)
            continue
        method, options = VARIANTS.get(m, (m, {}))
        runners[m + suffix] = OurRunner(pipe, method, cfg, **options)
    return runners


def build_runners(cfg: E2EConfig, pipe) -> tuple[dict, dict]:
    """({row name: runner}, {skipped baseline: why}) for a loaded Pipeline (and its in-graph twin, if asked)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.runtime.pipeline import Pipeline

    threads, device = pipe.machine.threads, pipe.machine.device
    dtype = getattr(torch, pipe.target.entry.dtype)
    torch.set_num_threads(threads)
    runners = our_runners(cfg, pipe, cfg.methods)
    if cfg.in_graph:
        twin = Pipeline.load(cfg.bundle, **{**cfg.pipeline_options(), "kv_update": "inplace"})
        runners.update(our_runners(cfg, twin, cfg.in_graph, " (in-graph)"))
    peers, skipped = peer_runners(cfg, pipe, cfg.baselines)
    runners.update(peers)
    why = {"optimum": optimum_missing() if "optimum" in cfg.baselines else None,
           "hf-compile": None if device.startswith("cuda") else "static cache + torch.compile is a GPU baseline"}
    skipped.update({name: why[name] for name in cfg.baselines if why.get(name)})
    for name, reason in skipped.items():
        print(f"bench e2e: skipping the {name} baseline: {reason}")
    if not [b for b in cfg.baselines if b not in skipped and b not in PEERS]:
        return runners, skipped

    def load(role):
        return AutoModelForCausalLM.from_pretrained(cfg.bundle / f"hf/{role}", dtype=dtype).eval().to(device)

    tok = AutoTokenizer.from_pretrained(cfg.bundle / "tokenizer")
    target = load("target")
    if "hf" in cfg.baselines:
        runners["hf"] = _HF(target, tok, cfg)
    if "hf-assisted" in cfg.baselines:
        runners["hf-assisted"] = _HF(target, tok, cfg, assistant_model=load("draft"))
    if "hf-lookup" in cfg.baselines:
        runners["hf-lookup"] = _HF(target, tok, cfg, prompt_lookup_num_tokens=cfg.prompt_lookup_tokens)
    if "hf-compile" in cfg.baselines and "hf-compile" not in skipped:
        # HF's recipe: a static cache, whose decode step generate compiles itself (torch.compile, on CUDA); the prefill
        # runs eagerly (compiling the whole forward, the older recipe, compiled it again for every prompt length)
        runners["hf-compile"] = _HF(load("target"), tok, cfg, cache_implementation="static")
    if "optimum" in cfg.baselines and "optimum" not in skipped:
        model = _optimum_model(cfg.bundle / "hf/target", cfg.out.parent / f"optimum-{cfg.label}", threads)
        runners["optimum"] = _HF(model, tok, cfg)
    return runners, skipped


def run_weight_bytes(pipe, role: str = "target") -> int:
    """Bytes of a model's weights that a one-token step reads (the roofline's; an untied input embedding, which a step
    looks up a row of, left out) as `pipe` runs them: on ONNX Runtime, the step graph it loaded (a quantized
    variant's, an in-graph one's, PPD's twin, where one runs); a PyTorch step, its module's tensors (quantized as the
    backend loaded them); else its parameters at the export's dtype."""
    backend = getattr(pipe, role)
    if getattr(backend, "onnx_path", None) is not None:
        from specrt.engines.quantize import graph_bytes

        return graph_bytes(backend.onnx_path, streamed=True)
    if getattr(backend, "module", None) is not None:
        from specrt.model.quant import module_bytes

        return module_bytes(backend.module, streamed=True)
    return backend.entry.num_params * np.dtype(backend.entry.dtype).itemsize


def run_e2e(cfg: E2EConfig) -> dict:
    from specrt.bench.hardware import EnergyMeter
    from specrt.bundle.artifacts.latency import roofline_ms
    from specrt.calibration.latency import copy_bandwidth, profiled_bandwidth
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    prompts = bench_prompts(cfg.prompt_set, cfg.num_prompts, pipe.bundle / pipe.manifest.tokenizer, cfg.first_prompt)
    runners, skipped = build_runners(cfg, pipe)
    weight_bytes = run_weight_bytes(pipe)
    bandwidth = copy_bandwidth(pipe.machine.device, pipe.machine.threads)
    meter, joules = EnergyMeter(pipe.machine.device), {}
    roofline = {"device": pipe.machine.gpu or pipe.machine.device, "weight_bytes": weight_bytes,
                "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "ms_per_token": round(roofline_ms(weight_bytes, bandwidth), 3),
                "tokens_per_s": round(bandwidth / weight_bytes, 1), "energy": meter.why_not or "NVML",
                "compiled": getattr(getattr(pipe.target, "engines", None), "compile", None)}  # static engines' mode
    pages = getattr(pipe.target, "huge_pages", None)  # the ort backend's (huge_pages.py)
    if pages is not None:
        roofline["huge_pages"] = f"{pages.bytes / 2**20:.0f} MiB" if pages.bytes else pages.reason
    profiled = profiled_bandwidth(pipe, bandwidth)
    if profiled:
        roofline["profile_copy_bandwidth_gb_s"] = profiled

    # A run is every row over every prompt, the (row, prompt) pairs in a new random order each run: the machine's
    # drift (minutes of it on a shared VM) then falls on every row alike, not on the rows that ran later in the run.
    pairs = [(name, i) for name in runners for i in range(len(prompts))]
    decoded = {pair: [] for pair in pairs}  # every run's Decoded of each pair, warm-up runs included

    def one(name, i):
        decoded[name, i].append(runners[name]([prompts[i]]))

    def results_of(pair_seconds) -> dict[str, MethodResult]:
        results = {}
        timed = len(next(iter(pair_seconds.values())))
        for name in runners:
            runs = [joined([decoded[name, i][r] for i in range(len(prompts))])
                    for r in range(len(decoded[name, 0]) - timed, len(decoded[name, 0]))]
            lat = [latencies(d) for d in runs]
            seconds = [sum(pair_seconds[name, i][r] for i in range(len(prompts))) for r in range(timed)]
            energy = [sum(joules[name, i][r] for i in range(len(prompts))) for r in range(timed)] \
                if all((name, i) in joules for i in range(len(prompts))) else []
            d = runs[-1]
            results[name] = MethodResult(name, seconds, sum(map(len, d.outputs)), d.target_calls, d.stage_seconds,
                                         d.rows, d.outputs, energy, ttft_ms=[t for t, _ in lat if t is not None],
                                         tpot_ms=[t for _, t in lat if t is not None])
        return results

    def partial(pair_seconds, _):  # after each timed run but the last: what a cut-off run leaves
        report(cfg, results_of(pair_seconds), skipped, roofline,
               partial=f"{len(next(iter(pair_seconds.values())))} of {cfg.runs} timed runs")

    pair_seconds, _ = timed_runs({pair: (lambda pair=pair: one(*pair)) for pair in pairs}, cfg.runs, cfg.warmup_runs,
                                 f"bench e2e {cfg.label}", meter, joules, partial)
    results = results_of(pair_seconds)
    # the speculative rows' ratios move with the machine's state (calibration.latency.same_state): measured again
    # after the runs, the copy bandwidth says whether it changed during them
    roofline["copy_bandwidth_gb_s_after"] = round(copy_bandwidth(pipe.machine.device, pipe.machine.threads) / 1e9, 1)
    if "autoregressive" in results:
        prompt_ids = [pipe.encode(p) for p in prompts]
        ref = results["autoregressive"].outputs
        for r in results.values():
            r.divergence = divergence(pipe, prompt_ids, ref, r.outputs)
            if r.divergence and r.name.startswith("llama-cpp-gguf"):  # the GGUF as shipped: its own 4-bit weights
                r.divergence["other_weights"] = r.name.split("(")[1].split(",")[0]
        quantized = [r for r in results.values() if r.divergence and pipe.machine.quant and r.name.split()[0] in PEERS]
        if quantized:  # peers whose 8-bit weights are their own: judged against what 8-bit weights move here
            floats = Pipeline.load(cfg.bundle, **{**cfg.pipeline_options(), "quant": None})
            shift = gap_shift(floats, pipe, prompt_ids, ref)
            for r in quantized:
                r.divergence = quantization_ties(r.divergence, shift, r.name.split(" (")[-1].rstrip(")"),
                                                 pipe.machine.quant)
    return report(cfg, results, skipped, roofline)


def time_shares(r: MethodResult) -> dict[str, float] | None:
    """Where our row's last timed run spent its wall time: the shares of bench.decoded.STAGES, and `other` (outside
    the rounds); None for a row whose runtime does not say (a baseline)."""
    if not r.stage_seconds or not r.target_calls:
        return None
    wall = r.seconds[-1]
    shares = {k: round(r.stage_seconds[k] / wall, 3) for k in STAGES}
    return {**shares, "other": round(max(0.0, 1 - sum(r.stage_seconds.values()) / wall), 3)}


def report(cfg: E2EConfig, results: dict[str, MethodResult], skipped: dict | None = None,
           roofline: dict | None = None, partial: str | None = None) -> dict:
    base = results.get("autoregressive")
    hf = results.get("hf")
    rows = []
    for r in results.values():
        ref = base.outputs if base else None
        shares = time_shares(r)
        rate = runs_rate(r.seconds, r.tokens)
        rows.append({
            "method": r.name,
            "tokens_per_s": round(r.tokens_per_s, 1),
            "median_s": round(r.median_s, 3),
            "runs_s": [round(s, 3) for s in r.seconds],
            "tokens": r.tokens,
            "speedup_vs_ours_ar": round(paired_ratio(rate, runs_rate(base.seconds, base.tokens)), 3) if base else None,
            "speedup_vs_hf": round(paired_ratio(rate, runs_rate(hf.seconds, hf.tokens)), 3) if hf else None,
            "tokens_per_target_call": round(r.tokens / r.target_calls, 3) if r.target_calls else None,
            "host_fraction": shares["host"] if shares else None,
            "time_shares": shares,
            "target_step_ms": round(1e3 * r.stage_seconds["target"] / r.target_calls, 2) if shares else None,
            "rows_per_step": round(r.rows / r.target_calls, 2) if shares else None,
            "same_tokens_as_ours_ar": (sum(a == b for a, b in zip(r.outputs, ref)) / len(ref)) if ref else None,
            "divergence": r.divergence,
            "roofline_fraction": round(r.tokens_per_s / roofline["tokens_per_s"], 4) if roofline else None,
            "joules_per_token": round(statistics.median(r.joules) / r.tokens, 4) if r.joules else None,
            "ttft_ms": round(statistics.median(r.ttft_ms), 2) if r.ttft_ms else None,
            "tpot_ms": round(statistics.median(r.tpot_ms), 2) if r.tpot_ms else None,
        })
    summary = {}
    lookup = results.get("hf-lookup")
    if base and hf and lookup:  # ANPD's goal: our n-gram speedup over our AR vs HF prompt lookup's over HF generate
        lookup_speedup = lookup.tokens_per_s / hf.tokens_per_s
        summary["ngram_speedup_over_hf_lookup_speedup"] = {
            r.name: round(r.tokens_per_s / base.tokens_per_s / lookup_speedup, 3)
            for r in results.values() if VARIANTS.get(r.name, (None,))[0] == "anpd"}
    summary.update(peer_summary(rows, *best_lossless(speed_rows({"rows": rows}))))
    data = {**header("e2e", cfg), "rows": rows, "summary": summary, "skipped": skipped or {}, "roofline": roofline,
            "ratios": "paired"}  # bench.report.paired_ratio (results from before: ratios of the rows' medians)
    if partial:  # a run still going (or cut off): its rows so far, without the divergence check
        data["partial"] = partial
    write_report(cfg.out / f"e2e-{cfg.label}", data, markdown, plot)
    return data


def speed_rows(data: dict) -> list[dict]:
    """This bench's rows in the shape the reports read (bench.report.speed_rows' fields)."""
    rows = data["rows"]
    return [{"name": r["method"], "tokens_per_s": r["tokens_per_s"], "speedup": r.get("speedup_vs_ours_ar"),
             "tokens_per_call": r.get("tokens_per_target_call"), "host_fraction": r.get("host_fraction"),
             "roofline_fraction": r.get("roofline_fraction"), "joules_per_token": r.get("joules_per_token"),
             "lossless": r.get("same_tokens_as_ours_ar") == 1, "baseline": r["method"].split()[0] in BASELINES}
            for r in rows]


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    rows = speed_rows(data)
    _, best = best_lossless(rows)
    text = lossless_headline(rows)
    peers = data.get("summary", {}).get("peers", {}).values()
    if best is None:  # our AR alone beside the peers' AR, where it was measured so
        versus = [f"{p['our_ar_vs_its_ar']:.2f}x {p['title']}'s AR" for p in peers if p.get("our_ar_vs_its_ar")]
        return f"our AR alone: {', '.join(versus)}" if versus else text
    for name, title in (("hf", "HF `generate`"), ("hf-compile", "HF's static-cache compiled `generate`")):
        hf = next((r for r in data["rows"] if r["method"] == name), None)
        if hf and hf.get("speedup_vs_ours_ar"):
            text += f"; our AR {1 / hf['speedup_vs_ours_ar']:.2f}x {title}"
    for peer in peers:
        if peer.get("our_best_vs_its_best") is not None:
            text += f"; {peer['our_best_vs_its_best']:.2f}x {peer['title']}'s best speculative"
        if peer.get("our_ar_vs_its_ar") is not None:
            text += f", our AR {peer['our_ar_vs_its_ar']:.2f}x its AR"
    if any(r.get("roofline_fraction") for r in rows):
        text += f"; {best['roofline_fraction']:.1%} of the batch-1 roofline"
    return text

"""Typed bundle artifacts: what calibration, profiling and tuning write into a bundle, and their one check.

    acceptance.json  Acceptance      `specrt calibrate`  how often the target accepts the draft's guesses
    latency.json     LatencyProfile  `specrt profile`    step latency L(n) per model, batch size and context
    plan.json        Plan            `specrt tune`       the speculation chosen per batch size
    engines.json     EngineSet       `specrt build`      static-shape steps per token-count profile (CUDA graphs)
    trt-engines.json TrtEngineSet    `specrt build --backend trt`  TensorRT plans, a profile per token-count range
    quant.json       QuantSet        `specrt quantize`   8-bit variants of the step graphs (ONNX Runtime)
    ppd.json         PromptTokens    `specrt ppd train`  PPD's trained prompt tokens, their graph and sparse trees
    inplace.json     InPlaceGraphs   `specrt inplace`    step graphs that write their K/V into the cache in place

Each is a frozen dataclass with a format version and a Stamp: the sha256 of the bundle's manifest it was
made from, the machine (backend, threads, device) it was measured on where that matters, and the sha256
of the artifacts it was derived from (a plan: acceptance.json and latency.json). `save` writes atomically;
`load` is the one place that checks them, and refuses with the command to re-run when the file is
missing, unreadable, of another format, made for another export, measured elsewhere, or derived from
artifacts that have changed since.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from specrt.bundle.codec import DataError, from_data, to_data
from specrt.bundle.files import write_json_atomic
from specrt.bundle.machine import Machine
from specrt.bundle.manifest import manifest_sha256, sha256_file, verify_files
from specrt.errors import BundleError, InvalidRequestError, SpecrtError


@dataclass(frozen=True)
class Stamp:
    manifest_sha256: str  # of the bundle's manifest.json this was made from
    specrt_version: str
    created: str  # local time, ISO 8601
    machine: Machine | None = None  # where it was measured; None: valid on any machine
    inputs: dict[str, str] = field(default_factory=dict)  # artifact file -> the sha256 it was derived from

    @staticmethod
    def make(bundle: Path, machine: Machine | None = None, inputs: tuple[str, ...] = ()) -> "Stamp":
        from specrt.version import __version__

        return Stamp(manifest_sha256(bundle), __version__, time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine,
                     {name: sha256_file(Path(bundle) / name) for name in inputs})


EXPORTED = "exported"  # the name of the step graphs as exported among variants (quant None)


def variant_quant(variant: str) -> str | None:
    """The quant of a variant's name: None for the exported graphs, else the scheme."""
    return None if variant == EXPORTED else variant


def variant_words(quant: str | None) -> str:
    """A variant in an error message: "the int8-weights variant", "the exported step graphs"."""
    return f"the {quant} variant" if quant else "the exported step graphs"


@dataclass(frozen=True)
class Artifact:
    FILE: ClassVar[str]
    FORMAT: ClassVar[int]
    COMMAND: ClassVar[str]  # what makes it; {bundle} and {flags} (the machine's backend flags) are filled in
    # measured on one variant of the step graphs: the exported graphs' at FILE, quantized variant S's at
    # quant/S/FILE (beside its graphs), so that the tuner can weigh variants side by side
    PER_VARIANT: ClassVar[bool] = False

    stamp: Stamp

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        """What to run to (re)make it; `reason` is "missing", "machine" (measured elsewhere) or "stale"."""
        return cls.COMMAND.format(bundle=bundle, flags=machine.flags() if machine else "").replace("  ", " ").strip()

    @classmethod
    def file(cls, quant: str | None = None) -> str:
        """Where it lies in the bundle (relative): per variant of the step graphs for PER_VARIANT artifacts."""
        return f"quant/{quant}/{cls.FILE}" if quant and cls.PER_VARIANT else cls.FILE

    @classmethod
    def variant_command(cls, bundle: Path, machine: Machine | None, reason: str, quant: str | None) -> str:
        cmd = cls.command(bundle, machine, reason)
        return cmd + (f" --quant {quant}" if quant and cls.PER_VARIANT and f"--quant {quant}" not in cmd else "")

    def mismatch(self) -> str | None:
        """Why this artifact cannot be used in this process beyond its stamp (libraries, devices), or None."""
        return None


def save(bundle: Path, artifact: Artifact, quant: str | None = None) -> Path:
    """Write atomically into the bundle (a PER_VARIANT artifact: where variant `quant`'s lie); returns the path."""
    path = Path(bundle) / artifact.file(quant)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"format": artifact.FORMAT, **to_data(artifact)})
    return path


def load(bundle: Path, cls: type[Artifact], machine: Machine | None = None, here: bool = True,
         quant: str | None = None) -> Artifact:
    """The bundle's artifact of this type, checked against the bundle and (if given) this machine; and with
    `here`, against this process's libraries and devices (Artifact.mismatch: engines built elsewhere). A
    PER_VARIANT artifact is variant `quant`'s, else the machine's variant (Machine.quant)."""
    bundle = Path(bundle).resolve()
    if quant is None and machine is not None:
        quant = machine.quant
    name = cls.file(quant)
    path = bundle / name
    redo = f"re-run `{cls.variant_command(bundle, machine, 'stale', quant)}`"
    if not path.is_file():
        raise BundleError(f"no {name} in {bundle}: run `{cls.variant_command(bundle, machine, 'missing', quant)}` first")
    artifact = _parse(cls, path, redo)
    stamp = artifact.stamp
    if stamp.manifest_sha256 != manifest_sha256(bundle):
        raise BundleError(f"{path} was made for another export of this bundle (its manifest.json changed): {redo}")
    if machine is not None and stamp.machine is not None and stamp.machine != machine:
        raise BundleError(f"{path} was measured on {stamp.machine.describe()}, but this is {machine.describe()}: "
                          f"re-run `{cls.variant_command(bundle, machine, 'machine', quant)}` here")
    for input_name, digest in stamp.inputs.items():
        if verify_files(bundle, {input_name: digest}):
            raise BundleError(f"{path} was made from an earlier {input_name} (it changed or is gone since): {redo}")
    why = artifact.mismatch() if here else None
    if why:
        raise BundleError(f"{path} {why}: re-run `{cls.variant_command(bundle, machine, 'machine', quant)}` here")
    return artifact


def read(bundle: Path, cls: type[Artifact], quant: str | None = None) -> tuple[Artifact | None, str]:
    """The bundle's artifact of this type (of variant `quant`, for PER_VARIANT ones) for reading about it (a
    report), and "ok" or why `load` would refuse it (not counting this process's devices); the artifact is None
    only when it is missing or unreadable."""
    try:
        return load(bundle, cls, here=False, quant=quant), "ok"
    except SpecrtError as e:
        why = str(e)
    try:
        return _parse(cls, Path(bundle).resolve() / cls.file(quant), ""), why
    except (OSError, SpecrtError):
        return None, why


_PARSED: dict = {}  # (class, path) -> (file signature, artifact): a file read again only when it changed


def _parse(cls: type[Artifact], path: Path, redo: str) -> Artifact:
    """The artifact in `path`, parsed and type-checked (cached while the file's size, mtime and inode hold)."""
    st = path.stat()
    signature = (st.st_mtime_ns, st.st_size, st.st_ino)
    cached = _PARSED.get((cls, path))
    if cached is not None and cached[0] == signature:
        return cached[1]
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON (truncated or edited? {e}): {redo}") from None
    if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise BundleError(f"{path} has format {found!r}, this specrt reads format {cls.FORMAT}: {redo}")
    try:
        artifact = from_data(cls, {k: v for k, v in data.items() if k != "format"})
    except (DataError, TypeError, ValueError) as e:
        raise BundleError(f"{path} is malformed ({e}): {redo}") from None
    _PARSED[(cls, path)] = (signature, artifact)
    return artifact


def status(bundle: Path, machine: Machine | None = None) -> list[tuple[str, str]]:
    """(file, "ok" or why it would be refused) for every artifact type: what `specrt inspect` prints."""
    out = []
    for cls in ARTIFACTS:
        name = cls.file(machine.quant if machine else None)
        try:
            load(bundle, cls, machine)
            out.append((name, "ok"))
        except SpecrtError as e:
            out.append((name, str(e)))
    return out


# -- acceptance.json ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeEstimate:
    """A calibrated best static tree under the product model."""

    num_nodes: int
    paths: tuple[tuple[int, ...], ...]  # child ranks from the root, in the order the greedy build added them
    expected_accepted: float  # drafted tokens accepted per round


@dataclass(frozen=True)
class MeasuredTree:
    """A dynamic tree (optionally with n-gram drafts merged in), or ANPD's n-gram drafts alone, measured by
    decoding."""

    num_nodes: int  # draft-model nodes per round (ANPD: n-gram drafted tokens, K)
    width: int  # beams expanded per depth
    depth: int
    expected_accepted: float  # drafted tokens accepted per round
    draft_calls_per_round: float
    nodes_per_round: float  # nodes verified per round (merged trees vary)
    nodes_hist: dict[int, int]  # nodes verified in a round -> rounds
    ngram_tokens: int = 0  # n-gram drafts merged in (0: a plain dynamic tree)
    ngram_min_prob: float | None = None
    # drafted tokens accepted per round by the output position a round starts at, per bucket of
    # Acceptance.position_bucket positions (the last bucket: every later position); () before it was measured
    accepted_by_position: tuple[float, ...] = ()
    # 5th-95th percentile of expected_accepted over resamples of the calibration prompts (calibration.acceptance.
    # ratio_interval): how far the text alone moves it; None before it was measured
    accepted_interval: tuple[float, float] | None = None


@dataclass(frozen=True)
class Acceptance(Artifact):
    FILE: ClassVar[str] = "acceptance.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt calibrate --bundle {bundle}"
    PER_VARIANT: ClassVar[bool] = True  # a quantized target accepts other drafts

    config: dict  # the CalibrationConfig it was made with
    num_positions: int
    rank_histogram: tuple[int, ...]  # [K + 1] draft rank of the target's token, ranks >= K pooled last
    depth_rank: tuple[tuple[float, ...], ...]  # [D][K] acceptance of rank r at depth d given an accepted parent
    depth_support: tuple[int, ...]  # [D] start positions each depth's estimate rests on
    chain_expected_accepted: tuple[float, ...]  # [D] for chains of 1..D tokens
    draft_temperature: float
    draft_nll_at_temperature_1: float
    draft_nll_at_draft_temperature: float
    trees: tuple[TreeEstimate, ...]
    dynamic: tuple[MeasuredTree, ...]
    merged: tuple[MeasuredTree, ...]
    seconds: float
    ngram: tuple[MeasuredTree, ...] = ()  # ANPD (n-gram drafts, no draft model) by K; () before it was measured
    # output positions per bucket of the by-position estimates (0: calibrated before they were measured)
    position_bucket: int = 0
    # [buckets][D][K]: depth_rank over the rounds that start in each bucket of output positions
    depth_rank_by_position: tuple[tuple[tuple[float, ...], ...], ...] = ()
    # PPD's sparse trees by budget (num_nodes; width: candidates, depth: the deepest), measured by decoding, and the
    # PromptTokens.identity() of the prompt tokens and trees measured; () / None where the bundle had none then
    ppd: tuple[MeasuredTree, ...] = ()
    ppd_source: str | None = None

    def ppd_measured(self, tokens: "PromptTokens | None") -> dict[int, MeasuredTree]:
        """PPD's trees measured by decoding, by budget, where they are `tokens`' trees ({} where the prompt tokens
        were trained again, or their trees rebuilt, after this calibration)."""
        if tokens is None or not self.ppd or self.ppd_source != tokens.identity():
            return {}
        return {m.num_nodes: m for m in self.ppd}


# -- latency.json ---------------------------------------------------------------------------------
HOST_KINDS = ("tree", "dynamic", "merged", "ngram", "ppd")
# a kind not in a profile (profiled before it was measured, or PPD without prompt tokens then) is costed as the next
# simpler one's host work
HOST_FALLBACK = {"merged": "dynamic", "dynamic": "tree", "ngram": "tree", "ppd": "tree"}


@functools.lru_cache(maxsize=4096)
def nondecreasing(values: tuple[float, ...]) -> tuple[float, ...]:
    """The least-squares non-decreasing fit of a sequence (pool adjacent violators): a profiled cost that falls
    as the work grows (a step of more tokens, a round of more nodes) is noise, and the tuner must not pick a
    tree for it, so each run of such points is replaced by its mean."""
    blocks: list[tuple[float, int]] = []  # (mean, points pooled)
    for v in values:
        blocks.append((float(v), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2))
    return tuple(m for m, c in blocks for _ in range(c))


@dataclass(frozen=True)
class LatencyProfile(Artifact):
    FILE: ClassVar[str] = "latency.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt profile --bundle {bundle} {flags}"
    PER_VARIANT: ClassVar[bool] = True  # a quantized step costs less

    config: dict  # the ProfileConfig it was made with
    models: dict[str, dict[int, dict[int, dict[int, float]]]]  # role -> batch -> context -> new tokens -> ms
    host_ms: dict[str, dict[int, float]]  # kind (HOST_KINDS) -> tree nodes -> host ms per round, batch 1
    # the device's measured copy bandwidth, bytes read + written per second (None: profiled before it was measured)
    copy_bandwidth: float | None = None
    # kind -> batch size (> 1) -> tree nodes -> host ms per round: host work grows with the batch (None: profiled
    # at batch 1 only, before this was measured)
    host_batch: dict[str, dict[int, dict[int, float]]] | None = None
    # the target's backend left holes out of its token-wise work (Backend.packs_rows): a ragged step costs about L at
    # its mean width, not its widest (False: it computes them, or it was profiled before rows were packed)
    packed_rows: bool = False
    # slots the profiled KV caches grew by (capacity: a multiple of it; a static cache's: its whole capacity): what
    # at_context prices a context by (None: profiled before it was recorded)
    cache_bucket: int | None = None
    # a static cache's attention spans (the graphs engines' EngineSet.spans): a step over c cached tokens attends over
    # the smallest span >= c, which at_context prices it by instead (None: no spans, or profiled before them)
    cache_spans: tuple[int, ...] | None = None
    # role -> batch -> tokens per sequence -> ms of one prefill step of that many prompt tokens per sequence into an
    # empty cache (a prompt's tokens cost more there than in a decode-shaped step of as many rows: attention over the
    # step's own tokens grows with them); prefill_chunk: the tokens per sequence per step the pipeline prefilled in
    # (None: profiled before prefill was; prefill_step_ms then prices it from the decode curves)
    prefill: dict[str, dict[int, dict[int, float]]] | None = None
    prefill_chunk: int | None = None

    def roofline_ms(self, weight_bytes: int) -> float | None:
        """The least time one step can take: every weight read once at the measured bandwidth (None: unknown)."""
        return 1e3 * weight_bytes / self.copy_bandwidth if self.copy_bandwidth else None

    def batch_sizes(self, role: str = "target") -> list[int]:
        return sorted(self.models[role])

    def at_context(self, context: float) -> LatencyProfile:
        """This profile with one curve per batch size, each point at `context` cached tokens per sequence (a batch's:
        its longest sequence's). A step attends over the cache's capacity, which grows by `cache_bucket` slots: each
        point is the profiled one at the same capacity, linear between profiled capacities, the smallest's below
        them, along the line through the two largest (never falling) above them; without a recorded bucket, linear
        in the context the same way. Engines with attention spans (cache_spans) attend over the span the cached
        context fits, which stands for the capacity. Without it, step_ms averages over the profiled contexts."""
        def capacity(cached: float, new: int) -> float:
            if self.cache_spans:
                return next((s for s in self.cache_spans if cached <= s), self.cache_spans[-1])
            tokens = cached + new
            return -(-tokens // self.cache_bucket) * self.cache_bucket if self.cache_bucket else tokens

        models = {}
        for role, per_batch in self.models.items():
            models[role] = {}
            for b, per_context in per_batch.items():
                ns = sorted(set.intersection(*(set(curve) for curve in per_context.values())))
                curve = {}
                for n in ns:
                    at: dict[float, list[float]] = {}  # capacity -> the profiled points there
                    for c, points in per_context.items():
                        at.setdefault(capacity(c, n), []).append(points[n])
                    xs = sorted(at)
                    ys = [float(np.mean(at[x])) for x in xs]
                    x = capacity(context, n)
                    if x > xs[-1] and len(xs) > 1:
                        curve[n] = ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) * (x - xs[-1])
                    else:
                        curve[n] = float(np.interp(x, xs, ys))
                models[role][b] = {round(context): curve}
        return replace(self, models=models)

    def step_ms(self, role: str, batch: float, num_tokens: float) -> float:
        """L(n) at a batch size, averaged over the profiled contexts, linear between profiled n of the curve's
        non-decreasing fit; between two profiled batch sizes, linear between theirs (a batch that drains runs at
        every size below its own)."""
        per_batch = self.models[role].get(batch)
        if per_batch is None:
            sizes = self.batch_sizes(role)
            if not sizes[0] < batch < sizes[-1]:
                raise SpecrtError(f"batch size {batch} was not profiled (profiled: {sizes})")
            lo = max(b for b in sizes if b < batch)
            hi = min(b for b in sizes if b > batch)
            w = (batch - lo) / (hi - lo)
            return (1 - w) * self.step_ms(role, lo, num_tokens) + w * self.step_ms(role, hi, num_tokens)
        values = []
        for curve in per_batch.values():
            ns = sorted(curve)
            if num_tokens > ns[-1]:
                raise SpecrtError(f"{role} was profiled up to {ns[-1]} tokens at batch {batch}, not {num_tokens}")
            values.append(float(np.interp(num_tokens, ns, nondecreasing(tuple(curve[n] for n in ns)))))
        return float(np.mean(values))

    def prefill_step_ms(self, role: str, rows: int, lens: list[int]) -> float:
        """Ms of one prefill step of `rows` sequences of which these feed `lens` prompt tokens (the others, if
        any, are empty rows of a static cache). A ragged step is as wide as its longest row for every sequence;
        a backend that packs rows leaves the holes out, so it costs the per-token price of a step that wide, times
        its tokens. Per-token prices: the prefill profile's, linear between profiled widths and batch sizes (the
        nearest profiled one beyond them); without one, the decode curve's largest step at the largest profiled
        batch size <= rows."""
        width = max(lens)
        tokens = sum(lens) if self.packed_rows else rows * width
        if not self.prefill or role not in self.prefill:
            sizes = self.batch_sizes(role)
            batch = max([b for b in sizes if b <= rows] or sizes[:1])
            largest = min(max(curve) for curve in self.models[role][batch].values())
            return self.step_ms(role, batch, largest) / (batch * largest) * tokens
        per_batch = self.prefill[role]
        sizes = sorted(per_batch)

        def per_token(b: int) -> float:
            curve = per_batch[b]
            ns = sorted(curve)
            return float(np.interp(width, ns, [curve[n] / (b * n) for n in ns]))

        return float(np.interp(rows, sizes, [per_token(b) for b in sizes])) * tokens

    def host(self, num_nodes: float, kind: str = "tree", batch: float = 1) -> float:
        """Host ms per round for a tree of num_nodes (0 = autoregressive) at a batch size, linear between measured
        sizes (of their non-decreasing fit) and batch sizes (beyond the largest profiled batch, along the line
        through the two largest); of this kind where profiled, else of the next simpler one (HOST_FALLBACK: "merged"
        -> "dynamic" -> "tree", "ngram" and "ppd" -> "tree"), else 0."""
        k = kind
        while k is not None:
            table = self.host_ms.get(k)
            if table:
                tables = {1: table, **(self.host_batch or {}).get(k, {})}
                sizes = sorted(tables)
                ys = [float(np.interp(num_nodes, sorted(tables[b]),
                                      nondecreasing(tuple(tables[b][n] for n in sorted(tables[b]))))) for b in sizes]
                if batch > sizes[-1] and len(sizes) > 1:
                    slope = (ys[-1] - ys[-2]) / (sizes[-1] - sizes[-2])
                    return max(0.0, ys[-1] + slope * (batch - sizes[-1]))
                return float(np.interp(batch, sizes, ys))
            k = HOST_FALLBACK.get(k)
        return 0.0


# -- plan.json ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurvePoint:
    """One candidate the tuner weighed at one batch size."""

    kind: str  # "autoregressive", "chain", "tree", "dynamic", "merged", "ngram" (ANPD) or "ppd"
    num_nodes: int
    expected_accepted: float
    predicted_tokens_per_s: float
    target_ms: float  # predicted per round
    draft_ms: float  # drafting + host work per round
    paths: tuple[tuple[int, ...], ...] | None = None  # static trees and chains
    width: int | None = None  # dynamic and merged trees
    depth: int | None = None
    ngram_tokens: int = 0
    ngram_min_prob: float | None = None


@dataclass(frozen=True)
class PlanChoice:
    method: str  # what method="auto" runs: "autoregressive", "tree", "dynamic", "anpd" or "ppd"
    best: CurvePoint  # the fastest candidate predicted
    best_static: CurvePoint  # the fastest static tree or chain (what method="tree" uses)
    predicted_speedup: float  # over autoregressive at this batch size


@dataclass(frozen=True)
class Plan(Artifact):
    FILE: ClassVar[str] = "plan.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt tune --bundle {bundle}"

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        # a plan is made from acceptance.json (any machine) and latency.json (this machine)
        steps = {"missing": (Acceptance, LatencyProfile), "machine": (LatencyProfile,), "stale": ()}[reason]
        return " && ".join([c.command(bundle, machine) for c in steps] + [super().command(bundle, machine)])

    choices: dict[int, PlanChoice]  # batch size -> choice
    curves: dict[int, tuple[CurvePoint, ...]]  # batch size -> every candidate weighed
    quant: str | None = None  # the variant of the step graphs the choices are for (None: as exported)
    # with `tune --variants`: each variant weighed ("exported" or the scheme) -> batch size -> its best predicted
    # tokens/s (after the min_gain rule); None: tuned on one variant
    variants: dict[str, dict[int, float]] | None = None
    new_tokens: int | None = None  # tuned for outputs of this many tokens (`tune --max-new-tokens`); None: calibration's
    context: int | None = None  # tuned for steps at this many cached tokens (`tune --context`); None: profiled average

    def trees_by_batch(self, batch_size: int) -> dict[int, CurvePoint] | None:
        """The static tree chosen at each tuned batch size <= batch_size, where there are several and every one is a
        static tree (`auto` then drafts the tree of the live batch size each round); else None."""
        choices = {b: c for b, c in self.choices.items() if b <= batch_size}
        if len(choices) > 1 and all(c.method == "tree" for c in choices.values()):
            return {b: c.best for b, c in choices.items()}
        return None

    def choice_for(self, batch_size: int) -> PlanChoice:
        """The choice of the largest tuned batch size <= batch_size (else the smallest)."""
        sizes = sorted(self.choices)
        fit = [b for b in sizes if b <= batch_size]
        return self.choices[fit[-1] if fit else sizes[0]]


# -- engines.json ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSet(Artifact):
    """Static-shape steps of both models: one per token-count profile and batch bucket, over one static KV
    capacity; on CUDA each is captured as a CUDA graph when the bundle is loaded (a graph cannot be stored),
    so the file records what was built and checked, and where. TensorRT engines will share the profile table."""

    FILE: ClassVar[str] = "engines.json"
    FORMAT: ClassVar[int] = 3  # 2: quant; 3: compile, spans
    PER_VARIANT: ClassVar[bool] = True  # each scheme's engines (`specrt build --quant S`) at quant/S/engines.json
    COMMAND: ClassVar[str] = "specrt build --bundle {bundle}"

    kind: str  # "graphs": the step module at static shapes (CUDA graphs on CUDA, eager on the CPU)
    token_profiles: tuple[int, ...]  # the largest new-token count of each profile, ascending
    batch_buckets: tuple[int, ...]  # the largest batch of each bucket, ascending
    capacity: int  # static KV cache capacity (positions per sequence)
    # attention spans, ascending, the last the capacity: a step whose sequences' cached contexts fit span s attends
    # over the static cache's first s slots only (graphs; trt: (capacity,), its profiles range over the cache size)
    spans: tuple[int, ...]
    slots: int  # calls served at once (each holds a static cache per model)
    device: str  # "cpu" or "cuda:N"
    device_name: str | None  # the GPU's name
    compute_capability: str | None  # e.g. "9.0"
    versions: dict[str, str]  # torch (and cuda) versions the engines were built with
    cuda_graphs: bool  # captured as CUDA graphs (False on the CPU: the same static steps, run eagerly)
    build_seconds: dict[str, float]  # per model: capture (or warm-up) and check time
    parity: dict[str, float]  # per model: max |logit| difference, padded static step vs eager step
    # graphs: the projections' 8-bit scheme (model/quant.py: int8-wo, fp8); trt: the quantized variant's Q/DQ graphs
    # the plans were built from (`specrt quantize`); None: the weights as exported
    quant: str | None
    weight_bytes: dict[str, int]  # per model: the bytes of its weights as the engines hold them (the roofline's)
    # graphs: the torch.compile mode of the decoder layers (contract.TORCH_COMPILE_MODES), None: eager; trt: None
    compile: str | None

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        device = f" --device {machine.device}" if machine and machine.device != "cpu" else ""
        return f"specrt build --bundle {bundle}{device}"

    def for_tokens(self, num_tokens: int) -> int:
        """The profile (its largest token count) a step of num_tokens new tokens per sequence runs at."""
        for t in self.token_profiles:
            if num_tokens <= t:
                return t
        raise InvalidRequestError(f"a step of {num_tokens} new tokens exceeds the engines' largest profile "
                          f"({self.token_profiles[-1]}): rebuild with a larger --token-profiles entry")

    def for_context(self, length: int) -> int:
        """The attention span a step over cached contexts of at most `length` rows runs at."""
        for s in self.spans:
            if length <= s:
                return s
        raise InvalidRequestError(f"a context of {length} cached rows exceeds the engines' capacity ({self.capacity})")

    def for_batch(self, batch: int) -> int:
        """The batch bucket a step of `batch` sequences runs at."""
        for b in self.batch_buckets:
            if batch <= b:
                return b
        raise InvalidRequestError(f"a batch of {batch} exceeds the engines' largest batch bucket ({self.batch_buckets[-1]}): "
                          "rebuild with a larger --batch-buckets entry")

    def mismatch(self) -> str | None:
        here = environment(self.device)
        built = (self.versions, self.device_name, self.compute_capability)
        if built != (here["versions"], here["device_name"], here["compute_capability"]):
            return (f"was built with {_describe_env(self.versions, self.device_name, self.compute_capability)}, but this is "
                    f"{_describe_env(here['versions'], here['device_name'], here['compute_capability'])}")
        return None


def environment(device: str, tensorrt: bool = False) -> dict:
    """What built engines depend on: the libraries (torch and CUDA; or TensorRT, None where it does not import),
    the GPU's name and compute capability."""
    if tensorrt:
        try:
            import tensorrt as trt

            versions = {"tensorrt": trt.__version__}
        except (ImportError, OSError):
            versions = {"tensorrt": None}
    else:
        import torch

        versions = {"torch": torch.__version__}
        if device.startswith("cuda"):
            versions["cuda"] = str(torch.version.cuda)
    name = capability = None
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        if torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
            name = torch.cuda.get_device_name(dev)
            capability = "{}.{}".format(*torch.cuda.get_device_capability(dev))
    return {"versions": versions, "device_name": name, "compute_capability": capability}


def _describe_env(versions: dict, name: str | None, capability: str | None) -> str:
    libs = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return f"{libs} on {name} (compute capability {capability})" if name else f"{libs} on the CPU"


# -- trt-engines.json -----------------------------------------------------------------------------
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


@dataclass(frozen=True)
class TrtEngineSet(EngineSet):
    """TensorRT engines of both models (`specrt build --backend trt`): one serialized plan per model under trt/,
    built from the bundle's step ONNX as a strongly typed network (the export's dtype is the engine's), with one
    optimization profile per token-count range of the profile table (over batch 1..largest bucket and KV
    capacity 1..capacity), repeated per slot (concurrent contexts never share a profile). A plan runs only
    with the TensorRT version and on the GPU it was built for, unless built version- or hardware-compatible."""

    FILE: ClassVar[str] = "trt-engines.json"
    FORMAT: ClassVar[int] = 2  # 2: compile (None), spans ((capacity,))
    PER_VARIANT: ClassVar[bool] = False  # one set of plans, built from the variant `quant` names
    COMMAND: ClassVar[str] = "specrt build --bundle {bundle} --backend trt"

    plans: dict[str, str]  # role -> plan file, relative to the bundle
    plan_bytes: dict[str, int]
    plan_sha256: dict[str, str]
    profiles: dict[str, tuple[dict[str, tuple[tuple[int, ...], ...]], ...]]  # role -> per range: input -> (min, opt, max)
    hardware_compatibility: str  # HARDWARE_COMPATIBILITY
    version_compatible: bool  # runs with later TensorRT versions (TensorRT's lean runtime in the plan)
    workspace_bytes: int
    kv_update: str = "runtime"  # "graph": built from `specrt inplace`'s graphs (a static cache the engine writes)

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        device = f" --device {machine.device}" if machine and machine.device != "cpu" else ""
        return f"specrt build --bundle {bundle} --backend trt{device}"

    def profile_index(self, num_tokens: int, slot: int = 0) -> int:
        """The optimization profile a step of num_tokens new tokens per sequence runs at, in slot `slot`."""
        return slot * len(self.token_profiles) + self.token_profiles.index(self.for_tokens(num_tokens))

    def mismatch(self) -> str | None:
        here = environment(self.device, tensorrt=True)
        built_v, here_v = self.versions.get("tensorrt"), here["versions"]["tensorrt"]
        fallback = "(the ONNX step graphs still run with --backend ort)"
        if here_v is None:
            return f"needs TensorRT {built_v}, which does not import here {fallback}"
        # a version-compatible plan runs with later releases of its major version (TensorRT's support matrix)
        here_t, built_t = _version_tuple(here_v), _version_tuple(built_v)
        version_ok = here_v == built_v or (self.version_compatible and here_t >= built_t and here_t[:1] == built_t[:1])
        cc, built_cc = here["compute_capability"], self.compute_capability
        if self.hardware_compatibility == "ampere_plus":
            gpu_ok = cc is not None and _version_tuple(cc) >= (8, 0)
        elif self.hardware_compatibility == "same_compute_capability":
            gpu_ok = cc == built_cc
        else:
            gpu_ok = (cc, here["device_name"]) == (built_cc, self.device_name)
        if version_ok and gpu_ok:
            return None
        return (f"was built with {_describe_env(self.versions, self.device_name, built_cc)}, but this is "
                f"{_describe_env(here['versions'], here['device_name'], cc)} {fallback}")


# -- quant.json -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantVariant:
    """One model's quantized step graph."""

    file: str  # relative to the bundle
    bytes: int  # of the graph and its external data
    sha256: str  # of the graph file
    source_sha256: str  # of the step graph it was made from (the manifest's)
    source_bytes: int
    quantized_nodes: int  # MatMul nodes with 8-bit weights
    seconds: float
    calibration: dict | None  # static schemes: held-out text (corpus hash, prompts, tokens, seed); None: dynamic
    kept: tuple[str, ...] = ()  # projections left in float by role (`specrt quantize --keep`: down, head)


@dataclass(frozen=True)
class QuantSet(Artifact):
    """Quantized variants of the bundle's step graphs (`specrt quantize`), run by the ort backend with --quant (and
    built into TensorRT plans: `specrt build --backend trt --quant int8-qdq`)."""

    FILE: ClassVar[str] = "quant.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt quantize --bundle {bundle}"

    variants: dict[str, dict[str, QuantVariant]]  # scheme -> role -> variant

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        scheme = f" --scheme {machine.quant}" if machine and machine.quant else ""
        return f"specrt quantize --bundle {bundle}{scheme}"

    def graphs(self, bundle: Path, scheme: str, verify: bool | str = True) -> dict[str, str]:
        """role -> the step graph (relative to the bundle) of variant `scheme`, refused where it is missing or
        (verify) changed since `specrt quantize` wrote it."""
        if scheme not in self.variants:
            raise BundleError(f"{bundle} has no {scheme} variant (it has: {', '.join(sorted(self.variants)) or 'none'}): "
                              f"run `specrt quantize --bundle {bundle} --scheme {scheme}`")
        for v in self.variants[scheme].values():
            if verify_files(bundle, {v.file: v.sha256}, verify) or not (Path(bundle) / v.file).is_file():
                raise BundleError(f"{Path(bundle) / v.file} is missing or changed since `specrt quantize` wrote it: "
                                  f"re-run `specrt quantize --bundle {bundle} --scheme {scheme}`")
        return {role: v.file for role, v in self.variants[scheme].items()}


# -- ppd.json -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PpdTree:
    """A PPD sparse tree for one budget (static pruning, PPD section 4.2.1): candidate tokens by child ranks (the
    top-k of the prompt token at that depth) and how many prompt tokens the root and each candidate carry."""

    budget: int  # step rows beyond the root allowed
    paths: tuple[tuple[int, ...], ...]  # candidates, as TreeSpec paths
    prompts: tuple[int, ...]  # [1 + len(paths)] prompt tokens carried by the root, then by each candidate (0..k)
    rows: int  # step rows beyond the root when every candidate is in play (<= budget)
    expected_rows: float  # the same, averaged over the steady state (fewer candidates after a short acceptance)
    expected_accepted: float  # candidates accepted per round in the steady state (R(T), PPD appendix A)


@dataclass(frozen=True)
class PathHit:
    """A candidate path of guess ranks (rank r_d of the guess of distance d + 1, d = 1..m) and the share of validation
    positions where every guess along it was right together (measured jointly: the guesses of one round are not
    independent, so the product of the per-distance accuracies can be far off)."""

    path: tuple[int, ...]
    accuracy: float


@dataclass(frozen=True)
class PromptTokens(Artifact):
    """PPD's prompt tokens (`specrt ppd train`): k prompt tokens x e ensemble prompt tokens (EPTs), extra rows of the
    target's input embedding table with ids V + (d - 1) * e + j (distance d = 1..k, EPT j = 0..e-1); a copy of the
    target's step graph holding them (ort); accuracy by distance on held-out text; sparse trees per budget."""

    FILE: ClassVar[str] = "ppd.json"
    FORMAT: ClassVar[int] = 2  # 2: path_accuracy
    COMMAND: ClassVar[str] = "specrt ppd train --bundle {bundle}"

    num_prompt_tokens: int  # k: prompt token d guesses the token d + 1 after the last accepted one
    num_ensemble: int  # e
    vocab_size: int  # V
    hidden_size: int
    embeddings: str  # .npy [k * e, hidden], relative to the bundle
    embeddings_sha256: str
    graph: str | None  # the target step graph with the prompt tokens (None: a bundle without ONNX graphs)
    graph_sha256: str | None
    parity: float | None  # max |logit| difference of that graph against the exported one on ordinary ids
    training: dict  # config, steps, loss curve, seconds, seed, corpus hash (or the bundle the tokens came from)
    accuracy: tuple[tuple[float, ...], ...]  # [k][K] P(rank r of prompt token d's guess is the true token)
    baseline_accuracy: tuple[tuple[float, ...], ...]  # [k][K] the same from the last position's own logits
    initial_accuracy: tuple[tuple[float, ...], ...]  # [k][K] the same with the untrained (initial) prompt tokens
    path_accuracy: tuple[PathHit, ...]  # every candidate path whose guesses were all right together at least once
    trees: tuple[PpdTree, ...]  # one per budget, ascending

    def identity(self) -> str:
        """What a measurement of these prompt tokens' trees rests on: the embeddings and the trees (sha256)."""
        return hashlib.sha256(json.dumps([self.embeddings_sha256, to_data(self.trees)]).encode()).hexdigest()

    def tree(self, budget: int | None = None) -> PpdTree:
        """The sparse tree of the largest budget <= `budget` (None: the largest built)."""
        fit = [t for t in self.trees if budget is None or t.budget <= budget]
        if not fit:
            raise InvalidRequestError(f"no PPD tree within {budget} rows (built: {', '.join(str(t.budget) for t in self.trees)})")
        return fit[-1]


# -- inplace.json ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class InPlaceGraph:
    """One model's in-graph variant of its step graph (contract.py, kv_update "graph")."""

    file: str  # relative to the bundle
    bytes: int  # of the graph and its external data
    sha256: str  # of the graph file
    opset: int
    parity: dict  # cases, max |logit| and |K/V| difference against the PyTorch step module, tolerance
    seconds: float  # export and check


@dataclass(frozen=True)
class InPlaceGraphs(Artifact):
    """Step graphs whose cache update is in the graph (`specrt inplace`): ONNX TensorScatter + Attention (opset
    24), which ONNX Runtime runs in place on the CPU and TensorRT >= 10.15 imports as IKVCacheUpdateLayer and
    IAttention. Run with --kv-update graph."""

    FILE: ClassVar[str] = "inplace.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt inplace --bundle {bundle}"

    graphs: dict[str, InPlaceGraph]  # role -> graph


ARTIFACTS = (Acceptance, LatencyProfile, Plan, EngineSet, TrtEngineSet, QuantSet, PromptTokens, InPlaceGraphs)
ENGINE_SETS = {"graphs": EngineSet, "trt": TrtEngineSet}  # backend -> the artifact its engines are described by

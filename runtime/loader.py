"""What a bundle resolves to before any model loads, built once (`resolve`): backend, threads, device, the variant of
the step graphs, the KV update, the engines, PPD's prompt tokens and the tokenizer, each checked against the others
and against the bundle's artifacts, refused in one line naming what to re-run. `Pipeline.load` makes each model's
backend from it (`ResolvedBundle.load_model`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import InPlaceGraphs, Plan, PromptTokens, QuantSet, variant_words
from specrt.bundle.machine import Machine, resolve_threads
from specrt.bundle.manifest import Manifest, load_manifest, verify_files
from specrt.contract import TORCH_QUANT_SCHEMES
from specrt.errors import BundleError, InvalidRequestError
from specrt.runtime.backends import Backend, BackendKind, ModelSource, backend_kind, load_backend, resolve_device
from specrt.runtime.backends.kinds import kinds_that


@dataclass(frozen=True)
class ResolvedBundle:
    bundle: Path
    manifest: Manifest
    tokenizer: object  # tokenizers.Tokenizer
    backend: str
    threads: int
    device: str
    quant: str | None  # the variant of the step graphs (or the torch backends' projections) that runs
    kv_update: str
    packed_rows: bool
    engines: object | None  # the EngineSet or TrtEngineSet of the engine backends
    graphs: dict[str, str]  # role -> the step graph run instead of the exported one (ort), relative to the bundle
    prompt_tokens: PromptTokens | None  # PPD's, where this backend holds them
    prompt_tokens_refused: str | None  # why not, where it does not
    embeddings: np.ndarray | None = field(default=None, repr=False)  # PPD's prompt embeddings (torch backends)

    @property
    def machine(self) -> Machine:
        return Machine.here(self.backend, self.threads, self.device, self.quant, self.kv_update, self.packed_rows)

    def load_model(self, role: str) -> Backend:
        source = ModelSource(self.manifest.models[role], self.threads, self.device, self.engines,
                             self.graphs.get(role), self.embeddings if role == "target" else None, self.kv_update,
                             self.quant, self.packed_rows)
        return load_backend(self.backend, self.bundle, source)


def resolve(bundle: str | Path, *, backend: str = "ort", threads: int | None = None, device: str | None = None,
            verify: bool | str = True, quant: str | None = None, kv_update: str = "runtime",
            packed_rows: bool = True) -> ResolvedBundle:
    """Pipeline.load's arguments (see there) resolved against the bundle, before any model loads."""
    from tokenizers import Tokenizer

    if threads is not None and (not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or threads < 1):
        raise InvalidRequestError(f"threads must be an integer >= 1 (or None for every core), got {threads!r}")
    kind = backend_kind(backend)
    if not isinstance(packed_rows, bool):
        raise InvalidRequestError(f"packed_rows must be True or False, got {packed_rows!r}")
    if not packed_rows and not kind.packs_rows:
        raise InvalidRequestError(f"packed_rows=False turns off the {kinds_that(lambda k: k.packs_rows, 'and')} "
                                  f"backend's packed token rows; backend {backend!r} does not pack them (leave "
                                  "packed_rows at True)")
    kind.check_kv_update(kv_update)
    bundle = Path(bundle)
    manifest = load_manifest(bundle, verify=verify)
    quant = resolve_quant(bundle, quant)
    kind.check_quant(quant)
    engines = _engines(bundle, kind, quant, device, kv_update)
    if engines is not None:  # the engines say what runs: their variant and device, and the KV update they were built for
        quant, device = engines.quant, device or engines.device
        kv_update = engines.kv_update if kind.kv_update_built else kv_update
    tok_file = bundle / manifest.tokenizer / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise BundleError(f"cannot read tokenizer {tok_file}: {e}") from None
    if not kind.step_graphs:  # the module (quantized as it loads) or the engines, which hold what they were built from
        graphs = {}
    elif kv_update == "inplace":
        graphs = _in_place_graphs(bundle, quant, verify)
    else:
        graphs = _quantized_graphs(bundle, quant)
    prompt_tokens, refused, embeddings = _prompt_tokens(bundle, kind, quant, verify, graphs.get("target")
                                                        if kv_update == "inplace" else None)
    if prompt_tokens is not None and kind.prompt_tokens == "graph":  # the target graph with the prompt tokens' rows
        graphs["target"] = prompt_tokens.inplace_graph if kv_update == "inplace" else prompt_tokens.graph
    return ResolvedBundle(bundle, manifest, tokenizer, backend, resolve_threads(threads), resolve_device(backend, device),
                          quant, kv_update, packed_rows, engines, graphs, prompt_tokens, refused, embeddings)


def resolve_quant(bundle: Path, quant: str | None) -> str | None:
    """`quant` as given, or for "plan" the variant of the step graphs the bundle's plan.json picked (`specrt tune
    --variants`); refused where there is no usable plan."""
    if quant != "plan":
        return quant
    plan, why = artifacts.read(bundle, Plan)
    if plan is None:
        raise BundleError(f"quant='plan' needs the bundle's plan: {why}")
    return plan.quant


def _engines(bundle: Path, backend: BackendKind, quant: str | None, device: str | None, kv_update: str):
    """The engine backends' EngineSet / TrtEngineSet, refused where it was built from another variant, for another
    device, or without the in-graph KV update asked for; None for the backends that build nothing."""
    kind = backend.engines
    if kind is None:
        return None
    # static: each scheme's engines apart (quant/S/engines.json); trt: one set of plans, built from a variant
    engines = artifacts.load(bundle, kind, quant=quant)
    if quant is not None and quant != engines.quant:
        raise InvalidRequestError(f"{bundle / engines.FILE} was built from {variant_words(engines.quant)}: "
                                  f"rebuild with `{engines.command(bundle)} --quant {quant}` to run {quant}")
    if device is not None and str(device).split(":")[0] != engines.device.split(":")[0]:
        raise InvalidRequestError(f"{bundle / kind.FILE} was built for {engines.device}, not {device}: load "
                                  f"with that device or re-run `{kind.command(bundle)} --device {device}`")
    if backend.kv_update_built and kv_update == "inplace" and engines.kv_update != "inplace":
        raise InvalidRequestError(f"{bundle / engines.FILE} was built from the exported step graphs: rebuild "
                                  f"with `{engines.command(bundle)} --kv-update inplace` to run the in-graph update")
    return engines


def _prompt_tokens(bundle: Path, backend: BackendKind, quant: str | None, verify: bool | str, inplace: str | None = None):
    """(PromptTokens or None, why not, prompt embeddings for the torch backends or None). A bundle without
    usable prompt tokens loads as ever: only method "ppd" needs them, and says why they are missing. `inplace`: the
    in-graph target graph loaded (kv_update "inplace"), whose twin with the prompt tokens must be there and made from
    it."""
    if backend.prompt_tokens is None:
        return None, (f"{backend.no_prompt_tokens}: run PPD with backend "
                      f"{kinds_that(lambda k: k.prompt_tokens is not None)}"), None
    if not (bundle / PromptTokens.FILE).is_file():
        return None, f"{bundle} has no PPD prompt tokens: run `specrt ppd train --bundle {bundle}`", None
    try:
        tokens = artifacts.load(bundle, PromptTokens)
    except BundleError as e:
        return None, str(e), None
    redo = f"re-run `specrt ppd train --bundle {bundle}`"
    if quant is not None and quant not in TORCH_QUANT_SCHEMES:  # the torch schemes keep the embedding table
        return None, (f"PPD's prompt tokens are rows of the exported target graph, not of the {quant} variant: load "
                      "without quant"), None
    if backend.prompt_tokens == "graph":
        graph, sha = (tokens.inplace_graph, tokens.inplace_graph_sha256) if inplace else (tokens.graph, tokens.graph_sha256)
        if tokens.graph is None:
            return None, f"{bundle} has no ONNX graph with the prompt tokens (a --no-onnx export): use backend torch", None
        if inplace and (graph is None or tokens.inplace_source_sha256 != _sha_of(bundle, inplace)):
            return None, (f"{bundle}'s in-graph step graphs are newer than its PPD prompt tokens (or were made after "
                          f"them): {redo} to give them the prompt tokens too"), None
        if verify_files(bundle, {graph: sha}, verify) or not (bundle / graph).is_file():
            return None, f"{bundle / graph} is missing or changed since `specrt ppd train` wrote it: {redo}", None
        return tokens, None, None
    path = bundle / tokens.embeddings
    if verify_files(bundle, {tokens.embeddings: tokens.embeddings_sha256}, verify or True):
        return None, f"{path} is missing or changed since `specrt ppd train` wrote it: {redo}", None
    return tokens, None, np.load(path)


def _sha_of(bundle: Path, graph: str) -> str | None:
    """The recorded sha256 of the in-graph target graph `graph` (inplace.json)."""
    return next((g.sha256 for g in artifacts.load(bundle, InPlaceGraphs).graphs.values() if g.file == graph), None)


def _in_place_graphs(bundle: Path, quant: str | None, verify: bool | str) -> dict[str, str]:
    """role -> the in-graph step graph (relative to the bundle; `specrt inplace`), checked against inplace.json."""
    graphs = artifacts.load(bundle, InPlaceGraphs).graphs
    missing = [role for role in ("target", "draft") if role not in graphs]
    if missing:
        raise BundleError(f"{bundle} has no in-graph step graph of its {' and '.join(missing)}: run "
                          f"`specrt inplace --bundle {bundle}`")
    for g in graphs.values():
        if verify_files(bundle, {g.file: g.sha256}, verify) or not (bundle / g.file).is_file():
            raise BundleError(f"{bundle / g.file} is missing or changed since `specrt inplace` wrote it: re-run "
                              f"`specrt inplace --bundle {bundle}`")
    files = {role: g.file for role, g in graphs.items()}
    if quant is not None:  # the quantized twins (`specrt quantize --kv-update inplace`) made from these graphs; a model
        # without one runs its float in-graph graph, as a model without a variant runs its exported graph
        sources = {role: g.sha256 for role, g in graphs.items()}
        files.update(artifacts.load(bundle, QuantSet).graphs(bundle, quant, verify, sources))
    return files


def _quantized_graphs(bundle: Path, quant: str | None) -> dict[str, str]:
    """role -> the quantized step graph (relative to the bundle) of variant `quant`; {} without one."""
    if quant is None:
        return {}
    return artifacts.load(bundle, QuantSet).graphs(bundle, quant)

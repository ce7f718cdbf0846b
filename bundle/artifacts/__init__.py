"""Typed bundle artifacts, one module each: what calibration, profiling and tuning write into a bundle, and their one check.

    acceptance.json  Acceptance      `specrt calibrate`  how often the target accepts the draft's guesses
    latency.json     LatencyProfile  `specrt profile`    step latency L(n) per model, batch size and context
    plan.json        Plan            `specrt tune`       the speculation chosen per batch size
    plans/V.json     VariantPlan     `specrt tune`       the same for variant V alone (every variant tune weighed)
    engines.json     EngineSet       `specrt build`      static-shape steps per token-count profile (CUDA graphs)
    trt-engines.json TrtEngineSet    `specrt build --backend trt`  TensorRT plans, a profile per token-count range
    quant.json       QuantSet        `specrt quantize`   8-bit variants of the step graphs (ONNX Runtime)
    ppd.json         PromptTokens    `specrt ppd train`  PPD's trained prompt tokens, their graph and sparse trees
    inplace.json     InPlaceGraphs   `specrt inplace`    step graphs that write their K/V into the cache in place
    ngram-prior.json NgramPrior      `specrt ngram prior` the target's own text, the n-gram drafters' prior

Each is a frozen dataclass with a format version and a Stamp: the sha256 of the bundle's manifest it was
made from, the machine (backend, threads, device) it was measured on where that matters, and the sha256
of the artifacts it was derived from (a plan: acceptance.json and latency.json). `save` writes atomically;
`load` is the one place that checks them, and refuses with the command to re-run when the file is
missing, unreadable, of another format, made for another export, measured elsewhere, or derived from
artifacts that have changed since.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specrt.bundle.artifacts.acceptance import Acceptance, MeasuredTree, TreeEstimate
from specrt.bundle.artifacts.base import (EXPORTED, Artifact, Stamp, load, read, save, variant_quant,
                                          variant_words)
from specrt.bundle.artifacts.engines import HARDWARE_COMPATIBILITY, EngineSet, TrtEngineSet, environment
from specrt.bundle.artifacts.inplace import InPlaceGraph, InPlaceGraphs
from specrt.bundle.artifacts.latency import LatencyProfile, nondecreasing
from specrt.bundle.artifacts.ngram import NgramPrior
from specrt.bundle.artifacts.plan import CurvePoint, Plan, PlanChoice, VariantPlan
from specrt.bundle.artifacts.ppd import PathHit, PpdTree, PromptTokens
from specrt.bundle.artifacts.quant import QuantSet, QuantVariant
from specrt.bundle.machine import Machine
from specrt.errors import SpecrtError

__all__ = ["ARTIFACTS", "EXPORTED", "HARDWARE_COMPATIBILITY", "Acceptance",
           "Artifact", "CurvePoint", "EngineSet", "InPlaceGraph", "InPlaceGraphs", "LatencyProfile", "MeasuredTree",
           "NgramPrior", "PathHit", "Plan", "PlanChoice", "PpdTree", "PromptTokens", "QuantSet", "QuantVariant", "Stamp",
           "TreeEstimate", "TrtEngineSet", "VariantPlan", "environment", "load", "nondecreasing", "read", "save",
           "status", "variant_quant", "variant_words"]

ARTIFACTS = (Acceptance, LatencyProfile, Plan, EngineSet, TrtEngineSet, QuantSet, PromptTokens, InPlaceGraphs,
             NgramPrior)


def status(bundle: Path, machine: Machine | None = None) -> list[tuple[str, str]]:
    """(file, "ok" or why it would be refused) for every artifact type, and the plan of this machine's variant of the
    step graphs (plans/<variant>.json): what `specrt inspect` prints."""
    out = []
    for cls in (*ARTIFACTS, VariantPlan):
        name = cls.file(machine.quant if machine else None)
        measured = _picking(bundle, machine) if cls is Plan else machine
        try:
            load(bundle, cls, measured)
        except SpecrtError as e:
            out.append((name, str(e)))
            continue
        out.append((name, "ok" if measured == machine else
                    f"ok: picked {variant_words(measured.quant)} (quant='plan' runs it); this machine runs "
                    f"{variant_words(machine.quant)}, on {VariantPlan.file(machine.quant)}"))
    return out


def _picking(bundle: Path, machine: Machine | None) -> Machine | None:
    """This machine as plan.json would have measured it: on the variant of the step graphs the plan picked (a tune
    over variants may pick another than the machine runs; Evidence.plan then runs that variant's own plan)."""
    picked, _ = read(bundle, Plan)
    if machine is None or picked is None or picked.quant == machine.quant:
        return machine
    return dataclasses.replace(machine, quant=picked.quant)

"""Evidence: what a bundle's measured artifacts say about this machine, read when a method or a bench asks.

The plan (`specrt tune`), the latency profile (`specrt profile`) and the acceptance (`specrt calibrate`), each
refused where it was made for another export, machine or variant of the step graphs (bundle/artifacts), and what
the methods derive from them: the calibrated draft temperature, ANPD's hardware-aware round costs, PPD's tree; and
the n-gram drafters' prior (`specrt ngram prior`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import Acceptance, LatencyProfile, NgramPrior, Plan, VariantPlan, variant_words
from specrt.bundle.machine import Machine
from specrt.bundle.manifest import verify_files
from specrt.errors import BundleError
from specrt.runtime.cost import choose_ppd_tree, ngram_round_costs
from specrt.runtime.speculation import SPECULATION
from specrt.runtime.drafters.ngram import NgramTable


@dataclass(frozen=True)
class Evidence:
    bundle: Path
    machine: Machine  # artifacts are checked against it (backend, threads, device, quantized variant)

    def has_plan(self) -> bool:
        return (self.bundle / Plan.FILE).is_file()

    def plan(self) -> Plan:
        """plan.json, or where it picked another variant than this pipeline runs, this variant's own plan
        (plans/<variant>.json, VariantPlan), refused where there is none."""
        picked, _ = artifacts.read(self.bundle, Plan)
        if picked is not None and picked.quant != self.machine.quant:  # tuned over variants: it picked another
            if (self.bundle / VariantPlan.file(self.machine.quant)).is_file():
                return artifacts.load(self.bundle, VariantPlan, self.machine)
            what, here = variant_words(picked.quant), variant_words(self.machine.quant)
            load = f"quant={picked.quant!r} (--quant {picked.quant})" if picked.quant else "no quant"
            raise BundleError(f"{self.bundle / Plan.FILE} picked {what}, this pipeline runs {here}: load with "
                              f"{load} or quant='plan' (--quant plan), or re-run `specrt tune`")
        return artifacts.load(self.bundle, Plan, self.machine)

    def latency(self) -> LatencyProfile:
        return artifacts.load(self.bundle, LatencyProfile, self.machine)

    def acceptance(self) -> Acceptance:
        """acceptance.json, refused if it was measured on another variant of the step graphs (a quantized target
        accepts other drafts than the exported one)."""
        acc = artifacts.load(self.bundle, Acceptance, quant=self.machine.quant)
        measured = acc.config.get("quant")
        if measured != self.machine.quant:
            what, here = variant_words(measured), variant_words(self.machine.quant)
            flag = f" --quant {self.machine.quant}" if self.machine.quant else ""
            raise BundleError(f"{self.bundle / Acceptance.file(self.machine.quant)} was measured on {what}, this "
                              f"pipeline runs {here}: "
                              f"re-run `specrt calibrate --bundle {self.bundle}{flag}`")
        return acc

    def draft_temperature(self) -> float:
        """The calibrated draft temperature (acceptance.json), 1.0 (raw draft scores) if not calibrated: this
        variant's calibration, else the exported graphs' (it scales the draft's scores; `specrt calibrate --quant
        S` fits it to a quantized target)."""
        for quant in dict.fromkeys((self.machine.quant, None)):  # this variant's, else the exported graphs'
            if (self.bundle / Acceptance.file(quant)).is_file():
                return artifacts.load(self.bundle, Acceptance, quant=quant).draft_temperature
        return 1.0

    def ngram_round_costs(self, num_draft_tokens: int, batch_size: int) -> list[float]:
        """ANPD's hardware-aware round costs on this machine's latency profile (cost.ngram_round_costs)."""
        return ngram_round_costs(self.latency(), num_draft_tokens, batch_size, SPECULATION["ngram"].host)

    def ppd_tree(self, prompt_tokens, batch_size: int):
        """PPD's sparse tree for these prompt tokens on this machine: the one the latency profile predicts fastest at
        this batch size (the default size where this machine is not profiled), with the acceptance `specrt
        calibrate` measured by decoding where it measured these prompt tokens' trees (else the training-time
        table's)."""
        try:
            latency = self.latency()
        except BundleError:
            latency = None
        try:
            measured = self.acceptance().ppd_measured(prompt_tokens)
        except BundleError:
            measured = {}
        return choose_ppd_tree(prompt_tokens, latency, batch_size, measured)

    def ngram_table(self, max_n: int) -> NgramTable | None:
        """The n-gram drafters' prior of order max_n (ngram-prior.json), None where the bundle has none; refused
        where it was made for another export or its sequences changed since."""
        if not (self.bundle / NgramPrior.FILE).is_file():
            return None
        prior = artifacts.load(self.bundle, NgramPrior)
        if verify_files(self.bundle, {prior.data: prior.data_sha256}):
            raise BundleError(f"{self.bundle / prior.data} is missing or changed since `specrt ngram prior` wrote it: "
                              f"re-run `{NgramPrior.command(self.bundle)}`")
        return prior_table(str(self.bundle / prior.data), prior.data_sha256, max_n)


@functools.lru_cache(maxsize=4)
def prior_table(path: str, sha256: str, max_n: int) -> NgramTable:
    """One NgramTable per prior file and order in a process (sha256: a remade file is read again)."""
    with np.load(path) as z:
        ids, offsets = z["ids"], z["offsets"]
    return NgramTable(max_n, [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])])

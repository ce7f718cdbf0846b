"""plan.json: the tuned speculation choice per batch size, valid only where it was tuned.

`specrt tune` writes it from acceptance.json and latency.json; `method="auto"` reads it. A plan records
the machine fingerprint (specrt.machine), backend, threads and the sha256 of the bundle's manifest;
loading it on another machine, backend or export raises a BundleError that says how to re-tune.
"""

from __future__ import annotations

import json
from pathlib import Path

from specrt.errors import BundleError

PLAN = "plan.json"


def plan_fingerprint(bundle: Path, latency: dict) -> dict:
    from specrt.contract import MANIFEST
    from specrt.manifest import sha256_file

    return {"machine": latency["machine"], "manifest_sha256": sha256_file(Path(bundle) / MANIFEST)}


def load_plan(bundle: Path, machine: dict) -> dict:
    """The bundle's plan, checked against this machine's fingerprint and the bundle's manifest."""
    from specrt.contract import MANIFEST
    from specrt.machine import describe
    from specrt.manifest import sha256_file

    path = Path(bundle) / PLAN
    if not path.is_file():
        raise BundleError(f"no {PLAN} in {bundle}: run `specrt calibrate`, `specrt profile` and `specrt tune` "
                          f"(or `make calibrate profile tune OUT={bundle}`) on this machine first")
    plan = json.loads(path.read_text())
    if plan.get("machine") != machine:
        raise BundleError(f"{path} was tuned on {describe(plan.get('machine', {}))}, but this is "
                          f"{describe(machine)}: re-run `specrt profile` and `specrt tune` here")
    if plan.get("manifest_sha256") != sha256_file(Path(bundle) / MANIFEST):
        raise BundleError(f"{path} was tuned for another export of this bundle: re-run `specrt calibrate`, "
                          "`specrt profile` and `specrt tune`")
    return plan


def choice_for(plan: dict, batch_size: int) -> dict:
    """The plan entry of the largest tuned batch size <= batch_size (else the smallest)."""
    sizes = sorted(int(b) for b in plan["choices"])
    fit = [b for b in sizes if b <= batch_size]
    return plan["choices"][str(fit[-1] if fit else sizes[0])]

"""`specrt report`: one page that ties a bundle's profile, calibration, plan, engines and benchmarks together.

    specrt report --bundle B [--bench DIR] [--vs OTHER] --out DIR

writes DIR/report.md (plots as DIR/plots/*.svg), DIR/report.html (the same Markdown rendered, plots inline,
no network or other file needed to open it) and DIR/report.json (the facts it was made from: what `--vs`
reads back to compare two machines, backends or commits). Every figure names the command that re-makes it.

The facts come from the bundle's artifacts (read even when they would be refused here, with the reason
shown), its manifest, and the bench results in DIR that were made on this bundle's export (recorded by the
manifest hash; older results, which did not record it, by the bundle path). The bench section is the same
generator `specrt bench docs` writes docs/results.md and the README's results table with.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bench.catalog import bench_command, bench_results, bench_section, headline, rebuild_command, speed_rows
from specrt.bench.report_sections import (acceptance_section, bench_overview, comparison, latency_section,
                                          machine_section, plan_section, recommendation)
from specrt.bundle import artifacts
from specrt.bundle.artifacts import Acceptance, EngineSet, LatencyProfile, Plan, PromptTokens, QuantSet, TrtEngineSet
from specrt.files import write_atomic, write_json_atomic
from specrt.bundle.manifest import MANIFEST, BundleOptions, ModelEntry, load_manifest, manifest_sha256
from specrt.calibration.acceptance import CalibrationConfig
from specrt.calibration.latency import ProfileConfig
from specrt.config import option, to_flags
from specrt.errors import SpecrtError
from specrt.runtime.speculation import SPECULATION

FORMAT = 1


@dataclass(frozen=True)
class ReportConfig(BundleOptions):
    bench: Path | None = option(None, "a directory of bench results (*.json) to look through for runs on this bundle")
    vs: Path | None = option(None, "another bundle, or a report (its directory or report.json), to compare with")
    out: Path = option(Path("build/report"), "where report.html, report.md, report.json and plots/ go")


# -- facts -----------------------------------------------------------------------------------------
def _weight_bytes(bundle: Path, entry: ModelEntry) -> int:
    """What a one-token step of the model reads (the roofline's, as bench e2e prices it): its step graph's weights but
    a table only looked up; a bundle without graphs, its parameters at its dtype."""
    if entry.onnx and (bundle / entry.onnx).is_file():
        from specrt.engines.quantize import graph_bytes

        return graph_bytes(bundle / entry.onnx, streamed=True)
    return entry.num_params * np.dtype({"bfloat16": "float16"}.get(entry.dtype, entry.dtype)).itemsize


def _file_bytes(bundle: Path, name: str | None) -> int:
    """Bytes of a step graph and its external data (0: a bundle exported without ONNX graphs)."""
    if not name:
        return 0
    return sum(p.stat().st_size for p in (bundle / name, bundle / f"{name}.data") if p.is_file())


def _plain(obj):
    """Artifacts (frozen dataclasses) as JSON-ready data, with integer keys as strings."""
    from specrt.bundle.codec import to_data

    return json.loads(json.dumps(to_data(obj)))


def by_position_series(acceptance: Acceptance) -> dict:
    """Accepted drafted tokens per round by the output position rounds start at (acceptance grows along an output):
    sd's chain, ANPD's n-gram drafts and the merged trees."""
    from specrt.bundle.artifacts import CurvePoint
    from specrt.calibration.acceptance import position_acceptance
    from specrt.runtime.methods import Sd

    g = Sd.num_draft_tokens
    series = {f"sd (chain of {g})": position_acceptance(acceptance, CurvePoint(
        "chain", g, 0.0, 0.0, 0.0, 0.0, paths=tuple((0,) * d for d in range(1, g + 1))))}
    series.update({kind.words(m.num_nodes, m.ngram_tokens): m.accepted_by_position for kind in SPECULATION.values()
                   if kind.calibration and kind.calibration.by_position for m in kind.measured_trees(acceptance)})
    return {"bucket": acceptance.position_bucket, "series": {k: list(v) for k, v in series.items() if v}}


def collect(bundle: Path, bench: Path | None = None) -> dict:
    """Everything the report shows, as plain data (report.json)."""
    bundle = Path(bundle)
    if not (bundle / MANIFEST).is_file():
        raise SpecrtError(f"{bundle} is not a bundle (no {MANIFEST}): export one with `specrt export`")
    manifest = load_manifest(bundle, verify=False)
    sha = manifest_sha256(bundle)
    facts: dict = {"format": FORMAT, "bundle": bundle.as_posix(), "manifest_sha256": sha,
                   "created": time.strftime("%Y-%m-%d %H:%M"), "versions": manifest.versions,
                   "models": {}, "artifacts": {}}
    for role, entry in manifest.models.items():
        facts["models"][role] = {k: getattr(entry, k) for k in ("num_params", "dtype", "num_layers", "num_heads",
                                                             "num_kv_heads", "head_dim", "vocab_size", "model_type")}
        facts["models"][role]["weight_bytes"] = _weight_bytes(bundle, entry)
        facts["models"][role]["onnx_bytes"] = _file_bytes(bundle, entry.onnx)
        facts["models"][role]["export"] = manifest.export.get(role, {})
    read = {}
    for cls in artifacts.ARTIFACTS:
        artifact, state = artifacts.read(bundle, cls)
        read[cls] = artifact
        present = (bundle / cls.FILE).is_file()
        facts["artifacts"][cls.FILE] = {
            "state": state if present else "missing", "created": artifact.stamp.created if artifact else None,
            # what makes it: all its inputs where it is missing, itself alone where it exists
            "command": cls.command(bundle, artifact.stamp.machine if artifact else None, "stale" if present else "missing")}
    latency, acceptance, plan = read[LatencyProfile], read[Acceptance], read[Plan]
    if plan is not None and plan.quant:  # tuned over variants, it picked a quantized one: show its evidence
        latency, acceptance = (artifacts.read(bundle, cls, quant=plan.quant)[0] for cls in (LatencyProfile, Acceptance))
    facts["machine"] = _plain(latency.stamp.machine) if latency and latency.stamp.machine else None
    facts["latency"] = None if latency is None else {
        "curves": {role: {str(b): {str(n): round(latency.step_ms(role, b, n), 4) for n in sorted({n for c in per.values() for n in c})
                                   if n <= min(max(c) for c in per.values())}
                          for b, per in sorted(latency.models[role].items())} for role in latency.models},
        "contexts": sorted({c for per in latency.models["target"].values() for c in per}),
        "host_ms": _plain(latency.host_ms),
        "copy_bandwidth_gb_s": round(latency.copy_bandwidth / 1e9, 2),
        "roofline_ms": {role: latency.roofline_ms(m["weight_bytes"]) for role, m in facts["models"].items()},
        "command": rebuild_command("specrt profile", ProfileConfig, latency.config, bundle)}
    facts["acceptance"] = None if acceptance is None else {
        "depth_rank": acceptance.depth_rank, "chain_expected_accepted": acceptance.chain_expected_accepted,
        "draft_temperature": acceptance.draft_temperature, "num_positions": acceptance.num_positions,
        "rank_histogram": acceptance.rank_histogram,
        "trees": [(t.num_nodes, t.expected_accepted) for t in acceptance.trees],
        "by_position": by_position_series(acceptance),
        # measured by decoding: (what, accepted drafted tokens per round, its 5-95% interval over the prompts or None)
        "decoded": [(kind.words(m.num_nodes, m.ngram_tokens), m.expected_accepted, m.accepted_interval)
                    for kind in SPECULATION.values() for m in kind.measured_trees(acceptance)],
        "num_prompts": acceptance.config.get("num_prompts"),
        "command": rebuild_command("specrt calibrate", CalibrationConfig, acceptance.config, bundle)}
    facts["plan"] = None if plan is None else {
        "choices": _plain(plan.choices), "curves": _plain(plan.curves), "quant": plan.quant,
        "variants": _plain(plan.variants),
        "command": f"specrt tune --bundle {bundle.as_posix()} --batch-sizes {','.join(map(str, sorted(plan.choices)))}"
                   + (f" --variants {','.join(plan.variants)}" if plan.variants and len(plan.variants) > 1 else "")
                   + (f" --max-new-tokens {plan.new_tokens}" if plan.new_tokens else "")}
    facts["engines"] = {cls.FILE: _plain(read[cls]) for cls in (EngineSet, TrtEngineSet, QuantSet) if read[cls]}
    ppd = read[PromptTokens]
    facts["ppd"] = None if ppd is None else {
        "prompt_tokens": ppd.num_prompt_tokens, "ensemble": ppd.num_ensemble,
        "parameters": ppd.num_prompt_tokens * ppd.num_ensemble * ppd.hidden_size,
        "top1_by_distance": [row[0] for row in ppd.accuracy], "baseline_top1": [row[0] for row in ppd.baseline_accuracy],
        "budgets": [t.budget for t in ppd.trees]}
    facts["bench"], facts["bench_elsewhere"] = [], 0
    if bench is not None:
        if not Path(bench).is_dir():
            raise SpecrtError(f"--bench {bench}: no such directory")
        for path, verb, data in bench_results(bench)[0]:
            made_on = data.get("bundle_manifest_sha256")
            path_match = Path(data.get("config", {}).get("bundle", "")).resolve() == bundle.resolve()
            if made_on == sha or (made_on is None and path_match):
                facts["bench"].append({"file": path.as_posix(), "verb": verb, "label": data.get("label"),
                                       "date": data.get("date"), "matched": "manifest" if made_on else "path",
                                       "batch_size": data.get("config", {}).get("batch_size") or 1,
                                       "command": bench_command(verb, data), "headline": headline(verb, data),
                                       "rows": speed_rows(verb, data), "roofline": data.get("roofline")})
            else:
                facts["bench_elsewhere"] += 1
    return facts


def load_facts(other: Path, bench: Path | None) -> dict:
    """--vs: a report's facts (report.json, or a directory holding one), or a bundle's, collected now."""
    other = Path(other)
    path = other / "report.json" if other.is_dir() else other
    if other.is_dir() and (other / MANIFEST).is_file():
        return collect(other, bench)
    if not path.is_file():
        raise SpecrtError(f"--vs {other}: neither a bundle (no {MANIFEST}) nor a report (no report.json)")
    try:
        facts = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecrtError(f"--vs {path} is not valid JSON ({e})") from None
    if not isinstance(facts, dict) or facts.get("format") != FORMAT:
        raise SpecrtError(f"--vs {path} is not a report.json of format {FORMAT}: re-run `specrt report` for it")
    return facts


def markdown(facts: dict, command: str, other: dict | None = None, page_dir: Path = Path(".")) -> tuple[str, dict[str, str]]:
    """The report as Markdown for a page in `page_dir`, and the plots it references (source -> SVG text)."""
    plots: dict[str, str] = {}
    lines = [f"# specrt report: `{facts['bundle']}`", "",
             f"Made {facts['created']} by `{command}` (specrt {facts['versions'].get('specrt', '?')}); bundle manifest "
             f"sha256 `{facts['manifest_sha256'][:16]}`. Contents: what to run here; the machine, bundle and engines; "
             "step latency; acceptance; the tuner's evidence; benchmarks" + ("; the comparison." if other else "."), ""]
    lines += recommendation(facts) + machine_section(facts) + latency_section(facts, plots)
    lines += acceptance_section(facts, plots) + plan_section(facts, plots) + bench_overview(facts, plots)
    if facts["bench"]:
        results = [(Path(b["file"]), b["verb"], json.loads(Path(b["file"]).read_text())) for b in facts["bench"]
                   if Path(b["file"]).is_file()]
        lines += ["## Full bench tables", ""] + bench_section(results, page_dir, level=3)
    if other is not None:
        lines += comparison(facts, other, plots)
    return "\n".join(lines).rstrip() + "\n", plots


def run_report(cfg: ReportConfig) -> Path:
    """Write report.md, plots/*.svg, report.html and report.json into cfg.out; returns the HTML's path."""
    from specrt.bench.html import to_html

    facts = collect(cfg.bundle, cfg.bench)
    other = load_facts(cfg.vs, cfg.bench) if cfg.vs is not None else None
    command = f"specrt report {to_flags(cfg)}".strip()
    out = Path(cfg.out)
    md, plots = markdown(facts, command, other, out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for name, text in plots.items():
        write_atomic(out / name, text + "\n")
    write_atomic(out / "report.md", md)
    write_atomic(out / "report.html", to_html(md, f"specrt report: {facts['bundle']}", plots, out))
    write_json_atomic(out / "report.json", facts)
    print(f"wrote {out / 'report.html'}, {out / 'report.md'} ({len(plots)} plots) and {out / 'report.json'}")
    return out / "report.html"

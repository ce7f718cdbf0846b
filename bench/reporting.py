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

import importlib
import json
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from specrt.bench import svg
from specrt.bundle import artifacts
from specrt.bundle.artifacts import Acceptance, EngineSet, LatencyProfile, Plan, PromptTokens, QuantSet, TrtEngineSet
from specrt.bundle.files import write_atomic, write_json_atomic
from specrt.bundle.manifest import MANIFEST, BundleOptions, load_manifest, manifest_sha256
from specrt.calibration.acceptance import CalibrationConfig
from specrt.calibration.latency import ProfileConfig
from specrt.config import option, to_flags
from specrt.errors import SpecrtError

FORMAT = 1
VERBS = {"e2e": ("E2EConfig", "End to end"), "trees": ("TreesConfig", "Trees: measured vs predicted"),
         "ngram": ("NgramConfig", "ANPD ablation"), "mtad": ("MtadConfig", "MJSD / MTAD"),
         "soak": ("SoakConfig", "Memory soak"), "quant": ("QuantBenchConfig", "Quantized step graphs"),
         "ppd": ("PpdBenchConfig", "PPD: parallel prompt decoding"),
         "batch": ("BatchBenchConfig", "Batching: continuous against static, unpadded against padded, and predicted"),
         "load": ("LoadBenchConfig", "Start-up: fresh process to first token"),
         "serve": ("ServeBenchConfig", "Serving: a real Triton server against the same load in process")}
SHOWN_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)  # L(n) columns of the latency table, where profiled


@dataclass(frozen=True)
class ReportConfig(BundleOptions):
    bench: Path | None = option(None, "a directory of bench results (*.json) to look through for runs on this bundle")
    vs: Path | None = option(None, "another bundle, or a report (its directory or report.json), to compare with")
    out: Path = option(Path("build/report"), "where report.html, report.md, report.json and plots/ go")


# -- commands --------------------------------------------------------------------------------------
def rebuild_command(prefix: str, cls, config: dict, bundle: Path | None = None) -> str:
    """The command that re-makes a result from the config it recorded (fields this specrt no longer has are
    dropped; lists become tuples), for `bundle` where given (else the bundle the config names)."""
    names = {f.name for f in fields(cls)}
    kw = {k: tuple(map(tuple, v)) if k == "sweeps" else tuple(v) if isinstance(v, list) else v
          for k, v in config.items() if k in names}
    if bundle is not None or "bundle" in kw:
        kw["bundle"] = Path(bundle if bundle is not None else kw["bundle"])
    return f"{prefix} {to_flags(cls(**kw))}".strip()


def bench_command(verb: str, data: dict) -> str:
    """A bench result's command: recorded by newer runs, rebuilt from its config for older ones."""
    if data.get("command"):
        return data["command"]
    cls = getattr(importlib.import_module(f"specrt.bench.{verb}"), VERBS[verb][0])
    return rebuild_command(f"specrt bench {verb}", cls, data.get("config", {}))


# -- bench results ---------------------------------------------------------------------------------
def bench_results(directory: Path) -> tuple[list[tuple[Path, str, dict]], list[Path]]:
    """(path, verb, data) of every bench report in `directory`, sorted by name; and the other JSON files."""
    found, others = [], []
    for path in sorted(Path(directory).glob("*.json")):
        verb = path.stem.split("-")[0]
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            others.append(path)
            continue
        if verb in VERBS and isinstance(data, dict) and "rows" in data:
            found.append((path, verb, data))
        else:
            others.append(path)
    return found, others


def speed_rows(verb: str, data: dict) -> list[dict]:
    """A bench run's rows in one shape: name, tokens/s, speedup over the run's own autoregressive baseline,
    tokens per target call, and what the verb also measured (host share, roofline, energy, prediction)."""
    rows = data["rows"]
    if verb == "e2e":
        return [{"name": r["method"], "tokens_per_s": r["tokens_per_s"], "speedup": r.get("speedup_vs_ours_ar"),
                 "tokens_per_call": r.get("tokens_per_target_call"), "host_fraction": r.get("host_fraction"),
                 "roofline_fraction": r.get("roofline_fraction"), "joules_per_token": r.get("joules_per_token"),
                 "lossless": r.get("same_tokens_as_ours_ar") == 1} for r in rows]
    if verb == "trees":
        ar = next((r["measured_tokens_per_s"] for r in rows if r["kind"] == "autoregressive"), None)
        return [{"name": r["name"], "tokens_per_s": r["measured_tokens_per_s"],
                 "speedup": round(r["measured_tokens_per_s"] / ar, 3) if ar else None,
                 "tokens_per_call": r["tokens_per_target_call"], "predicted": r["predicted_tokens_per_s"],
                 "decode_tokens_per_s": r["decode_tokens_per_s"], "prediction_error": r["prediction_error"],
                 "lossless": bool(r["same_tokens_as_autoregressive"])} for r in rows]
    if verb == "ppd":
        return [{"name": r["name"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup_vs_ar"],
                 "tokens_per_call": r["tokens_per_target_call"], "lossless": r["same_tokens_as_ar"]} for r in rows]
    if verb == "batch":
        return [{"name": f"{r['method']}{' (padded)' if r.get('padded') else ''}, batch {r['batch_size']}, {r['batching']}",
                 "tokens_per_s": r["tokens_per_s"],
                 "speedup": r["speedup_vs_ar"], "tokens_per_call": None, "lossless": r["same_tokens_as_ar"]}
                for r in rows]
    if verb == "ngram":
        return [{"name": " ".join(str(r[k]) for k in ("method", "n", "k") if r.get(k) is not None),
                 "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup_vs_ar"],
                 "tokens_per_call": r["tokens_per_target_call"], "lossless": r.get("same_tokens_as_ar") in (True, 1)}
                for r in rows]
    if verb == "mtad":
        return [{"name": r["name"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup_vs_ar"],
                 "tokens_per_call": r["tokens_per_target_call"], "lossless": False} for r in rows]
    return []


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def headline(verb: str, data: dict) -> str:
    """One line a README reader can take away from a bench run, computed from its rows."""
    rows = speed_rows(verb, data)
    if verb in ("e2e", "trees", "ngram", "ppd"):
        ar = next((r for r in rows if r["name"] == "autoregressive"), None)
        ours = [r for r in rows if r["speedup"] is not None and r["name"] != "autoregressive"
                and not r["name"].startswith("hf") and r["lossless"]]
        if not ours or ar is None:
            return "no speculative row"
        best = max(ours, key=lambda r: r["speedup"])
        text = f"best lossless `{best['name']}` **{_x(best['speedup'])}** our AR ({best['tokens_per_s']:.1f} vs {ar['tokens_per_s']:.1f} tok/s)"
        if verb == "e2e":
            hf = next((r for r in data["rows"] if r["method"] == "hf"), None)
            if hf:
                text += f"; our AR {1 / hf['speedup_vs_ours_ar']:.2f}x HF `generate`" if hf.get("speedup_vs_ours_ar") else ""
            if any(r.get("roofline_fraction") for r in rows):
                text += f"; {best['roofline_fraction']:.1%} of the batch-1 roofline"
        if verb == "ppd":
            picked = next(r for r in rows if r["name"].startswith("ppd (picked"))
            text = (f"PPD (picked size) **{_x(picked['speedup'])}** our AR, {picked['tokens_per_call']:.2f} tokens per "
                    f"target call, no draft model; " + text)
        if verb == "trees":
            s = data["summary"]
            errors = [r["prediction_error"] for r in rows if r["prediction_error"] is not None]
            text = (f"batch {data['config'].get('batch_size', 1)}: tuned `{s['tuned_choice']}` / best measured = "
                    f"**{s['tuned_vs_best_measured']}**; " + text +
                    (f"; predictions {min(errors):+.0%} to {max(errors):+.0%}" if errors else ""))
        return text
    if verb == "batch":
        largest = max(r["batch_size"] for r in data["rows"])
        at = [r for r in data["rows"] if r["batch_size"] == largest]
        parts = [f"`{r['method']}` {r['continuous_vs_static']:.2f}x" for r in at
                 if r["continuous_vs_static"] is not None and not r.get("padded")]
        padded = [f"`{r['method']}` {r['unpadded_vs_padded']:.2f}x ({r['batching']})" for r in at
                  if r.get("unpadded_vs_padded") is not None]
        errors = [r["prediction_error"] for r in data["rows"] if r.get("prediction_error") is not None]
        auto = data.get("auto") or []
        same = all(r["same_tokens_as_ar"] for r in data["rows"])
        out = [f"continuous / static batching at batch {largest}: " + ", ".join(parts)] if parts else []
        out += [f"unpadded / padded at batch {largest}: {', '.join(padded)}"] if padded else []
        out += [f"predictions {min(errors):+.0%} to {max(errors):+.0%}"] if errors else []
        if auto and all(a["vs_ar"] for a in auto):
            out.append(f"`auto` {min(a['vs_ar'] for a in auto):.2f}x-{max(a['vs_ar'] for a in auto):.2f}x AR, "
                       f"{min(a['vs_best'] for a in auto):.2f}-{max(a['vs_best'] for a in auto):.2f} of the best row")
        out.append("every request's tokens as single-sequence AR's" if same else "SOME TOKENS DIFFER FROM AR")
        return "; ".join(out)
    if verb == "mtad":
        greedy = next((r for r in data["rows"] if r["method"] == "sd"), None)
        timed = [r for r in data["rows"] if r["tokens_per_s"] and r["method"] not in ("autoregressive", "sd")]
        if not timed:
            return "no timed MTAD row"
        best = min(timed, key=lambda r: r["perplexity"])
        text = f"lowest perplexity `{best['name']}` {best['perplexity']:.3f}"
        if greedy:
            text += (f" vs `sd` {greedy['perplexity']:.3f} (**{best['perplexity'] / greedy['perplexity'] - 1:+.1%}**), "
                     f"{best['tokens_per_s'] / greedy['tokens_per_s']:.2f}x `sd`'s tok/s")
        return text
    if verb == "soak":
        clients = data.get("config", {}).get("clients", 1)
        return "; ".join(f"batch {r['batch_size']}{f', {clients} client threads' if clients > 1 else ''}: "
                         f"**{r['rss_last_mb']:.0f} MB** resident at the end, {r['growth']:+.1%} over the run, "
                         f"{r['calls_per_s']:.2f} calls/s, {'passed' if r['passed'] else 'FAILED'}" for r in data["rows"])
    if verb == "load":
        modes = len(data["config"].get("verify", ())) > 1
        name = lambda r: f"`{r['bundle']}`" + (f" (verify {r['verify']})" if modes else "")  # noqa: E731
        first = data["rows"][0]
        text = f"{name(first)}: **{first['total_s']:.2f} s** to the first token (`Pipeline.load` {first['load_s']:.2f} s)"
        return "; ".join([text] + [f"{name(r)} {r['total_s']:.2f} s (load {r['load_vs_first']:.2f}x)"
                                   for r in data["rows"][1:]])
    if verb == "serve":
        most = max(r["clients"] for r in data["rows"])
        served = next(r for r in data["rows"] if r["way"] == "served" and r["clients"] == most)
        text = (f"{most} clients over Triton: **{served['tokens_per_s']:.1f} tok/s**, {served['vs_in_process']:.2f}x "
                f"in-process")
        if "vs_one_at_a_time" in served:
            text += f", {served['vs_one_at_a_time']:.2f}x served one request at a time"
        bad = sum(r["failed"] + r["wrong"] for r in data["rows"])
        return text + f", TTFT p50 {served['ttft_ms_p50']} ms; " + ("every answer right" if not bad else
                                                                    f"{bad} FAILED OR WRONG ANSWERS")
    if verb == "quant":
        parts = []
        for r in data["rows"][1:]:  # the first row is the exported pair, the baseline
            ar = r["methods"].get("autoregressive", {}).get("vs_exported_ar")
            best = r["methods"].get(r["best"], {}).get("vs_exported_ar")
            parts.append(f"`{r['variant']}`: AR {_x(ar)}, `{r['best']}` **{_x(best)}** the exported AR, perplexity "
                         f"{r['perplexity_delta']:+.1%}, top-1 agreement {r.get('top1_agreement') or 0:.1%}")
        return "; ".join(parts)
    return ""


def bench_section(results: list[tuple[Path, str, dict]], page_dir: Path, level: int = 2) -> list[str]:
    """Every bench result under its verb's heading: its own Markdown, the command that re-makes it, its plot."""
    import os

    lines = []
    for verb, (_, title) in VERBS.items():
        runs = [(p, d) for p, v, d in results if v == verb]
        if not runs:
            continue
        lines += [f"{'#' * level} {title}", ""]
        for path, data in runs:
            md = importlib.import_module(f"specrt.bench.{verb}").markdown(data).rstrip()
            if md.startswith("### "):  # each verb's Markdown starts with its run's heading
                md = "#" * (level + 1) + md[3:]
            lines += [md, "", f"Command: `{bench_command(verb, data)}` → `{path.as_posix()}`", ""]
            where = data.get("machine") or {}
            if where.get("cpu"):  # recorded since 2026-11-24
                features = ", ".join(where.get("cpu_features") or []) or "none of those recorded"
                lines += [f"Ran on: {where['cpu']}, {where.get('cpus')} cores ({features})", ""]
            png = path.with_suffix(".png")
            if png.is_file():
                lines += [f"![{path.stem}]({Path(os.path.relpath(png, page_dir)).as_posix()})", ""]
    return lines


def results_table(results: list[tuple[Path, str, dict]], docs_page: str) -> list[str]:
    """The README's results table: a headline per committed bench result, its date and where its table is."""
    lines = ["| result | measured | date | command |", "|---|---|---|---|"]
    for path, verb, data in results:
        anchor = re.sub(r"[^\w\- ]", "", VERBS[verb][1].lower()).replace(" ", "-")  # as GitHub makes heading anchors
        lines.append(f"| [`{path.stem}`]({docs_page}#{anchor}) | {headline(verb, data)} | {data.get('date', '-')} | "
                     f"`{bench_command(verb, data)}` |")
    return lines


# -- facts -----------------------------------------------------------------------------------------
def _weight_bytes(entry: dict) -> int:
    return int(entry["num_params"]) * np.dtype({"bfloat16": "float16"}.get(entry["dtype"], entry["dtype"])).itemsize


def _file_bytes(bundle: Path, name: str | None) -> int:
    """Bytes of a step graph and its external data (0: a bundle exported without ONNX graphs)."""
    if not name:
        return 0
    return sum(p.stat().st_size for p in (bundle / name, bundle / f"{name}.data") if p.is_file())


def _plain(obj):
    """Artifacts (frozen dataclasses) as JSON-ready data, with integer keys as strings."""
    from specrt.bundle.codec import to_data

    return json.loads(json.dumps(to_data(obj)))


def collect(bundle: Path, bench: Path | None = None) -> dict:
    """Everything the report shows, as plain data (report.json)."""
    bundle = Path(bundle)
    if not (bundle / MANIFEST).is_file():
        raise SpecrtError(f"{bundle} is not a bundle (no {MANIFEST}): export one with `specrt export`")
    manifest = load_manifest(bundle, verify=False)
    sha = manifest_sha256(bundle)
    facts: dict = {"format": FORMAT, "bundle": bundle.as_posix(), "manifest_sha256": sha,
                   "created": time.strftime("%Y-%m-%d %H:%M"), "versions": manifest.get("versions", {}),
                   "models": {}, "artifacts": {}}
    for role, entry in manifest["models"].items():
        facts["models"][role] = {k: entry.get(k) for k in ("num_params", "dtype", "num_layers", "num_heads",
                                                             "num_kv_heads", "head_dim", "vocab_size", "model_type")}
        facts["models"][role]["weight_bytes"] = _weight_bytes(entry)
        facts["models"][role]["onnx_bytes"] = _file_bytes(bundle, entry["onnx"])
        facts["models"][role]["export"] = manifest.get("export", {}).get(role, {})
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
        "copy_bandwidth_gb_s": round(latency.copy_bandwidth / 1e9, 2) if latency.copy_bandwidth else None,
        "roofline_ms": {role: latency.roofline_ms(m["weight_bytes"]) for role, m in facts["models"].items()},
        "command": rebuild_command("specrt profile", ProfileConfig, latency.config, bundle)}
    facts["acceptance"] = None if acceptance is None else {
        "depth_rank": acceptance.depth_rank, "chain_expected_accepted": acceptance.chain_expected_accepted,
        "draft_temperature": acceptance.draft_temperature, "num_positions": acceptance.num_positions,
        "rank_histogram": acceptance.rank_histogram,
        "trees": [(t.num_nodes, t.expected_accepted) for t in acceptance.trees],
        "by_position": by_position_series(acceptance),
        # measured by decoding: (what, accepted drafted tokens per round, its 5-95% interval over the prompts or None)
        "decoded": [(f"dynamic tree of {m.num_nodes} nodes", m.expected_accepted, m.accepted_interval)
                    for m in acceptance.dynamic] +
                   [(f"dynamic tree of {m.num_nodes} nodes + {m.ngram_tokens} n-gram drafts", m.expected_accepted,
                     m.accepted_interval) for m in acceptance.merged] +
                   [(f"ANPD, K = {m.num_nodes}", m.expected_accepted, m.accepted_interval) for m in acceptance.ngram] +
                   [(f"PPD sparse tree of {m.num_nodes} rows", m.expected_accepted, m.accepted_interval)
                    for m in acceptance.ppd],
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


# -- the page --------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _describe(point: dict) -> str:
    from specrt.calibration.tune import describe_point

    return describe_point(point["kind"], point["num_nodes"], point.get("ngram_tokens") or 0)


def _measured_for(facts: dict, batch: int, point: dict) -> tuple[dict | None, dict | None]:
    """The latest trees run at this batch size, and its row for the plan's choice (None where not measured): a run
    on this very export (manifest hash) before any older one matched only by the bundle's path."""
    runs = [b for b in facts["bench"] if b["verb"] == "trees" and b["batch_size"] == batch]
    if not runs:
        return None, None
    run = max(runs, key=lambda b: (b["matched"] == "manifest", b["date"] or "", b["file"]))
    name = "autoregressive" if point["kind"] == "autoregressive" else f"{point['kind']} {point['num_nodes']}"
    return run, next((r for r in run["rows"] if r["name"] == name), None)


def recommendation(facts: dict) -> list[str]:
    lines = ["## What to run here", ""]
    plan, lat = facts["plan"], facts["latency"]
    if plan is None:
        return lines + [f"No plan: run `{facts['artifacts']['plan.json']['command']}` (it weighs every speculation "
                        "against this machine's latency profile).", ""]
    state = facts["artifacts"]["plan.json"]["state"]
    if state != "ok":
        lines += [f"**The plan would be refused here:** {state}", ""]
    roof = lat["roofline_ms"]["target"] if lat else None
    variants = plan.get("variants") or {}
    if len(variants) > 1:
        lines += [f"Tuned over variants of the step graphs, the plan picked **{plan['quant'] or 'exported'}** (load "
                  f"with `--quant {plan['quant'] or 'plan'}`); predicted tok/s at batch "
                  f"{', '.join(map(str, next(iter(variants.values()))))}: "
                  + "; ".join(f"{v} {', '.join(f'{x:.1f}' for x in speed.values())}" for v, speed in variants.items())
                  + ". The figures below are the picked variant's.", ""]
    lines += ["`method=\"auto\"` runs, per batch size, what the tuner predicts fastest on this machine:", "",
              "| batch | run | predicted tok/s | vs autoregressive | measured tok/s (decode) | measured / predicted | "
              "of roofline |", "|---:|---|---:|---:|---:|---:|---:|"]
    why, older = [], False
    for b, choice in sorted(plan["choices"].items(), key=lambda kv: int(kv[0])):
        best = choice["best"]
        ar = next(p for p in plan["curves"][b] if p["kind"] == "autoregressive")
        run, row = _measured_for(facts, int(b), best)
        measured = row["decode_tokens_per_s"] if row else None
        ratio = f"{measured / best['predicted_tokens_per_s']:.2f}" if measured else "-"
        of_roof = (f"{best['predicted_tokens_per_s'] / (int(b) * 1e3 / roof):.1%}" if roof else "-")
        mark = "" if measured is None or run["matched"] == "manifest" else " †"
        lines.append(f"| {b} | {_describe(best)} | {best['predicted_tokens_per_s']:.1f} | {choice['predicted_speedup']:.2f}x | "
                     f"{'-' if measured is None else f'{measured:.1f}{mark}'} | {ratio} | {of_roof} |")
        older = older or bool(mark)
        if best["kind"] == "autoregressive":
            why.append(f"batch {b}: no speculation. One step of {b} tokens costs {_ms(ar['target_ms'])} (+ "
                       f"{_ms(ar['draft_ms'])} host); no drafted candidate's accepted tokens pay for its extra cost.")
        else:
            why.append(f"batch {b}: a round costs {_ms(best['target_ms'])} of target (verifying the drafts) + "
                       f"{_ms(best['draft_ms'])} of drafting and host work, and accepts {best['expected_accepted']:.2f} "
                       f"drafted tokens on average, so it emits {best['expected_accepted'] + 1:.2f} tokens per sequence per "
                       f"round: {best['predicted_tokens_per_s']:.1f} tok/s against autoregressive's "
                       f"{ar['predicted_tokens_per_s']:.1f} ({_ms(ar['target_ms'])} per step).")
        if run is not None:
            why[-1] += f" Measured by `{run['command']}` ({run['date']})."
    if older:
        lines += ["", "† from a trees run that predates manifest hashes in bench results, matched by the bundle's path "
                      "only: it may have measured another export, or another machine."]
    lines += ["", "Why:", ""] + [f"- {w}" for w in why]
    if roof:
        lines += ["", f"Roofline: a target step reads its {facts['models']['target']['weight_bytes'] / 1e6:.1f} MB of weights "
                      f"at least once; at the measured copy bandwidth ({lat['copy_bandwidth_gb_s']} GB/s) no step is "
                      f"faster than {roof:.3f} ms, so batch-b autoregressive decoding is bounded by b x {1e3 / roof:.0f} "
                      "tok/s. \"Of roofline\" is the predicted tok/s over that bound; speculation emits several tokens "
                      "per weight read, so it can pass 100%."]
    else:
        lines += ["", "Roofline: unknown (this latency profile predates bandwidth measurement: re-run "
                      f"`{facts['artifacts']['latency.json']['command']}`)."]
    return lines + [""]


def machine_section(facts: dict) -> list[str]:
    m = facts["machine"]
    lines = ["## Machine, bundle and engines", ""]
    if m:
        where = f"GPU {m['gpu']} ({m['device']})" if m.get("gpu") else m["device"]
        lines += [f"Profiled on {m['cpu']} ({m['cores']} cores, {m['arch']}), backend `{m['backend']}`"
                  f"{', ' + m['quant'] + ' step graphs' if m.get('quant') else ''}, {m['threads']} threads, {where}.", ""]
    else:
        lines += ["Not profiled yet: no machine recorded.", ""]
    lines += ["| model | params | layers | heads (KV) | dtype | weight MB | ONNX MB | exporter |",
              "|---|---:|---:|---:|---|---:|---:|---|"]
    for role, e in facts["models"].items():
        exporter = e["export"].get("exporter", "-")  # older bundles did not record it
        if e["export"].get("fallback"):
            exporter += " (fallback)"
        lines.append(f"| {role} | {e['num_params'] / 1e6:.2f}M | {e['num_layers']} | {e['num_heads']} ({e['num_kv_heads']}) | "
                     f"{e['dtype']} | {e['weight_bytes'] / 1e6:.1f} | {e['onnx_bytes'] / 1e6:.1f} | {exporter} |")
    lines += ["", "| artifact | state | made | command |", "|---|---|---|---|"]
    for name, a in facts["artifacts"].items():
        lines.append(f"| `{name}` | {a['state'].replace('|', '/')} | {a['created'] or '-'} | `{a['command']}` |")
    p = facts.get("ppd")
    if p:
        lines += ["", f"PPD prompt tokens (`ppd.json`): {p['prompt_tokens']} x {p['ensemble']} EPT(s), {p['parameters']} parameters; "
                      "top-1 guess accuracy by distance " + ", ".join(
                          f"{d + 2}: {a:.1%} (no prompt tokens {b:.1%})"
                          for d, (a, b) in enumerate(zip(p["top1_by_distance"], p["baseline_top1"])))
                  + f"; sparse trees of {', '.join(map(str, p['budgets']))} rows"]
    for name, e in facts["engines"].items():
        if name == QuantSet.FILE:
            lines += ["", f"Quantized variants (`{name}`): " + "; ".join(
                f"`{scheme}`: " + ", ".join(f"{role} {v['bytes'] / 1e6:.1f} MB" for role, v in per.items())
                for scheme, per in e["variants"].items())]
        else:
            lines += ["", f"Engines (`{name}`, {e['kind']} on {e['device']}"
                          f"{' ' + e['device_name'] if e.get('device_name') else ''}): token-count profiles "
                          f"{', '.join(map(str, e['token_profiles']))}; batch buckets {', '.join(map(str, e['batch_buckets']))}; "
                          f"capacity {e['capacity']}"
                          + (f" (attention spans {', '.join(map(str, e['spans']))})"
                             if len(e.get("spans", ())) > 1 else "")
                          + (f"; decoder layers torch.compile'd ({e['compile']})" if e.get("compile") else "")
                          + f"; {e['slots']} slot(s); built with "
                          + ", ".join(f"{k} {v}" for k, v in e["versions"].items())]
    return lines + [""]


def latency_section(facts: dict, plots: dict) -> list[str]:
    lat = facts["latency"]
    lines = ["## Step latency L(n)", ""]
    if lat is None:
        return lines + [f"Not profiled: run `{facts['artifacts']['latency.json']['command']}`.", ""]
    lines += [f"Median step time for n new tokens per sequence, averaged over contexts of "
              f"{', '.join(map(str, lat['contexts']))} cached tokens (what the tuner reads). Dashed: the roofline, "
              "weight bytes / measured copy bandwidth.", ""]
    for role, per_batch in lat["curves"].items():
        series = [svg.Series(f"batch {b}", tuple(map(int, c)), tuple(c.values())) for b, c in per_batch.items()]
        roof = lat["roofline_ms"].get(role)
        rules = [svg.Rule(roof, "roofline (one weight read)")] if roof else []
        plots[f"plots/latency-{role}.svg"] = svg.line_chart(f"{role}: step latency L(n)", "new tokens per sequence (n)",
                                                            "ms per step", series, rules, log_x=True)
        lines += [f"![{role} L(n) per batch size](plots/latency-{role}.svg)", ""]
    shown = [n for n in SHOWN_TOKENS if any(str(n) in c for per in lat["curves"].values() for c in per.values())]
    lines += ["| model | batch | " + " | ".join(f"L({n})" for n in shown) + " | roofline |",
              "|---|---:|" + "---:|" * (len(shown) + 1)]
    for role, per_batch in lat["curves"].items():
        for b, c in per_batch.items():
            lines.append(f"| {role} | {b} | " + " | ".join(f"{c[str(n)]:.2f}" if str(n) in c else "-" for n in shown)
                         + f" | {_ms(lat['roofline_ms'].get(role))} |")
    if lat["host_ms"]:
        lines += ["", "Host work per decode round (outside model calls, batch 1), ms by tree size: " + "; ".join(
            f"{kind}: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in table.items()) for kind, table in lat["host_ms"].items())]
    bw = lat["copy_bandwidth_gb_s"]
    lines += ["", f"Copy bandwidth: {bw} GB/s." if bw else "Copy bandwidth: not measured by this profile.", "",
              f"Command: `{lat['command']}`", ""]
    return lines


def by_position_series(acceptance: Acceptance) -> dict | None:
    """Accepted drafted tokens per round by the output position rounds start at (acceptance grows along an output):
    sd's chain, ANPD's n-gram drafts and the merged trees; None where the calibration predates these estimates."""
    from specrt.bundle.artifacts import CurvePoint
    from specrt.calibration.acceptance import position_acceptance
    from specrt.runtime.methods import Sd

    if not acceptance.position_bucket:
        return None
    g = Sd.num_draft_tokens
    series = {f"sd (chain of {g})": position_acceptance(acceptance, CurvePoint(
        "chain", g, 0.0, 0.0, 0.0, 0.0, paths=tuple((0,) * d for d in range(1, g + 1))))}
    series.update({f"ANPD, K = {m.num_nodes}": m.accepted_by_position for m in acceptance.ngram})
    series.update({f"dynamic {m.num_nodes} + {m.ngram_tokens} n-gram": m.accepted_by_position for m in acceptance.merged})
    return {"bucket": acceptance.position_bucket, "series": {k: list(v) for k, v in series.items() if v}}


def acceptance_section(facts: dict, plots: dict) -> list[str]:
    acc = facts["acceptance"]
    lines = ["## Acceptance", ""]
    if acc is None:
        return lines + [f"Not calibrated: run `{facts['artifacts']['acceptance.json']['command']}`.", ""]
    ranks = min(4, len(acc["depth_rank"][0]))
    lines += [f"How often the target accepts the draft's rank-r guess at depth d (given an accepted parent), on "
              f"{acc['num_positions']} held-out positions; calibrated draft temperature **{acc['draft_temperature']:.3f}**.", "",
              "| depth | " + " | ".join(f"rank {r}" for r in range(ranks)) + " | E[accepted], chain of d |",
              "|---:|" + "---:|" * (ranks + 1)]
    for d, (row, chain) in enumerate(zip(acc["depth_rank"], acc["chain_expected_accepted"]), start=1):
        lines.append(f"| {d} | " + " | ".join(f"{p:.3f}" for p in row[:ranks]) + f" | {chain:.3f} |")
    series = [svg.Series("chain of d tokens", tuple(range(1, len(acc["chain_expected_accepted"]) + 1)),
                         tuple(acc["chain_expected_accepted"]))]
    if acc["trees"]:
        series.append(svg.Series("best static tree of n nodes", tuple(n for n, _ in acc["trees"]),
                                 tuple(e for _, e in acc["trees"]), dashed=True, marker=False))
    plots["plots/acceptance.svg"] = svg.line_chart("expected accepted drafted tokens per round", "drafted tokens (nodes)",
                                                   "E[accepted]", series, log_x=True)
    lines += ["", "![expected accepted tokens: chains and calibrated trees](plots/acceptance.svg)", ""]
    by = acc.get("by_position")
    if by and by["series"]:
        plots["plots/acceptance-by-position.svg"] = svg.line_chart(
            "accepted drafted tokens per round, by where in the output a round starts", "output position",
            "accepted per round", [svg.Series(name, tuple(by["bucket"] * i for i in range(len(ys))), tuple(ys))
                                   for name, ys in by["series"].items()])
        lines += [f"Acceptance grows along an output (by buckets of {by['bucket']} output positions; the batch cost "
                  "model and `specrt tune --max-new-tokens` walk each output through it):", "",
                  "![accepted per round by output position](plots/acceptance-by-position.svg)", ""]
    if acc.get("decoded"):
        prompts = f"{acc['num_prompts']} calibration prompts" if acc["num_prompts"] else "calibration prompts"
        lines += [f"Measured by decoding the {prompts}; last column: the 5-95% "
                  "interval over resamples of those prompts (how much which prompts were drawn moves the figure: acceptance "
                  "depends on the text):", "", "| drafts | accepted per round | 5-95% over the prompts |", "|---|---:|---:|"]
        lines += [f"| {what} | {e:.2f} | " + ("-" if spread is None else f"{spread[0]:.2f}-{spread[1]:.2f}") + " |"
                  for what, e, spread in acc["decoded"]]
        lines.append("")
    lines += [f"Command: `{acc['command']}`", ""]
    return lines


def plan_section(facts: dict, plots: dict) -> list[str]:
    plan = facts["plan"]
    lines = ["## The tuner's evidence", ""]
    if plan is None:
        return lines + ["No plan.", ""]
    lines += ["Every candidate the tuner weighed at each batch size: predicted tokens/s (acceptance x latency) by "
              "the number of drafted nodes; where a trees bench ran at that batch size, its measured decode tokens/s "
              "are drawn beside the predictions.", ""]
    kinds = ("chain", "tree", "dynamic", "merged", "ngram", "ppd")
    for b, points in sorted(plan["curves"].items(), key=lambda kv: int(kv[0])):
        series = []
        for kind, color in zip(kinds, svg.COLORS):
            pts = sorted((p["num_nodes"], p["predicted_tokens_per_s"]) for p in points if p["kind"] == kind)
            if pts:
                series.append(svg.Series(f"{kind}: predicted", *map(tuple, zip(*pts)), marker=False, color=color))
        run, _ = _measured_for(facts, int(b), {"kind": "autoregressive", "num_nodes": 0})
        if run is not None:  # the same colour per kind, dashed with points: measured
            for kind, color in zip(kinds, svg.COLORS):
                pts = sorted((int(r["name"].split()[1]), r["decode_tokens_per_s"]) for r in run["rows"]
                             if r["name"].split()[0] == kind)
                if pts:
                    series.append(svg.Series(f"{kind}: measured", *map(tuple, zip(*pts)), dashed=True, color=color))
        ar = next(p for p in points if p["kind"] == "autoregressive")
        name = f"plots/plan-batch{b}.svg"
        plots[name] = svg.line_chart(f"batch {b}: predicted tokens/s per candidate", "drafted nodes per round",
                                     "tokens/s", series, [svg.Rule(ar["predicted_tokens_per_s"], "autoregressive")],
                                     log_x=True)
        lines += [f"![batch {b}: the tuner's candidates]({name})", ""]
    return lines + [f"Command: `{plan['command']}`", ""]


def bench_overview(facts: dict, plots: dict) -> list[str]:
    lines = ["## Benchmarks on this bundle", ""]
    if not facts["bench"]:
        return lines + ["No bench results given (`--bench DIR`) or none made on this bundle.", ""]
    if facts["bench_elsewhere"]:
        lines += [f"({facts['bench_elsewhere']} other result(s) in the bench directory were made on other bundles or "
                  "exports and are left out.)", ""]
    lines += ["| run | batch | headline | matched by | command |", "|---|---:|---|---|---|"]
    for b in facts["bench"]:
        lines.append(f"| `{Path(b['file']).stem}` ({b['date']}) | {b['batch_size']} | {b['headline']} | {b['matched']} | "
                     f"`{b['command']}` |")
    lines.append("")
    for i, b in enumerate(facts["bench"]):
        rows = [r for r in b["rows"] if r.get("tokens_per_s")]
        if not rows:
            continue
        groups = {"tokens/s": [r["tokens_per_s"] for r in rows]}
        rules = []
        ar = next((r for r in rows if r["name"] == "autoregressive"), None)
        if ar:
            rules.append(svg.Rule(ar["tokens_per_s"], "our autoregressive"))
        if b.get("roofline"):
            rules.append(svg.Rule(b["roofline"]["tokens_per_s"] * b["batch_size"], "AR roofline", "#d62728"))
        name = f"plots/bench-{i}-{Path(b['file']).stem}.svg"
        plots[name] = svg.bar_chart(f"{Path(b['file']).stem}: tokens/s (batch {b['batch_size']})", "tokens/s",
                                    [r["name"] for r in rows], groups, rules)
        lines += [f"![{Path(b['file']).stem}]({name})", ""]
        extra = [r for r in rows if r.get("roofline_fraction") or r.get("joules_per_token")]
        if extra:
            def cell(v, fmt="{}"):
                return "-" if v is None else fmt.format(v)

            lines += ["| method | tok/s | vs our AR | tokens/call | host share | of roofline | J/token |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {r['name']} | {r['tokens_per_s']:.1f} | {_x(r['speedup'])} | {cell(r['tokens_per_call'])} | "
                      f"{cell(r.get('host_fraction'), '{:.1%}')} | {cell(r.get('roofline_fraction'), '{:.1%}')} | "
                      f"{cell(r.get('joules_per_token'), '{:.3f}')} |" for r in extra]
            lines.append("")
    return lines


def _key_numbers(facts: dict) -> dict[str, float | str | None]:
    """What --vs sets side by side."""
    out: dict[str, float | str | None] = {}
    m = facts.get("machine")
    out["machine"] = (f"{m['gpu'] or m['cpu']}, {m['backend']}, {m['threads']} threads" if m else None)
    lat = facts.get("latency")
    for role in ("target", "draft"):
        for n in (1, 8, 32, 64):
            c = (lat or {}).get("curves", {}).get(role, {}).get("1", {})
            out[f"{role} L({n}) at batch 1, ms"] = c.get(str(n))
    out["copy bandwidth, GB/s"] = (lat or {}).get("copy_bandwidth_gb_s")
    acc = facts.get("acceptance")
    out["draft temperature"] = acc["draft_temperature"] if acc else None
    out["E[accepted], chain of 4"] = acc["chain_expected_accepted"][3] if acc and len(acc["chain_expected_accepted"]) > 3 else None
    plan = facts.get("plan")
    for b, c in sorted((plan or {}).get("choices", {}).items(), key=lambda kv: int(kv[0])):
        out[f"plan at batch {b}"] = _describe(c["best"])
        out[f"predicted tok/s at batch {b}"] = c["best"]["predicted_tokens_per_s"]
    for b in facts.get("bench", []):
        best = max(b["rows"], key=lambda r: r.get("tokens_per_s") or 0, default=None)
        if best and best.get("tokens_per_s"):
            out[f"{b['verb']} best tok/s, batch {b['batch_size']}"] = f"{best['tokens_per_s']:.1f} ({best['name']})"
    return out


def comparison(facts: dict, other: dict, plots: dict) -> list[str]:
    mine, theirs = _key_numbers(facts), _key_numbers(other)
    lines = ["## Compared with " + f"`{other['bundle']}`" + (f" (report of {other['created']})" if other.get("created") else ""), "",
             "| | this | other | this / other |", "|---|---|---|---:|"]
    def fmt(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = mine.get(key), theirs.get(key)
        if a is None and b is None:
            continue
        ratio = f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
        lines.append(f"| {key} | {fmt(a)} | {fmt(b)} | {ratio} |")
    series = []
    for label, f in (("this", facts), ("other", other)):
        c = ((f.get("latency") or {}).get("curves") or {}).get("target", {}).get("1")
        if c:
            series.append(svg.Series(f"{label}: target, batch 1", tuple(map(int, c)), tuple(c.values()), dashed=label == "other"))
    if series:
        plots["plots/vs-latency.svg"] = svg.line_chart("target L(n) at batch 1: this vs other", "new tokens (n)",
                                                       "ms per step", series, log_x=True)
        lines += ["", "![target latency, this vs other](plots/vs-latency.svg)"]
    return lines + [""]


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

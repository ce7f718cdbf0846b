"""The sections of `specrt report`'s page (bench/reporting.py): each a list of Markdown lines from the facts
`collect` gathered, with its plots (SVG) added to `plots`."""

from __future__ import annotations

from pathlib import Path

from specrt.bench import svg
from specrt.bench.report import ratio_text
from specrt.bundle.artifacts import QuantSet

SHOWN_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)  # L(n) columns of the latency table, where profiled


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
    lines += ["", f"Copy bandwidth: {bw} GB/s.", "",
              f"Command: `{lat['command']}`", ""]
    return lines


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
    from specrt.runtime.speculation import SPECULATION

    kinds = tuple(k.name for k in SPECULATION.values() if k.drafts)
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
            lines += [f"| {r['name']} | {r['tokens_per_s']:.1f} | {ratio_text(r['speedup'])} | {cell(r['tokens_per_call'])} | "
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

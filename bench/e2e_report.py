"""`specrt bench e2e`'s report: its Markdown table, where each row's time goes, and its plot (bench/e2e.py runs it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.bench.peers import peer_lines
from specrt.bench.quality import describe_divergence
from specrt.plotting import pyplot, save_figure

# our rows by default (the rest of a table: baselines and peers, drawn grey)
OURS = ("autoregressive", "sd", "anpd", "anpd-hw", "dynamic", "dynamic-ngram")


def markdown(data: dict) -> str:
    c = data["config"]
    gammas = ",".join(map(str, c["num_draft_tokens"]))
    roof = data.get("roofline")
    compiled = f" (layers compiled: {roof['compiled']})" if roof and roof.get("compiled") else ""
    where = f"backend {c.get('backend', 'ort')}{compiled}, {roof['device'] if roof else 'cpu'}, "
    kind = "chat" if c.get("prompt_set") == "chat" else "HumanEval"
    first = c.get("first_prompt") or 0
    which = f" (from prompt {first})" if first else ""
    lines = [f"### e2e `{data['label']}`: {c['num_prompts']} {kind} prompts{which}, {c['max_new_tokens']} new tokens, "
             f"greedy, batch 1, {where}{c['threads']} threads, sd γ={gammas}, median of {c['runs']} runs ({data['date']})",
             "", "| method | tokens/s | vs our AR | vs HF | TTFT ms | TPOT ms | tokens/target call | host share | "
                 "same tokens as our AR | of roofline | J/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt, unit=""):
        return "-" if v is None else format(v, fmt) + unit

    for r in data["rows"]:
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {f(r['speedup_vs_ours_ar'], '.2f', 'x')} | "
                     f"{f(r['speedup_vs_hf'], '.2f', 'x')} | {f(r.get('ttft_ms'), '.1f')} | {f(r.get('tpot_ms'), '.2f')} | "
                     f"{f(r['tokens_per_target_call'], '.2f')} | "
                     f"{f(r['host_fraction'], '.1%')} | {f(r['same_tokens_as_ours_ar'], '.0%')} | "
                     f"{f(r.get('roofline_fraction'), '.1%')} | {f(r.get('joules_per_token'), '.3f')} |")
    lines += ["", "- TTFT: median over prompts of the time from a prompt's start to its first new token; TPOT: the "
                  "time from each first new token to the last / the tokens after the first (bench/decoded.py)"
                  + ("; vs our AR, vs HF and the ratios against the peers: the median over the timed runs of the ratio "
                     "within each run (the rows' prompts interleave within a run: bench.report.paired_ratio)"
                     if data.get("ratios") == "paired" else "")]
    if roof:
        lines += [f"- roofline: {roof['weight_bytes'] / 1e9:.3f} GB of target weights / {roof['copy_bandwidth_gb_s']} "
                      f"GB/s measured copy bandwidth = {roof['ms_per_token']} ms per token ({roof['tokens_per_s']} "
                      f"tokens/s at batch 1); energy: {roof['energy']}"
                  + (f"; our target's weights in huge pages: {roof['huge_pages']}" if roof.get("huge_pages") else "")]
        states = [f"{roof[k]} GB/s {what}" for k, what in (("copy_bandwidth_gb_s_after", "after the runs"),
                                                            ("profile_copy_bandwidth_gb_s", "when the latency profile "
                                                             "the hardware-aware rows choose by was measured"))
                  if roof.get(k) is not None]
        if states:
            lines += [f"- copy bandwidth {roof['copy_bandwidth_gb_s']} GB/s before the runs, " + ", ".join(states)]
    ratios = data.get("summary", {}).get("ngram_speedup_over_hf_lookup_speedup")
    if ratios:
        lines += ["- n-gram speedup over our AR / HF prompt lookup's speedup over HF generate: "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())]
    lines += [f"- {line}" for line in peer_lines(data.get("summary", {}))]
    lines += [f"- {r['method']}: {describe_divergence(r['divergence'])}" for r in data["rows"] if r.get("divergence")]
    if data.get("partial"):
        lines += [f"- partial: {data['partial']} so far (the divergence check runs at the end)"]
    for name, why in data.get("skipped", {}).items():
        lines += [f"- {name} skipped: {why}"]
    lines += time_table(data["rows"])
    return "\n".join(lines) + "\n"


STAGE_WORDS = {"prefill": "prefill", "target": "target steps", "draft_model": "draft model", "host": "host",
               "other": "outside rounds"}


def time_table(rows: list[dict]) -> list[str]:
    """Where our rows spent their last timed run: the stages' shares of its wall time, the mean target step and the
    rows it verified (bench.decoded.STAGES)."""
    ours = [r for r in rows if r.get("time_shares")]
    if not ours:
        return []
    lines = ["", "Where the time goes (our rows, last timed run; host: each round outside the model steps, i.e. "
                 "drafting's Python, verification, cache bookkeeping):", "",
             "| method | " + " | ".join(STAGE_WORDS.values()) + " | target step ms | rows per step | tokens per step |",
             "|---|" + "---:|" * (len(STAGE_WORDS) + 3)]
    for r in ours:
        lines.append(f"| {r['method']} | " + " | ".join(f"{r['time_shares'][k]:.1%}" for k in STAGE_WORDS)
                     + f" | {r['target_step_ms']:.2f} | {r['rows_per_step']:.2f} | {r['tokens_per_target_call']:.2f} |")
    return lines


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = data["rows"]
    ours = [r for r in rows if r.get("time_shares")]
    fig, axes = plt.subplots(1, 2 if ours else 1, figsize=(12 if ours else 7, 3.2), squeeze=False)
    ax = axes[0, 0]
    ax.barh([r["method"] for r in rows], [r["tokens_per_s"] for r in rows],
            color=["tab:blue" if r["method"].split()[0] in OURS else "tab:gray" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median)")
    kind = "chat" if data["config"].get("prompt_set") == "chat" else "HumanEval"
    ax.set_title(f"e2e {data['label']}: {data['config']['num_prompts']} {kind} prompts, {data['config']['threads']} threads")
    if ours:  # where our rows' time goes, stacked
        ax = axes[0, 1]
        left = np.zeros(len(ours))
        for k, words in STAGE_WORDS.items():
            share = np.array([r["time_shares"][k] for r in ours])
            ax.barh([r["method"] for r in ours], share, left=left, label=words)
            left += share
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of wall time (last timed run)")
        ax.legend(fontsize=7, ncol=len(STAGE_WORDS), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    save_figure(fig, path)

"""`specrt bench kernels`: where a target step's time goes, kernel by kernel, against the bandwidth roofline.

    specrt bench kernels --bundle B --backend static --label h200-7b-compiled

torch.profiler (CPU and, on CUDA, device activities) over `--steps` one-token target steps, AR's step (its argmax
brought to the host after each, as AR reads it), and over as many verification steps of `--verify-tokens` rows, both
after `--context` cached tokens, as the backend runs them (the static engines: their CUDA graphs' replays). For each:
- the step's wall time on the host, split into host work before its first kernel, kernels, gaps between kernels,
  and the wait after the last one (the argmax's copy to the host);
- the top kernels by time, with the bytes their operators read and the rate that achieves against the measured
  copy bandwidth (the roofline's): bytes from one more profile of the same steps launched without graphs, where
  the profiler sees the operator and input shapes behind each kernel (each input at the model dtype's size; a
  kernel without an operator, e.g. inductor's fused ones, has none);
- the share of the step outside the weight GEMMs (kernels of operators one of whose inputs is a weight matrix).
On the CPU the "kernels" are the outermost aten operators (a
linear with its matmul). Writes kernels-LABEL.json|md|png (a row per kind of step: docs/results.md shows them).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from contextlib import nullcontext
from functools import lru_cache
from dataclasses import dataclass, replace

import numpy as np

from specrt.bench.report import BenchConfig, header, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import InvalidRequestError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends import BackendOptions

RANGE = "specrt-step-"  # the profiler range around each step
GATHERS = ("aten::embedding", "aten::index_select", "aten::index", "aten::gather")  # read rows, not their input
PARTS = ("host_before_ms", "weight_gemm_ms", "other_kernels_ms", "gaps_ms", "after_ms")


@dataclass(frozen=True)
class KernelsConfig(BenchConfig, BackendOptions):
    steps: int = option(8, "one-token target steps profiled, and as many verification steps (each kind after as "
                           "many untimed ones)", ge=1)
    verify_tokens: int = option(8, "rows of the verification step profiled", ge=2)
    context: int = option(256, "cached tokens before the profiled steps", ge=0)
    top: int = option(12, "kernels listed per step, the longest first", ge=1)


@dataclass
class Kernel:
    name: str
    start: float  # µs, on the profiler's clock
    end: float


def _profile(on_cuda: bool, shapes: bool, run) -> list:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities, record_shapes=shapes) as prof:
        run()
    return list(prof.events())


def _steps(runner, args, count: int) -> None:
    from torch.profiler import record_function

    for i in range(count):
        with record_function(f"{RANGE}{i}"):
            runner.step(*args, head="argmax")
            runner.wait()


def _is_shape(s) -> bool:
    return isinstance(s, (list, tuple)) and len(s) > 0 and all(isinstance(d, int) for d in s)


@lru_cache(maxsize=None)
def _is_view(name: str) -> bool:
    """Whether an aten operator returns an alias of its input (a view: it reads no bytes)."""
    import torch

    try:
        packet = getattr(torch.ops.aten, name.removeprefix("aten::"))
        schema = getattr(packet, packet.overloads()[0])._schema
    except (AttributeError, IndexError, RuntimeError):
        return False
    return any(r.alias_info is not None for r in schema.returns)


def _outermost(e) -> bool:
    """An aten operator no other aten operator called: on the CPU, the ops of a step, one after another."""
    if not e.name.startswith("aten::"):
        return False
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _launched(op, on_cuda: bool) -> list[tuple[str, float]]:
    """(kernel name, µs) of what an operator event ran itself: its device kernels, or on the CPU, an outermost
    operator (its own time, its callees' included)."""
    if on_cuda:
        return [(k.name, k.duration) for k in op.kernels]
    return [(op.name, op.time_range.elapsed_us())] if _outermost(op) else []


def kernels_of(events, on_cuda: bool) -> list[Kernel]:
    """The device kernels (copies included) of a profile, or on the CPU its outermost operators, by start."""
    from torch.autograd import DeviceType

    if on_cuda:
        chosen = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        chosen = [e for e in events if e.device_type == DeviceType.CPU and _outermost(e)]
    return sorted((Kernel(e.name, e.time_range.start, e.time_range.end) for e in chosen
                   if not e.name.startswith(RANGE)), key=lambda k: k.start)


def runtime_calls(events) -> list[Kernel]:
    """The host's CUDA runtime calls of a profile (cudaGraphLaunch, cudaLaunchKernel, cudaMemcpyAsync, ...), by start:
    what the host was inside while the device waited in a gap."""
    from torch.autograd import DeviceType

    return sorted((Kernel(e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CPU and e.name.startswith("cuda")), key=lambda k: k.start)


def operator_bytes(events, on_cuda: bool, weights: set, itemsize: int, steps: int) -> tuple[dict, set]:
    """({kernel name: bytes its operators read per step}, names of the weight GEMMs' kernels) from a profile of
    `steps` steps run without graphs, with input shapes. An operator's bytes go to the longest kernel it ran; a name
    is a weight GEMM's where operators with a weight-matrix input (a shape in `weights`) took most of its time."""
    bytes_by, weight_us, total_us = defaultdict(float), defaultdict(float), defaultdict(float)
    for op in events:
        if op.name.startswith(RANGE) or not (launched := _launched(op, on_cuda)):
            continue
        inputs = [tuple(s) for s in (op.input_shapes or ()) if _is_shape(s)]
        weight = op.name not in GATHERS and any(s in weights for s in inputs)
        if op.name not in GATHERS and not _is_view(op.name):
            bytes_by[max(launched, key=lambda k: k[1])[0]] += sum(int(np.prod(s)) for s in inputs) * itemsize
        for name, us in launched:
            total_us[name] += us
            weight_us[name] += us if weight else 0.0
    gemms = {n for n, us in total_us.items() if us and weight_us[n] >= us / 2}
    return {n: b / steps for n, b in bytes_by.items() if b}, gemms


def step_summary(ranges: list[tuple[float, float]], kernels: list[Kernel], per_kernel_bytes: dict, gemms: set,
                 bandwidth: float, top: int, calls: list[Kernel] = ()) -> dict:
    """Each step's wall time (its profiler range) split into host work before its first kernel, weight GEMMs, other
    kernels, gaps between kernels and the wait after the last, averaged over the steps; the top kernels by time; and
    of the host's runtime `calls` (runtime_calls), each step's longest (a graph's launch, a copy's wait)."""
    parts, gaps, by_name, counts = defaultdict(float), [], defaultdict(float), defaultdict(int)
    largest = []  # each step's longest gap (µs) and the kernel after it: a launch or a wait inside the step
    longest_calls = [max(((c.end - c.start, c.name) for c in calls if start <= c.start <= end), default=(0.0, ""))
                     for start, end in ranges]
    for start, end in ranges:
        ks = [k for k in kernels if start <= k.start <= end]
        if not ks:
            parts["host_before_ms"] += (end - start) / 1e3
            continue
        busy, reach, longest = 0.0, ks[0].start, (0.0, "")
        for k in ks:  # the union of the kernels' intervals (copies may overlap kernels)
            busy += max(0.0, k.end - max(k.start, reach))
            if k.start > reach:
                gaps.append(k.start - reach)
                longest = max(longest, (k.start - reach, k.name))
            reach = max(reach, k.end)
            by_name[k.name] += (k.end - k.start) / 1e3
            counts[k.name] += 1
        largest.append(longest)
        parts["host_before_ms"] += (ks[0].start - start) / 1e3
        parts["gaps_ms"] += (reach - ks[0].start - busy) / 1e3
        parts["after_ms"] += max(0.0, end - reach) / 1e3
        gemm = sum(k.end - k.start for k in ks if k.name in gemms) / 1e3
        parts["weight_gemm_ms"] += gemm
        parts["other_kernels_ms"] += busy / 1e3 - gemm
    n = len(ranges)
    wall = sum(end - start for start, end in ranges) / 1e3 / n
    out = {"steps": n, "wall_ms": round(wall, 4), **{p: round(parts[p] / n, 4) for p in PARTS},
           "kernels_per_step": round(sum(counts.values()) / n, 1),
           "gap_us_median": round(statistics.median(gaps), 2) if gaps else 0.0,
           "gap_us_max": round(max(gaps), 2) if gaps else 0.0,
           "longest_gap_us_mean": round(statistics.mean(g for g, _ in largest), 2) if largest else 0.0,
           "longest_gap_before": statistics.mode(name for _, name in largest)[:200] if largest else "",
           "outside_weight_gemm_share": round(1 - parts["weight_gemm_ms"] / n / wall, 4) if wall else None}
    if any(name for _, name in longest_calls):
        out["longest_call_us_mean"] = round(statistics.mean(us for us, _ in longest_calls), 2)
        out["longest_call"] = statistics.mode(name for _, name in longest_calls)
    gemm_bytes = sum(b for name, b in per_kernel_bytes.items() if name in gemms)
    gemm_s = parts["weight_gemm_ms"] / n / 1e3
    out["weight_gemm_of_bandwidth"] = round(gemm_bytes / gemm_s / bandwidth, 4) if gemm_s and gemm_bytes else None
    rows = []
    for name in sorted(by_name, key=by_name.get, reverse=True)[:top]:
        ms = by_name[name] / n
        b = per_kernel_bytes.get(name)
        rows.append({"kernel": name[:200], "calls": round(counts[name] / n, 1), "ms": round(ms, 4),
                     "share": round(ms / wall, 4), "weight_gemm": name in gemms,
                     "mb": round(b / 2**20, 2) if b else None,
                     "gb_s": round(b / ms / 1e6, 1) if b and ms else None,
                     "of_bandwidth": round(b / (ms / 1e3) / bandwidth, 4) if b and ms else None})
    out["top"] = rows
    return out


def weight_shapes(module) -> set:
    """Shapes (both ways round) of the weight matrices of a module's layers (a linear's, a quantized linear's buffer,
    an embedding's, the projections a step module merged), not of other matrices it holds (RoPE's rotation: its
    matmuls are no projections)."""
    shapes = set()
    for m in [*module.modules(), *getattr(module, "merged_projections", list)()]:
        w = getattr(m, "weight", None)
        if getattr(w, "dim", lambda: 0)() == 2:
            shapes |= {tuple(w.shape), tuple(w.shape)[::-1]}
    return shapes


def run_kernels(cfg: KernelsConfig) -> dict:
    import torch

    from specrt.bench.e2e import run_weight_bytes
    from specrt.bundle.artifacts.latency import roofline_ms
    from specrt.calibration.latency import copy_bandwidth, step_args
    from specrt.runtime.pipeline import Pipeline

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    backend = pipe.target
    module = getattr(backend, "module", None)
    if module is None:
        raise InvalidRequestError(f"bench kernels profiles a PyTorch step; the {backend.name} backend runs none: "
                                  f"--backend static or torch")
    on_cuda = backend.device.type == "cuda"
    itemsize = np.dtype(backend.entry.dtype).itemsize
    weight_bytes, bandwidth = run_weight_bytes(pipe), copy_bandwidth(pipe.machine.device, pipe.machine.threads)
    eager = getattr(backend, "without_graphs", nullcontext)
    engines = getattr(backend, "engines", None)
    data = {**header("kernels", cfg), "device": pipe.machine.gpu or pipe.machine.device, "backend": backend.name,
            "graphs": bool(getattr(backend, "cuda_graphs", False)), "compiled": getattr(engines, "compile", None),
            "weight_bytes": weight_bytes, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "roofline_ms": round(roofline_ms(weight_bytes, bandwidth), 4), "context": cfg.context, "rows": []}
    with backend.runner() as runner:
        for kind, tokens in (("ar", 1), ("verify", cfg.verify_tokens)):
            args = step_args(runner, 1, tokens, cfg.context)
            _steps(runner, args, cfg.steps)  # untimed: first replays, the allocator, the caches warm
            with eager():
                shaped = _profile(on_cuda, True, lambda: _steps(runner, args, cfg.steps))
            per_kernel, gemms = operator_bytes(shaped, on_cuda, weight_shapes(module), itemsize, cfg.steps)
            events = _profile(on_cuda, False, lambda: _steps(runner, args, cfg.steps))
            ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                            if e.name.startswith(RANGE) and e.device_type == torch.autograd.DeviceType.CPU)
            data["rows"].append({"kind": kind, "tokens": tokens, **step_summary(
                ranges, kernels_of(events, on_cuda), per_kernel, gemms, bandwidth, cfg.top, runtime_calls(events))})
    write_report(cfg.out / f"kernels-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    lines = [f"### kernels `{data['label']}`: where a target step's time goes ({data['date']})", "",
             f"Target step on {data['device']} ({data['backend']}, graphs: {data['graphs']}, compiled: "
             f"{data['compiled']}), {data['context']} cached tokens; roofline {data['roofline_ms']} ms "
             f"({data['weight_bytes'] / 1e9:.3f} GB of weights over a measured {data['copy_bandwidth_gb_s']} "
             f"GB/s).", ""]
    for s in data["rows"]:
        gemm = s["weight_gemm_of_bandwidth"]
        lines += [f"**{s['kind']}**: {s['tokens']} token(s) a step, mean of {s['steps']} step(s)", "",
                  "| wall ms | host before | weight GEMMs | other kernels | gaps | after | kernels | median gap µs | "
                  "outside weight GEMMs |", "|" + "---:|" * 9,
                  f"| {s['wall_ms']} | {s['host_before_ms']} | {s['weight_gemm_ms']} | {s['other_kernels_ms']} | "
                  f"{s['gaps_ms']} | {s['after_ms']} | {s['kernels_per_step']} | {s['gap_us_median']} | "
                  f"{s['outside_weight_gemm_share']:.1%} |", "",
                  (f"Weight GEMMs at {gemm:.1%} of the copy bandwidth." if gemm else
                   "Weight GEMMs: no bytes attributed.") + ("" if s.get("longest_gap_us_mean") is None else
                                                            f" A step's longest gap: {s['longest_gap_us_mean']} µs "
                                                            f"(mean), most often before "
                                                            f"`{s['longest_gap_before'][:80]}`.")
                  + ("" if s.get("longest_call") is None else f" The host's longest runtime call a step: "
                                                              f"`{s['longest_call']}`, {s['longest_call_us_mean']} µs "
                                                              f"(mean)."),
                  "", "| kernel | calls | ms | share | weight GEMM | MiB read | GB/s | of bandwidth |",
                  "|---|" + "---:|" * 7]
        for r in s["top"]:
            name = r["kernel"] if len(r["kernel"]) <= 110 else r["kernel"][:107] + "..."
            cells = [r["calls"], r["ms"], f"{r['share']:.1%}", "yes" if r["weight_gemm"] else "", r["mb"], r["gb_s"],
                     f"{r['of_bandwidth']:.1%}" if r["of_bandwidth"] is not None else None]
            lines.append(f"| `{name}` | " + " | ".join("" if c is None else str(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(data: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3))
    kinds = [r["kind"] for r in data["rows"]]
    left = np.zeros(len(kinds))
    for part in PARTS:
        values = np.array([r[part] for r in data["rows"]])
        ax.barh(kinds, values, left=left, label=part.removesuffix("_ms").replace("_", " "))
        left += values
    ax.axvline(data["roofline_ms"], color="black", linestyle="--", label="roofline")
    ax.set_xlabel("ms a step")
    ax.set_title(f"Where a target step's time goes: {data['label']}")
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)

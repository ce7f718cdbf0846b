"""`specrt bench serve`: concurrent clients over a real Triton Inference Server against the same load in process.

Three ways (four with --route openai) of serving one bundle, one method, greedy, measured in the same run:

    served               `specrt serve`'s tritonserver, clients over HTTP generate_stream (server-sent events) or gRPC
                         streaming (--client), threads of this process
    served-openai        the same server through `specrt serve`'s OpenAI-compatible route (/v1/completions, the
                         `openai` client, streamed as server-sent events; the tokens read from return_token_ids)
    in-process           Pipeline.server in this process, clients as threads reading Request.pieces()
    served, one at a time  the same tritonserver model with batches of one: requests served one after another,
                         as a decode-loop model without batching would

At each client count N, N clients each send `requests_per_client` requests one after another (HumanEval prompts,
`max_new_tokens` new tokens each) and stream the answers. Reported per (way, N), medians over the timed runs:
throughput (new tokens / wall time of the load), time to first token and inter-token latency (the time between
successive streamed pieces over the tokens of the later one: a speculative round delivers several at once), p50 and
p99 over every request and piece of the timed runs; and how many answers failed or differ from Pipeline.generate's
greedy tokens for that prompt (there should be none). Ways and client counts run interleaved, each run in a new
order. The servers start (and load the bundle) before any timing. Where the CPU goes is counted per load from /proc:
the CPU seconds a request took in this process (the clients; in-process, the decoding too), the OpenAI route's
process, the tritonserver and its decode-loop stubs, and how many of the machine's cores the load kept busy.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from specrt.bench.report import BenchConfig, header, write_report
from specrt.bundle.machine import resolve_threads
from specrt.config import option
from specrt.errors import InvalidRequestError, SpecrtError
from specrt.plotting import pyplot, save_figure
from specrt.runtime.backends import BackendOptions
from specrt.runtime.methods import METHODS

WAYS = ("served", "served-openai", "served-instances", "in-process", "served-one-at-a-time")


@dataclass(frozen=True)
class ServeBenchConfig(BenchConfig, BackendOptions):
    method: str = option("sd", "the method every request names", choices=tuple(METHODS))
    clients: tuple[int, ...] = option((1, 4, 16), "concurrent clients of each load", ge=1, nonempty=True)
    requests_per_client: int = option(4, "requests each client sends, one after another", ge=1)
    max_batch: int = option(16, "sequences one batched loop decodes at once (served and in-process alike)", ge=1)
    num_prompts: int = option(16, "HumanEval prompts the requests cycle through", ge=1)
    max_new_tokens: int = option(64, "new tokens per request", ge=1)
    server_dir: Path = option(Path("build/tritonserver"), "where the Triton server files are (installed on first use)")
    one_at_a_time: bool = option(True, "also serve the clients one request at a time (a second server, batches of 1)")
    stream_interval_ms: float = option(20.0, "the served model's stream interval (`specrt serve --stream-interval-ms`)",
                                       ge=0)
    client: str = option("http", "the served clients' protocol: http (generate_stream's server-sent events, or generate "
                                 "without --stream) or grpc (tritonclient's streaming; its Python client costs this "
                                 "machine's cores several times the HTTP one's per response)", choices=("http", "grpc"))
    stream: bool = option(True, "clients stream each answer as it is accepted (--no-stream: one response per request; "
                                "the time to first token is then the time to the whole answer)")
    instances: int = option(0, "also serve with this many decode-loop model instances (a server of its own, way "
                                "served-instances; --threads split between them), beside the one instance (0: not)",
                            ge=0)
    route: str = option("generate", "openai: also the OpenAI-compatible route in front of the same server (the `openai` "
                                    "client's /v1/completions), beside the generate endpoint", choices=("generate", "openai"))

    def __post_init__(self):
        super().__post_init__()
        if not self.clients or any(c < 1 for c in self.clients):
            raise InvalidRequestError(f"--clients must be counts >= 1, got {self.clients}")


@dataclass
class Timing:
    """One request, seen by its client."""

    sent: float
    pieces: list[tuple[float, int]]  # (arrival, tokens) of each streamed piece with tokens
    token_ids: list[int]
    error: str | None = None


def _served_client(server, jobs: list[str], cfg: ServeBenchConfig, out: list[Timing]) -> None:
    from specrt.serving.client import GrpcStream, HttpClient

    inputs = dict(MAX_NEW_TOKENS=cfg.max_new_tokens, METHOD=cfg.method)
    with GrpcStream(server.grpc_url) if cfg.client == "grpc" else HttpClient(server.http_url) as s:
        for prompt in jobs:
            t = Timing(time.perf_counter(), [], [])
            try:
                if isinstance(s, GrpcStream):
                    responses = s.generate(prompt, STREAM=cfg.stream, **inputs)
                else:
                    responses = s.stream(prompt, **inputs) if cfg.stream else iter([s.generate(prompt, **inputs)])
                for r in responses:
                    if r.get("TOKEN_IDS"):
                        t.pieces.append((time.perf_counter(), len(r["TOKEN_IDS"])))
                        t.token_ids += r["TOKEN_IDS"]
            except Exception as e:  # noqa: BLE001 - counted as a failed answer
                t.error = str(e)
            out.append(t)


def _openai_client(api, jobs: list[str], cfg: ServeBenchConfig, out: list[Timing]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=api.url, api_key="-", max_retries=0)
    body = {"method": cfg.method, "return_token_ids": True}
    for prompt in jobs:
        t = Timing(time.perf_counter(), [], [])
        try:
            answer = client.completions.create(model=api.model, prompt=prompt, max_tokens=cfg.max_new_tokens,
                                               temperature=0, stream=cfg.stream, extra_body=body)
            for chunk in answer if cfg.stream else [answer]:
                ids = chunk.choices[0].model_extra["token_ids"] if chunk.choices else []
                if ids:
                    t.pieces.append((time.perf_counter(), len(ids)))
                    t.token_ids += ids
        except Exception as e:  # noqa: BLE001 - counted as a failed answer
            t.error = str(e)
        out.append(t)


def _local_client(server, jobs: list[str], cfg: ServeBenchConfig, out: list[Timing]) -> None:
    for prompt in jobs:
        t = Timing(time.perf_counter(), [], [])
        try:
            request = server.submit(prompt, cfg.max_new_tokens)
            if cfg.stream:
                for piece in request.pieces():
                    if piece.token_ids:
                        t.pieces.append((time.perf_counter(), len(piece.token_ids)))
                        t.token_ids += piece.token_ids
            else:
                t.token_ids = request.result().token_ids
                t.pieces.append((time.perf_counter(), len(t.token_ids)))
        except Exception as e:  # noqa: BLE001
            t.error = str(e)
        out.append(t)


def _load(client, target, num_clients: int, prompts: list[str], cfg: ServeBenchConfig) -> tuple[float, list]:
    """(wall seconds, [(prompt index, Timing)]) of one load: num_clients threads, each its requests in turn."""
    jobs = [[(c * cfg.requests_per_client + k) % len(prompts) for k in range(cfg.requests_per_client)]
            for c in range(num_clients)]
    outs: list[list[Timing]] = [[] for _ in range(num_clients)]
    threads = [threading.Thread(target=client, args=(target, [prompts[i] for i in jobs[c]], cfg, outs[c]))
               for c in range(num_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return wall, [(i, t) for c in range(num_clients) for i, t in zip(jobs[c], outs[c])]


CPU_PARTS = ("clients", "route", "tritonserver", "decode loop")


def _cpu_seconds() -> dict[int, tuple[int, float]]:
    """(parent process id, user + system CPU seconds) of every process, read from /proc."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            out[int(proc.name)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / tick)
    return out


def _cpu_parts(before: dict, after: dict, server, api) -> dict[str, float]:
    """CPU seconds each part of a way used between two snapshots: this process (its clients), the route's process,
    the server's tritonserver process and its children (the models' Python-backend stubs: the decode loop)."""
    used = {pid: cpu - before.get(pid, (0, 0.0))[1] for pid, (_, cpu) in after.items()}
    parts = {"clients": used.get(os.getpid(), 0.0)}
    if api is not None:
        parts["route"] = used.get(api.process.pid, 0.0)
    if server is not None:
        parts["tritonserver"] = used.get(server.process.pid, 0.0)
        parts["decode loop"] = sum(used[pid] for pid, (parent, _) in after.items() if parent == server.process.pid)
    return parts


def _row(way: str, clients: int, loads: list, reference: list[list[int]]) -> dict:
    ttft, itl, tps, failed, wrong, cpu = [], [], [], 0, 0, []
    for wall, answers, parts in loads:
        tps.append(sum(len(t.token_ids) for _, t in answers) / wall)
        cpu.append({k: 1000 * v / len(answers) for k, v in parts.items()} | {"cores": sum(parts.values()) / wall})
        for i, t in answers:
            if t.error is not None:
                failed += 1
                continue
            wrong += t.token_ids != reference[i]
            ttft.append(t.pieces[0][0] - t.sent)
            itl += [(b - a) / n for (a, _), (b, n) in zip(t.pieces, t.pieces[1:])]
    q = (lambda xs, p: round(1000 * float(np.percentile(xs, p)), 2) if xs else None)
    return {"way": way, "clients": clients, "tokens_per_s": round(statistics.median(tps), 1),
            "tokens_per_s_runs": [round(x, 1) for x in tps], "ttft_ms_p50": q(ttft, 50), "ttft_ms_p99": q(ttft, 99),
            "itl_ms_p50": q(itl, 50), "itl_ms_p99": q(itl, 99), "requests": sum(len(a) for _, a, _ in loads),
            "failed": failed, "wrong": wrong,
            # ms of CPU a request took in each part (cores: CPU seconds over the wall time), median over the runs
            "cpu_ms_per_request": {k: round(statistics.median(c[k] for c in cpu), 2) for k in cpu[0]}}


def _start_server(cfg: ServeBenchConfig, files, max_batch: int, name: str, instances: int = 1):
    from specrt.serving.serve import ServeConfig, start
    from specrt.serving.tritonserver import free_ports

    http, grpc, metrics = free_ports(3)
    backend = {f.name: getattr(cfg, f.name) for f in fields(BackendOptions)}  # as the in-process pipeline loads
    serve = ServeConfig(bundle=cfg.bundle, out=Path("build") / "bench-serve" / f"{cfg.label}-{name}", **backend,
                        verify=cfg.verify, method=cfg.method, max_batch=max_batch, http_port=http, grpc_port=grpc,
                        stream_interval_ms=cfg.stream_interval_ms, metrics_port=metrics, server_dir=cfg.server_dir,
                        instances=instances)
    server, _ = start(serve, files)
    return server


def _serve_openai(served, port: int, ready, stop) -> None:
    from specrt.serving.openai_server import OpenAIServer

    api = OpenAIServer(served, "127.0.0.1", port).start()
    ready.set()
    stop.wait()
    api.stop()


class _OpenAIProcess:
    """`specrt serve`'s OpenAI-compatible route in front of a server, in a process of its own (as `specrt serve` runs
    it: apart from its clients, which here are this process's threads)."""

    def __init__(self, served, port: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.ready, self.stopping = ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=_serve_openai, args=(served, port, self.ready, self.stopping), daemon=True)
        self.url, self.model = f"http://127.0.0.1:{port}/v1", served.name

    def start(self) -> "_OpenAIProcess":
        self.process.start()
        if not self.ready.wait(120):
            self.stop()
            raise SpecrtError(f"the OpenAI-compatible route did not start on {self.url}")
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _start_openai(cfg: ServeBenchConfig, server) -> _OpenAIProcess:
    from specrt.bundle.manifest import load_manifest
    from specrt.serving.openai_server import Served
    from specrt.serving.tritonserver import free_ports

    tokenizer = Path(cfg.bundle) / load_manifest(cfg.bundle, False).tokenizer
    served = Served(Path(cfg.bundle).resolve().name, server.grpc_url, cfg.method, tokenizer)
    return _OpenAIProcess(served, free_ports(1)[0]).start()


def run_serve(cfg: ServeBenchConfig) -> dict:
    from tqdm import tqdm

    from specrt.bench.prompts import humaneval_prompts
    from specrt.runtime.pipeline import Pipeline
    from specrt.serving.tritonserver import locate

    cfg = replace(cfg, threads=resolve_threads(cfg.threads))
    prompts = humaneval_prompts(cfg.num_prompts)
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    reference = [pipe.generate(p, method="autoregressive", max_new_tokens=cfg.max_new_tokens).token_ids for p in prompts]
    files = locate(cfg.server_dir)
    servers = {"served": _start_server(cfg, files, cfg.max_batch, "batched")}
    api = None
    try:
        if cfg.route == "openai":
            api = _start_openai(cfg, servers["served"])
        if cfg.one_at_a_time:
            servers["served-one-at-a-time"] = _start_server(cfg, files, 1, "one")
        if cfg.instances:
            servers["served-instances"] = _start_server(cfg, files, cfg.max_batch, "instances", cfg.instances)
        local = pipe.server(cfg.method, cfg.max_batch)
        # way -> (its clients, what they call, the tritonserver and the route whose CPU it uses)
        targets = {"served": (_served_client, servers["served"], servers["served"], None),
                   "in-process": (_local_client, local, None, None)}
        if cfg.one_at_a_time:
            one = servers["served-one-at-a-time"]
            targets["served-one-at-a-time"] = (_served_client, one, one, None)
        if api is not None:
            targets["served-openai"] = (_openai_client, api, servers["served"], api)
        if cfg.instances:
            more = servers["served-instances"]
            targets["served-instances"] = (_served_client, more, more, None)
        loads: dict[tuple[str, int], list] = {(w, n): [] for w in targets for n in cfg.clients}
        rng = np.random.default_rng(0)
        with tqdm(total=(cfg.runs + 1) * len(loads), desc=f"bench serve {cfg.label}", unit="load") as bar:
            for run in range(cfg.runs + 1):  # the first untimed: warm-up of every way and client count
                keys = list(loads)
                for k in (keys if run == 0 else [keys[i] for i in rng.permutation(len(keys))]):
                    client, target, server, route = targets[k[0]]
                    before = _cpu_seconds()
                    wall, answers = _load(client, target, k[1], prompts, cfg)
                    if run:
                        loads[k].append((wall, answers, _cpu_parts(before, _cpu_seconds(), server, route)))
                    bar.update()
        local.close()
    finally:
        if api is not None:
            api.stop()
        for s in servers.values():
            s.stop()
    rows = [_row(w, n, loads[w, n], reference) for w, n in loads]
    by = {(r["way"], r["clients"]): r for r in rows}
    for r in rows:
        r["vs_in_process"] = round(r["tokens_per_s"] / by["in-process", r["clients"]]["tokens_per_s"], 3)
        if r["way"] in ("served-openai", "served-instances"):
            r["vs_generate"] = round(r["tokens_per_s"] / by["served", r["clients"]]["tokens_per_s"], 3)
        if ("served-one-at-a-time", r["clients"]) in by:
            r["vs_one_at_a_time"] = round(r["tokens_per_s"] / by["served-one-at-a-time", r["clients"]]["tokens_per_s"], 3)
    data = {**header("serve", cfg), "server": files.version, "rows": rows}
    write_report(Path(cfg.out) / f"serve-{cfg.label}", data, markdown, plot)
    return data


def markdown(data: dict) -> str:
    c = data["config"]
    streamed = f"streamed (interval {c['stream_interval_ms']:g} ms)" if c["stream"] else "not streamed"
    lines = [f"### serve `{data['label']}`: {c['method']}, greedy, {c['max_new_tokens']} new tokens a request, "
             f"{c['requests_per_client']} requests per client, batches of up to {c['max_batch']}, {streamed}, backend "
             f"{c['backend']}, {c['threads']} threads, tritonserver {data['server']}, median of {c['runs']} runs "
             f"({data['date']})", "",
             "| way | clients | tokens/s | vs in-process | vs served | vs one at a time | TTFT p50 / p99 (ms) "
             "| ITL p50 / p99 (ms) | failed / wrong |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(data["rows"], key=lambda r: (r["clients"], WAYS.index(r["way"]))):
        one = f"{r['vs_one_at_a_time']:.2f}x" if "vs_one_at_a_time" in r else "-"
        served = f"{r['vs_generate']:.2f}x" if "vs_generate" in r else "-"
        lines.append(f"| {r['way']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['vs_in_process']:.2f}x | {served} | {one} | "
                     f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} | "
                     f"{r['failed']} / {r['wrong']} of {r['requests']} |")
    client = {"http": "HTTP (`generate_stream`, server-sent events)" if c.get("stream", True) else "HTTP (`generate`)",
              "grpc": "gRPC (tritonclient)"}[c.get("client", "grpc")]
    lines += ["", f"served: `specrt serve`'s tritonserver, clients over {client}, in this process; served-openai: the "
                  "same server through the OpenAI-compatible route (the `openai` client, /v1/completions); "
                  + (f"served-instances: a server of {c['instances']} decode-loop instances; " if c.get("instances")
                     else "") + "in-process: "
                  "`Pipeline.server` in the bench's process; one at a time: the served model with batches of 1. "
                  "Wrong: tokens other than `Pipeline.generate`'s greedy ones for the prompt. ITL: time between "
                  "streamed pieces over the tokens of the later one."]
    rows = [r for r in data["rows"] if "cpu_ms_per_request" in r]
    if rows:
        lines += ["", "Where the CPU goes (ms of CPU a request, median over the timed runs, read from /proc; cores "
                      "busy: the load's CPU seconds over its wall time, on this machine's "
                      f"{data.get('machine', {}).get('cpus', '?')} cores):", "",
                  "| way | clients | " + " | ".join(CPU_PARTS) + " | total | cores busy |",
                  "|---|---:|" + "---:|" * (len(CPU_PARTS) + 2)]
        for r in sorted(rows, key=lambda r: (r["clients"], WAYS.index(r["way"]))):
            cpu = r["cpu_ms_per_request"]
            cells = [f"{cpu[k]:.1f}" if k in cpu else "-" for k in CPU_PARTS]
            total = sum(v for k, v in cpu.items() if k != "cores")
            lines.append(f"| {r['way']} | {r['clients']} | " + " | ".join(cells)
                         + f" | {total:.1f} | {cpu['cores']:.2f} |")
        lines += ["", "clients: this process, where the clients run (in-process: the decoding too); route: the OpenAI "
                      "route's process; tritonserver: its own process; decode loop: its Python-backend stubs."]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for way in WAYS:
        rows = sorted((r for r in data["rows"] if r["way"] == way), key=lambda r: r["clients"])
        if not rows:
            continue
        xs = [r["clients"] for r in rows]
        a.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=way)
        b.plot(xs, [r["ttft_ms_p50"] for r in rows], marker="o", label=way)
    for ax, what in ((a, "tokens/s (median)"), (b, "time to first token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"serve {data['label']}")
    save_figure(fig, path)


def headline(data: dict) -> str:
    """One line a README reader can take away from a run, computed from its rows."""
    most = max(r["clients"] for r in data["rows"])
    served = next(r for r in data["rows"] if r["way"] == "served" and r["clients"] == most)
    text = (f"{most} clients over Triton: **{served['tokens_per_s']:.1f} tok/s**, {served['vs_in_process']:.2f}x "
            f"in-process")
    if "vs_one_at_a_time" in served:
        text += f", {served['vs_one_at_a_time']:.2f}x served one request at a time"
    text += f", TTFT p50 {served['ttft_ms_p50']} ms"
    api = next((r for r in data["rows"] if r["way"] == "served-openai" and r["clients"] == most), None)
    if api is not None:
        text += f"; the OpenAI route {api['tokens_per_s']:.1f} tok/s, {api['vs_generate']:.2f}x the generate endpoint"
    more = next((r for r in data["rows"] if r["way"] == "served-instances" and r["clients"] == most), None)
    if more is not None:
        text += f"; {data['config']['instances']} instances {more['vs_generate']:.2f}x one"
    bad = sum(r["failed"] + r["wrong"] for r in data["rows"])
    return text + "; " + ("every answer right" if not bad else f"{bad} FAILED OR WRONG ANSWERS")

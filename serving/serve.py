"""`specrt serve --bundle B`: the bundle behind a real Triton Inference Server, in one command.

Finds the server (or installs its files: serving/tritonserver.py), writes the model repository (serving/triton.py),
starts tritonserver on 127.0.0.1 (by default) loading only the models whose backends it has, waits until they are
ready, prints the endpoints and a curl line, and runs until Ctrl-C or SIGTERM, when it stops the server and every
stub process it started.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from specrt.config import option
from specrt.errors import SpecrtError
from specrt.serving.triton import DECODE_MODEL, TritonConfig, write_repository
from specrt.serving.tritonserver import ServerFiles, TritonServer, locate


@dataclass(frozen=True)
class ServeConfig(TritonConfig):
    host: str = option("127.0.0.1", "address the HTTP, gRPC and metrics endpoints listen on (0.0.0.0: every "
                                    "interface)")
    http_port: int = option(8000, "HTTP port (generate, generate_stream, KServe v2)", ge=1, le=65535)
    grpc_port: int = option(8001, "gRPC port (KServe v2, streaming)", ge=1, le=65535)
    metrics_port: int = option(8002, "Prometheus metrics port", ge=1, le=65535)
    server_dir: Path = option(Path("build/tritonserver"), "where the server files are (installed there on first use "
                                                          "from the nvidia-pytriton wheel)")
    tritonserver: Path | None = option(None, "a tritonserver binary of a full Triton install instead (its backends "
                                             "beside it, in ../backends)")
    install: bool = option(True, "install the server files when missing (--no-install: refuse instead)")
    ready_timeout: float = option(600.0, "seconds to wait for the models to load", gt=0)


def repository_config(cfg: ServeConfig) -> TritonConfig:
    return TritonConfig(**{f.name: getattr(cfg, f.name) for f in fields(TritonConfig)})


def start(cfg: ServeConfig, files: ServerFiles | None = None, log: Path | None = None) -> tuple[TritonServer, dict]:
    """Locate the server (unless given its files), write the repository, start the server on it and wait until it is
    ready; returns (the running server, the repository's info). The caller stops it."""
    files = files or locate(cfg.server_dir, cfg.tritonserver, cfg.install)
    info = write_repository(repository_config(cfg))
    have = set(files.backends)
    models = [m for m, backend in info["backends"].items() if backend in have]
    if DECODE_MODEL not in models:
        raise SpecrtError(f"{files.backend_dir} has no python backend, which the decode-loop model runs on")
    server = TritonServer(files, cfg.out, models, cfg.host, cfg.http_port, cfg.grpc_port, cfg.metrics_port, log)
    server.start()
    try:
        server.wait_ready(cfg.ready_timeout)
    except BaseException:
        server.stop()
        raise
    info["loaded"] = models
    info["skipped"] = {m: b for m, b in info["backends"].items() if b not in have}
    return server, info


def serve(cfg: ServeConfig) -> None:
    """Run the server until Ctrl-C / SIGTERM (or until it exits)."""
    files = locate(cfg.server_dir, cfg.tritonserver, cfg.install)
    print(f"starting tritonserver {files.version} on {cfg.host} for {cfg.bundle} ({cfg.backend} backend, method "
          f"{cfg.method} by default, batches of up to {cfg.max_batch}) ...", file=sys.stderr, flush=True)
    stopping = threading.Event()

    def _stop(signum, frame):
        stopping.set()

    previous = signal.signal(signal.SIGTERM, _stop)
    server = None
    try:
        server, info = start(cfg, files)
        skipped = ", ".join(f"{m} (no {b} backend here)" for m, b in info["skipped"].items())
        host = "127.0.0.1" if cfg.host == "0.0.0.0" else cfg.host
        body = json.dumps({"PROMPT": "def fibonacci(n):", "MAX_NEW_TOKENS": 64})
        print(f"ready: models {', '.join(info['loaded'])}" + (f"; not loaded: {skipped}" if skipped else ""))
        print(f"  HTTP     http://{host}:{cfg.http_port}/v2/models/{DECODE_MODEL}/generate (and generate_stream)")
        print(f"  gRPC     {host}:{cfg.grpc_port} (streaming: tritonclient.grpc start_stream / async_stream_infer)")
        print(f"  metrics  http://{host}:{cfg.metrics_port}/metrics")
        print(f"  log      {server.log}")
        print(f"try: curl -s -X POST http://{host}:{cfg.http_port}/v2/models/{DECODE_MODEL}/generate -d '{body}'")
        print("Ctrl-C stops it.", flush=True)
        while not stopping.is_set() and server.process.poll() is None:
            stopping.wait(0.5)
        if not stopping.is_set():
            raise SpecrtError(f"tritonserver exited (status {server.process.returncode}); {server.log}:\n"
                              f"{server.log_tail()}")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if server is not None:
            print("stopping tritonserver ...", file=sys.stderr, flush=True)
            code = server.stop()
            print(f"stopped (status {code})", file=sys.stderr)

"""`specrt serve --bundle B`: the bundle behind a real Triton Inference Server, in one command.

Finds the server (or installs its files: serving/tritonserver.py), writes the model repository (serving/triton.py),
starts tritonserver on 127.0.0.1 (by default) loading only the models whose backends it has, waits until they are
ready, puts the OpenAI-compatible routes in front of it (serving/openai_server.py), prints the endpoints and a curl
line, and runs until Ctrl-C or SIGTERM, when it stops the server and every stub process it started. Meanwhile a
decode-loop model whose stub process died is reloaded (Revive).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
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
    openai_port: int = option(9000, "port of the OpenAI-compatible routes (/v1/completions, /v1/chat/completions, "
                                    "/v1/models) in front of the server (0: none)", ge=0, le=65535)
    served_model_name: str | None = option(None, "the model id OpenAI clients name (default: the bundle directory's "
                                                 "name)")
    chat_template: Path | None = option(None, "a Jinja chat template file for /v1/chat/completions instead of the "
                                              "tokenizer's own (for a tokenizer that has none)")


def start(cfg: ServeConfig, files: ServerFiles | None = None, log: Path | None = None) -> tuple[TritonServer, dict]:
    """Locate the server (unless given its files), write the repository, start the server on it and wait until it is
    ready; returns (the running server, the repository's info). The caller stops it."""
    files = files or locate(cfg.server_dir, cfg.tritonserver, cfg.install)
    info = write_repository(TritonConfig.part_of(cfg))
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


def start_openai(cfg: ServeConfig):
    """The OpenAI-compatible routes in front of the server that `start` runs, listening once this returns (None where
    --openai-port is 0)."""
    if not cfg.openai_port:
        return None
    from specrt.bundle.manifest import load_manifest

    try:
        from specrt.serving.openai_server import OpenAIServer, Served
    except ImportError as e:
        raise SpecrtError(f"the OpenAI-compatible routes need FastAPI, uvicorn and sse-starlette ({e}): pip install "
                          "'specrt[serve]', or --openai-port 0 to serve without them") from None

    bundle = Path(cfg.bundle)
    tokenizer = bundle / load_manifest(bundle, False).tokenizer
    if cfg.chat_template is not None and not Path(cfg.chat_template).is_file():
        raise SpecrtError(f"--chat-template {cfg.chat_template} is not a file")
    grpc = f"{'127.0.0.1' if cfg.host == '0.0.0.0' else cfg.host}:{cfg.grpc_port}"
    served = Served(cfg.served_model_name or bundle.resolve().name, grpc, cfg.method, tokenizer, cfg.chat_template)
    return OpenAIServer(served, cfg.host, cfg.openai_port).start()


class Revive:
    """Watches the decode-loop model's stub processes (one per instance) and, where one has died (the OOM killer, a
    crash), reloads the model through Triton's repository API: readiness turns false at once (the model unloaded), the
    requests in flight end with an error, and the next ones are answered once it is loaded again. Triton itself keeps
    answering ready over a dead stub, failing every request. Where the server's own process has exited (a stub's death
    can abort it: TritonServer.restart), it is started again, unless it exits again before it is ready: then Revive
    gives up (`gave_up` says why) and ends."""

    def __init__(self, server: TritonServer, model: str = DECODE_MODEL, interval: float = 0.5, log=sys.stderr):
        self.server, self.model, self.interval, self.log = server, model, interval, log
        self.on_death: list = []  # called (from this thread) as a stub or the server is found dead, before the reload
        self.known = server.stubs(model)  # the stubs' process ids, looked at alone while they all live
        self.expected = len(self.known)
        self.revived = self.restarts = 0  # reloads and restarts, and restarts alone
        self.gave_up: str | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specrt-revive", daemon=True)

    def start(self) -> "Revive":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            if self._dead():
                if not self._restart():
                    return
                continue
            if len(self.server.stubs(self.model, among=self.known)) >= self.expected:
                continue
            self.known = self.server.stubs(self.model)  # every process looked at: one may have been started anew
            if len(self.known) >= self.expected or self.server.process.poll() is not None:
                continue
            print(f"{self.expected - len(self.known)} of the {self.model} model's {self.expected} stub process(es) died: "
                  "reloading it ...", file=self.log, flush=True)
            self._revived(self._reload, self.model, "reloaded")

    def _dead(self) -> bool:
        """Whether the server's process has exited, or crashed and hangs (then it is killed, its stubs with it)."""
        if self.server.process.poll() is None and self.server.crashed():
            self.server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.process.wait(30)
        return self.server.process.poll() is not None

    def _reload(self) -> None:
        """server.reload() on a thread of its own, watched: where the server dies meanwhile (a stub's death can crash
        it as its model unloads), SpecrtError at once rather than a load that waits on a hung server."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def reload():
            try:
                done.set_result(self.server.reload(self.model))
            except BaseException as e:  # noqa: BLE001 - raised where the result is read
                done.set_exception(e)

        threading.Thread(target=reload, name="specrt-reload", daemon=True).start()
        while not self.stopping.is_set():
            try:
                return done.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if self._dead():
                    raise SpecrtError("tritonserver died during the reload") from None

    def _restart(self) -> bool:
        """The server's process exited: start it again and wait for its models; False where it could not be."""
        code = self.server.process.returncode
        how = "crashed" if self.server.crashed() else "exited"
        print(f"tritonserver {how} (status {code}; its log: {self.server.log}): restarting it ...", file=self.log,
              flush=True)
        if not self._revived(lambda: self.server.restart().wait_ready(cancel=self.stopping), "tritonserver",
                             "restarted"):
            self.gave_up = f"tritonserver {how} (status {code}) and did not start again; {self.server.log}"
            return False
        self.restarts += 1
        return True

    def _revived(self, revive, what: str, done: str) -> bool:
        """Fail the requests in flight (on_death), then revive(); counted and logged where it ends well."""
        for callback in self.on_death:
            callback()
        t0 = time.monotonic()
        try:
            revive()
        except SpecrtError as e:
            print(f"{what} was not {done}: {e}", file=self.log, flush=True)
            return False  # a reload is tried again at the next look
        self.revived += 1
        self.known = self.server.stubs(self.model)
        self.expected = max(self.expected, len(self.known))
        print(f"{what} {done} in {time.monotonic() - t0:.1f} s", file=self.log, flush=True)
        return True

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


def serve(cfg: ServeConfig) -> None:
    """Run the server until Ctrl-C / SIGTERM (or until it exits)."""
    files = locate(cfg.server_dir, cfg.tritonserver, cfg.install)
    print(f"starting tritonserver {files.version} on {cfg.host} for {cfg.bundle} ({cfg.backend} backend, method "
          f"{cfg.method} by default, batches of up to {cfg.max_batch}) ...", file=sys.stderr, flush=True)
    stopping, ready = threading.Event(), threading.Event()

    def _stop(signum, frame):
        if stopping.is_set():  # a second Ctrl-C: stop now (the server's process group killed, stop() returns)
            if server is not None:
                server.kill()
            return
        stopping.set()
        if not ready.is_set():  # still starting: stop starting (start() stops what it began)
            raise KeyboardInterrupt

    # both handled here, whatever this process inherited (a parent that ignores SIGINT passes that on to its children)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = openai = revive = None
    try:
        server, info = start(cfg, files)
        revive = Revive(server).start()
        openai = start_openai(cfg)
        if openai is not None:
            revive.on_death.append(openai.fail_in_flight)
        skipped = ", ".join(f"{m} (no {b} backend here)" for m, b in info["skipped"].items())
        host = "127.0.0.1" if cfg.host == "0.0.0.0" else cfg.host
        body = json.dumps({"PROMPT": "def fibonacci(n):", "MAX_NEW_TOKENS": 64})
        print(f"ready: models {', '.join(info['loaded'])}" + (f"; not loaded: {skipped}" if skipped else ""))
        print(f"  HTTP     http://{host}:{cfg.http_port}/v2/models/{DECODE_MODEL}/generate (and generate_stream)")
        print(f"  gRPC     {host}:{cfg.grpc_port} (streaming: tritonclient.grpc start_stream / async_stream_infer)")
        print(f"  metrics  http://{host}:{cfg.metrics_port}/metrics")
        if openai is not None:
            print(f"  OpenAI   {openai.url} (completions, chat/completions, models)")
        print(f"  log      {server.log}")
        print(f"try: curl -s -X POST http://{host}:{cfg.http_port}/v2/models/{DECODE_MODEL}/generate -d '{body}'")
        print("Ctrl-C stops it.", flush=True)
        ready.set()
        while not stopping.is_set() and revive.thread.is_alive():  # Revive restarts a server that exits
            stopping.wait(0.5)
        if not stopping.is_set():
            raise SpecrtError(f"{revive.gave_up}:\n{server.log_tail()}")
    except KeyboardInterrupt:
        pass
    finally:  # under this process's own handlers still: a signal now hurries the stop rather than cutting it short
        stopping.set()
        if revive is not None:
            revive.stop()
        if openai is not None:
            openai.stop()
        if server is not None:
            print("stopping tritonserver ...", file=sys.stderr, flush=True)
            code = server.stop()
            print(f"stopped (status {code})", file=sys.stderr)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

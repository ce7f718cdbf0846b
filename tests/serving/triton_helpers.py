"""A real tritonserver for the serving tests (its files: the `files` fixture of conftest.py), started on a model
repository, and its Prometheus metrics read back."""

import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_server(files, repo, tmp):
    from specrt.serving.tritonserver import TritonServer, free_ports

    # a test server exits within seconds: no client of a finished test needs Triton's default 30 s of grace
    server = TritonServer(files, repo, ["specrt"], "127.0.0.1", *free_ports(3), log=tmp / "server.log",
                          exit_timeout=5).start()
    try:
        server.wait_ready(300)
    except BaseException:
        server.stop()
        raise
    return server


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line.startswith("specrt_"))}


def settled(server, before: dict, key: str, want: float, timeout: float = 30) -> dict:
    """The metrics once `key` has grown by `want` since `before` (the model refreshes them every POLL_SECONDS)."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(server)
        if now.get(key, 0) - before.get(key, 0) >= want:
            return now
        assert time.monotonic() < deadline, f"{key} grew by {now.get(key, 0) - before.get(key, 0)}, not {want}: {now}"
        time.sleep(0.1)


def quiet(server, timeout: float = 30) -> dict:
    """The metrics once nothing runs and they have stopped changing (what ended before is counted)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = metrics(server)
        if now == last and not any(v for k, v in now.items() if k.startswith(("specrt_running", "specrt_queue"))):
            return now
        last = now
        time.sleep(0.5)  # a few of the model's refreshes (POLL_SECONDS)
    raise AssertionError(f"the metrics did not settle: {last}")

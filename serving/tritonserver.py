"""The Triton Inference Server process: found (or installed), started on a model repository, stopped cleanly.

    files = locate(Path("build/tritonserver"))                   # installs the server files on first use
    with TritonServer(files, repo, models=["specrt"], http_port=8000) as server:
        server.wait_ready()                                       # every model loaded, or the log's tail raised
        ...                                                       # http://127.0.0.1:8000/v2/models/specrt/generate

Where the server comes from:
  - `tritonserver=PATH`: the binary of a full Triton install (the NGC container's /opt/tritonserver/bin/tritonserver,
    its backends in ../backends: python, onnxruntime, tensorrt, ...), run as it is;
  - else the `nvidia-pytriton` wheel's server files, installed once into `server_dir` with `pip install --no-deps
    --target`: tritonserver 2.51, its libraries and the Python backend with stubs for Python 3.8-3.13 (no ONNX Runtime
    or TensorRT backend). Only those files are used: the wheel's own package pins numpy < 2.

The Python backend runs each Python model in a stub process embedding the Python whose `python3` comes first on PATH
(the embedded interpreter ignores PYTHONPATH), so that is made specrt's environment: the model imports specrt from
where this process does. The wheel's stub is built against numpy 1.x and garbles every tensor a numpy 2 array
carries (its pybind11 reads numpy 1's array layout); where this environment has numpy 2, the stub gets a small
virtual environment of its own (`server_dir/python`): numpy 1.26 in front, then this environment's packages through
a .pth file. The stub links libpython3.X.so.1.0, taken from this Python's own LIBDIR first.

A server runs in a session of its own: stop() asks it to exit (SIGINT: Triton unloads its models and their stubs
exit), waits `exit_timeout` seconds, then kills whatever is left of its process group, stubs included. On Linux a
server is also sent SIGTERM when the process that started it dies, stopped or not. restart() starts a server whose
process exited again, on the same ports (serve.Revive does, after a crash).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.files import replace_dir

PYTRITON = "nvidia-pytriton==0.7.0"  # tritonserver 2.51.0 (r24.10)
STUB_NUMPY = "numpy==1.26.4"  # the last numpy the wheel's stub reads arrays of
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
# a model's platform or backend -> the backend directory Triton runs it with
BACKEND_OF = {"python": "python", "onnxruntime_onnx": "onnxruntime", "onnxruntime": "onnxruntime",
              "tensorrt_plan": "tensorrt", "tensorrt": "tensorrt"}


@dataclass(frozen=True)
class ServerFiles:
    """A tritonserver binary and what it needs to run here."""

    binary: Path
    backend_dir: Path  # --backend-directory: one directory per backend
    library_path: tuple[str, ...]  # LD_LIBRARY_PATH entries, first
    python_bin: Path  # first on PATH: the Python the Python backend's stubs embed
    version: str  # of the server, as its source says (the wheel's), or "unknown"

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(sorted(p.name for p in self.backend_dir.iterdir() if p.is_dir()))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.python_bin}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*self.library_path, *filter(None, [env.get("LD_LIBRARY_PATH")])])
        return env


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise SpecrtError(f"cannot install {what} ({why}): run `{' '.join(cmd[2:])}` yourself, or give "
                          "--tritonserver PATH of an installed Triton")


def _libpython() -> Path:
    """The directory holding this Python's libpython3.X.so.1.0 (what the stub links)."""
    name = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    for d in filter(None, [sysconfig.get_config_var("LIBDIR"), "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]):
        if (Path(d) / name).is_file():
            return Path(d)
    raise SpecrtError(f"Triton's Python backend links {name}, which this Python ({sys.executable}) does not have: use "
                      "a Python built with --enable-shared (python.org's, Debian's, pyenv with PYTHON_CONFIGURE_OPTS="
                      "--enable-shared)")


def _stub_python(server_dir: Path) -> Path:
    """The bin directory of the Python the stubs embed: this environment's, or (numpy 2 here) a venv beside it whose
    numpy is 1.26 and whose other packages are this environment's."""
    import numpy

    if int(numpy.__version__.split(".")[0]) < 2:
        return Path(sys.prefix) / "bin"
    env = server_dir / "python"
    site = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    if not (site / "numpy" / "__init__.py").is_file():
        shutil.rmtree(env, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, capture_output=True)
        _pip(["--no-deps", "--target", str(site), STUB_NUMPY], f"{STUB_NUMPY} for Triton's Python backend stub")
    paths = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    # site.addsitedir, not a plain path: this environment's own .pth files (an editable specrt) are read too
    (site / "specrt-environment.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in paths))
    return env / "bin"


def _wheel_backends(wheel: Path, server_dir: Path) -> Path:
    """A backend directory holding the wheel's Python backend with the stub for this Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    root = wheel / "pytriton" / "tritonserver"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise SpecrtError(f"Triton's Python backend in {PYTRITON} has stubs for Python {', '.join(have)}, not {version}")
    backends = server_dir / "backends"
    if not (backends / "python" / stub.name).is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".backends-", dir=server_dir))
        (tmp / "python").mkdir()
        for src in [root / "backends" / "python" / f for f in PYTHON_BACKEND_FILES] + [stub]:
            shutil.copy2(src, tmp / "python" / src.name)
        replace_dir(tmp, backends)
    return backends


def locate(server_dir: Path = Path("build/tritonserver"), tritonserver: Path | None = None,
           install: bool = True) -> ServerFiles:
    """The server to run: `tritonserver` (a full install) if given, else the wheel's in `server_dir`, installed there
    first when missing and `install`; raises SpecrtError saying what to install when neither can be had."""
    server_dir = Path(server_dir).resolve()
    if tritonserver is not None:
        binary = Path(tritonserver).resolve()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise SpecrtError(f"--tritonserver {tritonserver} is not an executable file")
        backends = binary.parent.parent / "backends"
        if not backends.is_dir():
            raise SpecrtError(f"no backends directory beside {binary} ({backends}): a Triton install keeps its "
                              "backends there")
        return ServerFiles(binary, backends, (), Path(sys.prefix) / "bin", "unknown")
    if sys.platform != "linux":
        raise SpecrtError(f"{PYTRITON}'s tritonserver runs on Linux (x86_64, glibc >= 2.35), not {sys.platform}: give "
                          "--tritonserver PATH of an installed Triton")
    wheel = server_dir / "wheel"
    binary = wheel / "pytriton" / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        if not install:
            raise SpecrtError(f"no Triton server files in {wheel}: run `{sys.executable} -m pip install --no-deps "
                              f"--target {wheel} {PYTRITON}`, or give --tritonserver PATH of an installed Triton")
        server_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".wheel-", dir=server_dir))
        try:
            _pip(["--no-deps", "--target", str(tmp), PYTRITON], f"Triton's server files ({PYTRITON})")
            replace_dir(tmp, wheel)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    libs = (str(wheel / "nvidia_pytriton.libs"), str(_libpython()))
    return ServerFiles(binary, _wheel_backends(wheel, server_dir), libs, _stub_python(server_dir),
                       f"2.51.0 ({PYTRITON})")


def _dies_with(parent: int):
    """What the server's process runs before it execs (Linux): it gets SIGTERM (Triton's graceful exit) when the
    thread that started it ends, so a process that dies without stopping its server (killed, or a script that never
    called stop()) leaves none behind; stubs exit with their server. Called on the launcher's thread (_launch), which
    ends with the process only; off Linux, nothing."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def child() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that: no signal will come (and this child, not yet
            os.kill(os.getpid(), signal.SIGKILL)  # exec'd, keeps the parent's handlers: only SIGKILL is sure)

    return child


_launches: queue.SimpleQueue = queue.SimpleQueue()
_launcher: list[threading.Thread] = []
_launcher_lock = threading.Lock()


def _launch(cmd: list[str], **popen) -> subprocess.Popen:
    """subprocess.Popen(cmd, **popen) on a thread that lives as long as this process: the kernel's parent-death signal
    (_dies_with) follows the thread that started a child, not its process, so a server started from any thread (a
    fixture's, serve.Revive's) still dies with this process and not before."""
    with _launcher_lock:
        if not _launcher:
            _launcher.append(threading.Thread(target=_launch_forever, name="specrt-launcher", daemon=True))
            _launcher[0].start()
    started: concurrent.futures.Future = concurrent.futures.Future()
    _launches.put((cmd, popen, started))
    return started.result()


def _launch_forever() -> None:
    while True:
        cmd, popen, started = _launches.get()
        try:
            started.set_result(subprocess.Popen(cmd, preexec_fn=_dies_with(os.getpid()), **popen))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            started.set_exception(e)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports nothing listens on now (the OS's choice)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class TritonServer:
    """One tritonserver process over a model repository, loading `models` only (explicit model control), bound to
    `host`; its output goes to `log` (default: a file in the repository's parent directory)."""

    def __init__(self, files: ServerFiles, repository: Path, models: list[str], host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002, log: Path | None = None,
                 exit_timeout: int = 30, verbose: int = 0):
        self.files, self.repository, self.models, self.host = files, Path(repository).resolve(), list(models), host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log = Path(log) if log is not None else self.repository.parent / f"{self.repository.name}-tritonserver.log"
        self.exit_timeout, self.verbose = exit_timeout, verbose
        self.process: subprocess.Popen | None = None
        self._log_read, self._crashed = 0, False

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        cmd = [str(self.files.binary), "--model-repository", str(self.repository),
               "--backend-directory", str(self.files.backend_dir), "--model-control-mode", "explicit",
               "--http-address", self.host, "--http-port", str(self.http_port),
               "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
               "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
               "--exit-timeout-secs", str(self.exit_timeout), "--log-verbose", str(self.verbose)]
        for m in self.models:
            cmd += ["--load-model", m]
        return cmd

    def start(self, append: bool = False) -> "TritonServer":
        if self.process is not None:
            raise SpecrtError("this server was started already")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            self.log.write_bytes(b"")
        with open(self.log, "ab") as out:  # appended to (O_APPEND): the server's lines and specrt's interleave whole
            self._log_read = out.tell()  # crashed() reads the log from here on
            self.process = _launch(self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.files.env(),
                                   start_new_session=True)
        self._crashed = False
        return self

    def crashed(self) -> bool:
        """Whether the server's crash handler has logged a fatal signal since it started ("Signal (6) received."): it
        may then hang for minutes, its process alive and its requests unanswered, before it exits."""
        if not self._crashed and self.process is not None:
            try:
                with open(self.log, "rb") as f:
                    f.seek(self._log_read)
                    new = f.read()
            except OSError:
                return False
            cut = new.rfind(b"\n") + 1  # whole lines only
            self._log_read += cut
            self._crashed = re.search(rb"^Signal \(\d+\) received\.", new[:cut], re.M) is not None
        return self._crashed

    def restart(self) -> "TritonServer":
        """Start the server again after its process exited (Triton's Python backend can abort the whole server as a
        stub dies holding a lock of their shared memory: boost::interprocess::lock_exception), on the same ports and
        models; what is left of the old process group goes first, and the log goes on in the same file. Returns at
        once: wait_ready() waits for the models."""
        if self.process is None or self.process.poll() is None:
            raise SpecrtError("restart() starts a server whose process has exited")
        self.kill()
        self.process = None
        with open(self.log, "ab") as out:
            out.write(b"\n-- specrt: tritonserver restarted --\n")
        return self.start(append=True)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [t for t in text if t.strip() and not t.startswith(("+", "|"))]  # not the startup tables
        return "\n".join(keep[-lines:])

    def fatal_error(self) -> str | None:
        """The error Triton exited with (its log's last `error: ` line, e.g. a model's failed load and why), if any."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return None
        return next((t.removeprefix("error: ") for t in reversed(lines) if t.startswith("error: ")), None)

    def ready(self) -> bool:
        """Whether the server answers ready (every model it was asked to load, loaded)."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stubs(self, model: str, among=None) -> list[int]:
        """Process ids of the Python-backend stubs this server runs for `model` (one per instance); `among`: only
        these process ids are looked at (a cheap check that known stubs still live), else every process."""
        if self.process is None:
            return []
        found = []
        for proc in (Path("/proc") / str(pid) for pid in among) if among is not None else Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            if (parent == self.process.pid and cmd[0].endswith(b"triton_python_backend_stub")
                    and f"/{model}/1/model.py".encode() in b" ".join(cmd)):
                found.append(int(proc.name))
        return found

    def reload(self, model: str, timeout: float = 600) -> None:
        """Unload `model` (readiness turns false; its requests in flight end with an error) and load it again through
        Triton's repository API; returns once it is loaded (raises SpecrtError, with the server's answer, if not).
        The load waits for the unload to begin: Triton loads a model it still counts as ready in the background and
        keeps answering ready over the old one meanwhile. (The unload itself may never end: a request in flight in a
        dead stub holds the old model.)"""
        self._repository(f"models/{model}/unload", 60)
        deadline = time.monotonic() + 30
        while self.model_state(model) == "READY" and time.monotonic() < deadline:
            time.sleep(0.05)
        self._repository(f"models/{model}/load", timeout)

    def model_state(self, model: str) -> str | None:
        """`model`'s state in Triton's repository index (READY, LOADING, UNLOADING, UNAVAILABLE), None if unlisted."""
        states = [m.get("state") for m in json.loads(self._repository("index", 10)) if m.get("name") == model]
        return states[0] if states else None

    def _repository(self, action: str, wait: float) -> bytes:
        """POST to Triton's repository API (/v2/repository/`action`); its answer, or SpecrtError saying why not."""
        request = urllib.request.Request(f"{self.http_url}/v2/repository/{action}", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=wait) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise SpecrtError(f"Triton refused {action}: {e.read().decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SpecrtError(f"Triton did not answer {action}: {e}") from None

    def wait_ready(self, timeout: float = 300, cancel: threading.Event | None = None) -> None:
        """Wait until ready (or `cancel` is set); raises SpecrtError with the log's tail if the server exits or
        `timeout` s pass."""
        deadline = time.monotonic() + timeout
        while not self.ready() and not (cancel is not None and cancel.is_set()):
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                why = self.fatal_error()
                raise SpecrtError(f"tritonserver exited (status {code}) before it was ready"
                                  f"{f': {why}' if why else ''}; {self.log}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SpecrtError(f"tritonserver was not ready after {timeout:.0f} s; {self.log}:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        """Ask the server to exit, wait, then kill what is left of its process group (stubs included); returns its exit
        status (None if it never started). Idempotent."""
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(self.exit_timeout + 10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # the session's leftovers: a stub whose model never unloaded
        p.wait()
        return p.returncode

    def kill(self) -> None:
        """Kill the server's process group (the server and its stubs) at once, without waiting (safe from a signal
        handler: stop() then returns as soon as the server is gone)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def __enter__(self) -> "TritonServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

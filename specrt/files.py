"""Atomic writes: a reader sees the old file (or directory) or the new one, never a torn one.

Files go to a temporary name in the same directory, are flushed to disk, then renamed over the
destination (rename is atomic within a filesystem). Directories are swapped with renameat2's
RENAME_EXCHANGE where the kernel and C library have it (Linux >= 3.15, glibc >= 2.28): one atomic step;
elsewhere with two renames, where an interruption between them leaves the old directory at
`<dest>.old-<pid>` (named in the error) rather than lost.

Under `interrupts_kept()` (the CLI runs every command so) neither commits once a SIGINT (Ctrl-C) has come: a library
may catch the KeyboardInterrupt it raises and go on (a Ctrl-C early in torch.onnx's dynamo export was lost there and
the export went on to replace the bundle), and the rename would then commit what the user stopped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

RENAME_EXCHANGE = 2  # linux/fs.h


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _umask()  # read once: os.umask sets it to read it, which must not race with other threads later

_interrupted = threading.Event()  # a SIGINT came under interrupts_kept


@contextmanager
def interrupts_kept():
    """Within the block a SIGINT is remembered as well as handled as before (Python's handler raises
    KeyboardInterrupt), and no write_atomic or replace_dir commits after it, whatever the code under the block did
    with the KeyboardInterrupt. Outside the main thread (which alone receives signals), or where SIGINT is ignored or
    not Python's to handle, the block runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return

    def remember(signum, frame):
        _interrupted.set()
        previous(signum, frame)

    _interrupted.clear()
    signal.signal(signal.SIGINT, remember)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted.clear()


def _commit_allowed() -> None:
    if _interrupted.is_set():
        raise KeyboardInterrupt("interrupted (SIGINT) earlier: nothing is committed")


def commit(tmp: Path, path: Path) -> None:
    """Put the file `tmp` (written beside `path`, by whatever wrote it) in place of `path`: flushed to disk, given a
    plain file's mode, then renamed over it; refused after a SIGINT under interrupts_kept (`tmp` is left to the
    caller to remove)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600; a plain file would get this
    _commit_allowed()
    os.replace(tmp, path)


@contextmanager
def atomic_file(path: Path, suffix: str = ".tmp"):
    """A temporary path beside `path` for a writer that takes a file name (a figure, an archive, a converter's
    output): committed over `path` when the block ends (commit), removed whatever else happens. `suffix`: the
    temporary name's ending, for a writer that picks its format by it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        commit(Path(tmp), path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_atomic(path: Path, data: str | bytes) -> None:
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_json_atomic(path: Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where renameat2 is not available."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem or kernel cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(a))


def check_replaceable(dest: Path, marker: str, what: str) -> None:
    """Refuse, before any work, to replace `dest` where it is not a directory, or is a non-empty one without `marker`
    (the file that says its writer made it; `what`: what that is, in words): nothing of the user's is lost."""
    from specrt.errors import SpecrtError

    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise SpecrtError(f"{dest} exists and is not a directory")
    if dest.is_dir() and not (dest / marker).is_file() and any(dest.iterdir()):
        raise SpecrtError(f"{dest} is a non-empty directory that is not {what}: refusing to replace it (choose another "
                          "--out, or empty it)")


def replace_dir(new: Path, dest: Path) -> None:
    """Put directory `new` in place of `dest` (which may not exist); the old content is deleted after."""
    new, dest = Path(new), Path(dest)
    _commit_allowed()
    if not dest.exists():
        os.rename(new, dest)
        return
    if _exchange(new, dest):
        shutil.rmtree(new)  # now the old directory
        return
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    os.rename(dest, old)
    os.rename(new, dest)
    shutil.rmtree(old)

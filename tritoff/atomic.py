"""Files that appear complete or not at all: written under a temporary name beside the target, then renamed."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path

# the most bytes of the target's name a temporary name takes: with the rest, within the 255 bytes of a file name
NAME_PART = 200


def umask() -> int:
    """The process umask, read without changing it (Linux), else by setting it and putting it back at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def can_create_in(directory: str | Path) -> bool:
    """Whether a file can be created in ``directory``: modes do not stop root, but a read-only or virtual file system
    (``/sys``, ``/proc``) does, which only trying tells."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".tritoff-probe.")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def nearest_existing(path: str | Path) -> Path:
    """``path`` itself if it exists, else the nearest directory above it that does: where making it would start."""
    path = Path(path)
    return next(p for p in (path, *path.absolute().parents) if p.exists())


@contextlib.contextmanager
def interrupts_held():
    """Hold Ctrl-C and SIGTERM while the block makes something its caller must clean up (a file, a child process)
    but has no handle on yet: each is delivered to its own handler as the block ends, where the caller's cleanup
    then sees what was made. Only the main thread runs signal handlers, so elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    held = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        # None: a handler set outside Python, which cannot be put back; SIG_IGN: nothing to hold
        if signal.getsignal(sig) not in (None, signal.SIG_IGN):
            held[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        for sig in pending:
            signal.raise_signal(sig)  # its own handler runs now (Ctrl-C's raises KeyboardInterrupt here)


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ""):
    """Yield a temporary path in ``path``'s directory; on success rename it to ``path``, on failure or interrupt
    remove it. The file gets the mode a plain ``open`` would give it (0666 less the umask), not the private one of
    ``mkstemp``."""
    path = Path(path)
    tmp = None
    try:
        with interrupts_held():  # an interrupt between making the file and naming it here would leave it behind
            part = os.fsencode(path.name)[:NAME_PART].decode(errors="ignore")  # a character cut in two is dropped
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{part}.", suffix=suffix)
            try:
                os.fchmod(fd, 0o666 & ~umask())
            finally:
                os.close(fd)
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)

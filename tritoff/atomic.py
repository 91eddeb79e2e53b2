"""Files that appear complete or not at all: written under a temporary name beside the target, then renamed."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


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


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ""):
    """Yield a temporary path in ``path``'s directory; on success rename it to ``path``, on failure remove it. The
    file gets the mode a plain ``open`` would give it (0666 less the umask), not the private one of ``mkstemp``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~umask())
    finally:
        os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

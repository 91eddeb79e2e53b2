"""A store being written: its temporary directory beside the target, and the lock that tells it from one left behind.

A store is written into ``.NAME.XXXXXXXX.partial`` beside its target and renamed into place when complete. The writer
holds an exclusive ``flock`` on a ``.writing`` file inside it for as long as it writes; the kernel drops the lock when
the process ends, however it ends. A partial directory whose lock can be taken was therefore left by a writer that was
killed (the out-of-memory killer, a power loss): it is never used, may hold gigabytes, and the next write of the same
store removes it. Process ids and host names would not tell: pid namespaces (containers) and shared disks reuse them.
Directories without a lock file (older tritoff) are only named, never removed.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path

LOCK = ".writing"
_WRITING: dict[Path, int] = {}  # partial directory -> the descriptor holding its lock


def real_target(target: Path) -> Path:
    """Where a store at ``target`` is written: a symbolic link's destination (the link itself is kept)."""
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def partial_store(directory: str | Path, overwrite: bool = False) -> Path:
    """A new temporary directory beside the store target ``directory`` (checked as ``check_target`` does), locked by
    this process until :func:`finished`; partial directories of the same target left by killed writers are removed
    first."""
    from tritoff.store import check_target

    target = real_target(check_target(directory, overwrite))
    target.parent.mkdir(parents=True, exist_ok=True)
    for old in left_behind(target):
        shutil.rmtree(old, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial"))
    fd = os.open(partial / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _WRITING[partial] = fd
    return partial


def finished(partial: Path) -> None:
    """Drop the lock file and the lock (before the directory is renamed into place, or after it was removed)."""
    fd = _WRITING.pop(partial, None)
    if fd is None:
        return
    try:
        os.unlink(partial / LOCK)  # while still locked: a cleaner that opened it sees it gone and leaves the directory
    except FileNotFoundError:
        pass
    os.close(fd)


def left_behind(target: Path) -> list[Path]:
    """The partial directories of the store ``target`` whose writer is gone (their lock can be taken)."""
    target = real_target(target)
    parent = target.parent if str(target.parent) else Path(".")
    name = re.compile(rf"\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.partial")
    return [p for p in sorted(parent.glob(".*.partial")) if name.fullmatch(p.name) and _abandoned(p)]


def _abandoned(partial: Path) -> bool:
    lock = partial / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # no lock file: an older tritoff's, or one being renamed into place
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its writer holds it
        os.close(fd)
        return False
    try:  # the writer unlinks the file before it lets go: a lock taken on an unlinked file proves nothing
        return os.stat(lock).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False
    finally:
        os.close(fd)

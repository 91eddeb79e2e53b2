"""Packs served from disk: a file of packs read on demand into a small page-locked bounce ring.

When the host budget (``enable(..., host_budget=)``) holds only some packs, the others stay in their store file (or
in a private spill file written at enable) and are read when needed. The ring has a few buffers, each the size of the
largest pack served from disk, in one page-locked arena (``tritoff/arena.py``). On CUDA a background thread reads
ahead: the hook manager names the disk packs its next groups will need (:meth:`DiskRing.want`), the thread reads them
into free buffers with ``pread`` while the GPU copies and computes, and a buffer is overwritten only once the CUDA
event recorded after the last copy out of it has completed. On the CPU the same calls read synchronously.

Files are read with ``pread``, never mapped whole or registered, so a file larger than RAM costs only the ring; the
kernel's page cache (reclaimable, not this process's memory) may keep what fits. Lookup tables (``host_lookup.py``)
served from disk are the exception: they are mapped read-only, so only the rows a prompt touches are read.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import warnings
import weakref
from pathlib import Path

import torch
import xxhash

from tritoff.arena import PAGE, HostArena
from tritoff.atomic import can_create_in, nearest_existing
from tritoff.pack import align
from tritoff.warn import warn

# the CPU reads synchronously (tests set this to run the read-ahead thread without a GPU)
READ_AHEAD_ON_CPU = False


SPILL_FULL = "for the packs beyond host_budget: pass spill_dir= (--spill-dir) on a larger disk, or convert to a store"


class PackFile:
    """A file holding packs at ``data_offset`` + each pack's offset; ``fd`` an open descriptor of it.

    ``path`` names it in errors (a spill file has been unlinked already). Packs carrying a hash are checked against
    it when first read (``verify``), so a corrupt store is refused, naming the file, before a wrong byte is used (the
    hash covers the pack and its padding to the next page)."""

    def __init__(
        self, fd: int, data_offset: int, path: str, *, verify: bool = True, owner=None, no_space: str = SPILL_FULL
    ):
        self.fd = fd
        self.no_space = no_space  # what to do when a write finds the disk full
        self.data_offset = data_offset
        self.path = path
        self.verify = verify
        self._owner = owner  # a spill file's TemporaryFile: the file lives as long as this object
        self._verified: set[int] = set()
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._replaced_fds: list[int] = []  # descriptors of the file ``path`` named before (see _reopen_if_replaced)

    @property
    def disk_bytes(self) -> int:
        """Bytes the file takes on its disk (its blocks: a spill file written in part holds fewer than its size)."""
        return os.fstat(self.fd).st_blocks * 512

    @property
    def spill(self) -> bool:
        """Whether this is a private spill file (written at enable, gone with the process), not a store's."""
        return self._owner is not None

    @classmethod
    def open(cls, path: str | Path, data_offset: int, verify: bool = True) -> PackFile:
        """Open the store file at ``path`` for reading."""
        return cls(os.open(path, os.O_RDONLY), data_offset, str(path), verify=verify)

    def read(self, pack, out: torch.Tensor, recheck: bool = False) -> None:
        """Read ``pack``'s bytes into the uint8 CPU tensor ``out`` (at least the pack's size), checking its hash on
        the first read, or on this one (``recheck``: bytes handed back as a model's weights, which a file changed
        in place since its first read must not give). A store file found damaged that was written again since it
        was opened (``tritoff convert --overwrite`` puts a new file in its place) is opened again and read from."""
        nbytes = pack.layout.nbytes
        if out.numel() < nbytes:
            raise ValueError(f"pack {pack.name} needs {nbytes} bytes, and the buffer it is read into has {out.numel()}")
        from tritoff.store import StoreError

        view = memoryview(out[:nbytes].numpy())
        fd = self.fd  # one file throughout, should another thread open a replacing one meanwhile
        try:
            self._read_checked(pack, view, recheck, fd)
        except StoreError:
            if not self._reopen_if_replaced(fd):
                raise
            self._read_checked(pack, view, True, self.fd)

    def _read_checked(self, pack, view: memoryview, recheck: bool, fd: int) -> None:
        nbytes, position, done = len(view), self.data_offset + pack.offset, 0
        while done < nbytes:
            try:
                got = os.preadv(fd, [view[done:]], position + done)
            except OSError as err:  # the OS names no file: say which, and which pack
                raise OSError(err.errno, f"reading pack {pack.name} from {self.path} failed: {err.strerror}") from err
            if got == 0:
                if self.spill:  # tritoff's own, unlinked: no store to recreate
                    raise OSError(f"{self.path} ended early while reading pack {pack.name}; the file was truncated")
                from tritoff.store import RECREATE, StoreError

                raise StoreError(
                    f"{self.path} ended early while reading pack {pack.name}: it was truncated; {RECREATE}"
                )
            done += got
        if self._unchecked(pack, recheck):
            # the hash covers the pack's page-aligned span: with the header's, every byte of the file is checked
            hasher = xxhash.xxh3_128(view)
            padding = align(nbytes, PAGE) - nbytes
            if padding:
                hasher.update(os.pread(fd, padding, position + nbytes))
            self._accept(pack, hasher.hexdigest(), fd)

    def check(self, pack, chunk: int = 64 << 20) -> None:
        """Read ``pack`` through once in chunks and check its hash, unless that was done (or is not asked for)."""
        if not self._unchecked(pack):
            return
        hasher, fd = xxhash.xxh3_128(), self.fd
        start, span = self.data_offset + pack.offset, align(pack.layout.nbytes, PAGE)
        for at in range(0, span, chunk):
            hasher.update(os.pread(fd, min(chunk, span - at), start + at))
        self.drop_cache(pack)
        self._accept(pack, hasher.hexdigest(), fd)

    def _reopen_if_replaced(self, fd: int) -> bool:
        """Whether ``path`` now names another file than ``fd``, the one a read found damaged (a store written again),
        which is then opened in its place (unless another read did so already), every pack to be checked again; only
        for checked store files, whose hashes tell a repair from another conversion."""
        if not self.verify or self.spill:
            return False
        with self._lock:
            if self.fd != fd:  # another thread's read opened the file now at the path: read from it
                return self.fd >= 0
            try:
                now, held = os.stat(self.path), os.fstat(self.fd)
                if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    return False
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:  # gone, or unreadable: the damaged file's error stands
                return False
            # a read on another thread (the disk ring's) may still use the old descriptor: closed with the file
            self._replaced_fds.append(self.fd)
            self.fd, self._verified = fd, set()
        return True

    def _unchecked(self, pack, recheck: bool = False) -> bool:
        """Whether ``pack``'s bytes are to be checked against its hash: on the first read, or again (``recheck``)."""
        return self.verify and pack.hash is not None and (recheck or pack.offset not in self._verified)

    def _accept(self, pack, digest: str, fd: int) -> None:
        """Remember ``pack`` as checked if ``digest``, read from ``fd``, is its hash (and ``fd`` is still the file's:
        a check of the file a repair replaced says nothing of the new one); refuse the file, naming it, otherwise."""
        if digest != pack.hash:
            from tritoff.store import RECREATE, StoreError

            raise StoreError(
                f"{self.path} is corrupt or from another conversion (pack {pack.name} differs from its hash); "
                f"{RECREATE}"
            )
        with self._lock:
            if fd == self.fd:
                self._verified.add(pack.offset)

    def write(self, pack, data: torch.Tensor) -> None:
        """Write ``data`` (the pack's bytes) at the pack's place (a spill file, a store file being written)."""
        self.write_at(self.data_offset + pack.offset, memoryview(data.numpy()))

    def write_at(self, position: int, data) -> None:
        """Write the bytes ``data`` at ``position`` in the file; a full disk is a one-line error saying what to do."""
        view, done = memoryview(data), 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], position + done)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, f"no space left on the disk of {self.path} {self.no_space}") from None

    def drop_cache(self, pack) -> None:
        """Tell the kernel the pack's pages will not be read again soon (a pack now held in RAM)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.data_offset + pack.offset, pack.layout.nbytes, os.POSIX_FADV_DONTNEED)

    def map(self, pack) -> torch.Tensor:
        """A read-only uint8 view of the pack mapped from the file: pages are read only when touched. A pack with a
        hash is first read through once in chunks and checked (its pages are not kept)."""
        self.check(pack)
        start = self.data_offset + pack.offset
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self.fd, start - base + pack.layout.nbytes, access=mmap.ACCESS_READ, offset=base)
        self._maps.append(mapping)
        with warnings.catch_warnings():  # never written through: a lookup table only reads rows
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(mapping, dtype=torch.uint8, offset=start - base, count=pack.layout.nbytes)

    def close(self) -> None:
        """Close the descriptor (mapped views stay valid until they go away)."""
        if self._owner is not None:  # the owner's descriptor is ``fd``: closed once, by its owner
            owner, self._owner = self._owner, None
            owner.close()
        elif self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
        while self._replaced_fds:
            os.close(self._replaced_fds.pop())

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def spill_files(
    directory, sizes: dict[str, int], warn_tmpfs: bool = True, freed: list[PackFile] = ()
) -> dict[str, PackFile]:
    """A private, already unlinked file per component of ``sizes`` (its bytes of packs beyond the host budget) in
    ``directory`` (default: ``$XDG_CACHE_HOME/tritoff``, else ``~/.cache/tritoff``): they disappear when the process
    ends, however it ends. The directory and its free space (for all of them together) are checked first, with
    one-line errors; the space of ``freed`` (spill files closed before the new ones are written: a re-enable that
    packs again) counts as free where they are on the same file system."""
    import shutil
    import tempfile

    from tritoff.budget import format_bytes

    sizes = {name: n for name, n in sizes.items() if n}
    if not sizes:
        return {}
    directory = spill_directory(directory)
    free, total = shutil.disk_usage(directory).free, sum(sizes.values())
    device = os.stat(directory).st_dev
    free += sum(f.disk_bytes for f in freed if f.fd >= 0 and os.fstat(f.fd).st_dev == device)
    if free < total:
        raise ValueError(
            f"the packs beyond host_budget need {format_bytes(total)} of disk in {directory}, which has "
            f"{format_bytes(free)} free: pass spill_dir= (--spill-dir) on a larger disk, or convert to a store"
        )
    if warn_tmpfs and _is_tmpfs(directory):
        warn(
            f"{directory} is a tmpfs (held in RAM): spilling packs there saves no memory; pass spill_dir= "
            "(--spill-dir) on a disk"
        )
    files = {}
    for name in sizes:
        owner = tempfile.TemporaryFile(dir=directory, prefix="tritoff-spill-")
        files[name] = PackFile(owner.fileno(), 0, f"{directory}/<spill file of {name}>", verify=False, owner=owner)
    return files


def spill_directory(directory, create: bool = True) -> Path:
    """The directory spill files go into (``directory``, default :func:`default_spill_dir`), made if missing
    (``create``; else only checked that it could be); a one-line ValueError unless it is, or can become, a directory
    this process can write files in."""
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"spill_dir must be a path, got {type(directory).__name__}")
    if directory is not None and not os.fspath(directory).strip():
        raise ValueError("spill_dir is empty: pass a writable directory on a disk (or leave it out: ~/.cache/tritoff)")
    try:
        directory = Path(directory).expanduser() if directory is not None else default_spill_dir()
    except RuntimeError as err:  # ~user of no such user
        raise ValueError(f"spill_dir {directory}: {err}; pass a writable directory on a disk") from None
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"spill_dir {directory} is not a directory: pass a writable directory on a disk")
    if directory.is_symlink() and not directory.exists():  # mkdir would say only "File exists"
        raise ValueError(
            f"spill_dir {directory} is a link to {os.readlink(directory)}, which does not exist: create that "
            "directory, or pass a writable directory on a disk"
        )
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        existing = nearest_existing(directory)
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        if not can_create_in(existing):  # (a mode check would pass root where no file can be made)
            raise PermissionError("not writable")
    except OSError as err:
        raise ValueError(
            f"spill_dir {directory} cannot hold the packs beyond host_budget ({err.strerror or err}): pass a "
            "writable directory on a disk"
        ) from None
    return directory


def default_spill_dir() -> Path:
    """Where packs beyond the host budget are written when no store holds them."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tritoff"


def _is_tmpfs(directory: Path) -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    resolved, best, kind = str(directory.resolve()), "", ""
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind == "tmpfs"


class _Buffer:
    def __init__(self, view: torch.Tensor):
        self.view = view
        self.pack = None
        self.state = "empty"  # empty | reading | ready | failed
        self.users = 0
        self.event = None  # CUDA event after the last copy out of it
        self.error: BaseException | None = None
        self.last_used = 0


class DiskRing:
    """``n_buffers`` page-locked buffers of ``buffer_bytes`` that disk packs are read into.

    ``threaded``: read ahead on a background thread (CUDA); otherwise :meth:`take` reads synchronously. ``owners``
    maps ``id(pack)`` to the component it belongs to, for the per-component counters. ``device``: the GPU the
    packs go to."""

    def __init__(
        self,
        n_buffers: int,
        buffer_bytes: int,
        *,
        register: bool | None,
        threaded: bool,
        owners: dict,
        device: torch.device | None = None,
    ):
        buffer_bytes = align(buffer_bytes, PAGE)
        self.buffer_bytes = buffer_bytes  # the largest pack a buffer holds
        self.device = device  # the GPU whose copies the reader waits for
        self.arena = HostArena(n_buffers * buffer_bytes, register=register)
        self.buffers = [_Buffer(self.arena.view(i * buffer_bytes, buffer_bytes)) for i in range(n_buffers)]
        self.threaded = threaded
        self.owners = owners
        self.cond = threading.Condition()
        self.wanted: list = []
        self.bytes_read: dict[str, int] = {}
        self.reads = 0
        self.wait_ns = 0  # time takers waited for a read (the copy stream's wait on disk)
        self.clock = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes of the ring."""
        return self.arena.nbytes

    # read-ahead -----------------------------------------------------------------------------------------------------
    def want(self, packs: list) -> None:
        """The disk packs needed next, soonest first: the reader keeps the first ones read ahead."""
        with self.cond:
            self.wanted = packs[: len(self.buffers)]
            if self.threaded:
                self._start()
                self.cond.notify_all()

    def ready(self, pack) -> bool:
        """Whether ``pack`` sits read in a buffer (a :meth:`take` would not wait)."""
        with self.cond:
            buf = self._find(pack)
            return buf is not None and buf.state == "ready"

    def _start(self) -> None:
        if self._thread is None:
            # the thread holds the ring weakly between reads, so a ring nobody holds (a pipeline deleted without
            # disable) is freed and its thread ends
            self._thread = threading.Thread(
                target=_reader, args=(weakref.ref(self),), name="tritoff-disk-reader", daemon=True
            )
            self._thread.start()

    def _find(self, pack):
        return next((b for b in self.buffers if b.pack is pack and b.state != "empty"), None)

    def _claim(self):
        """(buffer, pack) of the next read the wanted list calls for, the buffer marked as reading; or None."""
        wanted = {id(p) for p in self.wanted}
        for pack in self.wanted:
            if self._find(pack) is not None:
                continue
            free = [
                b
                for b in self.buffers
                if b.users == 0 and b.state != "reading" and (b.pack is None or id(b.pack) not in wanted)
            ]
            if not free:
                return None
            buf = min(free, key=lambda b: (b.state != "empty", b.last_used))
            buf.pack, buf.state, buf.error = pack, "reading", None
            return buf, pack
        return None

    def _read(self, buf: _Buffer, pack) -> None:
        """Fill ``buf`` with ``pack`` (called without the lock held)."""
        try:
            if buf.event is not None:
                buf.event.synchronize()  # the last copy out of this buffer has finished
            pack.file.read(pack, buf.view)
        except BaseException as err:  # handed to the taker
            with self.cond:
                buf.state, buf.error = "failed", err
                self.cond.notify_all()
            return
        with self.cond:
            buf.state, buf.event = "ready", None
            owner = self.owners.get(id(pack), "?")
            self.bytes_read[owner] = self.bytes_read.get(owner, 0) + pack.layout.nbytes
            self.reads += 1
            self.cond.notify_all()

    def _next_job(self, timeout: float):
        """The next read to do, None when there is none after ``timeout`` seconds, or ``_STOP``."""
        with self.cond:
            job = self._claim() if not self._stop else None
            if job is None and not self._stop:
                self.cond.wait(timeout)
                job = self._claim() if not self._stop else None
            return _STOP if self._stop else job

    # use ------------------------------------------------------------------------------------------------------------
    def take(self, pack) -> tuple[int, torch.Tensor]:
        """Wait until ``pack`` is read into a buffer (reading it now on the CPU); returns (buffer index, its bytes).
        The buffer is not reused until :meth:`give_back`."""
        start = time.perf_counter_ns()
        waited = False
        with self.cond:
            if not self.wanted or self.wanted[0] is not pack:
                self.wanted = [pack, *[p for p in self.wanted if p is not pack]][: len(self.buffers)]
            while True:
                buf = self._find(pack)
                if buf is not None and buf.state == "ready":
                    break
                if buf is not None and buf.state == "failed":
                    buf.state, buf.pack = "empty", None
                    if waited:  # the read made for this take failed
                        raise buf.error
                    continue  # a read ahead failed before this take asked: read again (the disk may be back)
                waited = True
                if buf is None and not any(p is pack for p in self.wanted):  # a want() replaced the list: ask again
                    self.wanted = [pack, *self.wanted][: len(self.buffers)]
                if self.threaded:
                    self._start()
                    self.cond.notify_all()
                    self.cond.wait()
                    continue
                job = self._claim()
                if job is None:
                    raise RuntimeError("every disk ring buffer is in use; this is a tritoff bug")
                try:
                    self.cond.release()
                    try:
                        self._read(*job)
                    finally:
                        self.cond.acquire()
                except BaseException:  # an interrupt before the read began: the buffer is not left "reading"
                    if job[0].state == "reading":
                        job[0].state, job[0].pack = "empty", None
                    raise
            buf.users += 1
            self.wanted = [p for p in self.wanted if p is not pack]  # consumed: the read-ahead moves on
            if self.threaded:
                self.cond.notify_all()
            self.clock += 1
            buf.last_used = self.clock
            if waited:
                self.wait_ns += time.perf_counter_ns() - start
            return self.buffers.index(buf), buf.view[: pack.layout.nbytes]

    def forget(self, pack) -> None:
        """Drop what a buffer not in use holds of ``pack`` (moved between host memory and disk: ``rehold.py``), so a
        later take reads it again from its file; a read of it under way completes from that file."""
        with self.cond:
            for buf in self.buffers:
                if buf.pack is pack and not buf.users and buf.state in ("ready", "failed"):
                    buf.pack, buf.state, buf.error = None, "empty", None
            self.wanted = [p for p in self.wanted if p is not pack]

    def recover(self) -> None:
        """After an exception ended every forward: a buffer still counted as taken was left by an interrupt between
        its take and the taker's cleanup, so no taker holds it any more (copies out of it may be queued, from an
        interrupt inside the give-back: on CUDA the device finishes its work first); without a reader thread, a
        buffer still marked as being read was left by an interrupt in the taker's own read."""
        stuck = [buf for buf in self.buffers if buf.users or (not self.threaded and buf.state == "reading")]
        if not stuck:
            return
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self.cond:
            for buf in stuck:
                buf.users = 0
                if not self.threaded and buf.state == "reading":
                    buf.state, buf.pack = "empty", None
            self.cond.notify_all()

    def give_back(self, index: int, event=None) -> None:
        """Done with buffer ``index``; on CUDA, ``event`` marks the end of the last copy out of it."""
        with self.cond:
            buf = self.buffers[index]
            buf.users -= 1
            if event is not None:
                buf.event = event
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the reader and release the buffers."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.arena.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_STOP = object()


def _reader(ref) -> None:
    """The reader thread: read what the ring wants until it is closed or freed."""
    ring = ref()
    if ring is not None and ring.device is not None and ring.device.type == "cuda":
        # this thread's CUDA calls (event waits, unregistering the ring if it is freed here) use the ring's GPU, not
        # a context made on device 0
        torch.cuda.set_device(ring.device)
    del ring
    while True:
        ring = ref()
        if ring is None:
            return
        job = ring._next_job(timeout=0.5)
        if job is _STOP:
            return
        if job is not None:
            ring._read(*job)
        del ring, job

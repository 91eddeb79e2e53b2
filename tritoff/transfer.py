"""Moving packs into GPU buffers: the copy engine fills staging halves, an upcast stream turns them into tensors.

Two side streams per device, created once per process (``side_streams``). On the *copy stream*, a chunk of a pack is
copied (DMA, from page-locked memory) into one of two staging halves; on the *upcast stream*, the kernel turns that
chunk into its tensors in the destination. With two halves, the DMA of the next chunk (of this pack or the next one)
runs while the current one is upcast, so the copy engine never waits for the SMs. Events only: the copy stream waits
for the upcast that last read a half before overwriting it, the upcast stream waits for the chunk's DMA and for the
event after which the destination may be overwritten. The host never synchronizes.

Groups whose tensors come from their resident fp8 pack, or that are read zero-copy from the host, skip staging and
run on the upcast stream alone.

A pack served from disk is first taken from the disk ring (``tritoff/disk.py``: read ahead by its thread, or read
now), then moves exactly like a held one; the ring gets its buffer back with an event after the last copy out of it.

On the CPU the same calls run synchronously, through the staging halves when there are any (so the chunking is
exercised exactly as on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from tritoff import cuda_host, streams
from tritoff.chunks import Chunk, chunk_views
from tritoff.onload import GroupRuntime
from tritoff.warn import warn


@functools.cache
def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The copy and upcast streams of ``device``, created once per process: PyTorch hands out streams from a small
    pool round-robin, so making new ones at every phase entry would, after a few calls, land on a stream already in
    use (another engine's, or the user's), silently serializing transfers with it."""
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


# streams a phase remembers its calls ran on (other than its home stream) before it waits for them and forgets them:
# a caller making a new stream for every call would otherwise grow the set for as long as the phase stays loaded
MAX_COMPUTE_STREAMS = 16

# devices whose driver refused a staged copy: every fill there uses Tensor.copy_ for the rest of the process, the
# Transfers of phases loaded at the time included (one per loaded phase, made again at every load)
_DRIVER_REFUSED: set[int | None] = set()


class FillClock:
    """Host time spent filling synchronously (the CPU path): transfer time, not hook overhead. One per engine, shared
    by the Transfer of every phase it loads, so a phase leaving or entering inside a hook keeps the count whole."""

    def __init__(self):
        self.ns = 0


class Transfer:
    """Staging halves of ``chunk_bytes`` each on ``device`` (none when 0), and the copy and upcast streams.
    ``clock``: where synchronous fills add their host time (default: its own)."""

    def __init__(self, device: torch.device, chunk_bytes: int, disk=None, clock: FillClock | None = None):
        self.device = device
        self.disk = disk
        self.cuda = device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self.staging = [
            torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(2 if chunk_bytes else 0)
        ]
        self.copy_stream, self.upcast_stream = side_streams(device) if self.cuda else (None, None)
        if self.cuda:
            self._upcast_ids = streams.ids(self.upcast_stream)
        # staged copies go through the driver (cuda_host.copy_async) unless it refused one on this device
        self._driver = self.cuda and cuda_host.copies_available()
        self._device_index = torch.cuda.current_device() if self.cuda and device.index is None else device.index
        self._copy_handle = self.copy_stream.cuda_stream if self.cuda else 0
        # (chunk, host address, half) -> the views its copies read and write, and their addresses (see _stage)
        self._copies: dict[tuple[int, int, int], tuple] = {}
        self._staged = [torch.cuda.Event() for _ in self.staging] if self.cuda else []
        self._free = [torch.cuda.Event() for _ in self.staging] if self.cuda else []
        self._used = [False] * len(self.staging)
        self._half = 0
        # the stream the staging (and the ring's slots) were allocated on: their memory goes back to its pool
        self.home_stream = torch.cuda.current_stream(device) if self.cuda else None
        # the streams other than the home one that the phase's calls computed on (note_compute_stream): its memory
        # may be read there until it is freed
        self.compute_streams: set[torch.cuda.Stream] = set()
        self.clock = clock if clock is not None else FillClock()

    @property
    def driver_copies(self) -> bool:
        """Whether staged copies go through the CUDA driver: on CUDA, until the driver refuses one on this device."""
        return self._driver and self._device_index not in _DRIVER_REFUSED

    @property
    def staging_bytes(self) -> int:
        """Bytes of both staging halves."""
        return self.chunk_bytes * len(self.staging)

    @contextlib.contextmanager
    def host_bytes(self, group: GroupRuntime, stream=None):
        """``group``'s host bytes while the block runs: its arena view, or a disk ring buffer given back afterwards
        with an event on ``stream`` (the stream whose queued work reads it)."""
        if not group.pack.on_disk:
            yield group.pack.data
            return
        index, data = self.disk.take(group.pack)
        event = None
        try:
            yield data
        finally:
            try:
                if stream is not None:
                    # the reader thread waits on it before reading into the buffer again: a blocking event sleeps
                    # there, where a default one would spin a core for as long as the copy waits behind compute
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
            except BaseException:
                # no event (a CUDA error): the copies queued out of the buffer end before the reader may refill it
                event = None
                with contextlib.suppress(Exception):  # an error that persists: nothing more runs on the device
                    stream.synchronize()
                raise
            finally:  # the buffer goes back in every case: kept taken, the ring would wait for it forever
                self.disk.give_back(index, event)

    def fill(self, group: GroupRuntime, dst: torch.Tensor, after: torch.cuda.Event | None = None) -> int:
        """Write ``group``'s tensors into ``dst`` (asynchronously on CUDA); returns the host bytes read.

        On CUDA, nothing is written into ``dst`` before ``after`` (an event marking the end of its previous use);
        callers that need the result record an event on :attr:`upcast_stream` after this call.
        """
        if not group.packed_bytes:  # zero-size tensors alone: nothing to copy or wait for, and a launch of no programs
            return 0  # is an error on CUDA
        if not self.cuda:
            with self._synchronous():
                return self._fill_now(group, dst)
        if not group.direct and not self.staging:
            raise RuntimeError(f"{group.component}.{group.name} needs staging but the plan has none")
        upcast = self.upcast_stream
        # the upcast stream (and the engine's device) current throughout (copies name their stream); the caller's
        # device and stream come back at the end
        state = streams.enter(self._upcast_ids)
        try:
            if group.device_pack is not None:
                if after is not None:
                    upcast.wait_event(after)
                return group.fill_direct(dst, stream=upcast)
            if group.zero_copy:
                with self.host_bytes(group, upcast) as host:
                    if after is not None:
                        upcast.wait_event(after)
                    return group.fill_direct(dst, host, stream=upcast)
            with self.host_bytes(group, self.copy_stream) as host:
                for index, chunk in enumerate(group.chunks):
                    half = self._half
                    self._half ^= 1
                    if self._used[half]:
                        self.copy_stream.wait_event(self._free[half])
                    staged = self._stage(chunk, host, half)
                    self._staged[half].record(self.copy_stream)
                    upcast.wait_event(self._staged[half])
                    if index == 0 and after is not None:
                        upcast.wait_event(after)
                    group.fill_chunk(index, staged, dst, stream=upcast)
                    self._free[half].record(upcast)
                    self._used[half] = True
            return group.packed_bytes
        finally:
            streams.leave(state)

    def _stage(self, chunk: Chunk, host: torch.Tensor, half: int) -> torch.Tensor:
        """Copy ``chunk`` of ``host`` into staging ``half`` (on the copy stream on CUDA); returns the staged bytes.
        The views each copy reads and writes (two per chunk: payload and scales) and their addresses are found once
        per chunk, host address and half rather than at every copy (a disk ring hands out a new view of the same
        buffer every time, hence the address). A cached view keeps its host memory alive, so no other buffer can
        turn up at its address.

        On CUDA the copies are queued through the driver (``cuda_host.copy_async``), or through ``Tensor.copy_``
        under a torch dispatch mode (which then sees them), and on this device for the rest of the process once the
        driver has refused a copy (warned once; ``Tensor.copy_`` then raises an error that persists, as PyTorch
        does)."""
        key = (id(chunk), host.data_ptr(), half)
        entry = self._copies.get(key)
        if entry is None or entry[0] is not chunk:
            staged, *copies = chunk_views(chunk, host, self.staging[half])
            spans = tuple((dst.data_ptr(), src.data_ptr(), dst.numel()) for dst, src in copies)
            entry = self._copies[key] = (chunk, staged, copies, spans)
        _, staged, copies, spans = entry
        failed = None
        if self.driver_copies and not torch._C._len_torch_dispatch_stack():
            # a refusal is tried again once after a runtime call on the device gives this thread its context
            failed = cuda_host.copy_async(spans, self._copy_handle, self.copy_stream.query)
            if failed is None:
                return staged
            _DRIVER_REFUSED.add(self._device_index)
        with torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext():
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        if failed is not None:  # once the chunk is copied (an error filter raises it: the engine recovers as from any)
            warn(
                f"the CUDA driver refused a staged copy ({failed}); tritoff queues its copies through PyTorch on "
                f"{self.device} from now on"
            )
        return staged

    @contextlib.contextmanager
    def _synchronous(self):
        """Count a synchronous fill or upload (the CPU path) on :attr:`clock`, less the waits for the disk inside it,
        which are the disk ring's to count (the hooks' counter takes both off)."""
        waited = self.disk.wait_ns if self.disk is not None else 0
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            waited = (self.disk.wait_ns if self.disk is not None else 0) - waited
            self.clock.ns += time.perf_counter_ns() - start - waited

    def _fill_now(self, group: GroupRuntime, dst: torch.Tensor) -> int:
        if group.device_pack is not None:
            return group.fill_direct(dst)
        with self.host_bytes(group) as host:
            if not self.staging:
                return group.fill_from_host(dst, host)
            for index, chunk in enumerate(group.chunks):
                half = self._half
                self._half ^= 1
                group.fill_chunk(index, self._stage(chunk, host, half), dst)
        return group.packed_bytes

    def mark_compute(self) -> torch.cuda.Event | None:
        """An event recorded on the compute (current) stream now: what a fill into memory the compute stream just
        allocated, or last used, must wait for (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the compute, current one) wait for every copy and fill issued so far."""
        if self.cuda:
            compute = stream if stream is not None else torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            compute.wait_stream(self.upcast_stream)

    def note_compute_stream(self) -> None:
        """At each call of the phase: a current stream other than the home one (a caller may run one call under a
        stream of its own, the next under another) waits, the first time, for the phase's uploads, which only the
        stream current at its entry waited for, and is remembered, so the memory is freed only after its kernels."""
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.device)
        if current == self.home_stream or current in self.compute_streams:
            return
        if torch.cuda.is_current_stream_capturing():
            # a CUDA graph's capture (of a phase tritoff keeps resident for it) may not wait for streams outside it
            return
        if len(self.compute_streams) >= MAX_COMPUTE_STREAMS:  # a new stream at every call: wait for the old now
            self.home_waits_for_compute()
            self.compute_streams.clear()
        self.compute_waits(current)
        self.compute_streams.add(current)

    def before_free(self) -> None:
        """Before memory allocated on the home stream is freed: the current (compute) stream and the home stream wait
        for every copy and fill issued so far, and the home stream, whose next allocations may reuse the memory,
        also for the kernels of the current stream and of every stream the phase's calls computed on, which may
        still read it (a caller running under another stream)."""
        if self.cuda:
            self.compute_waits()
            current = torch.cuda.current_stream(self.device)
            if self.home_stream != current:
                self.compute_waits(self.home_stream)
            self.home_waits_for_compute(current)

    def home_waits_for_compute(self, current: torch.cuda.Stream | None = None) -> None:
        """Make the home stream wait for the kernels queued so far on every stream the phase's calls computed on,
        and on ``current``. A stream its owner has destroyed since (an ``ExternalStream`` over a handle it freed)
        cannot be waited on: the device is synchronized instead, which waits for whatever it still runs."""
        for stream in {*self.compute_streams, *((current,) if current is not None else ())}:
            if stream == self.home_stream:
                continue
            try:
                self.home_stream.wait_stream(stream)
            except RuntimeError:
                torch.cuda.synchronize(self.device)

    def wait_for_compute(self) -> None:
        """Make both transfer streams wait for the compute stream's work so far: memory just allocated on the
        compute stream may have been freed by kernels still queued there."""
        if self.cuda:
            event = self.mark_compute()
            self.copy_stream.wait_event(event)
            self.upcast_stream.wait_event(event)

    def upload(self, group: GroupRuntime, dst: torch.Tensor) -> None:
        """Copy ``group``'s pack into device ``dst`` on the copy stream; later fills may read ``dst``."""
        if not self.cuda:
            with self._synchronous(), self.host_bytes(group) as host:
                dst.copy_(host)
            return
        with self.host_bytes(group, self.copy_stream) as host, torch.cuda.stream(self.copy_stream):
            dst.copy_(host, non_blocking=True)
        self.upcast_stream.wait_stream(self.copy_stream)

    def release(self) -> None:
        """Free the staging halves (teardown)."""
        self.staging = []
        self._used = []
        self._copies = {}

    def __del__(self):
        free_after_transfers(self, getattr(self, "staging", None))


def free_after_transfers(transfer: Transfer | None, buffers: list | None) -> None:
    """Before ``buffers`` of a dropped Transfer or SlotRing (a pipeline deleted without ``tritoff.disable``) go back
    to the allocator: the stream they were allocated on waits for the copies and fills still queued on ``transfer``'s
    streams, which may be writing them, since its next allocations may reuse their memory."""
    if buffers and transfer is not None and transfer.cuda:
        try:
            transfer.compute_waits(transfer.home_stream)
            transfer.home_waits_for_compute()  # and for the kernels of the streams its calls computed on
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass

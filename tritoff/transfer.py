"""Moving packs into GPU buffers: the copy engine fills staging halves, an upcast stream turns them into tensors.

Two side streams, created once. On the *copy stream*, a chunk of a pack is copied (DMA, from page-locked memory)
into one of two staging halves; on the *upcast stream*, the kernel turns that chunk into its tensors in the
destination. With two halves, the DMA of the next chunk (of this pack or the next one) runs while the current one is
upcast, so the copy engine never waits for the SMs. Events only: the copy stream waits for the upcast that last read a
half before overwriting it, the upcast stream waits for the chunk's DMA and for the event after which the destination
may be overwritten. The host never synchronizes.

Groups whose tensors come from their resident fp8 pack, or that are read zero-copy from the host, skip staging and
run on the upcast stream alone.

On the CPU the same calls run synchronously, through the staging halves when there are any (so the chunking is
exercised exactly as on a GPU).
"""

from __future__ import annotations

import time

import torch

from tritoff.chunks import stage_chunk
from tritoff.onload import GroupRuntime


class Transfer:
    """Staging halves of ``chunk_bytes`` each on ``device`` (none when 0), and the copy and upcast streams."""

    def __init__(self, device: torch.device, chunk_bytes: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self.staging = [
            torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(2 if chunk_bytes else 0)
        ]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.upcast_stream = torch.cuda.Stream(device) if self.cuda else None
        self._staged = [torch.cuda.Event() for _ in self.staging] if self.cuda else []
        self._free = [torch.cuda.Event() for _ in self.staging] if self.cuda else []
        self._used = [False] * len(self.staging)
        self._half = 0
        self.sync_fill_ns = 0  # time spent filling synchronously (the CPU): transfer time, not hook overhead

    @property
    def staging_bytes(self) -> int:
        """Bytes of both staging halves."""
        return self.chunk_bytes * len(self.staging)

    def fill(self, group: GroupRuntime, dst: torch.Tensor, after: torch.cuda.Event | None = None) -> int:
        """Write ``group``'s tensors into ``dst`` (asynchronously on CUDA); returns the host bytes read.

        On CUDA, nothing is written into ``dst`` before ``after`` (an event marking the end of its previous use);
        callers that need the result record an event on :attr:`upcast_stream` after this call.
        """
        if not self.cuda:
            start = time.perf_counter_ns()
            moved = self._fill_now(group, dst)
            self.sync_fill_ns += time.perf_counter_ns() - start
            return moved
        if group.direct:
            with torch.cuda.stream(self.upcast_stream):
                if after is not None:
                    self.upcast_stream.wait_event(after)
                return group.fill_direct(dst)
        if not self.staging:
            raise RuntimeError(f"{group.component}.{group.name} needs staging but the plan has none")
        for index, chunk in enumerate(group.chunks):
            half = self._half
            self._half ^= 1
            with torch.cuda.stream(self.copy_stream):
                if self._used[half]:
                    self.copy_stream.wait_event(self._free[half])
                staged = stage_chunk(chunk, group.pack.data, self.staging[half])
                self._staged[half].record(self.copy_stream)
            with torch.cuda.stream(self.upcast_stream):
                self.upcast_stream.wait_event(self._staged[half])
                if index == 0 and after is not None:
                    self.upcast_stream.wait_event(after)
                group.fill_chunk(index, staged, dst)
                self._free[half].record(self.upcast_stream)
            self._used[half] = True
        return group.packed_bytes

    def _fill_now(self, group: GroupRuntime, dst: torch.Tensor) -> int:
        if group.device_pack is not None:
            return group.fill_direct(dst)
        if not self.staging:
            return group.fill_from_host(dst)
        for index, chunk in enumerate(group.chunks):
            staging = self.staging[self._half]
            self._half ^= 1
            group.fill_chunk(index, stage_chunk(chunk, group.pack.data, staging), dst)
        return group.packed_bytes

    def mark_compute(self) -> torch.cuda.Event | None:
        """An event recorded on the compute (current) stream now: what a fill into memory the compute stream just
        allocated, or last used, must wait for (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self) -> None:
        """Make the compute (current) stream wait for every copy and fill issued so far."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            compute.wait_stream(self.upcast_stream)

    def wait_for_compute(self) -> None:
        """Make both transfer streams wait for the compute stream's work so far: memory just allocated on the
        compute stream may have been freed by kernels still queued there."""
        if self.cuda:
            event = self.mark_compute()
            self.copy_stream.wait_event(event)
            self.upcast_stream.wait_event(event)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host bytes ``src`` into device ``dst`` on the copy stream; later fills may read ``dst``."""
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
        self.upcast_stream.wait_stream(self.copy_stream)

    def release(self) -> None:
        """Free the staging halves (teardown)."""
        self.staging = []
        self._used = []

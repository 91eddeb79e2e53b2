"""The host arena: every pack of a model in one allocation, page-locked on CUDA machines.

The arena is one anonymous memory mapping (page-aligned, faulted in as packs are written, so host memory tracks the
packed bytes) page-locked through the driver API (``tritoff/cuda_host.py``: a failure leaves no sticky CUDA error).
Page-locking faults in and pins every page at once, so arenas are locked once their packs are written (``register``
after packing or reading): locked up front, the whole arena would be resident beside the weights still being packed.
PyTorch's ``pin_memory`` is avoided on purpose: its caching host allocator rounds every allocation up to a power of
two (a 12 GiB model would pin 16 GiB).
"""

from __future__ import annotations

import mmap

import torch

from tritoff.warn import warn

PAGE = 4096


def locks(register: bool | None) -> bool:
    """Whether an arena is page-locked given ``register``: None means when CUDA is available."""
    return torch.cuda.is_available() if register is None else register


class HostArena:
    """One host buffer of ``nbytes``; ``register`` page-locks it now (default: when CUDA is available), else
    :meth:`register` does later."""

    def __init__(self, nbytes: int, *, register: bool | None = None):
        self.nbytes = int(nbytes)
        self._map = mmap.mmap(-1, max(self.nbytes, PAGE))
        self.buffer = (
            torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes)
            if self.nbytes
            else torch.empty(0, dtype=torch.uint8, device="cpu")
        )
        self.registered = False
        self.register_error: str | None = None
        self.readers: set[torch.device] = set()  # CUDA devices whose transfers read it (see close)
        if locks(register):
            self.register()

    def register(self) -> None:
        """Page-lock the arena (a failure warns: transfers fall back to pageable memory); nothing if it already is."""
        if self.registered or not self.nbytes:
            return
        from tritoff import cuda_host

        self.register_error = cuda_host.register(self.buffer.data_ptr(), self.nbytes)
        if self.register_error is not None:
            warn(
                f"page-locking {self.nbytes / 2**30:.2f} GiB of host memory failed ({self.register_error}); transfers "
                "fall back to pageable memory, whose copies wait for the GPU to catch up, so they no longer overlap "
                "compute (page-locking needs that much free host memory: free some, or lower host_budget)."
            )
            return
        self.registered = True

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 view of ``nbytes`` at ``offset``."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.nbytes} bytes")
        return self.buffer[offset : offset + nbytes]

    def device_view(self, offset: int, nbytes: int, device: torch.device | str = "cuda") -> torch.Tensor:
        """A CUDA uint8 tensor aliasing host bytes, for kernels that read host memory directly (zero-copy).

        Registered memory is mapped into the GPU's unified address space under the same pointer.
        """
        if not self.registered:
            raise RuntimeError("zero-copy reads need a page-locked arena; this one is not registered with CUDA")
        from tritoff.cuda_host import device_index

        host = self.view(offset, nbytes)
        device = torch.device("cuda", device_index(device))  # "cuda" alone has no index, which set_ needs
        storage = torch._C._construct_storage_from_data_pointer(host.data_ptr(), device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))

    def device_view_of(self, host: torch.Tensor, device: torch.device | str = "cuda") -> torch.Tensor:
        """:meth:`device_view` of ``host``, a view of this arena."""
        offset = host.data_ptr() - self.buffer.data_ptr()
        return self.device_view(offset, host.numel(), device)

    def close(self) -> None:
        """Unregister the arena (its memory is freed when the last view goes away)."""
        if self.registered:
            from tritoff import cuda_host

            # copies still reading it (prefetches queued by a pipeline dropped without tritoff.disable) finish first:
            # the driver does not wait for them
            devices = set(self.readers)
            if torch.cuda.is_initialized():
                devices.add(torch.device("cuda", torch.cuda.current_device()))
            for device in devices:
                torch.cuda.synchronize(device)
            cuda_host.unregister(self.buffer.data_ptr())
            self.registered = False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass

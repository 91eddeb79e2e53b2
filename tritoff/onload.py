"""A group at run time: where its pack is, how it becomes tensors on the GPU, and binding its parameters to them."""

from __future__ import annotations

import torch

from tritoff.kernels.upcast import (
    BLOCK,
    BLOCK_ZERO_COPY,
    upcast_pack,
    upcast_pack_reference,
    upcast_pack_zero_copy,
)
from tritoff.packer import Pack, PackedModel


class GroupRuntime:
    """One pack's onload machinery; its parameters point at a GPU buffer while loaded and at placeholders otherwise."""

    def __init__(
        self,
        component: str,
        pack: Pack,
        packed: PackedModel,
        params: list[torch.nn.Parameter],
        device: torch.device,
        use_triton: bool,
        zero_copy: bool,
    ):
        self.component = component
        self.name = pack.name
        self.pack = pack
        self.layout = pack.layout
        self.arena = packed.arena
        self.storage = packed.storage
        self.params = params
        self.device = device
        self.use_triton = use_triton
        self.zero_copy = zero_copy and device.type == "cuda" and packed.arena.registered
        # tables are tiny (8 int64 per tensor) and stay on the device; zero-copy launches use larger blocks
        self.table_cpu = self.layout.table(BLOCK)
        self.launches = {False: (self.layout.table(BLOCK, device), self.layout.n_programs(BLOCK))}
        if self.zero_copy:
            self.launches[True] = (self.layout.table(BLOCK_ZERO_COPY, device), self.layout.n_programs(BLOCK_ZERO_COPY))
        self.placeholders = [torch.empty(0, dtype=p.dtype, device=device) for p in params]
        self.tier = "stream"
        self.device_pack: torch.Tensor | None = None  # fp8 tier: the pack resident on the GPU
        self.buffer: torch.Tensor | None = None  # bf16 tier or pool unit: its own buffer
        self.slot: int | None = None  # ring slot holding it while streamed
        self.ready: torch.cuda.Event | None = None
        self._views: dict[int, list[torch.Tensor]] = {}

    @property
    def packed_bytes(self) -> int:
        """Bytes of the pack (what crosses PCIe when streamed)."""
        return self.layout.nbytes

    @property
    def unpacked_bytes(self) -> int:
        """Bytes of its tensors on the GPU."""
        return self.layout.out_nbytes

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` for each parameter, cached per buffer (building them costs ~3 us per tensor)."""
        key = buffer.data_ptr()
        if key not in self._views:
            self._views[key] = self._ordered_views(buffer)
        return self._views[key]

    def _ordered_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        by_name = self.layout.views(buffer)
        return [by_name[e.name] for e in self.layout.entries]

    def bind(self, buffer: torch.Tensor) -> None:
        """Point every parameter at its view of ``buffer``."""
        for param, view in zip(self.params, self.views(buffer), strict=True):
            param.data = view

    def release(self) -> None:
        """Point every parameter at a zero-size placeholder on the compute device."""
        for param, placeholder in zip(self.params, self.placeholders, strict=True):
            param.data = placeholder

    def forget_buffer(self, buffer: torch.Tensor) -> None:
        """Drop cached views of a buffer that is going away."""
        self._views.pop(buffer.data_ptr(), None)

    def fill(self, dst: torch.Tensor, staging: torch.Tensor | None) -> int:
        """Write the group's tensors into ``dst`` on the current stream; returns the host bytes read.

        Sources, in order: the resident fp8 pack (HBM), the host arena directly (zero-copy), or the arena copied into
        ``staging`` by the copy engine.
        """
        if self.device_pack is not None:
            self._upcast(self.device_pack, dst, zero_copy=False)
            return 0
        if self.zero_copy:
            self._upcast(self.arena.device_view(self.pack.offset, self.packed_bytes, self.device), dst, zero_copy=True)
            return self.packed_bytes
        source = self.pack.data
        if self.device.type == "cuda" or self.use_triton:
            if staging is None:
                staging = torch.empty(self.packed_bytes, dtype=torch.uint8, device=self.device)
            staged = staging[: self.packed_bytes]
            staged.copy_(source, non_blocking=True)
            source = staged
        self._upcast(source, dst, zero_copy=False)
        return self.packed_bytes

    def _upcast(self, src: torch.Tensor, dst: torch.Tensor, zero_copy: bool) -> None:
        if not self.use_triton:
            upcast_pack_reference(src, dst, self.table_cpu, self.layout.out_dtype, self.storage)
            return
        table, n_programs = self.launches[zero_copy]
        kernel = upcast_pack_zero_copy if zero_copy else upcast_pack
        kernel(src, dst, table, n_programs, self.layout.out_dtype, self.storage)

    def dequantized(self, device: torch.device) -> list[torch.Tensor]:
        """Fresh tensors on ``device`` holding the group's weights (dequantized exactly, with the reference)."""
        out = torch.empty(self.unpacked_bytes, dtype=torch.uint8)
        upcast_pack_reference(self.pack.data, out, self.table_cpu, self.layout.out_dtype, self.storage)
        return self._ordered_views(out.to(device))

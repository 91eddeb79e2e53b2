"""Split a pack into chunks that fit a staging buffer, so no transfer ever needs a temporary of the pack's size.

A pack smaller than the staging buffer is one chunk: one copy of the whole pack and its own table. A larger one (a
pool unit such as UMT5-XXL's 2.1 GB embedding, or any pack when staging is split in two halves so the DMA of one half
overlaps the upcast of the other) becomes several chunks. Each chunk is a contiguous run of *pieces* (whole tensors,
or parts of one cut at whole rows for row-scaled weights, at 256-byte boundaries otherwise) and moves as at most two
copies: its payload range and its scale range (scales sit after all payloads in a pack, in entry order, so a chunk's
scales are contiguous too). Its table points the kernel at the staged bytes and at the pieces' places in the
unpacked buffer, so the kernel and its reference run on a chunk exactly as on a pack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tritoff.kernels.upcast import BLOCK, KIND_COPY, PAD, TABLE_COLUMNS, chunk_starts
from tritoff.pack import ALIGN, PackLayout, align


@dataclass(frozen=True)
class Piece:
    """A tensor or part of one: kernel units (4-byte words or fp8 elements), where they are and where they go."""

    kind: int
    src: int  # payload byte offset in the pack
    nbytes: int  # payload bytes
    scale_src: int  # scale byte offset in the pack (-1: none)
    scale_bytes: int
    dst: int  # byte offset in the unpacked buffer
    units: int
    row_len: int


@dataclass(frozen=True)
class Chunk:
    """What one staging fill moves: ``payload`` and ``scales`` ([start, end) byte ranges of the pack, copied to
    staging offsets 0 and ``scale_base``) and the kernel table rows of its pieces."""

    payload: tuple[int, int]
    scales: tuple[int, int]
    scale_base: int
    rows: tuple[tuple[int, ...], ...]  # TABLE_COLUMNS - 1 columns: the table without chunk_start

    @property
    def staged_bytes(self) -> int:
        """Bytes of staging the chunk occupies."""
        return self.scale_base + (self.scales[1] - self.scales[0])

    def n_programs(self, block: int = BLOCK) -> int:
        """Programs an upcast launch of this chunk runs."""
        return chunk_starts([r[3] for r in self.rows], block)[-1]

    def table(self, block: int = BLOCK, device: torch.device | str = "cpu") -> torch.Tensor:
        """The kernel's int64 table for this chunk."""
        starts = chunk_starts([r[3] for r in self.rows], block)
        rows = [[start, *r] for start, r in zip(starts, self.rows, strict=False)]
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, TABLE_COLUMNS).to(device)


def _pieces(layout: PackLayout):
    """Each entry as (entry, unit payload bytes, unit scale bytes, units, per-tensor scale) for cutting."""
    for e in layout.entries:
        if e.kind == KIND_COPY:
            yield e, ALIGN, 0, -(-e.nbytes // ALIGN), False
        elif e.num_scales > 1:
            # whole rows, and a multiple of 256 bytes so every cut lands on an aligned offset in pack and output
            rows = ALIGN // math.gcd(e.row_len, ALIGN)
            yield e, rows * e.row_len, 4 * rows, -(-e.num_scales // rows), False
        else:
            yield e, ALIGN, 0, -(-e.numel // ALIGN), True


def _piece(e, unit_payload: int, unit_scales: int, first: int, count: int, per_tensor: bool) -> Piece:
    out_size = e.out_nbytes // max(e.numel, 1)
    start = first * unit_payload
    nbytes = min(count * unit_payload, e.nbytes - start)
    if e.kind == KIND_COPY:
        return Piece(e.kind, e.offset + start, nbytes, -1, 0, e.out_offset + start, -(-nbytes // 4), 0)
    if per_tensor:
        return Piece(
            e.kind, e.offset + start, nbytes, e.scale_offset, 4, e.out_offset + start * out_size, nbytes, nbytes
        )
    rows = nbytes // e.row_len
    scale_src = e.scale_offset + first * unit_scales
    return Piece(
        e.kind, e.offset + start, nbytes, scale_src, 4 * rows, e.out_offset + start * out_size, nbytes, e.row_len
    )


def _chunk(pieces: list[Piece]) -> Chunk:
    payload = (pieces[0].src, align(pieces[-1].src + pieces[-1].nbytes))
    scaled = [p for p in pieces if p.scale_bytes]
    scales = (scaled[0].scale_src, scaled[-1].scale_src + scaled[-1].scale_bytes) if scaled else (0, 0)
    base = align(payload[1] - payload[0])
    rows = tuple(
        (
            p.kind,
            p.src - payload[0],
            p.dst,
            p.units,
            p.row_len if p.scale_bytes else 1,
            base + p.scale_src - scales[0] if p.scale_bytes else 0,
            align(p.units, PAD),
        )
        for p in pieces
    )
    return Chunk(payload, scales, base, rows)


def smallest_chunk(layout: PackLayout) -> int:
    """The smallest staging capacity :func:`split_pack` accepts for ``layout`` (its largest uncuttable piece)."""
    return max((_chunk([_piece(e, up, us, 0, 1, pt)]).staged_bytes for e, up, us, _, pt in _pieces(layout)), default=0)


def halving_chunk(layout: PackLayout) -> int:
    """A staging capacity that moves ``layout``'s pack in two chunks (one when it is small enough): half the pack,
    plus what cutting it costs (each chunk's payload and scales are padded to 256 bytes, and so is a tensor cut at a
    row). Exactly half would leave a third chunk of a few KiB, which takes a staging half of its own: the next pack's
    first chunk would then wait for the upcast of this pack's second."""
    capacity = max(align(-(-layout.nbytes // 2)), smallest_chunk(layout))
    while len(chunks := split_pack(layout, capacity)) > 2:
        capacity += align(sum(c.staged_bytes for c in chunks[2:]))
    return capacity


# (layout geometry, capacity) -> its chunks: the blocks of a transformer share one geometry (Wan-14B's 40), and
# cutting a pack takes milliseconds, done for the plan, the staging size and every group's tables
_CUTS: dict[tuple, tuple[Chunk, ...]] = {}
_CUTS_KEPT = 1024


def split_pack(layout: PackLayout, capacity: int) -> list[Chunk]:
    """``layout``'s pack as chunks of at most ``capacity`` staged bytes (one chunk when the whole pack fits); cut once
    per geometry and capacity (chunks hold no names, so packs of one geometry share them).

    Raises ``ValueError`` when ``capacity`` cannot hold even the smallest piece of some tensor.
    """
    key = (layout.geometry, capacity)
    cut = _CUTS.get(key)
    if cut is None:
        if len(_CUTS) >= _CUTS_KEPT:
            _CUTS.clear()
        cut = _CUTS[key] = tuple(_split(layout, capacity))
    return list(cut)


def _split(layout: PackLayout, capacity: int) -> list[Chunk]:
    if not layout.entries:
        return []
    if layout.nbytes <= capacity:
        rows = tuple(tuple(int(v) for v in row[1:]) for row in layout.table().tolist())
        return [Chunk((0, layout.nbytes), (0, 0), layout.nbytes, rows)]
    chunks: list[Chunk] = []
    current: list[Piece] = []

    def size(pieces: list[Piece]) -> int:
        return _chunk(pieces).staged_bytes

    for e, unit_payload, unit_scales, units, per_tensor in _pieces(layout):
        done = 0
        while done < units:
            # the most units of this entry that still fit beside the current chunk's pieces (binary search)
            low, high = 0, units - done
            while low < high:
                mid = (low + high + 1) // 2
                candidate = _piece(e, unit_payload, unit_scales, done, mid, per_tensor)
                if size([*current, candidate]) <= capacity:
                    low = mid
                else:
                    high = mid - 1
            if low == 0:
                if not current:
                    smallest = size([_piece(e, unit_payload, unit_scales, done, 1, per_tensor)])
                    raise ValueError(
                        f"a staging chunk of {capacity} bytes cannot hold one piece of {e.name} ({smallest} bytes)"
                    )
                chunks.append(_chunk(current))
                current = []
                continue
            current.append(_piece(e, unit_payload, unit_scales, done, low, per_tensor))
            done += low
    if current:
        chunks.append(_chunk(current))
    return chunks


def chunk_views(chunk: Chunk, pack: torch.Tensor, staging: torch.Tensor):
    """What staging ``chunk`` of ``pack`` reads and writes: the staged bytes the kernel reads, then one (staging view,
    pack view) pair per copy (the payload, and the scales when the chunk has any)."""
    a, b = chunk.payload
    copies = [(staging[: b - a], pack[a:b])]
    if chunk.scales[1] > chunk.scales[0]:
        a, b = chunk.scales
        copies.append((staging[chunk.scale_base : chunk.scale_base + b - a], pack[a:b]))
    return staging[: chunk.staged_bytes], *copies


def stage_chunk(chunk: Chunk, pack: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """Copy ``chunk``'s bytes of ``pack`` into ``staging`` (on the current stream; asynchronous from page-locked
    memory) and return the staged bytes the kernel reads."""
    staged, *copies = chunk_views(chunk, pack, staging)
    for dst, src in copies:
        dst.copy_(src, non_blocking=True)
    return staged

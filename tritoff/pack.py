"""Packs: one contiguous byte buffer per module group, laid out for the upcast kernel.

A pack holds, each at a 256-byte aligned offset: the fp8 payload of every quantized weight, its fp32 power-of-two
scales, and every kept tensor as it is (bf16, or fp32 where the model keeps fp32). Its layout also places every tensor
in the *unpacked* buffer the kernel writes (again 256-byte aligned), so one launch fills a whole group.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from tritoff.formats import StorageFormat
from tritoff.kernels.quantize import NonFiniteError
from tritoff.kernels.upcast import (
    BLOCK,
    KIND_COPY,
    KIND_FP8,
    PAD,
    TABLE_COLUMNS,
    chunk_starts,
    row_pieces,
)

ALIGN = 256


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to pack: its name, shape, the dtype it computes with, and whether it is to be quantized."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quantize: bool


@dataclass(frozen=True)
class PackEntry:
    """Where one tensor lives in a pack and in the unpacked buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype it comes back as
    kind: int  # KIND_* of tritoff.kernels.upcast
    offset: int  # payload byte offset in the pack
    nbytes: int  # payload bytes
    scale_offset: int  # byte offset of the fp32 scales in the pack, -1 when there are none
    num_scales: int
    out_offset: int  # byte offset in the unpacked buffer

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)

    @property
    def out_nbytes(self) -> int:
        """Bytes of the tensor once unpacked."""
        return self.numel * self.dtype.itemsize

    @property
    def row_len(self) -> int:
        """Elements sharing one scale."""
        return self.numel // max(self.num_scales, 1)

    @property
    def kernel_units(self) -> int:
        """Units the kernel iterates over: 4-byte words for copies, elements otherwise."""
        return -(-self.nbytes // 4) if self.kind == KIND_COPY else self.numel


class MixedDtypes(ValueError):
    """Weights to quantize in more than one dtype in one pack, whose upcast gives every weight one dtype back."""

    def __init__(self, dtypes: dict[str, torch.dtype], message: str | None = None):
        self.dtypes = dtypes  # name -> dtype of each weight to quantize
        named = ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for name, dtype in dtypes.items())
        super().__init__(message or f"a pack's weights to quantize must share one dtype, got {named}")


@dataclass(frozen=True)
class PackLayout:
    """The table of a pack: its entries, its size, and the size of its unpacked buffer."""

    entries: tuple[PackEntry, ...]
    nbytes: int
    out_nbytes: int
    out_dtype: torch.dtype
    storage: StorageFormat
    granularity: str

    @classmethod
    def plan(cls, specs: list[TensorSpec], storage: StorageFormat, granularity: str = "row") -> PackLayout:
        """Lay out ``specs``: payloads first, then scales, each 256-byte aligned; unpacked outputs in spec order."""
        # bf16/fp16 storage is pure offload: every tensor is copied in its own dtype, nothing is rounded
        compute = {s.dtype for s in specs if s.quantize and storage.is_fp8}
        if len(compute) > 1:
            raise MixedDtypes({s.name: s.dtype for s in specs if s.quantize})
        out_dtype = compute.pop() if compute else torch.bfloat16
        entries, offset, out_offset = [], 0, 0
        scale_sizes = []
        for spec in specs:
            numel = math.prod(spec.shape)
            itemsize = spec.dtype.itemsize
            kind, nbytes, num_scales = KIND_COPY, numel * itemsize, 0
            if spec.quantize and numel and storage.is_fp8:
                kind, nbytes = KIND_FP8, numel
                num_scales = spec.shape[0] if granularity == "row" and len(spec.shape) > 1 else 1
            entries.append([spec, kind, offset, nbytes, num_scales, out_offset])
            scale_sizes.append(4 * num_scales)
            offset += align(nbytes)
            out_offset += align(numel * itemsize)
        result = []
        for (spec, kind, off, nbytes, num_scales, out_off), scale_bytes in zip(entries, scale_sizes, strict=True):
            scale_offset = -1
            if scale_bytes:
                scale_offset, offset = offset, offset + align(scale_bytes)
            result.append(
                PackEntry(spec.name, spec.shape, spec.dtype, kind, off, nbytes, scale_offset, num_scales, out_off)
            )
        return cls(tuple(result), offset, out_offset, out_dtype, storage, granularity)

    @functools.cached_property
    def geometry(self) -> tuple:
        """The layout without its names: what its tables and chunks depend on (a transformer's blocks share it)."""
        return self.nbytes, tuple(
            (e.shape, e.dtype, e.kind, e.offset, e.nbytes, e.scale_offset, e.num_scales, e.out_offset)
            for e in self.entries
        )

    @property
    def quantized_bytes(self) -> int:
        """Bytes the quantized weights would take in their own dtype (what the pack saves on)."""
        return sum(e.out_nbytes for e in self.entries if e.kind != KIND_COPY)

    def n_programs(self, block: int = BLOCK) -> int:
        """Programs one upcast launch of this pack runs with ``block`` units per program."""
        return chunk_starts([e.kernel_units for e in self.entries], block)[-1]

    def table(self, block: int = BLOCK, device: torch.device | str = "cpu") -> torch.Tensor:
        """The kernel's int64 table (``TABLE_COLUMNS`` per tensor) for ``block`` units per program."""
        starts = chunk_starts([e.kernel_units for e in self.entries], block)
        rows = [
            [
                start,
                e.kind,
                e.offset,
                e.out_offset,
                e.kernel_units,
                e.row_len,
                max(e.scale_offset, 0),
                align(e.kernel_units, PAD),
            ]
            for start, e in zip(starts, self.entries, strict=False)
        ]
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, TABLE_COLUMNS)
        return table.to(device)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors viewing an unpacked ``buffer`` (uint8, ``out_nbytes`` long), by name."""
        return {
            e.name: buffer[e.out_offset : e.out_offset + e.out_nbytes].view(e.dtype).view(e.shape) for e in self.entries
        }


def write_pack(
    layout: PackLayout, data: torch.Tensor, tensors: dict[str, torch.Tensor], quantizer, snr: dict | None = None
) -> None:
    """Fill the pack ``data`` (uint8, ``layout.nbytes`` long) from ``tensors``.

    ``quantizer(w, fmt, granularity) -> (codes, scales)`` is the kernel or its reference. A quantized weight holding
    NaN or Inf is refused with an error naming it. ``snr``, when given, receives each quantized weight's SNR in dB.
    """
    for e in layout.entries:
        write_entry(layout, data, e, tensors[e.name], quantizer, snr)


def write_entry(
    layout: PackLayout, data: torch.Tensor, e: PackEntry, t: torch.Tensor, quantizer, snr: dict | None = None
) -> None:
    """Write one tensor ``t`` into its place ``e`` of the pack ``data`` (quantized or copied, as the layout says)."""
    if tuple(t.shape) != e.shape:
        raise ValueError(f"{e.name}: shape {tuple(t.shape)} does not match the pack's {e.shape}")
    payload = data[e.offset : e.offset + e.nbytes]
    if e.kind == KIND_FP8:
        try:
            codes, scales = quantizer(t, layout.storage, layout.granularity)
        except NonFiniteError:
            raise ValueError(f"{e.name} contains NaN or Inf: fix or skip this weight before quantizing it") from None
        codes = within_range(codes, scales, layout.storage, e.dtype)
        if snr is not None:
            from tritoff.snr import CHUNK, snr_db_of_chunks

            pieces = _dequantized_chunks(t, codes, scales, layout.storage.dtype, CHUNK)
            snr[e.name] = snr_db_of_chunks(pieces)
        payload.copy_(codes.reshape(-1).cpu())
        data[e.scale_offset : e.scale_offset + 4 * e.num_scales].view(torch.float32).copy_(scales.cpu())
    else:
        payload.copy_(t.detach().to(e.dtype).reshape(-1).contiguous().view(torch.uint8).cpu())


def within_range(codes: torch.Tensor, scales: torch.Tensor, fmt, dtype: torch.dtype) -> torch.Tensor:
    """``codes`` (uint8, rows of ``scales``) whose dequantized value ``code * scale`` would overflow ``dtype`` step down
    to the largest fp8 value that fits, in place: the cast rounds a row's largest value up (an fp16 weight of 64000 at
    scale 2^8 becomes 256 * 2^8 = 65536, Inf in fp16), so weights saturate at the compute dtype's largest value as
    they do at the format's. Only rows whose scale times the format's largest value exceeds it are read (fp16 rows
    holding values past 2^15 or so; never a bf16 or fp32 one, whose range holds every code at any scale)."""
    limit = torch.finfo(dtype).max
    at_risk = (scales * fmt.max > limit).nonzero().flatten()
    if at_risk.numel():
        rows = codes.view(len(scales), -1)
        risky = rows[at_risk]
        over = risky.view(fmt.dtype).float().abs() * scales[at_risk, None] > limit
        # one step down in magnitude: the bits below the sign count up with the value; the unrounded value fit
        rows[at_risk] = torch.where(over, risky - 1, risky)
    return codes


def _dequantized_chunks(t: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, piece: int):
    """``(t, dequantized codes)`` in pieces of at most ``piece`` elements (:func:`row_pieces`), so measuring a
    weight's SNR never holds a float copy of the whole weight."""
    rows = codes.reshape(len(scales), -1).view(dtype)
    ref = t.reshape(rows.shape)
    for r, c in row_pieces(*rows.shape, piece=piece):
        yield ref[r, c], rows[r, c].float() * scales[r, None]


def read_entry(layout: PackLayout, data: torch.Tensor, e: PackEntry) -> torch.Tensor:
    """One tensor of the pack ``data``, dequantized exactly as the kernels do (a fresh tensor on ``data``'s device)."""
    payload = data[e.offset : e.offset + e.nbytes]
    if e.kind != KIND_FP8:
        return payload.clone().view(e.dtype).view(e.shape)
    codes = payload.view(layout.storage.dtype).to(torch.float32).view(e.num_scales, -1)
    scales = data[e.scale_offset : e.scale_offset + 4 * e.num_scales].view(torch.float32)
    return (codes * scales[:, None]).to(e.dtype).view(e.shape)


def dequantize_bytes(layout: PackLayout, data: torch.Tensor) -> torch.Tensor:
    """The pack ``data`` dequantized with plain PyTorch into one zero-filled buffer of ``layout.out_nbytes`` (the
    gaps between tensors stay zero, so two buffers compare bit for bit)."""
    from tritoff.kernels.upcast import upcast_pack_reference

    out = torch.zeros(layout.out_nbytes, dtype=torch.uint8)
    upcast_pack_reference(data, out, layout.table(), layout.out_dtype, layout.storage)
    return out


def unpack_reference(layout: PackLayout, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dequantize a pack with plain PyTorch into fresh tensors (the oracle the kernels are compared with)."""
    return {name: t.clone() for name, t in layout.views(dequantize_bytes(layout, data)).items()}

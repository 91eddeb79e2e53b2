"""Quantize weights to fp8 with power-of-two scales: Triton kernel, launcher, PyTorch reference.

A scale 2^k is chosen per row (or per tensor) so the row's absmax fits the format's largest finite value. Because the
scale is a power of two, ``w * 2^-k`` is exact in fp32 and ``fp8 * 2^k`` is exact in bf16: the only rounding is the
fp32 -> fp8 cast (round to nearest even, saturating at +-max), and dequantization is lossless.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from tritoff.formats import StorageFormat, check_granularity, get_format

from .backend import eager, holds_values, interpreting, launch, launch_device, native_fp8, register_op
from .fp8_bits import encode_fp8_bits

# Scale exponents are clamped so fp8 * 2^k never leaves bf16's normal range (smallest e5m2 subnormal 2^-16 * 2^-100).
MAX_SCALE_EXPONENT = 100

# One program per row; 2048 elements per step keeps 16 fp32 values per thread at 4 warps. Rows of Wan-14B are
# 5120 or 13824 long, so a row takes 3-7 steps.
_BLOCK = 2048

_FP8_DTYPES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


def _fp32_fields(x: float) -> tuple[int, int]:
    """Unbiased exponent and 23-bit mantissa of ``x`` as fp32 (plain Python: safe inside traced custom ops)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


def pow2_exponents(absmax: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """Exponents k (int32) such that ``absmax * 2^-k <= fmt.max`` with k smallest; 0 for a zero (or fp32 subnormal) max.

    With absmax = m_a 2^e_a and max = m_f 2^e_f (mantissas in [1, 2)): k = e_a - e_f + (m_a > m_f). The kernel
    computes the same integers from the same bits.
    """
    e_max, m_max = _fp32_fields(fmt.max)
    bits = absmax.to(torch.float32).contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    k = biased - 127 - e_max + ((bits & 0x7FFFFF) > m_max).to(torch.int32)
    k = torch.where(biased == 0, torch.zeros_like(k), k)
    return k.clamp(-MAX_SCALE_EXPONENT, MAX_SCALE_EXPONENT).to(torch.int32)


def _scale_from_exponent(k: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(k, dtype=torch.float32), k.to(torch.float32))


class NonFiniteError(ValueError):
    """A weight given to a quantizer holds NaN or Inf, which no fp8 code and power-of-two scale represent."""


def _checked(w: torch.Tensor, fmt: StorageFormat | str, granularity: str) -> StorageFormat:
    """The format ``fmt`` names, once ``w``, it and ``granularity`` are ones both quantizers take (one-line errors
    otherwise: without them the kernel and the reference would part ways on NaN, and a misspelled granularity would
    fall through to the plain cast)."""
    fmt = get_format(fmt)
    if not fmt.is_fp8:
        raise ValueError(f"quantize needs an fp8 format, got {fmt.name}")
    check_granularity(granularity)
    if w.is_complex():
        raise ValueError(f"quantize takes real weights, got {w.dtype}")
    if holds_values(w) and not torch.isfinite(w).all():  # traced (torch.compile, fake tensors): no values to read
        raise NonFiniteError("the weight contains NaN or Inf, which fp8 with scales cannot hold: fix or skip it")
    return fmt


def _as_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` viewed as rows along dim 0 (a scalar is one row of one; an empty tensor keeps its row count)."""
    if w.dim() == 0:
        return w.reshape(1, 1)
    return w.reshape(w.shape[0], math.prod(w.shape[1:]))


def _absmax(rows: torch.Tensor, per_row: bool) -> torch.Tensor:
    """Each row's largest magnitude (``per_row``) or the whole tensor's, in one element; 0 where there is nothing."""
    if rows.numel() == 0:
        return torch.zeros(rows.shape[0] if per_row else 1, dtype=rows.dtype, device=rows.device)
    return rows.abs().amax(dim=1) if per_row else rows.abs().amax().reshape(1)


def quantize_reference(
    w: torch.Tensor, fmt: StorageFormat | str, granularity: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: ``w`` viewed as rows (dim 0) -> (uint8 codes shaped like ``w``, fp32 scales).

    ``granularity``: ``"row"`` gives one scale per row, ``"tensor"`` one for the whole tensor, ``"none"`` the plain
    saturating cast with scale 1. ``fmt``: an fp8 format or its name. A weight holding NaN or Inf raises
    :class:`NonFiniteError`; an unknown granularity or a 16-bit format, a one-line ValueError.
    """
    fmt = _checked(w, fmt, granularity)
    rows = _as_rows(w).to(torch.float32)
    if granularity in ("row", "tensor"):
        k = pow2_exponents(_absmax(rows, granularity == "row"), fmt)
    else:
        k = torch.zeros(1, dtype=torch.int32, device=w.device)
    inv = _scale_from_exponent(-k)
    scaled = (rows * inv[:, None]).clamp(-fmt.max, fmt.max)
    codes = scaled.to(fmt.dtype).view(torch.uint8).reshape(w.shape)
    return codes, _scale_from_exponent(k)


@triton.jit
def _quantize_rows_kernel(
    w_ptr,
    q_ptr,
    scale_ptr,
    row_len,
    FMAX: tl.constexpr,
    FMAX_EXP: tl.constexpr,
    FMAX_MANTISSA: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    EXPONENT_BIAS: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    PER_ROW: tl.constexpr,
    MAX_EXP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * row_len
    cols = tl.arange(0, BLOCK)
    if PER_ROW:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, row_len, BLOCK):
            m = start + cols < row_len
            x = tl.load(w_ptr + base + start + cols, mask=m, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        k = biased - 127 - FMAX_EXP + ((bits & 0x7FFFFF) > FMAX_MANTISSA).to(tl.int32)
        k = tl.where(biased == 0, 0, k)
        k = tl.minimum(tl.maximum(k, -MAX_EXP), MAX_EXP)
        tl.store(scale_ptr + row, ((k + 127) << 23).to(tl.float32, bitcast=True))
        inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    else:
        # the scale is 2^k with |k| <= MAX_EXP: 2^-k from its exponent bits, since a compiled 1.0 / scale divides
        # approximately (div.full.f32, up to 2 ulp)
        scale_bits = tl.load(scale_ptr.to(tl.pointer_type(tl.int32), bitcast=True))
        inv = ((254 << 23) - scale_bits).to(tl.float32, bitcast=True)
    for start in range(0, row_len, BLOCK):
        m = start + cols < row_len
        x = tl.load(w_ptr + base + start + cols, mask=m, other=0.0).to(tl.float32) * inv
        x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
        if NATIVE_FP8:
            code = x.to(FP8_DTYPE).to(tl.uint8, bitcast=True)
        else:
            code = encode_fp8_bits(x, MANTISSA_BITS, EXPONENT_BIAS)
        tl.store(q_ptr + base + start + cols, code, mask=m)


def _quantize_rows_launcher(traceable: bool):
    """The launcher of the quantize kernel; ``traceable`` as in ``upcast._upcast_pack_launcher``."""

    def quantize_rows_launch(
        w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fp8_kind: int, per_row: bool, native: bool
    ) -> None:
        fmt_dtype = torch.float8_e4m3fn if fp8_kind == 0 else torch.float8_e5m2
        fmax = torch.finfo(fmt_dtype).max
        fmax_exp, fmax_mantissa = _fp32_fields(fmax)
        kernel = launch(_quantize_rows_kernel) if traceable else _quantize_rows_kernel
        kernel[(w.shape[0],)](
            w,
            q,
            scales,
            w.shape[1],
            FMAX=fmax,
            FMAX_EXP=fmax_exp,
            FMAX_MANTISSA=fmax_mantissa,
            MANTISSA_BITS=3 if fp8_kind == 0 else 2,
            EXPONENT_BIAS=7 if fp8_kind == 0 else 15,
            FP8_DTYPE=tl.float8e4nv if fp8_kind == 0 else tl.float8e5,
            NATIVE_FP8=native,
            PER_ROW=per_row,
            MAX_EXP=MAX_SCALE_EXPONENT,
            BLOCK=_BLOCK,
        )

    return quantize_rows_launch


_quantize_rows_eager = _quantize_rows_launcher(traceable=False)
# the op torch.compile and fake-tensor tracing see; eager calls launch directly (see ``backend.eager``)
_quantize_rows_op = register_op("quantize_rows", mutates_args=("q", "scales"))(_quantize_rows_launcher(traceable=True))


def quantize(
    w: torch.Tensor, fmt: StorageFormat | str, granularity: str = "row", *, native: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantization, bit-identical to :func:`quantize_reference` (same arguments, same results).

    ``native`` forces the hardware fp8 cast on or off (default: on where the device converts fp8 natively; Triton's
    interpreter rounds its own cast differently, so it is refused there).
    """
    fmt = _checked(w, fmt, granularity)
    if native and interpreting():
        raise ValueError("native=True needs a GPU's fp8 conversion: Triton's interpreter rounds its own differently")
    rows = _as_rows(w).contiguous()
    q = torch.empty(rows.shape, dtype=torch.uint8, device=w.device)
    if granularity == "row":
        # rows of no elements are never written by the kernel: scale 1, as for a row of zeros
        fill = torch.ones if not rows.shape[1] else torch.empty
        scales = fill(rows.shape[0], dtype=torch.float32, device=w.device)
    elif granularity == "tensor":
        scales = _scale_from_exponent(pow2_exponents(_absmax(rows, False), fmt))
    else:
        scales = torch.ones(1, dtype=torch.float32, device=w.device)
    if rows.numel():
        use_native = native_fp8(w.device) if native is None else native
        call = _quantize_rows_eager if eager(rows, q, scales) else _quantize_rows_op
        with launch_device(rows):
            call(rows, q, scales, _FP8_DTYPES[fmt.dtype], granularity == "row", use_native)
    return q.reshape(w.shape), scales

"""Storage formats and scale granularities: the names users pass to ``tritoff``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StorageFormat:
    """How weights are stored off-GPU.

    For fp8 formats ``max`` is the largest finite value, ``mantissa_bits`` and ``exponent_bias`` describe the encoding
    (the kernels encode and decode from these), and ``min_normal_exp`` is the exponent of the smallest normal value.
    """

    name: str
    dtype: torch.dtype
    is_fp8: bool
    max: float = 0.0
    mantissa_bits: int = 0
    exponent_bias: int = 0
    min_normal_exp: int = 0

    @property
    def bytes_per_element(self) -> int:
        """Bytes one stored element takes."""
        return self.dtype.itemsize


FORMATS: dict[str, StorageFormat] = {
    "fp8_e4m3": StorageFormat("fp8_e4m3", torch.float8_e4m3fn, True, 448.0, 3, 7, -6),
    "fp8_e5m2": StorageFormat("fp8_e5m2", torch.float8_e5m2, True, 57344.0, 2, 15, -14),
    "bf16": StorageFormat("bf16", torch.bfloat16, False),
    "fp16": StorageFormat("fp16", torch.float16, False),
}

GRANULARITIES = ("row", "tensor", "none")


def get_format(name: str | StorageFormat) -> StorageFormat:
    """Return the :class:`StorageFormat` called ``name`` (``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"bf16"``, ``"fp16"``)."""
    if isinstance(name, StorageFormat):
        return name
    key = str(name).strip().lower().replace("-", "_")  # spelled as the budgets are: case, "-" and spaces around
    if key in FORMATS:
        return FORMATS[key]
    raise ValueError(f"unknown storage {name!r}: use one of {', '.join(FORMATS)}")


def check_granularity(granularity: str) -> str:
    """Validate a scale granularity name: ``"row"`` (default), ``"tensor"`` or ``"none"`` (plain cast)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown scale granularity {granularity!r}: use one of {', '.join(GRANULARITIES)}")
    return granularity

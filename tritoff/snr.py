"""Signal-to-noise ratio, the measure every lossy path in tritoff is judged by."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

# below this a quantized weight is lost rather than rounded: the error's amplitude is a third of the weight's or more
# (scaled fp8 keeps 25 dB or more: docs/quantization.md)
LOST_DB = 10.0
# elements per step: float64 copies of a whole weight (Wan-14B's largest has 70.8M elements) would take gigabytes of
# the GPU that enable quantizes on, outside any budget
CHUNK = 1 << 22


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - approx)^2) in dB, computed in float64; inf when they are equal."""
    if reference.shape != approx.shape:
        shapes = f"{tuple(reference.shape)} and {tuple(approx.shape)}"
        raise ValueError(f"snr_db compares tensors of one shape, got {shapes}")
    ref, app = reference.detach().reshape(-1), approx.detach().reshape(-1)
    return snr_db_of_chunks((ref[i : i + CHUNK], app[i : i + CHUNK]) for i in range(0, ref.numel(), CHUNK))


def snr_db_of_chunks(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """:func:`snr_db` of the concatenation of ``(reference, approx)`` pairs, summed pair by pair on each approx's
    device, so no step holds more than one pair in float64."""
    signal = err = 0.0
    for ref, approx in pairs:
        # moved in its own dtype, widened where approx is (a copy to another device widens first: 4x the bytes)
        ref = ref.detach().to(approx.device).to(torch.float64)
        err += (ref - approx.detach().to(torch.float64)).pow(2).sum().item()
        signal += ref.pow(2).sum().item()
    if err == 0:
        return math.inf
    return 10 * math.log10(signal / err) if signal > 0 else -math.inf

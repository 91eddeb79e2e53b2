"""Signal-to-noise ratio, the measure every lossy path in tritoff is judged by."""

from __future__ import annotations

import math

import torch


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - approx)^2) in dB, computed in float64; inf when they are equal."""
    ref = reference.detach().to(torch.float64)
    err = (ref - approx.detach().to(torch.float64)).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if err == 0:
        return math.inf
    return 10 * math.log10(signal / err) if signal > 0 else -math.inf

"""tritoff/snr.py: SNR summed in bounded pieces equals the whole-tensor float64 formula, as enable measures it."""

import math

import pytest
import torch
from torch import nn

from tritoff import snr as snr_module
from tritoff.pack import unpack_reference
from tritoff.packer import pack_model
from tritoff.snr import snr_db, snr_db_of_chunks


def _whole(reference: torch.Tensor, approx: torch.Tensor) -> float:
    ref = reference.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - approx.double()).pow(2).sum().item())


@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])
def test_snr_in_pieces_equals_the_whole_tensor_formula(monkeypatch, chunk):
    monkeypatch.setattr(snr_module, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(37, 23, generator=g)
    approx = reference + 0.01 * torch.randn(37, 23, generator=g)
    assert snr_db(reference, approx) == pytest.approx(_whole(reference, approx), rel=1e-12)
    assert snr_db(reference, approx) == pytest.approx(40, abs=0.5)  # noise 1/100 of the signal: 40 dB


def test_equal_zero_and_mismatched_inputs():
    x = torch.randn(5, 3)
    assert snr_db(x, x.clone()) == math.inf
    assert snr_db(torch.zeros(4), torch.ones(4)) == -math.inf
    assert snr_db_of_chunks([]) == math.inf
    for other in (torch.randn(4, 3), torch.randn(3, 5), torch.randn(15)):  # other counts, or only other shapes
        with pytest.raises(ValueError, match=r"snr_db compares tensors of one shape, got \(5, 3\) and"):
            snr_db(x, other)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("chunk", [5, 48, 1 << 22])  # pieces of one row, rows per piece, one piece
def test_enable_measures_each_weights_snr_in_pieces(monkeypatch, granularity, chunk):
    monkeypatch.setattr(snr_module, "CHUNK", chunk)
    pieces = []

    def recorded(pairs):
        pairs = list(pairs)
        pieces.extend(approx.numel() for _, approx in pairs)
        return snr_db_of_chunks(pairs)

    monkeypatch.setattr(snr_module, "snr_db_of_chunks", recorded)
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 16)).to(torch.bfloat16)
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    stats: dict[str, float] = {}
    packed = pack_model(model, "fp8_e4m3", granularity=granularity, progress=False, snr=stats, quantize_on="cpu")
    dequantized = {}
    for pack in packed.packs:
        dequantized.update(unpack_reference(pack.layout, pack.data))
    weights = [n for n in originals if n.endswith("weight")]
    assert sorted(stats) == sorted(weights)
    for name in weights:
        assert stats[name] == pytest.approx(_whole(originals[name], dequantized[name]), rel=1e-9)
        assert 25 < stats[name] < 40  # e4m3 rounding of Gaussian-like weights: about 31 dB
    assert sum(pieces) == sum(originals[n].numel() for n in weights) and max(pieces) <= chunk

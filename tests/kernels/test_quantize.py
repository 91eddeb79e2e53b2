"""kernels/quantize.py: the Triton quantizer equals its PyTorch reference bit for bit; the reference is right."""

import pytest
import torch

from tritoff.formats import get_format
from tritoff.kernels.quantize import NonFiniteError, pow2_exponents, quantize, quantize_reference

FORMATS = [pytest.param(get_format("fp8_e4m3"), id="e4m3"), pytest.param(get_format("fp8_e5m2"), id="e5m2")]
SHAPES = [
    pytest.param((64, 128), id="64x128"),
    pytest.param((1, 77), id="one-row"),
    pytest.param((37, 2051), id="odd-37x2051"),
    pytest.param((5, 4100), id="row-longer-than-block"),
    pytest.param((16, 3, 3, 3), id="conv"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["row", "tensor", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_matches_reference(fmt, shape, granularity, dtype, device):
    # rows of very different scales, as in real weights
    w = (torch.randn(shape) * torch.logspace(-3, 1, shape[0]).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)
    codes, scales = quantize(w.to(device), fmt, granularity)
    ref_codes, ref_scales = quantize_reference(w, fmt, granularity)
    torch.testing.assert_close(codes.cpu(), ref_codes, rtol=0, atol=0)
    torch.testing.assert_close(scales.cpu(), ref_scales, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_values(fmt, device):
    tiny = torch.finfo(torch.bfloat16).tiny
    rows = torch.stack(
        [
            torch.linspace(-fmt.max, fmt.max, 300),  # exactly +-max: scale 1, codes at the extremes
            torch.linspace(-1, 1, 300) * tiny * 4,  # bf16 subnormal neighbourhood
            torch.randn(300) * 1e-3,  # fp8 subnormals after scaling
            torch.randn(300).sign() * 0.0,  # a zero row amid others: scale 1, signed zeros
            torch.randn(300) * 3e4,
        ]
    )
    for granularity in ("row", "tensor", "none"):
        codes, scales = quantize(rows.to(device), fmt, granularity)
        ref_codes, ref_scales = quantize_reference(rows, fmt, granularity)
        torch.testing.assert_close(codes.cpu(), ref_codes, rtol=0, atol=0)
        torch.testing.assert_close(scales.cpu(), ref_scales, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("exponent", [-110, -90, 0, 90, 110])
def test_a_tensor_scale_far_from_one_is_applied_exactly(fmt, exponent, device):
    # the per-tensor path takes the reciprocal of a stored scale; at 2^+-90 (and clamped at +-100) it must be exact
    w = torch.randn(8, 300) * 2.0**exponent
    codes, scales = quantize(w.to(device), fmt, "tensor")
    ref_codes, ref_scales = quantize_reference(w, fmt, "tensor")
    assert ref_codes.view(torch.uint8).any()  # not a tensor of zeros
    torch.testing.assert_close(scales.cpu(), ref_scales, rtol=0, atol=0)
    torch.testing.assert_close(codes.cpu(), ref_codes, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_to_nearest_even_on_every_tie(fmt, device):
    # every fp8 value, and the midpoints between neighbours: the ties that round-half-even decides
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(float("inf")))]).reshape(1, -1)
    codes, _ = quantize(x.to(device), fmt, "none")
    ref, _ = quantize_reference(x, fmt, "none")
    torch.testing.assert_close(codes.cpu(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturates_instead_of_nan(fmt, device):
    w = torch.tensor([[fmt.max * 4, -fmt.max * 1e3, 1.0, fmt.max * 1.06]])
    codes, _ = quantize(w.to(device), fmt, "none")
    values = codes.cpu().view(fmt.dtype).float()
    assert values.isfinite().all()
    assert values.tolist()[0] == [fmt.max, -fmt.max, 1.0, fmt.max]


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_are_powers_of_two_and_fit(fmt):
    w = torch.randn(200, 64) * torch.logspace(-6, 4, 200)[:, None]
    codes, scales = quantize_reference(w, fmt, "row")
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()
    absmax = w.abs().amax(dim=1)
    assert (absmax / scales <= fmt.max).all()
    # the smallest such power: half the scale would overflow the format
    assert (absmax / (scales / 2) > fmt.max).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_is_exact_in_bf16(fmt):
    w = torch.randn(64, 96) * 0.02
    codes, scales = quantize_reference(w, fmt, "row")
    exact = codes.view(fmt.dtype).double() * scales.double()[:, None]
    assert torch.equal(exact.to(torch.bfloat16).double(), exact)


def test_pow2_exponents_rule():
    fmt = get_format("fp8_e4m3")
    absmax = torch.tensor([448.0, 448.5, 224.0, 1.0, 0.0, 1e-40])
    # 448 fits as is; a hair above needs 2^1; 224 could double; 1 * 2^-8 = 1/256 -> 256 <= 448; zero and fp32
    # subnormal get 2^0
    assert pow2_exponents(absmax, fmt).tolist() == [0, 1, -1, -8, 0, 0]


def test_row_scales_beat_unscaled_on_small_weights():
    fmt = get_format("fp8_e4m3")
    from tritoff.snr import snr_db

    w = torch.randn(256, 256) * 0.002
    results = {}
    for granularity in ("row", "none"):
        codes, scales = quantize_reference(w, fmt, granularity)
        results[granularity] = snr_db(w, codes.view(fmt.dtype).float() * scales[:, None])
    # scaled e4m3 sits near 31.5 dB; at sigma=0.002 the plain cast falls into subnormals (about 11 dB)
    assert 30.5 < results["row"] < 32.5
    assert results["none"] < 15


@pytest.mark.parametrize("quantizer", [quantize, quantize_reference], ids=["kernel", "reference"])
def test_what_neither_quantizer_can_take_is_refused_in_one_line(quantizer, device):
    w = torch.randn(4, 32, device=device)
    fmt = get_format("fp8_e4m3")
    for granularity in ("Row", "rows", "per_row", None):  # fell through to the plain cast, scale 1, with no error
        with pytest.raises(ValueError, match=r"^unknown scale granularity .*: use one of row, tensor, none$"):
            quantizer(w, fmt, granularity)
    with pytest.raises(ValueError, match=r"^quantize needs an fp8 format, got bf16$"):
        quantizer(w, get_format("bf16"))
    with pytest.raises(ValueError, match=r"^quantize takes real weights, got torch.complex64$"):
        quantizer(torch.randn(4, 32, dtype=torch.complex64, device=device), fmt)
    for bad in (float("nan"), float("inf")):  # the kernel and the reference gave different codes for a NaN
        broken = w.clone()
        broken[1, 3] = bad
        with pytest.raises(NonFiniteError, match=r"^the weight contains NaN or Inf, .*: fix or skip it$"):
            quantizer(broken, fmt)
    codes, scales = quantizer(w, "fp8_e4m3")  # a format given by name
    ref_codes, ref_scales = quantize_reference(w.cpu(), fmt)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,), (), (3, 0, 2)])
@pytest.mark.parametrize("granularity", ["row", "tensor", "none"])
def test_empty_and_scalar_weights_match_the_reference(shape, granularity, device):
    w = torch.full(shape, 3.0)
    codes, scales = quantize(w.to(device), get_format("fp8_e4m3"), granularity)
    ref_codes, ref_scales = quantize_reference(w, get_format("fp8_e4m3"), granularity)
    assert codes.shape == ref_codes.shape == w.shape
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    if granularity == "row" and shape and shape[0]:  # rows of nothing: scale 1, as rows of zeros
        assert torch.equal(ref_scales, torch.ones(shape[0]))


def test_forcing_the_native_cast_in_the_interpreter_is_refused():
    from tritoff.kernels import interpreting

    if not interpreting():
        pytest.skip("compiled kernels: the native cast is the hardware's")
    with pytest.raises(ValueError, match=r"^native=True needs a GPU's fp8 conversion"):
        quantize(torch.randn(4, 32), get_format("fp8_e4m3"), native=True)

"""tritoff/formats.py: the storage formats users name, their fp8 encodings, and scale granularities."""

import dataclasses
import re

import pytest
import torch

from tritoff.formats import FORMATS, GRANULARITIES, StorageFormat, check_granularity, get_format

FP8 = ["fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize(
    "name,key",
    [
        pytest.param("fp8_e4m3", "fp8_e4m3", id="canonical"),
        pytest.param("FP8_E4M3", "fp8_e4m3", id="upper-case"),
        pytest.param("fp8-e5m2", "fp8_e5m2", id="dashes"),
        pytest.param("Fp8-E5M2", "fp8_e5m2", id="mixed"),
        pytest.param("BF16", "bf16", id="bf16"),
        pytest.param("fp16", "fp16", id="fp16"),
        pytest.param(" fp8_e4m3\n", "fp8_e4m3", id="spaces-around"),
    ],
)
def test_names_are_read_whatever_their_case_and_dashes(name, key):
    assert get_format(name) is FORMATS[key]


def test_a_storage_format_is_returned_as_it_is():
    custom = StorageFormat("mine", torch.float16, False)  # not in FORMATS: taken on trust
    assert get_format(custom) is custom
    assert get_format(FORMATS["bf16"]) is FORMATS["bf16"]


@pytest.mark.parametrize("name", ["int8", "fp8", "e4m3", "fp32", "", "fp8 e4m3"])
def test_an_unknown_name_is_refused_with_the_valid_ones(name):
    message = f"unknown storage {name!r}: use one of fp8_e4m3, fp8_e5m2, bf16, fp16"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        get_format(name)


@pytest.mark.parametrize(
    "name,dtype,is_fp8,size",
    [
        pytest.param("fp8_e4m3", torch.float8_e4m3fn, True, 1, id="fp8_e4m3"),
        pytest.param("fp8_e5m2", torch.float8_e5m2, True, 1, id="fp8_e5m2"),
        pytest.param("bf16", torch.bfloat16, False, 2, id="bf16"),
        pytest.param("fp16", torch.float16, False, 2, id="fp16"),
    ],
)
def test_each_format_names_its_dtype_and_bytes_per_element(name, dtype, is_fp8, size):
    fmt = FORMATS[name]
    assert (fmt.name, fmt.dtype, fmt.is_fp8, fmt.bytes_per_element) == (name, dtype, is_fp8, size)


@pytest.mark.parametrize("name", FP8)
def test_fp8_parameters_are_those_of_torchs_dtype(name):
    fmt = FORMATS[name]
    info = torch.finfo(fmt.dtype)
    assert fmt.max == info.max
    assert 2.0**-fmt.mantissa_bits == info.eps
    assert 2.0**fmt.min_normal_exp == info.smallest_normal
    assert fmt.min_normal_exp == 1 - fmt.exponent_bias
    one = torch.tensor(1.0).to(fmt.dtype).view(torch.uint8).item()
    assert one == fmt.exponent_bias << fmt.mantissa_bits  # 1.0: a biased exponent of 0, no mantissa


@pytest.mark.parametrize("name", FP8)
def test_every_finite_fp8_code_decodes_from_the_format_parameters(name):
    """The kernels decode sign | exponent | mantissa with these numbers: every one of the 256 codes must agree with
    torch's own conversion (normals, subnormals, both zeros), and the largest finite one is ``max``."""
    fmt = FORMATS[name]
    codes = torch.arange(256, dtype=torch.int32)
    values = codes.to(torch.uint8).view(fmt.dtype).float()
    finite = torch.isfinite(values)
    m = fmt.mantissa_bits
    sign = torch.where(codes >> 7 == 1, -1.0, 1.0)
    exponent = (codes >> m) & ((1 << (7 - m)) - 1)
    mantissa = (codes & ((1 << m) - 1)).float() / 2**m
    normal = (1 + mantissa) * torch.pow(2.0, (exponent - fmt.exponent_bias).float())
    subnormal = mantissa * 2.0**fmt.min_normal_exp
    decoded = sign * torch.where(exponent == 0, subnormal, normal)
    torch.testing.assert_close(decoded[finite], values[finite], rtol=0, atol=0)
    assert values[finite].max().item() == fmt.max
    assert finite.sum().item() == {"fp8_e4m3": 254, "fp8_e5m2": 248}[name]  # e4m3fn: only NaN; e5m2: inf and NaN


def test_formats_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FORMATS["fp8_e4m3"].max = 240.0


@pytest.mark.parametrize("granularity", ["row", "tensor", "none"])
def test_valid_granularities_are_returned(granularity):
    assert check_granularity(granularity) == granularity
    assert granularity in GRANULARITIES


@pytest.mark.parametrize("granularity", ["channel", "", "rows", None])
def test_an_unknown_granularity_is_refused_with_the_valid_ones(granularity):
    message = f"unknown scale granularity {granularity!r}: use one of row, tensor, none"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_granularity(granularity)

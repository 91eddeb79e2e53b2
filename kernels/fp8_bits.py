"""fp8 <-> fp32 conversions from the raw bits, shared by the kernels.

Used where the hardware conversion is missing (compute capability < 8.9) or wrong (the interpreter's fp32->fp8 cast).
Both are exact integer arithmetic: decoding is lossless, encoding rounds to nearest even like PyTorch's cast. Inputs to
the encoder are already clamped to the format's finite range, so it never produces NaN.
"""

import triton
import triton.language as tl


@triton.jit
def decode_fp8_bits(bits, MANTISSA_BITS: tl.constexpr, EXPONENT_BIAS: tl.constexpr):
    """uint8 fp8 codes (e4m3fn or e5m2) -> fp32 values."""
    b = bits.to(tl.int32)
    sign = (b >> 7) & 1
    exp = (b >> MANTISSA_BITS) & ((1 << (7 - MANTISSA_BITS)) - 1)
    man = b & ((1 << MANTISSA_BITS) - 1)
    # Normal: rebias the exponent and left-align the mantissa in the fp32 bit pattern.
    normal = (sign << 31) | ((exp + (127 - EXPONENT_BIAS)) << 23) | (man << (23 - MANTISSA_BITS))
    normal_val = normal.to(tl.float32, bitcast=True)
    # Subnormal: man * 2^(1 - bias - mantissa_bits), exact in fp32.
    sub_unit_bits: tl.constexpr = (127 + 1 - EXPONENT_BIAS - MANTISSA_BITS) << 23
    sub_unit = tl.full([], sub_unit_bits, tl.int32).to(tl.float32, bitcast=True)
    sub_mag = (man.to(tl.float32) * sub_unit).to(tl.int32, bitcast=True)
    sub_val = (sub_mag | (sign << 31)).to(tl.float32, bitcast=True)  # by bits: -0.0 must stay negative
    return tl.where(exp == 0, sub_val, normal_val)


@triton.jit
def encode_fp8_bits(x, MANTISSA_BITS: tl.constexpr, EXPONENT_BIAS: tl.constexpr):
    """fp32 values within the format's range -> uint8 fp8 codes, rounding to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127
    # Normal results: round the fp32 pattern at the fp8 mantissa's last bit; a carry correctly bumps the exponent.
    shift: tl.constexpr = 23 - MANTISSA_BITS
    lsb = (mag >> shift) & 1
    rounded = (mag + ((1 << (shift - 1)) - 1) + lsb) >> shift
    normal_code = rounded - ((127 - EXPONENT_BIAS) << MANTISSA_BITS)
    # Subnormal results: integer mantissa (implicit 1) shifted into units of the smallest subnormal, rounded half-even.
    min_exp: tl.constexpr = 1 - EXPONENT_BIAS
    man24 = (mag & 0x7FFFFF) | 0x800000
    sub_shift = tl.minimum(23 + min_exp - MANTISSA_BITS - exp, 31)
    sub_shift = tl.maximum(sub_shift, 1)
    q = man24 >> sub_shift
    rem = man24 & ((1 << sub_shift) - 1)
    half = 1 << (sub_shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(exp >= min_exp, normal_code, q)
    return (code | sign).to(tl.uint8)

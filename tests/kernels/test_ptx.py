"""The kernels compile for Hopper (sm_90) and Ampere (sm_80) without a GPU, with 16-byte stores and loads and stores
in one register layout (no round trip through shared memory between them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ptx():
    from tritoff.kernels.upcast import TRITON_VERSION

    if TRITON_VERSION < (3, 3):
        pytest.skip("the probe describes kernels to Triton's compiler as Triton 3.3 on does (ASTSource)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("ptx_probe.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode != 0 and "ptxas" in run.stderr.lower() and "not found" in run.stderr.lower():
        pytest.skip("this triton build has no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_every_variant_compiles(ptx):
    # 3 outputs x 2 formats, for sm_90 native, sm_90 from bits and sm_80 from bits; the quantizers likewise
    assert sum(k.startswith("upcast") for k in ptx) == 6 + 6 + 6
    assert sum(k.startswith("zero-copy") for k in ptx) == 3
    assert sum(k.startswith("wide-loads") for k in ptx) == 3
    assert sum(k.startswith("quantize") for k in ptx) == (2 + 2 + 2) * 2  # per-row and per-tensor scales


def test_scales_are_applied_without_a_float_division(ptx):
    # a compiled float division is approximate (div.full.f32: up to 2 ulp); scales are powers of two, applied exactly
    # from their exponent bits
    for name, facts in ptx.items():
        assert facts["float_div"] == 0, name


def test_main_variant_stores_16_bytes_from_8_byte_code_loads(ptx):
    facts = ptx["upcast sm90 native e4m3->bf16"]
    # 8 fp8 codes a load (the 8 bf16 values of one 16-byte store); 16-byte loads copy the kept words; never a byte
    assert facts["loads"].get("ld.global.v2.b32", 0) > 0 and facts["loads"].get("ld.global.v4.b32", 0) > 0
    assert "ld.global.b8" not in facts["loads"] and "ld.global.u8" not in facts["loads"]
    assert set(facts["stores"]) == {"st.global.v4.b32"}
    assert facts["fp8_cvt"] > 0  # the hardware conversion


def test_zero_copy_variant_stores_16_bytes_from_8_byte_code_loads(ptx):
    facts = ptx["zero-copy sm90 native e4m3->bf16"]
    assert facts["loads"].get("ld.global.v2.b32", 0) > 0 and "ld.global.b8" not in facts["loads"]
    assert set(facts["stores"]) == {"st.global.v4.b32"}


def test_outputs_do_not_pass_through_shared_memory(ptx):
    # loads laid out as their stores: no shared memory, no barrier, for every output dtype, format and target
    for name, facts in ptx.items():
        if name.startswith(("upcast", "zero-copy")):
            assert facts["shared_bytes"] == 0 and facts["barriers"] == 0, (name, facts)
    # what 16-byte code loads compile to (CODE_LOAD_BYTES = 16): every bf16 output through shared memory
    for name, facts in ptx.items():
        if name.startswith("wide-loads"):
            assert facts["shared_bytes"] > 0 and facts["barriers"] > 0, (name, facts)


def test_ampere_path_has_no_fp8_conversion_instruction(ptx):
    for name, facts in ptx.items():
        if "sm80" in name:
            assert facts["fp8_cvt"] == 0, name

"""The kernels are registered torch custom ops that pass torch.library.opcheck."""

import torch

from tritoff.formats import get_format
from tritoff.kernels.quantize import _quantize_rows_op
from tritoff.kernels.upcast import BLOCK, WARPS, _upcast_pack_op
from tritoff.pack import PackLayout, TensorSpec, write_pack


def test_upcast_pack_op(device):
    from tritoff.kernels.quantize import quantize_reference

    fmt = get_format("fp8_e4m3")
    specs = [TensorSpec("w", (40, 33), torch.bfloat16, True), TensorSpec("b", (40,), torch.bfloat16, False)]
    layout = PackLayout.plan(specs, fmt)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    write_pack(layout, data, {"w": torch.randn(40, 33).bfloat16(), "b": torch.randn(40).bfloat16()}, quantize_reference)
    out = torch.zeros(layout.out_nbytes, dtype=torch.uint8, device=device)
    args = (data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), 0, False, False, BLOCK, 0, WARPS)
    torch.library.opcheck(_upcast_pack_op, args)


def test_quantize_rows_op(device):
    w = torch.randn(24, 70, device=device)
    q = torch.zeros(24, 70, dtype=torch.uint8, device=device)
    scales = torch.zeros(24, device=device)
    torch.library.opcheck(_quantize_rows_op, (w, q, scales, 0, True, False))


def test_the_checkout_importable_as_top_level_kernels_leaves_the_ops_registered_once(tmp_path):
    """From a source checkout, transformers imports this directory as Hugging Face's ``kernels`` to read a version: that
    import must not register tritoff's ops again (torch would replace them under tritoff's handles)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import torch._library.custom_ops as co, tritoff.kernels.upcast as up;"
        "before = co.OPDEF_TO_LIB['tritoff::upcast_pack'];"
        "import kernels, kernels.upcast as again;"
        "assert not hasattr(kernels, 'upcast_pack') and not hasattr(kernels, '__version__');"
        "assert co.OPDEF_TO_LIB['tritoff::upcast_pack'] is before;"
        "assert again._upcast_pack_op is up._upcast_pack_op._opoverload;"
        "from transformers.utils import is_kernels_available; assert not is_kernels_available()"
    )
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_eager_calls_launch_the_kernels_themselves(device, monkeypatch):
    """Outside the op's body, ``wrap_triton`` sends every launch through a higher-order op (hundreds of µs of host time
    and a side-table entry never freed, on a GPU): eager calls must launch the kernels directly, and still be exact."""
    import importlib

    from tritoff.kernels.quantize import quantize, quantize_reference
    from tritoff.kernels.upcast import upcast_pack, upcast_pack_reference

    def refuse(kernel):
        raise AssertionError("an eager call went through wrap_triton")

    for module in ("quantize", "upcast"):  # the package's functions shadow these names as attributes
        monkeypatch.setattr(importlib.import_module(f"tritoff.kernels.{module}"), "launch", refuse)
    fmt = get_format("fp8_e4m3")
    w = torch.randn(40, 33, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, scales = quantize(w.to(device), fmt)
    q_ref, scales_ref = quantize_reference(w, fmt)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scales.cpu(), scales_ref)

    specs = [TensorSpec("w", (40, 33), torch.bfloat16, True), TensorSpec("b", (40,), torch.bfloat16, False)]
    layout = PackLayout.plan(specs, fmt)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    write_pack(layout, data, {"w": w, "b": torch.randn(40).bfloat16()}, quantize_reference)
    out = torch.zeros(layout.out_nbytes, dtype=torch.uint8, device=device)
    upcast_pack(data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), torch.bfloat16, fmt)
    expected = torch.zeros(layout.out_nbytes, dtype=torch.uint8)
    upcast_pack_reference(data, expected, layout.table(BLOCK, "cpu"), torch.bfloat16, fmt)
    assert torch.equal(out.cpu(), expected)

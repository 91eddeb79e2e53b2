"""The kernels are registered torch custom ops that pass torch.library.opcheck."""

import torch

from tritoff.formats import get_format
from tritoff.kernels.quantize import _quantize_rows_op
from tritoff.kernels.upcast import BLOCK, _upcast_pack_op
from tritoff.pack import PackLayout, TensorSpec, write_pack


def test_upcast_pack_op(device):
    from tritoff.kernels.quantize import quantize_reference

    fmt = get_format("fp8_e4m3")
    specs = [TensorSpec("w", (40, 33), torch.bfloat16, True), TensorSpec("b", (40,), torch.bfloat16, False)]
    layout = PackLayout.plan(specs, fmt)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    write_pack(layout, data, {"w": torch.randn(40, 33).bfloat16(), "b": torch.randn(40).bfloat16()}, quantize_reference)
    out = torch.zeros(layout.out_nbytes, dtype=torch.uint8, device=device)
    args = (data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), 0, False, False, BLOCK, 0)
    torch.library.opcheck(_upcast_pack_op, args)


def test_quantize_rows_op(device):
    w = torch.randn(24, 70, device=device)
    q = torch.zeros(24, 70, dtype=torch.uint8, device=device)
    scales = torch.zeros(24, device=device)
    torch.library.opcheck(_quantize_rows_op, (w, q, scales, 0, True, False))

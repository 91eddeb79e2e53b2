"""On a CUDA GPU: the streamed path equals the CPU path, stays within its budget, and hides its transfers."""

import pytest
import torch
import torch.nn as nn
from helpers import dequantized_pipeline, run, wan

import tritoff
from tritoff.tiny import realistic_init

pytestmark = pytest.mark.gpu


def test_pipeline_on_gpu_matches_the_dequantized_pipeline():
    reference = dequantized_pipeline(wan).to("cuda")
    expected = run(reference)
    for transport in ("staged", "zero_copy"):
        pipe = wan()
        engine = tritoff.enable(pipe, mode="group", budget="4MB", transport=transport, progress=False)
        assert engine.plan.tier_counts("transformer")["stream"] > 0
        assert pipe._execution_device.type == "cuda"
        assert torch.equal(run(pipe), expected), transport
        assert engine.stats["total"]["sync_onloads"] == 0


class Heavy(nn.Module):
    """Blocks whose matmuls take much longer than their weights take to stream."""

    def __init__(self, n=8, width=4096):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(n)
        )
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_budget_holds_and_transfers_hide_behind_compute():
    torch.manual_seed(0)
    model = realistic_init(Heavy()).to(torch.bfloat16).eval()
    x = torch.randn(16384, 4096, dtype=torch.bfloat16, device="cuda")  # compute-heavy: ~2 ms of matmul per block
    block_bytes = 2 * 2 * 4096 * 4096
    budget = 6 * block_bytes + 16384 * 4096 * 2 * 6
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = tritoff.enable(model, mode="group", budget=budget, reserve=16384 * 4096 * 2 * 5, progress=False)
    assert engine.plan.tier_counts("model")["stream"] > 0
    with torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget
    total = engine.stats["total"]
    # the first forward's activations were measured: 16384 x 4096 bf16 tensors, a few alive at once
    assert 16384 * 4096 * 2 <= total["activation_bytes"]["model"] <= 16384 * 4096 * 2 * 8
    # transfer time at the measured H2D rate, against the time the compute stream waited for transfers
    moved = total["bytes_h2d"]
    src = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    transfer_s = moved / (src.numel() / (start.elapsed_time(end) / 1e3))
    assert total["compute_wait_s"] < 0.1 * transfer_s, (total["compute_wait_s"], transfer_s)


def test_registered_arena_and_real_fp8_kernels():
    from tritoff.formats import get_format
    from tritoff.kernels import native_fp8, quantize, quantize_reference

    fmt = get_format("fp8_e4m3")
    w = torch.randn(4096, 5120, dtype=torch.bfloat16) * 0.02
    codes, scales = quantize(w.cuda(), fmt)
    ref_codes, ref_scales = quantize_reference(w, fmt)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert native_fp8("cuda")

"""tritoff/manager.py: prefetch order, conditional groups, fp8-casting text encoders, ring slot reuse."""

import pytest
import torch
import torch.nn as nn
from helpers import dequantize_in_place

import tritoff
from tritoff.planner import BudgetError
from tritoff.tiny import realistic_init, tiny_umt5

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


class Stack(nn.Module):
    """Blocks of Linear layers; ``skip`` names blocks to leave out, ``reverse`` runs them backwards."""

    def __init__(self, n=5, width=64):
        super().__init__()
        self.proj_in = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(n)
        )
        self.head = nn.Linear(width, 16)
        self.skip: set[int] = set()
        self.reverse = False

    def forward(self, x):
        x = self.proj_in(x)
        order = range(len(self.blocks) - 1, -1, -1) if self.reverse else range(len(self.blocks))
        for i in order:
            if i not in self.skip:
                x = x + self.blocks[i](x)
        return self.head(x)


def _stack():
    torch.manual_seed(0)
    return realistic_init(Stack()).to(torch.bfloat16).eval()


def _minimum(model) -> int:
    """The smallest budget the planner accepts for ``model`` in group mode (every block streamed)."""
    with pytest.raises(BudgetError) as info:
        _enable(model, 1000)
    return info.value.minimum


def _enable(model, budget):
    return tritoff.enable(model, mode="group", budget=budget, reserve=1000, progress=False, kernels="reference")


def test_conditional_and_unused_groups_work_and_are_counted():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    engine = _enable(model, _minimum(_stack()))  # room for the ring only: every block is streamed
    assert engine.plan.tier_counts("model")["stream"] == 5
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # traces 0..4
        assert torch.equal(model(x), reference(x))
        model.skip = reference.skip = {2}  # a conditional block: skipped ones are passed over, no fallback
        assert torch.equal(model(x), reference(x))
        stats = engine.stats["components"]["model"]
        assert stats["sync_onloads"] == 0
        model.skip = reference.skip = set()
        model.reverse = reference.reverse = True  # out of the traced order: synchronous loads, counted
        assert torch.equal(model(x), reference(x))
    assert engine.stats["components"]["model"]["sync_onloads"] > 0


def test_prefetch_runs_depth_groups_ahead_and_wraps_around():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    manager = engine.manager
    seen = []
    original = manager.group_pre

    def spy(group):
        original(group)
        seen.append((group.name, [g.name for g in manager.inflight]))

    manager.group_pre = spy
    with torch.no_grad():
        model(x)
        model(x)
    # while block i runs, blocks i+1 and i+2 are in flight; after the last block, the next forward's first ones
    assert seen[5 + 3] == ("blocks.3", ["blocks.4", "blocks.0"])
    assert seen[5 + 4] == ("blocks.4", ["blocks.0", "blocks.1"])
    assert engine.stats["components"]["model"]["onloads"] == 10 + 2


def test_umt5_in_fp8_storage():
    """UMT5's feed-forward casts activations to ``wo``'s dtype: a whole block is upcast before it runs."""
    ids = torch.randint(0, 256, (2, 12))
    reference = dequantize_in_place(tiny_umt5())
    model = tiny_umt5()
    engine = _enable(model, _minimum(tiny_umt5()))
    assert engine.plan.tier_counts("model")["stream"] == 2
    with torch.no_grad():
        expected = reference(input_ids=ids).last_hidden_state
        got = model(input_ids=ids).last_hidden_state
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_ring_slots_are_reused_not_reallocated():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    ring = engine.manager.ring
    pointers = [b.data_ptr() for b in ring.buffers]
    with torch.no_grad():
        for _ in range(3):
            model(x)
    assert [b.data_ptr() for b in ring.buffers] == pointers
    # between forwards, streamed blocks hold zero-size placeholders, never stale slot views
    streamed = [g for g in engine.manager.components["model"].blocks if g.slot is None]
    assert all(p.numel() == 0 for g in streamed for p in g.params)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_fp16_and_fp32_models_come_back_in_their_dtype(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=dtype)
    reference = dequantize_in_place(realistic_init(Stack()).to(dtype).eval())
    torch.manual_seed(0)
    model = realistic_init(Stack()).to(dtype).eval()
    engine = _enable(model, _minimum(realistic_init(Stack()).to(dtype)))
    assert engine.plan.tier_counts("model")["stream"] == 5
    with torch.no_grad():
        got = model(x)
    assert got.dtype == dtype and torch.equal(got, reference(x))

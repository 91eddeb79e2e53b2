"""tritoff/transfer.py: staged fills move every chunk exactly, and build the views their copies use only once."""

import pytest
import torch

import tritoff
from tritoff.planner import BudgetError

from .helpers import stack

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")
OPTIONS = dict(mode="group", reserve=1000, progress=False, kernels="reference")


def _smallest_budget() -> int:
    with pytest.raises(BudgetError) as info:
        tritoff.enable(stack(width=1024), budget=1000, **OPTIONS)
    return info.value.minimum


def _outputs(model, x, forwards: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for _ in range(forwards)]


@pytest.mark.parametrize("served", ["host", "disk"])
def test_staged_copies_reuse_their_views_and_stay_exact(served, tmp_path):
    # the disk ring hands out a new view of one of its buffers at every take: the views are cached by host address,
    # so the cache stops growing once every chunk has passed through every buffer and half
    budget, x = _smallest_budget(), torch.randn(4, 16, dtype=torch.bfloat16)
    resident = stack(width=1024)
    tritoff.enable(resident, budget="1GB", **OPTIONS)  # every block resident, from the same fp8 packs
    expected = _outputs(resident, x, 1)[0]
    model = stack(width=1024)
    disk = dict(host_budget=0, spill_dir=str(tmp_path)) if served == "disk" else {}
    engine = tritoff.enable(model, budget=budget, **OPTIONS, **disk)
    comp = engine.manager.components["model"]
    streamed = [g for g in comp.blocks if g.tier == "stream"]
    assert streamed and all(len(g.chunks) == 2 for g in streamed)  # each pack moves in two chunks, one per half
    first = _outputs(model, x, 3)
    cached = len(comp.transfer._copies)
    later = _outputs(model, x, 3)
    assert len(comp.transfer._copies) == cached  # built once: later forwards reuse them
    buffers = len(engine.manager.disk.buffers) if served == "disk" else 1
    assert 0 < cached <= sum(len(g.chunks) for g in streamed) * 2 * buffers
    for (_, address, half), (chunk, staged, copies, spans) in comp.transfer._copies.items():
        # each in its own half (on the CPU a fill is synchronous: a wrong half would still give the right bytes)
        home = comp.transfer.staging[half]
        assert staged.data_ptr() == home.data_ptr() and staged.numel() == chunk.staged_bytes
        for to, source in copies:
            assert home.data_ptr() <= to.data_ptr() and to.data_ptr() + to.numel() <= home.data_ptr() + home.numel()
            assert source.data_ptr() >= address
        # what a CUDA fill hands the driver: the same bytes, address for address
        assert spans == tuple((to.data_ptr(), source.data_ptr(), source.numel()) for to, source in copies)
    for out in first + later:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_every_streamed_block_of_a_wan_transformer_moves_in_two_chunks():
    # staging halves of exactly half a block cut each pack into three chunks, the third a few KiB of padding, which
    # took a half of its own and held the next block's first copy back
    from tritoff.tiny import tiny_wan_transformer

    config = dict(num_layers=4, ffn_dim=344, num_attention_heads=3, attention_head_dim=40)
    with pytest.raises(BudgetError) as info:
        tritoff.enable(tiny_wan_transformer(**config), budget=1, **OPTIONS)
    engine = tritoff.enable(tiny_wan_transformer(**config), budget=info.value.minimum, **OPTIONS)
    streamed = [g for g in engine.manager.components["model"].blocks if g.tier == "stream"]
    assert streamed and all(len(g.chunks) == 2 for g in streamed)

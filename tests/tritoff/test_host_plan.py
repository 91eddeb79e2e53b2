"""tritoff/host_plan.py: the host budget holds the packs read most often, spread through a denoiser's blocks."""

import pytest

import tritoff
from tritoff.arena import PAGE
from tritoff.host_plan import _spread
from tritoff.pack import align
from tritoff.tiny import tiny_wan_pipeline

from .helpers import BIG_WAN, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference", **kwargs)


def _held(engine):
    return {name: [p.name for p in m.packs if not p.on_disk] for name, m in engine.packed.items()}


def _size(engine, name, pack_name):
    return align(next(p for p in engine.packed[name].packs if p.name == pack_name).layout.nbytes, PAGE)


def test_spread_picks_evenly_spaced_indices():
    assert _spread(0, 4) == [] and _spread(4, 4) == [0, 1, 2, 3]
    assert _spread(2, 8) == [3, 7] and _spread(3, 9) == [2, 5, 8]


def test_streamed_denoiser_blocks_are_held_before_anything_else(tmp_path):
    pipe = wan(num_layers=8)
    full = _enable(wan(num_layers=8))
    streamed = [g for g, t in full.plan.phases["transformer"].tiers["transformer"].items() if t == "stream"]
    assert len(streamed) >= 4
    block = _size(full, "transformer", streamed[0])
    engine = _enable(pipe, host_budget=2 * block + block // 2, spill_dir=str(tmp_path))
    held = _held(engine)
    # two streamed blocks fit, spread through the stack; only the half block left over holds anything else
    assert len(held["transformer"]) == 2 and set(held["transformer"]) <= set(streamed)
    positions = sorted(streamed.index(name) for name in held["transformer"])
    assert positions[1] - positions[0] >= len(streamed) // 2 - 1
    others = sum(_size(engine, n, g) for n in ("text_encoder", "vae") for g in held[n])
    assert others <= block // 2
    assert engine.stats["total"]["host_arena_bytes"] <= engine.options.host_budget


def test_a_budget_for_every_streamed_block_then_holds_what_is_read_per_call(tmp_path):
    full = _enable(wan())
    streamed = [
        (n, p)
        for n, m in full.packed.items()
        for p in m.packs
        if full.plan.phases[n].tiers.get(n, {}).get(p.name) == "stream"
    ]
    assert {n for n, _ in streamed} == {"transformer"}
    stream_bytes = sum(align(p.layout.nbytes, PAGE) for _, p in streamed)
    text = sum(align(p.layout.nbytes, PAGE) for p in full.packed["text_encoder"].packs)
    engine = _enable(wan(), host_budget=stream_bytes + text, spill_dir=str(tmp_path))
    held = _held(engine)
    assert {p.name for _, p in streamed} <= set(held["transformer"])
    assert engine.stats["total"]["host_arena_bytes"] <= stream_bytes + text


@pytest.mark.parametrize("boundary_ratio", [0.5, 0.95])
def test_wan22_holds_first_the_expert_that_takes_more_of_the_steps(tmp_path, boundary_ratio):
    # the tiny pipeline's scheduler (flow matching, shift 7) gives the first expert 88% of the steps at a boundary of
    # 0.5 (as Wan 2.2 T2V-A14B's defaults give it most), 28% at 0.95 (as I2V-A14B's give the second most)
    from tritoff.experts import expert_shares

    def pipe():
        made = tiny_wan_pipeline(two_experts=True, **BIG_WAN)
        made.register_to_config(boundary_ratio=boundary_ratio)
        return made

    more, less = ("transformer", "transformer_2") if boundary_ratio == 0.5 else ("transformer_2", "transformer")
    assert expert_shares(pipe())[more] > 0.7
    full = _enable(pipe())
    first = sum(align(p.layout.nbytes, PAGE) for p in full.packed[more].packs)
    engine = _enable(pipe(), host_budget=first, spill_dir=str(tmp_path))
    held = _held(engine)
    streamed = [g for g, t in engine.plan.phases[more].tiers[more].items() if t == "stream"]
    assert set(streamed) <= set(held[more])
    assert len(held[less]) < len(held[more])


def test_an_expert_the_steps_never_reach_is_held_last(tmp_path):
    # without a boundary the pipeline calls the first expert alone: holding the second's packs would save no read
    def pipe():
        made = tiny_wan_pipeline(two_experts=True, **BIG_WAN)
        made.register_to_config(boundary_ratio=None)
        return made

    full = _enable(pipe())
    held_bytes = full.stats["total"]["host_arena_bytes"]
    idle = sum(align(p.layout.nbytes, PAGE) for p in full.packed["transformer_2"].packs)
    engine = _enable(pipe(), host_budget=held_bytes - idle, spill_dir=str(tmp_path))
    held = _held(engine)
    assert held["transformer_2"] == []
    assert set(held["transformer"]) == {p.name for p in full.packed["transformer"].packs}


def test_of_a_denoisers_resident_blocks_those_a_larger_reserve_streams_are_held_first():
    # enable plans with its default reserve; the first call re-plans with the traced one, usually larger, which
    # streams some of the blocks enable kept resident: those are the resident blocks worth holding first
    from tritoff.host_plan import _rank, hold_order, hold_plan

    engine = tritoff.enable(
        wan(num_layers=8), mode="group", budget="5MB", reserve=100_000, progress=False, kernels="reference"
    )
    block = engine.packed["transformer"].packs[0].layout.nbytes
    larger = engine._replan("transformer", 100_000 + block)
    tiers, later = engine.plan.phases["transformer"].tiers["transformer"], larger.tiers["transformer"]
    newly = [name for name, tier in later.items() if tier == "stream" and tiers[name] != "stream"]
    resident = [name for name, tier in tiers.items() if tier != "stream"]
    assert len(newly) == 1 and len(resident) > 1 and newly[0] != resident[0]  # not simply the first in module order
    group_lists = engine._group_lists
    layouts = {name: [p.layout for p in packed.packs] for name, packed in engine.packed.items()}
    looped = {name: name == "transformer" for name in group_lists}
    # room for what is read every call under enable's plan, and for one block more
    first = sum(
        align(layout.nbytes, PAGE)
        for name, groups in group_lists.items()
        for group, layout in zip(groups, layouts[name], strict=True)
        if _rank(name, group, engine.plan, looped[name]) <= 1
    )
    order = hold_order(group_lists, layouts, engine.plan, looped, first + align(block, PAGE))
    assert len(order) == len(set(order))  # each pack held once, its bytes counted once
    held = hold_plan(group_lists, layouts, engine.plan, looped, first + align(block, PAGE))
    assert newly[0] in held["transformer"]
    streamed_later = {name for name, tier in later.items() if tier == "stream"}
    assert streamed_later <= held["transformer"]  # every block the larger reserve streams is held


def test_a_streamed_layer_too_large_for_what_is_left_does_not_keep_smaller_ones_out():
    # leaf mode streams layers of many sizes: the first in module order (a 100 MiB embedder linear in Wan-14B) may
    # not fit where the smaller ones after it do
    from types import SimpleNamespace

    from tritoff.groups import Group
    from tritoff.host_plan import hold_plan

    mib = 2**20
    sizes = {"big": 100 * mib, "a": 25 * mib, "b": 25 * mib, "c": 40 * mib}
    groups = {"transformer": [Group(name) for name in sizes]}
    layouts = {"transformer": [SimpleNamespace(nbytes=n) for n in sizes.values()]}
    phase = SimpleNamespace(modes={"transformer": "group"}, tiers={"transformer": dict.fromkeys(sizes, "stream")})
    the_plan = SimpleNamespace(phases={"transformer": phase})
    held = hold_plan(groups, layouts, the_plan, {"transformer": True}, 70 * mib)
    assert held == {"transformer": {"a", "b"}}  # 50 MiB of streamed layers held, not none

"""tritoff/planner.py: tiers within the budget, streamed blocks spread through the execution order, honest minimums."""

import pytest

from tritoff.planner import BudgetError, ComponentSize, GroupSize, Ring, chunk_capacity, plan, ring_for, spread_order

MB = 2**20


def _transformer(n=40, packed=8 * MB, unpacked=16 * MB, rest=4 * MB):
    blocks = [GroupSize(f"blocks.{i}", packed, unpacked) for i in range(n)]
    return ComponentSize("transformer", blocks, GroupSize("<rest>", rest // 2, rest), looped=True)


@pytest.mark.parametrize("n", [1, 2, 5, 40, 64, 100])
def test_spread_order_is_a_permutation_whose_prefixes_spread(n):
    order = spread_order(n)
    assert sorted(order) == list(range(n))
    for k in range(1, n + 1):
        prefix = sorted(order[:k])
        gaps = [b - a for a, b in zip(prefix, prefix[1:] + [prefix[0] + n], strict=True)]
        # every prefix of k indices leaves no gap wider than about twice the even spacing n / k
        assert max(gaps) <= 2 * -(-n // k) + 1, (n, k, prefix)


@pytest.mark.parametrize("streamed", [3, 5, 10, 20])
def test_streamed_blocks_are_spread_through_the_stack(streamed):
    comp = _transformer()
    with pytest.raises(BudgetError) as info:
        plan([comp], MB, "group", 2, MB)
    overhead = plan([comp], info.value.minimum, "group", 2, MB).planned_bytes  # ring, staging, pool, reserve
    # room for 40 - streamed blocks in fp8, not one more, and not enough to upgrade any to bf16
    budget = overhead + (40 - streamed) * 8 * MB + 4 * MB
    the_plan = plan([comp], budget, "group", 2, MB)
    tiers = the_plan.tiers["transformer"]
    positions = [i for i in range(40) if tiers[f"blocks.{i}"] == "stream"]
    assert len(positions) == streamed and the_plan.planned_bytes <= budget
    gaps = [b - a for a, b in zip(positions, positions[1:] + [positions[0] + 40], strict=True)]
    assert max(gaps) <= 2 * -(-40 // streamed), positions  # never a run of streamed blocks back to back
    assert min(gaps) >= 40 // streamed // 2, positions


def test_every_fixed_byte_is_in_the_plan_and_the_minimum_is_honest():
    comp = _transformer(n=8)
    fixed = 123_456  # module buffers and kernel tables, shared by every phase
    with pytest.raises(BudgetError) as info:
        plan([comp], 10 * MB, "group", 2, MB, fixed=fixed)
    minimum = info.value.minimum
    the_plan = plan([comp], minimum, "group", 2, MB, fixed=fixed)
    assert the_plan.fixed_bytes == fixed
    assert the_plan.staging_bytes == 2 * chunk_capacity(comp, 2) >= 8 * MB  # two halves of half a pack each
    assert the_plan.planned_bytes <= minimum
    with pytest.raises(BudgetError):
        plan([comp], minimum - 1, "group", 2, MB, fixed=fixed)


def test_the_planner_alone_names_no_alternative():
    # which prefetch or mode lowers the minimum is for tritoff.advice to plan: the planner only names its minimum
    comp = _transformer(n=8)
    for mode, depth in (("leaf", 1), ("group", 2), ("model", 2)):
        with pytest.raises(BudgetError) as info:
            plan([comp], MB, mode, depth, MB)
        message = str(info.value)
        assert "mode=" not in message and "prefetch" not in message and info.value.alternatives == {}


def test_nothing_to_split_moves_whole_or_names_its_minimum():
    whole = ComponentSize("vae", [], GroupSize("vae", 30 * MB, 60 * MB, 0, 10 * MB), looped=False)
    with pytest.raises(BudgetError, match="nothing in it can be split") as info:
        plan([whole], 10 * MB, "group", 2, MB)
    the_plan = plan([whole], info.value.minimum, "group", 2, MB)
    assert the_plan.modes == {"vae": "model"} and the_plan.planned_bytes <= info.value.minimum
    assert the_plan.staging_bytes == 2 * 10 * MB  # chunks of its largest single pack, not of the whole


def test_one_group_larger_than_the_others_stays_resident_where_that_lowers_the_minimum():
    # leaf mode's time projection: one unquantized layer twice the unpacked size of any other, so three ring slots
    # of its size would cost more than holding it once and sizing the slots for the rest
    small = [GroupSize(f"blocks.{i}", 4 * MB, 8 * MB) for i in range(20)]
    big = GroupSize("time_proj", 20 * MB, 20 * MB)
    comp = ComponentSize("transformer", [*small[:3], big, *small[3:]], GroupSize("<rest>", MB, MB), looped=True)
    with pytest.raises(BudgetError, match=r"the largest group resident, 20\.00 MiB; 3 ring slots of 8\.00 MiB") as e:
        plan([comp], MB, "group", 2, MB)
    minimum = e.value.minimum
    the_plan = plan([comp], minimum, "group", 2, MB)
    assert the_plan.tiers["transformer"]["time_proj"] == "bf16" and the_plan.slot_bytes == 8 * MB
    assert [t for n, t in the_plan.tiers["transformer"].items() if n != "time_proj"] == ["stream"] * 20
    # the staging halves are cut for the blocks that stream: the resident one loads in more chunks
    assert the_plan.staging_bytes == 2 * chunk_capacity(comp, 2) == 2 * 2 * MB
    assert the_plan.planned_bytes <= minimum
    with pytest.raises(BudgetError):
        plan([comp], minimum - 1, "group", 2, MB)
    # 20 MiB + 3 x 8 MiB + two 2 MiB halves, against 3 x 20 MiB + two 10 MiB halves
    assert minimum == MB + 20 * MB + 3 * 8 * MB + 4 * MB + MB
    # blocks of one size keep every one in the ring, and two large groups of twenty are both kept
    assert ring_for(_transformer(n=8), 2) == Ring([], 3, 16 * MB, 4 * MB)
    twice = ComponentSize("transformer", [*small, big, GroupSize("proj", 20 * MB, 20 * MB)], None, looped=True)
    with pytest.raises(BudgetError, match=r"the 2 largest groups resident, 40\.00 MiB"):
        plan([twice], MB, "group", 2, MB)
    # zero-copy (no staging) with a prefetch of 0 has one slot: the larger group costs no more in it than resident
    assert ring_for(comp, 0, staged=False) == Ring([], 1, 20 * MB, 0)
    with pytest.raises(BudgetError, match=r"\(1 ring slot of 20\.00 MiB, staging 0 B"):
        plan([comp], MB, "group", 0, MB, staged=False)

"""Which packs the host budget holds in RAM; the others are read from disk when needed (``tritoff/disk.py``).

Packs are held in the order of how often they are read: first the blocks a denoiser streams (read every step), then
blocks other components stream (read every call: a text encoder once per prompt), then what the GPU plan keeps
resident in a denoiser's phase (read when its phase is entered; first those a larger activation reserve streams
first, since the first call re-plans the phase with its traced reserve, usually larger than enable's), then
everything else, then the lookup tables kept on the host (served from disk, a lookup reads only the rows it gathers),
and last the packs of an expert the steps never reach. Within a rank, the expert that takes more of the steps comes
first (Wan 2.2, ``tritoff/experts.py``: the high-noise ``transformer`` under T2V-A14B's defaults, ``transformer_2``
under I2V-A14B's), then components in pipeline order. Where only some of a component's streamed blocks fit, the held
ones are spread evenly through its blocks, so each block read from disk has the compute of held blocks around it to
hide behind. ``enable`` places the packs from its own plan; after each re-plan ``tritoff/rehold.py`` moves them toward
the placement the new plans give.
"""

from __future__ import annotations

from tritoff.arena import PAGE
from tritoff.groups import is_block, is_host
from tritoff.pack import align
from tritoff.planner import PhasedPlan, spread_order

RANKS = (
    "streamed every step",
    "streamed every call",
    "resident in a denoiser",
    "other",
    "host lookup table",
    "an expert never called",
)


def _rank(name: str, group, the_plan: PhasedPlan, looped: bool, share: float | None = None) -> int:
    if share == 0:  # an expert the steps never reach (a boundary that gives every step to the other, or none)
        return 5
    if is_host(group):
        return 4
    phase = the_plan.phases[name]
    streamed = (
        is_block(group) and phase.modes[name] == "group" and phase.tiers.get(name, {}).get(group.name) == "stream"
    )
    if streamed:
        return 0 if looped else 1
    return 2 if looped else 3


def _spread(count: int, total: int) -> list[int]:
    """``count`` indices of ``range(total)`` spread evenly."""
    return [i for i in range(total) if (i + 1) * count // total > i * count // total]


def hold_plan(
    group_lists: dict,
    layouts: dict,
    the_plan: PhasedPlan,
    looped: dict[str, bool],
    budget: int | None,
    shares: dict[str, float] | None = None,
) -> dict[str, set[str]] | None:
    """Each component's groups whose packs the host ``budget`` (bytes) holds; None when there is no budget (all).
    ``shares``: the share of the steps each of two experts takes (:func:`tritoff.experts.expert_shares`)."""
    if budget is None:
        return None
    held = {name: set() for name in group_lists}
    for name, group_name in hold_order(group_lists, layouts, the_plan, looped, budget, shares):
        held[name].add(group_name)
    return held


def hold_order(
    group_lists: dict,
    layouts: dict,
    the_plan: PhasedPlan,
    looped: dict[str, bool],
    budget: int,
    shares: dict[str, float] | None = None,
) -> list[tuple[str, str]]:
    """(component, group) of each pack :func:`hold_plan` holds, the one it holds first (read most often) first."""
    classes: dict[tuple[int, float, int], list[tuple[str, int]]] = {}
    keys = hold_classes(group_lists, the_plan, looped, shares)
    for name, groups in group_lists.items():
        for group, layout in zip(groups, layouts[name], strict=True):
            classes.setdefault(keys[name, group.name], []).append((group.name, align(layout.nbytes, PAGE)))
    held: list[tuple[str, str]] = []
    left = budget
    names = list(group_lists)
    for (rank, _, order), members in sorted(classes.items()):
        name = names[order]
        if rank == 2:
            members = _next_to_stream_first(members, group_lists[name])
        fit, used = 0, 0
        for _, nbytes in members:  # how many fit in module order
            if used + nbytes > left:
                break
            fit, used = fit + 1, used + nbytes
        chosen = [members[i] for i in _spread(fit, len(members))] if rank <= 1 else members[:fit]
        if sum(n for _, n in chosen) > left:  # blocks of unequal sizes: keep the ones that fitted in order
            chosen = members[:fit]
        for group_name, nbytes in chosen:
            held.append((name, group_name))
            left -= nbytes
        taken = {group_name for group_name, _ in chosen}
        for group_name, nbytes in members:  # smaller packs after the first that did not fit
            if group_name not in taken and nbytes <= left:
                held.append((name, group_name))
                left -= nbytes
    return held


def hold_classes(
    group_lists: dict, the_plan: PhasedPlan, looped: dict[str, bool], shares: dict[str, float] | None = None
) -> dict[tuple[str, str], tuple[int, float, int]]:
    """{(component, group): its class}, a smaller class read more often and held first: (rank in :data:`RANKS`, minus
    its expert's share of the steps, the component's place in the pipeline)."""
    shares = shares or {}
    return {
        (name, group.name): (_rank(name, group, the_plan, looped[name], shares.get(name)), -shares.get(name, 0.0), at)
        for at, (name, groups) in enumerate(group_lists.items())
        for group in groups
    }


def _next_to_stream_first(members: list[tuple[str, int]], groups) -> list[tuple[str, int]]:
    """A denoiser's resident groups, those that stream first when a larger activation reserve leaves less room (the
    first call's traced reserve, usually larger than the one enable plans with) first: the planner hands residency
    out over the blocks in reverse ``spread_order``, so it takes it back in ``spread_order``. Its other groups last."""
    blocks = [g.name for g in groups if is_block(g)]
    position = {blocks[i]: at for at, i in enumerate(spread_order(len(blocks)))}
    return sorted(members, key=lambda member: position.get(member[0], len(blocks)))

"""Packs moved between host memory and disk when a re-plan changes which ones the host budget should hold.

``enable`` places the packs before any call, from the plan made with its own activation reserve
(``tritoff/host_plan.py``). A component's first call re-plans its phase with the reserve traced for that call, usually
larger, which streams blocks the first plan kept resident: read at every step from then on, they belong in memory
more than what is held in their place (with two experts, the second expert's streamed blocks, read at fewer steps).
After each re-plan the placement is made again from the plans as they now stand, and each pack it holds that is on
disk takes the place of one it no longer holds, in that pack's slot of its arena: the host memory held never grows.
The leaving pack's bytes go to its file first (a store's file holds them already; a spill file is written), then the
arriving pack is read in, so an error or an interrupt at any point leaves every pack readable where it is recorded.

A component none of whose packs spilled at enable gets its spill file at its first pack's move out. Not moved: lookup
tables (mapped, not read through the ring), packs a fused LoRA wrote into (unfusing is refused for a pack on disk),
packs larger than the disk ring's buffers, and nothing at all while another component's forward is running (a call
made inside it).
"""

from __future__ import annotations

import contextlib

import torch

from tritoff.atomic import interrupts_held
from tritoff.disk import spill_files
from tritoff.groups import is_host
from tritoff.host_plan import hold_classes, hold_order
from tritoff.packer import arena_holding
from tritoff.warn import warn


def rehold(engine, name: str) -> int:
    """After component ``name``'s phase was planned again, before its forward: move ``engine``'s packs between its
    arenas and disk to the placement the plans now give; returns the bytes read from disk. A failure (a full disk, a
    read error) stops the moves for the engine's life, warned once (the next re-plan would try the same moves), and
    the forward goes on."""
    ring, budget, manager = engine.disk, engine.options.host_budget, engine.manager
    if ring is None or budget is None or manager is None or engine.rehold_failed:
        return 0
    if manager.running_blocks or any(c.name != name for c in manager.running):
        return 0  # called inside another component's forward, whose packs may be in use
    if any(comp.active for comp in manager.components.values()):
        return 0
    group_lists = engine._group_lists
    layouts = {component: [p.layout for p in packed.packs] for component, packed in engine.packed.items()}
    packs = {  # (component, group) -> pack, lookup tables aside (mapped, never moved)
        (component, pack.name): pack
        for component, packed in engine.packed.items()
        for pack, group in zip(packed.packs, group_lists[component], strict=True)
        if not is_host(group)
    }
    pairs = plan_moves(
        hold_order(group_lists, layouts, engine.plan, engine.loops, budget, engine.shares),
        {key for key, pack in packs.items() if not pack.on_disk},
        hold_classes(group_lists, engine.plan, engine.loops, engine.shares),
        {key: pack.layout.nbytes for key, pack in packs.items()},
        lambda key: _may_leave(engine, packs[key]),
    )
    if not pairs:
        return 0
    runtimes = {id(g.pack): g for comp in engine._runtimes for g in comp.groups}
    if engine.options.device.type == "cuda":
        torch.cuda.synchronize(engine.options.device)  # no copy is still reading a leaving pack's bytes
    ring.want([])  # the reader reads nothing ahead while the moves read (the manager names the next packs again)
    read = 0
    try:
        for leaving, arriving in pairs:
            read += _swap(engine, leaving, packs[leaving], arriving, packs[arriving], runtimes)
    except Exception as err:  # a full disk, a read error: the packs stay where they are recorded
        engine.rehold_failed = True
        warn(
            f"tritoff could not move packs between host memory and disk after a re-plan ({err}); they stay as placed "
            "until the pipeline is enabled again"
        )
    finally:
        for comp in engine._runtimes:
            comp.note_disk()
        engine.reheld_bytes += read
    return read


def plan_moves(wanted: list, held: set, classes: dict, sizes: dict, may_leave) -> list[tuple]:
    """The (leaving, arriving) pairs of pack keys that bring the placement toward ``wanted`` (the keys to hold, most
    read first, :func:`tritoff.host_plan.hold_order`) from ``held``: each pack wanted but not held takes the slot of
    one held but not wanted (``may_leave(key)``), of at least its size (``sizes``, keys of the packs that can move)
    and read less often (its class's rank and expert share, ``classes``): one as often read (a streamed block for
    another, the held ones spread anew) would cost a read and save none. Those read least often leave first."""
    wanted_set = set(wanted)
    leaving = [key for key in sizes if key in held and key not in wanted_set and may_leave(key)]
    leaving.sort(key=lambda key: classes[key], reverse=True)
    pairs, arriving = [], set()
    for key in wanted:
        if key not in sizes or key in held or key in arriving:
            continue
        slot = next((k for k in leaving if classes[k][:2] > classes[key][:2] and sizes[k] >= sizes[key]), None)
        if slot is not None:
            leaving.remove(slot)
            arriving.add(key)
            pairs.append((slot, key))
    return pairs


def _may_leave(engine, pack) -> bool:
    """Whether ``pack`` can go to disk: it fits the ring's buffers and no fused LoRA wrote into it (unfusing a pack on
    disk is refused: it would stay fused)."""
    return pack.layout.nbytes <= engine.disk.buffer_bytes and not pack.rewritten


def _file_for(engine, name: str, pack):
    """The file ``pack`` of component ``name`` leaves for, and whether its bytes must be written there: its store's
    file (which holds them), else the component's spill file, made now if none of its packs spilled at enable."""
    if pack.file is not None and not pack.file.spill:
        return pack.file, False
    spill = next((p.file for p in engine.packed[name].packs if p.file is not None and p.file.spill), None)
    if spill is None:
        spill = spill_files(engine.spill_dir, {name: pack.layout.nbytes})[name]
    return spill, True


def _swap(engine, leaving_key, leaving, arriving_key, arriving, runtimes) -> int:
    """``leaving`` goes to disk, ``arriving`` is read into its slot; returns the bytes read."""
    ring = engine.disk
    file, write = _file_for(engine, leaving_key[0], leaving)
    if write:
        file.write(leaving, leaving.data)  # a full disk stops here, this pack unchanged
    slot = leaving.data
    home = arena_holding(engine.packed, leaving)
    with interrupts_held():
        runtimes[id(leaving)].rehome(ring.arena)
        leaving.file, leaving.data = file, None
        ring.owners[id(leaving)] = leaving_key[0]
        ring.forget(leaving)  # a buffer may hold what it read of it before an earlier move brought it in
    view = slot[: arriving.layout.nbytes]
    try:
        arriving.file.read(arriving, view)
    except BaseException:
        with contextlib.suppress(Exception):  # the leaving pack back in its slot, if its file gives it back
            leaving.file.read(leaving, slot)
            with interrupts_held():
                runtimes[id(leaving)].rehome(home)
                leaving.data = slot
        raise
    arriving.file.drop_cache(arriving)
    with interrupts_held():
        runtimes[id(arriving)].rehome(home)
        arriving.data = view
        ring.forget(arriving)  # held now: a buffer would keep a stale copy should it leave again
    return arriving.layout.nbytes

"""Which phases are on the GPU: entering a phase uploads what its plan keeps resident; others leave only for room.

A phase (a component, see ``tritoff/planner.py``) holds, while loaded: its bf16-resident blocks, its fp8-resident
packs, its unit (rest group, or the whole component), its ring of slots and its staging halves. Entering a phase
evicts other loaded phases, least recently used first, only until the entering phase, its activation reserve and the
bytes every phase shares fit the budget, and never one whose forward is running: a pipeline whose phases fit together
is uploaded once.

All of a phase's memory is allocated on the compute stream before its transfers start, and the transfer streams first
wait for the compute stream (the allocator may hand back memory that queued kernels still use); the compute stream
waits for the uploads before anything reads them. Before a phase's memory is freed, the compute stream waits for the
phase's transfers still in flight (prefetched slots nobody consumed), so a later allocation never overlaps them.
"""

from __future__ import annotations

import torch

from tritoff.slots import SlotRing
from tritoff.transfer import FillClock, Transfer


class Residency:
    """Loads and evicts phases within ``budget`` bytes (``fixed``: bytes every phase shares). ``evict(comp)`` evicts a
    phase to make room (default :meth:`leave`; the hook manager's also forgets loads queued for it); ``busy(comp)``:
    whether its forward is running, which keeps it loaded (default: its ``active`` flag)."""

    def __init__(self, device: torch.device, budget: int, fixed: int, disk=None, evict=None, busy=None):
        self.device = device
        self.disk = disk  # the ring packs served from disk are read into
        self.evict = evict or self.leave
        self.busy = busy or (lambda comp: comp.active)
        self.budget = budget
        self.fixed = fixed
        self.clock = 0
        self.fills = FillClock()  # every phase's synchronous fills (the CPU path), whichever Transfer made them
        self.warned_over = False

    def held(self, components) -> int:
        """Bytes the loaded phases hold."""
        return sum(c.plan.need_bytes for c in components if c.loaded)

    def enter(self, comp, components) -> None:
        """Make ``comp``'s phase resident, evicting least recently used inactive phases while room is short: also
        when it is loaded already, since it may have been admitted beside the others with a smaller reserve than its
        call needs now."""
        self.clock += 1
        comp.last_used = self.clock
        self.make_room(comp, components)
        if not comp.loaded:
            self.load(comp)

    def make_room(self, comp, components) -> None:
        """Evict other phases whose forwards are not running, least recently used first, until ``comp``'s phase and
        its activation reserve fit beside the rest; of those, the ones whose room the others' already make stay (the
        most recently used first): a small phase used long ago does not leave when a large one must anyway."""
        room = self.budget - self.fixed - comp.plan.reserve - comp.plan.need_bytes
        held = self.held(c for c in components if c is not comp)
        if held <= room:
            return
        victims = sorted(
            (c for c in components if c.loaded and c is not comp and not self.busy(c)), key=lambda c: c.last_used
        )
        leaving = []
        for victim in victims:  # a running one stays even if room stays short (a component called inside another's)
            if held <= room:
                break
            leaving.append(victim)
            held -= victim.plan.need_bytes
        for victim in reversed(leaving[:]):
            if held + victim.plan.need_bytes <= room:
                leaving.remove(victim)
                held += victim.plan.need_bytes
        for victim in leaving:
            self.evict(victim)

    def load(self, comp) -> None:
        """Allocate ``comp``'s phase and upload what its plan keeps resident. A failure part way (out of memory,
        Ctrl-C, a pack on disk failing its check) frees what was allocated, after the uploads already queued."""
        plan, device = comp.plan, self.device
        transfer = Transfer(device, plan.chunk_bytes, self.disk, self.fills)
        ring = None
        try:
            if plan.ring_slots:
                ring = SlotRing(device, plan.ring_slots, plan.slot_bytes, transfer, stalls=comp.stalls)
            fills = []
            for g in comp.groups:
                if g.tier in ("bf16", "pool"):
                    g.buffer = torch.empty(g.unpacked_bytes, dtype=torch.uint8, device=device)
                    fills.append(g)
                elif g.tier == "fp8":
                    g.device_pack = torch.empty(g.packed_bytes, dtype=torch.uint8, device=device)
            transfer.wait_for_compute()
            moved = 0
            uploads = [g for g in comp.groups if g.device_pack is not None] + fills
            for i, g in enumerate(uploads):
                if self.disk is not None:  # read the next packs served from disk while this one uploads
                    self.disk.want([u.pack for u in uploads[i:] if u.pack.on_disk])
                if g.device_pack is not None:
                    transfer.upload(g, g.device_pack)
                    moved += g.packed_bytes
                else:
                    moved += transfer.fill(g, g.buffer)
            transfer.compute_waits()
        except BaseException:
            _free(comp, transfer, ring)
            raise
        for g in fills:
            g.bind(g.buffer)
        comp.transfer, comp.ring, comp.loaded = transfer, ring, True
        comp.stats.pool_loads += 1
        comp.stats.bytes_h2d += moved
        comp.stats.entry_bytes += moved

    def leave(self, comp) -> None:
        """Free everything ``comp``'s phase holds (the host packs stay the canonical copy)."""
        if not comp.loaded:
            return
        _free(comp, comp.transfer, comp.ring)
        comp.transfer, comp.ring, comp.loaded = None, None, False
        comp.stats.evictions += 1


def _free(comp, transfer: Transfer, ring: SlotRing | None) -> None:
    """Free the device memory of ``comp``'s phase (loaded, or part way through loading) once the compute stream has
    waited for every transfer queued into it (prefetched slots nobody consumed, uploads of an interrupted load)."""
    transfer.before_free()
    for g in comp.groups:
        g.drop_device_state(keep_tables=True)
    if ring is not None:
        ring.release()
    transfer.release()

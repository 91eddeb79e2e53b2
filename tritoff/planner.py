"""The planner: every group goes to the fastest tier the budget allows.

Tiers, fastest first:

- ``bf16``: resident in the compute dtype; no work per forward.
- ``fp8``: the pack resident on the GPU, upcast from HBM into a ring slot before each forward (half the memory).
- ``stream``: the pack streamed from the host arena into a ring slot, prefetched on a side stream.

Whole components that are not split into groups (the VAE, small encoders) and the *rest* group of each split
component (embeddings, output head) are *pool units*: loaded whole when called, kept until the pool needs their room,
least recently used first. The budget covers resident tiers, the ring of streaming slots, the staging buffer, the pool
and an activation reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tritoff.budget import format_bytes

MODES = ("auto", "model", "group", "leaf")
TIERS = ("bf16", "fp8", "stream")


@dataclass
class GroupSize:
    """A group's bytes: packed (host, fp8) and unpacked (GPU, compute dtype)."""

    name: str
    packed: int
    unpacked: int


@dataclass
class ComponentSize:
    """A component: its block groups (empty when it moves whole) and its rest (or whole-component) unit."""

    name: str
    blocks: list[GroupSize]
    rest: GroupSize | None
    looped: bool  # called many times per pipeline call (a denoiser): keep its pool unit and favour its blocks

    @property
    def unit_bytes(self) -> int:
        """Bytes of its pool unit (the whole component when not split)."""
        return self.rest.unpacked if self.rest else 0


@dataclass
class Plan:
    """What goes where, and the bytes it takes."""

    budget: int
    reserve: int
    depth: int
    modes: dict[str, str]  # component -> "resident" | "model" | "group"
    tiers: dict[str, dict[str, str]] = field(default_factory=dict)  # component -> block group -> tier
    ring_slots: int = 0
    slot_bytes: int = 0
    staging_bytes: int = 0
    pool_bytes: int = 0
    resident_bytes: int = 0

    @property
    def ring_bytes(self) -> int:
        """Bytes of the slot ring and the staging buffer."""
        return self.ring_slots * self.slot_bytes + self.staging_bytes

    @property
    def planned_bytes(self) -> int:
        """Peak GPU bytes the plan allows for: tiers, ring, pool and reserve."""
        return self.resident_bytes + self.ring_bytes + self.pool_bytes + self.reserve

    def tier_counts(self, component: str) -> dict[str, int]:
        """How many block groups of ``component`` are in each tier."""
        counts = dict.fromkeys(TIERS, 0)
        for tier in self.tiers.get(component, {}).values():
            counts[tier] += 1
        return counts

    def summary(self) -> str:
        """The plan as a readable table."""
        lines = [
            f"budget {format_bytes(self.budget)}: resident tiers {format_bytes(self.resident_bytes)}, "
            f"ring {self.ring_slots} x {format_bytes(self.slot_bytes)} + staging {format_bytes(self.staging_bytes)}, "
            f"pool {format_bytes(self.pool_bytes)}, activation reserve {format_bytes(self.reserve)}"
        ]
        for name, mode in self.modes.items():
            detail = ""
            if mode == "group":
                counts = self.tier_counts(name)
                detail = ", ".join(f"{counts[t]} {t}" for t in TIERS if counts[t])
            lines.append(f"  {name:<16} {mode:<9} {detail}")
        return "\n".join(lines)


class BudgetError(ValueError):
    """The budget cannot hold the plan; the message (and ``minimum``, in bytes) names the smallest budget that works."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


def plan(
    components: list[ComponentSize],
    budget: int,
    mode: str,
    depth: int,
    reserve: int,
    staged: bool = True,
    reserve_fraction: float | None = None,
) -> Plan:
    """Place every component and group within ``budget`` bytes (see the module docstring).

    ``reserve_fraction``: the reserve was taken as this fraction of the budget, so the smallest working budget
    reported in errors grows with it.
    """

    def smallest(fixed: int) -> int:
        return fixed if reserve_fraction is None else int(-(-(fixed - reserve) // (1 - reserve_fraction)))

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    everything = sum(c.unit_bytes + sum(g.unpacked for g in c.blocks) for c in components)
    if mode == "auto" and everything + reserve <= budget:
        return Plan(budget, reserve, depth, {c.name: "resident" for c in components}, resident_bytes=everything)
    split = [c for c in components if c.blocks and mode != "model"]
    modes = {c.name: ("group" if c in split else "model") for c in components}
    if mode == "model":
        units = [c.unit_bytes + sum(g.unpacked for g in c.blocks) for c in components]
        need = smallest(max(units) + reserve)
        if need > budget:
            raise BudgetError(
                f"budget {format_bytes(budget)} is too small for mode='model': the largest component needs "
                f"{format_bytes(max(units))} plus a {format_bytes(reserve)} activation reserve; use a budget of at "
                f"least {format_bytes(need)}, or mode='group'",
                need,
            )
        return Plan(budget, reserve, depth, modes, pool_bytes=budget - reserve)
    blocks = [g for c in split for g in c.blocks]
    slots = depth + 1
    slot_bytes = max(g.unpacked for g in blocks)
    staging = max(g.packed for g in blocks) if staged else 0
    largest_unit = max(c.unit_bytes for c in components)
    minimum = reserve + slots * slot_bytes + staging + largest_unit
    if minimum > budget:
        raise BudgetError(
            f"budget {format_bytes(budget)} is too small: the smallest that works is {format_bytes(smallest(minimum))} "
            f"({slots} ring slots of {format_bytes(slot_bytes)}, staging {format_bytes(staging)}, largest pool unit "
            f"{format_bytes(largest_unit)}, activation reserve {format_bytes(reserve)}); raise the budget, lower "
            "prefetch depth, or use mode='leaf'",
            smallest(minimum),
        )
    # keep the looped components' pool units (denoiser rests) resident beside the largest other unit
    looped_units = sum(c.unit_bytes for c in components if c.looped)
    pool = min(budget - minimum + largest_unit, max(largest_unit, looped_units + largest_unit))
    spare = budget - reserve - slots * slot_bytes - staging - pool
    ordered = [(c, g) for c in sorted(split, key=lambda c: not c.looped) for g in c.blocks]
    tiers = {c.name: {g.name: "stream" for g in c.blocks} for c in split}
    resident = 0
    for c, g in ordered:  # first make as many groups as possible fp8-resident (half the bytes of bf16)
        if g.packed <= spare:
            tiers[c.name][g.name], spare, resident = "fp8", spare - g.packed, resident + g.packed
    for c, g in ordered:  # then upgrade fp8 groups to bf16 with what is left
        extra = g.unpacked - g.packed
        if tiers[c.name][g.name] == "fp8" and extra <= spare:
            tiers[c.name][g.name], spare, resident = "bf16", spare - extra, resident + extra
    if all(t == "bf16" for per in tiers.values() for t in per.values()):
        slots, staging = 0, 0
    elif all(t != "stream" for per in tiers.values() for t in per.values()):
        staging = 0
    return Plan(budget, reserve, depth, modes, tiers, slots, slot_bytes if slots else 0, staging, pool, resident)

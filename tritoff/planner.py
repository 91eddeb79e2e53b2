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

from collections.abc import Callable
from dataclasses import dataclass, field

from tritoff.budget import format_bytes

MODES = ("auto", "model", "group", "leaf")
TIERS = ("bf16", "fp8", "stream")


# Staging per half when no block streams (only whole units load): copies of >= 2-4 MB reach ~90% of the PCIe peak,
# so 64 MiB chunks lose nothing to per-copy overhead while a 2 GB unit never needs a buffer of its size.
UNIT_STAGING = 64 * 2**20


@dataclass
class GroupSize:
    """A group's bytes: packed (host, fp8) and unpacked (GPU, compute dtype); ``min_chunk``: the smallest staging
    chunk that holds its largest uncuttable piece; ``largest_pack``: for a whole component moving as one unit, its
    largest single pack (each pack is filled on its own)."""

    name: str
    packed: int
    unpacked: int
    min_chunk: int = 0
    largest_pack: int = 0


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
    staging_bytes: int = 0  # two halves: the DMA of one chunk overlaps the upcast of the other
    pool_bytes: int = 0
    resident_bytes: int = 0
    fixed_bytes: int = 0  # module buffers and kernel tables on the device

    @property
    def chunk_bytes(self) -> int:
        """Capacity of one staging half: the largest chunk a transfer moves at once."""
        return self.staging_bytes // 2

    @property
    def ring_bytes(self) -> int:
        """Bytes of the slot ring and the staging buffers."""
        return self.ring_slots * self.slot_bytes + self.staging_bytes

    @property
    def planned_bytes(self) -> int:
        """Peak GPU bytes the plan allows for: tiers, ring, staging, pool, buffers and tables, and the reserve."""
        return self.resident_bytes + self.ring_bytes + self.pool_bytes + self.fixed_bytes + self.reserve

    def tier_counts(self, component: str) -> dict[str, int]:
        """How many block groups of ``component`` are in each tier."""
        counts = dict.fromkeys(TIERS, 0)
        for tier in self.tiers.get(component, {}).values():
            counts[tier] += 1
        return counts

    def summary(self, mode_names: dict[str, str] | None = None) -> str:
        """The plan as a readable table (``mode_names`` renames modes, e.g. ``group`` to ``leaf``)."""
        lines = [
            f"budget {format_bytes(self.budget)}: resident tiers {format_bytes(self.resident_bytes)}, "
            f"ring {self.ring_slots} x {format_bytes(self.slot_bytes)} + staging {format_bytes(self.staging_bytes)}, "
            f"pool {format_bytes(self.pool_bytes)}, buffers and tables {format_bytes(self.fixed_bytes)}, "
            f"activation reserve {format_bytes(self.reserve)}"
        ]
        for name, mode in self.modes.items():
            detail = ""
            if mode == "group":
                counts = self.tier_counts(name)
                detail = ", ".join(f"{counts[t]} {t}" for t in TIERS if counts[t])
            shown = (mode_names or {}).get(mode, mode)
            lines.append(f"  {name:<16} {shown:<9} {detail}")
        return "\n".join(lines)


class BudgetError(ValueError):
    """The budget cannot hold the plan; the message (and ``minimum``, in bytes) names the smallest budget that works."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed order: every prefix is spread evenly over the range (0, n/2, n/4, 3n/4, ...)."""
    bits = max(1, (n - 1).bit_length())
    order = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits)]
    return [i for i in order if i < n]


def _chunk_capacity(blocks: list[GroupSize], units: list[GroupSize], staged: bool) -> int:
    """Bytes of one staging half. Streamed blocks move in about two chunks each, so the DMA of one overlaps the
    upcast of the other at the cost of one pack of staging; whole units move through the same halves in chunks."""
    if not staged or not (blocks or units):
        return 0
    if blocks:
        capacity = -(-max(g.packed for g in blocks) // 2)
    else:
        capacity = min(max(g.largest_pack or g.packed for g in units), UNIT_STAGING)
    capacity = max(capacity, *(g.min_chunk for g in blocks + units))
    return -(-capacity // 256) * 256


def _build_chunk(components: list[ComponentSize], reserve: int, staged: bool) -> int:
    """Staging chunk of a plan that loads nothing at run time: its groups are filled once, during enable, through
    staging taken from the activation reserve (no activation exists yet)."""
    every = [g for c in components for g in [*c.blocks, *([c.rest] if c.rest else [])]]
    if not staged or not every:
        return 0
    largest = max(g.largest_pack or g.packed for g in every)
    capacity = max(min(largest, reserve // 2, UNIT_STAGING), *(g.min_chunk for g in every))
    return -(-capacity // 256) * 256


def build_chunk(the_plan: Plan, components: list[ComponentSize], staged: bool) -> int:
    """The staging chunk capacity groups are cut for: the plan's, or the enable-time one of an all-resident plan."""
    return the_plan.chunk_bytes or _build_chunk(components, the_plan.reserve, staged)


def _advice(mode: str, depth: int) -> str:
    tips = ["raise the budget"]
    if depth > 1:
        tips.append("lower prefetch (one ring slot less)")
    if mode != "leaf":
        tips.append("use mode='leaf' (one layer per group)")
    return ", ".join(tips[:-1]) + (" or " if len(tips) > 1 else "") + tips[-1]


def plan(
    components: list[ComponentSize],
    budget: int,
    mode: str,
    depth: int,
    reserve: int,
    staged: bool = True,
    reserve_fraction: float | None = None,
    fixed: int | Callable[[int], int] = 0,
) -> Plan:
    """Place every component and group within ``budget`` bytes (see the module docstring).

    ``reserve_fraction``: the reserve was taken as this fraction of the budget, so the smallest working budget
    reported in errors grows with it. ``fixed``: device bytes outside the groups (module buffers, kernel tables), or
    a function of the staging chunk capacity returning them (kernel tables depend on how packs are chunked).
    """
    cost = fixed if callable(fixed) else (lambda chunk: fixed)

    def smallest(need: int) -> int:
        return need if reserve_fraction is None else int(-(-(need - reserve) // (1 - reserve_fraction)))

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    everything = sum(c.unit_bytes + sum(g.unpacked for g in c.blocks) for c in components)
    fixed = cost(_build_chunk(components, reserve, staged))
    if mode == "auto" and everything + reserve + fixed <= budget:
        return Plan(
            budget,
            reserve,
            depth,
            {c.name: "resident" for c in components},
            resident_bytes=everything,
            fixed_bytes=fixed,
        )
    split = [c for c in components if c.blocks and mode != "model"]
    modes = {c.name: ("group" if c in split else "model") for c in components}
    units = [c.rest for c in components if c.rest is not None]
    if not split:
        # model mode, or nothing to split (no block lists): whole components move through the pool
        staging = 2 * _chunk_capacity([], units, staged)
        fixed = cost(staging // 2)
        largest = max(c.unit_bytes for c in components)
        need = smallest(largest + staging + reserve + fixed)
        if need > budget:
            why = "" if mode == "model" else " (nothing in it can be split into blocks)"
            raise BudgetError(
                f"budget {format_bytes(budget)} is too small for whole components{why}: the largest needs "
                f"{format_bytes(largest)} plus staging {format_bytes(staging)} and a {format_bytes(reserve)} "
                f"activation reserve; use a budget of at least {format_bytes(need)}"
                + (", or mode='group'" if mode == "model" and any(c.blocks for c in components) else ""),
                need,
            )
        modes = dict.fromkeys(modes, "model")
        pool = budget - reserve - staging - fixed
        return Plan(budget, reserve, depth, modes, staging_bytes=staging, pool_bytes=pool, fixed_bytes=fixed)
    # in auto mode a budget too small to split may still hold everything resident (tiny models): name the smaller
    resident_need = smallest(everything + reserve + fixed) if mode == "auto" else None
    blocks = [g for c in split for g in c.blocks]
    slots = depth + 1
    slot_bytes = max(g.unpacked for g in blocks)
    staging = 2 * _chunk_capacity(blocks, units, staged)
    fixed = cost(staging // 2)
    largest_unit = max(c.unit_bytes for c in components)
    minimum = reserve + slots * slot_bytes + staging + largest_unit + fixed
    if minimum > budget:
        if resident_need is not None and resident_need < smallest(minimum):
            raise BudgetError(
                f"budget {format_bytes(budget)} is too small: the smallest that works is "
                f"{format_bytes(resident_need)} (everything resident, activation reserve {format_bytes(reserve)})",
                resident_need,
            )
        raise BudgetError(
            f"budget {format_bytes(budget)} is too small: the smallest that works is {format_bytes(smallest(minimum))} "
            f"({slots} ring slots of {format_bytes(slot_bytes)}, staging {format_bytes(staging)}, largest pool unit "
            f"{format_bytes(largest_unit)}, buffers and tables {format_bytes(fixed)}, activation reserve "
            f"{format_bytes(reserve)}); {_advice(mode, depth)}",
            smallest(minimum),
        )
    # keep the looped components' pool units (denoiser rests) resident beside the largest other unit
    looped_units = sum(c.unit_bytes for c in components if c.looped)
    pool = min(budget - minimum + largest_unit, max(largest_unit, looped_units + largest_unit))
    spare = budget - reserve - slots * slot_bytes - staging - pool - fixed
    # residency is handed out in reverse bit-reversed order, so the blocks left streaming are spread through the
    # execution order: each transfer hides behind the compute of the resident blocks before it
    ordered = [
        (c, c.blocks[i])
        for c in sorted(split, key=lambda c: not c.looped)
        for i in reversed(spread_order(len(c.blocks)))
    ]
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
        slots = 0
    return Plan(
        budget,
        reserve,
        depth,
        modes,
        tiers,
        slots,
        slot_bytes if slots else 0,
        staging,
        pool,
        resident,
        fixed,
    )

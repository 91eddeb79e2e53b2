"""The planner: a pipeline runs in phases, and each phase gets the whole budget.

A diffusers pipeline encodes the prompt, denoises (the transformer, every step; Wan 2.2's two experts one after the
other), then decodes: one component works at a time. Each component is a *phase*, planned on its own with the whole
budget; entering a phase uploads what it keeps resident, and evicts what other phases left on the GPU only when the
room is needed (least recently used first), so a pipeline that fits is never moved twice.

Within a phase every group goes to the fastest tier the budget allows:

- ``bf16``: resident in the compute dtype; no work per forward.
- ``fp8``: the pack resident on the GPU, upcast from HBM into a ring slot before each forward (half the memory).
- ``stream``: the pack streamed from the host arena into a ring slot, prefetched on side streams.

A component that is not split into blocks (the VAE, small encoders) moves whole, as does the *rest* group of a split
component (embeddings, output head): its *unit*, loaded when the phase is entered. A phase's bytes are its resident
tiers, ring slots, two staging halves and unit; with the activation reserve of its calls and the bytes every phase
shares (module buffers, kernel tables) they fit the budget.
"""

from __future__ import annotations

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
    largest single pack (each pack is filled on its own); ``half_chunk``: for a block, the staging chunk that moves
    its pack in two (``tritoff.chunks.halving_chunk``; 0: half its bytes)."""

    name: str
    packed: int
    unpacked: int
    min_chunk: int = 0
    largest_pack: int = 0
    half_chunk: int = 0


@dataclass
class ComponentSize:
    """A component: its block groups (empty when it moves whole) and its rest (or whole-component) unit."""

    name: str
    blocks: list[GroupSize]
    rest: GroupSize | None
    looped: bool  # called many times per pipeline call (a denoiser): favour its blocks

    @property
    def groups(self) -> list[GroupSize]:
        """Its block groups and its unit."""
        return [*self.blocks, *([self.rest] if self.rest else [])]

    @property
    def unit_bytes(self) -> int:
        """Bytes of its unit (the whole component when not split)."""
        return self.rest.unpacked if self.rest else 0

    @property
    def unpacked_bytes(self) -> int:
        """Bytes of all its tensors in their compute dtypes."""
        return self.unit_bytes + sum(g.unpacked for g in self.blocks)


@dataclass
class Plan:
    """What goes where in one phase, and the bytes it takes."""

    budget: int
    reserve: int
    depth: int
    modes: dict[str, str]  # component -> "resident" | "model" | "group"
    tiers: dict[str, dict[str, str]] = field(default_factory=dict)  # component -> block group -> tier
    ring_slots: int = 0
    slot_bytes: int = 0
    staging_bytes: int = 0  # two halves: the DMA of one chunk overlaps the upcast of the other
    pool_bytes: int = 0  # the units (rest groups, whole components) the phase loads
    resident_bytes: int = 0
    fixed_bytes: int = 0  # module buffers and kernel tables on the device, shared by every phase

    @property
    def chunk_bytes(self) -> int:
        """Capacity of one staging half: the largest chunk a transfer moves at once."""
        return self.staging_bytes // 2

    @property
    def ring_bytes(self) -> int:
        """Bytes of the slot ring and the staging buffers."""
        return self.ring_slots * self.slot_bytes + self.staging_bytes

    @property
    def need_bytes(self) -> int:
        """Device bytes the phase holds while loaded: resident tiers, ring, staging and units."""
        return self.resident_bytes + self.ring_bytes + self.pool_bytes

    @property
    def planned_bytes(self) -> int:
        """Peak GPU bytes the phase allows for: what it holds, the shared bytes and its activation reserve."""
        return self.need_bytes + self.fixed_bytes + self.reserve

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
            f"units {format_bytes(self.pool_bytes)}, buffers and tables {format_bytes(self.fixed_bytes)}, "
            f"activation reserve {format_bytes(self.reserve)}"
        ]
        for name, mode in self.modes.items():
            lines.append(f"  {name:<16} {(mode_names or {}).get(mode, mode):<9} {_tier_text(self, name)}")
        return "\n".join(lines)


def mode_label(requested: str, planned: str) -> str:
    """How a phase's mode is shown: a component split in leaf mode streams layer by layer, so "leaf", not the
    planner's "group"."""
    return "leaf" if requested == "leaf" and planned == "group" else planned


def _tier_text(plan: Plan, name: str) -> str:
    if plan.modes.get(name) != "group":
        return ""
    counts = plan.tier_counts(name)
    return ", ".join(f"{counts[t]} {t}" for t in TIERS if counts[t])


@dataclass
class PhasedPlan:
    """One :class:`Plan` per phase (component), each within the whole budget."""

    budget: int
    fixed_bytes: int
    phases: dict[str, Plan]

    @property
    def together(self) -> bool:
        """Every phase fits at once, each with its current reserve: nothing is ever evicted. Computed, not stored: a
        re-plan of one phase (a new activation reserve) changes it."""
        return fit_together(
            self.phases.values(), self.fixed_bytes, {n: p.reserve for n, p in self.phases.items()}, self.budget
        )

    @property
    def modes(self) -> dict[str, str]:
        """Each component's mode."""
        return {name: p.modes[name] for name, p in self.phases.items()}

    @property
    def tiers(self) -> dict[str, dict[str, str]]:
        """Each split component's block tiers."""
        return {name: p.tiers[name] for name, p in self.phases.items() if name in p.tiers}

    def tier_counts(self, component: str) -> dict[str, int]:
        """How many block groups of ``component`` are in each tier."""
        return self.phases[component].tier_counts(component)

    @property
    def planned_bytes(self) -> int:
        """The peak GPU bytes of the plan: its largest phase."""
        return max(p.planned_bytes for p in self.phases.values())

    def summary(self, mode_names: dict[str, str] | None = None) -> str:
        """The plan as a readable table, one row per phase."""
        lines = [
            f"budget {format_bytes(self.budget)}, one phase per component"
            + (" (all fit at once: nothing is evicted)" if self.together else "")
            + f"; buffers and tables {format_bytes(self.fixed_bytes)}",
            f"  {'phase':<16} {'mode':<9} {'holds':>11} {'reserve':>11} {'peak':>11}  tiers / ring",
        ]
        for name, p in self.phases.items():
            ring = f", ring {p.ring_slots} x {format_bytes(p.slot_bytes)}" if p.ring_slots else ""
            tiers = _tier_text(p, name)
            lines.append(
                f"  {name:<16} {(mode_names or {}).get(p.modes[name], p.modes[name]):<9} "
                f"{format_bytes(p.need_bytes):>11} {format_bytes(p.reserve):>11} {format_bytes(p.planned_bytes):>11}"
                f"  {tiers}{ring}".rstrip()
            )
        return "\n".join(lines)


class BudgetError(ValueError):
    """The budget cannot hold the plan; the message (and ``minimum``, in bytes) names the smallest budget that works.

    ``alternatives``: other options that lower it, as ``{option: (value, minimum)}``, planned for ``budget``
    (``tritoff.advice``; empty from the planner alone). ``facts``: the message without the advice on those options
    (the planner's own message), for callers that word the advice themselves (the command line)."""

    def __init__(
        self,
        message: str,
        minimum: int,
        alternatives: dict[str, tuple[object, int]] | None = None,
        budget: int | None = None,
        facts: str | None = None,
    ):
        super().__init__(message)
        self.minimum = minimum
        self.alternatives = alternatives or {}
        self.budget = budget
        self.facts = message if facts is None else facts


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed order: every prefix is spread evenly over the range (0, n/2, n/4, 3n/4, ...)."""
    bits = max(1, (n - 1).bit_length())
    order = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits)]
    return [i for i in order if i < n]


def _round_up(n: int, to: int = 256) -> int:
    return -(-n // to) * to


@dataclass
class Ring:
    """A split component's ring: the blocks kept resident in bf16, the slots, their bytes and the staging half."""

    kept: list[GroupSize]
    slots: int
    slot_bytes: int
    chunk: int


def ring_for(component: ComponentSize, depth: int, staged: bool = True) -> Ring:
    """The ring of ``component``'s blocks that needs the fewest bytes. Its slots hold every block but the few largest,
    which stay resident where that costs less than slots of their size and staging cut for them (one large layer
    among small ones: a time projection in leaf mode). Streamed blocks move in two chunks, so the DMA of one overlaps
    the upcast of the other at the cost of one pack of staging (a third chunk would hold the next pack's DMA back); a
    block kept resident loads in more. ``depth`` ring slots come after the running block's."""
    floor = max(g.min_chunk for g in component.groups)
    by_size = sorted(component.blocks, key=lambda g: g.unpacked, reverse=True)
    halves = [g.half_chunk or -(-g.packed // 2) for g in by_size]
    for i in range(len(halves) - 2, -1, -1):  # the largest half chunk of the blocks from i on
        halves[i] = max(halves[i], halves[i + 1])
    best, kept = None, 0
    for k, group in enumerate(by_size):  # the k largest kept, the ring sized for the next
        slots = min(depth + 1, len(by_size) - k)  # the running block and those ahead of it: never more than there are
        chunk = _round_up(max(halves[k], floor)) if staged else 0
        if best is None or kept + slots * group.unpacked + 2 * chunk < best[0]:
            best = (kept + slots * group.unpacked + 2 * chunk, Ring(by_size[:k], slots, group.unpacked, chunk))
        kept += group.unpacked
    return best[1]


def chunk_capacity(component: ComponentSize, depth: int, staged: bool = True) -> int:
    """Bytes of one staging half for ``component``: for a split one its ring's (:func:`ring_for`), for one moving
    whole its largest pack, at most ``UNIT_STAGING``. Depends on the sizes and ``depth`` alone, never on the
    budget."""
    groups = component.groups
    if not staged or not groups:
        return 0
    if component.blocks:
        return ring_for(component, depth, staged).chunk
    capacity = min(max(g.largest_pack or g.packed for g in groups), UNIT_STAGING)
    return _round_up(max(capacity, *(g.min_chunk for g in groups)))


def plan(
    components: list[ComponentSize],
    budget: int,
    mode: str,
    depth: int,
    reserve: int,
    staged: bool = True,
    reserve_fraction: float | None = None,
    fixed: int = 0,
) -> Plan:
    """Place the components of one phase (all loaded together) within ``budget`` bytes.

    ``reserve``: the phase's activation reserve; ``reserve_fraction``: the reserve was taken as this fraction of the
    budget, so the smallest working budget reported in errors grows with it. ``fixed``: device bytes every phase
    shares (module buffers, kernel tables).
    """

    def smallest(need: int) -> int:
        if reserve_fraction is None:
            return need
        # the smallest budget b whose reserve int(b * fraction) (as tritoff.enable computes it) leaves the rest of
        # need: b - int(b * fraction) grows by 0 or 1 with b, so every smaller budget fails
        rest, f = need - reserve, reserve_fraction
        # b - int(b * f) < b * (1 - f) + 1: no budget below (rest - 1) / (1 - f) leaves rest; count up from there
        b = max(int((rest - 1) / (1 - f)) - 2, 0)
        while b - int(b * f) < rest:
            b += 1
        return b

    def reserve_at(b: int) -> int:
        """The reserve at budget ``b``, as the parts of a named budget add up to it."""
        return reserve if reserve_fraction is None else int(b * reserve_fraction)

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    staging = 2 * max(chunk_capacity(c, depth, staged) for c in components)
    everything = sum(c.unpacked_bytes for c in components)
    if mode == "auto" and everything + staging + reserve + fixed <= budget:
        resident = {c.name: "resident" for c in components}
        return Plan(
            budget, reserve, depth, resident, staging_bytes=staging, resident_bytes=everything, fixed_bytes=fixed
        )
    split = [c for c in components if c.blocks and mode != "model"]
    modes = {c.name: ("group" if c in split else "model") for c in components}
    units = sum(c.unit_bytes for c in components)
    if not split:
        # model mode, or nothing to split (no block lists): the components move whole
        need = smallest(units + staging + reserve + fixed)
        if need > budget:
            why = "" if mode == "model" else " (nothing in it can be split: no block list, or a VAE, which moves whole)"
            raise BudgetError(
                f"budget {format_bytes(budget)} is too small for {', '.join(modes)} moving whole{why}: it needs "
                f"{format_bytes(units)} plus staging {format_bytes(staging)}, buffers and tables {format_bytes(fixed)} "
                f"and a {format_bytes(reserve_at(need))} activation reserve; use a budget of at least "
                f"{format_bytes(need, up=True)}",
                need,
            )
        return Plan(budget, reserve, depth, modes, staging_bytes=staging, pool_bytes=units, fixed_bytes=fixed)
    # in auto mode a budget too small to split may still hold everything resident (tiny models): name the smaller
    resident_need = smallest(everything + staging + reserve + fixed) if mode == "auto" else None
    rings = [ring_for(c, depth, staged) for c in split]
    pinned = [g for r in rings for g in r.kept]
    pinned_bytes = sum(g.unpacked for g in pinned)
    slots = min(depth + 1, sum(len(c.blocks) for c in split) - len(pinned))
    slot_bytes = max(r.slot_bytes for r in rings)
    minimum = reserve + pinned_bytes + slots * slot_bytes + staging + units + fixed
    if minimum > budget:
        if resident_need is not None and resident_need < smallest(minimum):
            raise BudgetError(
                f"budget {format_bytes(budget)} is too small: the smallest that works is "
                f"{format_bytes(resident_need, up=True)} (everything resident, activation reserve "
                f"{format_bytes(reserve_at(resident_need))})",
                resident_need,
            )
        largest = "the largest group" if len(pinned) == 1 else f"the {len(pinned)} largest groups"
        held = f"{largest} resident, {format_bytes(pinned_bytes)}; " if pinned else ""
        need = format_bytes(smallest(minimum), up=True)
        raise BudgetError(
            f"budget {format_bytes(budget)} is too small: the smallest that works is {need} "
            f"({held}{slots} ring slot{'s' if slots != 1 else ''} of {format_bytes(slot_bytes)}, staging "
            f"{format_bytes(staging)}, units "
            f"{format_bytes(units)}, buffers and tables {format_bytes(fixed)}, activation reserve "
            f"{format_bytes(reserve_at(smallest(minimum)))})",
            smallest(minimum),
        )
    spare = budget - minimum
    # residency is handed out in reverse bit-reversed order, so the blocks left streaming are spread through the
    # execution order: each transfer hides behind the compute of the resident blocks before it
    ordered = [
        (c, c.blocks[i])
        for c in sorted(split, key=lambda c: not c.looped)
        for i in reversed(spread_order(len(c.blocks)))
    ]
    kept = {id(g) for g in pinned}
    tiers = {c.name: {g.name: "bf16" if id(g) in kept else "stream" for g in c.blocks} for c in split}
    resident = pinned_bytes
    for c, g in ordered:  # first make as many groups as possible fp8-resident (half the bytes of bf16)
        if tiers[c.name][g.name] == "stream" and g.packed <= spare:
            tiers[c.name][g.name], spare, resident = "fp8", spare - g.packed, resident + g.packed
    for c, g in ordered:  # then upgrade fp8 groups to bf16 with what is left
        extra = g.unpacked - g.packed
        if tiers[c.name][g.name] == "fp8" and extra <= spare:
            tiers[c.name][g.name], spare, resident = "bf16", spare - extra, resident + extra
    if all(t == "bf16" for per in tiers.values() for t in per.values()):
        slots = 0
    return Plan(
        budget, reserve, depth, modes, tiers, slots, slot_bytes if slots else 0, staging, units, resident, fixed
    )


def plan_phases(
    components: list[ComponentSize],
    budget: int,
    mode: str,
    depth: int,
    reserves: dict[str, int],
    staged: bool = True,
    reserve_fraction: float | None = None,
    fixed: int = 0,
) -> PhasedPlan:
    """One :func:`plan` per component, each with the whole budget and its own activation reserve.

    Raises :class:`BudgetError` naming the phase that does not fit and the smallest budget every phase fits in.
    """
    phases, errors = {}, {}
    for c in components:
        try:
            phases[c.name] = plan([c], budget, mode, depth, reserves[c.name], staged, reserve_fraction, fixed)
        except BudgetError as err:
            errors[c.name] = err
    if errors:
        # the phase needing the most names the smallest budget every phase fits in
        worst = max(errors, key=lambda n: errors[n].minimum)
        message = str(errors[worst])
        if worst not in message.split(":")[0]:
            message = message.replace(" is too small", f" is too small for the {worst} phase", 1)
        raise BudgetError(message, errors[worst].minimum)
    return PhasedPlan(budget, fixed, phases)


def fit_together(phases, fixed: int, reserves: dict[str, int], budget: int) -> bool:
    """Whether every phase's holdings, the shared bytes and the largest activation reserve fit ``budget`` at once
    (then nothing is ever evicted)."""
    return sum(p.need_bytes for p in phases) + fixed + max(reserves.values()) <= budget

"""Host placement: what a run reads from disk where enable places the packs, and after the first call re-places them.

``enable`` places the packs a host budget holds before any call, from the plan made with its own activation reserve
(10% of the budget without ``reserve=``); each component's first call re-plans its phase with the reserve traced for
it, and then moves packs between host memory and disk (``tritoff/rehold.py``). For each preset configuration this
counts, from configs alone (``tritoff.preview``, meta device, no weights), the bytes read from disk per run (50 steps,
480x832x81) under the tiers that run (the traced plans') for three placements: the preview's (``tritoff plan
--host-budget``), enable's kept as it was, and enable's after the moves each component's first call makes, in the
pipeline's order of calls, with the bytes those moves read once.

Usage:
  python bench/host_placement.py [--out DIR]   the Wan presets at 8 and 12 GB, with 8 and 20 GB held
  python bench/host_placement.py --smoke       one configuration (CI)

Writes ``host_placement.json`` (``-smoke`` with --smoke) under ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_directory, write_result

from tritoff.arguments import OneLineParser

CASES = [
    ("wan2.1-t2v-14b", "12GB", "8GB"),
    ("wan2.2-t2v-a14b", "12GB", "8GB"),
    ("wan2.2-t2v-a14b", "8GB", "8GB"),
    ("wan2.2-t2v-a14b", "8GB", "20GB"),
    ("wan2.2-i2v-a14b", "12GB", "8GB"),
    ("wan2.2-i2v-a14b", "8GB", "20GB"),
]
ENABLE_RESERVE = 0.1  # of the budget: enable's reserve without reserve= (tritoff/options.py)
CALL_ORDER = ("text_encoder", "image_encoder", "transformer", "transformer_2", "vae")


def placements(preset: str, budget: str, host_budget: str) -> dict:
    """The three placements' bytes read per run for one configuration."""
    import tritoff.preview as preview
    from tritoff.budget import parse_host_budget, parse_size
    from tritoff.groups import is_host
    from tritoff.host_plan import hold_classes, hold_order, hold_plan
    from tritoff.rehold import plan_moves

    planned, seen = [], {}
    phase_plan, disk_reads = preview.phase_plan, preview._disk_reads

    def recording_phase_plan(sizes, budget_bytes, *rest):
        if budget_bytes > 1:  # not the probe for the smallest budget
            planned.append((sizes, budget_bytes, rest))
        return phase_plan(sizes, budget_bytes, *rest)

    def recording_disk_reads(result, group_lists, layouts, phases, looped, shares):
        seen.update(group_lists=group_lists, layouts=layouts, phases=phases, looped=looped, shares=shares)
        return disk_reads(result, group_lists, layouts, phases, looped, shares)

    preview.phase_plan, preview._disk_reads = recording_phase_plan, recording_disk_reads
    try:
        result = preview.plan(preset, budget, host_budget=host_budget)
    finally:
        preview.phase_plan, preview._disk_reads = phase_plan, disk_reads
    if not result.feasible:
        raise SystemExit(f"{preset} at {budget}: {result.reason}")
    groups, layouts, traced = seen["group_lists"], seen["layouts"], seen["phases"]
    looped, shares = seen["looped"], seen["shares"]
    gpu, held_budget = parse_size(budget), parse_host_budget(host_budget)
    at_enable = {}
    for sizes, budget_bytes, (mode, prefetch, _, staged, fraction, fixed) in planned:
        reserve = int(gpu * ENABLE_RESERVE)
        at_enable[sizes[0].name] = phase_plan(sizes, budget_bytes, mode, prefetch, reserve, staged, fraction, fixed)
    sizes = {
        (name, g.name): lay.nbytes
        for name in groups
        for g, lay in zip(groups[name], layouts[name], strict=True)
        if not is_host(g)
    }
    preview_bytes = result.as_dict()["disk_bytes_per_run"]  # as the preview places the packs

    def per_run(held: dict) -> int:  # what the preview counts for another placement, under the traced tiers
        preview.reads_for(result, groups, layouts, traced, held)
        return result.as_dict()["disk_bytes_per_run"]

    enable_held = hold_plan(groups, layouts, SimpleNamespace(phases=at_enable), looped, held_budget, shares)
    held = {name: set(names) for name, names in enable_held.items()}
    plans, moved = dict(at_enable), 0
    for name in [n for n in CALL_ORDER if n in groups] + [n for n in groups if n not in CALL_ORDER]:
        plans[name] = traced[name]  # its first call re-plans it with the traced reserve, then moves packs
        now = SimpleNamespace(phases=dict(plans))
        moves = plan_moves(
            hold_order(groups, layouts, now, looped, held_budget, shares),
            {key for key in sizes if key[1] in held[key[0]]},
            hold_classes(groups, now, looped, shares),
            sizes,
            lambda key: True,
        )
        for (leaving, leaving_group), (arriving, arriving_group) in moves:
            held[leaving].discard(leaving_group)
            held[arriving].add(arriving_group)
            moved += sizes[arriving, arriving_group]
    return {
        "model": preset,
        "budget": budget,
        "host_budget": host_budget,
        "preview_bytes_per_run": preview_bytes,
        "enable_kept_bytes_per_run": per_run(enable_held),
        "enable_moved_bytes_per_run": per_run(held),
        "moved_bytes_once": moved,
    }


def main() -> None:
    """Count every configuration and write the JSON."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="one configuration (CI)")
    parser.add_argument("--out", type=out_directory, default=None, help="directory for the JSON (bench/results)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for preset, budget, host_budget in CASES[3:4] if args.smoke else CASES:
        start = time.time()
        row = placements(preset, budget, host_budget)
        rows.append({**row, "seconds": round(time.time() - start, 1)})
        gib = {k: round(v / 2**30, 1) for k, v in row.items() if k.endswith(("_per_run", "_once"))}
        print(f"{preset} at {budget}, {host_budget} held (GiB): {gib}", flush=True)
    print(f"wrote {write_result('host_placement', {'rows': rows}, args.smoke, args.out)}")


if __name__ == "__main__":
    main()

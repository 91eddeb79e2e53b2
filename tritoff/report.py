"""``Engine.report()`` and ``Engine.stats``: what moved, what waited, where everything lives."""

from __future__ import annotations

import torch

from tritoff.budget import format_bytes
from tritoff.planner import mode_label
from tritoff.storage import describe_storage


def host_rss() -> int | None:
    """Resident set size of this process in bytes (Linux), or None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class Report:
    """Collects an engine's counters into data and a readable table."""

    def __init__(self, engine):
        self.engine = engine

    def data(self) -> dict:
        """Per component and total: bytes moved host->GPU, onloads, synchronous fallbacks, hook time, tiers, arena."""
        engine = self.engine
        manager = engine.manager
        components = {}
        for comp in manager.components.values() if manager else []:
            s = comp.stats
            components[comp.name] = {
                "mode": mode_label(engine.options.mode, comp.mode),
                "calls": s.calls,
                "bytes_h2d": s.bytes_h2d,
                "onloads": s.onloads,
                "sync_onloads": s.sync_onloads,
                "trace_sync_onloads": s.trace_sync_onloads,
                "pool_loads": s.pool_loads,
                "evictions": s.evictions,
                "hook_us_per_group": (s.hook_ns / s.hook_calls / 1e3) if s.hook_calls else None,
                "tiers": engine.plan.tier_counts(comp.name) if comp.mode == "group" else {},
                "host_arena_bytes": engine.packed[comp.name].arena.nbytes,
                # not always its own arena's size: a pack moved after a re-plan may lie in another component's arena
                "host_held_pack_bytes": engine.packed[comp.name].held_bytes,
                "packed_bytes": engine.packed[comp.name].packed_bytes,
                "entry_bytes": s.entry_bytes,
                "replans": s.replans,
                "reserve_bytes": comp.plan.reserve,
                "activation_estimate_bytes": comp.estimate,
                "activation_measured_bytes": comp.measured,
                # embedding tables looked up in host memory: never on the GPU
                "host_lookup_bytes": sum(p.numel() * p.element_size() for table in comp.host for p in table.params),
                # packs beyond the host budget: served from disk, and what was read of them
                "disk_pack_bytes": engine.packed[comp.name].disk_bytes,
                "disk_bytes_read": engine.disk.bytes_read.get(comp.name, 0) if engine.disk else 0,
            }
        keys = (
            "bytes_h2d",
            "onloads",
            "sync_onloads",
            "trace_sync_onloads",
            "pool_loads",
            "evictions",
            "host_arena_bytes",
            "packed_bytes",
            "host_lookup_bytes",
            "disk_pack_bytes",
            "disk_bytes_read",
        )
        total = {k: sum(c[k] for c in components.values()) for k in keys}
        ring = engine.disk
        # host memory tritoff holds for weights: the arenas and the disk ring
        total["disk_ring_bytes"] = ring.nbytes if ring else 0
        total["host_held_bytes"] = total["host_arena_bytes"] + total["disk_ring_bytes"]
        total["disk_wait_s"] = ring.wait_ns / 1e9 if ring else 0.0
        # read from disk moving packs a re-plan made worth holding into host memory, in place of others
        total["reheld_bytes"] = engine.reheld_bytes
        device = engine.options.device
        if device.type == "cuda":
            total["compute_wait_s"] = sum(c.stalls.seconds() for c in manager.components.values()) if manager else 0.0
            total["peak_vram_bytes"] = manager.peak_bytes() if manager else torch.cuda.max_memory_allocated(device)
            total["activation_bytes"] = dict(manager.activation_peaks) if manager else {}
            # host memory transfers read that page-locking failed for: each copy from it waits for the GPU
            arenas = [p.arena for p in engine.packed.values()] + ([ring.arena] if ring else [])
            total["pageable_host_bytes"] = sum(a.nbytes for a in arenas if a.register_error is not None)
        worst = sorted(engine.snr.items(), key=lambda kv: kv[1])[:5]
        requantized = sorted(engine.requantized.items(), key=lambda kv: kv[1][1])
        return {
            "device": str(device),
            "storage": dict(engine.options.storage),  # component -> format
            "budget_bytes": engine.plan.budget,
            "host_budget_bytes": engine.options.host_budget,
            "planned_bytes": engine.plan.planned_bytes,
            "components": components,
            "total": total,
            "worst_layers_snr_db": dict(worst),
            # fp8 weights quantized again after fuse_lora/unfuse_lora: how many, and the five lowest SNRs
            "requantized_weights": len(requantized),
            "requantized_worst_snr_db": {name: snr for name, (_, snr) in requantized[:5]},
        }

    def _mode_names(self) -> dict[str, str]:
        return {"group": "leaf"} if self.engine.options.mode == "leaf" else {}

    def text(self) -> str:
        """The table ``Engine.report()`` returns."""
        d = self.data()
        o = self.engine.options
        lines = [
            f"tritoff on {d['device']}, storage {describe_storage(d['storage'])}, mode {o.mode}, "
            f"transport {o.transport}, prefetch {o.prefetch}",
            self.engine.plan.summary(self._mode_names()),
            "",
        ]
        header = (
            f"  {'component':<16}{'mode':<10}{'calls':>6}{'H2D':>12}{'onloads':>9}{'sync':>6}{'entries':>8}"
            f"{'hook us':>9}{'held':>12}{'activations est / measured':>30}"
        )
        lines.append(header)
        for name, c in d["components"].items():
            hook = f"{c['hook_us_per_group']:.1f}" if c["hook_us_per_group"] is not None else "-"
            est, measured = c["activation_estimate_bytes"], c["activation_measured_bytes"]
            activations = (
                f"{format_bytes(est) if est is not None else '-'} / "
                f"{format_bytes(measured) if measured is not None else '-'}"
            )
            lines.append(
                f"  {name:<16}{c['mode']:<10}{c['calls']:>6}{format_bytes(c['bytes_h2d']):>12}{c['onloads']:>9}"
                f"{c['sync_onloads']:>6}{c['pool_loads']:>8}{hook:>9}{format_bytes(c['host_held_pack_bytes']):>12}"
                f"{activations:>30}"
            )
        t = d["total"]
        lines.append(
            f"  {'total':<16}{'':<10}{'':>6}{format_bytes(t['bytes_h2d']):>12}{t['onloads']:>9}"
            f"{t['sync_onloads']:>6}{t['pool_loads']:>8}{'':>9}{format_bytes(t['host_arena_bytes']):>12}"
        )
        host = {name: c["host_lookup_bytes"] for name, c in d["components"].items() if c["host_lookup_bytes"]}
        if host:
            lines.append(
                "  embedding tables looked up in host memory (never uploaded): "
                + ", ".join(f"{name} {format_bytes(n)}" for name, n in host.items())
            )
        if d["host_budget_bytes"] is not None:
            per_call = ", ".join(
                f"{name} {format_bytes(c['disk_bytes_read'] / c['calls'])}"
                for name, c in d["components"].items()
                if c["disk_pack_bytes"] and c["calls"]
            )
            lines.append(
                f"  host budget {format_bytes(d['host_budget_bytes'])}: holding {format_bytes(t['host_held_bytes'])} "
                f"(packs {format_bytes(t['host_arena_bytes'])}, disk ring {format_bytes(t['disk_ring_bytes'])}), "
                f"{format_bytes(t['disk_pack_bytes'])} of packs served from disk; read from disk "
                f"{format_bytes(t['disk_bytes_read'])} ({per_call or 'nothing yet'} per call), waited on disk "
                f"{t['disk_wait_s'] * 1e3:.1f} ms"
                + (f"; moved into memory after re-plans {format_bytes(t['reheld_bytes'])}" if t["reheld_bytes"] else "")
            )
        if "peak_vram_bytes" in t:
            lines.append(
                f"  peak VRAM {format_bytes(t['peak_vram_bytes'])}, compute stream waited on transfers "
                f"{t['compute_wait_s'] * 1e3:.1f} ms"
            )
        if t.get("pageable_host_bytes"):
            lines.append(
                f"  {format_bytes(t['pageable_host_bytes'])} of packs could not be page-locked: copies from them wait "
                "for the GPU to catch up, so their transfers do not overlap compute (free host memory, or lower "
                "host_budget)"
            )
        if d["requantized_weights"]:
            lines.append(
                f"  LoRA fuse/unfuse re-quantized {d['requantized_weights']} weights, lowest SNR: "
                + ", ".join(f"{name} {snr:.1f} dB" for name, snr in d["requantized_worst_snr_db"].items())
            )
        if d["worst_layers_snr_db"]:
            lines.append(
                "  worst quantized layers (SNR): "
                + ", ".join(f"{name} {snr:.1f} dB" for name, snr in d["worst_layers_snr_db"].items())
            )
        return "\n".join(line.rstrip() for line in lines)

"""Host budget: a Wan-shaped transformer served from a store with only part of its packs in RAM.

For each host budget (all packs, half, a quarter, none) one child process builds the transformer without weights,
enables tritoff from the store with that ``host_budget``, and times forwards. Per row: peak RSS over the child's
baseline (Linux's peak, reset after the model is built), the packs held and the disk ring, bytes read from disk per
forward, time waited on the disk, seconds per forward and the slowdown against holding every pack. ``cold`` rows drop
the store's pages from the page cache (``posix_fadvise``) before every forward, so every read reaches the disk;
``warm`` rows let the kernel cache what fits. On the CPU, reads are synchronous by default (``sync``) or read ahead on
the thread tritoff uses on CUDA (``thread``).

Usage:
  python bench/host_budget.py [--device cpu|cuda] [--layers 12] [--dim 1024] [--ffn 4096] [--tokens 1024]
  python bench/host_budget.py --smoke          tiny, CI
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRACTIONS = (None, 0.5, 0.25, 0.0)  # of the packs; None: no host budget


def row_kinds(device: str, smoke: bool) -> list[tuple[float | None, str, str]]:
    """(fraction of the packs held, page cache, reader) of each row: every pack held once (nothing is read from disk),
    then each smaller fraction with warm and cold caches and each reader. A smoke run keeps one row of each kind: all
    held, part held (warm, synchronous reads) and none held (cold, the read-ahead thread)."""
    if smoke:
        return [(None, "warm", "sync"), (0.25, "warm", "sync"), (0.0, "cold", "thread")]
    readers = ("sync", "thread") if device == "cpu" else ("thread",)
    kinds = [(f, c, r) for f in FRACTIONS[1:] for c in ("warm", "cold") for r in readers]
    return [(None, "warm", readers[0]), *kinds]


CHILD = """
import json, os, statistics, sys, time, warnings
args = json.loads(sys.argv[1])
if args["device"] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore")
import torch
import tritoff
from tritoff import disk
from accelerate import init_empty_weights
from diffusers import WanTransformer3DModel
from tritoff.tiny import cast_like_from_pretrained

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

disk.READ_AHEAD_ON_CPU = args["reader"] == "thread"
with init_empty_weights():
    model = cast_like_from_pretrained(WanTransformer3DModel(**args["config"]), torch.bfloat16).eval()
device = torch.device(args["device"])
f, h, w = args["shape"]
torch.manual_seed(0)
inputs = dict(
    hidden_states=torch.randn(1, 16, f, h, w, dtype=torch.bfloat16, device=device),
    timestep=torch.tensor([500], device=device),
    encoder_hidden_states=torch.randn(1, 64, args["config"]["text_dim"], dtype=torch.bfloat16, device=device),
    return_dict=False,
)
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
engine = tritoff.enable(model, mode="group", budget=args["budget"], device=device, progress=False,
                        kernels="reference" if device.type == "cpu" else "auto", store=args["store"],
                        host_budget=args["host_budget"])
names = [n for n in os.listdir(args["store"]) if n.endswith(".safetensors")]
files = [os.open(os.path.join(args["store"], n), os.O_RDONLY) for n in names]
times = []
with torch.no_grad():
    for i in range(args["reps"] + 1):
        if args["cache"] == "cold":
            for fd in files:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(**inputs)[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
total = engine.stats["total"]
forwards = args["reps"] + 1
print(json.dumps({
    "seconds_per_forward": statistics.median(times[1:]),
    "forward_seconds": times,
    "peak_rss_over_baseline_bytes": status("VmHWM:") - base,
    "host_arena_bytes": total["host_arena_bytes"],
    "disk_ring_bytes": total["disk_ring_bytes"],
    "packed_bytes": total["packed_bytes"],
    "disk_pack_bytes": total["disk_pack_bytes"],
    "disk_bytes_per_forward": total["disk_bytes_read"] / forwards,
    "disk_wait_s_per_forward": total["disk_wait_s"] / forwards,
    "output_checksum": float(out.float().sum()),
}))
"""


def main() -> None:
    """Measure and write the JSON."""
    sys.path.insert(0, str(ROOT / "bench"))
    from common import out_directory, size

    from tritoff.arguments import OneLineParser, at_least

    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=at_least(1), default=12)
    parser.add_argument("--dim", type=at_least(128), default=1024, help="heads x 128")
    parser.add_argument("--ffn", type=at_least(1), default=4096)
    parser.add_argument("--frames", type=at_least(1), default=4, help="latent frames (tokens: frames x h/2 x w/2)")
    parser.add_argument("--size", type=at_least(2), default=32, help="latent height and width")
    parser.add_argument("--reps", type=at_least(1), default=None, help="timed calls per configuration (3; --smoke: 1)")
    parser.add_argument("--budget", type=size, default=None, help="device budget (default: 1.1x the smallest)")
    parser.add_argument(
        "--out", type=out_directory, default=None, help="directory for the JSON (default bench/results)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, CI")
    args = parser.parse_args()
    if args.dim % 128:
        parser.error(f"argument --dim: must be a multiple of 128 (heads x 128), got {args.dim}")
    if args.size % 2:
        parser.error(f"argument --size: must be even (patches of 2), got {args.size}")
    if args.smoke:
        args.layers, args.dim, args.ffn, args.frames, args.size = 4, 256, 512, 1, 8
    args.reps = args.reps or (1 if args.smoke else 3)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from common import markdown_table, write_result

    import tritoff
    from tritoff.budget import parse_size
    from tritoff.tiny import WAN_TINY, tiny_wan_transformer

    heads = args.dim // 128 if args.dim >= 128 else 2
    config = {
        **WAN_TINY,
        "num_layers": args.layers,
        "num_attention_heads": heads,
        "attention_head_dim": args.dim // heads,
        "ffn_dim": args.ffn,
        "text_dim": 256,
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="tritoff-host-budget-", dir=ROOT / "bench") as tmp:
        store = Path(tmp) / "store"
        start = time.perf_counter()
        model = tiny_wan_transformer(**config)
        try:  # the smallest device budget that works names itself: every block then streams
            tritoff.enable(model, mode="group", budget=1, device="cpu", progress=False, kernels="reference")
        except tritoff.BudgetError as err:
            smallest = err.minimum
        engine = tritoff.enable(model, device="cpu", progress=False, kernels="reference")
        packed = engine.stats["total"]["packed_bytes"]
        engine.save(store)
        del engine
        print(f"store of {packed / 2**20:.1f} MiB written in {time.perf_counter() - start:.1f} s", flush=True)
        budget = parse_size(args.budget) if args.budget else int(smallest * 1.1)
        for fraction, cache, reader in row_kinds(args.device, args.smoke):
            host_budget = None if fraction is None else int(fraction * packed)
            child = dict(
                device=args.device,
                config=config,
                shape=[args.frames, args.size, args.size],
                store=str(store),
                budget=budget,
                host_budget=host_budget,
                reps=args.reps,
                cache=cache,
                reader=reader,
            )
            result = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(child)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                # the checkout first, then the caller's path (carried wheels on the GPU machine)
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                },
            )
            if result.returncode != 0:
                sys.exit(f"host budget {host_budget}: {result.stderr[-2000:]}")
            row = json.loads(result.stdout.strip().splitlines()[-1])
            row.update(host_budget_bytes=host_budget, cache=cache, reader=reader)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("host_budget_bytes", "cache", "reader")}), flush=True)
    held = next(r for r in rows if r["host_budget_bytes"] is None)
    for row in rows:
        row["slowdown_vs_all_held"] = row["seconds_per_forward"] / held["seconds_per_forward"]
        row["same_output_as_all_held"] = row["output_checksum"] == held["output_checksum"]
    data = {
        "config": config,
        "shape": [args.frames, args.size, args.size],
        "device_budget_bytes": budget,
        "packed_bytes": packed,
        "reps": args.reps,
        "rows": rows,
    }
    path = write_result(f"host_budget-{args.device}", data, smoke=args.smoke, out=args.out)
    mib = 2**20
    table = [
        [
            "all" if r["host_budget_bytes"] is None else f"{r['host_budget_bytes'] / mib:.0f} MiB",
            r["cache"],
            r["reader"],
            f"{r['peak_rss_over_baseline_bytes'] / mib:.0f}",
            f"{r['host_arena_bytes'] / mib:.0f} + {r['disk_ring_bytes'] / mib:.0f}",
            f"{r['disk_bytes_per_forward'] / mib:.0f}",
            f"{r['disk_wait_s_per_forward'] * 1e3:.0f}",
            f"{r['seconds_per_forward']:.3f}",
            f"{r['slowdown_vs_all_held']:.2f}",
            "yes" if r["same_output_as_all_held"] else "NO",
        ]
        for r in rows
    ]
    print(f"\nWan-shaped transformer, {args.layers} blocks, {packed / mib:.0f} MiB of packs, on {args.device}")
    header = ["host budget", "cache", "reads", "peak RSS MiB", "held + ring MiB", "disk MiB / fwd", "disk wait ms"]
    print(markdown_table([*header, "s / fwd", "x all held", "same output"], table))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

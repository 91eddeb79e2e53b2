"""The recipes of docs/usage.md: ``tritoff plan`` for the presets at 12 GB and 8 GB, 480p and 720p, and the Wan
presets on machines of 16 GB and 32 GB of RAM (host budgets of 8 GB and 20 GB: the packs beyond them read from disk).

Runs on any machine (configs only, on the meta device) and writes ``bench/results/plan_presets.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_directory

import tritoff
from tritoff.arguments import OneLineParser
from tritoff.budget import format_bytes

SHAPES = {
    "wan2.1-t2v-1.3b": [(81, 480, 832)],
    "wan2.1-t2v-14b": [(81, 480, 832), (81, 720, 1280)],
    "wan2.2-t2v-a14b": [(81, 480, 832), (81, 720, 1280)],
    "wan2.1-i2v-14b": [(81, 480, 832), (81, 720, 1280)],
    "wan2.2-i2v-a14b": [(81, 480, 832), (81, 720, 1280)],
    "wan2.2-ti2v-5b": [(121, 704, 1280)],  # its one published size (720p, 24 fps: 5 s)
    "cogvideox-5b": [(49, 480, 720)],
}
BUDGETS = ("12GB", "8GB")
# RAM of the machine -> the host budget its recipe gives the packs (the rest: the OS, Python, torch and CUDA, the disk
# ring, the pipeline's host tensors)
HOST_BUDGETS = {"16GB": "8GB", "32GB": "20GB"}


def main() -> None:
    """Plan every preset and write the JSON."""
    parser = OneLineParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_presets.json"))
    parser.add_argument("--smoke", action="store_true", help="one preset, one shape")
    args = parser.parse_args()
    try:  # its directory, checked before planning rather than when writing
        out_directory(str(Path(args.out).parent))
    except argparse.ArgumentTypeError as err:
        parser.error(f"argument --out: {err}")
    warnings.filterwarnings("ignore")
    rows = []
    presets = list(SHAPES.items())[:1] if args.smoke else SHAPES.items()
    for model, shapes in presets:
        for frames, height, width in shapes[:1] if args.smoke else shapes:
            for budget in BUDGETS[:1] if args.smoke else BUDGETS:
                for tiling in (False,) if args.smoke else (False, True):
                    start = time.time()
                    p = tritoff.plan(model, budget, frames=frames, height=height, width=width, vae_tiling=tiling)
                    rows.append({**p.as_dict(), "seconds": round(time.time() - start, 1)})
                    print(p.text(), "\n", flush=True)
    host_rows = []
    for model in ["wan2.1-t2v-14b"] if args.smoke else ["wan2.1-t2v-14b", "wan2.2-t2v-a14b"]:
        for ram, host_budget in list(HOST_BUDGETS.items())[:1] if args.smoke else HOST_BUDGETS.items():
            for budget in BUDGETS[:1] if args.smoke else BUDGETS:
                start = time.time()
                p = tritoff.plan(model, budget, host_budget=host_budget)
                host_rows.append({**p.as_dict(), "ram": ram, "seconds": round(time.time() - start, 1)})
                print(p.text(), "\n", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    data = {"tritoff": tritoff.__version__, "rows": rows, "host_rows": host_rows}
    Path(args.out).write_text(json.dumps(data, indent=2))
    print("model", "shape", "budget", "vae tiling", "fits", "minimum", sep=" | ")
    for r in rows:
        s = r["shape"]
        print(
            r["model"],
            f"{s['frames']}x{s['height']}x{s['width']}",
            format_bytes(r["budget"]),
            s["vae_tiling"],
            r["feasible"],
            format_bytes(r["minimum_budget"], up=True),
            sep=" | ",
        )
    print("\nmodel", "RAM", "host budget", "GPU budget", "held", "read from disk per run (50 steps)", sep=" | ")
    for r in host_rows:
        per_run = {
            p["components"][0]: p["disk_bytes_per_call"] * p["calls_per_run"] + p["disk_entry_bytes"]
            for p in r["phases"]
        }
        disk = ", ".join(f"{name} {format_bytes(n)}" for name, n in per_run.items())
        held = f"{format_bytes(r['host_held_bytes'])} of {format_bytes(r['host_bytes'])}"
        print(r["model"], r["ram"], format_bytes(r["host_budget"]), format_bytes(r["budget"]), held, disk, sep=" | ")


if __name__ == "__main__":
    main()

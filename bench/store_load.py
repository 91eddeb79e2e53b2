"""Loading from a store: host memory and time of ``tritoff run --store`` with the text encoder built without its
weights, against the same run loading it whole.

``tritoff run MODEL --store DIR`` builds the stored components from their configs, without reading their weights
(the packs replace them); a transformers text encoder is built so too where it is the model the store was made from,
else loaded whole (the fallback, forced here for the second row). A Wan pipeline of tiny transformer and VAE with a
UMT5 text encoder of ``--layers`` x ``--dim`` (UMT5-XXL: 24 x 4096, 11 GB in bf16) is saved, converted once, and run
from the store in a child process per row (one step, one 16x16 frame, on the CPU). Per row: the child's peak RSS
(Linux's VmHWM) and its RSS once enabled, the seconds to load and enable, and the video's bytes (both rows must give
the same). Writes ``store_load.json`` (``-smoke`` with --smoke) under ``--out`` (default bench/results).

Usage:
  python bench/store_load.py [--layers 12] [--dim 2048] [--out DIR]
  python bench/store_load.py --smoke      a small encoder (CI)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_directory, write_result

from tritoff.arguments import OneLineParser

# the child: the command line's own entry point, in a process of its own so its peak RSS is this row's alone
CHILD = """
import json, sys, time
args = json.loads(sys.argv[1])
start = time.perf_counter()
import tritoff
from tritoff import cli, loading
if not args["built_empty"]:
    loading._empty_encoder = lambda *a: None  # the fallback: the text encoder loaded whole, then replaced by its packs
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
row, enable = {}, tritoff.enable
def timed(*a, **k):
    engine = enable(*a, **k)
    seconds = time.perf_counter() - start
    row.update(enabled_s=seconds, rss_enabled_bytes=status("VmRSS:"), peak_rss_enabled_bytes=status("VmHWM:"))
    return engine
tritoff.enable = timed
row["exit"] = cli.main(args["argv"])
row["peak_rss_bytes"] = status("VmHWM:")
print("ROW " + json.dumps(row), flush=True)
"""


def build(directory: Path, layers: int, dim: int, saved: str) -> int:
    """Save a Wan pipeline with a UMT5 text encoder of ``layers`` x ``dim`` in ``directory``, the encoder's checkpoint
    in ``saved`` (``float32`` or ``bfloat16``); returns the encoder's bytes in bf16."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from tritoff.tiny import UMT5_TINY, realistic_init, tiny_wan_pipeline

    pipe = tiny_wan_pipeline(text_dim=dim)
    sizes = dict(d_model=dim, d_kv=dim // 16, num_heads=16, d_ff=2 * dim, num_layers=layers)
    config = UMT5Config(**{**UMT5_TINY, **sizes})
    # rounded through bf16 either way: the two checkpoints hold the same values
    pipe.text_encoder = realistic_init(UMT5EncoderModel(config)).to(torch.bfloat16).to(getattr(torch, saved)).eval()
    pipe.save_pretrained(directory)
    return sum(p.numel() * 2 for p in pipe.text_encoder.parameters())


def run_row(model: Path, store: Path, out: Path, built_empty: bool) -> dict:
    """One ``tritoff run --store`` in a child process; its figures."""
    argv = ["run", str(model), "--store", str(store), "--prompt", "a cat", "--steps", "1", "--frames", "1"]
    argv += ["--height", "16", "--width", "16", "--budget", "1GB", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({"argv": argv, "built_empty": built_empty})],
        capture_output=True,
        text=True,
    )
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows or json.loads(rows[-1])["exit"] != 0:
        raise SystemExit(f"the run from the store failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    row = json.loads(rows[-1])
    row["video_sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
    return {"text_encoder": "built without its weights" if built_empty else "loaded whole", **row}


def main() -> None:
    """Build, convert, run both rows, write the JSON."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="UMT5 layers (default 12)")
    parser.add_argument("--dim", type=int, default=2048, help="UMT5 width (default 2048: 1 GB in bf16)")
    parser.add_argument("--smoke", action="store_true", help="a small encoder (CI)")
    parser.add_argument("--out", type=out_directory, default=None, help="directory for the JSON (bench/results)")
    args = parser.parse_args()
    layers, dim = (2, 128) if args.smoke else (args.layers, args.dim)
    from tritoff.convert import convert_pipeline

    rows, data = [], {"text_encoder": {"layers": layers, "dim": dim}}
    for saved in ("float32",) if args.smoke else ("float32", "bfloat16"):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            data["text_encoder"]["bf16_bytes"] = build(root / "pipe", layers, dim, saved)
            convert_pipeline(root / "pipe", root / "store", progress=False)  # the pipeline loaded in bf16
            data["store_bytes"] = sum(f.stat().st_size for f in (root / "store").iterdir())
            for empty in (True, False):
                rows.append({"checkpoint": saved, **run_row(root / "pipe", root / "store", root / "v.gif", empty)})
                row = rows[-1]
                print(
                    f"{saved} checkpoint, text encoder {row['text_encoder']}: peak RSS by the end of enable "
                    f"{row['peak_rss_enabled_bytes'] / 2**20:.0f} MiB (then {row['rss_enabled_bytes'] / 2**20:.0f} "
                    f"MiB), load + enable {row['enabled_s']:.1f} s; peak RSS of the run "
                    f"{row['peak_rss_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
    encoder, store = data["text_encoder"]["bf16_bytes"], data["store_bytes"]
    print(f"text encoder {encoder / 2**20:.0f} MiB in bf16, store {store / 2**20:.0f} MiB")
    if len({row["video_sha256"] for row in rows}) != 1:
        raise SystemExit("the rows wrote different videos")
    print(f"wrote {write_result('store_load', {**data, 'rows': rows}, args.smoke, args.out)}")


if __name__ == "__main__":
    main()

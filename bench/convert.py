"""Converting a saved pipeline into a store: time, bytes written, and the most disk the conversion held at once.

Saves a Wan pipeline whose transformer has ``--layers`` blocks of width ``--dim`` (random weights, bf16), then runs
``tritoff.convert_pipeline`` on it into a new store on the same file system. A thread samples the file system's free
space every 5 ms, so "peak extra disk" is the most the conversion held at once beyond what was there before it started
(the store included). "bytes written" is the process's ``write_bytes`` from ``/proc/self/io`` (what it sent to the
block layer; None where the kernel does not report it). The store is verified afterwards.

Usage:
  python bench/convert.py [--layers 8] [--dim 1024] [--ffn 4096] [--dir DIR] [--out DIR]
  python bench/convert.py --smoke          tiny, CI
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    """Measure one conversion and write ``convert-cpu.json``."""
    from common import out_directory

    from tritoff.arguments import OneLineParser, at_least

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=at_least(1), default=8)
    parser.add_argument("--dim", type=at_least(128), default=1024, help="transformer width (heads of 128)")
    parser.add_argument("--ffn", type=at_least(1), default=4096)
    parser.add_argument(
        "--dir", type=out_directory, default=None, help="where the pipeline and the store go (default: a temporary dir)"
    )
    parser.add_argument(
        "--out", type=out_directory, default=None, help="directory for the JSON (default: bench/results)"
    )
    parser.add_argument("--smoke", action="store_true", help="2 blocks of width 256")
    args = parser.parse_args()
    if args.dim % 128:
        parser.error(f"argument --dim: must be a multiple of 128 (heads of 128), got {args.dim}")
    if args.smoke:
        args.layers, args.dim, args.ffn = 2, 256, 512
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from common import markdown_table, write_result

    from tritoff.convert import convert_pipeline
    from tritoff.store import verify_store
    from tritoff.tiny import tiny_wan_pipeline

    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tritoff-convert-", dir=args.dir))
    try:
        config = dict(num_layers=args.layers, num_attention_heads=args.dim // 128, attention_head_dim=128)
        if args.smoke:
            config.update(num_attention_heads=2)
        tiny_wan_pipeline(ffn_dim=args.ffn, **config).save_pretrained(work / "pipe")
        checkpoint = sum(p.stat().st_size for p in (work / "pipe").rglob("*.safetensors"))
        os.sync()
        peak = _PeakDisk(work)
        written = _write_bytes()
        start = time.perf_counter()
        with peak:
            convert_pipeline(work / "pipe", work / "store", progress=False)
        seconds = time.perf_counter() - start
        written = None if written is None else _write_bytes() - written
        store = sum(p.stat().st_size for p in (work / "store").glob("*.safetensors"))
        verify_store(work / "store", full=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "config": {**config, "ffn_dim": args.ffn},
        "checkpoint_bytes": checkpoint,
        "store_bytes": store,
        "seconds": seconds,
        "bytes_written": written,
        "peak_extra_disk_bytes": peak.most,
    }
    path = write_result("convert-cpu", result, smoke=args.smoke, out=args.out)
    mib = 1 << 20
    print(
        markdown_table(
            ["checkpoint MiB", "store MiB", "seconds", "MiB written", "peak extra disk MiB", "peak / store"],
            [
                [
                    f"{checkpoint / mib:.0f}",
                    f"{store / mib:.0f}",
                    f"{seconds:.1f}",
                    "-" if written is None else f"{written / mib:.0f}",
                    f"{peak.most / mib:.0f}",
                    f"{peak.most / store:.2f}",
                ]
            ],
        )
    )
    print(f"wrote {path}")


def _write_bytes() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class _PeakDisk:
    """The most free space of ``directory``'s file system fell below its level at entry, sampled every 5 ms."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.most = 0
        self._stop = threading.Event()

    def __enter__(self):
        self._base = shutil.disk_usage(self.directory).free
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.most = max(self.most, self._base - shutil.disk_usage(self.directory).free)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.most = max(self.most, self._base - shutil.disk_usage(self.directory).free)


if __name__ == "__main__":
    main()

"""The ``tritoff`` command line (also ``python -m tritoff``)."""

from __future__ import annotations

import argparse
import os
import sys


def _prepare_backend() -> None:
    """Without CUDA, run Triton kernels in its interpreter (must be decided before triton is imported)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _print_table(rows: dict) -> None:
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        if isinstance(value, int) and value > 4096:
            value = f"{value:,} B ({value / 2**20:.2f} MiB)"
        print(f"  {key:<{width}}  {value}")


def _cmd_demo(args) -> int:
    from tritoff.demo import run_demo

    print("tritoff demo: a locally built Wan transformer, quantized into fp8 packs and onloaded through the kernels")
    _print_table(run_demo(args.storage, args.device))
    return 0


def _cmd_info(args) -> int:
    import torch

    import tritoff
    from tritoff.kernels import has_triton, interpreting, native_fp8

    rows = {"tritoff": tritoff.__version__, "torch": torch.__version__}
    if has_triton():
        import triton

        rows["triton"] = triton.__version__
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        rows["device"] = f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})"
        rows["fp8 conversion"] = "native" if native_fp8("cuda") else "from uint8 bits (compute capability < 8.9)"
        rows["kernels"] = "Triton" if has_triton() else "PyTorch reference (triton not installed)"
    else:
        rows["device"] = "cpu (no CUDA)"
        rows["kernels"] = "Triton interpreter" if has_triton() and interpreting() else "PyTorch reference"
    _print_table(rows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tritoff`` command."""
    parser = argparse.ArgumentParser(prog="tritoff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize, pack and onload a small locally built model; print a summary")
    demo.add_argument("--storage", default="fp8_e4m3", help="fp8_e4m3 (default), fp8_e5m2, bf16 or fp16")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    demo.set_defaults(func=_cmd_demo)
    info = sub.add_parser("info", help="versions, device, and which kernel path will be used")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tritoff`` console script."""
    args = build_parser().parse_args(argv)
    _prepare_backend()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"tritoff: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``tritoff`` command line (also ``python -m tritoff``): demo, run, convert, bench, info.

Every bad input ends with a one-line error and exit code 2; outputs are written to a temporary file and renamed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

EXIT_USAGE = 2


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _prepare_backend(device: str | None) -> None:
    """Without CUDA, run Triton kernels in its interpreter (must be decided before triton is imported)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore", message="no CUDA device")


def _print_rows(rows: dict) -> None:
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"  {key:<{width}}  {value}")


def _cmd_demo(args) -> int:
    from tritoff.demo import run_demo
    from tritoff.video import check_writable, write_video

    check_writable(args.out)
    print("tritoff demo: a Wan pipeline built locally (random weights), weights in fp8 packs, blocks streamed")
    frames, engine, psnr = run_demo(args.storage, args.budget, args.steps, args.device)
    path = write_video(frames, args.out, fps=8)
    print(engine.report())
    print(f"\n  frames PSNR against the plain bf16 pipeline: {psnr:.1f} dB")
    print(f"  video: {path}")
    return 0


def _check_model(model: str) -> Path:
    """A local pipeline directory, or something shaped like a hub id; else a one-line error."""
    local = Path(model)
    if local.exists() and not (local / "model_index.json").is_file():
        raise CliError(f"{model} is not a diffusers pipeline directory (no model_index.json)")
    if not local.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise CliError(f"model {model!r} not found: give a local pipeline directory or a hub id like org/name")
    return local


def _load_pipeline(model: str, dtype, store: str | None):
    """``DiffusionPipeline.from_pretrained`` with one-line errors; components held in ``store`` are built empty."""
    import torch

    from tritoff.convert import from_pretrained

    local = _check_model(model)
    kwargs = {}
    if store is not None and local.exists():
        import json

        from tritoff.store import read_index

        libraries = json.loads((local / "model_index.json").read_text())
        for name in read_index(store)["components"]:
            # diffusers models (the transformer: most of the bytes) are built without reading their weights;
            # transformers encoders tie weights at load time, so they load normally and are replaced by the packs
            if libraries.get(name, [None])[0] == "diffusers":
                kwargs[name] = _empty_component(local, name, store)
    try:
        pipe = from_pretrained(model, dtype, **kwargs)
    except (OSError, ValueError) as err:
        raise CliError(f"cannot load {model}: {str(err).splitlines()[0]}") from None
    if not any(isinstance(getattr(pipe, n, None), torch.nn.Module) for n in ("transformer", "unet")):
        raise CliError(f"{model} has no transformer or unet: tritoff runs diffusion pipelines")
    return pipe


def _empty_component(directory: Path, name: str, store: str):
    """A diffusers component built from its config without weights, in the dtypes the store recorded."""
    import json

    from tritoff.convert import empty_diffusers_component
    from tritoff.store import stored_dtypes

    _, class_name = json.loads((directory / "model_index.json").read_text())[name]
    return empty_diffusers_component(directory / name, class_name, stored_dtypes(store, name))


def _check_options(args) -> None:
    """Validate options before anything slow happens (the same checks ``enable`` makes later)."""
    from tritoff.budget import parse_size
    from tritoff.formats import get_format
    from tritoff.planner import MODES

    if args.storage is not None:
        get_format(args.storage)
    if args.mode is not None and args.mode not in MODES:
        raise CliError(f"unknown mode {args.mode!r}: use one of {', '.join(MODES)}")
    if args.budget is not None:
        parse_size(args.budget, total=1)  # syntax only: a percentage is resolved on the device later


def _cmd_run(args) -> int:
    import torch

    import tritoff
    from tritoff.report import host_rss
    from tritoff.video import check_writable, write_video

    _check_options(args)
    check_writable(args.out)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    start = time.perf_counter()
    pipe = _load_pipeline(args.model, dtype, args.store)
    engine = tritoff.enable(
        pipe, args.storage, mode=args.mode, budget=args.budget, device=args.device, store=args.store
    )
    startup = time.perf_counter() - start
    rss = host_rss()
    call = dict(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=torch.Generator().manual_seed(args.seed),
        output_type="pt",
    )
    for key in ("num_frames", "height", "width"):
        if getattr(args, key.replace("num_", "")) is not None:
            call[key] = getattr(args, key.replace("num_", ""))
    frames = pipe(**call).frames
    path = write_video(frames, args.out, fps=args.fps)
    print(engine.report())
    source = f" from store {args.store}" if args.store else ""
    memory = f"{rss / 2**20:.0f} MiB" if rss else "n/a"
    print(f"\n  startup (load + enable): {startup:.2f} s{source}, host RSS after enable: {memory}")
    print(f"  video: {path}")
    return 0


def _cmd_convert(args) -> int:
    from tritoff.convert import convert_pipeline
    from tritoff.formats import get_format

    get_format(args.storage)
    _check_model(args.model)
    packed = convert_pipeline(
        args.model,
        args.out_dir,
        args.storage,
        args.granularity,
        tuple(args.skip),
        "leaf" if args.mode == "leaf" else "block",
    )
    total = sum(p.arena.nbytes for p in packed.values())
    print(f"wrote {args.out_dir}: {len(packed)} components, {total / 2**20:.1f} MiB of packs ({args.storage})")
    return 0


def _cmd_bench(args) -> int:
    bench = Path(__file__).resolve().parent.parent / "bench"
    script = bench / f"{args.which}.py"
    if not script.is_file():
        raise CliError(f"{script} not found: the benchmarks ship with the source tree; run from a checkout")
    return subprocess.call([sys.executable, str(script), *args.rest], cwd=bench.parent)


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
        rows["transport"] = "staged: copy engine DMA, then upcast in HBM (leaves SMs to compute)"
    else:
        rows["device"] = "cpu (no CUDA): packs and upcasts, offloads nothing"
        rows["kernels"] = "Triton interpreter" if has_triton() and interpreting() else "PyTorch reference"
    _print_rows(rows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tritoff`` command."""
    parser = argparse.ArgumentParser(prog="tritoff", description="Run large diffusion video models on small GPUs.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a small locally built Wan pipeline through tritoff; write the video")
    demo.add_argument("--storage", default="fp8_e4m3", help="fp8_e4m3 (default), fp8_e5m2, bf16 or fp16")
    demo.add_argument("--budget", default=None, help="GPU memory budget (default: 1.2x the smallest that works)")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    demo.add_argument("--out", default="tritoff-demo.mp4", help="video path (.mp4 with imageio-ffmpeg, else .gif)")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser("run", help="generate a video with a diffusers pipeline (local directory or hub id)")
    run.add_argument("model")
    run.add_argument("--prompt", required=True)
    run.add_argument("--negative-prompt", default=None)
    run.add_argument("--budget", default=None, help="e.g. 12GB, 12GiB, 80%% (default: the GPU's free memory)")
    run.add_argument("--storage", default=None, help="fp8_e4m3 (default), fp8_e5m2, bf16, fp16")
    run.add_argument("--mode", default=None, help="auto (default), model, group, leaf")
    run.add_argument("--steps", type=int, default=30)
    run.add_argument("--frames", type=int, default=None)
    run.add_argument("--height", type=int, default=None)
    run.add_argument("--width", type=int, default=None)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--guidance", type=float, default=5.0)
    run.add_argument("--fps", type=int, default=16)
    run.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    run.add_argument("--device", default=None)
    run.add_argument("--out", default="video.mp4")
    run.add_argument("--store", default=None, help="a store written by `tritoff convert` (mapped, not re-quantized)")
    run.set_defaults(func=_cmd_run)

    convert = sub.add_parser("convert", help="quantize a pipeline once and save its packs as a store")
    convert.add_argument("model")
    convert.add_argument("out_dir")
    convert.add_argument("--storage", default="fp8_e4m3")
    convert.add_argument("--granularity", default="row", choices=("row", "tensor", "none"))
    convert.add_argument("--skip", nargs="*", default=[], help="extra regexes of module names to keep unquantized")
    convert.add_argument("--mode", default="group", choices=("group", "leaf"), help="grouping of the packs")
    convert.set_defaults(func=_cmd_convert)

    bench = sub.add_parser("bench", help="run a benchmark of bench/ (kernels, e2e, quality)")
    bench.add_argument("which", choices=("kernels", "e2e", "quality"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the script (e.g. --smoke)")
    bench.set_defaults(func=_cmd_bench)

    info = sub.add_parser("info", help="versions, device, and which kernel path and transport will be used")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tritoff`` console script."""
    args = build_parser().parse_args(argv)
    _prepare_backend(getattr(args, "device", None))
    try:
        return args.func(args)
    except (CliError, ValueError, FileNotFoundError, PermissionError) as err:
        print(f"tritoff: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

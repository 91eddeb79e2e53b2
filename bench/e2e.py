"""End to end: transformer forwards (the step that repeats) and whole pipelines under a GPU memory cap.

Rows, same weights and inputs: all-resident bf16 (no cap, where it fits); tritoff group fp8 and tritoff auto at the cap;
diffusers ``enable_layerwise_casting(fp8)`` then ``enable_group_offload(block_level, 1 block, use_stream=True)`` (the
order that really sends fp8) at the cap; diffusers model CPU offload where it fits. Columns: seconds per forward
(median after warm-up), ratio to all-resident, peak VRAM, host RSS, bytes moved per forward, compute-stream wait, host
time in tritoff's hooks per group.

Usage:
  python bench/e2e.py [--model wan|cogvideox] [--budget 12GB] [--shape video|image]
  python bench/e2e.py --pipeline [--model wan|cogvideox]     whole pipeline, peak VRAM and time per stage
  python bench/e2e.py --smoke                                 small models on the CPU (CI)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import psutil  # noqa: E402
from common import markdown_table, write_result  # noqa: E402
from models import COGVIDEOX_5B, COGVIDEOX_SMOKE, UMT5_XXL, WAN_14B, WAN_SMOKE, build  # noqa: E402

import tritoff  # noqa: E402
from tritoff.budget import parse_size  # noqa: E402

# (frames, height, width) per model and shape
SHAPES = {
    ("wan", "video"): (81, 480, 832),
    ("wan", "image"): (1, 480, 832),
    ("cogvideox", "video"): (49, 480, 720),
    ("cogvideox", "image"): (1, 480, 720),
}


def transformer_class(model: str):
    from diffusers import CogVideoXTransformer3DModel, WanTransformer3DModel

    return WanTransformer3DModel if model == "wan" else CogVideoXTransformer3DModel


def make_inputs(model: str, config: dict, frames: int, height: int, width: int, device) -> dict:
    """The transformer's keyword arguments for one denoising forward at a video shape (random, fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    lat_f, lat_h, lat_w = (frames - 1) // 4 + 1, height // 8, width // 8
    if model == "wan":
        return dict(
            hidden_states=torch.randn(1, 16, lat_f, lat_h, lat_w, generator=gen).to(device, dtype),
            timestep=torch.tensor([500], device=device),
            encoder_hidden_states=torch.randn(1, 512, config["text_dim"], generator=gen).to(device, dtype),
            return_dict=False,
        )
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    patch = config["patch_size"]
    grid_h, grid_w = lat_h // patch, lat_w // patch
    rope = get_3d_rotary_pos_embed(
        embed_dim=config["attention_head_dim"],
        crops_coords=((0, 0), (grid_h, grid_w)),
        grid_size=(grid_h, grid_w),
        temporal_size=lat_f,
        device=device,
    )
    return dict(
        hidden_states=torch.randn(1, lat_f, config["in_channels"], lat_h, lat_w, generator=gen).to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, config["max_text_seq_length"], config["text_embed_dim"], generator=gen).to(
            device, dtype
        ),
        image_rotary_emb=rope,
        return_dict=False,
    )


class Cap:
    """Enforce a GPU memory cap with set_per_process_memory_fraction (no-op on the CPU)."""

    def __init__(self, budget: int | None, device):
        self.budget, self.device = budget, device

    def __enter__(self):
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, (self.budget or total) / total), self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def peak(self):
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None


def time_forwards(module, inputs, device, reps: int) -> float:
    """Median seconds per forward after one warm-up forward."""
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            module(**inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_row(name, setup, model_name, config, inputs, device, budget, reps) -> dict:
    """Build a fresh model, apply ``setup`` under the cap, time its forwards; errors become the row's note."""
    row = {"row": name}
    model = build(transformer_class(model_name), config)
    try:
        with Cap(budget, device) as cap:
            engine = setup(model)
            row["seconds_per_forward"] = time_forwards(model, inputs, device, reps)
            row["peak_vram_bytes"] = cap.peak()
        row["host_rss_bytes"] = psutil.Process().memory_info().rss
        if engine is not None:
            stats = engine.stats
            forwards = reps + 1
            row["bytes_moved_per_forward"] = stats["total"]["bytes_h2d"] / forwards
            row["compute_wait_s_per_forward"] = stats["total"].get("compute_wait_s", 0.0) / forwards
            row["hook_us_per_group"] = stats["components"]["model"]["hook_us_per_group"]
            row["packed_bytes"] = stats["total"]["packed_bytes"]
            row["plan"] = engine.plan.summary()
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as err:
        row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def transformer_rows(args, device) -> dict:
    config = (
        (WAN_SMOKE if args.model == "wan" else COGVIDEOX_SMOKE)
        if args.smoke
        else (WAN_14B if args.model == "wan" else COGVIDEOX_5B)
    )
    frames, height, width = (5, 32, 32) if args.smoke else SHAPES[(args.model, args.shape)]
    budget = parse_size(args.budget)
    reserve = parse_size(args.reserve, what="reserve", total=budget)
    inputs = make_inputs(args.model, config, frames, height, width, device)
    kernels = "auto"

    def resident(model):
        model.to(device)

    def tritoff_mode(mode):
        return lambda model: tritoff.enable(
            model, mode=mode, budget=budget, reserve=reserve, device=device, kernels=kernels, progress=False
        )

    def diffusers_group(model):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        model.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=device.type == "cuda",
        )

    def diffusers_model_offload(model):
        from accelerate import cpu_offload_with_hook

        cpu_offload_with_hook(model, device)

    setups = [
        ("all-resident bf16 (no cap)", resident, None),
        (f"tritoff group fp8 @ {args.budget}", tritoff_mode("group"), budget),
        (f"tritoff auto @ {args.budget}", tritoff_mode("auto"), budget),
        (f"diffusers layerwise fp8 + group offload @ {args.budget}", diffusers_group, budget),
        (f"diffusers model cpu offload @ {args.budget}", diffusers_model_offload, budget),
    ]
    rows = [run_row(label, setup, args.model, config, inputs, device, cap, args.reps) for label, setup, cap in setups]
    base = rows[0].get("seconds_per_forward")
    for row in rows:
        if base and row.get("seconds_per_forward"):
            row["ratio_to_resident"] = row["seconds_per_forward"] / base
    return {
        "model": args.model,
        "shape": [frames, height, width],
        "budget_bytes": budget,
        "reserve_bytes": reserve,
        "rows": rows,
    }


def pipeline_run(args, device) -> dict:
    """Whole pipeline under the cap: text encoding, denoising with CFG, VAE decode (tiled), per stage."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        AutoencoderKLWan,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from tritoff.tiny import COGVIDEOX_VAE_TINY, UMT5_TINY, WAN_VAE_TINY, tiny_tokenizer

    budget = parse_size(args.budget)
    if args.smoke:
        t5 = UMT5_TINY
        frames, height, width = (5, 32, 32) if args.model == "wan" else (9, 32, 32)
    else:
        t5 = UMT5_XXL
        frames, height, width = SHAPES[(args.model, "video")]
    encoder = build(UMT5EncoderModel, {"config": UMT5Config(**t5)})
    tokenizer = tiny_tokenizer(min(t5["vocab_size"], 32000))
    if args.model == "wan":
        transformer = build(transformer_class("wan"), WAN_SMOKE if args.smoke else WAN_14B)
        vae_config = WAN_VAE_TINY if args.smoke else {}
        vae = build(AutoencoderKLWan, vae_config, dtype=torch.float32)
        pipe = WanPipeline(
            tokenizer=tokenizer,
            text_encoder=encoder,
            vae=vae,
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        )
    else:
        transformer = build(transformer_class("cogvideox"), COGVIDEOX_SMOKE if args.smoke else COGVIDEOX_5B)
        vae_config = COGVIDEOX_VAE_TINY if args.smoke else {}
        vae = build(AutoencoderKLCogVideoX, vae_config)
        pipe = CogVideoXPipeline(
            tokenizer=tokenizer,
            text_encoder=encoder,
            vae=vae,
            transformer=transformer,
            scheduler=CogVideoXDDIMScheduler(),
        )
    pipe.vae.enable_tiling()
    result = {
        "model": args.model,
        "shape": [frames, height, width],
        "budget_bytes": budget,
        "vae": "tiling enabled",
        "steps": args.steps,
    }
    with Cap(budget, device) as cap:
        start = time.perf_counter()
        reserve = parse_size(args.reserve, what="reserve", total=budget)
        engine = tritoff.enable(pipe, budget=budget, reserve=reserve, device=device, progress=not args.smoke)
        result["enable_s"] = time.perf_counter() - start
        seq = 16 if args.smoke else (512 if args.model == "wan" else 226)
        stages = {}
        with torch.no_grad():
            start = time.perf_counter()
            embeds, negative = pipe.encode_prompt(
                "a cat surfing a wave at sunset", "blurry", device=device, max_sequence_length=seq
            )[:2]
            stages["text_encode_s"] = _elapsed(start, device)
            start = time.perf_counter()
            latents = pipe(
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                num_frames=frames,
                height=height,
                width=width,
                num_inference_steps=args.steps,
                guidance_scale=5.0,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            ).frames
            stages["denoise_s"] = _elapsed(start, device)
            stages["denoise_s_per_step"] = stages["denoise_s"] / args.steps
            start = time.perf_counter()
            decode_in = latents.to(pipe.vae.dtype)
            if args.model == "cogvideox":
                decode_in = decode_in.permute(0, 2, 1, 3, 4) / pipe.vae.config.scaling_factor
            pipe.vae.decode(decode_in)
            stages["vae_decode_s"] = _elapsed(start, device)
        result.update(stages)
        result["peak_vram_bytes"] = cap.peak()
    result["host_rss_bytes"] = psutil.Process().memory_info().rss
    result["report"] = engine.report()
    return result


def gib(value) -> str:
    """Bytes as GiB with two decimals, or '-'."""
    return f"{value / 2**30:.2f}" if value else "-"


def _elapsed(start: float, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    """Parse arguments, run, print a table, write bench/results/e2e-<model>-<shape>.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("wan", "cogvideox"), default="wan")
    parser.add_argument("--shape", choices=("video", "image"), default="video")
    parser.add_argument("--budget", default=None, help="GPU memory cap (default 12GB; --smoke: 5MB)")
    parser.add_argument(
        "--reserve", default="25%", help="activation reserve given to tritoff (default 25%% of the budget)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="--pipeline: denoising steps")
    parser.add_argument("--pipeline", action="store_true", help="whole pipeline instead of transformer forwards")
    parser.add_argument("--smoke", action="store_true", help="small models on the CPU (CI)")
    args = parser.parse_args()
    args.budget = args.budget or ("5MB" if args.smoke else "12GB")
    if args.smoke:
        args.reps = 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.pipeline:
        data = pipeline_run(args, device)
        print(data.pop("report"))
        print({k: v for k, v in data.items()})
        name = f"e2e-pipeline-{args.model}"
    else:
        data = transformer_rows(args, device)
        table = []
        for r in data["rows"]:
            table.append(
                [
                    r["row"],
                    f"{r['seconds_per_forward']:.3f}" if "seconds_per_forward" in r else r.get("note", "-"),
                    f"{r['ratio_to_resident']:.3f}" if "ratio_to_resident" in r else "-",
                    gib(r.get("peak_vram_bytes")),
                    gib(r.get("host_rss_bytes")),
                    gib(r.get("bytes_moved_per_forward")),
                    f"{r['compute_wait_s_per_forward'] * 1e3:.1f}" if "compute_wait_s_per_forward" in r else "-",
                    f"{r['hook_us_per_group']:.1f}" if r.get("hook_us_per_group") else "-",
                ]
            )
        print(
            markdown_table(
                [
                    "row",
                    "s / forward",
                    "x resident",
                    "peak VRAM GiB",
                    "host RSS GiB",
                    "moved GiB / fwd",
                    "wait ms / fwd",
                    "hook us / group",
                ],
                table,
            )
        )
        name = f"e2e-{args.model}-{args.shape}"
    print(f"wrote {write_result(name, data, smoke=args.smoke)}")
    failed = [r for r in data.get("rows", []) if r["row"].startswith("tritoff") and "note" in r]
    if failed:  # a peer that does not fit is a result; tritoff failing is a bug
        sys.exit(f"tritoff rows failed: {'; '.join(r['note'] for r in failed)}")


if __name__ == "__main__":
    main()

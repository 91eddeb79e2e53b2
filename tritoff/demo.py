"""The README's main job: a locally built Wan pipeline run through tritoff under a tight budget."""

from __future__ import annotations

import math

import torch

import tritoff
from tritoff.planner import BudgetError
from tritoff.tiny import tiny_wan_pipeline

# blocks that dominate the model, as in the 14B one, so the budget forces streaming
DEMO_TRANSFORMER = dict(num_layers=4, ffn_dim=1024, num_attention_heads=4, attention_head_dim=32)
DEMO_CALL = dict(
    prompt="a red fox running through snow",
    negative_prompt="blurry",
    num_frames=9,
    height=64,
    width=64,
    max_sequence_length=16,
    guidance_scale=5.0,
)


def demo_pipeline():
    """The demo's pipeline: tiny Wan components with random weights, built locally."""
    return tiny_wan_pipeline(**DEMO_TRANSFORMER)


def run_demo(
    storage: str = "fp8_e4m3",
    budget: str | None = None,
    steps: int = 4,
    device: str | None = None,
    frames: int = DEMO_CALL["num_frames"],
):
    """Generate with and without tritoff; return (frames, engine, PSNR of the frames against plain bf16 in dB).

    Without ``budget`` the demo takes 1.2x the smallest budget the planner accepts, so blocks stream. tritoff is
    enabled first, so a budget that cannot work fails before the reference pipeline runs.
    """
    call = dict(DEMO_CALL, num_frames=frames, num_inference_steps=steps, output_type="pt")
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pipe = demo_pipeline()
    if budget is None:
        try:
            tritoff.enable(pipe, storage, mode="group", budget=1, device=target, progress=False)
        except BudgetError as err:
            budget = int(err.minimum * 1.2)
    engine = tritoff.enable(pipe, storage, mode="group", budget=budget, device=target)
    plain = demo_pipeline().to(target)
    plain.set_progress_bar_config(desc="reference run (plain bf16, no tritoff)")
    reference = plain(**call, generator=torch.Generator().manual_seed(0)).frames
    del plain
    pipe.set_progress_bar_config(desc=f"tritoff run ({engine.options.storage['transformer']} packs)")
    out = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    mse = (out.float() - reference.float()).pow(2).mean().item()
    psnr = math.inf if mse == 0 else 10 * math.log10(1 / mse)
    return out, engine, psnr

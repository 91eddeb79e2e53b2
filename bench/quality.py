"""Output quality: SNR of the transformer output against bf16, tritoff's fp8 against diffusers' unscaled cast.

For tiny and mid-size random-weight Wan and CogVideoX transformers whose weights have realistic scale
(std = gain / sqrt(fan_in), gain swept from 1 down to 0.05), on the same weights and inputs:
tritoff e4m3 and e5m2 with power-of-two row scales, tritoff e4m3 with per-tensor scales, and diffusers'
``enable_layerwise_casting`` (unscaled fp8). Then the frames of a full tiny Wan pipeline with the same seed (PSNR).
With ``--vae``: only the frames of each tiny pipeline family with its VAE in fp8_e4m3 against its VAE kept in its own
dtype (tritoff's default), everything else alike (bench/results/vae_psnr.json).
Runs on the CPU. Usage: python bench/quality.py [--smoke] [--vae]
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from common import markdown_table, out_directory, plot_lines, write_result

import tritoff
from tritoff.arguments import OneLineParser
from tritoff.snr import snr_db
from tritoff.tiny import realistic_init, tiny_cogvideox_transformer, tiny_wan_pipeline, tiny_wan_transformer

warnings.filterwarnings("ignore", message="no CUDA device")

SIZES = {
    "wan-tiny": (tiny_wan_transformer, {}),
    "wan-mid": (
        tiny_wan_transformer,
        dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=4, text_dim=256),
    ),
    "cogvideox-tiny": (tiny_cogvideox_transformer, {}),
    "cogvideox-mid": (
        tiny_cogvideox_transformer,
        dict(num_attention_heads=8, attention_head_dim=64, num_layers=4, text_embed_dim=256, time_embed_dim=64),
    ),
}
GAINS = (1.0, 0.5, 0.25, 0.1, 0.05)
METHODS = {
    "tritoff e4m3 row": dict(storage="fp8_e4m3", granularity="row"),
    "tritoff e5m2 row": dict(storage="fp8_e5m2", granularity="row"),
    "tritoff e4m3 tensor": dict(storage="fp8_e4m3", granularity="tensor"),
}
DIFFUSERS = "diffusers layerwise e4m3 (unscaled)"


def inputs_for(name: str, model) -> dict:
    """Fixed-seed transformer inputs for preset ``name``."""
    gen = torch.Generator().manual_seed(1)
    cfg = model.config
    if name.startswith("wan"):
        return dict(
            hidden_states=torch.randn(1, 16, 3, 16, 16, generator=gen).bfloat16(),
            timestep=torch.tensor([700]),
            encoder_hidden_states=torch.randn(1, 16, cfg.text_dim, generator=gen).bfloat16(),
            return_dict=False,
        )
    return dict(
        hidden_states=torch.randn(1, 3, cfg.in_channels, 16, 16, generator=gen).bfloat16(),
        timestep=torch.tensor([700]),
        encoder_hidden_states=torch.randn(1, 16, cfg.text_embed_dim, generator=gen).bfloat16(),
        return_dict=False,
    )


def measure(name: str, gain: float) -> dict:
    """SNR (dB) of preset ``name``'s output, its weights drawn with ``gain``, under each storage method and diffusers'
    layerwise fp8 casting, against the unquantized model."""
    build, overrides = SIZES[name]
    model = realistic_init(build(**overrides), seed=0, gain=gain).eval()
    # realistic_init draws in fp32 and writes into bf16/fp32 parameters; fp32-kept modules stay fp32
    inputs = inputs_for(name, model)
    with torch.no_grad():
        reference = model(**inputs)[0].float()
    row = {"model": name, "gain": gain}
    for method, options in METHODS.items():
        candidate = copy.deepcopy(model)
        tritoff.enable(candidate, mode="auto", progress=False, kernels="reference", **options)
        with torch.no_grad():
            row[method] = snr_db(reference, candidate(**inputs)[0].float())
    candidate = copy.deepcopy(model)
    candidate.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with torch.no_grad():
        row[DIFFUSERS] = snr_db(reference, candidate(**inputs)[0].float())
    return row


def pipeline_psnr(steps: int) -> dict:
    """PSNR (dB) of a tiny Wan pipeline's frames (range [0, 1]) against the bf16 pipeline, same seed."""
    call = dict(
        prompt="a cat",
        num_frames=5,
        height=32,
        width=32,
        num_inference_steps=steps,
        max_sequence_length=16,
        output_type="pt",
    )

    def frames(pipe):
        return pipe(**call, generator=torch.Generator().manual_seed(0)).frames.float()

    reference = frames(tiny_wan_pipeline())
    results = {}
    for storage in ("fp8_e4m3", "fp8_e5m2"):
        pipe = tiny_wan_pipeline()
        tritoff.enable(pipe, storage=storage, progress=False, kernels="reference")
        results[f"tritoff {storage} (VAE kept in its dtype)"] = _psnr(reference, frames(pipe))
        pipe = tiny_wan_pipeline()
        tritoff.enable(pipe, storage={"vae": storage, "transformer": storage, "text_encoder": storage}, progress=False)
        results[f"tritoff {storage} (all components, VAE too)"] = _psnr(reference, frames(pipe))
    pipe = tiny_wan_pipeline()
    tritoff.enable(pipe.transformer, progress=False, kernels="reference")
    results["tritoff fp8_e4m3 (transformer only)"] = _psnr(reference, frames(pipe))
    pipe = tiny_wan_pipeline()
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    results["diffusers layerwise e4m3 (transformer only)"] = _psnr(reference, frames(pipe))
    return results


def vae_psnr() -> dict:
    """Per tiny pipeline family: PSNR (dB) of its frames with the VAE in fp8_e4m3 against the VAE kept in its own
    dtype (both through tritoff, everything else alike), and each against the plain pipeline."""
    from tritoff import tiny

    video = dict(prompt="a cat", num_inference_steps=4, max_sequence_length=16, output_type="pt")
    families = {
        "wan": (tiny.tiny_wan_pipeline, dict(video, height=32, width=32, num_frames=9)),
        "cogvideox": (tiny.tiny_cogvideox_pipeline, dict(video, height=32, width=32, num_frames=9)),
        "hunyuan-video": (
            tiny.tiny_hunyuan_video_pipeline,
            dict(video, height=32, width=32, num_frames=9, prompt_template={"template": "{}", "crop_start": 0}),
        ),
        "ltx-video": (tiny.tiny_ltx_video_pipeline, dict(video, height=32, width=32, num_frames=9)),
        "flux": (tiny.tiny_flux_pipeline, dict(video, height=32, width=32)),
    }
    rows = []
    for name, (factory, call) in families.items():

        def frames(pipe, call=call):
            out = pipe(**call, generator=torch.Generator().manual_seed(0))
            return (out.frames if hasattr(out, "frames") else out.images).float().clamp(0, 1)

        plain = frames(factory())
        kept, quantized = factory(), factory()
        tritoff.enable(kept, progress=False, kernels="reference")
        tritoff.enable(quantized, storage={"vae": "fp8_e4m3"}, progress=False, kernels="reference")
        a, b = frames(kept), frames(quantized)
        rows.append(
            {
                "family": name,
                "vae_fp8_vs_vae_kept": _psnr(a, b),
                "vae_kept_vs_plain": _psnr(plain, a),
                "vae_fp8_vs_plain": _psnr(plain, b),
                "vae_params": sum(p.numel() for p in factory().vae.parameters()),
            }
        )
    return {"unit": "dB", "rows": rows}


def _psnr(reference: torch.Tensor, frames: torch.Tensor) -> float:
    mse = (reference - frames).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def main() -> None:
    """Measure, print tables, write quality.json (or vae_psnr.json) into ``--out`` (default: bench/results)."""
    parser = OneLineParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny models and two gains only (CI)")
    parser.add_argument("--vae", action="store_true", help="only the PSNR of VAEs in fp8 against VAEs kept")
    parser.add_argument(
        "--out", type=out_directory, default=None, help="directory for the JSON and the plot (default: bench/results)"
    )
    args = parser.parse_args()
    if args.vae:
        result = vae_psnr()
        print("PSNR (dB) of tiny pipelines' frames: VAE in fp8_e4m3 against VAE kept in its own dtype (CPU)")
        header = ["family", "VAE fp8 vs kept", "VAE kept vs plain", "VAE fp8 vs plain"]
        keys = ("vae_fp8_vs_vae_kept", "vae_kept_vs_plain", "vae_fp8_vs_plain")
        print(markdown_table(header, [[r["family"], *(f"{r[k]:.1f}" for k in keys)] for r in result["rows"]]))
        print(f"\nwrote {write_result('vae_psnr', result, out=args.out)}")
        return
    names = ["wan-tiny", "cogvideox-tiny"] if args.smoke else list(SIZES)
    gains = (1.0, 0.1) if args.smoke else GAINS
    rows = [measure(name, gain) for name in names for gain in gains]
    methods = [*METHODS, DIFFUSERS]
    print("SNR (dB) of the transformer output against bf16; weights std = gain / sqrt(fan_in)")
    print(
        markdown_table(
            ["model", "gain", *methods], [[r["model"], r["gain"], *(f"{r[m]:.1f}" for m in methods)] for r in rows]
        )
    )
    psnr = pipeline_psnr(steps=2 if args.smoke else 4)
    print("\nPSNR (dB) of a tiny Wan pipeline's frames against bf16, same seed")
    print(markdown_table(["method", "PSNR dB"], [[k, f"{v:.1f}"] for k, v in psnr.items()]))
    result = {"unit": "dB", "output_snr": rows, "pipeline_psnr": psnr}
    path = write_result("quality", result, smoke=args.smoke, out=args.out)
    print(f"\nwrote {path}")
    biggest = names[-1] if args.smoke else "wan-mid"
    series = {
        m: ([r["gain"] for r in rows if r["model"] == biggest], [r[m] for r in rows if r["model"] == biggest])
        for m in methods
    }
    plot = plot_lines(
        "quality",
        series,
        "weight gain (std = gain / sqrt(fan_in))",
        "output SNR vs bf16 (dB)",
        f"{biggest}: transformer output SNR against bf16",
        logx=True,
        smoke=args.smoke,
        out=args.out,
    )
    if plot:
        print(f"wrote {plot}")


if __name__ == "__main__":
    main()

"""Video shapes a pipeline accepts: height and width are multiples of its VAE's downscale times its patch size.

Read from configs (plain dicts) only, so the command line checks its arguments before torch is imported.
"""

from __future__ import annotations


def spatial_multiple(vae: dict, denoiser: dict) -> int | None:
    """What height and width must be multiples of: the VAE's spatial downscale times the denoiser's spatial patch
    size, from their configs (None when the VAE's config says neither)."""
    if isinstance(vae.get("temperal_downsample"), list):  # Wan: one 2x spatial downscale per stage
        scale = 2 ** len(vae["temperal_downsample"])
    elif isinstance(vae.get("block_out_channels"), (list, tuple)):  # diffusers VAEs: one per block after the first
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
    else:
        return None
    patch = denoiser.get("patch_size") or 1
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
    return scale * int(patch)


def check_dimensions(vae: dict, denoiser: dict, prefix: str = "", **dims: int | None) -> None:
    """Refuse a height or width (``dims``) the pipeline cannot make, naming the two nearest that work; ``prefix``
    (``"--"`` on the command line) goes before each name."""
    multiple = spatial_multiple(vae, denoiser)
    for key, value in dims.items():
        if multiple and value is not None and value % multiple:
            lower = max(multiple, value - value % multiple)
            raise ValueError(
                f"{prefix}{key} {value} is not a multiple of {multiple} (the VAE's downscale times the patch size); "
                f"use {lower} or {lower + multiple}"
            )

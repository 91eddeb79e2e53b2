"""Video shapes a pipeline accepts: height and width are multiples of its VAE's downscale times its patch size, and
the frame count is one more than a multiple of its VAE's time compression (for CogVideoX's VAE, an odd count of
latent frames).

Read from configs (plain dicts) only, so the command line checks its arguments before torch is imported.
"""

from __future__ import annotations

# The largest shapes tritoff plans and runs: far beyond any published model's, and past them tracing a call's
# activations takes hours (a video VAE decodes latent frame by latent frame: `tritoff plan wan2.1-t2v-14b` took
# 9.6 s at 81 frames, 17 s at 1,001, 42 s at 4,001 on a 2-core VM) while the run itself would take years.
# Steps: a scheduler's train timesteps, which it takes at most.
LIMITS = {"frames": 10_000, "height": 16_384, "width": 16_384, "steps": 1_000}

# VAEs that decode their latent frames in pairs after an odd first batch: an even count comes out longer than asked
# (CogVideoX: 2 latent frames make 8 frames, not 5; the pipeline returns them all)
ODD_LATENT_VAES = {"AutoencoderKLCogVideoX"}


def positive_int(value) -> int | None:
    """``value`` when a config gives an integer of at least 1 there (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def spatial_scale(vae: dict) -> int | None:
    """The VAE's spatial downscale from its config (None when the config says nothing of it)."""
    if positive_int(vae.get("scale_factor_spatial")):  # Wan, as its pipeline reads it (16 for Wan 2.2 TI2V's VAE)
        return vae["scale_factor_spatial"]
    if isinstance(vae.get("temperal_downsample"), list):  # Wan configs saved without it: a 2x downscale per stage
        return 2 ** len(vae["temperal_downsample"])
    if isinstance(vae.get("block_out_channels"), (list, tuple)):  # diffusers VAEs: one per block after the first
        return 2 ** (len(vae["block_out_channels"]) - 1)
    return None


def latent_channels(vae: dict) -> int | None:
    """The channels of the VAE's latents from its config (Wan's ``z_dim``, CogVideoX's ``latent_channels``)."""
    return positive_int(vae.get("z_dim")) or positive_int(vae.get("latent_channels"))


def spatial_multiple(vae: dict, denoiser: dict) -> int | None:
    """What height and width must be multiples of: the VAE's spatial downscale times the denoiser's spatial patch
    size, from their configs (None when the VAE's config says neither)."""
    scale = spatial_scale(vae)
    if scale is None:
        return None
    patch = denoiser.get("patch_size") or 1
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
    return scale * int(patch)


def temporal_multiple(vae: dict) -> int | None:
    """The VAE's time compression from its config: frames after the first go into latents this many at a time (None
    when the config says nothing of it)."""
    if positive_int(vae.get("scale_factor_temporal")):  # Wan, as its pipeline reads it
        return vae["scale_factor_temporal"]
    if isinstance(vae.get("temperal_downsample"), list):  # Wan configs saved without it: 2x per stage that has one
        return 2 ** sum(bool(down) for down in vae["temperal_downsample"])
    ratio = vae.get("temporal_compression_ratio")  # CogVideoX
    return int(ratio) if isinstance(ratio, (int, float)) and ratio >= 1 else None


def check_dimensions(
    vae: dict, denoiser: dict, prefix: str = "", frames: int | None = None, **dims: int | None
) -> None:
    """Refuse a frame count, height or width (``dims``) the pipeline cannot make, naming the two nearest that work
    (the pipeline would round it, or drop frames, with a warning at most); ``prefix`` (``"--"`` on the command line)
    goes before each name."""
    step = temporal_multiple(vae)
    if step and step > 1 and frames is not None and (frames - 1) % step:
        lower = frames - (frames - 1) % step
        raise ValueError(
            f"{prefix}frames {frames} is not one more than a multiple of {step} (the VAE compresses time {step}x after "
            f"the first frame); use {lower} or {lower + step}"
        )
    latents = (frames - 1) // step + 1 if step and frames is not None else None
    if latents is not None and vae.get("_class_name") in ODD_LATENT_VAES and latents % 2 == 0:
        raise ValueError(
            f"{prefix}frames {frames} makes {latents} latent frames, an even count, which {vae['_class_name']} decodes "
            f"to {latents * step} frames; use {frames - step} or {frames + step}"
        )
    multiple = spatial_multiple(vae, denoiser)
    for key, value in dims.items():
        if multiple and value is not None and value % multiple:
            lower = max(multiple, value - value % multiple)
            raise ValueError(
                f"{prefix}{key} {value} is not a multiple of {multiple} (the VAE's downscale times the patch size); "
                f"use {lower} or {lower + multiple}"
            )
    learned_size(vae, denoiser, prefix, **dims)


def learned_size(vae: dict, denoiser: dict, prefix: str = "", **dims: int | None) -> None:
    """Refuse a height or width other than the sample size of a denoiser with learned positional embeddings
    (CogVideoX-5B I2V: its table holds one size of latents, 480x720; the pipeline stops at its first step)."""
    scale = spatial_scale(vae)
    if denoiser.get("use_learned_positional_embeddings") is not True or not scale:
        return
    sizes = {key: positive_int(denoiser.get(f"sample_{key}")) for key in ("height", "width")}
    for key, value in dims.items():
        wanted = sizes.get(key) and sizes[key] * scale
        if wanted and value is not None and value != wanted:
            raise ValueError(
                f"{prefix}{key} {value}: this transformer's learned positional embeddings take one size of video, "
                f"{sizes['height'] * scale}x{sizes['width'] * scale}; use {prefix}{key} {wanted}"
            )

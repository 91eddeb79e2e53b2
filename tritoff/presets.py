"""Configurations of the pipelines people run most, so ``tritoff plan`` can answer before anything is downloaded.

The shapes are those of the published checkpoints (transformer, text encoder and VAE configs); no weights are involved.
"""

from __future__ import annotations

from typing import NamedTuple

WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
# Wan 2.1 I2V-14B (480P and 720P: one architecture): the image and the mask concatenated to the latents (36 channels
# in), and a CLIP image embedding attended to in every block
WAN_14B_I2V = dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
# Wan 2.2 I2V-A14B: the concatenated channels, no image embedding
WAN_A14B_I2V = dict(WAN_14B, in_channels=36)
# Wan 2.1 T2V-1.3B: the 14B's architecture, narrower (12 heads) and shallower (30 blocks)
WAN_1_3B = dict(WAN_14B, num_attention_heads=12, ffn_dim=8960, num_layers=30)
# Wan 2.2 TI2V-5B: 24 heads, 30 blocks, the 48 latent channels of Wan 2.2's VAE in and out
WAN_TI2V_5B = dict(WAN_14B, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)
COGVIDEOX_5B = dict(
    num_attention_heads=48,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    time_embed_dim=512,
    text_embed_dim=4096,
    num_layers=42,
    sample_width=90,
    sample_height=60,
    sample_frames=49,
    patch_size=2,
    temporal_compression_ratio=4,
    max_text_seq_length=226,
    use_rotary_positional_embeddings=True,
)
UMT5_XXL = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
)
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K's vision tower: Wan 2.1 I2V's image encoder
CLIP_VIT_H14 = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=16,
    patch_size=14,
    image_size=224,
    projection_dim=1024,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)

# Wan 2.2's VAE (TI2V-5B): 2x2 patches before a 8x downscale make 16x, 48 latent channels, residual blocks. The
# latents' per-channel mean and deviation (48 each) change no size: zeros and ones here
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    z_dim=48,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)

# what the command line checks a preset's frames, height and width against before torch is imported: the keys of each
# family's VAE config that fix them (the diffusers classes' defaults, the published configs; a test compares them),
# and its class, as a saved config names it
VAE_SHAPES = {
    "wan": dict(
        _class_name="AutoencoderKLWan",
        temperal_downsample=[False, True, True],
        scale_factor_spatial=8,
        scale_factor_temporal=4,
    ),
    "cogvideox": dict(
        _class_name="AutoencoderKLCogVideoX", block_out_channels=(128, 256, 256, 512), temporal_compression_ratio=4
    ),
}


class Preset(NamedTuple):
    """A published pipeline: its family, denoiser components and configs, and how it calls them."""

    family: str
    denoisers: tuple[str, ...]
    transformer: dict
    text_encoder: dict
    image_encoder: dict | None = None  # a CLIP vision config: the pipeline embeds the image (Wan 2.1 I2V)
    image_to_video: bool = False  # the pipeline encodes the conditioning image with the VAE
    # the two experts of Wan 2.2: the share of the train timesteps the first takes, and the scheduler's flow shift
    # (the Wan team's defaults: 0.875 and 12 for T2V-A14B, 0.9 and 5 for I2V-A14B) that places the steps on them
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    vae: dict | None = None  # the VAE's config where it is not its class's default
    expand_timesteps: bool = False  # a timestep per token (Wan 2.2 TI2V)


# the VAEs are the diffusers classes' default configs, which are the published ones, except Wan 2.2's (``vae``)
PRESETS = {
    "wan2.1-t2v-1.3b": Preset("wan", ("transformer",), WAN_1_3B, UMT5_XXL),
    "wan2.1-t2v-14b": Preset("wan", ("transformer",), WAN_14B, UMT5_XXL),
    "wan2.2-t2v-a14b": Preset(
        "wan", ("transformer", "transformer_2"), WAN_14B, UMT5_XXL, boundary_ratio=0.875, flow_shift=12.0
    ),
    "wan2.1-i2v-14b": Preset("wan", ("transformer",), WAN_14B_I2V, UMT5_XXL, CLIP_VIT_H14, image_to_video=True),
    "wan2.2-i2v-a14b": Preset(
        "wan",
        ("transformer", "transformer_2"),
        WAN_A14B_I2V,
        UMT5_XXL,
        image_to_video=True,
        boundary_ratio=0.9,
        flow_shift=5.0,
    ),
    # text to video, as WanPipeline calls it (given an image, its first frame's latents come from the VAE)
    "wan2.2-ti2v-5b": Preset("wan", ("transformer",), WAN_TI2V_5B, UMT5_XXL, vae=WAN22_VAE, expand_timesteps=True),
    "cogvideox-5b": Preset("cogvideox", ("transformer",), COGVIDEOX_5B, T5_XXL),
}


def vae_shapes(name: str) -> dict:
    """The VAE config keys the command line checks preset ``name``'s frames, height and width against: its family's
    (:data:`VAE_SHAPES`), with the values its own VAE config gives them."""
    preset = PRESETS[name]
    own = preset.vae or {}
    return {key: own.get(key, value) for key, value in VAE_SHAPES[preset.family].items()}


def as_loaded(module, dtype):
    """Cast ``module``'s floating parameters as ``from_pretrained(torch_dtype=dtype)`` does: the modules its class
    keeps in fp32 (:func:`fp32_modules`) stay fp32, and tied weights are tied. Returns ``module`` in eval mode."""
    import torch

    tie_weights(module)
    keep = fp32_modules(module, dtype)
    cast: dict[int, torch.nn.Parameter] = {}  # a tied parameter stays one parameter
    for name, sub in module.named_modules(remove_duplicate=False):
        for pname, param in list(sub._parameters.items()):
            if param is not None and param.is_floating_point():
                if id(param) not in cast:
                    full = f"{name}.{pname}" if name else pname
                    wanted = torch.float32 if any(k in full.split(".") for k in keep) else dtype
                    cast[id(param)] = torch.nn.Parameter(param.to(wanted), requires_grad=param.requires_grad)
                sub._parameters[pname] = cast[id(param)]
    return module.eval()


def tie_weights(module) -> None:
    """Tie the tables transformers ties when loading (T5's input embeddings to ``shared``): one parameter, not two."""
    tied = getattr(module, "_tied_weights_keys", None)
    if isinstance(tied, dict):
        params = dict(module.named_parameters(remove_duplicate=False))
        for target, source in tied.items():
            if target in params and source in params and not target.startswith("lm_head"):
                owner, _, leaf = target.rpartition(".")
                setattr(module.get_submodule(owner), leaf, params[source])


def fp32_modules(module, dtype) -> set[str]:
    """Names of the modules ``from_pretrained(torch_dtype=dtype)`` keeps in fp32: diffusers'
    ``_keep_in_fp32_modules``; transformers' strict list, and its plain list only for fp16."""
    import torch

    keep = set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if type(module).__module__.startswith("diffusers") or dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    return keep


def build_preset(name: str) -> tuple[str, dict]:
    """(family, {component: module}) of preset ``name``, built on the meta device in bf16 (as ``tritoff run`` loads
    pipelines)."""
    import torch

    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: give a local diffusers directory or one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    family = preset.family
    # imported before the meta device is made the default: a first import of torch._dynamo (diffusers imports it)
    # under it fails on torch 2.6
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan, CogVideoXTransformer3DModel, WanTransformer3DModel
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
        T5Config,
        T5EncoderModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    with torch.device("meta"):
        if family == "wan":
            components = {"text_encoder": UMT5EncoderModel(UMT5Config(**preset.text_encoder))}
            if preset.image_encoder is not None:
                components["image_encoder"] = CLIPVisionModelWithProjection(CLIPVisionConfig(**preset.image_encoder))
            for denoiser in preset.denoisers:
                components[denoiser] = WanTransformer3DModel(**preset.transformer)
            components["vae"] = AutoencoderKLWan(**(preset.vae or {}))
        else:
            components = {
                "text_encoder": T5EncoderModel(T5Config(**preset.text_encoder)),
                "transformer": CogVideoXTransformer3DModel(**preset.transformer),
                "vae": AutoencoderKLCogVideoX(),
            }
    return family, {n: as_loaded(m, torch.bfloat16) for n, m in components.items()}

"""Tiny Wan and CogVideoX models and pipelines built locally with random weights (no downloads).

Used by the demo, the tests and the benchmarks' smoke runs. Weights are drawn at a realistic scale (std about
1/sqrt(fan_in)), so quantization behaves as on real checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tritoff.convert import cast_like_from_pretrained
from tritoff.presets import WAN22_VAE

WAN_TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)

COGVIDEOX_TINY = dict(
    num_attention_heads=4,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    time_embed_dim=2,
    text_embed_dim=32,
    num_layers=2,
    sample_width=8,
    sample_height=8,
    sample_frames=9,
    patch_size=2,
    temporal_compression_ratio=4,
    max_text_seq_length=16,
)

UMT5_TINY = dict(
    vocab_size=256,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
)
WAN_VAE_TINY = dict(
    base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
)
COGVIDEOX_VAE_TINY = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("CogVideoXDownBlock3D",) * 4,
    up_block_types=("CogVideoXUpBlock3D",) * 4,
    block_out_channels=(8, 8, 8, 8),
    latent_channels=4,
    layers_per_block=1,
    norm_num_groups=2,
    temporal_compression_ratio=4,
)


@torch.no_grad()
def realistic_init(model: nn.Module, seed: int = 0, gain: float = 1.0) -> nn.Module:
    """Redraw every Linear/Conv weight as N(0, gain / sqrt(fan_in)) and every bias as N(0, 0.02), reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and weight is not None:
            fan_in = weight[0].numel()
            weight.copy_(torch.randn(weight.shape, generator=gen) * (gain / fan_in**0.5))
            if module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.02)
    return model


def tiny_wan_transformer(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides):
    """A 2-block WanTransformer3DModel, random weights; `_keep_in_fp32_modules` stay fp32 as on `from_pretrained`."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = realistic_init(WanTransformer3DModel(**{**WAN_TINY, **overrides}), seed)
    return cast_like_from_pretrained(model, dtype)


def tiny_cogvideox_transformer(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides):
    """A 2-block CogVideoXTransformer3DModel with random weights."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    model = realistic_init(CogVideoXTransformer3DModel(**{**COGVIDEOX_TINY, **overrides}), seed)
    return cast_like_from_pretrained(model, dtype)


def tiny_tokenizer(vocab_size: int = 256):
    """A word-level tokenizer built with the ``tokenizers`` package: lowercase words hashed into ``vocab_size`` ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_umt5(dtype: torch.dtype = torch.bfloat16, seed: int = 0, d_model: int = 32, vocab_size: int = 256):
    """A 2-layer UMT5 encoder (its feed-forward casts activations to the ``wo`` weight's dtype, like UMT5-XXL)."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(**{**UMT5_TINY, "vocab_size": vocab_size, "d_model": d_model})
    return realistic_init(UMT5EncoderModel(config), seed).to(dtype).eval()


def tiny_wan_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0, two_experts: bool = False, **transformer):
    """A WanPipeline of tiny random components; ``two_experts`` adds Wan 2.2's ``transformer_2`` (boundary 0.5).

    ``transformer`` overrides the transformer's config (e.g. ``num_layers=4, ffn_dim=1024``).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**WAN_VAE_TINY).eval()
    kwargs = {}
    if two_experts:
        kwargs = dict(transformer_2=tiny_wan_transformer(dtype, seed + 1, **transformer).eval(), boundary_ratio=0.5)
    return WanPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_umt5(dtype, seed),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=tiny_wan_transformer(dtype, seed, **transformer).eval(),
        **kwargs,
    )


def tiny_cogvideox_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **transformer):
    """A CogVideoXPipeline of tiny random components; ``transformer`` overrides the transformer's config."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLCogVideoX(**COGVIDEOX_VAE_TINY).to(dtype).eval()  # decodes in the pipeline's dtype
    return CogVideoXPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_umt5(dtype, seed),
        vae=vae,
        transformer=tiny_cogvideox_transformer(dtype, seed, **transformer).eval(),
        scheduler=CogVideoXDDIMScheduler(),
    )


# the other pipeline families tritoff is tested on; each call takes a few hundred milliseconds on a CPU


def _t5(dtype: torch.dtype, seed: int, d_model: int = 32, vocab_size: int = 256):
    """A 2-layer T5 encoder (CogVideoX, LTX-Video and Flux use T5-XXL)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(**{**UMT5_TINY, "vocab_size": vocab_size, "d_model": d_model})
    return realistic_init(T5EncoderModel(config), seed).to(dtype).eval()


def _clip_text(dtype: torch.dtype, seed: int, hidden: int = 32, projection: int = 32):
    """A 2-layer CLIP text encoder (HunyuanVideo's and Flux's pooled prompt embedding)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=projection,
        max_position_embeddings=77,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return realistic_init(CLIPTextModel(config), seed).to(dtype).eval()


def _clip_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.model_max_length = 77  # CLIP's context; pipelines read it from the tokenizer
    return tokenizer


def tiny_wan_i2v_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A Wan 2.1 image-to-video pipeline: the transformer takes the image latents (36 channels in) and a CLIP vision
    encoder's embedding through added key/value projections."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    image_encoder = realistic_init(CLIPVisionModel(vision), seed).to(dtype).eval()
    inner = WAN_TINY["num_attention_heads"] * WAN_TINY["attention_head_dim"]
    transformer = tiny_wan_transformer(dtype, seed, in_channels=36, image_dim=16, added_kv_proj_dim=inner)
    return WanImageToVideoPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_umt5(dtype, seed),
        vae=AutoencoderKLWan(**WAN_VAE_TINY).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        image_processor=CLIPImageProcessorPil(crop_size=32, size={"shortest_edge": 32}),
        image_encoder=image_encoder,
        transformer=transformer.eval(),
    )


def tiny_wan_vace_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A Wan VACE pipeline: a transformer with VACE control blocks beside its blocks (two lists of blocks)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanVACEPipeline, WanVACETransformer3DModel

    torch.manual_seed(seed)
    transformer = WanVACETransformer3DModel(**{**WAN_TINY, "num_layers": 3}, vace_layers=[0, 2], vace_in_channels=96)
    transformer = cast_like_from_pretrained(realistic_init(transformer, seed), dtype).eval()
    return WanVACEPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_umt5(dtype, seed),
        vae=AutoencoderKLWan(**WAN_VAE_TINY).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=transformer,
    )


def tiny_wan22_ti2v_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A Wan 2.2 TI2V-5B-like pipeline: the 48-channel residual VAE with 2x2 patches, timesteps expanded per token,
    the first frame's latents given by the image (no image encoder)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    torch.manual_seed(seed)
    # Wan 2.2's VAE (the TI2V-5B preset's) with 4 channels at every stage and one residual block each
    small = dict(base_dim=4, decoder_base_dim=None, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    vae = AutoencoderKLWan(**{**WAN22_VAE, **small}).eval()
    return WanImageToVideoPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_umt5(dtype, seed),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=tiny_wan_transformer(dtype, seed, in_channels=48, out_channels=48).eval(),
        expand_timesteps=True,
    )


def tiny_cogvideox_i2v_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A CogVideoX image-to-video pipeline: the image latents are concatenated to the noise (8 channels in)."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXImageToVideoPipeline,
        CogVideoXTransformer3DModel,
    )

    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        **{**COGVIDEOX_TINY, "in_channels": 8, "num_attention_heads": 2, "attention_head_dim": 16},
        use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=True,
    )
    transformer = cast_like_from_pretrained(realistic_init(transformer, seed), dtype).eval()
    return CogVideoXImageToVideoPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=_t5(dtype, seed),
        vae=cast_like_from_pretrained(AutoencoderKLCogVideoX(**COGVIDEOX_VAE_TINY), dtype).eval(),
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )


def tiny_hunyuan_video_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A HunyuanVideo pipeline: dual- and single-stream blocks and a token refiner, a Llama text encoder and a CLIP
    one."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    transformer = cast_like_from_pretrained(realistic_init(transformer, seed), dtype).eval()
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).eval()
    llama = LlamaConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    text_encoder = realistic_init(LlamaModel(llama), seed).to(dtype).eval()
    return HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tiny_tokenizer(),
        transformer=transformer,
        vae=cast_like_from_pretrained(vae, dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=_clip_text(dtype, seed, hidden=8, projection=8),
        tokenizer_2=_clip_tokenizer(),
    )


def tiny_ltx_video_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """An LTX-Video pipeline: a T5 text encoder, 1x1 patches, the LTX VAE."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    torch.manual_seed(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=32,
    )
    transformer = cast_like_from_pretrained(realistic_init(transformer, seed), dtype).eval()
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=cast_like_from_pretrained(vae, dtype),
        text_encoder=_t5(dtype, seed),
        tokenizer=tiny_tokenizer(),
        transformer=transformer,
    )


def tiny_flux_pipeline(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A Flux pipeline (images): dual- and single-stream blocks, CLIP and T5 text encoders, a 2D VAE."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    transformer = cast_like_from_pretrained(realistic_init(transformer, seed), dtype).eval()
    vae = AutoencoderKL(
        sample_size=32,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval()
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=_clip_text(dtype, seed),
        text_encoder_2=_t5(dtype, seed),
        tokenizer=_clip_tokenizer(),
        tokenizer_2=tiny_tokenizer(),
        transformer=transformer,
        vae=cast_like_from_pretrained(vae, dtype),
    )

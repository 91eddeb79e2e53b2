"""Tiny Wan and CogVideoX models and pipelines built locally with random weights (no downloads).

Used by the demo, the tests and the benchmarks' smoke runs. Weights are drawn at a realistic scale (std about
1/sqrt(fan_in)), so quantization behaves as on real checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tritoff.convert import cast_like_from_pretrained

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

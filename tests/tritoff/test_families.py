"""Every pipeline family, built tiny and locally, equals its dequantized twin bit for bit in every mode.

One pipeline per family runs through four modes in turn (``enable`` again re-plans): ``group`` and ``leaf`` at the
smallest budget each accepts (the blocks streamed), ``model`` and ``auto`` at theirs. The first run decodes frames;
the others stop at the latents (what the mode changes is the denoising), compared as the last step left them.
Transformers of more families (QwenImage, Chroma, SkyReels-V2, HunyuanVideo 1.5, SD3) are compared on their own.
"""

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import tritoff
from tritoff import tiny
from tritoff.planner import BudgetError

from .helpers import dequantize_in_place, dequantized_pipeline, lora_state_dict, tiny_transformer

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

IMAGE = Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype("uint8"))
BASE = dict(prompt="a cat", negative_prompt="blurry", num_inference_steps=2, max_sequence_length=16)
VIDEO = dict(BASE, height=16, width=16, num_frames=5)

FAMILIES = {
    "wan21-t2v": (tiny.tiny_wan_pipeline, VIDEO),
    "wan21-i2v": (tiny.tiny_wan_i2v_pipeline, dict(VIDEO, image=IMAGE)),
    "wan-vace": (tiny.tiny_wan_vace_pipeline, VIDEO),
    # the boundary falls inside 4 steps: both experts run
    "wan22-a14b": (lambda: tiny.tiny_wan_pipeline(two_experts=True), dict(VIDEO, num_inference_steps=4)),
    "wan22-ti2v-5b": (tiny.tiny_wan22_ti2v_pipeline, dict(VIDEO, image=IMAGE, height=32, width=32)),
    "cogvideox": (tiny.tiny_cogvideox_pipeline, dict(VIDEO, num_frames=9)),
    # learned positional embeddings: the configured sample size (8x8 latents)
    "cogvideox-i2v": (tiny.tiny_cogvideox_i2v_pipeline, dict(VIDEO, image=IMAGE, height=64, width=64, num_frames=9)),
    "hunyuan-video": (
        tiny.tiny_hunyuan_video_pipeline,
        dict(VIDEO, negative_prompt=None, prompt_template={"template": "{}", "crop_start": 0}),
    ),
    "ltx-video": (tiny.tiny_ltx_video_pipeline, dict(VIDEO, height=32, width=32, num_frames=9)),
    "flux": (tiny.tiny_flux_pipeline, dict(BASE, negative_prompt=None, height=16, width=16)),
}


def _run(pipe, call, output_type="pt"):
    """(frames or images, the latents the last step left) for a fixed seed."""
    seen = {}

    def keep(pipe, step, timestep, kwargs):
        seen["latents"] = kwargs["latents"].clone()
        return kwargs

    out = pipe(
        **call,
        output_type=output_type,
        callback_on_step_end=keep,
        generator=torch.Generator().manual_seed(0),
    )
    return (getattr(out, "frames", None) if hasattr(out, "frames") else out.images), seen["latents"]


def _minimum(pipe, mode) -> int:
    with pytest.raises(BudgetError) as info:
        tritoff.enable(pipe, mode=mode, budget=1000, reserve=1000, progress=False, kernels="reference")
    return info.value.minimum


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_equals_the_dequantized_pipeline_in_every_mode(family):
    factory, call = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = dequantized_pipeline(factory)
        reference.set_progress_bar_config(disable=True)
        expected, expected_latents = _run(reference, call)
        del reference
        pipe = factory()
    pipe.set_progress_bar_config(disable=True)
    components = [n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)]
    for mode in ("group", "leaf", "model", "auto"):
        budget = _minimum(pipe, mode)
        engine = tritoff.enable(pipe, mode=mode, budget=budget, reserve=1000, progress=False, kernels="reference")
        frames, latents = _run(pipe, call, "pt" if mode == "group" else "latent")
        assert torch.equal(latents, expected_latents), mode
        stats = engine.stats
        denoisers = [n for n in components if n.startswith("transformer")]
        if mode in ("group", "leaf"):
            # each phase has the whole budget, and at the pipeline's smallest one the binding phase may be another
            # (the tiny VAE moves whole): a denoiser streams only the blocks its phase has no room to keep
            for n in denoisers:
                phase, runtime = engine.plan.phases[n], engine.manager.components[n]
                streamed = [g.packed_bytes for g in runtime.blocks if g.tier == "stream"]
                assert not streamed or phase.planned_bytes + min(streamed) > budget, (mode, n)
        if mode == "group":
            assert torch.equal(frames, expected)
            # every component ran, and whatever streamed did so in the traced order after the first call
            assert all(stats["components"][n]["calls"] > 0 for n in components)
            assert stats["total"]["sync_onloads"] == 0
    tritoff.disable(pipe)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_lora_loaded_and_fused_after_enable(family):
    """A LoRA on every attention projection, loaded after enable while every block streams, then fused into the
    packs: equal to the dequantized pipeline with the same LoRA (fused, then quantized again like the packs)."""
    factory, call = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = dequantized_pipeline(factory)
        reference.set_progress_bar_config(disable=True)
        lora = lora_state_dict(reference.transformer)
        _, plain = _run(reference, call, "latent")
        reference.load_lora_weights(lora, adapter_name="style")
        _, expected = _run(reference, call, "latent")
        reference.fuse_lora(components=["transformer"])
        dequantize_in_place(reference.transformer)
        _, expected_fused = _run(reference, call, "latent")
        del reference
        pipe = factory()
    assert torch.isfinite(expected).all() and not torch.equal(expected, plain)  # the LoRA changes the result
    pipe.set_progress_bar_config(disable=True)
    engine = tritoff.enable(
        pipe, mode="group", budget=_minimum(pipe, "group"), reserve=1000, progress=False, kernels="reference"
    )
    pipe.load_lora_weights(lora, adapter_name="style")
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(_run(pipe, call, "latent")[1], expected_fused)
    assert engine.stats["requantized_weights"] > 0
    tritoff.disable(pipe)


def _mask(batch, tokens, padded, dtype=torch.long):
    mask = torch.ones(batch, tokens, dtype=dtype)
    mask[:, -padded:] = 0
    return mask


def _randn(g, *shape):
    return torch.randn(*shape, generator=g).bfloat16()


def _qwen_image(g, h, w, tokens):
    return dict(
        hidden_states=_randn(g, 1, h * w, 16),
        encoder_hidden_states=_randn(g, 1, tokens, 32),
        encoder_hidden_states_mask=_mask(1, tokens, 2),
        timestep=torch.full((1,), 0.7).bfloat16(),
        img_shapes=[[(1, h, w)]],
    )


def _chroma(g, h, w, tokens):
    return dict(
        hidden_states=_randn(g, 1, h * w, 8),
        encoder_hidden_states=_randn(g, 1, tokens, 32),
        timestep=torch.full((1,), 0.7),
        img_ids=torch.cartesian_prod(torch.tensor([0]), torch.arange(h), torch.arange(w)).float(),
        txt_ids=torch.zeros(tokens, 3),
        attention_mask=torch.cat([_mask(1, tokens, 2, torch.bool), torch.ones(1, h * w, dtype=torch.bool)], 1),
    )


def _skyreels(g, frames, size, forcing):
    timestep = torch.tensor([[900.0 - 100 * i for i in range(frames)]]) if forcing else torch.full((1,), 700.0)
    return dict(
        hidden_states=_randn(g, 1, 4, frames, size, size),
        encoder_hidden_states=_randn(g, 1, 8, 32),
        timestep=timestep,
        fps=[1],
        enable_diffusion_forcing=forcing,
    )


def _hunyuan_video_15(g, frames, size, tokens):
    return dict(
        hidden_states=_randn(g, 1, 4, frames, size, size),
        timestep=torch.full((1,), 700.0).bfloat16(),
        encoder_hidden_states=_randn(g, 1, tokens, 32),
        encoder_attention_mask=_mask(1, tokens, 2),
        encoder_hidden_states_2=_randn(g, 1, 6, 32),
        encoder_attention_mask_2=_mask(1, 6, 1),
        image_embeds=_randn(g, 1, 5, 32),
    )


def _sd3(g, size, skip_layers):
    return dict(
        hidden_states=_randn(g, 1, 4, size, size),
        encoder_hidden_states=_randn(g, 1, 8, 32),
        pooled_projections=_randn(g, 1, 16),
        timestep=torch.full((1,), 700.0),
        skip_layers=skip_layers,
    )


# transformer families beyond the pipelines above (helpers.TINY_TRANSFORMERS): two calls of other shapes or options
TRANSFORMER_CALLS = {
    # modulation (img_mod, txt_mod) kept in bf16 beside each block's fp8 linears
    "qwen-image": lambda g: [_qwen_image(g, 4, 4, 8), _qwen_image(g, 6, 4, 10)],
    # a guidance network outside the blocks makes every block's modulation: kept in bf16
    "chroma": lambda g: [_chroma(g, 4, 4, 8), _chroma(g, 6, 4, 10)],
    # the fps projection into the timestep's modulation, and diffusion forcing (a timestep per frame)
    "skyreels-v2": lambda g: [_skyreels(g, 2, 4, False), _skyreels(g, 3, 4, True)],
    # one layer of its second text embedder outweighs every block: kept resident in leaf mode
    "hunyuan-video-1.5": lambda g: [_hunyuan_video_15(g, 2, 4, 8), _hunyuan_video_15(g, 3, 4, 10)],
    # blocks of three sizes (dual attention, a last one without context output), and a call skipping a streamed one
    # (skip layer guidance): its slot is reused
    "sd3": lambda g: [_sd3(g, 8, None), _sd3(g, 8, [0, 2])],
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("family", list(TRANSFORMER_CALLS))
def test_transformer_family_equals_its_dequantized_twin_at_the_smallest_budgets(family):
    """In group and leaf mode at their smallest budgets (blocks streamed; in a tiny model whose blocks differ in size
    the largest may be kept resident), the transformer computes what its dequantized twin does, for two calls of other
    shapes or options."""
    calls = TRANSFORMER_CALLS[family](torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = dequantize_in_place(tiny_transformer(family))
        expected = [reference(**call).sample for call in calls]
        assert not torch.equal(expected[0], tiny_transformer(family)(**calls[0]).sample)  # fp8 changes the result
    model = tiny_transformer(family)
    for mode in ("group", "leaf"):
        engine = tritoff.enable(model, mode=mode, budget=_minimum(model, mode), reserve=1000, progress=False)
        blocks = engine.manager.components["model"].blocks
        assert sum(g.tier == "stream" for g in blocks) >= (1 if mode == "group" else len(blocks) // 2), mode
        with torch.no_grad():
            for call, want in zip(calls, expected, strict=True):
                assert torch.equal(model(**call).sample, want), mode
        tritoff.disable(model)

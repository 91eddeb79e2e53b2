"""Every pipeline family, built tiny and locally, equals its dequantized twin bit for bit in every mode.

One pipeline per family runs through four modes in turn (``enable`` again re-plans): ``group`` and ``leaf`` at the
smallest budget each accepts (every block streamed), ``model`` and ``auto`` at theirs. The first run decodes frames;
the others stop at the latents (what the mode changes is the denoising), compared as the last step left them.
"""

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import tritoff
from tritoff import tiny
from tritoff.planner import BudgetError

from .helpers import dequantize_in_place, dequantized_pipeline, lora_state_dict

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


def _tiny_qwen_image():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    with warnings.catch_warnings():  # "modules that should be kept in float32: []"
        warnings.simplefilter("ignore")
        return tiny.realistic_init(model).to(torch.bfloat16).eval()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_qwen_image_blocks_with_their_modulation_kept_bf16_equal_the_dequantized_twin():
    """QwenImage keeps each block's modulation (img_mod, txt_mod) in bf16 beside its fp8 linears: every block
    streamed, in group and leaf mode, computes what the dequantized model does, at two image sizes."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for h, w, tokens in ((4, 4, 8), (6, 4, 10)):
        mask = torch.ones(1, tokens, dtype=torch.long)
        mask[:, -2:] = 0
        calls.append(
            dict(
                hidden_states=torch.randn(1, h * w, 16, generator=g).bfloat16(),
                encoder_hidden_states=torch.randn(1, tokens, 32, generator=g).bfloat16(),
                encoder_hidden_states_mask=mask,
                timestep=torch.full((1,), 0.7).bfloat16(),
                img_shapes=[[(1, h, w)]],
            )
        )
    reference = dequantize_in_place(_tiny_qwen_image())
    with torch.no_grad():
        expected = [reference(**call).sample for call in calls]
    assert not torch.equal(expected[0], _tiny_qwen_image()(**calls[0]).sample)  # fp8 changes the result
    model = _tiny_qwen_image()
    for mode in ("group", "leaf"):
        engine = tritoff.enable(model, mode=mode, budget=_minimum(model, mode), reserve=1000, progress=False)
        assert all(g.tier == "stream" for g in engine.manager.components["model"].blocks), mode
        with torch.no_grad():
            for call, want in zip(calls, expected, strict=True):
                assert torch.equal(model(**call).sample, want), mode
        tritoff.disable(model)

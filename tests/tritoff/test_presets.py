"""tritoff/presets.py: the preset pipelines are the published architectures, on the meta device, in the dtypes
``from_pretrained(torch_dtype=torch.bfloat16)`` gives them; ``as_loaded`` casts as loading does."""

import functools
import re

import pytest
import torch

from tritoff.presets import PRESETS, VAE_SHAPES, as_loaded, build_preset, vae_shapes
from tritoff.tiny import tiny_umt5, tiny_wan_transformer

# parameters of the published checkpoints: Wan2.1 14B DiT, UMT5-XXL encoder (11.4 GB in bf16), Wan VAE (508 MB in
# fp32); CogVideoX-5B DiT (11.1 GB in bf16), T5-v1.1-XXL encoder (9.5 GB), CogVideoX VAE (431 MB in bf16)
WAN_DIT, UMT5_XXL, WAN_VAE = 14_288_491_584, 5_680_910_336, 126_892_531
COG_DIT, T5_XXL, COG_VAE = 5_570_283_072, 4_762_310_656, 215_583_907
# Wan 2.1 I2V-14B's DiT (32.8 GB in bf16: the image embedder and each block's added key/value projections), CLIP
# ViT-H/14's vision tower with its projection (632M); Wan 2.2 I2V-A14B's experts: the T2V DiT with 36 channels in
WAN_I2V_DIT, CLIP_H14, WAN22_I2V_DIT = 16_394_878_784, 632_076_800, 14_288_901_184
# Wan 2.1 T2V-1.3B's DiT (5.68 GB in fp32), Wan 2.2 TI2V-5B's DiT (20.0 GB in fp32) and Wan 2.2's VAE (2.82 GB in
# fp32): counted from the published configs, the checkpoint files' sizes as a cross-check
WAN_1_3B_DIT, WAN_5B_DIT, WAN22_VAE = 1_418_996_800, 4_999_787_712, 704_688_668

EXPECTED = {
    "wan2.1-t2v-1.3b": (
        "wan",
        {"text_encoder": ("UMT5EncoderModel", UMT5_XXL), "transformer": ("WanTransformer3DModel", WAN_1_3B_DIT)},
        ("AutoencoderKLWan", WAN_VAE),
    ),
    "wan2.1-t2v-14b": (
        "wan",
        {"text_encoder": ("UMT5EncoderModel", UMT5_XXL), "transformer": ("WanTransformer3DModel", WAN_DIT)},
        ("AutoencoderKLWan", WAN_VAE),
    ),
    "wan2.2-t2v-a14b": (
        "wan",
        {
            "text_encoder": ("UMT5EncoderModel", UMT5_XXL),
            "transformer": ("WanTransformer3DModel", WAN_DIT),
            "transformer_2": ("WanTransformer3DModel", WAN_DIT),
        },
        ("AutoencoderKLWan", WAN_VAE),
    ),
    "wan2.1-i2v-14b": (
        "wan",
        {
            "text_encoder": ("UMT5EncoderModel", UMT5_XXL),
            "image_encoder": ("CLIPVisionModelWithProjection", CLIP_H14),
            "transformer": ("WanTransformer3DModel", WAN_I2V_DIT),
        },
        ("AutoencoderKLWan", WAN_VAE),
    ),
    "wan2.2-i2v-a14b": (
        "wan",
        {
            "text_encoder": ("UMT5EncoderModel", UMT5_XXL),
            "transformer": ("WanTransformer3DModel", WAN22_I2V_DIT),
            "transformer_2": ("WanTransformer3DModel", WAN22_I2V_DIT),
        },
        ("AutoencoderKLWan", WAN_VAE),
    ),
    "wan2.2-ti2v-5b": (
        "wan",
        {"text_encoder": ("UMT5EncoderModel", UMT5_XXL), "transformer": ("WanTransformer3DModel", WAN_5B_DIT)},
        ("AutoencoderKLWan", WAN22_VAE),
    ),
    "cogvideox-5b": (
        "cogvideox",
        {"text_encoder": ("T5EncoderModel", T5_XXL), "transformer": ("CogVideoXTransformer3DModel", COG_DIT)},
        ("AutoencoderKLCogVideoX", COG_VAE),
    ),
}


_build = functools.cache(build_preset)  # about a second each: built once for the whole file


@pytest.fixture(params=list(PRESETS))
def preset(request):
    return request.param, _build(request.param)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_an_unknown_model_is_refused_with_the_preset_names():
    message = (
        "unknown model 'wan2.1-t2v-7b': give a local diffusers directory or one of wan2.1-t2v-1.3b, wan2.1-t2v-14b, "
        "wan2.2-t2v-a14b, wan2.1-i2v-14b, wan2.2-i2v-a14b, wan2.2-ti2v-5b, cogvideox-5b"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_preset("wan2.1-t2v-7b")


def test_a_preset_has_its_family_components_and_published_parameter_counts(preset):
    name, (family, components) = preset
    expected_family, models, vae = EXPECTED[name]
    assert family == expected_family
    assert list(components) == [*models, "vae"]
    for component, (cls, numel) in {**models, "vae": vae}.items():
        module = components[component]
        assert type(module).__name__ == cls, component
        assert _numel(module) == numel, component


def test_a_preset_is_built_on_the_meta_device_in_eval_mode(preset):
    _, (_, components) = preset
    for component, module in components.items():
        assert all(p.is_meta for p in module.parameters()), component
        assert all(b.is_meta for b in module.buffers()), component
        assert not module.training and not any(m.training for m in module.modules()), component


def test_a_preset_is_bf16_except_the_modules_diffusers_keeps_in_fp32(preset):
    name, (_, components) = preset
    for component, module in components.items():
        fp32 = {n for n, p in module.named_parameters() if p.dtype == torch.float32}
        other = {p.dtype for p in module.parameters() if p.dtype != torch.float32}
        assert other == {torch.bfloat16}, component
        if component.startswith("transformer") and name.startswith("wan"):
            # the time embedder's 2 Linear layers, the output's scale_shift_table, and in each block its
            # scale_shift_table and the cross-attention norm (norm2, an affine LayerNorm); Wan 2.1 I2V's image
            # embedder also keeps its two affine LayerNorms
            image = 4 if name == "wan2.1-i2v-14b" else 0
            assert len(fp32) == 4 + 1 + len(module.blocks) * 3 + image, component
            assert all(
                n.startswith("condition_embedder.time_embedder.")
                or (image and re.fullmatch(r"condition_embedder\.image_embedder\.norm[12]\.(weight|bias)", n))
                or n.endswith("scale_shift_table")
                or re.fullmatch(r"blocks\.\d+\.norm2\.(weight|bias)", n)
                for n in fp32
            ), component
        else:  # the T5 encoders keep 'wo' in fp32 only for fp16; CLIP, the VAEs and CogVideoX keep nothing
            assert fp32 == set(), component


def test_the_text_encoders_input_table_is_tied_to_the_shared_one(preset):
    _, (_, components) = preset
    encoder = components["text_encoder"]
    assert encoder.encoder.embed_tokens.weight is encoder.shared.weight  # one parameter, counted once


def test_the_published_shapes(preset):
    name, (_, components) = preset
    dit, text = components["transformer"], components["text_encoder"]
    if name.startswith("wan"):
        # blocks, heads x 128, the feed-forward's width
        blocks, width, ffn = {"wan2.1-t2v-1.3b": (30, 1536, 8960), "wan2.2-ti2v-5b": (30, 3072, 14336)}.get(
            name, (40, 5120, 13824)
        )
        assert len(dit.blocks) == blocks
        assert dit.blocks[0].attn1.to_q.weight.shape == (width, width)
        assert dit.blocks[0].ffn.net[0].proj.weight.shape == (ffn, width)
        assert text.shared.weight.shape == (256384, 4096)
    else:
        assert len(dit.transformer_blocks) == 42
        assert dit.transformer_blocks[0].attn1.to_q.weight.shape == (3072, 3072)  # 48 heads x 64
        assert text.shared.weight.shape == (32128, 4096)
    assert len(text.encoder.block) == 24


@pytest.mark.parametrize("name", ["wan2.2-t2v-a14b", "wan2.2-i2v-a14b"])
def test_wan22_has_two_distinct_experts(name):
    _, components = _build(name)
    first, second = components["transformer"], components["transformer_2"]
    assert first is not second
    assert not {id(p) for p in first.parameters()} & {id(p) for p in second.parameters()}


@pytest.mark.parametrize("name", ["wan2.1-i2v-14b", "wan2.2-i2v-a14b"])
def test_the_image_to_video_shapes(name):
    # the latents, the mask and the image's latents concatenated: 16 + 4 + 16 channels in, 16 out; Wan 2.1 also
    # attends to CLIP ViT-H/14's 1280-wide hidden states through each block's added key/value projections
    _, components = _build(name)
    dit = components["transformer"]
    assert dit.patch_embedding.weight.shape == (5120, 36, 1, 2, 2) and dit.proj_out.weight.shape == (64, 5120)
    if name == "wan2.1-i2v-14b":
        attention = dit.blocks[0].attn2
        assert attention.add_k_proj.weight.shape == attention.add_v_proj.weight.shape == (5120, 5120)
        assert dit.condition_embedder.image_embedder.ff.net[0].proj.weight.shape == (1280, 1280)
        vision = components["image_encoder"].vision_model
        assert len(vision.encoder.layers) == 32 and vision.embeddings.position_embedding.weight.shape == (257, 1280)
    else:
        assert dit.blocks[0].attn2.add_k_proj is None and "image_encoder" not in components


# -- as_loaded on real (tiny) modules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,wo_dtype",
    [
        pytest.param(torch.float16, torch.float32, id="fp16-keeps-wo-fp32"),
        pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-casts-wo"),
    ],
)
def test_transformers_keep_their_fp32_modules_only_for_fp16(dtype, wo_dtype):
    model = tiny_umt5(torch.float32, seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert as_loaded(model, dtype) is model
    for name, param in model.named_parameters():
        wanted = wo_dtype if name.endswith(".wo.weight") else dtype
        assert param.dtype == wanted, name
        assert torch.equal(param, before[name].to(wanted)), name  # a plain cast: no value changes beyond it


def test_diffusers_models_keep_their_fp32_modules_in_any_dtype():
    model = tiny_wan_transformer(torch.float32, seed=2, num_layers=3)
    as_loaded(model, torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert len(fp32) == 4 + 1 + 3 * 3  # time embedder, scale_shift_table, and 3 per block
    assert {p.dtype for n, p in model.named_parameters() if n not in fp32} == {torch.bfloat16}
    assert all(b.dtype == torch.float32 for b in model.buffers())  # buffers are not parameters: left alone


def test_untied_embedding_tables_are_tied_as_loading_ties_them():
    model = tiny_umt5(torch.float32, seed=4)
    model.encoder.embed_tokens.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight))  # untied, different
    as_loaded(model, torch.bfloat16)
    assert model.encoder.embed_tokens.weight is model.shared.weight
    assert model.shared.weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 200]])
    torch.testing.assert_close(model.encoder.embed_tokens(ids), model.shared(ids), rtol=0, atol=0)


def test_a_shared_parameter_stays_one_parameter_and_requires_grad_is_kept():
    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Linear(8, 4))
    model[3].weight.requires_grad_(False)
    model.train()
    as_loaded(model, torch.float16)
    assert model[0] is model[2] and model[0].weight is model[2].weight
    assert model[0].weight.dtype == torch.float16 and model[3].bias.dtype == torch.float16
    assert model[0].weight.requires_grad and not model[3].weight.requires_grad
    assert isinstance(model[3].weight, torch.nn.Parameter)
    assert not model.training
    assert len(list(model.parameters())) == 4  # the shared Linear's two, the last Linear's two


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_shape_keys_the_command_line_checks_are_those_of_the_presets_vae(name):
    # tritoff plan checks a preset's frames, height and width against VAE_SHAPES before torch is imported
    from tritoff.shapes import spatial_multiple, temporal_multiple

    family, components = _build(name)
    config, transformer = dict(components["vae"].config), PRESETS[name].transformer
    shapes = vae_shapes(name)
    shape_keys = {k: v for k, v in shapes.items() if k != "_class_name"}
    assert type(components["vae"]).__name__ == shapes["_class_name"] == VAE_SHAPES[family]["_class_name"]
    assert {key: config[key] for key in shape_keys} == {k: type(config[k])(v) for k, v in shape_keys.items()}
    assert temporal_multiple(shape_keys) == temporal_multiple(config) == 4
    # Wan 2.2's VAE downscales 16x: with the transformer's 2x2 patches, multiples of 32
    multiple = 32 if name == "wan2.2-ti2v-5b" else 16
    assert spatial_multiple(shape_keys, transformer) == spatial_multiple(config, transformer) == multiple

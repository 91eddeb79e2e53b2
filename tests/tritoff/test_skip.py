"""tritoff/skip.py: exactly which tensors of tiny Wan and CogVideoX transformers are quantized."""

import pytest
import torch

from tritoff.skip import SkipRules
from tritoff.tiny import tiny_cogvideox_transformer, tiny_wan_transformer

from .helpers import tiny_transformer

ATTN = ("to_q", "to_k", "to_v", "to_out.0")


def _expected(prefix, blocks, ffn):
    names = set()
    for i in range(blocks):
        for attn in ("attn1", "attn2"):
            names |= {f"{prefix}.{i}.{attn}.{p}.weight" for p in ATTN}
        names |= {f"{prefix}.{i}.{ffn}.net.0.proj.weight", f"{prefix}.{i}.{ffn}.net.2.weight"}
    return names


def test_wan_quantizes_attention_and_ffn_linears_only():
    model = tiny_wan_transformer()
    quantized = SkipRules.for_model(model).quantized_names(model)
    assert quantized == _expected("blocks", 2, "ffn")
    kept = {n for n, _ in model.named_parameters()} - quantized
    # the conditioning path, norms, modulation tables, patch embedding and output projection all stay
    for name in (
        "patch_embedding.weight",
        "condition_embedder.time_embedder.linear_1.weight",
        "condition_embedder.time_proj.weight",
        "condition_embedder.text_embedder.linear_1.weight",
        "scale_shift_table",
        "blocks.0.scale_shift_table",
        "blocks.0.norm2.weight",
        "blocks.0.attn1.norm_q.weight",
        "blocks.0.attn1.to_q.bias",
        "proj_out.weight",
    ):
        assert name in kept, name


def test_cogvideox_quantizes_attention_and_ff_linears_only():
    model = tiny_cogvideox_transformer()
    quantized = SkipRules.for_model(model).quantized_names(model)
    expected = set()
    for i in range(2):
        expected |= {f"transformer_blocks.{i}.attn1.{p}.weight" for p in ATTN}
        expected |= {f"transformer_blocks.{i}.ff.net.0.proj.weight", f"transformer_blocks.{i}.ff.net.2.weight"}
    assert quantized == expected
    kept = {n for n, _ in model.named_parameters()} - quantized
    for name in (
        "patch_embed.proj.weight",
        "time_embedding.linear_1.weight",
        "transformer_blocks.0.norm1.linear.weight",
        "norm_out.linear.weight",
        "proj_out.weight",
    ):
        assert name in kept, name


def test_fp32_modules_stay_fp32():
    model = tiny_wan_transformer(torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert "condition_embedder.time_embedder.linear_1.weight" in fp32 and "blocks.1.norm2.weight" in fp32
    assert not fp32 & SkipRules.for_model(model).quantized_names(model)


def test_user_patterns_add_to_the_defaults():
    model = tiny_wan_transformer()
    rules = SkipRules.for_model(model, extra=[r"ffn\."])
    assert rules.quantized_names(model) == {n for n in _expected("blocks", 2, "ffn") if ".ffn." not in n}


def test_bad_user_pattern_is_refused():
    import pytest

    with pytest.raises(ValueError, match="regular expression"):
        SkipRules.for_model(tiny_wan_transformer(), extra=["(unclosed"])


def test_one_string_is_one_pattern_and_non_strings_are_refused():
    import pytest

    model = tiny_wan_transformer()
    # "ffn\." as a string once meant one pattern per character, which skipped every weight
    assert SkipRules.for_model(model, extra=r"ffn\.").quantized_names(model) == SkipRules.for_model(
        model, extra=[r"ffn\."]
    ).quantized_names(model)
    for bad in (5, [r"ffn\.", 5]):
        with pytest.raises(ValueError, match="a string or a list"):
            SkipRules.for_model(model, extra=bad)
    for empty in ("", [" "]):  # an empty regex matches every module name: the whole model would stay unquantized
        with pytest.raises(ValueError, match="empty pattern, which matches every module"):
            SkipRules.for_model(model, extra=empty)


def test_integer_bool_and_fp8_weights_keep_their_dtype():
    model = tiny_wan_transformer()
    weights = {
        "blocks.0.attn1.to_q": torch.ones(model.blocks[0].attn1.to_q.weight.shape, dtype=torch.int8),
        "blocks.0.attn1.to_k": torch.ones(model.blocks[0].attn1.to_k.weight.shape, dtype=torch.bool),
        "blocks.0.attn1.to_v": torch.ones(model.blocks[0].attn1.to_v.weight.shape, dtype=torch.float8_e4m3fn),
    }
    for name, weight in weights.items():
        model.get_submodule(name).weight = torch.nn.Parameter(weight, requires_grad=False)
    quantized = SkipRules.for_model(model).quantized_names(model)
    assert quantized == _expected("blocks", 2, "ffn") - {f"{name}.weight" for name in weights}


def _kept_and_quantized(family):
    model = tiny_transformer(family)
    quantized = SkipRules.for_model(model).quantized_names(model)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return linears - quantized, quantized


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_modulation_guidance_and_embedders_of_other_families_stay():
    # QwenImage's per-block modulation (img_mod, txt_mod: a sixth of each block's weights) by name
    kept, quantized = _kept_and_quantized("qwen-image")
    assert {f"transformer_blocks.{i}.{m}_mod.1.weight" for i in range(2) for m in ("img", "txt")} <= kept
    assert "transformer_blocks.0.img_mlp.net.0.proj.weight" in quantized
    assert "transformer_blocks.0.attn.to_q.weight" in quantized
    # Chroma's distilled guidance layer makes every block's modulation; its input projections are embedders
    kept, quantized = _kept_and_quantized("chroma")
    guidance = {n for n in kept | quantized if n.startswith("distilled_guidance_layer.")}
    assert len(guidance) == 6 and guidance <= kept
    assert {"x_embedder.weight", "context_embedder.weight"} <= kept
    assert "single_transformer_blocks.0.proj_mlp.weight" in quantized
    # LTX-2's cross-attention gates are adaptive norms named *_gate: kept by their class
    kept, quantized = _kept_and_quantized("ltx-2")
    for name in ("av_cross_attn_video_a2v_gate", "av_cross_attn_audio_v2a_gate", "av_cross_attn_video_scale_shift"):
        assert f"{name}.linear.weight" in kept, name
    assert {"audio_proj_in.weight", "audio_proj_out.weight"} <= kept
    assert "transformer_blocks.0.attn1.to_q.weight" in quantized


def test_a_skip_pattern_that_keeps_nothing_unquantized_is_warned_about(tmp_path):
    # a misspelt pattern ("atn1"), one naming the module above the layers ("attn1$") or one matching only a component
    # kept in its own dtype ("decoder": the VAE) keeps nothing unquantized: enable and convert say so, naming it; one
    # that keeps layers ("FFN", case-insensitively; ".*" on a lone layer) says nothing
    import warnings

    import tritoff
    from tritoff.convert import convert_pipeline
    from tritoff.tiny import tiny_wan_pipeline
    from tritoff.warn import TritoffWarning

    def warned(action) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            action()
        return [str(w.message) for w in caught if issubclass(w.category, TritoffWarning) and "skip" in str(w.message)]

    pipe = tiny_wan_pipeline()
    enable = dict(budget="1GB", progress=False, kernels="reference")
    messages = warned(lambda: tritoff.enable(pipe, skip=["atn1", "FFN", "attn1$", "decoder"], **enable))
    assert [m.split(" keeps")[0] for m in messages] == [
        "skip pattern 'atn1'",
        "skip pattern 'attn1$'",
        "skip pattern 'decoder'",
    ]
    assert messages[0] == (
        "skip pattern 'atn1' keeps nothing unquantized: it matches none of the quantized layers of text_encoder, "
        "transformer (names such as 'blocks.0.attn1.to_k')"
    )
    assert warned(lambda: tritoff.enable(pipe, **enable)) == []  # enabling again: the same patterns, said once
    tritoff.disable(pipe)
    assert warned(lambda: tritoff.enable(pipe.transformer, skip="ffn", **enable)) == []
    tritoff.disable(pipe.transformer)
    layer = torch.nn.Linear(16, 16).to(torch.bfloat16)
    assert warned(lambda: tritoff.enable(layer, skip=".*", **enable)) == []
    tritoff.disable(layer)
    pipe.save_pretrained(tmp_path / "pipe")
    [message] = warned(lambda: convert_pipeline(str(tmp_path / "pipe"), str(tmp_path / "store"), skip=("atn1",)))
    assert message.startswith("skip pattern 'atn1' keeps nothing unquantized")

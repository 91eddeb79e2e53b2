"""tritoff/preflight.py: what enable refuses about its target, each in one line, before anything changes."""

import types

import pytest
import torch

import tritoff
from tritoff import preflight

from .helpers import Stack, enable_at_minimum, stack

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def _one_line(call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_the_components_of_a_module_a_pipeline_and_a_compiled_module():
    model = stack()
    assert preflight.components_of(model) == {"model": model}
    pipe = types.SimpleNamespace(components={"transformer": model, "scheduler": object(), "tokenizer": None})
    assert preflight.components_of(pipe) == {"transformer": model}  # only the modules
    compiled = torch.compile(model)
    assert preflight.components_of(compiled)["model"] is model  # tritoff manages, and hooks, the module itself
    assert preflight.wrapped_components(compiled)["model"] is compiled


def test_what_is_neither_a_pipeline_nor_a_module_is_refused():
    _one_line(lambda: preflight.components_of(object(), "disable"), TypeError, "tritoff.disable needs a diffusers")
    empty = types.SimpleNamespace(components={"scheduler": object()})
    _one_line(lambda: preflight.components_of(empty), ValueError, "this pipeline has no model components")


def test_accelerate_hooks_and_device_maps_are_refused():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = stack()
    add_hook_to_module(model.blocks[1], AlignDevicesHook(execution_device="cpu"))
    _one_line(lambda: preflight.check_no_foreign_hooks({"model": model}), ValueError, "model.blocks.1 carries accel")
    mapped = stack()
    mapped.hf_device_map = {"": "cpu"}
    _one_line(lambda: preflight.check_no_foreign_hooks({"unet": mapped}), ValueError, "unet was loaded with a device")
    preflight.check_no_foreign_hooks({"model": stack()})  # nothing foreign: passes


def test_a_parameter_two_components_share_is_refused():
    first, second = stack(), stack(seed=1)
    second.head.weight = first.head.weight
    _one_line(
        lambda: preflight.check_components({"a": first, "b": second}, None),
        ValueError,
        r"a\.head\.weight and b\.head\.weight are one parameter shared by two components",
    )


def test_weights_on_the_meta_device_and_non_finite_weights_are_refused():
    with torch.device("meta"):
        empty = Stack()
    _one_line(lambda: preflight.check_loaded(empty, "vae"), ValueError, r"vae\.proj_in\.weight is on the meta device")
    model = stack()
    with torch.no_grad():
        model.blocks[2][0].weight[3, 4] = float("nan")
    quantized = {n for n, _ in model.named_parameters()}
    _one_line(
        lambda: preflight.check_finite(model, quantized, "transformer"),
        ValueError,
        r"transformer\.blocks\.2\.0\.weight contains NaN or Inf",
    )
    preflight.check_finite(model, quantized - {"blocks.2.0.weight"}, "transformer")  # skipped: kept as it is


def test_a_module_another_engine_manages_is_named_as_that_engine_names_it():
    model = stack()
    pipe = types.SimpleNamespace(components={"transformer": model})
    tritoff.enable(pipe, budget=10**9, progress=False, kernels="reference")
    try:
        assert preflight.ENGINES and getattr(pipe, preflight.ENGINE_ATTR) in preflight.ENGINES
        assert preflight.managed_elsewhere(model.blocks[0][2]) == "transformer.blocks.0.2"
        assert preflight.managed_elsewhere(stack()) is None
        _one_line(
            lambda: preflight.check_not_managed_elsewhere({"model": model}, None),
            ValueError,
            "is already managed by tritoff through another pipeline or module",
        )
    finally:
        tritoff.disable(pipe)
    assert preflight.managed_elsewhere(model.blocks[0][2]) is None
    preflight.check_not_managed_elsewhere({"model": model}, None)


def test_weights_made_under_inference_mode_are_refused_before_anything_changes():
    with torch.inference_mode():
        model = stack()
    before = {n: p.clone() for n, p in model.named_parameters()}
    _one_line(
        lambda: tritoff.enable(model, budget=10**9, progress=False),
        ValueError,
        r"^model\.proj_in\.weight was made under torch\.inference_mode\(\), whose tensors tritoff cannot manage: load",
    )
    assert not hasattr(model, preflight.ENGINE_ATTR)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _sparse_weight():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().to_sparse())
    return model


def _conjugate_weight():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.complex64))
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().conj())
    return model


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4))),
            r"^model is a TorchScript module, whose compiled code calls no hooks: enable tritoff on the Python module",
        ),
        (
            lambda: torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Linear(4, 4)),
            r"^model.0 is an nn.Embedding with max_norm, which rewrites its table in place at each lookup: set its",
        ),
        (_sparse_weight, r"^model.0.weight is a sparse tensor, and packs hold dense weights: make it dense"),
        (_conjugate_weight, r"^model.0.weight is a conjugate view, which packs cannot hold: resolve it"),
    ],
)
def test_what_packs_cannot_hold_or_hooks_cannot_serve_is_refused_before_anything_changes(make, message):
    # each failed deep inside enable with PyTorch's own error (or, for max_norm, at every call once enabled)
    model = make()
    before = {k: (v.to_dense() if v.layout != torch.strided else v).resolve_conj().clone()
              for k, v in model.state_dict().items()}  # fmt: skip
    _one_line(lambda: tritoff.enable(model, device="cpu", progress=False), ValueError, message)
    after = {
        k: (v.to_dense() if v.layout != torch.strided else v).resolve_conj() for k, v in model.state_dict().items()
    }
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not hasattr(model, "_tritoff_engine") and not getattr(model, "_forward_pre_hooks", None)


def test_a_scripted_module_without_weights_inside_a_block_is_served():
    # its compiled code calls no hooks, but it reads no weight either: only a scripted module holding weights is refused
    model = stack().to(torch.float32)
    for block in model.blocks:
        block.append(torch.jit.script(torch.nn.GELU()))
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
    engine = enable_at_minimum(model, mode="group", device="cpu", storage="bf16", progress=False)
    assert engine.plan.tier_counts("model")["stream"] > 0
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def _upcasting_pipeline(dtype: torch.dtype, force_upcast: bool = True, any_dtype: bool = False):
    """A pipeline with a tiny VAE in ``dtype`` that casts it to float32 to decode when its config asks for it: only a
    float16 one (Stable Video Diffusion, SDXL's text to image), or with ``any_dtype`` whatever its dtype (SDXL's
    image to image, AnimateDiff's video to video). Each class is defined here: enable reads its source."""
    from diffusers import AutoencoderKL, DiffusionPipeline

    class UpcastingPipeline(DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)

        def __call__(self, latents):
            needs_upcasting = self.vae.dtype == torch.float16 and self.vae.config.force_upcast
            if needs_upcasting:
                self.vae.to(dtype=torch.float32)
            return self.vae.decode(latents.to(self.vae.dtype)).sample

    class AnyDtypeUpcastingPipeline(UpcastingPipeline):
        def __call__(self, latents):
            if self.vae.config.force_upcast:
                self.vae.to(dtype=torch.float32)
            return self.vae.decode(latents.to(self.vae.dtype)).sample

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4, force_upcast=force_upcast)
    return (AnyDtypeUpcastingPipeline if any_dtype else UpcastingPipeline)(vae.to(dtype).eval())


@pytest.mark.parametrize("dtype, any_dtype", [(torch.float16, False), (torch.float16, True), (torch.bfloat16, True)])
def test_a_vae_the_pipeline_would_upcast_is_refused_before_anything_changes(dtype, any_dtype):
    # the pipeline's own vae.to(float32) was refused in the middle of its call (after the denoising loop in SDXL's)
    pipe = _upcasting_pipeline(dtype, any_dtype=any_dtype)
    before = {n: p.clone() for n, p in pipe.vae.named_parameters()}
    kind = str(dtype).removeprefix("torch.")
    _one_line(
        lambda: tritoff.enable(pipe, device="cpu", progress=False),
        ValueError,
        rf"^vae is {kind} with force_upcast=True in its config, so \w*UpcastingPipeline casts it to float32 around its "
        r"vae calls, .*: call pipe\.vae\.register_to_config\(force_upcast=False\) before enable .*float32 vae$",
    )
    assert not hasattr(pipe, preflight.ENGINE_ATTR) and not pipe.vae._forward_pre_hooks
    assert all(torch.equal(p, before[n]) and p.dtype == dtype for n, p in pipe.vae.named_parameters())


@pytest.mark.parametrize(
    "dtype, force_upcast, any_dtype",
    [
        (torch.float32, True, True),
        (torch.float16, False, True),
        (torch.bfloat16, True, False),  # SDXL's text to image upcasts only a float16 VAE
    ],
)
def test_a_vae_the_pipeline_does_not_upcast_is_served(dtype, force_upcast, any_dtype):
    latents = torch.randn(1, 4, 4, 4)
    with torch.no_grad():
        expected = _upcasting_pipeline(dtype, force_upcast, any_dtype)(latents)
        pipe = _upcasting_pipeline(dtype, force_upcast, any_dtype)
        tritoff.enable(pipe, device="cpu", progress=False)
        assert torch.equal(pipe(latents), expected)
    # a module, not a pipeline, has no call that casts it
    tritoff.enable(_upcasting_pipeline(torch.float16).vae, device="cpu", progress=False)

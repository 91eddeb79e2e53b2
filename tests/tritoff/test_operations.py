"""Pipeline operations after tritoff.enable: they work, or are refused in one line before anything changes."""

import copy

import pytest
import torch

import tritoff

from .helpers import WAN_CALL, dequantize_in_place, run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

LATENTS = dict(WAN_CALL, num_inference_steps=2, output_type="latent")


@pytest.fixture(scope="module")
def enabled():
    pipe = wan()
    tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")
    return pipe, run(pipe, LATENTS)


def test_moves_that_change_nothing_work(enabled):
    pipe, before = enabled
    device = pipe._tritoff_engine.options.device
    assert pipe.to(device) is pipe
    pipe.to(device.type)
    pipe.transformer.to(device)
    pipe.text_encoder.to(device=device, dtype=torch.bfloat16)
    assert torch.equal(run(pipe, LATENTS), before)


def test_conversions_keeping_device_and_dtype_leave_the_managed_weights_as_tritoff_lays_them_out():
    # a memory format or shared memory rebuilds tensors: a placeholder made dense would take its weight's full size
    pipe = wan()
    tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")
    before = run(pipe, LATENTS)
    weight = pipe.transformer.patch_embedding.weight
    pipe.transformer.to(memory_format=torch.channels_last_3d)
    pipe.vae.to(memory_format=torch.channels_last_3d)
    pipe.vae.share_memory()
    assert pipe.transformer.patch_embedding.weight is weight and weight.is_contiguous()
    assert torch.equal(run(pipe, LATENTS), before)
    pipe.transformer.extra = torch.nn.Linear(4, 4)  # added after enable: not tritoff's, so converted
    pipe.transformer.share_memory()
    assert pipe.transformer.extra.weight.is_shared() and not weight.is_shared()
    del pipe.transformer.extra


def test_a_move_that_changes_nothing_keeps_the_managed_parameters_when_torch_would_replace_them(monkeypatch):
    # with overwrite_module_params_on_conversion, torch wraps every parameter in a new one, even one kept as it is
    pipe = wan()
    tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")
    before = run(pipe, LATENTS)
    weight = pipe.transformer.patch_embedding.weight
    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    pipe.transformer.to(pipe._tritoff_engine.options.device)
    pipe.vae.to(memory_format=torch.channels_last_3d)
    monkeypatch.undo()
    assert pipe.transformer.patch_embedding.weight is weight
    assert torch.equal(run(pipe, LATENTS), before)


@pytest.mark.parametrize(
    "operation,message",
    [
        (lambda p: p.to(torch.float32), "moving or casting text_encoder to torch.float32"),
        (lambda p: p.to("meta"), "moving or casting .* to meta"),
        (lambda p: p.transformer.half(), "moving or casting transformer to torch.float16"),
        (lambda p: p.vae.to(torch.bfloat16), "moving or casting vae to torch.bfloat16"),
        (lambda p: p.enable_model_cpu_offload(), r"enable_model_cpu_offload\(\): tritoff already places"),
        (lambda p: p.enable_sequential_cpu_offload(), r"enable_sequential_cpu_offload\(\): tritoff already"),
        (lambda p: p.enable_group_offload("cpu"), r"enable_group_offload\(\): tritoff already streams"),
        (lambda p: p.transformer.enable_group_offload("cpu"), r"enable_group_offload\(\)"),
        (
            lambda p: p.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn),
            r"enable_layerwise_casting\(\)",
        ),
        (lambda p: p.remove_all_hooks(), r"remove_all_hooks\(\): the hooks on this pipeline are tritoff's"),
        (lambda p: p.transformer.fuse_qkv_projections(), r"call it before tritoff.enable"),
        (lambda p: p.transformer.blocks[0].attn1.fuse_projections(), r"fuse them before tritoff.enable"),
        # keeps dtype and device, and would leave the buffers (and the rope's tables) uninitialized
        (lambda p: p.transformer.to_empty(device="cpu"), r"^to_empty\(\): it would give the module's tensors"),
        (lambda p: p.transformer.rope.to_empty(device="cpu"), r"^to_empty\(\)"),
    ],
)
def test_operations_that_would_break_the_engine_are_refused_in_one_line(enabled, operation, message):
    pipe, before = enabled
    dtypes = {n: m.dtype for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    with pytest.raises(RuntimeError, match=message) as info:
        operation(pipe)
    text = str(info.value)  # one line saying what to do
    assert "\n" not in text and ("tritoff.disable(pipe)" in text or "before tritoff.enable" in text)
    assert {n: m.dtype for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)} == dtypes
    assert torch.equal(run(pipe, LATENTS), before)  # the pipeline is as it was


def test_copying_or_pickling_an_enabled_component_is_refused(enabled):
    import io
    import pickle

    pipe, before = enabled
    for attempt in (
        lambda: copy.deepcopy(pipe.transformer),
        lambda: copy.copy(pipe.vae),
        lambda: pickle.dumps(pipe.text_encoder),
        lambda: torch.save(pipe.transformer, io.BytesIO()),
        lambda: copy.deepcopy(pipe),  # through its components
        lambda: pickle.dumps(pipe.transformer.blocks[1]),  # a block, a layer: their copies would hold placeholders
        lambda: torch.save(pipe.transformer.blocks[0].ffn, io.BytesIO()),
        lambda: copy.deepcopy(pipe.transformer.proj_out),
    ):
        with pytest.raises(RuntimeError, match=r"^copying or pickling .*: the weights live in tritoff's packs"):
            attempt()
    assert torch.equal(run(pipe, LATENTS), before)


def test_loading_a_state_dict_into_managed_weights_is_refused_and_adapter_weights_load(enabled):
    pipe, before = enabled
    state = {"blocks.0.ffn.net.0.proj.weight": torch.zeros(1)}
    for kwargs in ({}, {"assign": True}, {"strict": False}):
        with pytest.raises(RuntimeError, match=r"^load_state_dict naming transformer\.blocks\.0\.ffn\.net\.0\.proj\.w"):
            pipe.transformer.load_state_dict(state, **kwargs)
    with pytest.raises(RuntimeError, match=r"^load_state_dict naming transformer\.blocks\.1\.attn1\.to_q\.weight"):
        pipe.transformer.blocks[1].load_state_dict({"attn1.to_q.weight": torch.zeros(1)}, strict=False)
    assert pipe.transformer.load_state_dict({}, strict=False) is not None  # nothing managed named: torch's own
    assert torch.equal(run(pipe, LATENTS), before)


def test_disable_gives_the_operations_back():
    pipe = wan()
    tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")
    tritoff.disable(pipe)
    shadowed = ("to", "_apply", "enable_model_cpu_offload", "remove_all_hooks", "fuse_qkv_projections", "compile")
    shadowed += ("__reduce_ex__", "load_state_dict", "fuse_projections", "to_empty")
    modules = [m for c in pipe.components.values() if isinstance(c, torch.nn.Module) for m in c.modules()]
    for obj in (pipe, *modules):
        assert not any(name in vars(obj) for name in shadowed), obj
    assert not any("compile" in vars(b) for b in pipe.transformer.blocks)
    pipe.to(torch.float32)
    assert pipe.transformer.dtype == torch.float32
    copy.deepcopy(pipe.transformer)  # ordinary modules again


def test_qkv_fused_before_enable_is_packed_and_unfused_after():
    def fused():
        pipe = wan()
        pipe.transformer.fuse_qkv_projections()
        # the separate projections stay beside the fused one: make them differ, so the two paths give two results
        pipe.transformer.blocks[0].attn1.to_q.weight.data.mul_(2)
        return pipe

    reference = fused()
    for component in (reference.text_encoder, reference.transformer):
        dequantize_in_place(component)
    expected = run(reference, LATENTS)
    reference.transformer.unfuse_qkv_projections()
    expected_unfused = run(reference, LATENTS)
    assert not torch.equal(expected, expected_unfused)
    pipe = fused()
    tritoff.enable(pipe, mode="group", budget="5MB", progress=False, kernels="reference")
    assert torch.equal(run(pipe, LATENTS), expected)
    pipe.transformer.unfuse_qkv_projections()
    assert torch.equal(run(pipe, LATENTS), expected_unfused)


def test_save_pretrained_is_refused_while_enabled_and_writes_the_weights_after_disable(tmp_path):
    pipe = wan()
    tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")
    for owner in (pipe, pipe.transformer, pipe.text_encoder):
        with pytest.raises(RuntimeError, match=r"save_pretrained\(\): the weights live in tritoff's packs") as info:
            owner.save_pretrained(tmp_path / "enabled")
        assert "\n" not in str(info.value) and "tritoff.disable(pipe)" in str(info.value)
    assert not (tmp_path / "enabled").exists()  # nothing written
    tritoff.disable(pipe)
    pipe.transformer.save_pretrained(tmp_path / "disabled")
    saved = type(pipe.transformer).from_pretrained(tmp_path / "disabled", torch_dtype=torch.bfloat16)
    reference = dequantize_in_place(wan().transformer)
    expected = dict(reference.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in saved.named_parameters())


def test_from_pipe_shares_the_enabled_components_when_given_their_dtype():
    from diffusers import WanPipeline

    pipe = wan().to(torch.float32)  # from_pipe casts every shared component to one dtype
    engine = tritoff.enable(pipe, mode="group", budget="8MB", progress=False, kernels="reference")
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    before = run(pipe, LATENTS)
    with pytest.raises(RuntimeError, match="^moving or casting [a-z_]+ to torch.bfloat16: its weights live in"):
        WanPipeline.from_pipe(pipe, dtype=torch.bfloat16)
    shared = WanPipeline.from_pipe(pipe, dtype=torch.float32)
    assert shared.transformer is pipe.transformer
    assert torch.equal(run(shared, LATENTS), before) and torch.equal(run(pipe, LATENTS), before)

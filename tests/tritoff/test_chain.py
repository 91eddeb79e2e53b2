"""tritoff's hooks among diffusers' own (a cache): innermost whichever came first, and each side removable alone."""

import types

import pytest
import torch
from diffusers import FirstBlockCacheConfig

import tritoff
from tritoff.warn import TritoffWarning

from .helpers import WAN_CALL, run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

CALL = dict(WAN_CALL, num_inference_steps=6, output_type="latent")
CACHE = FirstBlockCacheConfig(threshold=50.0)  # every step after the first skips the blocks after the first


def _enable(pipe, **kwargs):
    options = dict(mode="group", budget="5MB", progress=False, kernels="reference") | kwargs
    return tritoff.enable(pipe, "bf16", **options)


@pytest.fixture(scope="module")
def expected():
    """Latents of the plain pipeline without and with the cache (which changes them)."""
    pipe = wan()
    out = {"plain": run(pipe, CALL)}
    pipe.transformer.enable_cache(CACHE)
    out["cached"] = run(pipe, CALL)
    assert not torch.equal(out["cached"], out["plain"])
    return out


def _streamed_onloads(engine) -> int:
    return engine.stats["components"]["transformer"]["onloads"]


@pytest.mark.parametrize("first", ["tritoff", "cache"])
def test_a_cache_runs_outside_tritoff_whichever_was_enabled_first(expected, first):
    pipe = wan()
    if first == "cache":
        pipe.transformer.enable_cache(CACHE)
    engine = _enable(pipe)
    assert engine.plan.tier_counts("transformer")["stream"] >= 3
    if first == "tritoff":
        pipe.transformer.enable_cache(CACHE)
    assert torch.equal(run(pipe, CALL), expected["cached"])
    # the blocks the cache skips are not loaded either: each call after the first streams one block, not all
    cached = _streamed_onloads(engine)
    pipe.transformer.disable_cache()  # tritoff's hooks stay
    assert torch.equal(run(pipe, CALL), expected["plain"])
    assert cached < _streamed_onloads(engine) - cached


def test_disable_and_enable_again_keep_a_cache_enabled_after_tritoff(expected):
    pipe = wan()
    _enable(pipe)
    pipe.transformer.enable_cache(CACHE)
    _enable(pipe, reserve=2000)  # a re-plan
    assert torch.equal(run(pipe, CALL), expected["cached"])
    tritoff.disable(pipe)
    assert torch.equal(run(pipe, CALL), expected["cached"])
    pipe.transformer.disable_cache()  # diffusers' removal finds its own forward below its hooks, not tritoff's
    for module in pipe.transformer.modules():  # diffusers leaves the bound forward it found as an attribute
        assert not hasattr(module, "_hf_hook") and module.forward.__func__ is type(module).forward
    assert torch.equal(run(pipe, CALL), expected["plain"])


def test_a_forward_replaced_after_enable_is_named_when_disable_puts_the_hooked_one_back(expected):
    pipe = wan()
    _enable(pipe)
    block = pipe.transformer.blocks[1]
    block.forward = types.MethodType(type(block).forward, block)  # tritoff's hook no longer runs in it
    with pytest.warns(TritoffWarning, match=r"transformer\.blocks\.1: forward was replaced after tritoff.enable"):
        tritoff.disable(pipe)
    assert "forward" not in vars(block)
    assert torch.equal(run(pipe, CALL), expected["plain"])


def test_offloading_hooks_of_diffusers_are_refused():
    pipe = wan()
    pipe.transformer.enable_cache(CACHE)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"carries diffusers hooks \(layerwise_casting\)"):
        _enable(pipe)


def test_blocks_compiled_inside_the_hooks_under_a_cache_compile_as_modules_after_disable(expected):
    torch._dynamo.reset()
    pipe = wan()
    _enable(pipe)
    pipe.transformer.enable_cache(CACHE)
    for block in pipe.transformer.blocks:
        block.compile(backend="aot_eager")  # the block's own forward, inside tritoff's hooks
    assert torch.equal(run(pipe, CALL), expected["cached"])
    tritoff.disable(pipe)
    for block in pipe.transformer.blocks:  # below the cache's hooks: the block's own forward, compiled as a module
        holder = block._diffusers_hook._fn_refs[0]
        assert holder.original_forward.__func__ is type(block).forward and block._compiled_call_impl is not None
    assert torch.equal(run(pipe, CALL), expected["cached"])
    torch._dynamo.reset()


def test_a_component_forward_replaced_after_enable_is_refused_not_run_on_placeholders(expected):
    pipe = wan()
    _enable(pipe)
    transformer = pipe.transformer
    hooked = transformer.forward
    # a cache patch as community code writes it: the class's forward, which never calls tritoff's hook
    transformer.forward = types.MethodType(lambda self, *a, **k: type(self).forward(self, *a, **k), transformer)
    with pytest.raises(RuntimeError, match=r"transformer\.forward was replaced after tritoff\.enable") as info:
        run(pipe, CALL)
    assert "\n" not in str(info.value)
    transformer.blocks[0](*_block_inputs(transformer))  # a block called on its own still runs
    transformer.forward = lambda *a, **k: hooked(*a, **k)  # a wrapper calling the hooked forward runs
    assert torch.equal(run(pipe, CALL), expected["plain"])


def test_a_hook_diffusers_removed_below_another_leaves_tritoff_where_the_registry_calls(expected):
    """Removing a block's first registry hook (the cache) leaves the next one's ``original_forward`` stale: diffusers
    calls its ``forward`` from then on, and that is where a re-plan puts tritoff's hook."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    def steps(pipe, enable):
        pipe.transformer.enable_cache(CACHE)
        skip = LayerSkipConfig(indices=[1], fqn="blocks", skip_attention=True, skip_ff=True)
        apply_layer_skip(pipe.transformer, skip)
        pipe.transformer.disable_cache()
        enable(pipe)
        return run(pipe, CALL)

    plain = steps(wan(), lambda pipe: None)
    pipe = wan()
    _enable(pipe)
    assert torch.equal(steps(pipe, lambda pipe: _enable(pipe, reserve=2000)), plain)


def _block_inputs(transformer):
    dims = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    tokens = torch.randn(1, 4, dims, dtype=torch.bfloat16)
    rotary = (torch.ones(1, 4, 1, transformer.config.attention_head_dim),) * 2
    return tokens, tokens, torch.randn(1, 6, dims, dtype=torch.bfloat16), rotary


def test_only_tritoff_takes_its_hooks_off_so_a_pipeline_sharing_the_components_cannot(expected):
    # WanPipeline(**pipe.components) shares the enabled pipeline's modules, not its refusals: its remove_all_hooks(),
    # and the offloading that starts with it, would leave both pipelines computing with placeholders
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    from diffusers import WanPipeline

    pipe = wan()
    _enable(pipe)
    other = WanPipeline(**pipe.components)
    calls = [
        (other.remove_all_hooks, r"the hook on \w+ is tritoff's"),
        (lambda: other.enable_model_cpu_offload(device="cpu"), r"the hook on \w+ is tritoff's"),
        (lambda: other.enable_sequential_cpu_offload(device="cpu"), r"the hook on \w+ is tritoff's"),
        (lambda: remove_hook_from_module(pipe.transformer.blocks[1]), r"the hook on transformer\.blocks\.1 is"),
        (lambda: add_hook_to_module(pipe.transformer.blocks[1], ModelHook(), append=True), "with append=True"),
    ]
    for call, message in calls:
        with pytest.raises(RuntimeError, match=message) as info:
            call()
        assert "\n" not in str(info.value) and "tritoff.disable" in str(info.value)
    assert torch.equal(run(other, CALL), expected["plain"])  # bf16 packs: the plain pipeline's latents
    tritoff.disable(pipe)
    assert not any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules())
    other.remove_all_hooks()  # tritoff's hooks gone: nothing of its refuses


def test_a_block_hook_replaced_by_accelerate_is_refused_at_the_next_call_not_run_on_placeholders(expected):
    # add_hook_to_module without append puts its hook in place of tritoff's, taking nothing off: tritoff's hook then
    # never runs, and the block would compute with placeholders
    from accelerate.hooks import ModelHook, add_hook_to_module

    pipe = wan()
    _enable(pipe)
    add_hook_to_module(pipe.transformer.blocks[1], ModelHook())
    with pytest.raises(RuntimeError, match=r"the hook on transformer\.blocks\.1 is no longer tritoff's") as info:
        run(pipe, CALL)
    assert "\n" not in str(info.value)
    with pytest.warns(TritoffWarning):  # the forward tritoff hooked is put back
        tritoff.disable(pipe)
    assert torch.equal(run(pipe, CALL), expected["plain"])

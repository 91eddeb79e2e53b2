"""tritoff/engine.py + manager: outputs equal the dequantized pipeline bit for bit in every mode and budget."""

import warnings

import pytest
import torch
from helpers import COG_CALL, cogvideox, dequantized_pipeline, run, wan

import tritoff
from tritoff.planner import BudgetError

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


@pytest.fixture(scope="module")
def wan_reference():
    return run(dequantized_pipeline(wan))


def _enable(pipe, **kwargs):
    kwargs.setdefault("kernels", "reference")  # the interpreter is exercised in test_triton_end_to_end
    return tritoff.enable(pipe, progress=False, **kwargs)


@pytest.mark.parametrize(
    "mode,budget",
    [
        pytest.param("group", "4MB", id="group-all-streamed"),
        pytest.param("group", "6MB", id="group-fp8-resident"),
        pytest.param("group", "9MB", id="group-bf16-resident"),
        pytest.param("leaf", "2MB", id="leaf"),
        pytest.param("model", "5MB", id="model"),
        pytest.param("auto", "5MB", id="auto-split"),
        pytest.param("auto", None, id="auto-resident"),
    ],
)
def test_every_mode_equals_the_dequantized_pipeline(wan_reference, mode, budget):
    pipe = wan()
    engine = _enable(pipe, mode=mode, budget=budget)
    assert torch.equal(run(pipe), wan_reference)
    stats = engine.stats["total"]
    if mode in ("group", "leaf") and budget in ("4MB", "2MB"):
        assert stats["onloads"] > 0 and stats["bytes_h2d"] > 0
    assert stats["sync_onloads"] == 0  # the traced order held: every group was prefetched


def test_triton_end_to_end(wan_reference):
    """The kernels (Triton interpreter on CPU) unpack every streamed group exactly like the reference."""
    from tritoff.kernels import triton_runs_on

    if not triton_runs_on("cuda" if torch.cuda.is_available() else "cpu"):
        pytest.skip("Triton cannot run here")
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB", kernels="triton")
    assert torch.equal(run(pipe, num_inference_steps=2), run(dequantized_pipeline(wan), num_inference_steps=2))


def test_bf16_storage_equals_the_plain_pipeline():
    expected = run(wan())
    pipe = wan()
    _enable(pipe, storage="bf16", mode="group", budget="6MB")
    assert torch.equal(run(pipe), expected)


def test_cogvideox_group_mode():
    expected = run(dequantized_pipeline(cogvideox), COG_CALL)
    pipe = cogvideox()
    engine = _enable(pipe, mode="group", budget="320KB", reserve="20KB")
    assert engine.plan.modes["transformer"] == "group"
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    assert torch.equal(run(pipe, COG_CALL), expected)


def test_wan22_two_experts_switch_mid_loop():
    expected = run(dequantized_pipeline(wan, two_experts=True), num_inference_steps=4)
    pipe = wan(two_experts=True)
    engine = _enable(pipe, mode="group", budget="5MB")
    assert torch.equal(run(pipe, num_inference_steps=4), expected)
    comps = engine.stats["components"]
    assert comps["transformer"]["calls"] > 0 and comps["transformer_2"]["calls"] > 0


@pytest.mark.parametrize("steps", [2, 4])
def test_model_mode_onloads_the_transformer_once_per_call(steps):
    sizes = {c.name: c.unit_bytes for c in _enable(wan(), mode="model", budget="50MB").sizes}
    # room for the transformer, not for the transformer and the VAE together
    budget = sizes["transformer"] + sizes["vae"] // 2 + 10_000
    pipe = wan()
    engine = _enable(pipe, mode="model", budget=budget, reserve=10_000)
    for _ in range(2):
        run(pipe, num_inference_steps=steps)
    transformer = engine.stats["components"]["transformer"]
    assert transformer["calls"] == 2 * 2 * steps  # classifier-free guidance: two forwards a step
    # the VAE evicts it at decode time under this budget, so it comes back once per pipeline call, not per step
    assert transformer["pool_loads"] == 2


def test_model_mode_keeps_everything_when_it_fits():
    pipe = wan()
    engine = _enable(pipe, mode="model", budget="20MB")
    run(pipe)
    run(pipe)
    assert all(c["pool_loads"] == 1 and c["evictions"] == 0 for c in engine.stats["components"].values())


def test_plan_never_exceeds_the_budget_and_the_minimum_is_honest():
    minimum = None
    for kib in range(2500, 12000, 500):
        pipe = wan()
        try:
            engine = _enable(pipe, mode="group", budget=kib * 1024)
        except BudgetError as err:
            assert "smallest that works is" in str(err)
            minimum = err.minimum
            continue
        assert engine.plan.planned_bytes <= kib * 1024
    assert minimum is not None  # the sweep started below the minimum
    engine = _enable(wan(), mode="group", budget=minimum)  # the minimum named in the error works
    assert engine.plan.planned_bytes <= minimum
    with pytest.raises(BudgetError):
        _enable(wan(), mode="group", budget=minimum - 1024)


def test_impossible_budget_leaves_the_pipeline_unchanged():
    pipe = wan()
    before = {n: (p, p.detach().clone()) for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(BudgetError, match="smallest that works is"):
        _enable(pipe, mode="group", budget="1MB")
    for name, (param, value) in before.items():
        current = dict(pipe.transformer.named_parameters())[name]
        assert current is param and torch.equal(current, value), name
    assert not hasattr(pipe.transformer, "_hf_hook") and not hasattr(pipe, "_tritoff_engine")


def test_disable_round_trip(wan_reference):
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    run(pipe)
    tritoff.disable(pipe)
    assert not any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules())
    assert all(p.numel() > 0 for p in pipe.transformer.parameters())
    assert torch.equal(run(pipe), wan_reference)  # ordinary modules holding the dequantized weights
    tritoff.disable(pipe)  # a second disable does nothing


def test_enable_twice_replans(wan_reference):
    pipe = wan()
    first = _enable(pipe, mode="group", budget="4MB")
    second = _enable(pipe, mode="group", budget="9MB")
    assert second.packed is first.packed  # same storage: the packs are reused
    assert second.plan.tier_counts("transformer")["bf16"] == 4
    assert torch.equal(run(pipe), wan_reference)
    third = _enable(pipe, mode="leaf", budget="9MB")  # other groups: re-packed, exactly
    assert third.packed is not first.packed
    assert torch.equal(run(pipe), wan_reference)
    with pytest.raises(ValueError, match="reload the pipeline"):
        _enable(pipe, storage="fp8_e5m2", mode="group", budget="9MB")


def test_refuses_accelerate_hooks():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    pipe = wan()
    add_hook_to_module(pipe.transformer, AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(ValueError, match="remove_all_hooks"):
        _enable(pipe, budget="6MB")


def test_refuses_diffusers_hooks():
    pipe = wan()
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="diffusers hooks"):
        _enable(pipe, budget="6MB")


def test_execution_device_and_device_report_the_compute_device():
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB")
    device = engine.options.device
    assert pipe.transformer._hf_hook.execution_device == device
    assert pipe._execution_device == device
    assert pipe.device == device and pipe.transformer.device == device
    assert pipe.transformer.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(storage="int4"), "unknown storage 'int4'"),
        (dict(mode="layer"), "unknown mode 'layer'"),
        (dict(budget="abc"), "invalid budget 'abc'"),
        (dict(budget="150%", device="cpu"), "at most 100%"),
        (dict(budget=-1), "must be positive"),
        (dict(prefetch=0), "prefetch must be"),
        (dict(transport="pcie"), "unknown transport"),
    ],
)
def test_bad_options_are_one_line_errors(kwargs, message):
    pipe = wan()
    with pytest.raises(ValueError, match=message) as info:
        _enable(pipe, **kwargs)
    assert "\n" not in str(info.value)
    assert not hasattr(pipe, "_tritoff_engine")


def test_report_and_stats():
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB")
    run(pipe)
    text = engine.report()
    assert "transformer" in text and "worst quantized layers" in text and "stream" in text
    stats = engine.stats
    assert stats["components"]["transformer"]["tiers"]["stream"] == 4
    assert stats["total"]["host_arena_bytes"] >= stats["total"]["packed_bytes"] > 0
    assert len(stats["worst_layers_snr_db"]) == 5
    assert all(20 < v < 40 for v in stats["worst_layers_snr_db"].values())


def test_cpu_warns_that_nothing_is_offloaded():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tritoff.enable(wan(), progress=False, kernels="reference", device="cpu")
    assert any("offloads nothing" in str(w.message) for w in caught)

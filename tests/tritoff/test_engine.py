"""tritoff/engine.py + manager: outputs equal the dequantized pipeline bit for bit in every mode and budget."""

import copy
import io
import warnings

import pytest
import torch

import tritoff
from tritoff.onload import is_placeholder, shared_versions
from tritoff.planner import BudgetError

from .helpers import (
    COG_CALL,
    Stack,
    cogvideox,
    dequantize_in_place,
    dequantized_pipeline,
    enable_at_minimum,
    run,
    stack,
    wan,
)

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
        pytest.param("model", "6MB", id="model"),
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
    """The kernels (Triton interpreter on CPU) unpack every streamed group exactly like the reference. One step: its
    two calls (CFG) are the traced first call, with synchronous fills, and a prefetched one."""
    from tritoff.kernels import triton_runs_on

    if not triton_runs_on("cuda" if torch.cuda.is_available() else "cpu"):
        pytest.skip("Triton cannot run here")
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB", kernels="triton")
    assert torch.equal(run(pipe, num_inference_steps=1), run(dequantized_pipeline(wan), num_inference_steps=1))


def test_bf16_storage_equals_the_plain_pipeline():
    expected = run(wan())
    pipe = wan()
    _enable(pipe, storage="bf16", mode="group", budget="6MB")
    assert torch.equal(run(pipe), expected)


def test_cogvideox_group_mode():
    big = dict(num_layers=4, num_attention_heads=8, attention_head_dim=16)  # blocks that dominate the pipeline
    expected = run(dequantized_pipeline(cogvideox, **big), COG_CALL)
    with pytest.raises(BudgetError) as info:
        _enable(cogvideox(**big), mode="group", budget=1000, reserve="20KB")
    pipe = cogvideox(**big)
    engine = _enable(pipe, mode="group", budget=info.value.minimum, reserve="20KB")
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
    probe = _enable(wan(), mode="model", budget="50MB", reserve=10_000)
    # room for the transformer's phase (its weights, staging, the shared buffers and tables and its reserve), not for
    # the transformer and the VAE together
    budget = probe.plan.phases["transformer"].planned_bytes + probe.plan.phases["vae"].need_bytes // 2
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


def test_triton_kernels_where_triton_cannot_run_leave_the_pipeline_unchanged(monkeypatch):
    """``kernels='triton'`` on a device Triton cannot run on is refused before any weight is packed."""
    from tritoff.kernels import backend

    monkeypatch.setattr(backend, "triton_runs_on", lambda device: False)
    pipe = wan()
    before = {n: (p, p.detach().clone()) for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ValueError, match="kernels='triton' but Triton cannot run on cpu"):
        _enable(pipe, mode="group", budget="4MB", kernels="triton")
    for name, (param, value) in before.items():
        current = dict(pipe.transformer.named_parameters())[name]
        assert current is param and torch.equal(current, value), name
    assert not hasattr(pipe.transformer, "_hf_hook") and not hasattr(pipe, "_tritoff_engine")


def test_a_disk_ring_that_cannot_be_made_leaves_the_pipeline_unchanged(monkeypatch, tmp_path):
    """The ring packs beyond the host budget are read into is made before any weight is packed: its failure (no host
    memory for it, or page-locking it for zero-copy reads) leaves the original weights where they were."""
    import tritoff.engine

    def no_memory(*args, **kwargs):
        raise MemoryError("no host memory for the disk ring")

    monkeypatch.setattr(tritoff.engine, "DiskRing", no_memory)
    pipe = wan()
    before = {n: (p, p.detach().clone()) for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(MemoryError, match="disk ring"):
        _enable(pipe, mode="group", budget="4MB", host_budget="1MB", spill_dir=tmp_path)
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
    assert not any(is_placeholder(p) for p in pipe.transformer.parameters())
    assert torch.equal(run(pipe), wan_reference)  # ordinary modules holding the dequantized weights
    tritoff.disable(pipe)  # a second disable does nothing
    # each weight in a storage of its own, as after loading: torch.save and pickling accept them
    for component in (pipe.transformer, pipe.text_encoder):
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in component.parameters())
        torch.save(component.state_dict(), io.BytesIO())


def test_disable_of_a_pipeline_made_from_the_enabled_ones_components(wan_reference):
    """``pipe = WanPipeline(**pipe.components)`` drops the enabled pipeline: disabling the new one disables it; one
    holding only some of its components is refused, naming them."""
    from types import SimpleNamespace

    from diffusers import WanPipeline

    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    partial = WanPipeline(**{**pipe.components, "text_encoder": wan().text_encoder})
    with pytest.raises(ValueError, match="^tritoff is enabled on [a-z_]+ or on the pipeline or module holding it"):
        tritoff.disable(partial)
    assert hasattr(pipe, "_tritoff_engine")  # untouched
    # one holding all of them and a component another engine holds: refused, as disabling would leave that one hooked
    other = wan()
    _enable(other, mode="group", budget="4MB")
    # a pipeline-like object: diffusers' own refuse components their class does not name
    mixed = SimpleNamespace(components={**pipe.components, "text_encoder_2": other.text_encoder})
    with pytest.raises(ValueError, match="^tritoff is enabled on text_encoder or on the pipeline or module holding it"):
        tritoff.disable(mixed)
    assert hasattr(pipe, "_tritoff_engine") and hasattr(other, "_tritoff_engine")
    tritoff.disable(other)
    tritoff.disable(WanPipeline(**{n: None for n in pipe.components}))  # no models: nothing to disable
    pipe = WanPipeline(**pipe.components)
    tritoff.disable(pipe)
    assert not hasattr(pipe, "_tritoff_engine")
    assert not any(hasattr(m, "_hf_hook") for c in (pipe.transformer, pipe.vae) for m in c.modules())
    assert torch.equal(run(pipe), wan_reference)
    tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")  # enabled again, anew
    tritoff.disable(pipe)


def test_disable_releases_the_packs_of_an_engine_still_referenced(tmp_path):
    """A notebook keeps the engine enable returned: after disable it holds neither the packs nor their spill file,
    at once (not when Python's collector next runs: an enable right after would find two copies of the model)."""
    import gc

    gc.disable()
    try:
        _packs_released_at_disable(tmp_path)
    finally:
        gc.enable()


def _packs_released_at_disable(tmp_path):
    import weakref

    pipe = wan()
    replaced = _enable(pipe, mode="group", budget="5MB", host_budget="1MB", spill_dir=tmp_path)
    engine = _enable(pipe, mode="group", budget="4MB", host_budget="1MB", spill_dir=tmp_path)  # a re-plan: its packs
    assert not replaced.packed
    arenas = [weakref.ref(p.arena) for p in engine.packed.values()]
    spilled = [p.file for packed in engine.packed.values() for p in packed.packs if p.on_disk]
    assert spilled and len(arenas) == 3
    files = {id(f): weakref.ref(f) for f in spilled}
    del spilled
    run(pipe)
    tritoff.disable(pipe)
    assert not any(ref() for ref in arenas) and not any(ref() for ref in files.values())
    assert "transformer" in engine.report()  # still readable
    for held in (engine, replaced):
        with pytest.raises(RuntimeError, match="no longer holds packs .* save the pipeline's current engine, before"):
            held.save(tmp_path / "store")


def test_enable_twice_replans(wan_reference):
    pipe = wan()
    first = _enable(pipe, mode="group", budget="4MB")
    packs = first.packed
    second = _enable(pipe, mode="group", budget="9MB")
    assert second.packed is packs and not first.packed  # same storage: the packs are reused, handed over
    assert second.plan.tier_counts("transformer")["bf16"] == 4
    assert torch.equal(run(pipe), wan_reference)
    third = _enable(pipe, mode="leaf", budget="9MB")  # other groups: re-packed, exactly
    assert third.packed is not packs
    assert torch.equal(run(pipe), wan_reference)
    # the SNR is still the one against the original weights (the re-packed ones would all read inf dB)
    assert third.snr == first.snr and all(20 < v < 40 for v in third.stats["worst_layers_snr_db"].values())
    with pytest.raises(ValueError, match="reload the pipeline"):
        _enable(pipe, storage="fp8_e5m2", mode="group", budget="9MB")


@pytest.mark.parametrize("exponent", [-130, 116])
def test_weights_fp8_loses_are_named_in_a_warning_and_enable_goes_on(exponent):
    # magnitudes past what fp8 with scales of 2^-100..2^100 holds: every value rounds to zero, or saturates
    def model():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
        with torch.no_grad():
            layers[2].weight.mul_(2.0**exponent)
        return layers

    with pytest.warns(tritoff.TritoffWarning, match=r"^fp8 lost 1 weight \(model\.2\.weight \d+\.\d dB; ") as seen:
        engine = _enable(plain := model(), budget="1GB")
    assert len([w for w in seen if "fp8 lost" in str(w.message)]) == 1
    assert engine.snr["model.2.weight"] < 10 <= min(v for k, v in engine.snr.items() if k != "model.2.weight")
    with warnings.catch_warnings():  # enable again with other groups: re-packed, not warned twice
        warnings.filterwarnings("error", message="fp8 lost")
        _enable(plain, mode="leaf", budget="1GB")
    with warnings.catch_warnings():  # ordinary magnitudes: no warning
        warnings.filterwarnings("error", message="fp8 lost")
        layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
        _enable(layers, budget="1GB")


def test_enable_under_inference_mode():
    # its kernel tables are then inference tensors, which count no versions: reading one failed the enable
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)]).to(torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    expected = dequantize_in_place(copy.deepcopy(layers))(x)
    with torch.inference_mode():
        _enable(layers, mode="group", budget="1GB", kernels="triton")
        assert torch.equal(layers(x), expected)
        tritoff.disable(layers)  # its weights are ordinary tensors, as they were before enable
    assert not any(p.is_inference() for p in layers.parameters())
    x.requires_grad_(True)
    layers(x).float().sum().backward()  # the weights saved for backward: refused were they inference tensors
    assert x.grad is not None and torch.isfinite(x.grad).all()
    _enable(layers, mode="group", budget="1GB")  # and enabled again outside inference mode
    with torch.no_grad():
        assert torch.equal(layers(x), expected)


def test_enable_again_keeps_the_storage_and_skip_it_was_packed_with_unless_told_otherwise():
    pipe = wan()
    first = _enable(pipe, storage="fp8_e5m2", skip=["attn1"], mode="group", budget="4MB")
    packs = first.packed
    expected = run(pipe)
    second = _enable(pipe, mode="group", budget="9MB")  # storage= and skip= left out: kept
    assert second.packed is packs
    assert (second.options.storage, second.options.skip) == (first.options.storage, ("attn1",))
    assert torch.equal(run(pipe), expected)
    third = _enable(pipe, storage="fp8_e5m2", skip="attn1", granularity="row", mode="group", budget="4MB")
    assert third.packed is packs  # the same values given again
    # patterns that skip the same modules, written otherwise: the same packs
    fourth = _enable(pipe, skip=["ATTN1", "attn1", "to_nothing"], mode="group", budget="4MB")
    assert fourth.packed is packs and fourth.options.skip == ("attn1",)
    for change, shown in ((dict(skip=()), "skip=\\['attn1'\\]"), (dict(storage="fp8_e4m3"), "fp8_e5m2")):
        with pytest.raises(ValueError, match=f"{shown}.*leave storage=, granularity= and skip= out to keep them"):
            _enable(pipe, mode="group", budget="9MB", **change)
    assert torch.equal(run(pipe), expected)  # the refusals changed nothing


def test_enable_again_refuses_a_component_whose_modules_changed_and_leaves_it_enabled():
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB")
    expected = run(pipe)
    blocks = pipe.transformer.blocks
    removed = blocks[3]
    del blocks[3]
    with pytest.raises(ValueError, match=r"transformer\.blocks\.3\..* is no longer in transformer .*disable"):
        _enable(pipe, mode="group", budget="9MB")
    assert pipe._tritoff_engine is engine
    blocks.append(removed)  # back in place: enabling again works, and computes as before
    _enable(pipe, mode="group", budget="9MB")
    assert torch.equal(run(pipe), expected)
    blocks.append(wan(seed=1).transformer.blocks[0])  # a block added: its weights are in no pack
    with pytest.raises(ValueError, match=r"transformer\.blocks\.4\..* was added to transformer since enable"):
        _enable(pipe, mode="group", budget="9MB")
    del blocks[4]
    # skip patterns that differ only on a component kept in its own dtype (the VAE) skip the same weights
    _enable(pipe, skip=["decoder"], mode="group", budget="9MB")
    assert torch.equal(run(pipe), expected)


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
        (dict(budget=float("inf")), "invalid budget inf: give a finite number"),
        (dict(budget=float("nan")), "invalid budget nan: give a finite number"),
        (dict(prefetch=True), "prefetch must be an integer >= 1, got True"),
        (dict(device="meta"), "tritoff cannot compute on device 'meta'"),
        (dict(device="gpu0"), "invalid device 'gpu0'"),
        (dict(budget="1GB", reserve="100%"), "leaves nothing of the budget"),
    ],
)
def test_bad_options_are_one_line_errors(kwargs, message):
    pipe = wan()
    before = {n: (p, p.detach().clone()) for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ValueError, match=message) as info:
        _enable(pipe, **kwargs)
    assert "\n" not in str(info.value)
    assert not hasattr(pipe, "_tritoff_engine")
    after = dict(pipe.transformer.named_parameters())
    assert all(after[n] is p and torch.equal(p, value) for n, (p, value) in before.items())


@pytest.mark.parametrize("mode", ["group", "model", "leaf"])
@pytest.mark.parametrize(
    "reserve", ["25%", "90%", "99%", None, 1000], ids=["percent", "most", "nearly-all", "default", "bytes"]
)
def test_the_minimum_budget_named_works_and_one_byte_less_does_not(mode, reserve):
    options = dict(mode=mode, reserve=reserve)
    with pytest.raises(BudgetError) as info:
        _enable(stack(), budget=1000, **options)
    minimum = info.value.minimum
    engine = _enable(stack(), budget=minimum, **options)
    assert engine.plan.planned_bytes <= minimum
    with pytest.raises(BudgetError) as info:
        _enable(stack(), budget=minimum - 1, **options)
    assert info.value.minimum == minimum
    with pytest.raises(BudgetError) as info:  # a percentage of a budget of one byte is less than a byte
        _enable(stack(), budget=1, **options)
    assert info.value.minimum == minimum
    if reserve == "25%":  # the breakdown's parts add up to the budget it names: the reserve is 25% of that one
        from tritoff.budget import format_bytes

        assert format_bytes(int(minimum * 0.25)) in str(info.value)


def test_report_and_stats():
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB")
    run(pipe)
    text = engine.report()
    assert "transformer" in text and "worst quantized layers" in text and "stream" in text
    stats = engine.stats
    transformer = stats["components"]["transformer"]
    # the first call's traced activations replaced the default reserve: the stats follow the plan it made
    assert transformer["replans"] == 1 and transformer["tiers"] == engine.plan.tier_counts("transformer")
    assert transformer["tiers"]["stream"] and sum(transformer["tiers"].values()) == 4
    assert stats["total"]["host_arena_bytes"] >= stats["total"]["packed_bytes"] > 0
    assert len(stats["worst_layers_snr_db"]) == 5
    assert all(20 < v < 40 for v in stats["worst_layers_snr_db"].values())


def test_cpu_warns_that_nothing_is_offloaded():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tritoff.enable(wan(), progress=False, kernels="reference", device="cpu")
    assert any("offloads nothing" in str(w.message) for w in caught)


def _device_storages(engine) -> list:
    """Weak references to the storage of every device buffer of the engine: ring slots, staging, pool units,
    resident bf16 buffers and fp8 packs, kernel tables. A storage stays alive while any view of it does (a parameter,
    a cached view), so these expire only once everything over them is gone."""
    from torch.multiprocessing.reductions import StorageWeakRef

    buffers = []
    for comp in engine._runtimes:
        if comp.ring is not None:
            buffers += comp.ring.buffers
        if comp.transfer is not None:
            buffers += comp.transfer.staging
        for g in comp.groups:
            buffers += [t for t in (g.buffer, g.device_pack) if t is not None]
            buffers += [table for _, table, _ in g._launches]
    # on the CPU, "moving" an fp8 pack or a table to the device returns the host tensor itself: not a device buffer
    host = {p.arena.buffer.untyped_storage().data_ptr() for p in engine.packed.values()}
    return [StorageWeakRef(b.untyped_storage()) for b in buffers if b.untyped_storage().data_ptr() not in host]


def test_teardown_releases_every_device_buffer():
    import gc

    with pytest.raises(BudgetError) as info:
        _enable(wan(), mode="group", budget=1000, reserve="100KB")
    pipe = wan()
    # room for one fp8-resident block: fp8 and streamed blocks, a slot ring, units
    first = _enable(pipe, mode="group", budget=info.value.minimum + 500_000, reserve="100KB")
    assert first.plan.tier_counts("transformer")["fp8"] and first.plan.tier_counts("transformer")["stream"]
    run(pipe)
    held = _device_storages(first)
    assert len(held) > 10 and not any(r.expired() for r in held)  # slots, staging, units, fp8 packs, tables
    second = _enable(pipe, mode="group", budget="9MB", reserve="100KB")  # re-plan; the caller holds the first
    gc.collect()
    assert first is not second and all(r.expired() for r in held)
    run(pipe)
    held = _device_storages(second)
    assert held and not any(r.expired() for r in held)
    tritoff.disable(pipe)
    gc.collect()
    assert all(r.expired() for r in held)


def test_a_module_shared_with_an_enabled_pipeline_is_refused():
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    with pytest.raises(ValueError, match="^transformer is already managed by tritoff") as info:
        _enable(pipe.transformer, mode="group", budget="4MB")  # named as the pipeline names it
    assert "\n" not in str(info.value)
    with pytest.raises(
        ValueError, match="^tritoff is enabled on transformer or on the pipeline or module holding it, not"
    ):
        tritoff.disable(pipe.transformer)  # it would do nothing: the pipeline stays enabled
    with pytest.raises(
        ValueError, match=r"^tritoff is enabled on transformer\.proj_out or on the .* holding it, not on"
    ):
        tritoff.disable(pipe.transformer.proj_out)  # a layer of the component's unit, not hooked itself
    with pytest.raises(
        ValueError, match=r"on transformer\.blocks\.0\.ffn\.net\.0\.proj or on the .* holding it, not on"
    ):
        tritoff.disable(pipe.transformer.blocks[0].ffn.net[0].proj)
    with pytest.raises(ValueError, match=r"on transformer\.blocks\.0\.ffn\.net\.1 or on the .* holding it, not on"):
        tritoff.disable(pipe.transformer.blocks[0].ffn.net[1])  # a module holding no parameter
    with pytest.raises(TypeError, match="^tritoff.disable needs a diffusers pipeline or an nn.Module, got str"):
        tritoff.disable("pipe")
    other = wan()
    other.register_modules(text_encoder=pipe.text_encoder)  # two pipelines sharing one text encoder
    before = {n: p.detach().clone() for n, p in other.transformer.named_parameters()}
    with pytest.raises(ValueError, match="text_encoder.* already managed by tritoff"):
        _enable(other, mode="group", budget="4MB")
    assert not hasattr(other, "_tritoff_engine")
    assert all(torch.equal(p, before[n]) for n, p in other.transformer.named_parameters())  # untouched
    run(pipe)  # the first pipeline still works


def test_a_component_enabled_on_its_own_is_named_as_the_pipeline_names_it():
    # a module enabled on its own is the engine's "model", a name the user never gave
    pipe = wan()
    _enable(pipe.transformer, mode="group", budget="4MB")
    with pytest.raises(ValueError, match="^transformer is already managed by tritoff"):
        _enable(pipe, mode="group", budget="4MB")
    with pytest.raises(
        ValueError, match="^tritoff is enabled on transformer or on the pipeline or module holding it, not"
    ):
        tritoff.disable(pipe)
    with pytest.raises(ValueError, match="^WanTransformer3DModel is already managed by tritoff"):
        _enable(torch.nn.Sequential(pipe.transformer), mode="model", budget="1GB")  # neither names it
    tritoff.disable(pipe.transformer)


def test_flags_must_be_booleans_and_a_granularity_other_than_the_stores_is_refused(tmp_path):
    pipe = wan()
    for flag in ("verify", "progress"):
        with pytest.raises(ValueError, match=f"^{flag} must be True or False, got 'no'$"):
            tritoff.enable(pipe, **{flag: "no"})
    assert not hasattr(pipe, "_tritoff_engine")
    _enable(pipe, mode="group", budget="4MB", granularity="tensor").save(tmp_path / "store")
    with pytest.raises(ValueError, match="^granularity='row' but the store at .* was packed with 'tensor'; drop"):
        _enable(wan(), mode="group", store=tmp_path / "store", granularity="row")
    engine = _enable(pipe, mode="group", budget="8MB")  # a re-plan keeps the engine's granularity
    assert engine.options.granularity == "tensor"
    with pytest.raises(ValueError, match="was made with block groups: use mode='group', 'auto' or 'model' with it$"):
        _enable(wan(), mode="leaf", store=tmp_path / "store")
    # a store of leaf groups: mode left out is leaf (as tritoff run --store picks), another is refused
    _enable(wan(), mode="leaf", budget="4MB").save(tmp_path / "leaf")
    assert _enable(wan(), budget="4MB", store=tmp_path / "leaf").options.mode == "leaf"
    with pytest.raises(ValueError, match="was made with leaf groups: use mode='leaf' with it$"):
        _enable(wan(), mode="auto", budget="4MB", store=tmp_path / "leaf")


@pytest.mark.parametrize("mode", ["group", "auto"])
def test_a_plain_sequential_streams_its_children(mode):
    from tritoff.tiny import realistic_init

    def model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 256) for _ in range(8)]
        return realistic_init(torch.nn.Sequential(*layers)).to(torch.bfloat16).eval()

    x = torch.randn(3, 256, dtype=torch.bfloat16)
    reference = dequantize_in_place(model())
    with pytest.raises(BudgetError) as info:
        _enable(model(), mode=mode, budget=1000, reserve=1000)
    net = model()
    engine = _enable(net, mode=mode, budget=info.value.minimum, reserve=1000)
    assert engine.plan.modes["model"] == "group" and engine.plan.tier_counts("model")["stream"] == 8
    with torch.no_grad():
        assert torch.equal(net(x), reference(x))


@pytest.mark.parametrize("mode", ["model", "auto"])
def test_a_root_never_called_itself_cannot_move_whole(mode):
    from tritoff.tiny import realistic_init

    torch.manual_seed(0)
    root = realistic_init(torch.nn.ModuleDict({"a": torch.nn.Linear(64, 64), "b": torch.nn.Linear(64, 64)}))
    if mode == "model":
        root = torch.nn.ModuleList([root, torch.nn.Linear(64, 64)])  # splittable, but asked to move whole
    root = root.to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in root.named_parameters()}
    with pytest.raises(ValueError, match="which is never called itself, so it cannot move as one unit") as info:
        _enable(root, mode=mode, budget=10**8)
    assert "\n" not in str(info.value) and not hasattr(root, "_tritoff_engine")
    assert all(torch.equal(p, before[n]) for n, p in root.named_parameters())


def test_a_model_without_block_lists_falls_back_to_layers():
    from tritoff.tiny import realistic_init

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    def model():
        torch.manual_seed(0)
        return realistic_init(Flat()).to(torch.bfloat16).eval()

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    reference = dequantize_in_place(model())
    # group mode: its layers stream; auto below its size: a one-line error naming the minimum, not a crash
    with pytest.raises(BudgetError) as info:
        _enable(model(), mode="group", budget=1000, reserve=1000)
    net = model()
    engine = _enable(net, mode="group", budget=info.value.minimum, reserve=1000)
    assert engine.plan.tier_counts("model")["stream"] == 3
    with torch.no_grad():
        assert torch.equal(net(x), reference(x))
    with pytest.raises(BudgetError, match="nothing in it can be split") as info:
        _enable(model(), mode="auto", budget=1000, reserve=1000)
    assert "\n" not in str(info.value)
    net = model()
    _enable(net, mode="auto", budget=info.value.minimum, reserve=1000)
    with torch.no_grad():
        assert torch.equal(net(x), reference(x))


class _EmbeddingStack(torch.nn.Module):
    """Small blocks beside a kept embedding many times their size: its pool unit moves through staging in chunks."""

    def __init__(self, vocab=4096, width=64, n=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(n)
        )

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_a_pool_unit_larger_than_staging_moves_in_chunks(kernels):
    from tritoff.tiny import realistic_init

    def model():
        torch.manual_seed(0)
        return realistic_init(_EmbeddingStack()).to(torch.bfloat16).eval()

    ids = torch.randint(0, 4096, (2, 7))
    reference = dequantize_in_place(model())
    with pytest.raises(BudgetError) as info:
        _enable(model(), mode="group", budget=1000, reserve=1000)
    net = model()
    engine = _enable(net, mode="group", budget=info.value.minimum, reserve=1000, kernels=kernels)
    rest = engine.manager.components["model"].unit[0]
    assert len(rest.chunks) > 8  # the 512 KiB embedding crosses staging halves of a few KiB, chunk by chunk
    assert engine.plan.phases["model"].staging_bytes < rest.packed_bytes / 8
    with torch.no_grad():
        assert torch.equal(net(ids), reference(ids))


@pytest.mark.parametrize("where", ["building", "placing", "hooking", "installing"])
@pytest.mark.parametrize("replan", [False, True], ids=["first-enable", "re-plan"])
def test_a_failure_after_packing_leaves_ordinary_modules(wan_reference, monkeypatch, replan, where):
    """Ctrl-C before the engine exists (right after packing, or after a re-plan tore the previous engine down), an
    out-of-memory GPU while placing the packs, or Ctrl-C between two hooks or while the pipeline's operations are
    wrapped: no hook, wrapper or placeholder is left, and every parameter has its requires_grad back."""
    import tritoff.engine as engine_module
    from tritoff import operations

    pipe = wan()
    pipe.transformer.blocks[0].requires_grad_(False)
    flags = [p.requires_grad for p in pipe.transformer.parameters()]
    if replan:
        _enable(pipe, mode="group", budget="4MB")

    class OutOfMemory(RuntimeError):
        pass

    def no_memory(*args, **kwargs):
        raise OutOfMemory("simulated: the GPU is full")

    calls = []

    def interrupted_second_hook(module, manager):
        calls.append(module)
        if len(calls) == 2:  # the second module hooked, after accelerate's hook and before tritoff's guard
            raise KeyboardInterrupt
        guard(module, manager)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    guard = engine_module.guard_forward
    if where == "building":
        monkeypatch.setattr(engine_module, "Engine", interrupted)
    elif where == "placing":
        monkeypatch.setattr(engine_module, "GroupRuntime", no_memory)
    elif where == "hooking":
        monkeypatch.setattr(engine_module, "guard_forward", interrupted_second_hook)
    else:
        monkeypatch.setattr(operations, "install", lambda *args: no_memory())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt if where in ("building", "hooking") else OutOfMemory):
            _enable(pipe, mode="group", budget="5MB")
    monkeypatch.undo()
    # the weights this call released come back rounded to fp8, and it says so; a re-plan's were rounded before
    said = [str(w.message) for w in caught if "enable stopped" in str(w.message)]
    assert said == ([] if replan else [said[0]]) and (replan or "the weights of text_encoder, transformer" in said[0])
    # packing had already released the original weights: ordinary modules hold their dequantized values instead
    assert not hasattr(pipe, "_tritoff_engine")
    assert [p.requires_grad for p in pipe.transformer.parameters()] == flags
    assert not any(hasattr(m, "_hf_hook") or "forward" in vars(m) for m in pipe.transformer.modules())
    assert not any(is_placeholder(p) for p in pipe.transformer.parameters())
    assert not any(getattr(f, "_tritoff", False) for obj in (pipe, pipe.transformer) for f in vars(obj).values())
    assert torch.equal(run(pipe), wan_reference)
    _enable(pipe, mode="group", budget="5MB")  # and it can be enabled again
    assert torch.equal(run(pipe), wan_reference)


@pytest.mark.parametrize("how", ["error", "ctrl-c"])
def test_a_re_plan_stopped_in_the_previous_engines_teardown_leaves_ordinary_modules(
    wan_reference, monkeypatch, ctrl_c_raises, how
):
    """An error in the previous engine's teardown is undone by doing it again (each step a no-op where done); a
    Ctrl-C is held until the teardown is whole. Either way the re-plan gives the weights back, hooks and all gone."""
    import signal

    from tritoff import operations

    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    remove, calls = operations.remove, []

    def stopped_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1 and how == "error":
            raise RuntimeError("simulated")
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, landing in the middle of the teardown
        remove(*args, **kwargs)

    monkeypatch.setattr(operations, "remove", stopped_once)
    with pytest.raises(RuntimeError if how == "error" else KeyboardInterrupt):
        _enable(pipe, mode="group", budget="5MB")
    monkeypatch.undo()
    assert not hasattr(pipe, "_tritoff_engine")
    components = (pipe.text_encoder, pipe.transformer, pipe.vae)
    assert not any(hasattr(m, "_hf_hook") or "forward" in vars(m) for c in components for m in c.modules())
    assert not any(is_placeholder(p) for c in components for p in c.parameters())
    assert torch.equal(run(pipe), wan_reference)
    _enable(pipe, mode="group", budget="5MB")
    assert torch.equal(run(pipe), wan_reference)


def test_a_teardown_that_keeps_failing_leaves_forwards_refused_and_disable_recovers(wan_reference, monkeypatch):
    # a re-plan whose previous engine cannot release its GPU state (a sticky CUDA error): its hooks are gone, so a
    # forward would compute with placeholders; it is refused until a teardown completes
    from tritoff.manager import HookManager

    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")

    def failing(self):
        raise RuntimeError("simulated: CUDA error")

    monkeypatch.setattr(HookManager, "release", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        _enable(pipe, mode="group", budget="5MB")
    with pytest.raises(RuntimeError, match="holds no weights: its tritoff engine was torn down"):
        run(pipe)
    with pytest.raises(RuntimeError, match="simulated"):  # disable stops there too, and changes nothing
        tritoff.disable(pipe)
    monkeypatch.undo()
    tritoff.disable(pipe)
    assert not any(is_placeholder(p) for p in pipe.transformer.parameters())
    assert torch.equal(run(pipe), wan_reference)


def test_a_disable_stopped_in_its_teardown_stays_enabled_as_it_was(wan_reference, monkeypatch):
    from tritoff import operations

    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB")
    hooked, remove = list(engine._hooked), operations.remove

    def failing_once(*args, **kwargs):
        monkeypatch.setattr(operations, "remove", remove)
        raise RuntimeError("simulated")

    monkeypatch.setattr(operations, "remove", failing_once)
    with pytest.raises(RuntimeError, match="simulated"):
        tritoff.disable(pipe)
    assert pipe._tritoff_engine is engine and engine._hooked == hooked  # hooked once each, as before
    assert torch.equal(run(pipe), wan_reference)
    tritoff.disable(pipe)
    assert not any(hasattr(m, "_hf_hook") for m in pipe.vae.modules()) and "decode" not in vars(pipe.vae)
    assert torch.equal(run(pipe), wan_reference)


def test_an_enable_stopped_before_packing_began_gives_every_flag_back(monkeypatch):
    # the parameters are frozen before the first pack is made: a Ctrl-C between the two must not leave them frozen
    import tritoff.engine as engine_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    pipe = wan()
    pipe.transformer.blocks[0].requires_grad_(False)
    flags = {n: p.requires_grad for n, p in pipe.transformer.named_parameters()}
    weights = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    monkeypatch.setattr(engine_module, "quantize_device", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _enable(pipe, mode="group", budget="4MB")
    monkeypatch.undo()
    assert {n: p.requires_grad for n, p in pipe.transformer.named_parameters()} == flags
    assert all(torch.equal(p, weights[n]) for n, p in pipe.transformer.named_parameters())


@pytest.mark.parametrize("where", ["gathering", "returned"])
def test_a_component_stopped_once_its_packs_are_made_gets_its_weights_back(wan_reference, monkeypatch, where):
    """Ctrl-C after a component's last group was packed (and released): while its arena is page-locked or its packs
    gathered, or once pack_model has returned, before enable holds the packs. Its weights come back from the packs as
    they were made, as for a stop in the middle of packing."""
    import tritoff.engine as engine_module
    from tritoff import packer

    gather, pack_model = packer.PackedModel, engine_module.pack_model

    def stopped_gathering(arena, packs, groups, *args):
        if any(name.startswith("blocks.") for group in groups for name, _ in group.params):
            raise KeyboardInterrupt
        return gather(arena, packs, groups, *args)

    def stopped_as_it_returns(module, *args, **kwargs):
        packed = pack_model(module, *args, **kwargs)
        if kwargs["desc"] == "packing transformer":
            raise KeyboardInterrupt
        return packed

    pipe = wan()
    if where == "gathering":
        monkeypatch.setattr(packer, "PackedModel", stopped_gathering)
    else:
        monkeypatch.setattr(engine_module, "pack_model", stopped_as_it_returns)
    with pytest.warns(UserWarning, match="enable stopped: the weights of .*transformer"):
        with pytest.raises(KeyboardInterrupt):
            _enable(pipe, mode="group", budget="4MB")
    monkeypatch.undo()
    assert not any(p.numel() == 0 or is_placeholder(p) for p in pipe.transformer.parameters())
    assert torch.equal(run(pipe), wan_reference)  # every component as its packs hold it


def test_a_component_stopped_before_its_first_pack_is_not_said_to_be_rounded(monkeypatch):
    # its weights are the originals: "reload the pipeline" would be wrong about it
    from tritoff import packer

    write_pack = packer.write_pack

    def stopped_at_the_transformer(layout, data, tensors, *args, **kwargs):
        if any(name.startswith("blocks.") for name in tensors):
            raise KeyboardInterrupt
        return write_pack(layout, data, tensors, *args, **kwargs)

    pipe = wan()
    weights = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    monkeypatch.setattr(packer, "write_pack", stopped_at_the_transformer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            _enable(pipe, mode="group", budget="4MB")
    monkeypatch.undo()
    said = [str(w.message) for w in caught if "enable stopped" in str(w.message)]
    assert len(said) == 1 and "the weights of text_encoder packed so far" in said[0], said
    assert all(torch.equal(p, weights[n]) for n, p in pipe.transformer.named_parameters())


def test_weights_on_the_meta_device_are_refused_in_one_line_and_nothing_changes():
    # a model built empty (init_empty_weights) and never loaded: there are no values to pack
    pipe = wan()
    pipe.transformer.to("meta")
    text_encoder = {n: p.clone() for n, p in pipe.text_encoder.named_parameters()}
    with pytest.raises(ValueError, match=r"transformer\.\S+ is on the meta device, so there are no weights to pack"):
        _enable(pipe)
    assert not hasattr(pipe, "_tritoff_engine")
    assert all(torch.equal(p, text_encoder[n]) for n, p in pipe.text_encoder.named_parameters())


def _sliced_from_fused(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """``model`` with the weights ``names`` replaced by slices of one fused tensor, as a loader splitting a fused
    q/k/v or k/v weight gives them (``load_state_dict(assign=True)``): views sharing one version counter."""
    params = dict(model.named_parameters())
    fused = torch.cat([params[n].detach() for n in names]).clone()
    pieces = fused.split([params[n].shape[0] for n in names])
    model.load_state_dict(dict(zip(names, pieces, strict=True)), strict=False, assign=True)
    return model


@pytest.mark.parametrize("mode,budget", [("group", 80_000), ("model", "1GB"), ("leaf", 45_000), ("auto", "1GB")])
def test_weights_sliced_from_one_fused_tensor_run_like_any_other(mode, budget):
    names = ["blocks.0.0.weight", "blocks.0.2.weight", "blocks.2.0.weight"]  # in one block, and across two
    model = _sliced_from_fused(stack(), names)
    params = dict(model.named_parameters())
    assert shared_versions([params[n] for n in names]) == [[0, 1, 2]]  # one counter, as the loaders give them
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = dequantize_in_place(stack())(x)
    _enable(model, mode=mode, budget=budget)
    with torch.no_grad():
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
        model.blocks[2][0].weight.fill_(1.0)  # a write into one of them is still refused, naming the three
    sharers = r"model\.blocks\.0\.0\.weight \(or model\.blocks\.0\.2\.weight, model\.blocks\.2\.0\.weight: views of one"
    with pytest.raises(RuntimeError, match=rf"^{sharers} tensor\) was written in place after tritoff\.enable"):
        model(x)


class _MixedBlock(torch.nn.Module):
    """A bf16 layer and one kept in float32 for precision, in one block."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32).to(torch.bfloat16)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.b(self.a(x).float()).to(x.dtype)


class _Mixed(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MixedBlock() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _mixed():
    torch.manual_seed(0)
    return _Mixed()


@pytest.mark.parametrize("mode", ["group", "model", "auto"])
def test_a_block_mixing_dtypes_to_quantize_is_refused_naming_them_and_what_to_do(mode):
    model = _mixed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    message = (
        r"^model\.blocks\.0 has weights to quantize in more than one dtype \(model\.blocks\.0\.a\.weight bfloat16, "
        r"model\.blocks\.0\.b\.weight float32\), which one pack cannot give back: keep those of one dtype unquantized "
        r"\(skip=\[\.\.\.\] naming their modules\), cast model to one dtype, or use mode='leaf'"
    )
    with pytest.raises(ValueError, match=message) as info:
        _enable(model, mode=mode, budget="1GB")
    assert "\n" not in str(info.value) and not hasattr(model, "_tritoff_engine")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = dequantize_in_place(_mixed(), skip=(r"\.b$",))(x)
        _enable(model, mode=mode, budget="1GB", skip=r"\.b$")  # as the refusal says: the float32 layers kept
        assert torch.equal(model(x), expected)


def test_leaf_mode_mixing_dtypes_across_layers_names_the_smallest_budget():
    # a pack per layer holds one dtype: the planner's refusal names a budget that works, not the group modes' dtypes
    with pytest.raises(BudgetError) as info:
        _enable(_mixed(), mode="leaf", budget=1000)
    assert "mode='group'" not in str(info.value)
    _enable(_mixed(), mode="leaf", budget=info.value.minimum)


def test_leaf_mode_keeps_a_layer_larger_than_the_rest_resident_and_sizes_the_ring_for_the_others():
    # a tiny Wan's fp32 time embedder outweighs every layer tritoff quantizes: three slots of its size would cost
    # more than holding it once, so the smallest budget keeps it (and the time projection) and slots fit the rest
    from tritoff.tiny import tiny_wan_transformer

    def model():
        return tiny_wan_transformer(num_attention_heads=4, attention_head_dim=16, ffn_dim=128)

    with pytest.raises(BudgetError, match=r"the 2 largest groups resident") as info:
        _enable(model(), mode="leaf", budget=1000)
    wan_model = model()
    engine = _enable(wan_model, mode="leaf", budget=info.value.minimum)
    groups = engine.manager.components["model"].blocks
    kept = {g.name for g in groups if g.tier == "bf16"}
    assert kept == {"condition_embedder.time_embedder.linear_1", "condition_embedder.time_proj"}
    assert engine.plan.phases["model"].slot_bytes < min(g.unpacked_bytes for g in groups if g.name in kept)
    assert {g.tier for g in groups if g.name not in kept} == {"stream"}
    call = dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, dtype=torch.bfloat16),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, dtype=torch.bfloat16),
    )
    with torch.no_grad():
        expected = dequantize_in_place(model())(**call).sample
        assert torch.equal(wan_model(**call).sample, expected)


def _float64_stack():
    return stack().to(torch.float64)


def test_float64_weights_come_back_through_the_reference_where_the_kernel_has_no_float64():
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = dequantize_in_place(_float64_stack())(x)
    with pytest.raises(BudgetError) as smallest:
        _enable(_float64_stack(), mode="group", budget=1)
    model = _float64_stack()
    engine = _enable(model, mode="group", budget=smallest.value.minimum, kernels="auto")
    blocks = engine.manager.components["model"].blocks
    assert {g.tier for g in blocks} == {"stream"} and not any(g.use_triton for g in blocks)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with pytest.raises(ValueError, match=r"^kernels='triton' gives fp8 weights back in bf16, fp16 or fp32, and mod"):
        _enable(_float64_stack(), kernels="triton")


def test_two_models_loaded_from_one_state_dict_each_enabled_run_like_any_other():
    # load_state_dict(assign=True) into two models: their weights are the same tensors, sharing version counters
    # across the two engines, whose counts on release must not read as writes to the other's
    state = {k: v.clone() for k, v in stack().state_dict().items()}
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = dequantize_in_place(stack())(x)
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = Stack()
        model.load_state_dict(state, assign=True)
        _enable(model, mode="group", budget=80_000)
        models.append(model)
    with torch.no_grad():
        for model in (*models, *models):
            assert torch.equal(model(x), expected)
        tritoff.disable(models[1])
        assert torch.equal(models[0](x), expected)
        state["blocks.1.0.weight"].fill_(1.0)  # a write through the state dict: refused to the model still enabled
        with pytest.raises(RuntimeError, match=r"^model\.blocks\.1\.0\.weight.* was written in place after"):
            models[0](x)


def test_enabling_a_model_never_sets_the_counts_of_another_engines_weights(monkeypatch):
    # a forward of the other engine may be checking its weights' counts on another thread meanwhile
    from tritoff import onload

    first = stack()
    _enable(first, mode="group", budget=80_000)
    theirs = {id(p) for p in first.parameters()}
    touched = []
    real = onload._set_versions
    monkeypatch.setattr(onload, "_set_versions", lambda tensors, v: touched.extend(tensors) or real(tensors, v))
    _enable(stack(seed=1), mode="group", budget=80_000)
    assert touched and not any(id(t) in theirs for t in touched)


class _WithEmpty(torch.nn.Module):
    """A block whose zero-size parameter sits beside a Linear: packs with an empty entry."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.linear(x) + self.empty.sum()


@pytest.mark.parametrize("mode", ["auto", "group", "leaf"])
@pytest.mark.parametrize("host_budget", [None, 0])
def test_zero_size_parameters_make_empty_packs_that_run_save_and_load(tmp_path, mode, host_budget):
    # a Linear(16, 0) packs to no bytes (its view of the arena has address 0, inside no arena); in leaf mode the
    # zero-size parameter is a group of its own
    def model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 0), torch.nn.Linear(0, 16), _WithEmpty()]
        return torch.nn.Sequential(*layers).eval()

    x = torch.randn(2, 16)
    m = model()
    with torch.no_grad():
        expected = m(x)
    options = dict(mode=mode, device="cpu", storage="bf16", host_budget=host_budget, progress=False)
    engine = enable_at_minimum(m, **options)
    (packed,) = engine.packed.values()
    assert any(p.layout.nbytes == 0 for p in packed.packs)
    with torch.no_grad():
        assert all(torch.equal(m(x), expected) for _ in range(2))
    engine.save(tmp_path / "store")
    tritoff.disable(m)
    with torch.no_grad():
        assert torch.equal(m(x), expected)
    stored = model()
    tritoff.enable(stored, store=str(tmp_path / "store"), **{k: v for k, v in options.items() if k != "storage"})
    with torch.no_grad():
        assert torch.equal(stored(x), expected)
    tritoff.disable(stored)


def test_an_engine_on_the_cpu_page_locks_nothing_on_a_machine_with_cuda(monkeypatch, tmp_path):
    """Page-locking pins host memory for copies to a GPU, and starts a CUDA context: an engine computing on the CPU
    makes no such copies, packed now or read from a store, whatever GPU the machine has."""
    from tritoff import engine as engine_module
    from tritoff.arena import HostArena

    expected = run(dequantized_pipeline(wan))
    locked = []
    monkeypatch.setattr(HostArena, "register", lambda arena: locked.append(arena.nbytes))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # where there is a GPU the weights are quantized on it; here there is none
    monkeypatch.setattr(engine_module, "quantize_device", lambda device=None: torch.device("cpu"))
    options = dict(mode="group", budget="4MB", device="cpu")
    pipe = wan()
    engine = _enable(pipe, **options)
    assert torch.equal(run(pipe), expected)
    engine.save(tmp_path / "store")
    tritoff.disable(pipe)
    stored = wan()
    _enable(stored, store=str(tmp_path / "store"), host_budget="50%", **options)
    assert torch.equal(run(stored), expected)
    tritoff.disable(stored)
    assert locked == []


def test_enabling_on_a_gpu_again_locks_the_packs_a_cpu_engine_made(monkeypatch):
    """A re-enable reuses the packs it finds: those of an engine on the CPU were never page-locked, and copies to a
    GPU from pageable memory wait for it (zero-copy reads cannot run at all), so they are locked then; a re-enable
    refused unlocks what it locked, leaving the CPU engine as it was."""
    from tritoff import engine as engine_module
    from tritoff import options as options_module
    from tritoff import preflight
    from tritoff.arena import HostArena

    failing = set()  # arenas whose lock fails (no host memory left to pin)

    def lock(arena):
        if id(arena) in failing:
            arena.register_error = "CUDA_ERROR_OUT_OF_MEMORY"
        else:
            arena.registered = True

    monkeypatch.setattr(HostArena, "register", lock)
    monkeypatch.setattr(HostArena, "close", lambda arena: setattr(arena, "registered", False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "quantize_device", lambda device=None: torch.device("cpu"))
    expected = run(dequantized_pipeline(wan))
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB", device="cpu")
    arenas = {name: packed.arena for name, packed in engine.packed.items()}
    assert not any(arena.registered for arena in arenas.values())
    # the machine's GPU, as far as the re-enable's checks go
    check_device = options_module.check_device
    monkeypatch.setattr(
        options_module, "check_device", lambda d: torch.device("cuda", 0) if "cuda" in str(d) else check_device(d)
    )
    monkeypatch.setattr(options_module, "device_memory", lambda device: (80 * 2**30, 80 * 2**30))
    monkeypatch.setattr(engine_module, "warn_if_fragmenting", lambda: None)
    gpu = dict(mode="group", budget="4MB", device="cuda", transport="zero_copy")

    failing.add(id(arenas["vae"]))
    with pytest.raises(ValueError, match="needs page-locked host memory, and vae's packs could not be locked"):
        _enable(pipe, **gpu)
    assert not any(arena.registered for arena in arenas.values())  # the others, locked for it, unlocked again
    failing.clear()

    class Checked(Exception):
        pass

    def check_zero_copy(options, packed):  # the last check before anything changes: what zero-copy would read
        raise Checked({name: packed_model.arena.registered for name, packed_model in packed.items()})

    monkeypatch.setattr(preflight, "check_zero_copy", check_zero_copy)
    with pytest.raises(Checked) as seen:
        _enable(pipe, **gpu)
    assert seen.value.args[0] == dict.fromkeys(arenas, True)  # the failed lock tried again
    assert not any(arena.registered for arena in arenas.values())
    assert engine.options.device.type == "cpu" and torch.equal(run(pipe), expected)  # as it was
    tritoff.disable(pipe)


def test_enabling_on_the_cpu_again_unlocks_the_packs_a_gpu_engine_locked(monkeypatch):
    """The packs of an engine on a GPU are page-locked for its copies; a re-enable on the CPU reuses them and makes no
    copies, so it unlocks them (pinned memory cannot be swapped or given to anything else), keeping their bytes."""
    from tritoff.arena import HostArena

    expected = run(dequantized_pipeline(wan))
    monkeypatch.setattr(HostArena, "close", lambda arena: setattr(arena, "registered", False))
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB", device="cpu")
    arenas = [packed.arena for packed in engine.packed.values()]
    for arena in arenas:  # as a GPU engine leaves them
        arena.registered = True
    failed = dict(mode="group", budget="1KB", device="cpu")
    with pytest.raises(tritoff.BudgetError):  # refused: the enabled engine, and its locks, stay as they were
        _enable(pipe, **failed)
    assert all(arena.registered for arena in arenas)
    again = _enable(pipe, mode="group", budget="4MB", device="cpu", prefetch=1)
    assert [packed.arena for packed in again.packed.values()] == arenas  # the same packs, reused
    assert not any(arena.registered for arena in arenas)
    assert torch.equal(run(pipe), expected)

"""LoRA with tritoff: adapters outside the packs, loaded before or after enable, set, fused into the packs (quantized
again exactly as the dequantized reference would be), unfused, unloaded, refused where packs are read-only."""

import pytest
import torch

import tritoff
from tritoff.adapters import merged_adapters, named_parameters, tuner_layers
from tritoff.fingerprint import fingerprint

from .helpers import WAN_CALL, dequantize_in_place, dequantized_pipeline, lora_state_dict, run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

LATENTS = dict(WAN_CALL, num_inference_steps=2, output_type="latent")  # the denoiser is what adapters change
# every attention projection, and proj_out, which is kept unquantized (a copied tensor in its pack)
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_out")


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, progress=False, kernels="reference", **kwargs)


def _lora(seed=1):
    return lora_state_dict(wan().transformer, targets=TARGETS, seed=seed)


@pytest.fixture(scope="module")
def expected():
    """Latents of the dequantized pipeline: plain, with the LoRA, fused (then quantized again, as in the packs),
    unfused (again), and with the LoRA unloaded after that."""
    ref = dequantized_pipeline(wan)
    out = {"plain": run(ref, LATENTS)}
    ref.load_lora_weights(_lora(), adapter_name="style")
    out["lora"] = run(ref, LATENTS)
    ref.fuse_lora(components=["transformer"])
    dequantize_in_place(ref.transformer)
    out["fused"] = run(ref, LATENTS)
    ref.unfuse_lora(components=["transformer"])
    dequantize_in_place(ref.transformer)
    out["unfused"] = run(ref, LATENTS)
    ref.disable_lora()
    out["unfused, disabled"] = run(ref, LATENTS)
    ref.enable_lora()
    ref.unload_lora_weights()
    out["unloaded"] = run(ref, LATENTS)
    assert not torch.equal(out["lora"], out["plain"]) and not torch.equal(out["fused"], out["lora"])
    return out


@pytest.mark.parametrize(
    "mode,budget",
    [
        pytest.param("group", "4MB", id="streamed"),
        pytest.param("group", "6MB", id="fp8-resident"),
        pytest.param("group", "9MB", id="bf16-resident"),
        pytest.param("leaf", "2MB", id="leaf"),
        pytest.param("model", "6MB", id="model"),
    ],
)
def test_lora_loaded_and_fused_after_enable_in_every_mode(expected, mode, budget):
    pipe = wan()
    engine = _enable(pipe, mode=mode, budget=budget)
    pipe.load_lora_weights(_lora(), adapter_name="style")
    assert torch.equal(run(pipe, LATENTS), expected["lora"])
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(run(pipe, LATENTS), expected["fused"])
    # the re-quantized weights are in the report, with their SNR (an fp8 weight: about 31 dB)
    stats = engine.stats
    assert stats["requantized_weights"] == 32  # 4 blocks x 2 attentions x (q, k, v, out); proj_out is copied
    assert all(25 < snr < 40 for snr in stats["requantized_worst_snr_db"].values())
    assert "LoRA fuse/unfuse re-quantized 32 weights" in engine.report()
    tritoff.disable(pipe)  # keeps what was fused
    assert torch.equal(run(pipe, LATENTS), expected["fused"])


def test_unfuse_unload_and_fusing_twice(expected):
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    pipe.fuse_lora(components=["transformer"])  # already fused: nothing changes
    assert torch.equal(run(pipe, LATENTS), expected["fused"])
    pipe.unfuse_lora(components=["transformer"])
    assert torch.equal(run(pipe, LATENTS), expected["unfused"])
    pipe.unload_lora_weights()
    assert torch.equal(run(pipe, LATENTS), expected["unloaded"])
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())


@pytest.mark.parametrize(
    "mode,budget",
    [
        pytest.param("group", "4MB", id="streamed"),
        pytest.param("group", "6MB", id="fp8-resident"),
        pytest.param("leaf", "2MB", id="leaf"),
    ],
)
def test_disable_lora_after_fuse_unfuses_into_the_packs(expected, mode, budget):
    """peft unfuses inside the layer's forward when adapters are disabled with a LoRA fused: there, a streamed
    block's weights are the parameters of the slot it runs from. The unfused weights reach the packs (quantized again,
    as by unfuse_lora) and the slot, so that forward, the next ones and disable all compute without the LoRA."""
    pipe = wan()
    engine = _enable(pipe, mode=mode, budget=budget)
    tiers = engine.plan.tier_counts("transformer")
    assert tiers["stream"] + tiers["fp8"] > 0  # blocks that run from a slot
    pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    pipe.disable_lora()
    assert torch.equal(run(pipe, LATENTS), expected["unfused, disabled"])
    assert torch.equal(run(pipe, LATENTS), expected["unfused, disabled"])
    assert not merged_adapters(pipe.transformer)
    pipe.enable_lora()  # applied once, unfused
    assert torch.equal(run(pipe, LATENTS), expected["unfused"])
    tritoff.disable(pipe)
    assert torch.equal(run(pipe, LATENTS), expected["unfused"])


def test_a_dora_fused_after_a_lora_on_the_same_layer_fuses_like_plain_diffusers():
    # peft's DoRA merge unmerges the adapters merged before it and merges them again, from inside the merge tritoff
    # wraps: bf16 packs hold exactly what plain diffusers' weights hold
    lora = lora_state_dict(wan().transformer, targets=("to_k",), seed=1)
    dora = lora_state_dict(wan().transformer, targets=("to_k",), seed=3, rank=4, use_dora=True)
    weights = []
    for use_tritoff in (False, True):
        pipe = wan()
        if use_tritoff:
            _enable(pipe, storage="bf16", mode="group", budget="6MB")
        pipe.load_lora_weights(lora, adapter_name="a")
        pipe.load_lora_weights(dora, adapter_name="d")
        pipe.set_adapters(["a", "d"], [1.0, 1.0])
        pipe.fuse_lora(components=["transformer"])
        assert merged_adapters(pipe.transformer)
        if use_tritoff:
            tritoff.disable(pipe)
        weights.append([layer.base_layer.weight.detach().clone() for layer in tuner_layers(pipe.transformer)])
    assert len(weights[0]) == 8 and all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def test_disable_lora_after_fuse_with_a_pack_on_disk_is_refused_before_any_layer_changes(tmp_path):
    """peft unfuses layer after layer, each in its forward: one whose pack is on disk refuses the first call after
    disable_lora before any layer changes, not midway (the blocks unfused, proj_out still fused)."""
    fused = wan()
    fused.load_lora_weights(_lora(), adapter_name="style")
    fused.fuse_lora(components=["transformer"])
    expected = run(dequantized_pipeline(lambda: fused), LATENTS)
    pipe = wan()
    pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    engine = _enable(pipe, mode="group", budget="4MB", host_budget="2MB", spill_dir=tmp_path)
    on_disk = [g.name for comp in engine._runtimes for g in comp.groups if g.pack.on_disk]
    assert on_disk == ["<rest>"]  # proj_out's pack, after every block's
    pipe.disable_lora()
    with pytest.raises(ValueError, match=r"proj_out\.weight: its pack is served from disk .*enable_lora") as info:
        run(pipe, LATENTS)
    assert "\n" not in str(info.value)
    assert all(layer.merged for layer in tuner_layers(pipe.transformer))
    pipe.enable_lora()
    assert torch.equal(run(pipe, LATENTS), expected)


def test_ctrl_c_while_an_unfuse_is_stored_waits_for_the_store(expected, monkeypatch, ctrl_c_raises):
    # a Ctrl-C between writing a pack and the end of the store would leave peft saying "fused" over unfused packs,
    # and the next call would take the LoRA out a second time
    import signal

    from tritoff import lora

    write_entry, calls = lora.write_entry, []

    def interrupted(*args, **kwargs):
        write_entry(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)

    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    pipe.disable_lora()
    monkeypatch.setattr(lora, "write_entry", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(pipe, LATENTS)
    monkeypatch.undo()
    assert len(calls) == 1 and sum(not layer.merged for layer in tuner_layers(pipe.transformer)) == 1
    assert torch.equal(run(pipe, LATENTS), expected["unfused, disabled"])
    tritoff.disable(pipe)
    assert torch.equal(run(pipe, LATENTS), expected["unfused, disabled"])


def test_unload_after_fuse_keeps_the_fused_weights(expected):
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    pipe.load_lora_weights(_lora(), adapter_name="style")
    with pytest.raises(ValueError):  # the same adapter name twice: diffusers refuses, nothing changes
        pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    assert torch.equal(run(pipe, LATENTS), expected["fused"])


def test_lora_loaded_before_enable_stays_outside_the_packs(expected):
    pipe = wan()
    pipe.load_lora_weights(_lora(), adapter_name="style")
    adapters = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    engine = _enable(pipe, mode="group", budget="4MB")
    packed = [e.name for p in engine.packed["transformer"].packs for e in p.layout.entries]
    assert not any("lora" in n or "base_layer" in n for n in packed)  # the model's own names, no adapter
    assert "blocks.0.attn1.to_q.weight" in packed
    # adapters keep their flags (tritoff freezes only what it manages) and their memory: not placeholders
    assert all(p.requires_grad and p.untyped_storage().nbytes() >= p.numel() * 2 for p in adapters.values())
    assert not any(p.requires_grad for _, p in named_parameters(pipe.transformer))
    assert fingerprint(pipe.transformer) == fingerprint(wan().transformer)  # a store of the model still matches
    # pipelines run under no_grad: adapters requiring grad do not trip the saved-tensor refusal
    assert torch.equal(run(pipe, LATENTS), expected["lora"])
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(run(pipe, LATENTS), expected["fused"])


def test_two_adapters_set_disable_and_delete():
    a, b = _lora(seed=1), _lora(seed=2)
    ref = dequantized_pipeline(wan)
    ref.load_lora_weights(a, adapter_name="a")
    only_a = run(ref, LATENTS)
    ref.load_lora_weights(b, adapter_name="b")
    ref.set_adapters(["a", "b"], [1.0, 0.5])
    mixed = run(ref, LATENTS)
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    pipe.load_lora_weights(a, adapter_name="a")
    pipe.load_lora_weights(b, adapter_name="b")
    pipe.set_adapters(["a", "b"], [1.0, 0.5])
    assert torch.equal(run(pipe, LATENTS), mixed)
    pipe.delete_adapters("b")
    assert torch.equal(run(pipe, LATENTS), only_a)


def test_bf16_storage_fuses_exactly_like_plain_diffusers():
    lora = _lora()
    ref = wan()
    ref.load_lora_weights(lora, adapter_name="style")
    ref.fuse_lora(components=["transformer"])
    expected = run(ref, LATENTS)
    pipe = wan()
    engine = _enable(pipe, storage="bf16", mode="group", budget="6MB")
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    pipe.load_lora_weights(lora, adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(run(pipe, LATENTS), expected)
    assert engine.stats["requantized_weights"] == 0  # copied, not quantized


def test_a_broken_adapter_is_refused_and_changes_nothing():
    lora = _lora()
    lora["transformer.blocks.2.attn1.to_v.lora_B.weight"][0, 0] = float("nan")
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="6MB")  # fp8-resident blocks and streamed ones
    pipe.load_lora_weights(lora, adapter_name="broken")
    arena = {n: p.arena.buffer.clone() for n, p in engine.packed.items()}
    with pytest.raises(ValueError, match="'broken' has NaN or Inf in its delta for transformer.blocks.2.attn1.to_v"):
        pipe.fuse_lora(components=["transformer"])
    assert all(torch.equal(engine.packed[n].arena.buffer, before) for n, before in arena.items())
    assert merged_adapters(pipe.transformer) == []
    pipe.unload_lora_weights()
    assert torch.equal(run(pipe, LATENTS), run(dequantized_pipeline(wan), LATENTS))


def test_an_adapter_that_overflows_only_at_the_calls_scale_is_refused_before_any_layer_changes():
    lora = _lora()
    b, a = (f"transformer.blocks.2.attn1.to_v.lora_{x}.weight" for x in "BA")
    lora[b], lora[a] = lora[b].clone(), lora[a].clone()
    lora[b][0, 0], lora[a][0, 0] = 1e38, 1.0  # finite, and its delta too, until lora_scale=8 takes it past the largest
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="6MB")
    pipe.load_lora_weights(lora, adapter_name="big")
    arena = {n: p.arena.buffer.clone() for n, p in engine.packed.items()}
    with pytest.raises(ValueError, match="'big' has NaN or Inf in its delta for transformer.blocks.2.attn1.to_v"):
        pipe.fuse_lora(components=["transformer"], lora_scale=8.0)
    assert all(torch.equal(engine.packed[n].arena.buffer, before) for n, before in arena.items())
    assert merged_adapters(pipe.transformer) == []


def test_fusing_into_packs_read_from_a_store_works_and_into_packs_on_disk_is_refused(tmp_path, expected):
    engine = _enable(wan(), mode="group", budget="4MB")
    engine.save(tmp_path / "store")
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB", store=tmp_path / "store")  # every pack read into host memory
    pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(run(pipe, LATENTS), expected["fused"])
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB", store=tmp_path / "store", host_budget=0)  # every pack on disk
    pipe.load_lora_weights(_lora(), adapter_name="style")
    with pytest.raises(ValueError, match="served from disk") as info:
        pipe.fuse_lora(components=["transformer"])
    assert "\n" not in str(info.value)
    assert merged_adapters(pipe.transformer) == []
    assert torch.equal(run(pipe, LATENTS), expected["lora"])  # the unfused LoRA still works
    # a LoRA fused before enable(store=...) would be silently replaced by the store's weights: refused
    fused = wan()
    fused.load_lora_weights(_lora(), adapter_name="style")
    fused.fuse_lora(components=["transformer"])
    with pytest.raises(ValueError, match="fused into its weights") as info:
        _enable(fused, mode="group", budget="4MB", store=tmp_path / "store")
    assert "\n" not in str(info.value) and not hasattr(fused, "_tritoff_engine")


def _merged(module):
    return {n: list(m.merged_adapters) for n, m in module.named_modules() if hasattr(m, "merged_adapters")}


@pytest.mark.parametrize("caller", ["pipeline", "component"])
def test_unfusing_with_packs_on_disk_is_refused_before_any_layer_changes(tmp_path, caller):
    pipe = wan()
    pipe.load_lora_weights(_lora(), adapter_name="style")
    pipe.fuse_lora(components=["transformer"])  # before enable: the fused weights are packed
    engine = _enable(pipe, mode="group", budget="6MB", host_budget="1MB", spill_dir=str(tmp_path))
    places = [(g.name, g.pack.on_disk) for g in next(c for c in engine._runtimes if c.name == "transformer").blocks]
    assert any(disk for _, disk in places) and not all(disk for _, disk in places), places  # some blocks unfuse
    merged, arena, before = _merged(pipe.transformer), engine.packed["transformer"].arena.buffer.clone(), run(pipe)
    unfuse = pipe.unfuse_lora if caller == "pipeline" else pipe.transformer.unfuse_lora
    for _ in range(2):  # and again: nothing was left half done
        with pytest.raises(ValueError, match=r"cannot unfuse a LoRA from transformer\..*nothing was unfused.*fused$"):
            unfuse(components=["transformer"]) if caller == "pipeline" else unfuse()
    assert _merged(pipe.transformer) == merged and engine.requantized == {}
    assert torch.equal(engine.packed["transformer"].arena.buffer, arena) and torch.equal(run(pipe), before)


def test_fusing_one_expert_checks_that_expert_only(tmp_path):
    pipe = wan(two_experts=True)
    engine = _enable(pipe, mode="group", budget="6MB", host_budget="3MB", spill_dir=str(tmp_path))
    disk = {c.name: any(g.pack.on_disk for g in c.groups) for c in engine._runtimes}
    assert not disk["transformer"] and disk["transformer_2"], disk
    lora = _lora()
    broken = {k: v.clone() for k, v in lora.items()}
    broken["transformer.blocks.2.attn1.to_v.lora_B.weight"][0, 0] = float("nan")
    pipe.load_lora_weights(lora, adapter_name="style")
    pipe.load_lora_weights(broken, adapter_name="style", load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer"])  # transformer_2's packs on disk and NaN adapter are not in the way
    assert set(sum(_merged(pipe.transformer).values(), [])) == {"style"}
    assert set(sum(_merged(pipe.transformer_2).values(), [])) == set()
    # refused there, for either: a pack on disk, or the NaN adapter of blocks.2
    with pytest.raises(ValueError, match=r"transformer_2\.blocks\.\d.*nothing was fused"):
        pipe.fuse_lora(components=["transformer_2"])
    pipe.unfuse_lora(components=["transformer"])
    assert set(sum(_merged(pipe.transformer).values(), [])) == set()


def test_adapters_requiring_grad_are_refused_under_grad_mode_not_silently_wrong():
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    pipe.load_lora_weights(_lora(), adapter_name="style")
    inputs = dict(
        hidden_states=torch.randn(1, 16, 2, 4, 4, dtype=torch.bfloat16),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, dtype=torch.bfloat16),
    )
    with torch.no_grad():
        pipe.transformer(**inputs)
    with pytest.raises(RuntimeError, match="autograd would save a weight that lives in a reused GPU slot"):
        pipe.transformer(**inputs)
    with torch.no_grad():  # the refusal left nothing held
        pipe.transformer(**inputs)


@pytest.mark.parametrize("before", [True, False], ids=["loaded-before-enable", "loaded-after-enable"])
def test_dora_in_leaf_mode_hooks_around_the_adapter(before):
    """DoRA reads the base weight outside the base layer's forward: in leaf mode the layer's hook moves to the tuner
    layer peft wraps it in (and back when the adapter is unloaded)."""
    dora = lora_state_dict(wan().transformer, targets=("to_q", "to_k"), use_dora=True)
    assert any("lora_magnitude_vector" in k for k in dora)
    ref = dequantized_pipeline(wan)
    plain = run(ref, LATENTS)
    ref.load_lora_weights(dora, adapter_name="dora")
    expected = run(ref, LATENTS)
    ref.fuse_lora(components=["transformer"])
    dequantize_in_place(ref.transformer)
    expected_fused = run(ref, LATENTS)
    pipe = wan()
    if before:
        pipe.load_lora_weights(dora, adapter_name="dora")
    engine = _enable(pipe, mode="leaf", budget="2MB")
    if not before:
        pipe.load_lora_weights(dora, adapter_name="dora")
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    adapted = pipe.transformer.blocks[0].attn1.to_q
    assert hasattr(adapted, "_hf_hook") and not hasattr(adapted.base_layer, "_hf_hook")
    assert torch.equal(run(pipe, LATENTS), expected)
    pipe.unload_lora_weights()
    assert hasattr(pipe.transformer.blocks[0].attn1.to_q, "_hf_hook")  # back on the plain layer
    assert torch.equal(run(pipe, LATENTS), plain)
    pipe.load_lora_weights(dora, adapter_name="dora")
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(run(pipe, LATENTS), expected_fused)


def test_adapters_of_a_model_tritoff_does_not_manage_stay_peft_s_own():
    """Another model given a LoRA while an engine lives keeps peft's merge: it pickles, and a copy fuses into itself."""
    import copy
    import io

    from peft import LoraConfig, inject_adapter_in_model

    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    other = torch.nn.Sequential(torch.nn.Linear(8, 8))
    config = LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)
    other = inject_adapter_in_model(config, other)
    assert "merge" not in vars(other[0])
    torch.save(other, io.BytesIO())
    weight = other[0].base_layer.weight.detach().clone()
    twin = copy.deepcopy(other)
    twin[0].merge()
    assert torch.equal(other[0].base_layer.weight, weight) and not torch.equal(twin[0].base_layer.weight, weight)
    pipe.load_lora_weights(_lora(), adapter_name="style")  # the enabled pipeline's own layers are still wrapped
    assert all("merge" in vars(layer) for layer in tuner_layers(pipe.transformer))


def test_an_enable_interrupted_after_wrapping_the_adapters_gives_peft_its_merge_back(monkeypatch):
    import copy

    from tritoff import operations

    pipe = wan()
    pipe.load_lora_weights(_lora(), adapter_name="style")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(operations, "install", interrupted)  # after lora.attach wrapped every tuner layer
    with pytest.raises(KeyboardInterrupt):
        _enable(pipe, mode="group", budget="4MB")
    monkeypatch.undo()
    layers = tuner_layers(pipe.transformer)
    assert layers and not any("merge" in vars(layer) or "unmerge" in vars(layer) for layer in layers)
    twin = copy.deepcopy(pipe.transformer)  # an ordinary model again: a copy fuses into itself
    weight = layers[0].get_base_layer().weight.detach().clone()
    twin.fuse_lora()
    assert torch.equal(layers[0].get_base_layer().weight, weight)


def test_a_lora_loaded_while_enabled_leaves_the_weights_frozen_after_disable_as_peft_does():
    """peft freezes a model's own weights as it injects an adapter; loaded while enabled, the adapter finds them
    frozen by tritoff, so disable keeps them frozen (it gives back the flags saved at enable otherwise)."""
    plain = wan()
    plain.load_lora_weights(_lora(), adapter_name="style")
    pipe = wan()
    _enable(pipe, mode="group", budget="4MB")
    pipe.load_lora_weights(_lora(), adapter_name="style")
    tritoff.disable(pipe)
    for name in ("transformer", "text_encoder", "vae"):
        flags = {n: p.requires_grad for n, p in getattr(pipe, name).named_parameters()}
        assert flags == {n: p.requires_grad for n, p in getattr(plain, name).named_parameters()}, name
        # the transformer's weights frozen, its adapters trainable; the components without adapters as they were
        assert any(flags.values()) and (name == "transformer") != all(flags.values()), name

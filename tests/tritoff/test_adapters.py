"""tritoff/adapters.py: with peft's LoRA layers injected, the model's own modules and parameters keep the names and
objects they had before, and the adapters' layers, parameters and bytes are found exactly."""

import sys

import pytest
import torch

from tritoff import adapters
from tritoff.adapters import (
    adapter_bytes,
    adapter_parameters,
    is_tuner_layer,
    merged_adapters,
    move_adapters,
    named_modules,
    named_parameters,
    outer_modules,
    tuner_layer_class,
    tuner_layers,
)
from tritoff.tiny import tiny_wan_transformer

from .helpers import lora_state_dict

# peft is a test extra: a machine without it skips this file rather than failing the whole collection
BaseTunerLayer = pytest.importorskip("peft.tuners.tuners_utils").BaseTunerLayer

pytestmark = [
    pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute"),
    pytest.mark.filterwarnings("ignore:Already following adapters were merged"),
]

QKV = ("to_q", "to_k", "to_v")
# the tiny Wan transformer: 2 blocks, each with a self- (attn1) and a cross-attention (attn2), all 24 wide
ADAPTED = {f"blocks.{b}.{attn}.{proj}" for b in (0, 1) for attn in ("attn1", "attn2") for proj in QKV}
BF16 = 2


def _transformer(seed=0):
    return tiny_wan_transformer(seed=seed)


def _with_lora(model, name="style", targets=QKV, rank=2, seed=1, use_dora=False):
    """``model`` with a LoRA loaded the way ``pipe.load_lora_weights`` loads it into the transformer."""
    lora = lora_state_dict(model, targets=targets, rank=rank, seed=seed, use_dora=use_dora)
    model.load_lora_adapter(lora, adapter_name=name, prefix="transformer")
    return model


@pytest.fixture(scope="module")
def plain():
    """Names and objects of the tiny transformer before any adapter, and the same model with a rank-2 LoRA."""
    model = _transformer()
    modules = list(model.named_modules())
    params = list(model.named_parameters())
    return modules, params, _with_lora(model)


def test_tuner_layer_class_is_pefts_base_tuner_layer():
    assert tuner_layer_class() is BaseTunerLayer


def test_the_tuner_layers_are_exactly_the_adapted_projections(plain):
    _, _, model = plain
    found = {name for name, module in model.named_modules() if module in tuner_layers(model)}
    assert found == ADAPTED
    assert len(tuner_layers(model)) == 12
    assert {name for name, module in model.named_modules() if is_tuner_layer(module)} == ADAPTED
    assert not is_tuner_layer(model.blocks[0].attn1.to_q.base_layer)  # the wrapped Linear is not one
    assert not is_tuner_layer(model.blocks[0].attn1.to_out[0])  # a projection the LoRA does not target


def test_named_modules_are_the_modules_before_injection_with_base_layers_in_place(plain):
    modules, _, model = plain
    now = list(named_modules(model))
    assert [n for n, _ in now] == [n for n, _ in modules]  # same names, same order: no base_layer, no lora_A
    assert all(a is b for (_, a), (_, b) in zip(now, modules, strict=True))  # and the same module objects
    assert dict(now)["blocks.0.attn1.to_q"] is model.blocks[0].attn1.to_q.base_layer


def test_outer_modules_are_the_tuner_layers_where_a_layer_is_adapted(plain):
    modules, _, model = plain
    outer = outer_modules(model)
    assert list(outer) == [n for n, _ in modules]
    for name, module in outer.items():
        if name in ADAPTED:
            assert is_tuner_layer(module) and module is model.get_submodule(name), name  # what the parent calls
        else:
            assert module is dict(modules)[name], name


def test_named_parameters_are_the_models_own_under_their_names_before_injection(plain):
    _, params, model = plain
    now = list(named_parameters(model))
    assert [n for n, _ in now] == [n for n, _ in params]  # blocks.0.attn1.to_q.weight, not ...base_layer.weight
    assert all(a is b for (_, a), (_, b) in zip(now, params, strict=True))
    assert not any("lora" in n or "base_layer" in n for n, _ in now)


def test_adapter_parameters_are_exactly_the_lora_weights_and_their_bytes_are_counted(plain):
    _, params, model = plain
    lora = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    assert len(lora) == 24  # lora_A and lora_B in each of the 12 adapted layers
    found = adapter_parameters(model)
    assert {id(p) for p in found} == {id(p) for p in lora.values()} and len(found) == 24
    assert not {id(p) for p in found} & {id(p) for _, p in params}
    # each layer: A (2 x 24) and B (24 x 2), in bf16 like the base layer
    assert {p.dtype for p in found} == {torch.bfloat16}
    assert adapter_bytes(model) == 12 * (2 * 24 + 24 * 2) * BF16 == 2304


@pytest.mark.parametrize(
    "loras,count,numel",
    [
        pytest.param([dict(use_dora=True)], 36, 12 * (2 * 24 + 24 * 2 + 24), id="dora-adds-a-magnitude-vector"),
        pytest.param(
            [dict(), dict(name="detail", targets=("to_q",), rank=4, seed=2)],
            24 + 8,
            12 * (2 * 24 + 24 * 2) + 4 * (4 * 24 + 24 * 4),
            id="two-adapters",
        ),
    ],
)
def test_adapter_bytes_add_up_every_adapter_parameter(loras, count, numel):
    model = _transformer()
    own = [p for _, p in model.named_parameters()]
    for lora in loras:
        _with_lora(model, **lora)
    assert len(adapter_parameters(model)) == count
    assert adapter_bytes(model) == numel * BF16
    assert [p for _, p in named_parameters(model)] == own  # identity-wise too: nothing of the model moved out


def test_a_model_without_adapters_is_its_own_named_modules_and_parameters():
    model = _transformer()
    model.alias = model.blocks[0].ffn  # a module reachable under two names is listed once, as torch lists it
    assert [n for n, _ in named_modules(model)] == [n for n, _ in model.named_modules()]
    outer = outer_modules(model)
    assert all(outer[name] is module for name, module in model.named_modules())
    assert [(n, id(p)) for n, p in named_parameters(model)] == [(n, id(p)) for n, p in model.named_parameters()]
    assert tuner_layers(model) == [] and adapter_parameters(model) == []
    assert adapter_bytes(model) == 0 and merged_adapters(model) == []


def test_merged_adapters_name_the_fused_adapters_sorted():
    model = _with_lora(_with_lora(_transformer(), name="style"), name="detail", targets=("to_q",), seed=2)
    assert merged_adapters(model) == []
    model.fuse_lora(adapter_names=["style"])
    assert merged_adapters(model) == ["style"]
    model.fuse_lora(adapter_names=["detail"])
    assert merged_adapters(model) == ["detail", "style"]
    model.unfuse_lora()
    assert merged_adapters(model) == []


def test_fusing_changes_the_base_weights_in_place_under_the_same_names():
    model = _with_lora(_transformer())
    before = {n: p.detach().clone() for n, p in named_parameters(model)}
    objects = {n: id(p) for n, p in named_parameters(model)}
    model.fuse_lora(adapter_names=["style"])
    after = dict(named_parameters(model))
    assert {n: id(p) for n, p in after.items()} == objects
    changed = {n for n, p in after.items() if not torch.equal(p, before[n])}
    assert changed == {f"{name}.weight" for name in ADAPTED}  # LoRA changes the weights it targets, not the biases


def test_without_peft_no_module_is_a_tuner_layer(monkeypatch):
    model = _with_lora(_transformer())  # peft's layers are there, but tritoff cannot know them
    monkeypatch.setattr(adapters, "_TUNER", [])  # forget the cached class
    monkeypatch.setitem(sys.modules, "peft.tuners.tuners_utils", None)  # the import fails as without peft
    assert tuner_layer_class() is None
    assert tuner_layers(model) == [] and not is_tuner_layer(model.blocks[0].attn1.to_q)
    assert [n for n, _ in named_parameters(model)] == [n for n, _ in model.named_parameters()]
    assert adapter_parameters(model) == []


@pytest.mark.gpu
def test_move_adapters_moves_only_the_adapter_parameters_and_keeps_them_the_same_objects():
    model = _with_lora(_transformer())
    found = adapter_parameters(model)
    cuda = torch.device("cuda", torch.cuda.current_device())
    move_adapters(model, cuda)
    assert [id(p) for p in adapter_parameters(model)] == [id(p) for p in found]
    assert all(p.device == cuda and p.dtype == torch.bfloat16 for p in found)
    assert all(p.device.type == "cpu" for _, p in named_parameters(model))

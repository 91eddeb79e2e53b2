"""tritoff/engine.py lifecycle: enable, enable again, disable, teardown; a refused or failed step changes nothing."""

import pytest
import torch

import tritoff
import tritoff.engine as engine_module
from tritoff.onload import is_placeholder
from tritoff.planner import BudgetError

from .helpers import dequantize_in_place, stack

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


class Pipe:
    """What tritoff reads of a diffusers pipeline: ``components``, here the modules given by name."""

    def __init__(self, **modules):
        self.names = list(modules)
        self.__dict__.update(modules)

    @property
    def components(self):
        return {name: getattr(self, name) for name in self.names}


def _enable(target, **kwargs):
    kwargs = {"mode": "group", "budget": 10**6, "reserve": 1000, **kwargs}
    return tritoff.enable(target, progress=False, kernels="reference", **kwargs)


def _output(model):
    with torch.no_grad():
        return model(X)


def _expected(seed=0):
    return _output(dequantize_in_place(stack(seed)))


def _snapshot(modules):
    return {
        (i, n): (p, p.detach().clone(), p.requires_grad) for i, m in enumerate(modules) for n, p in m.named_parameters()
    }


def _unchanged(modules, before) -> bool:
    now = {(i, n): p for i, m in enumerate(modules) for n, p in m.named_parameters()}
    return now.keys() == before.keys() and all(
        now[k] is p and torch.equal(p, value) and p.requires_grad == flag for k, (p, value, flag) in before.items()
    )


def test_enabling_again_after_replacing_a_component_is_refused():
    pipe = Pipe(transformer=stack())
    engine = _enable(pipe)
    replacement = stack(seed=1)
    pipe.transformer = replacement
    before = _snapshot([replacement])
    with pytest.raises(ValueError, match="transformer changed since tritoff.enable") as info:
        _enable(pipe, budget=2 * 10**6)
    assert "\n" not in str(info.value)
    assert pipe._tritoff_engine is engine and _unchanged([replacement], before)
    tritoff.disable(pipe)  # what the error says: disable, then enable again
    _enable(pipe)
    assert torch.equal(_output(replacement), _expected(seed=1))  # the new weights, not the old packs


def test_a_parameter_shared_by_two_components_is_refused_before_anything_changes():
    transformer, text_encoder = stack(), stack(seed=1)
    text_encoder.head.weight = transformer.head.weight
    pipe = Pipe(transformer=transformer, text_encoder=text_encoder)
    before = _snapshot([transformer, text_encoder])
    with pytest.raises(ValueError, match="transformer.head.weight and text_encoder.head.weight are one parameter"):
        _enable(pipe)
    assert not hasattr(pipe, "_tritoff_engine") and _unchanged([transformer, text_encoder], before)


def test_a_module_shared_with_an_enabled_model_is_refused_even_without_a_hook():
    first, second = stack(), stack(seed=1)
    second.head = first.head  # in first's rest group: no hook of its own
    _enable(first)
    before = _snapshot([second.blocks, second.proj_in])
    with pytest.raises(ValueError, match="model.head.weight is already managed by tritoff"):
        _enable(second)
    with pytest.raises(ValueError, match="model.weight is already managed by tritoff"):
        _enable(first.proj_in)  # a submodule of an enabled model
    assert not hasattr(second, "_tritoff_engine") and _unchanged([second.blocks, second.proj_in], before)
    assert torch.equal(_output(first), _expected())
    tritoff.disable(first)
    _enable(second)  # once the first is disabled, the module is free


@pytest.mark.parametrize("first,second", [("group", "leaf"), ("leaf", "group")])
def test_a_failed_re_enable_switching_grouping_leaves_tritoff_enabled(first, second):
    model = stack()
    engine = _enable(model, mode=first)
    expected = _expected()
    assert torch.equal(_output(model), expected)
    with pytest.raises(BudgetError):
        _enable(model, mode=second, budget=1000)
    assert model._tritoff_engine is engine
    assert not any(p.requires_grad for p in model.parameters())
    assert torch.equal(_output(model), expected) and torch.equal(_output(model), expected)
    _enable(model, mode=second)  # a valid switch re-packs, exactly
    assert torch.equal(_output(model), expected)


@pytest.mark.parametrize("device", ["meta", "cuda:99", "nonsense"])
def test_disable_to_an_unusable_device_changes_nothing(device):
    model = stack()
    engine = _enable(model)
    with pytest.raises(ValueError) as info:
        tritoff.disable(model, device=device)
    assert "\n" not in str(info.value)
    assert model._tritoff_engine is engine and hasattr(model, "_hf_hook")
    assert torch.equal(_output(model), _expected())


def _out_of_memory_after(monkeypatch, calls: int):
    """Make the dequantization of the ``calls``-th pack (and every later one) run out of device memory."""
    original, seen = engine_module._dequantized, []

    def dequantized(pack, device):
        seen.append(pack)
        if len(seen) >= calls:
            raise torch.OutOfMemoryError("simulated: no room on the device")
        return original(pack, device)

    monkeypatch.setattr(engine_module, "_dequantized", dequantized)


def test_a_disable_that_runs_out_of_memory_leaves_tritoff_enabled(monkeypatch):
    model = stack()
    engine = _enable(model)
    expected = _expected()
    assert torch.equal(_output(model), expected)
    _out_of_memory_after(monkeypatch, calls=3)  # two blocks restored, then no room
    with pytest.raises(torch.OutOfMemoryError, match="do not fit on cpu: tritoff stays enabled") as info:
        tritoff.disable(model)
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    assert model._tritoff_engine is engine and hasattr(model, "_hf_hook")
    assert not any(p.requires_grad for p in model.parameters())
    assert torch.equal(_output(model), expected) and torch.equal(_output(model), expected)
    tritoff.disable(model)
    assert not hasattr(model, "_tritoff_engine") and all(p.requires_grad for p in model.parameters())
    assert torch.equal(_output(model), expected)


def test_a_failed_enable_restores_the_weights_on_the_cpu_when_the_device_has_no_room(monkeypatch):
    model = stack()

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: the GPU is full")

    monkeypatch.setattr(engine_module, "HookManager", no_memory)
    original, calls = engine_module._dequantized, []

    def dequantized(pack, device):  # the first restore runs out of memory too; the second, on the CPU, works
        calls.append(device)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("simulated: still full")
        return original(pack, device)

    monkeypatch.setattr(engine_module, "_dequantized", dequantized)
    with pytest.raises(torch.OutOfMemoryError, match="the GPU is full"):
        _enable(model)
    monkeypatch.undo()
    assert not hasattr(model, "_tritoff_engine") and not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert not any(is_placeholder(p) for p in model.parameters()) and all(p.requires_grad for p in model.parameters())
    assert torch.equal(_output(model), _expected())


@pytest.mark.parametrize("then", ["disable", "enable"])
def test_a_torn_down_engine_refuses_to_run_until_disabled_or_enabled_again(then):
    model = stack()
    engine = _enable(model)
    expected = _expected()
    engine.teardown()
    assert any(is_placeholder(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"holds no weights: its tritoff engine was torn down.*tritoff.disable"):
        _output(model)
    engine.teardown()  # once only: no second guard
    if then == "disable":
        tritoff.disable(model)
        assert not model._forward_pre_hooks and not any(is_placeholder(p) for p in model.parameters())
    else:
        again = _enable(model)
        assert again is not engine and len(model._forward_pre_hooks) == 0
    assert torch.equal(_output(model), expected)


def test_teardown_of_a_replaced_or_disabled_engine_does_nothing():
    model = stack()
    old = _enable(model, mode="auto", budget=10**8)
    new = _enable(model, mode="auto", budget=2 * 10**8)  # old is torn down and replaced
    expected = _expected()
    assert torch.equal(_output(model), expected)
    old.teardown()
    assert model._tritoff_engine is new and torch.equal(_output(model), expected)
    tritoff.disable(model)
    old.teardown()
    new.teardown()
    assert not any(is_placeholder(p) for p in model.parameters())
    assert torch.equal(_output(model), expected)


def _disable_or_enable(call, model):
    """``tritoff.disable(model)``, or ``enable`` again in other groups (leaf), as ``call`` says."""
    tritoff.disable(model) if call == "disable" else _enable(model, mode="leaf")


@pytest.mark.parametrize("call", ["disable", "enable"])
def test_disable_or_enable_from_inside_a_forward_is_refused_and_the_next_call_is_exact(call):
    # the running forward would go on with its hooks gone; between calls (a pipeline's step callback) both work
    model = stack()
    _enable(model)
    expected = _expected()

    handle = model.blocks[1].register_forward_hook(lambda module, args, output: _disable_or_enable(call, model))
    with pytest.raises(RuntimeError, match=f"tritoff.{call} was called during a forward of Stack"):
        _output(model)
    handle.remove()
    assert torch.equal(_output(model), expected)
    _disable_or_enable(call, model)  # after the call: works
    assert torch.equal(_output(model), expected)


@pytest.mark.parametrize("call", ["disable", "enable"])
def test_disable_or_enable_from_a_forward_pre_hook_of_the_root_runs_the_forward_it_leaves(call):
    # the root's pre-hooks run after its call took the hooked forward, before the forward counts as running
    model = stack()
    _enable(model)
    expected = _expected()

    handle = model.register_forward_pre_hook(lambda module, args: _disable_or_enable(call, model))
    assert torch.equal(_output(model), expected)
    handle.remove()
    assert hasattr(model, "_tritoff_engine") == (call == "enable")
    assert torch.equal(_output(model), expected)

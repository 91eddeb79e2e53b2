"""tritoff/sizing.py: what the planner is given about the components, and the smallest budget it names."""

import pytest
import torch

import tritoff
from tritoff.formats import get_format
from tritoff.groups import REST
from tritoff.packer import plan_layouts
from tritoff.planner import BudgetError, plan_phases
from tritoff.sizing import groups_for, looped, minimum_for, shared_bytes, sizes_of
from tritoff.skip import SkipRules

from .helpers import enable_at_minimum, stack


def _layouts(components, group_lists):
    fmt = get_format("fp8_e4m3")
    return {
        name: plan_layouts(group_lists[name], SkipRules.for_model(m, ()).quantized_names(m), fmt, "row")
        for name, m in components.items()
    }


def test_groups_are_the_blocks_and_the_rest_or_each_leaf_layer():
    model = stack(n=3)
    assert [g.name for g in groups_for(model, "group")] == ["blocks.0", "blocks.1", "blocks.2", REST]
    assert [g.name for g in groups_for(model, "model")] == [g.name for g in groups_for(model, "group")]
    leaves = groups_for(model, "leaf")
    assert len(leaves) == 3 * 2 + 2 and all(len(g.modules) == 1 for g in leaves)  # two Linears a block, in and head


def test_a_model_without_block_lists_streams_its_layers_in_group_mode():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    assert [len(g.modules) for g in groups_for(model, "group")] == [1, 1]


def test_a_split_component_has_blocks_and_a_rest_and_model_mode_moves_it_whole():
    components = {"transformer": stack(n=4)}
    lists = {n: groups_for(m, "group") for n, m in components.items()}
    layouts = _layouts(components, lists)
    (split,) = sizes_of(components, lists, layouts, "group")
    assert [b.name for b in split.blocks] == [f"blocks.{i}" for i in range(4)] and split.rest.name == REST
    assert split.looped and all(b.packed < b.unpacked for b in split.blocks)  # fp8 codes and scales, bf16 out
    (whole,) = sizes_of(components, lists, layouts, "model")
    assert not whole.blocks and whole.rest.name == "transformer"
    assert whole.rest.packed == sum(s.packed for s in [*split.blocks, split.rest])
    assert whole.rest.unpacked == sum(s.unpacked for s in [*split.blocks, split.rest])


def test_denoisers_are_called_again_and_again_encoders_once():
    assert looped("transformer") and looped("transformer_2") and looped("unet") and looped("model")
    assert not looped("text_encoder") and not looped("vae")


def test_the_shared_bytes_count_the_buffers_and_the_kernel_tables():
    model = stack(n=2)
    model.register_buffer("table", torch.zeros(1000, dtype=torch.float32))
    components = {"model": model}
    lists = {"model": groups_for(model, "group")}
    layouts = _layouts(components, lists)
    sizes = sizes_of(components, lists, layouts, "group")
    chunks, fixed = shared_bytes(sizes, lists, layouts, components, staged=True, zero_copy=False, depth=2)
    assert chunks["model"] > 0 and fixed > 4000  # the buffer, plus a table per group


@pytest.mark.parametrize("mode", ["group", "leaf", "model"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_minimum_named_plans_and_one_byte_less_does_not(mode, prefetch):
    components = {"model": stack(n=4)}
    lists = {"model": groups_for(components["model"], mode)}
    layouts = _layouts(components, lists)
    reserves = {"model": 4096}
    minimum = minimum_for(components, lists, layouts, reserves)(mode, prefetch)
    sizes = sizes_of(components, lists, layouts, mode)
    _, fixed = shared_bytes(sizes, lists, layouts, components, staged=True, zero_copy=False, depth=prefetch)
    plan_phases(sizes, minimum, mode, prefetch, reserves, True, None, fixed)
    with pytest.raises(BudgetError):
        plan_phases(sizes, minimum - 1, mode, prefetch, reserves, True, None, fixed)


def _weight_normed(make, n=3):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[make(torch.nn.Linear(16, 16)) for _ in range(n)]).eval()


@pytest.mark.parametrize("fn", ["weight_norm", "spectral_norm"])
def test_a_hooked_module_computing_its_weight_in_a_pre_hook_is_refused_and_left_as_it_was(fn):
    # nn.Module.__call__ runs torch.nn.utils.weight_norm's pre-hook before the forward tritoff hooks: it would read
    # placeholders (NaN on the first call)
    make = getattr(torch.nn.utils, fn)
    x = torch.randn(2, 16)
    for model, mode, where in (
        (make(torch.nn.Linear(16, 16)).eval(), "auto", "model"),
        (_weight_normed(make), "leaf", "model.0"),
    ):
        with torch.no_grad():
            expected = model(x)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(
            ValueError, match=rf"^{where} computes its weight in torch.nn.utils.{fn}'s forward pre-hook"
        ):
            tritoff.enable(model, mode=mode, device="cpu", progress=False)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    # inside a block (mode "group"), the layer's hook runs inside the block's forward, after its weights are loaded
    model = torch.nn.Sequential(*[torch.nn.Sequential(_weight_normed(make, 1), torch.nn.ReLU()) for _ in range(3)])
    with torch.no_grad():
        expected = model.eval()(x)
    engine = enable_at_minimum(model, mode="group", device="cpu", storage="bf16", progress=False)
    assert engine.plan.tier_counts("model")["stream"] > 0
    with torch.no_grad():
        assert all(torch.equal(model(x), expected) for _ in range(2))

"""tritoff/onload.py: a group's upcasts run on the grid chosen when the pipeline was enabled."""

import pytest
import torch

import tritoff
from tritoff import onload
from tritoff.kernels import upcast as upcast_kernels

from .helpers import dequantize_in_place, stack

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def test_the_upcast_grid_bound_is_read_at_enable_and_given_to_every_upcast(monkeypatch):
    # UPCAST_PROGRAMS bounds the HBM-side upcasts' grid (compiled kernels only); a change after enable is not seen
    grids = []
    original = onload.upcast_pack

    def spy(*args, **kwargs):
        grids.append(kwargs["programs"])
        return original(*args, **kwargs)

    monkeypatch.setattr(onload, "upcast_pack", spy)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = dequantize_in_place(stack())(x)
    monkeypatch.setattr(upcast_kernels, "UPCAST_PROGRAMS", 3)
    model = stack()
    engine = tritoff.enable(model, mode="group", budget="1GB", progress=False)
    monkeypatch.setattr(upcast_kernels, "UPCAST_PROGRAMS", 0)
    with torch.no_grad():
        out = model(x)
    assert grids and set(grids) == {3}
    assert all(g.upcast_programs == 3 for g in engine.manager.components["model"].blocks)
    assert torch.equal(out, expected)


def test_an_upcast_grid_bound_that_is_not_a_count_is_refused_at_enable(monkeypatch):
    monkeypatch.setattr(upcast_kernels, "UPCAST_PROGRAMS", -1)
    model = stack()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="^UPCAST_PROGRAMS must be an int >= 0"):
        tritoff.enable(model, mode="group", budget="1GB", progress=False)
    assert not hasattr(model, "_tritoff_engine")
    assert all(p is before[n][0] and torch.equal(p, before[n][1]) for n, p in model.named_parameters())


def test_placeholders_first_made_under_inference_mode_can_be_reset_outside_it(monkeypatch):
    # the scalars behind every placeholder outlive the engine that made them: an inference tensor among them would make
    # every later reset (each disable runs one) fail outside inference mode
    monkeypatch.setattr(onload, "_SCALARS", {})
    with torch.inference_mode():
        empty = onload.placeholder((3, 4), torch.bfloat16, torch.device("cpu"))
    assert not empty.is_inference()
    with torch.no_grad():
        empty.fill_(1.0)  # a write that lands on the shared scalar
    onload.reset_placeholders()
    assert onload.is_placeholder(empty) and torch.isnan(empty).all()


def test_parameters_sharing_a_version_counter_are_found_and_their_counts_kept():
    base = torch.zeros(4, 8)
    base.add_(1)  # a count of 1 on the counter its views share
    first, second = torch.nn.Parameter(base[:2]), torch.nn.Parameter(base[2:])
    alone = torch.nn.Parameter(torch.zeros(3))
    alias = torch.nn.Parameter(first)  # a parameter made from another shares its counter too
    params = [first, alone, second, alias]
    assert onload.shared_versions(params) == [[0, 2, 3]]
    assert [p._version for p in params] == [1, 0, 1, 1]  # given back as they were
    assert onload.shared_versions([alone, torch.nn.Parameter(torch.zeros(2))]) == []


def test_other_tensors_are_only_read_and_found_where_they_share_a_counter_with_the_parameters():
    base = torch.zeros(4, 8)
    mine = [torch.nn.Parameter(base[:2]), torch.nn.Parameter(torch.zeros(3))]
    sharing, apart = torch.nn.Parameter(base[2:]), torch.nn.Parameter(torch.zeros(5))
    apart.data.add_(1)  # a count of its own, never a mark: .data writes count none, so give it one through autograd
    torch.autograd.graph.increment_version(apart)
    assert onload.shared_versions(mine, [apart, sharing]) == [[0, 3]]  # indices into mine, then the others
    assert apart._version == 1 and sharing._version == 0 and mine[1]._version == 0
    assert onload.shared_versions([], [sharing, mine[0]]) == []  # only counters shared with the parameters

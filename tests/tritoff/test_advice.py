"""tritoff/advice.py: a budget too small names only the prefetch and mode that lower its minimum, each at a minimum
that works."""

import pytest
import torch

import tritoff
from tritoff.advice import advise
from tritoff.planner import BudgetError

from .helpers import stack

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

KB = 1024
# the smallest budget for each (mode, prefetch), as a planner would name it; None: the mode cannot be planned
NEEDS = {
    ("group", 4): 900 * KB,
    ("group", 3): 800 * KB,
    ("group", 2): 700 * KB,
    ("group", 1): 600 * KB,
    ("leaf", 4): 650 * KB,
    ("model", 4): 950 * KB,
}


def _advise(budget, mode="group", prefetch=4, needs=NEEDS, modes=("group", "leaf")):
    err = BudgetError(f"budget {budget} B is too small: the smallest that works is ...", needs[mode, prefetch])
    return advise(err, mode, prefetch, budget, lambda m, p: needs.get((m, p)), modes)


def test_the_fastest_prefetch_that_fits_is_named_else_the_one_needing_least():
    assert _advise(750 * KB).alternatives["prefetch"] == (2, 700 * KB)  # 2 fits: 1 would lose a slot for nothing
    assert _advise(500 * KB).alternatives["prefetch"] == (1, 600 * KB)  # none fits: the one needing least


def test_the_mode_needing_least_is_named_and_none_that_needs_more():
    err = _advise(500 * KB, modes=("group", "leaf", "model"))
    assert err.alternatives["mode"] == ("leaf", 650 * KB)  # model needs more than group: never named
    assert str(err).endswith("; prefetch=1 needs only 600.00 KiB; mode='leaf' needs only 650.00 KiB")
    assert err.minimum == 900 * KB and err.budget == 500 * KB
    fits = _advise(700 * KB)
    assert str(fits).endswith("; prefetch=2 would fit this budget; mode='leaf' would fit this budget")
    # the planner's own message, whole, for the command line to word its flags after
    assert err.facts == fits.facts.replace(str(700 * KB), str(500 * KB)) and not err.facts.endswith("KiB")


def test_nothing_that_lowers_nothing_is_named():
    # a phase moving whole: fewer ring slots change nothing; a mode that cannot be planned (None) is left out
    flat = {("group", p): 900 * KB for p in (1, 2, 3, 4)} | {("leaf", 4): 900 * KB}
    err = _advise(500 * KB, needs=flat)
    assert err.alternatives == {} and str(err).endswith("the smallest that works is ...")
    err = _advise(500 * KB, needs={("group", 4): 900 * KB})
    assert err.alternatives == {}
    # a saving the budget would be rounded up over is not worth a ring slot or smaller groups, unless it then fits
    slight = {("group", 4): 900 * KB, ("group", 3): 890 * KB, ("leaf", 4): 880 * KB}
    assert _advise(500 * KB, needs=slight).alternatives == {}
    assert _advise(885 * KB, needs=slight).alternatives == {"mode": ("leaf", 880 * KB)}


def test_another_mode_with_fewer_slots_is_named_where_neither_alone_fits():
    needs = {**NEEDS, ("leaf", 1): 400 * KB, ("model", 1): 950 * KB}
    err = _advise(500 * KB, needs=needs)
    assert err.alternatives["together"] == (("leaf", 1), 400 * KB)
    assert str(err).endswith("; mode='leaf' with prefetch=1 would fit this budget")
    assert "together" not in _advise(650 * KB, needs=needs).alternatives  # leaf alone fits: the fewest changes
    assert "together" not in _advise(500 * KB, needs={**needs, ("leaf", 1): 640 * KB}).alternatives  # > prefetch=1


def _refusal(model, **options) -> BudgetError:
    with pytest.raises(BudgetError) as info:
        tritoff.enable(model, budget=1000, reserve=1000, progress=False, kernels="reference", **options)
    return info.value


def _fits(model, budget, **options) -> bool:
    try:
        tritoff.enable(model, budget=budget, reserve=1000, progress=False, kernels="reference", **options)
    except BudgetError:
        return False
    tritoff.disable(model)
    return True


def test_each_named_alternative_works_at_its_minimum_and_not_below():
    model = stack(n=8)
    err = _refusal(model, mode="group", prefetch=3)
    assert set(err.alternatives) == {"prefetch", "mode", "together"}, str(err)
    (fewer, fewer_needs), (mode, mode_needs) = err.alternatives["prefetch"], err.alternatives["mode"]
    assert fewer == 1 and fewer_needs < err.minimum and mode == "leaf" and mode_needs < err.minimum
    assert _fits(model, fewer_needs, mode="group", prefetch=1)
    assert not _fits(model, fewer_needs - 1, mode="group", prefetch=1)
    assert _fits(model, mode_needs, mode="leaf", prefetch=3)
    assert not _fits(model, mode_needs - 1, mode="leaf", prefetch=3)
    (both, one), both_needs = err.alternatives["together"]
    assert (both, one) == ("leaf", 1) and both_needs < min(fewer_needs, mode_needs)
    assert _fits(model, both_needs, mode="leaf", prefetch=1)
    assert not _fits(model, both_needs - 1, mode="leaf", prefetch=1)
    assert _refusal(model, mode="group", prefetch=3).minimum == err.minimum  # a failed enable changed nothing


def test_prefetch_is_not_named_where_the_budget_goes_to_a_component_moving_whole():
    from tritoff.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    # the tiny VAE moving whole needs more than the streamed transformer: fewer ring slots lower nothing
    err = _refusal(pipe, mode="group", prefetch=2)
    assert "vae" in str(err) and "prefetch" not in err.alternatives and "prefetch=" not in str(err)


def test_a_store_is_never_told_to_change_its_grouping(tmp_path):
    model = stack(n=8)
    engine = tritoff.enable(model, mode="group", budget=10**9, progress=False, kernels="reference")
    engine.save(tmp_path / "store")
    tritoff.disable(model)
    err = _refusal(model, mode="group", prefetch=3, store=tmp_path / "store")
    assert "mode" not in err.alternatives and "prefetch" in err.alternatives, str(err)


class _Flat(torch.nn.Module):
    """Layers and no block list."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _flat():
    torch.manual_seed(0)
    return _Flat().to(torch.bfloat16).eval()


class _Even(torch.nn.Module):
    """Layers of one size and no block list."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(128, 128) for _ in range(4))

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


def _even():
    torch.manual_seed(0)
    return _Even().to(torch.bfloat16).eval()


def test_every_mode_is_weighed_and_the_one_needing_least_works():
    # four layers of one size: a ring of two, the running layer and the next, needs less than moving them whole
    err = _refusal(_even(), mode="model", prefetch=1, transport="zero_copy")
    mode, needed = err.alternatives["mode"]
    assert mode in ("group", "leaf") and needed < err.minimum
    assert _fits(_even(), needed, mode=mode, prefetch=1, transport="zero_copy")
    assert not _fits(_even(), needed - 1, mode=mode, prefetch=1, transport="zero_copy")
    # three layers, one four times the others: a ring of layers keeps the largest resident, so it needs about what
    # moving whole does and is not named (less than 5% saved)
    err = _refusal(_flat(), mode="leaf", prefetch=1, transport="zero_copy")
    assert "the 2 largest groups resident" in str(err) and "mode" not in err.alternatives


def test_a_store_of_a_model_without_blocks_is_never_told_to_stream_its_layers(tmp_path):
    model = _flat()
    tritoff.enable(model, mode="model", budget=10**9, progress=False, kernels="reference").save(tmp_path / "store")
    tritoff.disable(model)
    # mode="group" would stream the layers, which the store (whole-component groups) does not hold as packs
    err = _refusal(_flat(), mode="model", prefetch=2, store=tmp_path / "store")
    assert "mode" not in err.alternatives, str(err)


def test_no_mode_enable_would_refuse_is_named():
    model = stack(n=8)
    for block in model.blocks:  # tritoff's hooks inside a fullgraph block would break its graph: leaf is refused
        block.compile(fullgraph=True)
    err = _refusal(model, mode="group", prefetch=2)
    assert err.alternatives.get("mode", ("",))[0] != "leaf" and "prefetch" in err.alternatives, str(err)
    with pytest.raises(ValueError, match="fullgraph=True"):
        tritoff.enable(model, mode="leaf", budget=10**9, progress=False, kernels="reference")


def test_a_deep_prefetch_is_planned_once_per_ring_size(monkeypatch):
    from tritoff import sizing

    planned = []
    real = sizing.plan_phases
    monkeypatch.setattr(sizing, "plan_phases", lambda *a, **k: planned.append(a[3]) or real(*a, **k))
    err = _refusal(stack(n=4), mode="group", prefetch=50)
    # 4 blocks: prefetch 4 and more all give each block a slot, so 49..4 are planned once, then 3, 2 and 1, then
    # each other mode once, and at prefetch 1 where that is new (auto and leaf; model moves whole): 10 plans with the
    # refused one, not 55
    assert err.alternatives["prefetch"][0] == 1 and planned[:5] == [50, 4, 3, 2, 1] and len(planned) == 10, planned

"""tritoff/residency.py: entering a phase evicts other phases least recently used first, only until it fits, never a
phase that is running; a phase that fits beside the others stays loaded."""

from types import SimpleNamespace

import torch

from tritoff.residency import Residency


def _phase(name, need, reserve=0, loaded=True):
    return SimpleNamespace(
        name=name, plan=SimpleNamespace(need_bytes=need, reserve=reserve), loaded=loaded, active=False, last_used=0
    )


def _residency(budget, fixed=0):
    evicted = []

    def evict(comp):
        evicted.append(comp.name)
        comp.loaded = False

    return Residency(torch.device("cpu"), budget, fixed, evict=evict), evicted


def test_room_is_made_least_recently_used_first_and_only_as_far_as_needed():
    residency, evicted = _residency(budget=100, fixed=10)
    a, b, c, entering = _phase("a", 30), _phase("b", 30), _phase("c", 20), _phase("d", 30, reserve=15)
    a.last_used, b.last_used, c.last_used = 3, 1, 2
    phases = [a, b, c, entering]
    # room for the others: 100 - 10 fixed - 15 reserve - 30 = 45; held 80: evict b (oldest), then c, then it fits
    residency.make_room(entering, phases)
    assert evicted == ["b", "c"] and a.loaded
    assert residency.held(p for p in phases if p is not entering) == 30


def test_a_running_phase_is_never_evicted_even_when_room_stays_short():
    residency, evicted = _residency(budget=50)
    outer, entering = _phase("transformer", 40), _phase("text_encoder", 40)
    outer.active = True  # a component called inside another's forward: both stay
    residency.make_room(entering, [outer, entering])
    assert evicted == [] and outer.loaded


def test_phases_that_fit_together_stay_loaded():
    residency, evicted = _residency(budget=200)
    phases = [_phase("text_encoder", 50), _phase("transformer", 60), _phase("vae", 40)]
    for p in phases:
        residency.make_room(p, phases)
    assert evicted == [] and all(p.loaded for p in phases)

"""tritoff/residency.py: entering a phase evicts other phases least recently used first, only until it fits and only
those whose room is needed, never a phase that is running; a phase that fits beside the others stays loaded."""

from types import SimpleNamespace

import torch

from tritoff.residency import Residency


def _phase(name, need, reserve=0, loaded=True, last_used=0):
    return SimpleNamespace(
        name=name,
        plan=SimpleNamespace(need_bytes=need, reserve=reserve),
        loaded=loaded,
        active=False,
        last_used=last_used,
    )


def _residency(budget, fixed=0, busy=None):
    evicted = []

    def evict(comp):
        evicted.append(comp.name)
        comp.loaded = False

    return Residency(torch.device("cpu"), budget, fixed, evict=evict, busy=busy), evicted


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


def test_a_phase_whose_forward_runs_is_never_evicted_though_not_active():
    # a component moving whole is never marked active: the manager names the running ones
    outer, entering = _phase("transformer", 40), _phase("text_encoder", 40)
    residency, evicted = _residency(budget=50, busy=lambda comp: comp is outer)
    residency.make_room(entering, [outer, entering])
    assert evicted == [] and outer.loaded


def test_phases_whose_room_is_not_needed_stay_though_used_longer_ago():
    # the second expert enters: the first must leave, and with it gone the text encoder and the VAE fit
    residency, evicted = _residency(budget=100)
    vae, text_encoder = _phase("vae", 10, last_used=1), _phase("text_encoder", 20, last_used=2)
    first = _phase("transformer", 60, last_used=3)
    second = _phase("transformer_2", 60, loaded=False)
    residency.make_room(second, [vae, text_encoder, first, second])
    assert evicted == ["transformer"] and vae.loaded and text_encoder.loaded

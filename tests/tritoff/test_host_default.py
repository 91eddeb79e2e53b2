"""enable, save, disable and plan under a default device other than the host: what tritoff makes without naming a device
stays in host memory (on a GPU machine, ``torch.set_default_device("cuda")``; here the meta device stands in for it:
a pack or table made there would hold no data at all)."""

import warnings

import torch

import tritoff
from tests.tritoff.helpers import run, wan
from tritoff.host_default import host_by_default

OPTIONS = dict(storage="fp8_e4m3", mode="group", budget="4MB", device="cpu", kernels="reference", progress=False)


def _enable(pipe, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA device
        return tritoff.enable(pipe, **{**OPTIONS, **options})


def test_a_pipeline_enabled_saved_and_disabled_under_another_default_device_runs_as_on_the_host(tmp_path):
    expected = wan()
    _enable(expected)
    want = run(expected, num_inference_steps=1)
    pipe = wan()
    with torch.device("meta"):
        engine = _enable(pipe)
        engine.save(tmp_path / "store")
    assert engine.plan.tier_counts("transformer").get("stream"), "the budget streams blocks"
    assert torch.equal(run(pipe, num_inference_steps=1), want)
    with torch.device("meta"):
        tritoff.disable(pipe)
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())
    stored = wan()
    _enable(stored, store=str(tmp_path / "store"))
    # the store written under the meta default holds the packs
    assert torch.equal(run(stored, num_inference_steps=1), want)


def test_a_plan_under_another_default_device_is_the_plan_on_the_host():
    expected = tritoff.plan("wan2.1-t2v-14b", frames=5, height=32, width=32).text()
    with torch.device("meta"):
        assert tritoff.plan("wan2.1-t2v-14b", frames=5, height=32, width=32).text() == expected


def test_the_host_default_is_the_callers_again_afterwards():
    seen = []
    wrapped = host_by_default(lambda: seen.append(torch.empty(1).device.type))
    with torch.device("meta"):
        wrapped()
        assert torch.empty(1).device.type == "meta"
    wrapped()
    assert seen == ["cpu", "cpu"]

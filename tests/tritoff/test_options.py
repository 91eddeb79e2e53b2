"""tritoff/options.py: enable's options checked one by one and resolved to their defaults."""

import pytest
import torch

from tritoff.options import check_device, check_prefetch, resolve, same_skip

from .helpers import stack


def _resolve(module, **given):
    options = dict(storage=None, granularity="row", skip=None, mode=None, budget=None, reserve=None, device="cpu")
    options.update(prefetch=2, transport="auto", kernels="auto", host_budget=None)
    options.update(given)
    return resolve({"model": module}, *options.values())


def test_defaults_on_the_cpu():
    model = stack()
    options = _resolve(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # no device memory to measure on the CPU: a budget everything fits in, and 10% of it kept for activations
    assert options.mode == "auto" and options.device == torch.device("cpu")
    assert options.budget == 2 * weights + 2**30 and options.reserve == int(options.budget * 0.1)
    assert options.reserve_fraction == 0.1 and options.storage == {"model": "fp8_e4m3"} and options.skip == ()
    assert options.staged and not options.reads_host_directly and options.host_budget is None


@pytest.mark.parametrize(
    "reserve,expected,fraction", [("20%", 2 * 10**8, 0.2), ("100MB", 10**8, None), (12345, 12345, None)]
)
def test_a_reserve_is_a_share_of_the_budget_or_bytes(reserve, expected, fraction):
    options = _resolve(stack(), budget="1GB", reserve=reserve)
    assert options.budget == 10**9 and options.reserve == expected and options.reserve_fraction == fraction


def test_zero_copy_reads_the_host_only_on_cuda():
    options = _resolve(stack(), transport="zero_copy")
    assert not options.staged and not options.reads_host_directly  # the CPU has no host to read across


@pytest.mark.parametrize(
    "given,message",
    [
        (dict(mode="blocks"), "unknown mode 'blocks': use one of"),
        (dict(transport="nvlink"), "unknown transport 'nvlink': use one of auto, staged, zero_copy"),
        (dict(kernels="cuda"), "unknown kernels 'cuda': use one of auto, triton, reference"),
        (dict(granularity="column"), "granularity"),
        (dict(budget="1GB", reserve="100%"), "leaves nothing of the budget for weights"),
        # above 100% too: not "at most 100%", which 100% itself then contradicts
        (dict(budget="1GB", reserve="150%"), "reserve '150%' leaves nothing of the budget for weights: use less than"),
        (dict(prefetch=0), "prefetch must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_option_is_refused_in_one_line(given, message):
    with pytest.raises(ValueError, match=message) as info:
        _resolve(stack(), **given)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("prefetch", [0, -1, 1.5, "2", True, None])
def test_prefetch_is_a_whole_number_of_blocks(prefetch):
    with pytest.raises(ValueError, match=f"prefetch must be an integer >= 1, got {prefetch!r}"):
        check_prefetch(prefetch)


def test_prefetch_of_one_or_more_passes():
    for prefetch in (1, 2, 64):
        check_prefetch(prefetch)


@pytest.mark.parametrize(
    "device,message",
    [
        ("gpu0", "invalid device 'gpu0': use 'cuda', 'cuda:N' or 'cpu'"),
        (3.5, "invalid device 3.5"),
        ("meta", "tritoff cannot compute on device 'meta'"),
    ],
)
def test_a_device_tritoff_cannot_use_is_refused(device, message):
    with pytest.raises(ValueError, match=message):
        check_device(device)


def test_the_cpu_resolves_without_an_index():
    assert check_device("cpu") == check_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_cuda_says_to_pass_the_cpu():
    with pytest.raises(ValueError, match="CUDA is not available; pass device='cpu'"):
        check_device("cuda")


def test_skip_patterns_are_the_same_when_they_skip_the_same_weights():
    model = stack(n=3)
    components, storage = {"model": model}, {"model": "fp8_e4m3"}
    assert same_skip(components, storage, ("head", "proj_in"), ("proj_in", "head", "head"))
    assert same_skip(components, storage, ("^head$",), ("head",))  # spelled otherwise, the same module
    assert not same_skip(components, storage, ("head",), ("proj_in",))
    # nothing is quantized in bf16: any patterns skip the same (no) weights
    assert same_skip(components, {"model": "bf16"}, ("head",), ("proj_in",))

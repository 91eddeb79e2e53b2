import os
import subprocess
import sys
import warnings

import pytest

from tritoff import allocator
from tritoff.warn import TritoffWarning


@pytest.mark.parametrize(
    "conf, fragments",
    [
        ("", True),
        ("expandable_segments:True", False),
        ("max_split_size_mb:128, expandable_segments:True ", False),
        ("expandable_segments:False", True),
        ("expandable_segments:true", True),  # torch accepts only True and False: this one it rejects
        ("backend:cudaMallocAsync", False),
        ("backend:native,expandable_segments:True", False),
        ("backend:native", True),
        ("garbage_collection_threshold:0.6", True),
    ],
)
def test_fragmenting_allocators_are_told_from_their_settings(conf, fragments):
    assert allocator.fragments(conf) is fragments


@pytest.mark.parametrize(
    "environ, conf",
    [
        ({}, ""),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:True"),
        # torch reads PYTORCH_CUDA_ALLOC_CONF first, then the HIP name, then PYTORCH_ALLOC_CONF
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "a:1"}, "a:1"),
        ({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_HIP_ALLOC_CONF": "b:2"}, "b:2"),
        ({"PYTORCH_CUDA_ALLOC_CONF": ""}, ""),
    ],
)
def test_the_setting_is_read_where_torch_reads_it(environ, conf):
    assert allocator.configured(environ) == conf


@pytest.mark.parametrize(
    "given",
    [
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": ""},  # set, if empty, wins
    ],
)
def test_torch_reads_the_names_in_the_same_order(given):
    torch = pytest.importorskip("torch")
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch does not say which setting it read")
    env = {k: v for k, v in os.environ.items() if k not in allocator.ENV_NAMES} | given
    code = "import torch; print(repr(torch._C._accelerator_getAllocatorSettings()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(allocator.configured(env))


def test_the_command_line_prefers_expandable_segments_and_keeps_a_users_setting(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    environ = {}
    allocator.prefer_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert not allocator.fragments(allocator.configured(environ))
    for name in allocator.ENV_NAMES:
        environ = {name: "max_split_size_mb:64"}
        allocator.prefer_expandable_segments(environ)
        assert environ == {name: "max_split_size_mb:64"}
    monkeypatch.setattr(sys, "platform", "win32")  # torch has no expandable segments there
    environ = {}
    allocator.prefer_expandable_segments(environ)
    assert environ == {}


def _environment(monkeypatch, conf):
    for name in allocator.ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    if conf is not None:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)


def test_the_hint_is_given_once_per_process(monkeypatch):
    monkeypatch.setattr(allocator, "_warned", False)
    _environment(monkeypatch, "max_split_size_mb:64")
    with pytest.warns(TritoffWarning, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        allocator.warn_if_fragmenting()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        allocator.warn_if_fragmenting()
    assert not seen


@pytest.mark.parametrize("platform, conf", [("linux", "expandable_segments:True"), ("win32", None)])
def test_no_hint_where_the_allocator_expands_or_cannot(monkeypatch, platform, conf):
    monkeypatch.setattr(allocator, "_warned", False)
    _environment(monkeypatch, conf)
    monkeypatch.setattr(sys, "platform", platform)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        allocator.warn_if_fragmenting()
    assert not seen and not allocator._warned

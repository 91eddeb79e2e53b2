import warnings

import pytest

from tritoff import allocator
from tritoff.warn import TritoffWarning


@pytest.mark.parametrize(
    "environ, fragments",
    [
        ({}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}, True),
        # torch's newer name is read first
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, False),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ],
)
def test_fragmenting_allocators_are_told_from_their_settings(environ, fragments):
    assert allocator.fragments(environ) is fragments


def test_the_command_line_prefers_expandable_segments_and_keeps_a_users_setting():
    environ = {}
    allocator.prefer_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and not allocator.fragments(environ)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        environ = {name: "max_split_size_mb:64"}
        allocator.prefer_expandable_segments(environ)
        assert environ == {name: "max_split_size_mb:64"}


def test_the_hint_is_given_once_per_process(monkeypatch):
    monkeypatch.setattr(allocator, "_warned", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.warns(TritoffWarning, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        allocator.warn_if_fragmenting()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        allocator.warn_if_fragmenting()
    assert not seen


def test_no_hint_where_the_allocator_expands(monkeypatch):
    monkeypatch.setattr(allocator, "_warned", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        allocator.warn_if_fragmenting()
    assert not seen and not allocator._warned

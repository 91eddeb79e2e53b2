"""tritoff/cuda_host.py: the driver calls get each argument as libcuda declares it (checked on a stand-in library
whose copy is a memmove between host buffers, so a wrong address, size or order shows in the bytes)."""

import ctypes

import pytest
import torch

from tritoff import cuda_host

from .helpers import StandInDriver


@pytest.fixture
def stand_in(monkeypatch):
    def install(**kwargs):
        lib = StandInDriver(**kwargs)
        monkeypatch.setattr(cuda_host, "_driver", lambda: cuda_host.bind(lib.lib))
        return lib

    return install


def _spans(dst: torch.Tensor, src: torch.Tensor, ranges):
    return tuple((dst.data_ptr() + a, src.data_ptr() + a, b - a) for a, b in ranges)


def test_the_copy_is_declared_with_libcudas_argument_types():
    # undeclared, ctypes would pass each address as a C int, cut to 32 bits
    lib = cuda_host.bind(StandInDriver().lib)
    assert lib.cuMemcpyHtoDAsync_v2.argtypes == [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def test_copy_async_moves_each_span_and_names_the_stream(stand_in):
    lib = stand_in()
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    ranges = [(0, 1280), (2048, 2304)]  # a payload and its scales, a gap between them left alone
    assert cuda_host.copy_async(_spans(dst, src, ranges), 0x7F00DEAD0000) is None
    assert [call[3] for call in lib.calls] == [0x7F00DEAD0000] * 2
    expected = torch.zeros_like(src)
    for a, b in ranges:
        expected[a:b] = src[a:b]
    assert torch.equal(dst, expected)


def test_a_thread_without_a_context_binds_one_once_and_the_refused_copy_is_tried_again(stand_in):
    lib = stand_in(context=False)
    src = torch.randint(0, 256, (512,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    spans = _spans(dst, src, [(0, 256), (256, 512)])
    assert cuda_host.copy_async(spans, 1, lib.bind_context) is None
    assert lib.binds == 1 and len(lib.calls) == 3 and torch.equal(dst, src)  # refused, retried, then the second span


def test_a_copy_refused_again_is_named_and_the_spans_after_it_are_not_issued(stand_in):
    lib, bound = stand_in(refusals=2, code=1), []
    src = torch.randint(0, 256, (512,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    spans = _spans(dst, src, [(0, 256), (256, 512)])
    assert cuda_host.copy_async(spans, 1, lambda: bound.append(True)) == "CUDA_ERROR_INVALID_VALUE"
    assert bound == [True] and len(lib.calls) == 2 and not dst.any()

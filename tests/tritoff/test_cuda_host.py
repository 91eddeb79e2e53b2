"""tritoff/cuda_host.py: the driver calls get each argument as libcuda declares it (checked on a stand-in library
whose copy is a memmove between host buffers, so a wrong address, size or order shows in the bytes)."""

import ctypes
import types

import pytest
import torch

from tritoff import cuda_host

COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
NAME = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
ANY = ctypes.CFUNCTYPE(ctypes.c_int)


class StandIn:
    """libcuda's calls as ctypes function pointers: copies memmove at once, and the first ``refusals`` return
    ``code``."""

    def __init__(self, refusals: int = 0, code: int = cuda_host.INVALID_CONTEXT):
        self.calls, self.refusals, self.code = [], refusals, code
        self.names = {cuda_host.INVALID_CONTEXT: b"CUDA_ERROR_INVALID_CONTEXT", 1: b"CUDA_ERROR_INVALID_VALUE"}
        self.lib = types.SimpleNamespace(
            cuMemcpyHtoDAsync_v2=COPY(self._copy),
            cuGetErrorName=NAME(self._name),
            cuMemHostRegister_v2=ANY(lambda: 0),
            cuMemHostUnregister=ANY(lambda: 0),
        )

    def _copy(self, dst, src, nbytes, stream):
        self.calls.append((dst, src, nbytes, stream))
        if self.refusals:
            self.refusals -= 1
            return self.code
        ctypes.memmove(dst, src, nbytes)
        return 0

    def _name(self, code, out):
        out[0] = self.names[code]  # bytes kept alive by self.names
        return 0


@pytest.fixture
def stand_in(monkeypatch):
    def install(**kwargs):
        lib = StandIn(**kwargs)
        monkeypatch.setattr(cuda_host, "_driver", lambda: cuda_host.bind(lib.lib))
        return lib

    return install


def _spans(dst: torch.Tensor, src: torch.Tensor, ranges):
    return tuple((dst.data_ptr() + a, src.data_ptr() + a, b - a) for a, b in ranges)


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


def test_a_thread_without_a_context_gets_one_and_the_copy_is_retried(stand_in, monkeypatch):
    lib, made = stand_in(refusals=1), []
    monkeypatch.setattr(cuda_host, "_ensure_context", lambda: made.append(True))
    src = torch.randint(0, 256, (512,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    assert cuda_host.copy_async(_spans(dst, src, [(0, 512)]), 1) is None
    assert made == [True] and len(lib.calls) == 2 and torch.equal(dst, src)


def test_a_refused_copy_is_named_and_the_spans_after_it_are_not_issued(stand_in):
    lib = stand_in(refusals=1, code=1)
    src = torch.randint(0, 256, (512,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    assert cuda_host.copy_async(_spans(dst, src, [(0, 256), (256, 512)]), 1) == "CUDA_ERROR_INVALID_VALUE"
    assert len(lib.calls) == 1 and not dst.any()

"""Page-locking host memory, and copying out of it, through the CUDA driver API.

``cudaHostRegister`` (the runtime API, all PyTorch exposes) leaves a failed registration's error as the runtime's
*last error*, which the next unrelated kernel launch then reports as its own failure. The driver API
(``cuMemHostRegister``) returns its error and leaves no such state, so a machine that cannot lock a 14 GB arena
(too little free RAM) keeps working with pageable copies. libcuda is the driver itself, present wherever CUDA
runs; it is loaded on first use, never at import.

A staged fill copies each chunk of a pack out of that memory with :func:`copy_async`: one ``cuMemcpyHtoDAsync`` per
byte range, where ``Tensor.copy_`` goes through the dispatcher, its checks and its pinned-memory bookkeeping first
(``bench/hooks.py`` times both).
"""

from __future__ import annotations

import ctypes
import functools

import torch

# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: visible to every context, readable by kernels
REGISTER_FLAGS = 0x01 | 0x02


@functools.cache
def _driver() -> ctypes.CDLL:
    return bind(ctypes.CDLL("libcuda.so.1"))


def bind(lib):
    """Declare the argument types of the driver calls tritoff makes on ``lib`` (libcuda, or a stand-in); returns it."""
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUDA driver error {code}"


def _ensure_context() -> None:
    # driver calls need the runtime's primary context current on this thread; any runtime call that touches the
    # device makes it so
    torch.cuda.init()
    torch.cuda.synchronize()


def device_index(device: torch.device | str | int | None = None) -> int:
    """The CUDA device ordinal of ``device`` ("cuda", "cuda:1", 1, a torch.device or None: the current one)."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def register(ptr: int, nbytes: int) -> str | None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` (mapped for kernels); returns None, or why it failed."""
    try:
        driver = _driver()
    except OSError as err:
        return f"libcuda could not be loaded ({err})"
    _ensure_context()
    code = driver.cuMemHostRegister_v2(ctypes.c_void_p(ptr), nbytes, REGISTER_FLAGS)
    return None if code == 0 else _error_name(code)


def unregister(ptr: int) -> None:
    """Undo :func:`register` (a second failure is ignored: the memory is being released anyway)."""
    if _driver().cuMemHostUnregister(ctypes.c_void_p(ptr)) != 0:
        # no context current on this thread (an arena freed on a thread that made no CUDA call): make the runtime's
        # current and try again, or the pages would stay locked after the arena is unmapped
        _ensure_context()
        _driver().cuMemHostUnregister(ctypes.c_void_p(ptr))


def copies_available() -> bool:
    """Whether :func:`copy_async` can be used here (libcuda loads)."""
    try:
        _driver()
    except OSError:
        return False
    return True


def copy_async(spans, stream: int, bind_context=None) -> str | None:
    """Queue a copy of each ``(device address, host address, bytes)`` in ``spans`` on the CUDA stream whose handle is
    ``stream`` (``torch.cuda.Stream.cuda_stream``), asynchronous from page-locked memory; returns None, or the error
    the driver reported for a copy it refused (the spans before it were queued).

    The driver copies in the context current on the calling thread, which a thread gets at its first runtime call on
    the device: after a refusal, ``bind_context()`` (such a call, e.g. the stream's ``query``) runs once and the copy
    is tried again."""
    copy = _driver().cuMemcpyHtoDAsync_v2
    for dst, src, nbytes in spans:
        code = copy(dst, src, nbytes, stream)
        if code != 0 and bind_context is not None:
            bind_context()
            bind_context = None
            code = copy(dst, src, nbytes, stream)
        if code != 0:
            return _error_name(code)
    return None

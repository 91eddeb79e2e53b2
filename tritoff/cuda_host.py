"""Page-locking host memory through the CUDA driver API.

``cudaHostRegister`` (the runtime API, all PyTorch exposes) leaves a failed registration's error as the runtime's
*last error*, which the next unrelated kernel launch then reports as its own failure. The driver API
(``cuMemHostRegister``) returns its error and leaves no such state, so a machine that cannot lock a 14 GB arena
(too little free RAM) keeps working with pageable copies. libcuda is the driver itself, present wherever CUDA
runs; it is loaded on first use, never at import.
"""

from __future__ import annotations

import ctypes
import functools

import torch

# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: visible to every context, readable by kernels
REGISTER_FLAGS = 0x01 | 0x02


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
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

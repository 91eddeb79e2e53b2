"""Test setup: Triton's interpreter on CPU-only machines, GPU marker, NaN-poisoned outputs, tiny local models."""

import os
import signal

import torch

# Triton reads TRITON_INTERPRET when it is imported, so this must come before any tritoff.kernels import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# in one of several pytest workers (README's test command: two), one intra-op thread each: the workers are the
# parallelism, and more threads than cores spin
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _check_interpreter_bounds() -> None:
    """Make Triton's interpreter refuse any load or store outside the tensors passed to the kernel.

    The interpreter dereferences raw pointers: an out-of-bounds access silently reads or corrupts whatever memory
    lies there, and crashes only when it reaches an unmapped page. Checking every active lane's address against the
    kernel arguments' storages turns such a bug into an immediate error naming the access.
    """
    import numpy as np
    import triton.runtime.interpreter as interpreter

    ranges: list[tuple[int, int]] = []
    init_args = interpreter.GridExecutor._init_args_hst
    unwrap = getattr(interpreter, "_unwrap_tensor", lambda tensor: tensor)  # Triton 3.2 unwraps none

    def record_ranges(self, args_dev, kwargs):
        ranges.clear()
        for arg in [*args_dev, *kwargs.values()]:
            if hasattr(arg, "untyped_storage"):
                # the wrapper tensors of torch.library.opcheck's modes hold no storage of their own: unwrap as the
                # interpreter does before touching one
                storage = unwrap(arg).untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return init_args(self, args_dev, kwargs)

    def check(ptrs, mask, itemsize: int, what: str) -> None:
        addresses = np.asarray(ptrs.data[mask.data], dtype=np.uint64)
        if addresses.size:
            low, high = int(addresses.min()), int(addresses.max()) + itemsize
            if not any(start <= low and high <= end for start, end in ranges):
                raise AssertionError(f"kernel {what} outside its arguments: [{low:#x}, {high:#x})")

    builder = interpreter.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store

    def masked_load(ptrs, mask, other, *rest):
        check(ptrs, mask, np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return load(ptrs, mask, other, *rest)

    def masked_store(ptrs, value, mask, *rest):
        check(ptrs, mask, value.data.dtype.itemsize, "store")
        return store(ptrs, value, mask, *rest)

    interpreter.GridExecutor._init_args_hst = record_ranges
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store


if os.environ.get("TRITON_INTERPRET") == "1":
    _check_interpreter_bounds()


def pytest_collection_modifyitems(config, items):
    for item in items:  # `-m on_device`: the tests that run on the GPU when there is one, through the fixture below
        parametrized = getattr(item, "callspec", None) is not None and "device" in item.callspec.params
        if "device" in getattr(item, "fixturenames", ()) and not parametrized:
            item.add_marker(pytest.mark.on_device)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernels run: the GPU when there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def poisoned(nbytes: int, device) -> torch.Tensor:
    """A uint8 buffer filled with 0xFF: NaN in bf16, fp16 and fp32, so an unwritten element fails any comparison."""
    return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raising KeyboardInterrupt for one test, as in an interactive Python: a shell without job control starts
    its background commands with SIGINT ignored, and a Python started so keeps ignoring it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

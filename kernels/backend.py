"""Where the Triton kernels can run, decided in one place.

Importing this module never touches the GPU: every question is answered lazily, on first use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading

import torch

# Triton's interpreter patches triton.language's functions in place for the length of each launch and puts them back
# after: two threads interpreting at once undo each other's patches ("Did you forget to add @triton.jit ?"), so
# interpreted launches take turns
_INTERPRETER_LOCK = threading.RLock()


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU in its interpreter (TRITON_INTERPRET=1 before importing triton).

    Once the kernels are imported, whether Triton made them interpreted: it decided when decorating them, so the
    variable changed later no longer counts. Before, the setting read as the installed Triton reads it (from 3.4 on,
    its knobs: ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case; before 3.4, ``1`` only)."""
    upcast = sys.modules.get(f"{__package__}.upcast")
    if upcast is not None and hasattr(upcast, "_INTERPRETED"):
        return upcast._INTERPRETED
    try:
        from triton import knobs  # Triton 3.4 on: what its kernel decorator reads
    except Exception:  # a Triton before 3.4, which compares the variable with "1" (or none, or a broken one)
        return os.environ.get("TRITON_INTERPRET", "0") == "1" and library_interpreted()
    return bool(knobs.runtime.interpret) and library_interpreted()


def library_interpreted() -> bool:
    """Whether Triton's own jit functions (``tl.sum``'s combine, ``tl.cdiv``) are interpreted ones: Triton decided
    when it was imported. The variable set after that (by then any ``torch.compile`` user has imported Triton) makes
    new kernels interpreted over a compiled library, which fails at their first ``tl.sum``."""
    try:
        from triton.language import standard
        from triton.runtime.jit import JITFunction
    except Exception:  # no Triton, or a broken one: nothing interprets
        return False
    return not isinstance(standard.cdiv, JITFunction)


@functools.cache
def has_triton() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device: torch.device | str) -> bool:
    """True when a Triton kernel can run on tensors of ``device``: CUDA with Triton, or any device when interpreting."""
    if not has_triton():
        return False
    if interpreting():
        return torch.device(device).type == "cpu"
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def native_fp8(device: torch.device | str) -> bool:
    """Whether kernels may use the hardware fp8 conversions on ``device``.

    Compute capability >= 8.9 converts e4m3/e5m2 natively. Older GPUs have no e4m3 conversion, so the kernels decode and
    encode from the uint8 bits. The interpreter's fp32->fp8 cast does not carry a rounding overflow into the exponent
    (31.75 became 16.0 in e4m3; 22 of 4096 random values differed from PyTorch), so it takes the bit path too.
    """
    if interpreting() or torch.device(device).type != "cuda":
        return False
    return torch.cuda.get_device_capability(torch.device(device)) >= (8, 9)


def _registered(name: str):
    """The op ``tritoff::<name>`` if it is registered already, else None."""
    try:
        return getattr(torch.ops.tritoff, name).default
    except AttributeError:
        return None


def register_op(name: str, mutates_args: tuple[str, ...]):
    """Register a Triton launcher as the torch custom op ``tritoff::<name>``.

    Compiled Triton goes through ``triton_op`` + ``wrap_triton`` so torch.compile traces into the kernel. The
    interpreter cannot run under fake tensors, so there the launcher becomes an opaque ``custom_op`` (fake: no-op).
    An op registered already is returned as it is: registering it again would replace it under its earlier handles.
    """

    def decorate(launcher):
        existing = _registered(name)
        if existing is not None:  # this file imported again under another name (see kernels/__init__.py)
            return existing
        if interpreting():
            op = torch.library.custom_op(f"tritoff::{name}", mutates_args=mutates_args)(launcher)
            op.register_fake(lambda *args, **kwargs: None)
            return op
        return torch.library.triton_op(f"tritoff::{name}", mutates_args=mutates_args)(launcher)

    return decorate


def eager(*tensors: torch.Tensor) -> bool:
    """Whether a kernel call on ``tensors`` may run its launcher directly rather than through its registered op: eager
    mode on plain tensors, with no dispatch mode active. The op's dispatch costs tens of microseconds per call in
    eager mode (77 µs with torch 2.11 on a 2-core VM), more than the launch itself, and a streamed block launches in
    its hook. torch.compile, fake tensors, ``make_fx``, ``torch.export`` and dispatch modes (flop counters, loggers)
    still see the op (``functionalize`` and ``vmap`` refuse it: torch supports neither for custom ops that mutate)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(
        type(t) is torch.Tensor
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        and not torch._is_functional_tensor(t)
        for t in tensors
    )


def holds_values(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` hold values this call may read (the kernels' checks of sizes, addresses and NaN): not under
    torch.compile, and none fake, meta, or wrapped by functorch or functionalization. Otherwise the call is being
    traced, and the checks are left to where it runs on real tensors."""
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not any(
        t.is_meta or is_fake(t) or torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._is_functional_tensor(t)
        for t in tensors
    )


def launch_device(tensor: torch.Tensor):
    """A context making ``tensor``'s GPU the current device for a launch run now, when it is not already: Triton
    launches on the current device (its context, its current stream) whatever device the tensors are on, so a kernel on
    ``cuda:1`` tensors launched while ``cuda:0`` is current would run in the wrong context, unordered with the work
    queued on ``cuda:1``. (Under torch.compile, the compiled code sets the device itself.) On the CPU, in Triton's
    interpreter, it holds the lock interpreted launches take turns with, across threads."""
    if tensor.device.type == "cpu" and interpreting():
        return _INTERPRETER_LOCK
    if tensor.device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    if tensor.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)


def launch(kernel):
    """Wrap a ``@triton.jit`` kernel for launching from a registered op's body (``wrap_triton`` unless
    interpreting). Never for eager calls: outside ``triton_op``'s body the wrapper dispatches every launch through a
    higher-order op."""
    if interpreting():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)

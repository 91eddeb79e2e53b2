"""Where tritoff's hook sits among the hooks on a module's forward.

accelerate's ``add_hook_to_module`` wraps ``module.forward`` as it finds it, and ``remove_hook_from_module`` puts back
the forward it found. diffusers' hook registry (``enable_cache`` and the other caches, layer skip) wraps
``module.forward`` too, and keeps the forward below each of its hooks in references of its own. tritoff's hook goes
innermost, right around the module's own forward, whichever was enabled first: a cache that skips a block then skips
the block's load as well, and taking either side's hooks off leaves the other's working (accelerate's removal alone
would drop every registry hook added after tritoff's, and leave the registry calling a hook that is gone).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.nn as nn
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

# the modules whose hook tritoff itself is taking off: its hooks refuse to be detached by anyone else
_REMOVING: set[int] = set()


def removing(module: nn.Module) -> bool:
    """Whether tritoff itself is taking the hook off ``module`` (its hooks' ``detach_hook`` asks)."""
    return id(module) in _REMOVING


def _remove(module: nn.Module) -> None:
    """accelerate's ``remove_hook_from_module``, as tritoff's own removal."""
    _REMOVING.add(id(module))
    try:
        remove_hook_from_module(module)
    finally:
        _REMOVING.discard(id(module))


def _registry_refs(module: nn.Module) -> list:
    """The references diffusers' hook registry on ``module`` keeps of each hook's forwards, innermost first."""
    return getattr(module.__dict__.get("_diffusers_hook"), "_fn_refs", None) or []


def registry_slot(module: nn.Module) -> tuple[object, str] | None:
    """(holder, attribute) of the forward that diffusers' innermost registry hook on ``module`` calls, or None when
    ``module`` carries no registry hook."""
    refs = _registry_refs(module)
    if not refs:
        return None
    first = refs[0]  # the first registered: the one whose forward is the module's own
    # a hook with its own new_forward calls original_forward; once diffusers removed the hook before it, the registry
    # calls forward directly (it rewrites that one), and original_forward is stale
    calls_original = getattr(getattr(first.forward, "func", None), "__name__", None) == "new_forward"
    return first, "original_forward" if calls_original and first.original_forward is not None else "forward"


def hook_innermost(module: nn.Module, hook: ModelHook, wrap: Callable[[nn.Module], None]) -> Callable:
    """Hook ``module`` (accelerate's ``add_hook_to_module``, then ``wrap``, which wraps ``module.forward`` once more)
    under any diffusers registry hook on it; returns the forward installed, which :func:`unhook` looks for."""
    slot = registry_slot(module)
    if slot is None:
        add_hook_to_module(module, hook)
        wrap(module)
        return module.forward
    holder, attribute = slot
    outer = module.__dict__["forward"]  # the registry's wrapper
    module.forward = getattr(holder, attribute)
    try:
        add_hook_to_module(module, hook)
        wrap(module)
        installed = module.forward
        setattr(holder, attribute, installed)
    except BaseException:
        _remove(module)
        raise
    finally:
        module.forward = outer
    return installed


def unhook(module: nn.Module, installed: Callable | None) -> bool:
    """Take tritoff's hook off ``module`` wherever it sits (``installed``: what :func:`hook_innermost` returned),
    leaving every other hook in place. Returns False when the hook was nowhere to be found because ``module.forward``
    was replaced since: the forward tritoff found is then put back, and the replacement is lost."""
    below = module.__dict__.get("_old_forward")
    current = module.__dict__.get("forward")
    if below is None or installed is None or current is installed:
        _remove(module)
        return True
    for ref in _registry_refs(module):
        for attribute in ("original_forward", "forward"):
            if getattr(ref, attribute) is installed:
                _remove(module)
                setattr(ref, attribute, below)
                module.forward = current
                return True
    _remove(module)
    return False


def inside_forward(module: nn.Module) -> bool:
    """Whether the current call runs inside ``module``'s forward: its class's, or a function assigned in its place
    (a frame of either on the stack, with ``module`` as its first argument)."""
    codes = set()
    for forward in (type(module).forward, module.__dict__.get("forward")):
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is not None and code.co_argcount:
            codes.add(code)
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code in codes and frame.f_locals.get(code.co_varnames[0]) is module:
            return True
        frame = frame.f_back
    return False

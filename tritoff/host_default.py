"""Tensors tritoff makes without naming a device are host tensors, whatever default device the caller set.

tritoff names the device of everything it places on the GPU; what it makes without one (packs, tables, checks of a
store, placeholders' shapes) belongs in host memory. Under ``torch.set_default_device("cuda")`` or inside ``with
torch.device("cuda"):`` PyTorch would make those on the GPU (outside the budget, and where the host code reading them
expects host memory), so the public entry points that build or tear down an engine run with the host as the default.
"""

from __future__ import annotations

import functools

import torch


def host_by_default(fn):
    """Run ``fn`` with the host as PyTorch's default device (unchanged, and nothing added, when it already is)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.get_default_device().type == "cpu":
            return fn(*args, **kwargs)
        with torch.device("cpu"):
            return fn(*args, **kwargs)

    return wrapper

"""The CUDA caching allocator's setting that a budget depends on.

A budget bounds the bytes tritoff and the activations allocate; the caching allocator reserves more, in fixed
segments that large activations of different sizes fragment. At Wan-14B's 480x832x81 (32,760 tokens) on an H100, the
all-resident forward reserved 2.5 GiB more than its allocated peak, and every tritoff row under a 12 GB cap ran out of
reserved memory, where the same rows with expandable segments fitted with an allocated peak of 10.6 GiB
(docs/benchmarks.md). torch reads the setting from the environment when the allocator first starts, so tritoff
leaves the user's process as it is and says what to set; the ``tritoff`` command sets it for the processes it starts.
"""

from __future__ import annotations

import os
import sys

from tritoff.warn import warn

# where torch reads the setting, in its own order (c10/cuda/CUDAAllocatorConfig.h, torch 2.11 and 2.13): the first set
# wins; the HIP name only on ROCm builds
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"
HINT = (
    "the CUDA caching allocator is not using expandable segments, so at video shapes its fixed segments fragment "
    f"and memory can run out below the budget: start Python with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} "
    "(the tritoff command line sets it)"
)
_warned = False
set_by_command = False  # whether prefer_expandable_segments set it (the user had set none of ENV_NAMES)


def configured(environ=os.environ) -> str:
    """The allocator's setting string in ``environ``: the first of :data:`ENV_NAMES` set, else empty."""
    for name in ENV_NAMES:
        if name in environ:
            return environ[name]
    return ""


def settings(conf: str) -> dict[str, str]:
    """``conf``'s ``key:value`` options (spaces around them stripped, as torch strips them)."""
    options = {}
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip():
            options[key.strip()] = value.strip()
    return options


def fragments(conf: str) -> bool:
    """Whether an allocator set by ``conf`` keeps fixed segments: neither ``expandable_segments:True`` (torch accepts
    only ``True`` and ``False``) nor CUDA's own pool allocator (``backend:cudaMallocAsync``)."""
    options = settings(conf)
    return options.get("expandable_segments") != "True" and options.get("backend") != "cudaMallocAsync"


def warn_if_fragmenting() -> None:
    """Warn once per process, at the first enable on a CUDA device, when the environment leaves the allocator with
    fixed segments (not on Windows, where torch has no expandable segments). The environment is what torch reads when
    its allocator starts; asking torch instead would make it read the setting then, earlier than the process would."""
    global _warned
    if not _warned and sys.platform != "win32" and fragments(configured()):
        _warned = True
        warn(HINT)


def prefer_expandable_segments(environ=os.environ) -> None:
    """Turn on expandable segments for a process tritoff starts (the command line), unless the user set the allocator
    through any of :data:`ENV_NAMES`; effective only before torch starts its allocator. Not on Windows."""
    global set_by_command
    if sys.platform != "win32" and not any(name in environ for name in ENV_NAMES):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
        set_by_command = environ is os.environ

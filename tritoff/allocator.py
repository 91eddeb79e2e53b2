"""The CUDA caching allocator's setting that a budget depends on.

A budget bounds the bytes tritoff and the activations hold; the caching allocator reserves more than it hands out, in
fixed segments that large activations of different sizes fragment. At Wan-14B's 480x832x81 (32,760 tokens) on an
H100, the all-resident forward reserved 2.5 GiB more than its allocated peak, and tritoff under a 12 GB cap ran out
of reserved memory while its allocated peak (10.6 GiB) fitted: the same runs with expandable segments fitted
(docs/benchmarks.md). The setting is read when CUDA starts, so a library cannot change it for the user; it can say so.
"""

from __future__ import annotations

import os

from tritoff.warn import warn

HINT = (
    "the CUDA caching allocator is not using expandable segments, so at video shapes its fixed segments fragment "
    "and memory can run out below the budget: start Python with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "(the tritoff command line sets it)"
)
_warned = False


def settings(environ=os.environ) -> dict[str, str]:
    """The allocator's ``key:value`` options from ``PYTORCH_ALLOC_CONF`` (torch's newer name, read first) or
    ``PYTORCH_CUDA_ALLOC_CONF``, keys lower-cased."""
    conf = environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    options = {}
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip():
            options[key.strip().lower()] = value.strip()
    return options


def fragments(environ=os.environ) -> bool:
    """Whether the allocator keeps fixed segments: neither expandable segments nor CUDA's own pool allocator
    (``backend:cudaMallocAsync``) is configured."""
    options = settings(environ)
    return options.get("expandable_segments", "").lower() != "true" and options.get("backend") != "cudaMallocAsync"


def warn_if_fragmenting() -> None:
    """Warn once per process, at the first enable on a CUDA device, when the allocator keeps fixed segments."""
    global _warned
    if not _warned and fragments():
        _warned = True
        warn(HINT)


def prefer_expandable_segments(environ=os.environ) -> None:
    """Turn on expandable segments for a process tritoff starts (the command line), unless the user configured the
    allocator; effective only before CUDA starts."""
    if "PYTORCH_ALLOC_CONF" not in environ and "PYTORCH_CUDA_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

"""tritoff's warnings: their own category, attributed to the user's line (the first frame outside tritoff and the
libraries it runs inside)."""

from __future__ import annotations

import sys
import warnings

# a warning raised in a hook is reached through module calls, accelerate's hook wrapper and torch's dynamo wrappers:
# a fixed stacklevel lands in one of their frames, which tells the user nothing
LIBRARIES = frozenset(
    {"tritoff", "torch", "accelerate", "diffusers", "transformers", "peft", "contextlib", "functools"}
)

# where a thread's stack starts: a thread, a pool's worker (concurrent.futures, asyncio.to_thread)
THREAD_STARTS = frozenset({"threading", "concurrent", "asyncio"})


class TritoffWarning(UserWarning):
    """What tritoff warns about (``warnings.filterwarnings("ignore", category=tritoff.TritoffWarning)`` silences it);
    the command line prints it in one line."""


def warn(message: str, category: type[Warning] = TritoffWarning) -> None:
    """``warnings.warn(message)`` at the innermost frame that is not in :data:`LIBRARIES` (the user's call)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in LIBRARIES:
        frame, level = frame.f_back, level + 1
    # no user frame: the stack's bottom, or a thread's start (a thread or an executor running a pipeline, tritoff's
    # disk reader) names tritoff's own line, which says more than threading.py
    user = frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] not in THREAD_STARTS
    warnings.warn(message, category, stacklevel=level if user else 2)

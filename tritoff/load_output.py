"""What a pipeline's load prints, held until it ends: shown then, or dropped when tritoff's one-line error says it.

When a config does not describe the weights beside it, transformers prints a report of every mismatched tensor before
failing, and diffusers warns of the config's unknown keys: above the one line naming the config, that is noise. Held
until the load ends (after its progress bars), the libraries' warnings and log records are shown in the order they
came, unless the load failed for a reason tritoff names (:meth:`HeldLoadOutput.drop`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

LIBRARIES = ("diffusers", "transformers")


class HeldLoadOutput:
    """Warnings and log records held during a load (:func:`held_load_output`), in the order they came: shown when it
    ends, unless :meth:`drop` was called."""

    def __init__(self):
        self.items: list[tuple[str, object]] = []  # ("warning", showwarning's arguments) or ("record", LogRecord)
        self.dropped = False

    def drop(self) -> None:
        """Show none of them: the load failed with an error that says what they would have said."""
        self.dropped = True


class _Collector(logging.Handler):
    def __init__(self, held: HeldLoadOutput):
        super().__init__()
        self.held = held

    def emit(self, record):
        self.held.items.append(("record", record))


@contextlib.contextmanager
def held_load_output():
    """Hold the warnings and the log records of diffusers' and transformers' loggers until the block ends, then show
    them in their order unless :meth:`HeldLoadOutput.drop` was called. Handlers a user added to a library's inner
    loggers get their records as they come, and once."""
    import diffusers  # noqa: F401 - imported first: each library gives its logger its handler when imported
    import transformers  # noqa: F401

    held = HeldLoadOutput()
    loggers = [logging.getLogger(name) for name in LIBRARIES]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    collector = _Collector(held)
    for logger in loggers:
        logger.handlers, logger.propagate = [collector], False
    shown_before = warnings.showwarning  # set back alone: filters the load adds (libraries' imports) stay

    def hold(*shown, **named):
        held.items.append(("warning", (shown, named)))

    warnings.showwarning = hold
    try:
        yield held
    finally:
        if warnings.showwarning is hold:
            warnings.showwarning = shown_before
        for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
            added = [h for h in logger.handlers if h is not collector]  # by whatever the load configured
            logger.handlers, logger.propagate = handlers + added, propagate
        if not held.dropped:
            _show(held.items)


def _show(items: list) -> None:
    """Show held ``items`` as they would have been shown: warnings through ``warnings.showwarning`` (filtered once
    already), records through the library logger's handlers and those above it (inner loggers' handlers had them; the
    loggers' filters passed them on the way)."""
    for kind, item in items:
        if kind == "warning":
            shown, named = item
            warnings.showwarning(*shown, **named)
        else:
            logging.getLogger(item.name.partition(".")[0]).callHandlers(item)

"""Command-line arguments as the tritoff command and the benchmarks take them: usage errors in one line (exit 2) and
argument types that say what they expected. Imports nothing heavy: a benchmark parses its arguments before it decides
how Triton runs."""

from __future__ import annotations

import argparse

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its default prints the whole usage block first). ``hints``: advice added
    to the errors that end with a key (``"required: out_dir"``: what most often leaves it out)."""

    def __init__(self, *args, hints: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hints = hints or {}

    def error(self, message: str):
        """Print ``message`` as one line and exit with :data:`EXIT_USAGE`."""
        hint = next((h for end, h in self.hints.items() if message.endswith(end)), None)
        message = f"{message}; {hint}" if hint else message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def at_least(minimum: int, at_most: int | None = None):
    """An argument type: an integer >= ``minimum`` (and <= ``at_most``, when given)."""
    wanted = f"an integer >= {minimum}" if at_most is None else f"an integer from {minimum} to {at_most}"

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value!r}") from None
        if number < minimum or (at_most is not None and number > at_most):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value!r}")
        return number

    parse.__name__ = wanted.removeprefix("an ")
    return parse

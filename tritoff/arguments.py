"""Command-line arguments as the tritoff command and the benchmarks take them: usage errors in one line (exit 2) and
argument types that say what they expected. Imports nothing heavy: a benchmark parses its arguments before it decides
how Triton runs."""

from __future__ import annotations

import argparse

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its default prints the whole usage block first)."""

    def error(self, message: str):
        """Print ``message`` as one line and exit with :data:`EXIT_USAGE`."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def at_least(minimum: int):
    """An argument type: an integer >= ``minimum``."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value!r}")
        return number

    parse.__name__ = f"integer >= {minimum}"
    return parse

"""``python -m tritoff``: the command line."""

from tritoff.cli import entry

entry()

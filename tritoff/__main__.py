"""``python -m tritoff``: the command line."""

import sys

from tritoff.cli import main

sys.exit(main())

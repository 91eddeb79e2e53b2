"""tritoff/report.py: the report's mode column says how each component is managed."""

import pytest

import tritoff

from .helpers import wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


@pytest.mark.parametrize("mode", ["group", "leaf"])
def test_mode_column_names_the_mode(mode):
    engine = tritoff.enable(wan(), mode=mode, budget="4MB", progress=False, kernels="reference")
    lines = engine.report().splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.split()[:2] == ["component", "mode"]) + 1 :]
    rows = {line.split()[0]: line.split()[1] for line in table if len(line.split()) > 1}
    assert rows["transformer"] == mode  # split into blocks (group) or into single layers (leaf)
    assert rows["vae"] == "model"  # moves whole in both
    assert engine.stats["components"]["transformer"]["mode"] == mode

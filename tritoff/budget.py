"""GPU memory budgets: ``12GB``, ``"12 GiB"``, ``"80%"`` or a byte count."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported on use: the command line checks a budget's syntax before loading it
    import torch

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
MAX_BYTES = 2**63  # sizes from this up are refused
_PATTERN = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*|%)\s*$")  # 12GB, 1.5e9


def parse_size(
    value: int | float | str, *, what: str = "budget", total: int | None = None, percent: bool = True
) -> int:
    """Bytes from ``value``: an int, ``"12GB"`` (10^9), ``"12GiB"`` (2^30), ``"12 GB"``, or ``"80%"`` of ``total``
    (``percent`` False: where a percentage is not taken, its errors suggest none)."""
    examples = "'12GB', '12GiB' or '80%'" if percent else "'12GB' or '12GiB'"
    if isinstance(value, bool):
        raise ValueError(f"invalid {what} {value!r}: give bytes, e.g. {examples}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):  # an int is finite, if too large for a float
            raise ValueError(f"invalid {what} {value!r}: give a finite number of bytes, e.g. '12GB'")
        if value <= 0:
            raise ValueError(f"invalid {what} {value!r}: it must be positive, e.g. '12GB'")
        return _whole_bytes(value, value, what)
    match = _PATTERN.match(str(value))
    unit = match.group(2).upper() if match else None
    if not match or (unit not in _UNITS and unit != "%"):
        raise ValueError(f"invalid {what} {value!r}: give bytes, e.g. {examples}")
    number = float(match.group(1))
    if not math.isfinite(number * _UNITS.get(unit, 1)):  # 1e999
        raise ValueError(f"invalid {what} {value!r}: give a finite number of bytes, e.g. '12GB'")
    if number <= 0:
        raise ValueError(f"invalid {what} {value!r}: it must be positive")
    if unit == "" and number < 2**20:  # "12" meant 12GB: bytes that few are a unit left out (an int says bytes)
        raise ValueError(f"invalid {what} {value!r}: a number without a unit is bytes; give a unit, e.g. '12GB'")
    if unit == "%":
        if not percent:
            raise ValueError(f"invalid {what} {value!r}: give bytes (e.g. '12GB'), not a percentage")
        if number > 100:
            raise ValueError(f"invalid {what} {value!r}: a percentage must be at most 100%")
        if total is None:
            raise ValueError(f"{what} {value!r} is a percentage, but there is no GPU memory to take it of; give bytes")
        return _whole_bytes(total * number / 100, value, what)
    return _whole_bytes(number * _UNITS[unit], value, what)


def parse_rate(value: int | float | str, what: str) -> int:
    """Bytes per second from ``value``: a size as :func:`parse_size` takes it, without a percentage, optionally
    followed by ``/s`` (``"25GB/s"``)."""
    if isinstance(value, str) and value.rstrip().lower().endswith("/s"):
        value = value.rstrip()[:-2]
    return parse_size(value, what=what, percent=False)


def _whole_bytes(size: float, value, what: str) -> int:
    """``size`` rounded down to whole bytes; less than one byte is refused (``budget=0.5`` meant a unit), and so is
    more than any machine addresses (2**63 bytes: arithmetic in floats and in torch would overflow on it)."""
    if size < 1:
        raise ValueError(f"invalid {what} {value!r}: that is less than one byte; give a unit, e.g. '12GB'")
    if size >= MAX_BYTES:
        shown = repr(value) if len(repr(value)) <= 24 else f"of {len(str(value))} characters"
        raise ValueError(f"invalid {what} {shown}: more than 2**63 bytes, more than any machine has; e.g. '12GB'")
    return int(size)


def parse_host_budget(value, what: str = "host_budget", percent: bool = True) -> int | None:
    """A host budget in bytes: a size as :func:`parse_size` takes it (a percentage is of :func:`host_memory`), or zero
    in any spelling (every pack served from disk); None stays None (every pack held)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0
    match = _PATTERN.match(value) if isinstance(value, str) else None
    if match and float(match.group(1)) == 0 and (match.group(2).upper() in _UNITS or match.group(2) == "%"):
        return 0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"invalid {what} {value!r}: give bytes, e.g. '8GB', or 0 to read every pack from disk")
    return parse_size(value, what=what, total=host_memory(), percent=percent)


def host_memory() -> int | None:
    """Bytes of memory this process may use: the machine's RAM, or less where a cgroup limits it (a container started
    with ``--memory``, a systemd slice), whose limit the kernel enforces by killing the process; None if unknown."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    limits = [n for n in (ram, *cgroup_memory_limits()) if n]
    return min(limits) if limits else None


def cgroup_memory_limits(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> list[int]:
    """The memory limits set on this process's cgroups and their ancestors (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), as the kernel lists them under ``root``; none where there are none (or no cgroups)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = base / path.strip().lstrip("/")
        while base == here or base in here.parents:  # a limit on an ancestor holds too
            try:
                text = (here / name).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit():  # v2 writes "max" where there is none
                limits.append(int(text))
            if here == base:
                break
            here = here.parent
    return limits


def reserves_everything(reserve) -> bool:
    """Whether ``reserve`` is a percentage of 100 or more, which leaves nothing of the budget for weights (checked
    before :func:`parse_size`, which takes up to 100%; ``inf%`` is left to its finite-number error)."""
    fraction = percentage(reserve)
    return fraction is not None and 1 <= fraction < math.inf


def percentage(value) -> float | None:
    """The fraction a valid size ``value`` such as ``"20%"`` names (0.2), or None when it is not a percentage."""
    match = _PATTERN.match(value) if isinstance(value, str) else None
    return float(match.group(1)) / 100 if match and match.group(2) == "%" else None


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(free, total) bytes of ``device``; (None, None) on the CPU."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return free, total
    return None, None


# Kept free by the default budget: memory a device uses beyond what the plan counts (the allocator's rounding and
# fragmentation between activations of different sizes, cuBLAS and cuDNN workspaces, CUDA kernel modules loaded on
# first use), 5% of the free memory and at least 512 MiB
HEADROOM_FRACTION = 0.05
HEADROOM_MIN = 512 * 2**20


def default_budget(free: int) -> int:
    """The budget used when none is given: ``free`` device bytes less the headroom."""
    return max(0, free - max(HEADROOM_MIN, int(free * HEADROOM_FRACTION)))


def format_bytes(n: int | float, up: bool = False) -> str:
    """``n`` bytes as a short human string (GiB/MiB/KiB). ``up``: rounded up, not to the nearest, where the figure
    names a smallest budget (given back as a budget, it must be enough)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{(math.ceil(n * 100 / size) / 100 if up else n / size):.2f} {unit}"
    return f"{math.ceil(n) if up else int(n)} B"

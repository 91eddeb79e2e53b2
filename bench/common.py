"""Shared by the benchmark scripts: the environment record, writing results as JSON, and their arguments' types
(each bad value one line, exit 2, before anything is measured)."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    """Device name, driver and library versions, and the date: stored with every result."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **_machine()}


@functools.cache
def _machine() -> dict:
    """What does not change while a process runs (read once: results are rewritten after every measurement, and
    nvidia-smi takes a while)."""
    env = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for name in ("triton", "diffusers", "transformers", "accelerate", "huggingface_hub", "safetensors", "tritoff"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    env["host_memory_bytes"] = _host_memory()
    env["pytorch_cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")  # changes what a memory cap admits
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = torch.cuda.get_device_name()
        env["device_memory_bytes"] = props.total_memory
        env["multiprocessors"] = props.multi_processor_count
        env["cuda"] = torch.version.cuda
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            env["driver"] = None
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def _host_memory() -> int | None:
    try:
        import psutil

        return psutil.virtual_memory().total
    except ImportError:
        return None


def write_result(name: str, data: dict, smoke: bool = False, out: str | Path | None = None) -> Path:
    """Write ``data`` with the environment to ``<out>/<name>[-smoke].json`` (``out`` defaults to bench/results);
    returns the path. Written to a temporary file and renamed, so a run killed mid-write leaves the previous file, and
    a write that fails leaves no temporary file."""
    out = Path(out) if out is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}{'-smoke' if smoke else ''}.json"
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps({"environment": environment(), **data}, indent=2) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def out_directory(value: str) -> str:
    """An argument type: a directory for results, where a file can be written now or, when it does not exist yet, in
    the nearest directory above it, which it is made in at the first write (checked before the first measurement,
    which on a GPU may take minutes; nothing is made while the arguments are read)."""
    from tritoff.atomic import can_create_in, nearest_existing

    if not value.strip():
        raise argparse.ArgumentTypeError("expected a directory, got an empty string")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a file: give a directory")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, so {value} cannot be made: give a directory")
    if not can_create_in(existing):
        raise argparse.ArgumentTypeError(f"cannot write in {existing}: give a directory you can write to")
    return str(path)


def size(value: str) -> str:
    """An argument type: a size tritoff takes (``12GB``, ``5MB``, bytes), kept as given."""
    return _checked_size(value, "budget", None)


def share_or_size(value: str) -> str:
    """An argument type: a percentage of the budget (``25%``) or a size, kept as given."""
    return _checked_size(value, "reserve", 1 << 40)  # any total: only the spelling is checked here


def _checked_size(value: str, what: str, total: int | None) -> str:
    from tritoff.budget import parse_size

    try:
        parse_size(value, what=what, total=total)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def tag(value: str) -> str:
    """An argument type: a word appended to result file names (letters, digits, ``.``, ``_``, ``-``)."""
    if value and not re.fullmatch(r"[A-Za-z0-9._-]+", value):
        raise argparse.ArgumentTypeError(f"expected letters, digits, '.', '_' or '-' for a file name, got {value!r}")
    return value


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_lines(
    name: str,
    series: dict[str, tuple[list, list]],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    smoke: bool = False,
    out: str | Path | None = None,
) -> Path | None:
    """A PNG line plot at ``<out>/<name>[-smoke].png`` (``out`` defaults to bench/results) of ``series``
    (label -> (xs, ys)); None without matplotlib (``pip install tritoff[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tritoff[bench]')")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out) if out is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}{'-smoke' if smoke else ''}.png"
    fig.savefig(path)
    plt.close(fig)
    return path

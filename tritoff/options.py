"""The options of ``tritoff.enable``, checked and resolved in one place: every bad value is refused in one line that
says what to use, before anything changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tritoff.budget import (
    default_budget,
    device_memory,
    parse_host_budget,
    parse_size,
    percentage,
    reserves_everything,
)
from tritoff.formats import check_granularity, get_format
from tritoff.kernels import backend
from tritoff.planner import MODES
from tritoff.skip import SkipRules, skip_patterns
from tritoff.storage import resolve_storage

TRANSPORTS = ("auto", "staged", "zero_copy")
KERNELS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class Options:
    """Validated options of :func:`enable`."""

    storage: dict[str, str]  # component -> storage format name
    granularity: str
    skip: tuple[str, ...]
    mode: str
    budget: int
    reserve: int
    device: torch.device
    prefetch: int
    transport: str
    kernels: str
    reserve_fraction: float | None = None  # the reserve is this fraction of the budget (the default, or "20%")
    host_budget: int | None = None  # host bytes the packs may hold (None: all of them)

    @property
    def staged(self) -> bool:
        """Whether packs reach the device through staging (the copy engine, then the upcast): all but zero-copy."""
        return self.transport != "zero_copy"

    @property
    def reads_host_directly(self) -> bool:
        """Whether kernels read the packs zero-copy from page-locked host memory (which must then be locked)."""
        return self.transport == "zero_copy" and self.device.type == "cuda"


def check_device(device) -> torch.device:
    """``device`` as a usable compute device (``cuda`` resolved to its index), or a one-line ValueError."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"invalid device {device!r}: use 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tritoff cannot compute on device {str(device)!r}: use 'cuda', 'cuda:N' or 'cpu'")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available; pass device='cpu'")
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"there is no device {str(device)!r}: this machine has {count} CUDA devices")
    return torch.device("cuda", index)


def check_prefetch(prefetch) -> None:
    """Refuse a ``prefetch`` that is not a whole number of blocks >= 1, in one line."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an integer >= 1, got {prefetch!r}")


def resolve(
    components, storage, granularity, skip, mode, budget, reserve, device, prefetch, transport, kernels, host_budget
) -> Options:
    """:func:`tritoff.enable`'s arguments for ``components`` as :class:`Options`: names checked, sizes parsed, the
    device, budget and reserve resolved to their defaults where left out."""
    storage = resolve_storage(storage, components)
    host_budget = parse_host_budget(host_budget)
    check_granularity(granularity)
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}: use one of {', '.join(TRANSPORTS)}")
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}: use one of {', '.join(KERNELS)}")
    check_prefetch(prefetch)
    device = check_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    check_kernels(kernels, device)
    free, total = device_memory(device)
    if budget is None:
        # no budget: the device's free memory less headroom for what the plan cannot count (on the CPU: everything
        # fits)
        total_bytes = sum(p.numel() * p.element_size() for m in components.values() for p in m.parameters())
        budget_bytes = default_budget(free) if free is not None else 2 * total_bytes + 2**30
    else:
        budget_bytes = parse_size(budget, total=total)
    if reserve is None:
        fraction = 0.1
    else:
        # a percentage is checked for syntax only: of a budget too small it is less than a byte, which the planner
        # then refuses naming the smallest budget that works
        fraction = percentage(reserve)
        if reserves_everything(reserve):
            raise ValueError(f"reserve {reserve!r} leaves nothing of the budget for weights: use less than 100%")
        reserve_bytes = parse_size(reserve, what="reserve", total=budget_bytes if fraction is None else 2**50)
    # a fraction of the budget is computed as the planner computes it when it names the smallest budget that works
    if fraction is not None:
        reserve_bytes = int(budget_bytes * fraction)
    if mode is None:
        mode = "auto"
    return Options(
        storage,
        granularity,
        skip_patterns(skip),
        mode,
        budget_bytes,
        reserve_bytes,
        device,
        prefetch,
        transport,
        kernels,
        fraction,
        host_budget,
    )


def check_kernels(kernels: str, device: torch.device) -> None:
    """Refuse ``kernels='triton'`` where Triton cannot run on ``device``, before any weight is packed."""
    if kernels == "triton" and not backend.triton_runs_on(device):
        raise ValueError(
            f"kernels='triton' but Triton cannot run on {device}; install triton (CUDA), set TRITON_INTERPRET=1 "
            "before triton is first imported (CPU; torch.compile imports it), or use kernels='auto'"
        )


def same_skip(
    components: dict[str, nn.Module], storage: dict[str, str], a: tuple[str, ...], b: tuple[str, ...]
) -> bool:
    """Whether skip patterns ``a`` and ``b`` keep the same weights unquantized in every component ``storage``
    quantizes (whatever their order, repetitions or spelling)."""
    if set(a) == set(b):
        return True
    fp8 = [m for name, m in components.items() if get_format(storage.get(name, "bf16")).is_fp8]
    return all(
        SkipRules.for_model(m, a).quantized_names(m) == SkipRules.for_model(m, b).quantized_names(m) for m in fp8
    )

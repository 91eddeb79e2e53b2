"""Quantize a model group by group into packs that all live in one host arena.

Sizes come from parameter shapes alone, so the arena is allocated once before any weight is read. Groups are then
quantized one at a time and (with ``release=True``) each group's original weights are dropped as soon as its pack is
written: peak host memory is the packs plus one group, not the model plus its packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from tritoff.arena import PAGE, HostArena
from tritoff.formats import StorageFormat, check_granularity, get_format
from tritoff.groups import Group, block_groups
from tritoff.pack import PackLayout, TensorSpec, align, write_pack
from tritoff.skip import SkipRules


@dataclass
class Pack:
    """One group's pack: its layout and its bytes in the arena."""

    name: str
    layout: PackLayout
    offset: int  # in the arena
    data: torch.Tensor  # uint8 view of the arena


@dataclass
class PackedModel:
    """Every pack of a model, the arena holding them, and the groups they came from."""

    arena: HostArena
    packs: list[Pack]
    groups: list[Group]
    storage: StorageFormat
    granularity: str

    @property
    def packed_bytes(self) -> int:
        """Bytes of all packs (payloads, scales, kept tensors, alignment)."""
        return sum(p.layout.nbytes for p in self.packs)

    @property
    def unpacked_bytes(self) -> int:
        """Bytes the same tensors take in their compute dtypes."""
        return sum(p.layout.out_nbytes for p in self.packs)


def _quantizer(device: torch.device):
    from tritoff.kernels import quantize, quantize_reference, triton_runs_on

    if device.type == "cuda" and triton_runs_on(device):
        return lambda w, fmt, gran: quantize(w.to(device, non_blocking=True), fmt, gran)
    return quantize_reference


def release_params(group: Group) -> None:
    """Point every parameter of ``group`` at an empty tensor of its dtype, freeing the original weights."""
    for _, param in group.params:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def plan_layouts(groups: list[Group], quantized: set[str], fmt: StorageFormat, granularity: str) -> list[PackLayout]:
    """Each group's pack layout, from parameter shapes and dtypes alone (no weight is read); ``quantized`` names the
    parameters to quantize (:meth:`SkipRules.quantized_names`)."""
    return [
        PackLayout.plan(
            [TensorSpec(n, tuple(p.shape), p.dtype, n in quantized) for n, p in group.params], fmt, granularity
        )
        for group in groups
    ]


def pack_offsets(layouts: list[PackLayout]) -> tuple[list[int], int]:
    """Each pack's offset in the arena (page-aligned: whole pages per DMA) and the arena's size."""
    offsets, total = [], 0
    for layout in layouts:
        offsets.append(total)
        total += align(layout.nbytes, PAGE)
    return offsets, total


def pack_model(
    model: nn.Module,
    storage: str | StorageFormat = "fp8_e4m3",
    *,
    granularity: str = "row",
    skip: tuple[str, ...] = (),
    groups: list[Group] | None = None,
    release: bool = False,
    quantize_on: torch.device | str | None = None,
    register: bool | None = None,
    progress: bool = True,
    snr: dict | None = None,
    read_group=None,
    layouts: list[PackLayout] | None = None,
    desc: str | None = None,
    arena: HostArena | None = None,
) -> PackedModel:
    """Quantize ``model`` into packs, one per group (default: its blocks, then the rest), in one host arena.

    ``skip`` adds regexes of module names to keep unquantized. ``release`` drops each group's weights once packed.
    ``quantize_on`` picks where quantization runs (default: CUDA with Triton when available, else the CPU reference).
    ``snr``, when given, receives each quantized weight's SNR in dB. ``read_group(group) -> {name: tensor}`` supplies
    each group's tensors instead of its parameters (a model built without weights, read from a checkpoint group by
    group). ``layouts``: the groups' layouts when the caller already planned them (:func:`plan_layouts`).
    ``arena``: an arena sized by :func:`pack_offsets` the caller allocated (and checked) beforehand.
    """
    fmt = get_format(storage)
    check_granularity(granularity)
    groups = block_groups(model) if groups is None else groups
    if layouts is None:
        layouts = plan_layouts(groups, SkipRules.for_model(model, skip).quantized_names(model), fmt, granularity)
    offsets, total = pack_offsets(layouts)
    if arena is None:
        arena = HostArena(total, register=register)
    elif arena.nbytes != total:
        raise ValueError(f"the arena holds {arena.nbytes} bytes but these packs need {total}")
    device = torch.device(quantize_on) if quantize_on is not None else _default_quantize_device()
    quantizer = _quantizer(device)
    packs = []
    bar = tqdm(
        zip(groups, layouts, offsets, strict=True),
        total=len(groups),
        desc=desc or f"packing {type(model).__name__}",
        disable=not progress,
    )
    for group, layout, offset in bar:
        data = arena.view(offset, layout.nbytes)
        with torch.no_grad():
            tensors = read_group(group) if read_group else {n: p.detach() for n, p in group.params}
            write_pack(layout, data, tensors, quantizer, snr)
        packs.append(Pack(group.name, layout, offset, data))
        if release:
            release_params(group)
    return PackedModel(arena, packs, groups, fmt, granularity)


def _default_quantize_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

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

from tritoff.arena import PAGE, HostArena, locks
from tritoff.disk import PackFile
from tritoff.formats import StorageFormat, check_granularity, get_format
from tritoff.groups import Group, block_groups, group_label
from tritoff.kernels.upcast import KIND_FP8
from tritoff.pack import MixedDtypes, PackLayout, TensorSpec, align, dequantize_bytes, write_pack
from tritoff.skip import SkipRules


@dataclass(eq=False)  # identity: packs are compared as objects (their bytes may be a tensor)
class Pack:
    """One group's pack: its layout and where its bytes are: in the host arena, or in a file (``tritoff/disk.py``)
    when the host budget does not hold it."""

    name: str
    layout: PackLayout
    offset: int  # in the component's layout of packs (a store file's data, a spill file)
    data: torch.Tensor | None  # uint8 view of the arena; None when the pack is served from ``file``
    file: PackFile | None = None  # the file holding it (a store, a spill file), when it has one
    hash: str | None = None  # XXH3-128 of its bytes, checked when read from a store file
    rewritten: bool = False  # a fused LoRA wrote into its bytes: a store's file no longer holds them

    @property
    def on_disk(self) -> bool:
        """Whether the pack is read from its file when needed (not held in host memory)."""
        return self.data is None


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
    def disk_bytes(self) -> int:
        """Bytes of the packs served from disk."""
        return sum(p.layout.nbytes for p in self.packs if p.on_disk)

    @property
    def held_bytes(self) -> int:
        """Host memory of the packs held in an arena, page by page (a pack moved after a re-plan, ``rehold.py``, may
        lie in another component's arena)."""
        return sum(align(p.layout.nbytes, PAGE) for p in self.packs if not p.on_disk)

    @property
    def layout_bytes(self) -> int:
        """Bytes of every pack laid out page by page (the size of a store file's data)."""
        return pack_offsets([p.layout for p in self.packs])[1]

    @property
    def unpacked_bytes(self) -> int:
        """Bytes the same tensors take in their compute dtypes."""
        return sum(p.layout.out_nbytes for p in self.packs)


def arena_holding(packed: dict[str, PackedModel], pack: Pack) -> HostArena:
    """The arena of ``packed`` (component name -> packs) that holds ``pack``'s bytes: its own component's, unless a
    move after a re-plan (``tritoff/rehold.py``) put it in the slot of another component's pack."""
    if pack.layout.nbytes == 0:  # no bytes to lie anywhere (its view's address is 0): its own component's
        return next(m.arena for m in packed.values() if any(p is pack for p in m.packs))
    start = pack.data.data_ptr()
    for model in packed.values():
        base = model.arena.buffer.data_ptr()
        if model.arena.nbytes and base <= start < base + model.arena.nbytes:
            return model.arena
    raise RuntimeError(f"no arena holds the bytes of pack {pack.name}; this is a tritoff bug")


def pack_bytes(pack: Pack, recheck: bool = False) -> torch.Tensor:
    """``pack``'s bytes: its view of the arena, or a fresh copy read from its file (checked against its hash on the
    file's first read of it, or on this one: ``recheck``)."""
    if not pack.on_disk:
        return pack.data
    out = torch.empty(pack.layout.nbytes, dtype=torch.uint8)
    pack.file.read(pack, out, recheck=recheck)
    return out


def _quantizer(device: torch.device):
    from tritoff.kernels import quantize, quantize_reference, triton_runs_on

    if device.type == "cuda" and triton_runs_on(device):
        return lambda w, fmt, gran: quantize(w.to(device, non_blocking=True), fmt, gran)
    return quantize_reference


def release_params(group: Group) -> None:
    """Point every parameter of ``group`` at an empty tensor of its dtype, freeing the original weights."""
    for _, param in group.params:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def dequantized(pack: Pack, device: torch.device) -> dict[str, torch.Tensor]:
    """The pack's tensors dequantized exactly (with the reference), each in a storage of its own on ``device``, by
    name: views of one shared buffer of mixed dtypes would not survive ``torch.save`` or pickling."""
    # checked again: a store file changed in place since the engine first read it must not become the model's weights
    out = dequantize_bytes(pack.layout, pack_bytes(pack, recheck=True))
    return {name: tensor.to(device, copy=True) for name, tensor in pack.layout.views(out).items()}


def restore_params(group: Group, pack: Pack) -> None:
    """Give the parameters of ``group`` (released) their weights back, dequantized from ``pack`` (what tritoff
    computes with: fp8 weights come back rounded to fp8), each on the device it was released on."""
    tensors = dequantized(pack, torch.device("cpu"))
    for name, param in group.params:
        param.data = tensors[name].to(param.device)


def plan_layouts(
    groups: list[Group], quantized: set[str], fmt: StorageFormat, granularity: str, component: str = "model"
) -> list[PackLayout]:
    """Each group's pack layout, from parameter shapes and dtypes alone (no weight is read); ``quantized`` names the
    parameters to quantize (:meth:`SkipRules.quantized_names`). A group whose weights to quantize have more than one
    dtype is refused in one line naming them (``component``: how they are named)."""
    layouts = []
    for group in groups:
        specs = [TensorSpec(n, tuple(p.shape), p.dtype, n in quantized) for n, p in group.params]
        try:
            layouts.append(PackLayout.plan(specs, fmt, granularity))
        except MixedDtypes as err:
            dtypes = ", ".join(f"{component}.{n} {str(d).removeprefix('torch.')}" for n, d in err.dtypes.items())
            where = group_label(component, group)
            raise MixedDtypes(
                err.dtypes,
                (
                    f"{where} has weights to quantize in more than one dtype ({dtypes}), which one "
                    f"pack cannot give back: keep those of one dtype unquantized (skip=[...] naming their modules), "
                    f"cast {component} to one dtype, or use mode='leaf' (a pack per layer)"
                ),
            ) from None
    return layouts


def relayout(layouts: list[PackLayout], groups: list[Group]) -> list[PackLayout]:
    """The layouts of ``groups``, another grouping of the tensors ``layouts`` lay out, from their entries alone (so
    from packs whose weights are gone too). Raises KeyError for a tensor ``layouts`` do not hold."""
    specs = {e.name: TensorSpec(e.name, e.shape, e.dtype, e.kind == KIND_FP8) for lay in layouts for e in lay.entries}
    storage, granularity = layouts[0].storage, layouts[0].granularity
    return [PackLayout.plan([specs[name] for name, _ in group.params], storage, granularity) for group in groups]


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
    held: set[str] | None = None,
    spill: PackFile | None = None,
    made: list[Pack] | None = None,
) -> PackedModel:
    """Quantize ``model`` into packs, one per group (default: its blocks, then the rest), in one host arena.

    ``skip`` adds regexes of module names to keep unquantized. ``release`` drops each group's weights once packed.
    ``quantize_on`` picks where quantization runs (default: CUDA with Triton when available, else the CPU reference).
    ``register`` page-locks the arena once its packs are written (default: when CUDA is available).
    ``snr``, when given, receives each quantized weight's SNR in dB. ``read_group(group) -> {name: tensor}`` supplies
    each group's tensors instead of its parameters (a model built without weights, read from a checkpoint group by
    group). ``layouts``: the groups' layouts when the caller already planned them (:func:`plan_layouts`).
    ``arena``: an arena sized by :func:`pack_offsets` (of the held packs) the caller allocated beforehand.
    ``held``: names of the groups whose packs stay in the arena (default: all); the others are written to ``spill``
    (:func:`tritoff.disk.spill_files`) one at a time, so host memory holds the held packs and one group.
    ``made``: a list the caller keeps, to which each pack is appended as it is made, before its group is released;
    the caller then gives the released weights back (:func:`restore_params`) wherever packing stops, after this call
    returned included. Without it, a failure inside this call gives them back before it raises.
    """
    fmt = get_format(storage)
    check_granularity(granularity)
    groups = block_groups(model) if groups is None else groups
    if layouts is None:
        layouts = plan_layouts(groups, SkipRules.for_model(model, skip).quantized_names(model), fmt, granularity)
    offsets, _ = pack_offsets(layouts)
    keep = [held is None or g.name in held for g in groups]
    if not all(keep) and spill is None:
        raise ValueError("packs that are not held need a spill file")
    kept_offsets, total = pack_offsets([lay for lay, k in zip(layouts, keep, strict=True) if k])
    kept_offsets = iter(kept_offsets)
    if arena is None:
        arena = HostArena(total, register=False)
    elif arena.nbytes != total:
        raise ValueError(f"the arena holds {arena.nbytes} bytes but these packs need {total}")
    spilled = [lay.nbytes for lay, k in zip(layouts, keep, strict=True) if not k]
    scratch = torch.empty(max(spilled, default=0), dtype=torch.uint8)  # one spilled pack at a time
    device = torch.device(quantize_on) if quantize_on is not None else quantize_device()
    quantizer = _quantizer(device)
    packs = []
    bar = tqdm(
        zip(groups, layouts, offsets, keep, strict=True),
        total=len(groups),
        desc=desc or f"packing {type(model).__name__}",
        disable=not progress,
    )
    try:
        for group, layout, offset, kept in bar:
            data = arena.view(next(kept_offsets), layout.nbytes) if kept else scratch[: layout.nbytes].zero_()
            with torch.no_grad():
                tensors = read_group(group) if read_group else {n: p.detach() for n, p in group.params}
                write_pack(layout, data, tensors, quantizer, snr)
            pack = Pack(group.name, layout, offset, data)
            if not kept:
                pack.data, pack.file = None, spill
                spill.write(pack, data)
            packs.append(pack)
            if made is not None:
                made.append(pack)
            if release:
                release_params(group)
        # closed now, not when the loop is collected: what is printed next starts a line. Inside the try, so that
        # nothing runs between the last statement a Ctrl-C can stop and the return
        bar.close()
        if locks(register):  # locked once written: locking faults in every page at once (seconds for a large model)
            arena.register()
        return PackedModel(arena, packs, groups, fmt, granularity)
    except BaseException:
        try:
            if release and made is None:  # a full disk, Ctrl-C: the groups released so far get their packs' weights
                for pack, group in zip(packs, groups, strict=False):
                    restore_params(group, pack)
        finally:  # what is printed next (an error, "interrupted") starts a line
            bar.close()
        raise


def quantize_device(device: torch.device | None = None) -> torch.device:
    """Where weights are quantized: ``device`` when it is a GPU (an engine on ``cuda:1`` quantizes there, not on the
    current device), else CUDA when available (Triton), else the CPU (the reference)."""
    if device is not None and device.type == "cuda":
        return device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def hold_packs(
    packed: PackedModel, held: set[str] | None, *, register: bool | None = None, progress: bool = False, desc=""
) -> None:
    """Read the packs of ``packed`` named in ``held`` (default: all) from their file into a new host arena; the
    others stay on disk. Each pack is checked against its hash as it is read, and its pages are dropped from the
    kernel's cache afterwards (the arena is now its copy)."""
    chosen = [p for p in packed.packs if p.on_disk and (held is None or p.name in held)]
    offsets, total = pack_offsets([p.layout for p in chosen])
    arena = HostArena(total, register=False)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc or "reading packs", disable=not progress or not total)
    with bar:  # closed even when a read fails or is interrupted: what is printed next starts a line
        for pack, offset in zip(chosen, offsets, strict=True):
            data = arena.view(offset, pack.layout.nbytes)
            pack.file.read(pack, data)
            pack.file.drop_cache(pack)
            pack.data = data
            bar.update(align(pack.layout.nbytes, PAGE))
    if locks(register):  # locked once read (faulted in already, locking is quicker)
        arena.register()
    packed.arena.close()
    packed.arena = arena

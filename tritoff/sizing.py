"""What the planner is given about the components: their groups, each group's packed and unpacked bytes, the device
bytes every phase shares; the plan made from them, and the smallest budget that works in each mode and prefetch
(which a refusal names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.nn as nn

from tritoff import operations
from tritoff.adapters import adapter_bytes, outer_modules
from tritoff.advice import advise
from tritoff.chunks import halving_chunk, smallest_chunk
from tritoff.groups import REST, Group, block_groups, is_block, is_host, leaf_groups
from tritoff.onload import table_bytes
from tritoff.pack import MixedDtypes
from tritoff.packer import relayout
from tritoff.planner import BudgetError, ComponentSize, GroupSize, chunk_capacity, plan_phases

if TYPE_CHECKING:
    from tritoff.options import Options

# a component with a stack of at least this many blocks is split into groups (transformers, big text encoders)
MIN_BLOCKS = 2


def groups_for(module: nn.Module, mode: str) -> list[Group]:
    """``module``'s groups in ``mode``: one per leaf layer in ``"leaf"``, else one per block and the rest."""
    if mode == "leaf":
        return leaf_groups(module)
    groups = block_groups(module)
    if mode == "group" and not any(is_block(g) for g in groups):
        # no block list to stream (a model without ModuleLists): stream its layers instead
        return leaf_groups(module)
    return groups


def splittable(module: nn.Module, groups: list[Group]) -> bool:
    """Whether ``module`` may be split into groups loaded one at a time: a stack of blocks, called through forward."""
    blocks = [g for g in groups if is_block(g)]
    # VAEs are called through encode/decode, which run only pre_forward hooks: they move whole
    return len(blocks) >= MIN_BLOCKS and not hasattr(module, "decode")


def looped(name: str) -> bool:
    """Whether component ``name`` is called again and again in a run (a denoiser), so its packs are read most."""
    return name == "model" or name.startswith(("transformer", "unet", "prior", "denoiser"))


def sizes_of(components, group_lists, layouts, mode) -> list[ComponentSize]:
    """What the planner places of each component: its blocks and the rest when it splits, else one whole unit."""
    sizes = []
    for name, module in components.items():
        groups, lays = group_lists[name], layouts[name]
        if all(is_host(g) for g in groups):  # nothing but host lookup tables: no device bytes at all
            sizes.append(ComponentSize(name, [], None, looped(name)))
            continue
        splits = mode != "model" and splittable(module, groups)
        each = [  # host lookup tables take no device memory
            GroupSize(
                g.name,
                lay.nbytes,
                lay.out_nbytes,
                smallest_chunk(lay),
                half_chunk=halving_chunk(lay) if splits and g.name != REST else 0,
            )
            for g, lay in zip(groups, lays, strict=True)
            if not is_host(g)
        ]
        blocks = [s for s in each if s.name != REST]
        rest = [s for s in each if s.name == REST]
        if splits:
            sizes.append(ComponentSize(name, blocks, rest[0] if rest else None, looped(name)))
        else:
            whole = GroupSize(
                name,
                sum(s.packed for s in each),
                sum(s.unpacked for s in each),
                max(s.min_chunk for s in each),
                max(s.packed for s in each),
            )
            sizes.append(ComponentSize(name, [], whole, looped(name)))
    return sizes


def buffer_bytes(components: dict[str, nn.Module]) -> int:
    """Bytes of the module buffers (rotary tables, position ids) and adapter weights that move to the device with the
    components."""
    buffers = sum(b.numel() * b.element_size() for m in components.values() for b in m.buffers())
    return buffers + sum(adapter_bytes(m) for m in components.values())


def shared_bytes(
    sizes, group_lists, layouts, components, staged: bool, zero_copy: bool, depth: int
) -> tuple[dict[str, int], int]:
    """Each component's staging chunk capacity at prefetch ``depth``, and the device bytes every phase shares: module
    buffers and the kernel tables (cut for those chunks; host lookup tables have none)."""
    chunks = {s.name: chunk_capacity(s, depth, staged) for s in sizes}
    tables = sum(
        table_bytes(lay, chunks[name], zero_copy)
        for name, lays in layouts.items()
        for lay, group in zip(lays, group_lists[name], strict=True)
        if not is_host(group)
    )
    return chunks, buffer_bytes(components) + tables


def plan_for(sizes, group_lists, layouts, components, options: Options, fixed_groups: bool = False):
    """The phased plan, with every device byte the engine allocates outside the groups accounted for (module buffers
    and the kernel tables, cut for each phase's staging chunk), and each component's chunk capacity.

    A budget too small is refused naming the prefetch and mode that lower the smallest budget that works
    (:func:`tritoff.advice.advise`); ``fixed_groups``: the groups are a store's, so no mode grouping otherwise is."""
    try:
        return _plan_phases(sizes, group_lists, layouts, components, options)
    except BudgetError as err:
        minimum = minimum_for(
            components,
            group_lists,
            layouts,
            dict.fromkeys(components, options.reserve),
            staged=options.staged,
            zero_copy=options.reads_host_directly,
            fraction=options.reserve_fraction,
            fixed_groups=fixed_groups,
        )
        raise advise(err, options.mode, options.prefetch, options.budget, minimum) from None


def regroup(components, group_lists, layouts, mode: str) -> tuple[dict, dict]:
    """The group lists and layouts of ``components`` in ``mode``: those given where the grouping is the same, else
    laid out again from ``layouts``' entries (:func:`packer.relayout`, which raises KeyError for a tensor they do not
    hold)."""
    lists = {n: groups_for(m, mode) for n, m in components.items()}
    same = {n for n in components if [g.name for g in lists[n]] == [g.name for g in group_lists[n]]}
    return lists, {n: layouts[n] if n in same else relayout(layouts[n], lists[n]) for n in components}


def minimum_for(
    components,
    group_lists,
    layouts,
    reserves: dict[str, int],
    *,
    staged: bool = True,
    zero_copy: bool = False,
    fraction: float | None = None,
    fixed_groups: bool = False,
) -> Callable[[str, int], int | None]:
    """A function of (mode, prefetch) giving the smallest budget that works with them (what the planner names when
    given one byte), with ``layouts`` laid out again for another grouping. It gives None for a mode enable would
    refuse here: a grouping whose tensors the layouts lack, that mixes dtypes to quantize in a group, or that
    ``fixed_groups`` (a store's) rules out, a component moving whole that is never called, hooks inside a block
    compiled with ``fullgraph=True``."""
    usable, minimums = {}, {}

    def plannable(mode: str):
        try:
            lists, lays = regroup(components, group_lists, layouts, mode)
        except (KeyError, MixedDtypes):  # tensors the layouts lack, or a group mixing dtypes to quantize
            return None
        if fixed_groups and any(lays[n] is not layouts[n] for n in components):
            return None
        sizes = sizes_of(components, lists, lays, mode)
        try:
            check_callable(components, sizes)
            operations.check_compiled(hooked_modules(components, lists, sizes), components)
        except ValueError:
            return None
        return sizes, lists, lays, max([len(s.blocks) for s in sizes] + [1])

    def minimum(mode: str, prefetch: int) -> int | None:
        if mode not in usable:
            usable[mode] = plannable(mode)
        if usable[mode] is None:
            return None
        sizes, lists, lays, most = usable[mode]
        depth = min(prefetch, most)  # a prefetch as deep as the blocks: every one has a slot, a deeper one adds none
        if (mode, depth) not in minimums:
            _, fixed = shared_bytes(sizes, lists, lays, components, staged, zero_copy, depth)
            try:
                plan_phases(sizes, 1, mode, depth, reserves, staged, fraction, fixed)
                minimums[mode, depth] = 1
            except BudgetError as err:
                minimums[mode, depth] = err.minimum
        return minimums[mode, depth]

    return minimum


def _plan_phases(sizes, group_lists, layouts, components, options: Options):
    """The phased plan at ``options``, and each component's chunk capacity; raises the planner's BudgetError."""
    staged = options.staged
    chunks, fixed = shared_bytes(
        sizes, group_lists, layouts, components, staged, options.reads_host_directly, options.prefetch
    )
    reserves = dict.fromkeys(chunks, options.reserve)
    fraction = options.reserve_fraction
    phased = plan_phases(sizes, options.budget, options.mode, options.prefetch, reserves, staged, fraction, fixed)
    return phased, chunks


def hooked_modules(components: dict[str, nn.Module], group_lists: dict, sizes: list[ComponentSize]) -> dict:
    """The modules :meth:`Engine._build_runtime` hooks, per component: its root, the first module of each block of a
    split component, and every layer looking up a table kept on the host."""
    split = {size.name for size in sizes if size.blocks}
    hooked = {}
    for name, module in components.items():
        outer = outer_modules(module)
        blocks = [g for g in group_lists[name] if name in split and is_block(g)]
        readers = [reader for g in group_lists[name] if is_host(g) for _, reader in g.modules]
        hooked[name] = [module, *(outer[g.modules[0][0]] for g in blocks), *readers]
    return hooked


def check_weight_hooks(hooked: dict[str, list[nn.Module]], components: dict[str, nn.Module]) -> None:
    """Refuse a module tritoff hooks (:func:`hooked_modules`) that computes its weight in a forward pre-hook of
    ``torch.nn.utils.weight_norm`` or ``spectral_norm``: ``nn.Module.__call__`` runs such a hook before the forward
    tritoff hooks loads the weights it reads, so it would compute from placeholders (NaN)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for name, modules in hooked.items():
        for module in modules:
            for hook in module._forward_pre_hooks.values():
                if isinstance(hook, (WeightNorm, SpectralNorm)):
                    fn = "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
                    path = next(n for n, m in components[name].named_modules() if m is module)
                    raise ValueError(
                        f"{name}{'.' + path if path else ''} computes its weight in torch.nn.utils.{fn}'s forward "
                        f"pre-hook, which runs before tritoff loads the weights it reads; use "
                        f"torch.nn.utils.parametrizations.{fn} (computed inside the forward) or call "
                        f"torch.nn.utils.remove_{fn} on it before enable"
                    )


def check_callable(components: dict[str, nn.Module], sizes: list[ComponentSize]) -> None:
    """A component moving whole is loaded when its root is called: refuse a root without a forward of its own."""
    for size in sizes:
        module = components[size.name]
        if not size.blocks and type(module).forward is nn.Module.forward:
            raise ValueError(
                f"{size.name} is a {type(module).__name__}, which is never called itself, so it cannot move as one "
                "unit; use mode='group' (each block is loaded when called), or enable tritoff on the module that "
                "calls it"
            )

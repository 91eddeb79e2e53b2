"""Split a model into module groups: the blocks of its ModuleLists, large embedding tables kept on the host, and the
rest of the model as one group.

Names and parameters are the model's own, as before any adapter was injected (:mod:`tritoff.adapters`): adapter
weights never join a group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.nn as nn

from tritoff.adapters import is_tuner_layer, named_modules, named_parameters

REST = "<rest>"
HOST = "host:"
# An embedding table larger than this stays in host memory and its lookups run there: a prompt reads a few hundred
# of its rows, so uploading UMT5's 256k x 4096 table (2 GiB) for each prompt would move 4000x the bytes it uses.
HOST_EMBEDDING_BYTES = 16 * 2**20


@dataclass
class Group:
    """A set of modules loaded and released together; ``params`` are (qualified name, parameter) pairs."""

    name: str
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)


def is_host(group: Group) -> bool:
    """Whether ``group`` is an embedding table kept in host memory (see :func:`host_embeddings`)."""
    return group.name.startswith(HOST)


def group_label(component: str, group: Group) -> str:
    """How messages name ``group`` of ``component``: ``transformer.blocks.3``, or ``transformer outside its blocks``
    for the rest of it."""
    return f"{component} outside its blocks" if group.name == REST else f"{component}.{group.name}"


def is_block(group: Group) -> bool:
    """Whether ``group`` is one of the blocks a component streams (not its rest, not a host table)."""
    return group.name != REST and not is_host(group)


def host_embeddings(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """The ``nn.Embedding`` modules of ``model`` whose table is larger than ``HOST_EMBEDDING_BYTES`` and read only
    through embedding lookups (a table tied to an output head is multiplied whole, so it must move), each once."""
    readers: dict[int, list[nn.Module]] = {}
    for _, module in named_modules(model):
        for param in module._parameters.values():
            if param is not None:
                readers.setdefault(id(param), []).append(module)
    found, seen = [], set()
    for name, module in named_modules(model):
        weight = getattr(module, "weight", None)
        if (
            name
            and type(module) is nn.Embedding
            and isinstance(weight, nn.Parameter)
            and id(weight) not in seen
            and weight.numel() * weight.element_size() > HOST_EMBEDDING_BYTES
            and all(type(m) is nn.Embedding for m in readers[id(weight)])
        ):
            seen.add(id(weight))
            found.append((name, module))
    return found


def _host_groups(model: nn.Module, owner: dict[int, str]) -> list[Group]:
    groups = []
    for name, module in host_embeddings(model):
        # every module looking the table up runs on the host: T5's ``shared`` and its encoder's ``embed_tokens`` (tied)
        readers = [(n, m) for n, m in named_modules(model) if m._parameters.get("weight") is module.weight]
        group = Group(f"{HOST}{name}", readers, [(f"{name}.weight", module.weight)])
        owner[id(module.weight)] = group.name
        groups.append(group)
    return groups


def _is_block_list(module: nn.Module) -> bool:
    """Repeated blocks: a ModuleList or Sequential of at least two modules of one class that can be called (a block's
    hook runs when it is). A list of unlike layers (an attention's ``to_out`` = [Linear, Dropout], a feed-forward's
    ``net``) is part of whatever holds it, and so is a list of lists (``for attn, ff in self.layers``): its elements
    are never called themselves."""
    return (
        isinstance(module, (nn.ModuleList, nn.Sequential))
        and len(module) > 1
        and len({type(m) for m in module}) == 1
        and type(module[0]).forward is not nn.Module.forward
    )


def _block_lists(module: nn.Module, prefix: str = ""):
    """(name, ModuleList) pairs found under ``module`` without descending into the lists' elements."""
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if is_tuner_layer(child):  # an adapted layer: no block list inside
            continue
        if _is_block_list(child):
            yield qualified, child
        else:
            yield from _block_lists(child, qualified + ".")


def _holders(model: nn.Module, hooked: dict[int, str]) -> dict[int, set[str]]:
    """For each parameter under ``model``: the groups whose modules hold it (``hooked``: module id -> group name;
    a module outside them is in the rest). Every path is walked, so a module registered twice counts twice."""
    holders: dict[int, set[str]] = defaultdict(set)

    def walk(module: nn.Module, group: str) -> None:
        group = hooked.get(id(module), group)
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)].add(group)
        for child in module._modules.values():
            if child is not None:
                walk(child, group)

    walk(model, REST)
    return holders


def block_groups(model: nn.Module) -> list[Group]:
    """One group per element of each ModuleList of ``model`` (e.g. ``blocks.0``), then one per large embedding table
    kept on the host (``host:shared``), then the rest of the model.

    A model that is itself a ModuleList or Sequential is one list of blocks (``0``, ``1``, ...). A ModuleList element
    without parameters makes no group. A parameter tied across blocks, or between a block and a module outside the
    blocks, joins the rest: it is loaded with the whole component, so every module using it finds it in place.
    """
    hosted: dict[int, str] = {}
    host = _host_groups(model, hosted)
    groups: list[Group] = []
    # a model that is itself a list (a plain nn.Sequential) streams its children
    is_list = isinstance(model, (nn.ModuleList, nn.Sequential)) and len(model) > 1
    named = [
        (f"{list_name}.{index}" if list_name else str(index), block)
        for list_name, blocks in ([("", model)] if is_list else _block_lists(model))
        for index, block in enumerate(blocks)
    ]
    first: dict[int, str] = {}  # a block registered twice is one group, under its first name
    for name, block in named:
        first.setdefault(id(block), name)
    holders = _holders(model, first)
    owner: set[int] = set(hosted)
    for name, block in named:
        if first[id(block)] != name:
            continue
        params = [
            (f"{name}.{p}", t) for p, t in named_parameters(block) if holders[id(t)] == {name} and id(t) not in owner
        ]
        if params:
            owner.update(id(t) for _, t in params)
            groups.append(Group(name, [(name, block)], params))
    groups += host
    rest = [(n, t) for n, t in named_parameters(model) if id(t) not in owner]
    if rest:
        groups.append(Group(REST, [("", model)], rest))
    return groups


def leaf_groups(model: nn.Module) -> list[Group]:
    """One group per Linear/Conv layer (smallest memory), then the large embedding tables kept on the host, then the
    rest of the model (with any parameter tied across layers, as in :func:`block_groups`, and the layers whose parent
    reads their weights without calling them: ``nn.MultiheadAttention``'s ``out_proj``, the layers of an
    ``nn.TransformerEncoderLayer``)."""
    from tritoff.skip import QUANTIZABLE_LAYERS

    owner: dict[int, str] = {}
    host = _host_groups(model, owner)
    groups: list[Group] = []
    # layers whose weights their parent reads without calling them, so no hook of theirs would run before the read:
    # an attention's out_proj, and every layer of an encoder layer (PyTorch's fast path in eval reads them all)
    uncalled = set()
    for _, m in named_modules(model):
        if isinstance(m, nn.TransformerEncoderLayer):
            uncalled.update(id(sub) for sub in m.modules())
        elif isinstance(m, nn.MultiheadAttention):
            uncalled.add(id(m.out_proj))
    layers = [
        (name, m)
        for name, m in named_modules(model)
        if name and isinstance(m, QUANTIZABLE_LAYERS) and id(m) not in uncalled
    ]
    holders = _holders(model, {id(m): name for name, m in layers})
    for name, module in layers:
        params = [
            (f"{name}.{p}", t) for p, t in named_parameters(module) if holders[id(t)] == {name} and id(t) not in owner
        ]
        if params:
            owner.update((id(t), name) for _, t in params)
            groups.append(Group(name, [(name, module)], params))
    groups += host
    rest = [(n, t) for n, t in named_parameters(model) if id(t) not in owner]
    if rest:
        groups.append(Group(REST, [("", model)], rest))
    return groups

"""Saved stores: a model's packs written once, then mapped (not read) at every start.

A store is a directory: ``tritoff_store.json`` (format version, tritoff version, storage, granularity, skip patterns,
grouping, and per component a fingerprint of its class, config and parameter names/shapes/dtypes) and one safetensors
file per component holding its whole arena as one uint8 tensor, with the pack tables in the file's metadata. The data
starts page-aligned, so the file is mapped read-only and viewed in place; on CUDA the mapping is registered read-only
so the copy engine reads straight from the page cache.

A store that does not match the model (another config, a missing or truncated file, another format version) is refused
with a one-line error: it is never silently or partly used.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
import torch.nn as nn

from tritoff import __version__
from tritoff.arena import PAGE, HostArena
from tritoff.atomic import atomic_path
from tritoff.formats import get_format
from tritoff.groups import Group
from tritoff.pack import PackEntry, PackLayout
from tritoff.packer import Pack, PackedModel

STORE_VERSION = 1
INDEX = "tritoff_store.json"


class StoreError(ValueError):
    """A store that cannot be used for this model; the message says why."""


def fingerprint(module: nn.Module) -> str:
    """sha256 of the module's class, config and parameter names, shapes and dtypes."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    elif config is not None:
        config = dict(config)
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version",)}
    params = [(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    blob = json.dumps({"class": type(module).__name__, "config": config, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _entry_dict(e: PackEntry) -> dict:
    return {
        "name": e.name,
        "shape": list(e.shape),
        "dtype": str(e.dtype).removeprefix("torch."),
        "kind": e.kind,
        "offset": e.offset,
        "nbytes": e.nbytes,
        "scale_offset": e.scale_offset,
        "num_scales": e.num_scales,
        "out_offset": e.out_offset,
    }


def _entry(d: dict) -> PackEntry:
    return PackEntry(
        d["name"],
        tuple(d["shape"]),
        getattr(torch, d["dtype"]),
        d["kind"],
        d["offset"],
        d["nbytes"],
        d["scale_offset"],
        d["num_scales"],
        d["out_offset"],
    )


def _write_atomic(path: Path, write) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


def save_store(
    directory: str | Path,
    fingerprints: dict[str, str],
    packed: dict[str, PackedModel],
    skip: tuple[str, ...],
    grouping: str,
) -> Path:
    """Write every component's packs to ``directory``; files appear complete or not at all.

    ``fingerprints`` are the components' :func:`fingerprint` taken before packing.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    first = next(iter(packed.values()))
    index = {
        "store_version": STORE_VERSION,
        "tritoff": __version__,
        "storage": first.storage.name,
        "granularity": first.granularity,
        "skip": list(skip),
        "grouping": grouping,
        "components": {},
    }
    for name, model in packed.items():
        meta = {
            "packs": [
                {
                    "name": p.name,
                    "offset": p.offset,
                    "nbytes": p.layout.nbytes,
                    "out_nbytes": p.layout.out_nbytes,
                    "out_dtype": str(p.layout.out_dtype).split(".")[-1],
                    "entries": [_entry_dict(e) for e in p.layout.entries],
                }
                for p in model.packs
            ]
        }
        nbytes = model.arena.nbytes
        header = {
            "arena": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]},
            "__metadata__": {"tritoff": json.dumps(meta)},
        }
        raw = json.dumps(header).encode()
        # pad the header with spaces so the data starts on a page boundary (safetensors allows trailing spaces)
        raw += b" " * (-(8 + len(raw)) % PAGE)
        file = f"{name}.safetensors"

        def write(f, raw=raw, model=model):
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            f.write(memoryview(model.arena.buffer.numpy()))

        _write_atomic(directory / file, write)
        index["components"][name] = {
            "file": file,
            "fingerprint": fingerprints[name],
            "nbytes": nbytes,
            "data_offset": 8 + len(raw),
        }
    _write_atomic(directory / INDEX, lambda f: f.write(json.dumps(index, indent=1).encode()))
    return directory


def read_index(directory: str | Path) -> dict:
    """The store's index, checked for its format version."""
    path = Path(directory) / INDEX
    if not path.is_file():
        raise StoreError(f"{directory} is not a tritoff store (no {INDEX}); create one with `tritoff convert`")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise StoreError(f"{path} is corrupt ({err}); recreate the store with `tritoff convert`") from None
    if index.get("store_version") != STORE_VERSION:
        raise StoreError(
            f"{directory} has store format {index.get('store_version')}, this tritoff reads "
            f"{STORE_VERSION}; recreate it with `tritoff convert`"
        )
    return index


def _read_meta(path: Path) -> dict:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return json.loads(header["__metadata__"]["tritoff"])


def stored_dtypes(directory: str | Path, component: str) -> dict[str, torch.dtype]:
    """Each stored parameter's dtype (as the model computes with it), for building a model without weights."""
    info = read_index(directory)["components"][component]
    meta = _read_meta(Path(directory) / info["file"])
    return {e["name"]: getattr(torch, e["dtype"]) for p in meta["packs"] for e in p["entries"]}


def load_store(
    directory: str | Path,
    components: dict[str, nn.Module],
    group_lists: dict[str, list[Group]],
    fingerprints: dict[str, str],
    register: bool | None = None,
) -> dict[str, PackedModel]:
    """Map every component's packs from ``directory``, after checking it matches ``components`` (their
    ``fingerprints``)."""
    directory = Path(directory)
    index = read_index(directory)
    stored = set(index["components"])
    if stored != set(components):
        raise StoreError(f"{directory} holds components {sorted(stored)} but the model has {sorted(components)}")
    fmt = get_format(index["storage"])
    result = {}
    for name in components:
        info = index["components"][name]
        if info["fingerprint"] != fingerprints[name]:
            raise StoreError(
                f"{directory}: component {name} does not match the store (another config or other "
                "weights' names/shapes); recreate it with `tritoff convert`"
            )
        path = directory / info["file"]
        if not path.is_file():
            raise StoreError(f"{path} is missing; recreate the store with `tritoff convert`")
        expected = info["data_offset"] + info["nbytes"]
        if path.stat().st_size != expected:
            raise StoreError(f"{path} is truncated or altered ({path.stat().st_size} bytes, expected {expected})")
        meta = _read_meta(path)
        arena = HostArena.from_file(str(path), info["data_offset"], info["nbytes"], register=register)
        groups = group_lists[name]
        if [p["name"] for p in meta["packs"]] != [g.name for g in groups]:
            raise StoreError(f"{directory}: the groups of {name} differ from the store's; recreate it")
        packs = []
        for p in meta["packs"]:
            layout = PackLayout(
                tuple(_entry(e) for e in p["entries"]),
                p["nbytes"],
                p["out_nbytes"],
                getattr(torch, p["out_dtype"]),
                fmt,
                index["granularity"],
            )
            packs.append(Pack(p["name"], layout, p["offset"], arena.view(p["offset"], p["nbytes"])))
        result[name] = PackedModel(arena, packs, groups, fmt, index["granularity"])
    return result

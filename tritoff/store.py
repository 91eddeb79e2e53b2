"""Saved stores: a model's packs written once, then read (never quantized again) at every start.

A store is a directory: ``tritoff_store.json`` (the index) and one safetensors file per component holding its whole
arena as one uint8 tensor, with the pack tables in the file's metadata. The packs the host budget holds are read
into a new host arena (page-locked on CUDA once read); the others are read from the file as they are needed (the disk
ring). A file is never mapped and registered whole: registering faults in and locks every page, which a store larger
than RAM cannot survive.

The index records the format version, tritoff version, granularity, skip patterns, grouping, per component its
storage format, a fingerprint of its class, config and parameter names/shapes/dtypes (``tritoff/fingerprint.py``,
with the config itself and a hash of the class and parameters alone) and its file's size and XXH3-128 hash, what the
store was made from (:func:`describe_source`), and a hash of the index itself. Format 3 added the per-component
storage (a VAE is kept in its own dtype while the rest is fp8); format 2 stores, with one storage for every component,
are read as they were written. What a store guarantees:

- integrity: every file is hashed as it is written and verified before it is used (:func:`load_store`), so a flipped
  byte or a file of another conversion is refused, naming the file;
- atomicity: a store is written into a temporary directory beside its target and renamed into place, so a directory
  holds one complete store or none (an interrupted write leaves the target as it was);
- source identity: ``tritoff run MODEL --store DIR`` checks MODEL's weight files against the ones the store was made
  from (:func:`check_source`) and refuses other weights, even of the same architecture.

Anything that does not match is refused with a one-line error: a store is never silently or partly used.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from tritoff import __version__
from tritoff.atomic import umask
from tritoff.fingerprint import config_conflict, config_refusal, fingerprint, matches_store, recorded_parts

if TYPE_CHECKING:  # torch and the packer load on use: the command line reads and checks indexes before them
    import torch
    import torch.nn as nn

    from tritoff.groups import Group
    from tritoff.pack import PackEntry, PackLayout
    from tritoff.packer import PackedModel

STORE_VERSION = 4
# formats this tritoff reads: 2 recorded one storage for all components (the top-level "storage"); 4 added a hash per
# pack and per header, so a pack is checked when it is read (a store larger than RAM is never read whole up front)
READABLE_VERSIONS = (2, 3, 4)
INDEX = "tritoff_store.json"
HASH = "xxh3_128"
CHUNK = 64 << 20  # bytes hashed per call: large enough to run at memory speed, small enough for a smooth progress bar
# source identity: each weight file's header, and this many windows of this size spread evenly over the file
SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 64 << 10
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".index.json")
RECREATE = "recreate the store with `tritoff convert`"


class StoreError(ValueError):
    """A store that cannot be used for this model; the message says why."""


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


def torch_dtype(name: str, path) -> torch.dtype:
    """The torch dtype a store file names ``name`` (read from ``path``), refused in one line when this torch has none
    of that name."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"{path} holds tensors of dtype {name}, which this torch ({torch.__version__}) does not have")
    return dtype


def _entry(d: dict, path) -> PackEntry:
    from tritoff.pack import PackEntry

    return PackEntry(
        d["name"],
        tuple(d["shape"]),
        torch_dtype(d["dtype"], path),
        d["kind"],
        d["offset"],
        d["nbytes"],
        d["scale_offset"],
        d["num_scales"],
        d["out_offset"],
    )


# hashing -------------------------------------------------------------------------------------------------------------


def file_hash(path: str | Path, progress=None) -> str:
    """XXH3-128 of the file's bytes (hex), read in chunks into one buffer (never mapped: a file larger than RAM
    costs one chunk); ``progress`` (a tqdm bar) is advanced by the bytes hashed."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buffer):
            hasher.update(view[:got])
            if progress is not None:
                progress.update(got)
    return hasher.hexdigest()


def _index_hash(index: dict) -> str:
    body = {k: v for k, v in index.items() if k != "index_hash"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# (device, inode, size, mtime, ctime) of files verified by this process, with their hash: the command line verifies a
# store before loading the pipeline, and load_store does not hash the same unchanged file again
_verified: dict[tuple, str] = {}


def _identity(path: Path) -> tuple:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _header_hash(path: Path, data_offset: int) -> str:
    with open(path, "rb") as f:
        return xxhash.xxh3_128_hexdigest(f.read(data_offset))


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise StoreError(f"{path} is {'not a file' if path.exists() else 'missing'}; {RECREATE}")


def _verify_file(path: Path, info: dict, progress=None, full: bool = False) -> None:
    """Refuse ``path`` unless its size and hash are the ones the index records. A format-4 file is checked by its
    header's hash unless ``full``: its packs carry their own hashes, checked when each is read."""
    _require_file(path)
    size = path.stat().st_size
    if size != info["size"]:
        raise StoreError(f"{path} is truncated or altered ({size} bytes, the index records {info['size']}); {RECREATE}")
    if "header_hash" in info and not full:
        if _header_hash(path, info["data_offset"]) != info["header_hash"]:
            raise StoreError(
                f"{path} is corrupt or from another conversion (its header's {HASH} differs from the index's); "
                f"{RECREATE}"
            )
        if progress is not None:
            progress.update(size)
        return
    key = _identity(path)
    if _verified.get(key) == info["hash"]:
        if progress is not None:
            progress.update(size)
        return
    digest = file_hash(path, progress)
    if digest != info["hash"]:
        raise StoreError(
            f"{path} is corrupt or from another conversion (its {HASH} differs from the index's); {RECREATE}"
        )
    _verified[key] = digest


def verify_store(directory: str | Path, index: dict | None = None, progress: bool = False, full: bool = False) -> dict:
    """Check every file of the store at ``directory`` against the size and hashes its index records; returns the
    index.

    A format-4 store is checked by its headers (its packs are checked as they are read) unless ``full``, which reads
    and hashes every byte; older formats are always read whole (at memory speed once the files are in the page cache:
    see docs/usage.md for the measured rate)."""
    directory = Path(directory)
    index = read_index(directory) if index is None else index
    infos = list(index["components"].values())
    bar = None
    if progress and (full or any("header_hash" not in i for i in infos)):
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(i["size"] for i in infos), unit="B", unit_scale=True, desc=f"verifying {directory}")
    try:
        for info in infos:
            _verify_file(directory / info["file"], info, bar, full)
    finally:
        if bar is not None:
            bar.close()
    return index


# writing -------------------------------------------------------------------------------------------------------------


def check_target(directory: str | Path, overwrite: bool = False, model: str | Path | None = None) -> Path:
    """Refuse a store target that is a file, a non-empty directory (unless ``overwrite`` and it is a store), or a
    directory inside the local model directory ``model``; returns the target as a path."""
    target = store_path(directory)
    if model is not None and Path(model).is_dir():
        resolved, source = target.resolve(), Path(model).resolve()
        if resolved == source or source in resolved.parents:
            raise StoreError(f"{target} is inside the model directory {model}: write the store somewhere else")
    if target.exists() and not target.is_dir():
        raise StoreError(f"{target} exists and is not a directory: choose a new or empty directory for the store")
    # the store is written beside its target and renamed into place, which neither of these can take
    try:
        here, where = Path.cwd(), Path(os.path.realpath(target))
    except OSError:  # a removed working directory: a relative target is nowhere
        raise StoreError(f"the current directory was removed: give {target} as an absolute path") from None
    if where == here or where in here.parents:
        raise StoreError(
            f"{target} is the current directory or holds it: the store replaces the directory, which would leave "
            "the working directory removed; name a directory to create, such as my-store"
        )
    if target.is_dir() and _is_mount_point(where):
        raise StoreError(
            f"{target} is a mount point, which cannot be renamed (the store is written beside it and renamed into "
            f"place): write the store into a directory inside it ({target}/store)"
        )
    if target.is_dir() and any(target.iterdir()):
        if not (target / INDEX).is_file():
            raise StoreError(f"{target} is not empty and holds no tritoff store: choose a new or empty directory")
        if not overwrite:
            raise StoreError(f"{target} already holds a store: pass --overwrite (overwrite=True) to replace it")
        own = _store_files(target)
        others = sorted(p.name for p in target.iterdir() if p.name != INDEX and p.name not in own)
        if others:
            raise StoreError(
                f"{target} holds files that are not the store's ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}), which replacing the store would delete: move them out first"
            )
    # the store is written beside its target and moved in: the nearest existing parent must take new files
    parent = target.expanduser().absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:  # a real file, not os.access: root passes access checks on read-only mounts and /proc
        with tempfile.TemporaryFile(dir=parent, prefix=f".{target.name}."):
            pass
    except OSError as err:
        # the directory exists: "No such file or directory" would mislead (/proc answers so to a new file)
        reason = "it takes no new files" if err.errno == errno.ENOENT else err.strerror or err
        raise StoreError(
            f"cannot write a store in {parent} ({reason}): choose a directory on a writable disk"
        ) from None
    return target


def _store_files(directory: Path) -> set[str]:
    """The files a store's index lists (its components' files); with an unreadable index, every ``*.safetensors``
    file in it (the index cannot say which are the store's)."""
    try:
        components = json.loads((directory / INDEX).read_text())["components"]
        return {info["file"] for info in components.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {p.name for p in directory.glob("*.safetensors") if p.is_file() and not p.is_symlink()}


def _is_mount_point(path: Path) -> bool:
    """Whether ``path`` (resolved) is a mount point, bind mounts of a directory of the same disk included (which
    ``os.path.ismount`` does not see)."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            fields = [line.split() for line in f]
        # field 5 is the mount point: its bytes, with space, tab, newline and backslash written as octal escapes
        points = {_OCTAL.sub(lambda m: bytes([int(m[1], 8)]), field[4]) for field in fields if len(field) > 4}
    except OSError:
        return False
    return os.fsencode(path) in points


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _replace_dir(tmp: Path, target: Path) -> None:
    """Move the directory ``tmp`` to ``target``, replacing an empty directory or an existing store."""
    try:
        os.replace(tmp, target)  # a new target, or an empty directory
        return
    except OSError:
        if not target.is_dir():
            raise
    # an existing store: move it aside, move the new one in, then delete the old one (never a mix of the two)
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
    try:
        os.replace(target, old)
    except BaseException:
        old.rmdir()
        raise
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    try:
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:  # Ctrl-C with the new store in place: the old one goes whole, never half deleted
        shutil.rmtree(old, ignore_errors=True)
        raise


def _write_hashed(path: Path, chunks) -> tuple[int, str]:
    """Write the byte chunks to the new file ``path``; returns its size and XXH3-128."""
    hasher, size = xxhash.xxh3_128(), 0
    with open(path, "xb") as f:
        for chunk in chunks:
            f.write(chunk)
            hasher.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it visible, so a power loss cannot publish a torn file
    return size, hasher.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _span_hash(data, page: int) -> str:
    """XXH3-128 of ``data`` (a pack's bytes) followed by the zeros that pad it to a whole page."""
    hasher = xxhash.xxh3_128(memoryview(data.numpy()))
    hasher.update(bytes(-len(data) % page))
    return hasher.hexdigest()


def _data_pieces(model: PackedModel, nbytes: int):
    """The bytes of a component's packs laid out as in its store file (zeros between packs), wherever each pack
    lives: its arena or its file."""
    from tritoff.packer import pack_bytes

    at = 0
    for pack in sorted(model.packs, key=lambda p: p.offset):
        if pack.offset > at:
            yield bytes(pack.offset - at)
        view = memoryview(pack_bytes(pack).numpy())
        for start in range(0, len(view), CHUNK):
            yield view[start : start + CHUNK]
        at = pack.offset + len(view)
    if nbytes > at:
        yield bytes(nbytes - at)


def _head(packs: list[tuple[str, int, PackLayout]], nbytes: int, hashes: list[str]) -> bytes:
    """A component file's header: its length (8 bytes) and safetensors JSON (the arena as one uint8 tensor, the pack
    tables in the metadata), padded with spaces so the data starts on a page boundary (safetensors allows them)."""
    from tritoff.arena import PAGE

    meta = {
        "packs": [
            {
                "name": name,
                "offset": offset,
                "nbytes": layout.nbytes,
                "out_nbytes": layout.out_nbytes,
                "out_dtype": str(layout.out_dtype).split(".")[-1],
                "hash": digest,
                "entries": [_entry_dict(e) for e in layout.entries],
            }
            for (name, offset, layout), digest in zip(packs, hashes, strict=True)
        ]
    }
    header = {
        "arena": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]},
        "__metadata__": {"tritoff": json.dumps(meta)},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % PAGE)
    return struct.pack("<Q", len(raw)) + raw


def reserve_store_files(partial: Path, layouts: dict[str, list[tuple[str, PackLayout]]]) -> dict:
    """The component files of the store being written in ``partial`` (``tritoff.partial``), one per component of
    ``layouts`` ({component: [(group name, layout)]}), laid out with room for their headers: packs written into them
    (``pack_model``'s ``spill``) are where they stay, and :func:`save_store` (``files=``) only writes the headers.
    Converting then needs the packs' size on disk once, not twice (spill files, then the store)."""
    from tritoff.disk import PackFile
    from tritoff.packer import pack_offsets

    files: dict[str, PackFile] = {}
    for name, packs in layouts.items():
        offsets, nbytes = pack_offsets([layout for _, layout in packs])
        # an XXH3-128 digest is 32 hex digits: the header reserved here has the length of the final one
        head = _head([(n, o, lay) for (n, lay), o in zip(packs, offsets, strict=True)], nbytes, ["0" * 32] * len(packs))
        path = partial / f"{name}.safetensors"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        files[name] = PackFile(
            fd, len(head), str(path), verify=False, no_space="while converting: write the store on a larger disk"
        )
        os.ftruncate(fd, len(head) + nbytes)  # sparse: the zeros between packs cost no disk
    return files


def _finish_in_place(file, head: bytes, nbytes: int) -> str:
    """Write ``head`` into ``file`` (from :func:`reserve_store_files`), make it durable and return the whole file's
    XXH3-128."""
    file.write_at(0, head)
    os.fsync(file.fd)  # on disk before the rename makes it visible, so a power loss cannot publish a torn file
    if os.fstat(file.fd).st_size != len(head) + nbytes:
        raise OSError(f"{file.path} ended early while hashing it; the file was truncated")
    return file_hash(file.path)


def save_store(
    directory: str | Path,
    fingerprints: dict[str, str],
    packed: dict[str, PackedModel],
    skip: tuple[str, ...],
    grouping: str,
    *,
    source: dict | None = None,
    overwrite: bool = False,
    partial: Path | None = None,
    files: dict | None = None,
) -> Path:
    """Write every component's packs as a store at ``directory``, atomically: into a temporary directory beside it,
    then renamed into place. ``directory`` must be new or empty, or an existing store with ``overwrite``.

    ``fingerprints`` are the components' :func:`fingerprint` taken before packing; ``source`` is what the packs were
    made from (:func:`describe_source`), checked by :func:`check_source`. ``partial``: the directory from
    :func:`tritoff.partial.partial_store` to write into (default: a new one), with ``files``, the component files
    :func:`reserve_store_files` made there when the packs were written into them: those get their headers, not a copy.
    """
    from tritoff.arena import PAGE
    from tritoff.packer import pack_bytes
    from tritoff.partial import finished, partial_store, real_target

    tmp = partial if partial is not None else partial_store(directory, overwrite)
    target = real_target(store_path(directory))
    first = next(iter(packed.values()))
    from tritoff.storage import common_fp8

    index = {
        "store_version": STORE_VERSION,
        "tritoff": __version__,
        # each component records its own; this is their shared fp8 format (what format 2 recorded)
        "storage": common_fp8({name: m.storage.name for name, m in packed.items()}),
        "granularity": first.granularity,
        "skip": list(skip),
        "grouping": grouping,
        "hash": HASH,
        "source": source,
        "components": {},
    }
    try:
        for name, model in packed.items():
            # each pack's hash goes into the header, so a pack read alone (served from disk) is checked alone; it
            # covers the pack's page-aligned span, so with the header's hash every byte of the file is covered
            hashes = [_span_hash(pack_bytes(p), PAGE) for p in model.packs]
            nbytes = model.layout_bytes
            head = _head([(p.name, p.offset, p.layout) for p in model.packs], nbytes, hashes)
            file = f"{name}.safetensors"
            own = (files or {}).get(name)
            if own is not None and own.data_offset == len(head) and all(p.file is own for p in model.packs):
                size, digest = len(head) + nbytes, _finish_in_place(own, head, nbytes)
            else:  # packs held in RAM or in spill files: written into a new file
                if own is not None:
                    os.unlink(tmp / file)  # a reserved file its packs did not go to
                size, digest = _write_hashed(tmp / file, [head, *_data_pieces(model, nbytes)])
            index["components"][name] = {
                "file": file,
                "storage": model.storage.name,
                "fingerprint": fingerprints[name],
                # what matches_store compares where the fingerprints differ (another library version's config)
                **recorded_parts(fingerprints[name]),
                "nbytes": nbytes,
                "data_offset": len(head),
                "size": size,
                "hash": digest,
                "header_hash": xxhash.xxh3_128_hexdigest(head),
            }
        index["index_hash"] = _index_hash(index)
        _write_hashed(tmp / INDEX, [json.dumps(index, indent=1).encode()])
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; a store follows the umask like any directory
        _fsync_dir(tmp)
        check_target(target, overwrite)  # again: something may have appeared there while the packs were written
        finished(tmp)
        _replace_dir(tmp, target)
        _fsync_dir(target.parent)
        for file in (files or {}).values():  # the packs' file is the store's now: errors name it there
            file.path = str(target / Path(file.path).name)
    finally:
        if partial is None:  # a caller's partial directory is the caller's to remove
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            finished(tmp)
    return target


# reading -------------------------------------------------------------------------------------------------------------

_INDEX_FIELDS = {
    "tritoff": str,
    "storage": str,
    "granularity": str,
    "skip": list,
    "grouping": str,
    "hash": str,
    "components": dict,
    "index_hash": str,
}
_COMPONENT_FIELDS = {"file": str, "fingerprint": str, "nbytes": int, "data_offset": int, "size": int, "hash": str}


def _check_structure(index, path: Path) -> None:
    def bad(what: str):
        return StoreError(f"{path} is not a valid tritoff store index ({what}); {RECREATE}")

    for key, kind in _INDEX_FIELDS.items():
        if key not in index:
            raise bad(f"no {key!r}")
        if not isinstance(index[key], kind):
            raise bad(f"{key!r} is not a {kind.__name__}")
    if index["hash"] != HASH:
        raise bad(f"files hashed with {index['hash']!r}, this tritoff checks {HASH}")
    if not index["components"]:
        raise bad("no components")
    for name, info in index["components"].items():
        if not isinstance(info, dict):
            raise bad(f"component {name!r} is not an object")
        for key, kind in _COMPONENT_FIELDS.items():
            if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
                raise bad(f"component {name!r} has no {kind.__name__} {key!r}")
        if Path(info["file"]).name != info["file"] or info["file"] in ("", ".", ".."):
            raise bad(f"component {name!r} names a file outside the store")
        if info["data_offset"] < 8 or info["data_offset"] + info["nbytes"] != info["size"]:
            raise bad(f"component {name!r} has inconsistent sizes")
        if index.get("store_version", STORE_VERSION) >= 3 and not isinstance(info.get("storage"), str):
            raise bad(f"component {name!r} has no str 'storage'")
    if not isinstance(index.get("source"), (dict, type(None))):
        raise bad("'source' is not an object")


def store_path(directory) -> Path:
    """``directory`` as a Path, or a one-line ValueError for a value that is no path at all."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"a store is a directory, given as a str or pathlib.Path, got {directory!r}")
    return Path(directory)


def read_index(directory: str | Path) -> dict:
    """The store's index, checked for its format version, its structure and its own hash."""
    where = store_path(directory)  # (the messages name the directory as given)
    path = where / INDEX
    if path.exists() and not path.is_file():
        raise StoreError(f"{path} is not a file; {RECREATE}")
    if not where.exists():
        raise StoreError(f"{directory} does not exist; create a store there with `tritoff convert`, or check the path")
    if not path.is_file():
        raise StoreError(f"{directory} is not a tritoff store (no {INDEX}); create one with `tritoff convert`")
    try:
        index = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StoreError(f"{path} is corrupt ({err}); {RECREATE}") from None
    if not isinstance(index, dict):
        raise StoreError(f"{path} is not a valid tritoff store index (not an object); {RECREATE}")
    version = index.get("store_version")
    if type(version) is not int or version not in READABLE_VERSIONS:  # "4", 4.0 and True are no format numbers
        readable = ", ".join(map(str, READABLE_VERSIONS[:-1])) + f" and {READABLE_VERSIONS[-1]}"
        raise StoreError(
            f"{directory} has store format {version!r}, this tritoff reads formats {readable}; "
            "recreate it with `tritoff convert`"
        )
    _check_structure(index, path)
    if _index_hash(index) != index["index_hash"]:
        raise StoreError(f"{path} was altered after it was written (its hash differs); {RECREATE}")
    return index


def component_storages(index: dict) -> dict[str, str]:
    """Each component's storage format in the store whose ``index`` is given (format 2: the one storage of all)."""
    return {name: info.get("storage", index["storage"]) for name, info in index["components"].items()}


# the fields of a store file's pack table and their types, checked when the header is read: the CLI reads headers
# (dtypes, for building models without weights) before hashing the files
PACK_FIELDS = {"name": str, "entries": list, "nbytes": int, "out_nbytes": int, "offset": int, "out_dtype": str}
ENTRY_FIELDS = {
    "name": str,
    "shape": list,
    "dtype": str,
    "kind": int,
    **dict.fromkeys(("offset", "nbytes", "scale_offset", "num_scales", "out_offset"), int),
}
DTYPE_NAME = re.compile(r"(bool|u?int\d+|b?float\d+(_[a-z0-9]+)*|complex\d+)")  # torch's names, e.g. float8_e4m3fn


def _read_meta(path: Path) -> dict:
    _require_file(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"a header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
        meta = json.loads(header["__metadata__"]["tritoff"])
        _check_meta(meta)
        return meta
    except (struct.error, ValueError, KeyError, TypeError, RecursionError) as err:
        raise StoreError(f"{path} has an unreadable header ({_first_line(err)}); {RECREATE}") from None


def _check_meta(meta) -> None:
    """Raise ValueError unless ``meta`` has the pack table's fields, of their types."""

    def fields(record, kinds: dict, what: str) -> None:
        if not isinstance(record, dict):
            raise ValueError(f"{what} is not a record")
        wrong = next((k for k, kind in kinds.items() if not isinstance(record.get(k), kind)), None)
        if wrong is not None:
            raise ValueError(f"{what} has no valid {wrong!r}")

    packs = meta.get("packs") if isinstance(meta, dict) else None
    if not isinstance(packs, list):
        raise ValueError("no pack table")
    for pack in packs:
        fields(pack, PACK_FIELDS, "a pack")
        for entry in pack["entries"]:
            fields(entry, ENTRY_FIELDS, f"an entry of pack {pack['name']}")
            if not DTYPE_NAME.fullmatch(entry["dtype"]) or not all(isinstance(n, int) for n in entry["shape"]):
                raise ValueError(f"{pack['name']}.{entry['name']} has no valid dtype or shape")
        if not DTYPE_NAME.fullmatch(pack["out_dtype"]):
            raise ValueError(f"pack {pack['name']} has no valid out dtype")


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


def stored_compute_dtype(directory: str | Path) -> str | None:
    """The 16-bit dtype the store's pipeline was converted in (``"bfloat16"``, ``"float16"``), ``"float32"`` when it
    holds no 16-bit parameter, or None when components disagree; read from the file headers, without torch."""
    found = set().union(*_sixteen_bit_dtypes(directory).values())
    return "float32" if not found else found.pop() if len(found) == 1 else None


def component_dtypes(directory: str | Path) -> dict[str, str]:
    """Each component's dtype as the store holds it: its one 16-bit dtype, ``"float32"`` where it holds no 16-bit
    parameter (a VAE kept in float32 beside a bf16 pipeline, as Wan's examples load it); a component holding both
    16-bit dtypes is left out."""
    found = _sixteen_bit_dtypes(directory)
    return {name: next(iter(kinds), "float32") for name, kinds in found.items() if len(kinds) <= 1}


def _sixteen_bit_dtypes(directory: str | Path) -> dict[str, set[str]]:
    """Per component, the 16-bit dtypes among its stored parameters' (from the file headers)."""
    found = {}
    for name, info in read_index(directory)["components"].items():
        found[name] = {e["dtype"] for e in _stored_entries(directory, info)} & {"bfloat16", "float16"}
    return found


def _stored_entries(directory: str | Path, info: dict) -> list[dict]:
    """Every pack entry (a parameter's name, shape, dtype, place) of the component whose index record is ``info``,
    read from its file's header."""
    return [e for p in _read_meta(Path(directory) / info["file"])["packs"] for e in p["entries"]]


def stored_dtypes(directory: str | Path, component: str) -> dict[str, torch.dtype]:
    """Each stored parameter's dtype (as the model computes with it), for building a model without weights."""
    info = read_index(directory)["components"][component]
    return {e["name"]: torch_dtype(e["dtype"], info["file"]) for e in _stored_entries(directory, info)}


def _mismatch(directory: Path, component: str, module: nn.Module) -> str:
    """Why ``module`` does not match the fingerprint its store records, as far as the pack headers tell (each
    parameter's name, shape and dtype) and, where the store recorded it, its config (the keys both hold with other
    values), and what to do."""
    from tritoff.adapters import named_parameters

    info = read_index(directory)["components"][component]
    stored = {
        e["name"]: (tuple(e["shape"]), torch_dtype(e["dtype"], info["file"])) for e in _stored_entries(directory, info)
    }
    here = {n: (tuple(p.shape), p.dtype) for n, p in named_parameters(module)}
    if set(stored) != set(here) or any(stored[n][0] != here[n][0] for n in stored):
        return (
            "does not match the store (other parameter names or shapes: another model, or another config); "
            "recreate it with `tritoff convert`"
        )
    differ = [n for n in stored if here[n][1] != stored[n][1]]
    made = fingerprint(module)
    if not differ and info.get("class") not in (None, made.class_name):
        return (
            f"is a {made.class_name} where the store holds a {info['class']} of the same parameters: enable the "
            "model the store was made from, or convert this one into a new store"
        )
    keys = config_conflict(info, made)
    if not differ and keys:
        return (
            f"has the store's parameters under another config ({config_refusal(keys)}): load the model the store "
            "was made from, or convert this one into a new store"
        )
    if not differ:
        return (
            "has the store's parameters but not the config it was made from (a transformers model saved and loaded "
            "again records its dtype and architectures in its config; another library version may add keys): load "
            "it as the store's pipeline was loaded, or save a store from this pipeline (Engine.save, tritoff convert)"
        )

    def dtypes(side, names) -> str:
        return " and ".join(sorted({str(side[n][1]).removeprefix("torch.") for n in names}))

    if len({stored[n][1] for n in stored}) == 1 and len(differ) == len(stored):
        return (
            f"holds {dtypes(here, differ)} weights where the store holds {dtypes(stored, differ)}: load it in "
            f"{dtypes(stored, differ)} (tritoff.load_pipeline(model, store) loads each component as its store holds it)"
        )
    return (
        f"holds {len(differ)} of its {len(stored)} weights in {dtypes(here, differ)} where the store holds "
        f"{dtypes(stored, differ)} ({differ[0]} first): load it as the store's pipeline was loaded "
        "(from_pretrained(torch_dtype=...) keeps some modules in float32; a cast with .to() after loading does not)"
    )


# rows of every weight compared with the store's besides the one group compared whole: the first, middle and last
SAMPLED_ROWS = 3


def check_weights(directory: str | Path, components: dict[str, nn.Module], packed: dict[str, PackedModel]) -> None:
    """Refuse a store made from other weights than ``components`` hold (same architecture, another checkpoint, or the
    same with a LoRA fused into some layers): per component, the smallest group holding a quantized weight (else any
    weight) is packed again from the model's own weights and its values compared, bit for bit, with the stored
    pack's; then ``SAMPLED_ROWS`` rows of every weight of every group are (a few reads of each pack on disk). Values,
    not bytes: weights a disable gave back (dequantized from these packs) can pack into other bytes for the same
    values, with a row's scale halved and its codes doubled. Components without weights (built on the meta device,
    or left on placeholders by an engine) are not checked."""
    import torch

    from tritoff.kernels.upcast import KIND_FP8
    from tritoff.onload import is_placeholder
    from tritoff.pack import dequantize_bytes, write_pack
    from tritoff.packer import _quantizer, pack_bytes

    def refuse(name: str, where: str) -> StoreError:
        return StoreError(
            f"{directory} was made from other weights than this pipeline's {name} ({name}.{where} differs): "
            "load the weights the store was converted from, or convert this pipeline into a new store"
        )

    for name in components:
        model = packed[name]
        held = [
            (i, pack, group)
            for i, (pack, group) in enumerate(zip(model.packs, model.groups, strict=True))
            if group.params and not any(p.is_meta or is_placeholder(p) for _, p in group.params)
        ]
        if not held:
            continue
        chosen = min(
            (not any(e.kind == KIND_FP8 for e in pack.layout.entries), pack.layout.nbytes, i) for i, pack, _ in held
        )[2]
        pack, group = model.packs[chosen], model.groups[chosen]
        data = torch.zeros(pack.layout.nbytes, dtype=torch.uint8)
        with torch.no_grad():
            write_pack(
                pack.layout, data, {n: p.detach().cpu() for n, p in group.params}, _quantizer(torch.device("cpu"))
            )
        stored = pack_bytes(pack)
        same = torch.equal(data, stored) or torch.equal(
            dequantize_bytes(pack.layout, data), dequantize_bytes(pack.layout, stored)
        )
        if not same:
            raise refuse(name, group.name)
        for _, pack, group in held:
            differs = _sampled_rows_differ(pack, dict(group.params), model.granularity)
            if differs is not None:
                raise refuse(name, differs)


def _sampled_rows_differ(pack, params: dict, granularity: str) -> str | None:
    """The name of the first weight in ``pack`` whose sampled rows (``params``: the model's, by name) differ in value
    from the stored ones, or None: each row quantized as :func:`~tritoff.pack.write_entry` quantizes it (with tensor
    granularity, with the scale of the whole weight's largest magnitude)."""
    import torch

    from tritoff.kernels.quantize import _as_rows, _scale_from_exponent, pow2_exponents, quantize_reference
    from tritoff.kernels.upcast import KIND_FP8
    from tritoff.pack import within_range

    layout = pack.layout
    fmt = layout.storage
    for e in layout.entries:
        if e.numel == 0:  # no values to differ
            continue
        t = params[e.name].detach()
        rows = t.shape[0] if t.dim() else 1
        width = e.numel // max(rows, 1)
        picked = sorted({0, rows // 2, rows - 1})[:SAMPLED_ROWS] if rows else []
        with torch.no_grad():
            if e.kind == KIND_FP8:
                whole = e.num_scales != rows  # one scale for every row (tensor granularity, or none: 1)
                sample = t[picked].cpu()
                if whole and granularity == "tensor":  # the rows quantized with the whole weight's scale
                    exponent = pow2_exponents(t.abs().amax().float().reshape(1).cpu(), fmt)
                    scales = _scale_from_exponent(exponent)
                    scaled = (_as_rows(sample).float() * _scale_from_exponent(-exponent)).clamp(-fmt.max, fmt.max)
                    codes = scaled.to(fmt.dtype).view(torch.uint8).reshape(sample.shape)
                else:
                    codes, scales = quantize_reference(sample, fmt, granularity)
                codes = within_range(codes, scales, fmt, e.dtype)
                mine = codes.reshape(len(picked), width).view(fmt.dtype).float() * scales.reshape(-1, 1)
                stored_codes = torch.stack([_stored(pack, e.offset + r * width, width) for r in picked])
                at = [0] if whole else picked
                stored_scales = torch.cat([_stored(pack, e.scale_offset + 4 * i, 4).view(torch.float32) for i in at])
                theirs = stored_codes.view(fmt.dtype).float() * stored_scales.reshape(-1, 1)
            else:
                size = width * e.dtype.itemsize
                mine = t.reshape(rows, width)[picked].to(e.dtype).cpu().contiguous().view(torch.uint8).reshape(-1)
                theirs = torch.cat([_stored(pack, e.offset + r * size, size) for r in picked])
        if not torch.equal(mine, theirs):
            return e.name
    return None


def _stored(pack, start: int, nbytes: int):
    """``nbytes`` of ``pack`` from ``start``: from the arena, or read from its file (those bytes alone)."""
    import torch

    if not pack.on_disk:
        return pack.data[start : start + nbytes]
    file = pack.file
    read = os.pread(file.fd, nbytes, file.data_offset + pack.offset + start)
    return torch.frombuffer(bytearray(read), dtype=torch.uint8)


def check_packs(
    directory: str | Path, held: dict[str, PackedModel], packed: dict[str, PackedModel], progress: bool = False
) -> None:
    """Refuse a store made from other weights than an enabled pipeline holds (its weights are placeholders, so
    :func:`check_weights` has nothing to pack), comparing every weight of the enabled engine's packs ``held`` with the
    store's ``packed``, packs on disk read: a pack's bytes first, where both group it alike, and its values where the
    bytes differ (the same values can pack into other bytes: weights a ``disable`` gave back and ``enable`` packed
    again), one tensor at a time. ``progress``: a bar over the store's bytes, shown once the check has taken a second
    (comparing values runs at ~185 MB/s on a 2-core machine: over a minute for a 14B model's packs)."""
    from tqdm.auto import tqdm

    from tritoff.packer import pack_bytes

    read: dict[str, torch.Tensor] = {}  # the enabled engine's pack read last: the store's next packs mostly need it

    def bytes_of(pack) -> torch.Tensor:
        if pack.name not in read:
            read.clear()
            read[pack.name] = pack_bytes(pack)
        return read[pack.name]

    total = sum(p.layout.nbytes for model in packed.values() for p in model.packs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="checking the store", delay=1.0, disable=not progress)
    with bar:  # closed even when the check refuses: what is printed next starts a line
        for name, model in packed.items():
            read.clear()  # pack names repeat across components
            _check_component(directory, name, held[name], model, bytes_of, bar)


def _check_component(directory, name: str, held: PackedModel, model: PackedModel, bytes_of, bar) -> None:
    """:func:`check_packs` for one component: ``bytes_of(pack)`` reads one of the engine's packs ``held``."""
    import torch

    from tritoff.pack import read_entry
    from tritoff.packer import pack_bytes

    theirs = {p.name: p for p in held.packs}
    where = {e.name: (p, e) for p in held.packs for e in p.layout.entries}
    for pack in model.packs:
        bar.update(pack.layout.nbytes)
        data = pack_bytes(pack)
        alike = theirs.get(pack.name)
        if alike is not None and alike.layout == pack.layout and torch.equal(data, bytes_of(alike)):
            continue
        by_pack: dict[str, tuple] = {}  # the engine's packs this one's weights are in: each read once for it
        for entry in pack.layout.entries:
            other, other_entry = where.get(entry.name, (None, None))
            if other is not None and other_entry.shape == entry.shape:
                by_pack.setdefault(other.name, (other, []))[1].append((entry, other_entry))
        for other, pairs in by_pack.values():
            held_bytes = bytes_of(other)
            for entry, other_entry in pairs:
                mine = read_entry(other.layout, held_bytes, other_entry).view(-1).view(torch.uint8)
                if not torch.equal(mine, read_entry(pack.layout, data, entry).view(-1).view(torch.uint8)):
                    raise StoreError(
                        f"{directory} was made from other weights than this pipeline's {name} "
                        f"({name}.{entry.name} differs): load the weights the store was converted from, or convert "
                        "this pipeline into a new store"
                    )


def load_store(
    directory: str | Path,
    components: dict[str, nn.Module],
    group_lists: dict[str, list[Group]],
    fingerprints: dict[str, str],
    verify: bool = True,
) -> dict[str, PackedModel]:
    """Open every component's packs in ``directory``, after checking it matches ``components`` (their
    ``fingerprints``) and, with ``verify``, that every file has the size and hashes the index records (pass
    ``verify=False`` only when the files are verified elsewhere: a corrupt store then gives wrong outputs).

    Only headers are read: every pack starts on disk (:attr:`Pack.on_disk`), and :func:`tritoff.packer.hold_packs`
    reads those the host budget holds. A format-4 pack is checked against its own hash when first read.
    ``group_lists`` (each component's groups for the mode asked for) takes the groups a block store holds where they
    differ for a model without block lists (see :func:`groups_for`)."""
    from tritoff.arena import HostArena
    from tritoff.disk import PackFile
    from tritoff.formats import get_format
    from tritoff.pack import PackLayout
    from tritoff.packer import Pack, PackedModel

    directory = Path(directory)
    index = read_index(directory)
    stored = set(index["components"])
    if not set(components) <= stored:  # a pipeline loaded without some of its components uses the rest
        if list(components) == ["model"]:  # a module on its own: say which of the store's components it is
            same = [n for n in sorted(stored) if matches_store(index["components"][n], fingerprints["model"])]
            if same:
                raise StoreError(
                    f"{directory} holds this module as the pipeline's {' or '.join(same)}: a store is read per "
                    "pipeline component, so enable the pipeline that holds it (components it lacks are left out)"
                )
        raise StoreError(
            f"{directory} holds components {sorted(stored)} but the model has {sorted(components)}: enable the "
            "pipeline (or component) the store was converted from, or convert this one into a new store"
        )
    # only the components enabled: a pipeline loaded without one (text_encoder=None) needs nothing of its file
    index = {**index, "components": {n: info for n, info in index["components"].items() if n in components}}
    storages = component_storages(index)
    for name in components:
        if not matches_store(index["components"][name], fingerprints[name]):
            raise StoreError(f"{directory}: component {name} {_mismatch(directory, name, components[name])}")
    if verify:
        verify_store(directory, index)
    result = {}
    for name in components:
        info = index["components"][name]
        path = directory / info["file"]
        if not path.is_file():
            raise StoreError(f"{path} is missing; {RECREATE}")
        if path.stat().st_size != info["size"]:
            raise StoreError(f"{path} is truncated or altered ({path.stat().st_size} bytes, expected {info['size']})")
        meta = _read_meta(path)
        hashed = _verified.get(_identity(path)) == info["hash"]  # hashed whole by this process, unchanged since
        file = PackFile.open(path, info["data_offset"], verify=verify and not hashed)
        groups = group_lists[name]
        names = [p["name"] for p in meta["packs"]]
        if names != [g.name for g in groups] and index["grouping"] == "block":
            # a model without block lists: a block store holds its layers (convert and mode group stream them) or
            # its whole rest (saved from mode auto or model); either serves every mode but leaf
            from tritoff.groups import block_groups
            from tritoff.sizing import groups_for

            for other in (groups_for(components[name], "group"), block_groups(components[name])):
                if names == [g.name for g in other]:
                    groups = group_lists[name] = other
                    break
        if names != [g.name for g in groups]:
            raise StoreError(f"{directory}: the groups of {name} differ from the store's; recreate it")
        packs = []
        for p in meta["packs"]:
            layout = PackLayout(
                tuple(_entry(e, path) for e in p["entries"]),
                p["nbytes"],
                p["out_nbytes"],
                torch_dtype(p["out_dtype"], path),
                get_format(storages[name]),
                index["granularity"],
            )
            packs.append(Pack(p["name"], layout, p["offset"], None, file, p.get("hash")))
        arena = HostArena(0, register=False)  # hold_packs gives it the packs the host budget holds
        result[name] = PackedModel(arena, packs, groups, get_format(storages[name]), index["granularity"])
    return result


# source identity -----------------------------------------------------------------------------------------------------


def _source_record(path: Path) -> dict:
    """Size, XXH3-128 of the header (a safetensors file's whole JSON header, else the first window) and XXH3-128 of
    ``SAMPLE_WINDOWS`` windows of ``SAMPLE_BYTES`` spread evenly from the first byte to the last (the whole file when
    it is smaller than that): a few reads per file, whatever its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = min(size, SAMPLE_BYTES)
        if path.name.endswith(".safetensors") and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n <= size:
                header_len = 8 + n
        f.seek(0)
        header = xxhash.xxh3_128_hexdigest(f.read(header_len))
        sample = xxhash.xxh3_128()
        if size <= SAMPLE_WINDOWS * SAMPLE_BYTES:
            sample.update(f.read())
        else:
            for i in range(SAMPLE_WINDOWS):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1))
                sample.update(f.read(SAMPLE_BYTES))
    return {"size": size, "header": header, "sample": sample.hexdigest()}


def _left_out(model_dir: Path, components) -> set[str]:
    """Of ``components``, those the pipeline saved in ``model_dir`` leaves out: its model_index.json names no class
    for them (``[null, null]``, or no entry) and it has no directory of theirs; none where model_index.json cannot be
    read (the load says why)."""
    try:
        entries = json.loads((model_dir / "model_index.json").read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(entries, dict):
        return set()
    return {
        name
        for name in components
        if not (isinstance(entries.get(name), list) and any(entries[name])) and not (model_dir / name).exists()
    }


def _weight_files(model_dir: Path, components) -> list[str]:
    files = []
    for name in components:
        sub = model_dir / name
        if sub.is_dir():
            files += [
                p.relative_to(model_dir).as_posix()
                for p in sub.rglob("*")
                if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith(".")
            ]
    return sorted(files)


def check_components(directory: str | Path, model_dir: str | Path, index: dict, listed) -> None:
    """Refuse the store at ``directory`` (``index``: its index) when the pipeline directory ``model_dir`` has weights
    for a component the store lacks (Wan 2.2's ``transformer_2`` beside a store of Wan 2.1), from its files alone
    (``listed``: the components its model_index.json names): what enable would refuse once the pipeline is loaded."""
    model_dir = Path(model_dir)
    present = {rel.split("/")[0] for rel in _weight_files(model_dir, listed)}
    stored = set(index["components"])
    if not present <= stored:
        raise StoreError(
            f"{directory} holds components {sorted(stored)} but {model_dir} has {sorted(present)}: run the pipeline "
            "the store was converted from, or convert this one into a new store"
        )


def describe_source(model_dir: str | Path, components) -> dict:
    """What a store made from the pipeline directory ``model_dir`` is made from: each weight file of ``components``
    (``NAME/*.safetensors``, ``.bin``, shard indexes...) with its size, header hash and sampled content hash."""
    model_dir = Path(model_dir)
    return {"files": {rel: _source_record(model_dir / rel) for rel in _weight_files(model_dir, components)}}


def records_source(index: dict) -> bool:
    """Whether the store of ``index`` records the weight files it was made from (``convert`` does; ``Engine.save``,
    which knows no files, does not)."""
    source = index.get("source")
    return isinstance(source, dict) and isinstance(source.get("files"), dict)


def check_source(directory: str | Path, model_dir: str | Path, index: dict | None = None) -> None:
    """Refuse the store at ``directory`` if the pipeline directory ``model_dir`` holds other weight files than the
    ones it was made from (compared by size, header and sampled content: a few reads per file), those of components
    the pipeline leaves out aside (the store's others serve it). A store written by ``Engine.save`` records no source
    and is not checked."""
    index = read_index(directory) if index is None else index
    if not records_source(index):
        return
    source = index["source"]
    model_dir = Path(model_dir)
    left_out = _left_out(model_dir, index["components"])  # a pipeline without some of them uses the store's others
    recorded = {rel: r for rel, r in source["files"].items() if rel.split("/")[0] not in left_out}
    present = _weight_files(model_dir, set(index["components"]) - left_out)
    advice = f"run with the model it was made from, or convert {model_dir} into a new store"
    for rel in sorted(set(recorded) | set(present)):
        if rel not in present:
            raise StoreError(f"{directory} was made from {rel}, which {model_dir} lacks; {advice}")
        if rel not in recorded:
            raise StoreError(f"{directory} was not made from {model_dir / rel} (a file it does not know); {advice}")
        now, then = _source_record(model_dir / rel), recorded[rel]
        for key, what in (("size", "size"), ("header", "header"), ("sample", "content")):
            if now[key] != then.get(key):
                raise StoreError(
                    f"{directory} was made from other weights: {model_dir / rel} differs in {what}; {advice}"
                )

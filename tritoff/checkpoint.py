"""A component's safetensors checkpoint, read as ``from_pretrained`` reads it, and checked against the model its
config builds.

diffusers and transformers name no file when a config does not describe the weights beside it: a size mismatch ends
in a report of every mismatched tensor (transformers) or a message naming one tensor (diffusers), and tensors the
model has but the checkpoint lacks are left on the meta device (diffusers, which tritoff then refuses to pack).
:func:`checkpoint_fault` names the config instead, in one line; :func:`unused_tensors` lists what the model leaves out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn


class ConfigError(ValueError):
    """A config.json whose values build no model, or a model that does not match the weights beside it."""


# the name of the weights file each library reads (a sharded checkpoint: NAME.safetensors.index.json names its shards)
WEIGHTS_NAMES = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}


class CheckpointReader:
    """Tensors of a component's safetensors checkpoint (one file or shards with an index), read lazily by name.
    ``library`` (``"diffusers"`` or ``"transformers"``): the files are those its ``from_pretrained`` reads without a
    variant (the index of its file name, else that file), and none is refused in one line; None: the one
    checkpoint there, variants' files (``model.fp16.safetensors``) aside."""

    def __init__(self, directory: Path, library: str | None = None):
        self.names: dict[str, str] = {}  # a model's name -> the checkpoint's, where they differ (rename_for)
        self._headers: dict | None = None
        if library is not None:
            stem = WEIGHTS_NAMES[library]
            index, file = directory / f"{stem}.safetensors.index.json", directory / f"{stem}.safetensors"
            if not (index.is_file() or file.is_file()):
                found = ", ".join(sorted(f.name for f in directory.glob("*.safetensors*"))) or "none"
                raise FileNotFoundError(
                    f"{directory}: no {file.name} or {index.name}, which {library} reads (found: {found})"
                )
            indexes, files = ([index], []) if index.is_file() else ([], [file])
        else:
            indexes = _plain(sorted(directory.glob("*.safetensors.index.json")), ".index.json")
            files = _plain(sorted(directory.glob("*.safetensors")), "")
        self.sharded = bool(indexes)
        if indexes:
            self.files = _weight_map(indexes[0], directory)
            return
        if len(files) != 1:
            names = ", ".join(f.name for f in files) or "none"
            raise FileNotFoundError(
                f"{directory}: expected one safetensors file or an index naming its shards, found {len(files)} "
                f"({names})"
            )
        with open_safetensors(files[0]) as f:
            self.files = dict.fromkeys(f.keys(), files[0])

    def rename_for(self, model: nn.Module) -> None:
        """Read ``model``'s tensors under the names diffusers' ``from_pretrained`` gives them: the attention layers of
        VAEs saved before diffusers renamed them (``query`` -> ``to_q``, ``proj_attn`` -> ``to_out.0``), in a
        checkpoint of one file, as diffusers renames them."""
        if self.sharded:
            return
        files = {self.names.get(name, name): file for name, file in self.files.items()}  # by the checkpoint's names
        names = _names_on_load(model, files)
        self.files = {name: files[saved] for name, saved in names.items()}
        self.names = {name: saved for name, saved in names.items() if name != saved}
        self._headers = None

    def read(self, names_and_dtypes: list[tuple[str, torch.dtype]]) -> dict[str, torch.Tensor]:
        """The named tensors, cast to their dtypes."""
        by_file: dict[Path, list] = {}
        for name, dtype in names_and_dtypes:
            if name not in self.files:
                raise KeyError(f"{name} is not in the checkpoint")
            by_file.setdefault(self.files[name], []).append((name, dtype))
        out = {}
        for file, items in by_file.items():
            with open_safetensors(file) as f:
                for name, dtype in items:
                    out[name] = f.get_tensor(self.names.get(name, name)).to(dtype)
        return out

    def headers(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor's safetensors dtype name and shape, from the files' headers (no tensor is read), read once
        (convert checks a component's checkpoint, then lists what its model leaves out)."""
        if self._headers is None:
            self._headers = self._read_headers()
        return self._headers

    def _read_headers(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        found = {}
        for name, file in self.files.items():
            found.setdefault(file, []).append(name)
        headers = {}
        for file, names in sorted(found.items()):
            with open_safetensors(file) as f:
                there = set(f.keys())  # an index may name a tensor its shard lacks: loading it says so
                for name in names:
                    saved = self.names.get(name, name)
                    if saved in there:
                        tensor = f.get_slice(saved)
                        headers[name] = (tensor.get_dtype(), tuple(tensor.get_shape()))
        return headers


def _plain(files: list[Path], suffix: str) -> list[Path]:
    """Of a directory's safetensors ``files`` (or indexes: ``suffix`` after the name), those without a variant in
    their names, else all."""
    plain = [f for f in files if f.name.count(".") == 1 + suffix.count(".")]  # a variant's name has one dot more
    return plain or files


def _weight_map(index: Path, directory: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from a sharded checkpoint's ``index``; a one-line error naming it when it is not
    one."""
    try:
        saved = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {index}: {err}; is the checkpoint complete?") from None
    weight_map = saved.get("weight_map") if isinstance(saved, dict) else None
    if weight_map is None:
        raise ValueError(f"cannot read {index}: it has no weight_map; is the checkpoint complete?")
    if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
        raise ValueError(
            f"cannot read {index}: its weight_map does not map tensor names to file names; is the checkpoint complete?"
        )
    return {name: directory / file for name, file in weight_map.items()}


def index_fault(directory: Path) -> ValueError | None:
    """The error of the first shard index of a component of the pipeline saved in ``directory`` (one its
    model_index.json names) that is not one (:func:`_weight_map`), or None."""
    try:
        components = json.loads((directory / "model_index.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    for name in sorted(components) if isinstance(components, dict) else ():
        if not isinstance(components[name], list) or "/" in name:
            continue
        for index in sorted((directory / name).glob("*.safetensors.index.json")):
            try:
                _weight_map(index, index.parent)
            except ValueError as err:
                return err
    return None


def open_safetensors(file: Path):
    """``safe_open`` with a one-line error naming the file when it is not a readable safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt")
    except SafetensorError as err:
        raise ValueError(f"cannot read {file}: {err}; is the checkpoint complete?") from None


# safetensors' names of the floating-point dtypes: packed or quantized weights, stored as integers, take other shapes
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def checkpoint_fault(
    directory: Path, model: nn.Module, reader: CheckpointReader | None = None, missing: bool = False
) -> ConfigError | None:
    """A :class:`ConfigError` naming ``directory``'s config.json when the checkpoint beside it (read through
    ``reader``, or found there) holds a floating-point tensor whose shape is not that of ``model``'s tensor of that
    name (``model`` built from the config, on any device), or, with ``missing``, lacks one of ``model``'s
    parameters; None otherwise, or when the checkpoint cannot be read (loading it says so). Names are matched as
    transformers loads them (:func:`_saved_as`)."""
    if reader is None:
        try:
            reader = CheckpointReader(directory, _library(model))
        except Exception:  # noqa: BLE001 - no checkpoint of one safetensors file or an index: not ours to judge
            return None
    try:
        reader.rename_for(model)
        saved = reader.headers()
    except Exception:  # noqa: BLE001 - a damaged file: the load reports it, naming it
        return None
    own = model.state_dict(keep_vars=True)
    found = _saved_as(saved, own, _prefix(model))
    config = directory / "config.json"
    for name, tensor in own.items():
        if name in found and found[name][0] in FLOAT_DTYPES and tuple(tensor.shape) != found[name][1]:
            return ConfigError(
                f"{config} does not describe the weights beside it: {name} has shape {_shape(found[name][1])} in the "
                f"checkpoint, {_shape(tensor.shape)} in the model the config builds; fix the config, or the weights if "
                "they are another model's"
            )
    if missing:
        lacking = _missing_parameters(model, found)
        if lacking and reader.sharded and _renamed_on_load(model, saved) & set(lacking):
            return ConfigError(
                f"{directory}: its sharded checkpoint holds attention weights under their old names (query, key, "
                "value, proj_attn), which diffusers renames in a checkpoint of one file only; save it again as one "
                "file, or under the new names"
            )
        if lacking:
            more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
            return ConfigError(
                f"{config} does not describe the weights beside it: the model it builds has {lacking[0]}{more}, "
                "which the checkpoint lacks; fix the config, or the checkpoint if it is incomplete"
            )
    return None


def unused_tensors(directory: Path, model: nn.Module, reader: CheckpointReader) -> list[str]:
    """Names of the checkpoint's tensors that ``model`` (built from ``directory``'s config) has no place for, but
    those its class says to ignore (``_keys_to_ignore_on_load_unexpected``), as diffusers warns of them."""
    saved = reader.headers()
    own = model.state_dict(keep_vars=True)
    used = {found[2] for found in _saved_as(saved, own, _prefix(model)).values()}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    return [name for name in saved if name not in used and not any(p.search(name) for p in ignored)]


def _saved_as(saved: dict, own: dict, prefix: str | None) -> dict[str, tuple]:
    """Model name -> (dtype, shape, checkpoint name) of each checkpoint tensor the model has a name for: the same
    name or, for a transformers model (``prefix``: its ``base_model_prefix``, maybe empty), the name that model
    would load it as, without or with its prefix, else without its first part (a text encoder saved from its task
    model, ``model.layers.0...``, or with a name transformers renames, ``text_model.encoder...``). A name found
    without the first part of two checkpoint names (a whole CLIP model's ``text_model.`` and ``vision_model.``
    towers, read by one of them) is not taken: which one the model loads cannot be told."""
    found = {name: (*saved[name], name) for name in saved if name in own}
    if prefix is None:
        return found
    guessed: dict[str, list] = {}
    for name, (dtype, shape) in saved.items():
        if name in own:
            continue
        with_prefix = name[len(prefix) + 1 :] if name.startswith(prefix + ".") else f"{prefix}.{name}"
        if prefix and with_prefix in own:
            found.setdefault(with_prefix, (dtype, shape, name))
        elif name.partition(".")[2] in own:
            guessed.setdefault(name.partition(".")[2], []).append((dtype, shape, name))
    for name, candidates in guessed.items():
        if len(candidates) == 1:
            found.setdefault(name, candidates[0])
    return found


def _library(model: nn.Module) -> str | None:
    """The library ``model`` comes from, whose ``from_pretrained`` reads its checkpoint: ``"transformers"``,
    ``"diffusers"``, or None."""
    import diffusers

    if _prefix(model) is not None:
        return "transformers"
    return "diffusers" if isinstance(model, diffusers.ModelMixin) else None


def _names_on_load(model: nn.Module, saved) -> dict[str, str]:
    """The name diffusers' ``from_pretrained`` gives each tensor of a one-file checkpoint holding ``saved`` names ->
    its name there: the attention layers of VAEs saved under their old names renamed, the others as they are."""
    names = {name: name for name in saved}
    fix = getattr(model, "_fix_state_dict_keys_on_load", None)
    if fix is not None:
        fix(names)  # renames the keys in place; the values stay the checkpoint's names
    return names


def _renamed_on_load(model: nn.Module, saved: dict) -> set[str]:
    """The names :func:`_names_on_load` changes."""
    return {name for name, was in _names_on_load(model, saved).items() if name != was}


def _prefix(model: nn.Module) -> str | None:
    """A transformers model's ``base_model_prefix`` (maybe empty); None for others, whose names are matched as they
    are."""
    prefix = getattr(model, "base_model_prefix", None)
    return prefix if isinstance(prefix, str) else None


def _missing_parameters(model: nn.Module, found: dict) -> list[str]:
    """Names of ``model``'s parameters none of whose names (a tied one has several) is in ``found``."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [aliases[0] for aliases in names.values() if not any(n in found for n in aliases)]


def _shape(shape) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ")"

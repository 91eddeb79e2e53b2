"""Fingerprints: what tells a store which model its packs were made from.

A fingerprint hashes a module's class, config and parameter names, shapes and dtypes. A store records it per
component, and beside it (since stores recorded them) the config itself, as JSON data, and a hash of the class and
parameters alone, so that a config only another library version writes differently is told from another model: a
diffusers or transformers release adds a model argument, or drops one, and the fingerprint of the very same model
changes. :func:`matches_store` takes such a model for the store's; :func:`config_differences` names what differs
where it does not.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

# config keys that say nothing the parameters do not: transformers records the dtype and the class when a model is
# saved or loaded (and casts), so one model in memory and saved then loaded again would differ by them
RESTATED_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "architectures")
# differing keys a refusal names before it counts the rest
NAMED_DIFFERENCES = 3


class Fingerprint(str):
    """A module's fingerprint; ``legacy`` is the one stores written before it left out the restated config keys
    recorded (such a store is read as it was written). ``config`` (the config it hashes, as JSON data: see
    :func:`json_data`), ``layout`` (a hash of its class and parameter names, shapes and dtypes alone) and
    ``class_name`` are what a store records beside it (:func:`recorded_parts`)."""

    legacy: str
    config: dict | None
    layout: str
    class_name: str


def fingerprint(module: nn.Module) -> Fingerprint:
    """sha256 of the module's class, config (less :data:`RESTATED_CONFIG_KEYS`) and parameter names, shapes and
    dtypes (its own parameters, under their names before any adapter was injected)."""
    from tritoff.adapters import named_parameters

    name = type(module).__name__
    config = _config(module, RESTATED_CONFIG_KEYS)
    params = [(n, list(p.shape), str(p.dtype)) for n, p in named_parameters(module)]
    made = Fingerprint(_digest({"class": name, "config": config, "params": params}))
    made.legacy = _digest({"class": name, "config": _config(module, ("transformers_version",)), "params": params})
    made.config = json_data(config) if isinstance(config, dict) else None
    made.layout = _digest({"class": name, "params": params})
    made.class_name = name
    return made


def recorded_parts(made) -> dict:
    """What a store's index records beside fingerprint ``made``: its config, layout hash and class (nothing for a
    plain string)."""
    config, layout = getattr(made, "config", None), getattr(made, "layout", None)
    if not isinstance(config, dict) or not layout:
        return {}
    return {"config": config, "layout_fingerprint": layout, "class": made.class_name}


def matches_store(info: dict, made) -> bool:
    """Whether a store's component ``info`` (its index entry) was made from the model ``made`` fingerprints: the same
    fingerprint, or, where the store recorded its config, the same class and parameters under a config that differs
    only by keys one side lacks, at any depth (a release adds a model argument, or a key to a nested one such as
    ``rope_parameters``, or drops one); every value both record must be the same (numbers by value)."""
    if info["fingerprint"] in (made, getattr(made, "legacy", None)):
        return True
    layout = getattr(made, "layout", None)
    return layout is not None and info.get("layout_fingerprint") == layout and config_conflict(info, made) == []


def config_conflict(info: dict, made) -> list[str] | None:
    """The differences (:func:`config_differences`) between the config a store's component ``info`` recorded and
    ``made``'s, or None where either has none to compare."""
    stored, config = info.get("config"), getattr(made, "config", None)
    if not isinstance(stored, dict) or not isinstance(config, dict):
        return None
    return config_differences(stored, config)


def config_differences(stored: dict, made: dict, prefix: str = "") -> list[str]:
    """Each value both configs record that differs, by its path (``rope_parameters.rope_theta``, ``latents_mean[3]``),
    as ``path (VALUE in the store, VALUE here)``; keys one side lacks are left out, at every depth."""
    found = []
    for key in sorted(stored.keys() & made.keys()):
        found += _differences(stored[key], made[key], f"{prefix}{_key_text(key)}")
    return found


def config_refusal(keys: list[str]) -> str:
    """What a refusal says of the config differences ``keys``: the first few, and how many more."""
    more = len(keys) - NAMED_DIFFERENCES
    return "; ".join(keys[:NAMED_DIFFERENCES]) + (f"; {more} more" if more > 0 else "")


def json_data(value):
    """``value`` as plain JSON data: dicts with str keys, lists for tuples, finite floats (a non-finite one as its
    text: ``NaN`` equals itself, and the index stays strict JSON), str() of anything else (a torch dtype)."""
    if isinstance(value, dict):
        return {str(k): json_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_data(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _differences(stored, made, path: str) -> list[str]:
    if isinstance(stored, dict) and isinstance(made, dict):
        return config_differences(stored, made, f"{path}.")
    if isinstance(stored, list) and isinstance(made, list) and len(stored) == len(made):
        pairs = enumerate(zip(stored, made, strict=True))
        return [d for i, (a, b) in pairs for d in _differences(a, b, f"{path}[{i}]")]
    if _same(stored, made):
        return []
    return [f"{path} ({_short(stored)} in the store, {_short(made)} here)"]


def _same(a, b) -> bool:
    """Equal as config values: numbers by value (1 and 1.0), but a bool only as a bool."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _key_text(key: str) -> str:
    """A config key as a refusal names it: on one line whatever it holds."""
    return key if key.isprintable() else json.dumps(key)


def _short(value, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config(module: nn.Module, left_out: tuple[str, ...]):
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    elif config is not None:
        config = dict(config)
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if not str(k).startswith("_") and k not in left_out}
    return config


def _digest(record: dict) -> str:
    try:
        text = json.dumps(record, sort_keys=True, default=str)
    except TypeError:  # keys of several types, which cannot be sorted: as JSON data, every key a str
        text = json.dumps(json_data(record), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()

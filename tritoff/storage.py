"""Which storage each pipeline component gets (no torch needed: the command line checks this before loading it).

``storage`` is ``None`` (fp8_e4m3), a format name, or ``{component: format}``. A format name applies to text
encoders, image encoders and denoisers; VAEs keep their own dtype (pure offload) unless a dict names them: quantizing a
video VAE saves about 0.1 GB and costs quality (docs/usage.md has the measured PSNR).
"""

from __future__ import annotations

# the names tritoff.formats.FORMATS defines, and which of them quantize
NAMES = ("fp8_e4m3", "fp8_e5m2", "bf16", "fp16")
FP8 = ("fp8_e4m3", "fp8_e5m2")
DEFAULT_STORAGE = "fp8_e4m3"
VAE_STORAGE = "bf16"  # pure offload: every tensor kept in its own dtype


def storage_name(name) -> str:
    """The canonical name of a storage format (``"FP8-E4M3"`` -> ``"fp8_e4m3"``); a ``StorageFormat`` gives its own."""
    key = str(getattr(name, "name", name)).lower().replace("-", "_")
    if key not in NAMES:
        raise ValueError(f"unknown storage {name!r}: use one of {', '.join(NAMES)}")
    return key


def is_vae(name: str, module=None) -> bool:
    """Whether the pipeline component ``name`` (``module``, when known) is a VAE: named ``vae`` / ``*_vae``, or a
    module whose class has ``encode`` and ``decode`` methods (submodules of those names make no VAE)."""
    if name == "vae" or name.endswith("_vae"):
        return True
    return module is not None and all(callable(getattr(type(module), m, None)) for m in ("encode", "decode"))


def resolve_storage(storage, components: dict) -> dict[str, str]:
    """Each component's storage format name from ``storage`` (see the module docstring). ``components`` maps names
    to modules, or to None where only names are known."""
    if isinstance(storage, dict):
        unknown = sorted(set(storage) - set(components), key=repr)  # keys of any type: 1 and "x" do not compare
        if unknown:
            raise ValueError(
                f"storage names {', '.join(map(repr, unknown))}, which "
                f"{'is not a component' if len(unknown) == 1 else 'are not components'}; the components are "
                f"{', '.join(components)}"
            )
        chosen = {name: storage_name(fmt) for name, fmt in storage.items()}
        default = DEFAULT_STORAGE
    else:
        chosen = {}
        default = storage_name(storage if storage is not None else DEFAULT_STORAGE)
    result = {}
    for name, module in components.items():
        if name in chosen:
            result[name] = chosen[name]
        elif default in FP8 and is_vae(name, module):
            result[name] = VAE_STORAGE
        else:
            result[name] = default
    return result


def describe_storage(storages: dict[str, str]) -> str:
    """A few words for reports: the storage of most components, then the others', e.g. ``fp8_e4m3 (vae: own
    dtype)``; ``mixed (...)`` naming each component's when no storage is held by more components than any other."""
    # bf16 and fp16 keep every tensor as the model has it: named after the format, a bf16 model read "fp16"
    # by name: the pipeline's order of components differs with how they were given
    shown = {name: fmt if fmt in FP8 else "own dtype" for name, fmt in sorted(storages.items())}
    by_format: dict[str, list[str]] = {}
    for name, fmt in shown.items():
        by_format.setdefault(fmt, []).append(name)
    main, *others = sorted(by_format, key=lambda f: (-len(by_format[f]), f not in FP8))
    if not others:
        return main
    if len(by_format[main]) == len(by_format[others[0]]):  # a tie: no storage is the pipeline's
        return f"mixed ({', '.join(f'{n}: {fmt}' for n, fmt in shown.items())})"
    return f"{main} ({', '.join(f'{n}: {fmt}' for fmt in others for n in by_format[fmt])})"


def common_fp8(storages: dict[str, str]) -> str:
    """The one name for a set of components' storages: their fp8 format when they share one (components kept in their
    own dtypes store no fp8 codes), the shared name when none is fp8, else ``"mixed"``."""
    fp8 = {f for f in storages.values() if f in FP8}
    names = fp8 or set(storages.values())
    return names.pop() if len(names) == 1 else "mixed"


def parse_storage(text: str | None):
    """A command line's ``--storage``: a format name, or ``component=format`` pairs separated by commas."""
    if text is None or "=" not in text:
        return None if text is None else storage_name(text)
    pairs = {}
    for item in text.split(","):
        name, sep, fmt = item.partition("=")
        if not sep or not name.strip() or not fmt.strip():
            raise ValueError(f"--storage {text!r}: use a format, or component=format pairs separated by commas")
        if name.strip() in pairs:
            raise ValueError(f"--storage {text!r} names {name.strip()} twice: give each component one format")
        pairs[name.strip()] = storage_name(fmt.strip())
    return pairs

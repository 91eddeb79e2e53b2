"""Loading a pipeline whose weights a store holds: its stored components built without their weights.

``enable(pipe, store=DIR)`` replaces every stored weight with the store's packs, so reading the weights first is
wasted: a pipeline loaded whole needs its bf16 model in RAM (28 GB for Wan-14B's transformer, 11 GB for its text
encoder) before the packs take its place. :func:`load_pipeline` builds the stored components from their configs
instead, parameters on the meta device, and loads only the rest (tokenizers, schedulers, components the store lacks).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn


def load_pipeline(
    model: str | Path, store: str | Path, dtype: torch.dtype = torch.bfloat16, pipeline: str | None = None
):
    """The diffusers pipeline ``model`` (a local directory, or a hub id: its copy in the Hugging Face cache,
    downloaded first where it is not all there) with every component ``store`` holds built without its weights, ready
    for ``tritoff.enable(pipe, store=store, ...)``, which fills them from the packs (the pipeline runs only then); the
    other components load as ``from_pretrained`` loads them. ``dtype``: the dtype the store was converted in
    (``tritoff convert --dtype``). ``pipeline``: the name of the diffusers pipeline class to load it as (default: the
    one model_index.json names).

    Refused in one line (:class:`~tritoff.store.StoreError`, ``ValueError`` or ``TypeError``) before the pipeline
    loads: a store made from other weight files than ``model``'s, one converted in another dtype, or a pipeline that
    lacks one of its components. A store ``Engine.save`` wrote records no weight files: the pipeline is then loaded
    whole, for ``enable`` to compare its weights with the packs."""
    from tritoff.convert import fetch_pipeline, from_pretrained, load_error
    from tritoff.store import (
        StoreError,
        check_components,
        check_source,
        read_index,
        stored_compute_dtype,
    )

    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a pipeline directory or a hub id, got {model!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch dtype such as torch.bfloat16, got {dtype!r}")
    _check_pipeline_class(pipeline)
    index = read_index(store)
    converted = stored_compute_dtype(store)
    if converted is not None and getattr(torch, converted) != dtype:
        raise StoreError(
            f"the store {store} was converted in {converted} and the pipeline would load in "
            f"{str(dtype).removeprefix('torch.')}: pass dtype=torch.{converted}"
        )
    if not Path(model).exists() and str(model).startswith((".", "/", "~")):
        raise ValueError(f"{model} does not exist: give a pipeline directory or a hub id like org/name")
    local = fetch_pipeline(model)
    if not (local / "model_index.json").is_file():
        raise ValueError(f"{model} is not a diffusers pipeline directory (no model_index.json)")
    check_source(store, local, index)
    check_components(store, local, index, list(_library_components(local)))
    components = stored_components(local, store, dtype)
    try:
        return from_pretrained(local, whole_dtypes(store, components, dtype), pipeline=pipeline, **components)
    except Exception as err:
        error = load_error(model, err, local)  # the config or shard index at fault, named; else the libraries' own
        if error is None:
            raise
        raise error from None


def whole_dtypes(store: str | Path, built: dict[str, nn.Module], dtype: torch.dtype) -> torch.dtype | dict:
    """The ``torch_dtype`` that loads the components not ``built`` (loaded whole) in the dtype their packs hold:
    ``dtype``, but another for a component the store holds in it (a VAE kept in float32 beside a bf16 pipeline, as
    Wan's examples load it; a float16 text encoder beside a bf16 transformer), which would not match its store in
    ``dtype``."""
    from tritoff.store import component_dtypes

    other = {
        name: getattr(torch, kind)
        for name, kind in component_dtypes(store).items()
        if name not in built and getattr(torch, kind) != dtype
    }
    return {"default": dtype, **other} if other else dtype


def stored_components(directory: Path, store: str | Path, dtype: torch.dtype) -> dict[str, nn.Module]:
    """The components of the pipeline saved in ``directory`` that ``store`` holds, built without their weights: their
    parameters in the dtypes the store recorded, their buffers as ``from_pretrained(torch_dtype=dtype)`` makes them
    (read from the checkpoint's safetensors files; a component saved in other files loads whole). A transformers model
    (a text or image encoder) is built only where it is the model the store was made from (its fingerprint: class,
    config, parameter names, shapes and dtypes), as another transformers version may build it otherwise; the others
    are left out, to be loaded whole (the store's own checks then speak). Each built component is marked with the
    store, which ``enable`` checks (:func:`check_built_for`).

    None for a store that records no source files (one ``Engine.save`` wrote): only the weights' values, which
    ``enable`` compares with the packs, tell whether it was made from this pipeline, so it is loaded whole."""
    from tritoff.convert import empty_diffusers_component
    from tritoff.store import read_index, records_source, stored_dtypes

    index = read_index(store)
    if not records_source(index):
        from tritoff.warn import warn

        warn(
            f"the store at {store} records no weight files (Engine.save wrote it): the pipeline is loaded whole, "
            "and enable compares its weights with the packs; tritoff convert writes a store that spares the load"
        )
        return {}
    libraries = _library_components(directory)
    built = {}
    for name, info in index["components"].items():
        library, class_name = libraries.get(name, (None, None))
        if not any((directory / name).glob("*.safetensors")):  # the saved buffers are read from safetensors files
            continue
        if library == "diffusers":
            # buffers cast as loaded, parameters as the store holds them
            built[name] = empty_diffusers_component(
                directory / name, class_name, dtype, stored=stored_dtypes(store, name)
            )
        elif library == "transformers":
            encoder = _empty_encoder(directory / name, class_name, store, name, dtype, info)
            if encoder is not None:
                built[name] = encoder
    for name, module in built.items():
        module._tritoff_store = index["index_hash"]
        module._tritoff_until_filled = module.register_forward_pre_hook(_refuse_until_filled(name))
    return built


def _refuse_until_filled(name: str):
    """A forward pre-hook for a component built without its weights: a call before ``enable`` filled them is refused
    in one line (torch would fail on the meta device, deep inside); the first call after removes the hook."""

    def hook(module: nn.Module, args) -> None:
        if any(p.is_meta for p in module.parameters()):
            raise RuntimeError(
                f"{name} was built without its weights (tritoff.load_pipeline): call tritoff.enable(pipe, store=...) "
                "before running the pipeline"
            )
        module._tritoff_until_filled.remove()

    return hook


def check_built_for(components: dict[str, nn.Module], store: str | Path) -> None:
    """Refuse to fill from ``store`` a component :func:`stored_components` built without its weights for another
    store: nothing else would tell (a component without weights has none to compare with the packs)."""
    from tritoff.store import StoreError, read_index

    expected = read_index(store)["index_hash"]
    for name, module in components.items():
        built_for = getattr(module, "_tritoff_store", None)
        if built_for is not None and built_for != expected and any(p.is_meta for p in module.parameters()):
            raise StoreError(
                f"{name} was built without its weights for another store (tritoff.load_pipeline): enable it with "
                f"the store it was loaded for, or load the pipeline again for {store}"
            )


def _check_pipeline_class(pipeline) -> None:
    """Refuse a ``pipeline`` that names no diffusers pipeline class (``DiffusionPipeline`` itself included: through it
    diffusers loads the optional components, a transformer among them, whole)."""
    if pipeline is None:
        return
    import diffusers

    cls = getattr(diffusers, pipeline, None) if isinstance(pipeline, str) else None
    if (
        not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline))
        or cls is diffusers.DiffusionPipeline
    ):
        raise ValueError(
            f"pipeline={pipeline!r} names no diffusers pipeline class: give one such as 'WanImageToVideoPipeline', "
            "or None for the one model_index.json names"
        )


def _empty_encoder(directory: Path, class_name: str, store, name: str, dtype, stored: dict):
    """The transformers component ``name`` saved in ``directory`` built without its weights, or None where that is not
    the model the store was made from (``stored``: the component's entry in the store's index). A config the store
    records with another value for a key both hold is refused here, before the encoder is loaded whole: the loaded
    one has that config too."""
    from tritoff.convert import empty_transformers_component
    from tritoff.fingerprint import config_conflict, config_refusal, fingerprint, matches_store
    from tritoff.store import StoreError, stored_dtypes
    from tritoff.warn import warn

    try:
        built = empty_transformers_component(directory, class_name, dtype, stored_dtypes(store, name))
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - the whole load that follows reports what is wrong, naming the file
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
    else:
        made = fingerprint(built)
        if matches_store(stored, made):
            return built
        keys = config_conflict(stored, made)
        if keys:
            raise StoreError(
                f"{store}: component {name} has another config than the store's ({config_refusal(keys)}): load the "
                "pipeline the store was made from, or convert this one into a new store"
            )
        why = "it differs from the model the store was made from (class, parameter names, shapes or dtypes)"
    warn(f"{name} is loaded whole, then its packs replace it: built without its weights by this transformers, {why}")
    return None


def _library_components(directory: Path) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class name) for each model_index.json entry of the pipeline in ``directory`` that
    names one (``[library, class]``)."""
    import json

    path = Path(directory) / "model_index.json"
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not isinstance(index, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {
        name: (spec[0], spec[1])
        for name, spec in index.items()
        if isinstance(spec, list) and len(spec) == 2 and all(isinstance(part, str) and part for part in spec)
    }

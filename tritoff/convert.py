"""``tritoff convert``: quantize a saved pipeline once into a store, reading the checkpoint one group at a time.

Diffusers components (the transformer: most of the bytes) are built from their configs without weights; each group's
tensors are read from the checkpoint's safetensors files (memory-mapped), cast as ``from_pretrained`` would, quantized,
written into its component's file of the store being written, and dropped: host memory holds one group, so a store
larger than RAM can be made, and the disk holds the packs once (their files become the store's). Other components
(transformers text encoders, which tie weights at load time) and checkpoints without safetensors files are loaded
normally and released group by group as they are packed.

The store is written atomically (a temporary directory beside the target, renamed into place) and records the weight
files it was made from, so ``tritoff run MODEL --store DIR`` can refuse a store made from other weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from tritoff.checkpoint import CheckpointReader, ConfigError, checkpoint_fault, index_fault, unused_tensors
from tritoff.fingerprint import fingerprint
from tritoff.formats import get_format
from tritoff.groups import Group
from tritoff.load_output import held_load_output
from tritoff.packer import PackedModel, pack_model, plan_layouts
from tritoff.partial import finished, partial_store
from tritoff.skip import SkipRules, warn_unmatched
from tritoff.storage import resolve_storage
from tritoff.store import check_target, describe_source, reserve_store_files, save_store


def empty_diffusers_component(
    directory: Path,
    class_name: str,
    dtype: torch.dtype,
    reader: CheckpointReader | None = None,
    stored: dict[str, torch.dtype] | None = None,
):
    """The component saved in ``directory`` built from its config, parameters on the meta device (buffers computed for
    real). ``dtype``: the pipeline dtype, applied to parameters and buffers as ``from_pretrained`` does
    (``_keep_in_fp32_modules`` stay fp32); ``stored``: a dtype per parameter name that overrides it (as a store
    recorded them). A config that does not describe the checkpoint beside it (read through ``reader``, or found
    there) is a :class:`ConfigError` naming it."""
    import diffusers
    from accelerate import init_empty_weights

    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(
            f"cannot load {directory}: diffusers {diffusers.__version__} has no model class {class_name!r} (named in "
            "model_index.json): fix the name, or upgrade diffusers"
        )
    with init_empty_weights(include_buffers=False), config_errors(Path(directory) / "config.json"):
        module = cls.from_config(cls.load_config(directory))
    # before the saved buffers are copied in: a config of other sizes would fail there naming no file
    fault = checkpoint_fault(Path(directory), module, reader, missing=True)
    if fault is not None:
        raise fault
    module = with_stored_dtypes(cast_like_from_pretrained(module, dtype), stored or {})
    load_saved_buffers(module, Path(directory))
    return module.eval()


def with_stored_dtypes(module: nn.Module, stored: dict[str, torch.dtype]) -> nn.Module:
    """``module`` (built without weights) with each parameter ``stored`` names given that dtype, on the meta device."""
    for name, param in module.named_parameters():
        if name in stored:
            param.data = torch.empty(param.shape, dtype=stored[name], device="meta")
    return module


def empty_transformers_component(
    directory: Path, class_name: str, dtype: torch.dtype, stored: dict[str, torch.dtype]
) -> nn.Module:
    """The transformers model saved in ``directory`` built from its config as ``from_pretrained(dtype=dtype)`` builds
    it (buffers computed under that dtype, the attention implementation it picks, its tied weights one parameter), but
    with its parameters on the meta device, in the dtypes ``stored`` names (as a store recorded them: which modules
    transformers keeps in fp32 depends on its version). Whether it is the model a store was made from is for the
    store's fingerprint to say."""
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"cannot load {directory}: transformers {transformers.__version__} has no {class_name!r}")
    # transformers 4.56 renamed torch_dtype to dtype (its _from_config then takes the old name only where the config's
    # own dtype is another)
    major, minor = (int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    with init_empty_weights(include_buffers=False), config_errors(Path(directory) / "config.json"):
        config = cls.config_class.from_pretrained(directory)
        setattr(config, key, dtype)  # the dtype loaded in, as from_pretrained records it (the fingerprint has it)
        module = cls._from_config(config, **{key: dtype})
    # as from_pretrained does once the weights are in: shared embeddings become one parameter (outside
    # init_empty_weights, which would register a new one in the tied one's place)
    module.tie_weights()
    with_stored_dtypes(module, stored)
    unsaved = load_saved_buffers(module, Path(directory))
    if unsaved:  # saved under another name (a prefix transformers maps on load) or not at all: not built as it loads
        raise ValueError(f"{directory}: no saved value under the model's name for buffer {sorted(unsaved)[0]}")
    return module.eval()


def load_saved_buffers(module: nn.Module, directory: Path) -> set[str]:
    """Give ``module``'s persistent buffers the values saved in ``directory``'s safetensors files, in the buffers'
    dtypes: built from a config they hold their initial values, which a checkpoint may not (CogVideoX-5B I2V's learned
    positional embedding, a VAE's latent statistics). Files without a variant in their name are read first. Returns
    the names of those no file holds (they keep their initial values)."""
    from safetensors import safe_open

    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    wanted = {name for name in module.state_dict(keep_vars=True) if name not in params}
    files = sorted(directory.glob("*.safetensors"), key=lambda path: (path.name.count(".") > 1, path.name))
    for path in files:
        if not wanted:
            break
        with safe_open(str(path), framework="pt") as saved, torch.no_grad():
            for name in wanted & set(saved.keys()):
                buffer = module.get_buffer(name)
                buffer.copy_(saved.get_tensor(name).to(buffer.dtype))
                wanted.discard(name)
    return wanted


def cast_like_from_pretrained(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast like ``from_pretrained(torch_dtype=...)``: tensors of ``_keep_in_fp32_modules`` stay fp32 (never rounded
    through ``dtype``)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        kept = any(part in keep for part in name.split("."))
        for pname, param in module._parameters.items():
            if param is not None:
                param.data = param.data.to(torch.float32 if kept or pname in keep else dtype)
        for bname, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[bname] = buf.to(torch.float32 if kept else dtype)
    return model


def from_pretrained(model, dtype: torch.dtype | dict, pipeline: str | None = None, **components):
    """``from_pretrained`` of the pipeline class ``model`` names (or of diffusers' class ``pipeline``), without the
    ``torch_dtype`` rename warning of newer diffusers (older ones know only that name). ``dtype``: one for all, or
    ``{component: dtype, "default": dtype}``. ``components`` are passed as built (``None``: not loaded).

    The class itself, not ``DiffusionPipeline``: called through ``DiffusionPipeline``, diffusers reads the optional
    components of ``DiffusionPipeline`` (none), so a component the pipeline declares optional (Wan's transformer) is
    loaded from its files whatever is passed for it, a whole model read into RAM where it was to be built empty."""
    import diffusers

    cls = diffusers.DiffusionPipeline
    index = Path(model) / "model_index.json"
    if pipeline is not None or index.is_file():
        name = pipeline if pipeline is not None else json.loads(index.read_text()).get("_class_name")
        named = getattr(diffusers, name, None) if isinstance(name, str) else None
        cls = named if isinstance(named, type) and issubclass(named, cls) else cls
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
        return cls.from_pretrained(model, torch_dtype=dtype, **components)


# what diffusers raises on missing or malformed files (an unknown class, a config of the wrong types, a size the
# model cannot be built with: torch's RuntimeError), or a package the pipeline needs
LOAD_ERRORS = (OSError, ValueError, ImportError, AttributeError, TypeError, RuntimeError)


@contextlib.contextmanager
def config_errors(config: Path):
    """Around building a model from ``config`` (a config.json): what its constructor raises on values it cannot take
    (a string where a count goes, a negative size) becomes a one-line :class:`ConfigError` naming the file."""
    try:
        yield
    except Exception as err:
        # the machine's errors, a package missing, and one naming the file already (diffusers: a config.json it cannot
        # parse) stay as they are
        if isinstance(err, (MemoryError, torch.OutOfMemoryError, OSError, ImportError)) or str(config) in str(err):
            raise
        raise ConfigError(f"cannot build a model from {config}: {_one_line(err)}; fix the config") from err


def build_from_config(directory: Path, library: str, cls: type) -> nn.Module:
    """``cls`` (a ``library`` model class: ``"diffusers"`` or ``"transformers"``) built on the meta device from the
    config saved in ``directory``; values it cannot be built with are a one-line ValueError naming the file."""
    with torch.device("meta"), config_errors(directory / "config.json"):
        if library == "diffusers":
            return cls.from_config(cls.load_config(directory))
        # the class's own config class, as its from_pretrained reads it (AutoConfig needs a model_type it does not)
        config_class = getattr(cls, "config_class", None)
        if config_class is None:
            from transformers import AutoConfig as config_class
        return cls(config_class.from_pretrained(directory))


def config_fault(directory: Path) -> ConfigError | None:
    """The error of the first model of the pipeline saved in ``directory`` whose config builds no model
    (:func:`config_errors`) or one whose tensors do not have its weights' shapes (:func:`checkpoint_fault`), or
    None: what a failed ``from_pretrained`` cannot say, since diffusers and transformers name no file."""
    try:
        index = json.loads((directory / "model_index.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    for name, spec in index.items() if isinstance(index, dict) else ():
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in ("diffusers", "transformers")):
            continue
        cls = getattr(__import__(spec[0]), spec[1], None) if isinstance(spec[1], str) else None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and (directory / name / "config.json").is_file()):
            continue
        try:
            built = build_from_config(directory / name, spec[0], cls)
        except ConfigError as err:
            return err
        except Exception:  # noqa: BLE001 - a fault of another kind: from_pretrained's own message says it
            continue
        fault = checkpoint_fault(directory / name, built)
        if fault is not None:
            return fault
    return None


def load_error(model, err: Exception, directory: Path | None, kept: tuple[type, ...] = ()) -> ValueError | None:
    """The one-line error for ``err``, which ``from_pretrained`` raised loading ``model`` (saved in ``directory``, a
    local pipeline directory, or None): the config whose values build no model where :func:`config_fault` finds one
    (transformers' configs raise their own exception types on a bad value), or the shard index that is not one
    (:func:`index_fault`: diffusers fails inside it with a KeyError or TypeError), else :func:`cannot_load` for the
    ``LOAD_ERRORS``; None for running out of memory, the unforeseen, and errors of the types ``kept`` that no config
    explains, which stay as they are."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return None
    if directory is not None and not isinstance(err, (OSError, ImportError)) and directory.is_dir():
        fault = config_fault(directory) or index_fault(directory)
        if fault is not None:
            return fault
    return ValueError(cannot_load(model, err)) if isinstance(err, LOAD_ERRORS) and not isinstance(err, kept) else None


def _one_line(err: BaseException) -> str:
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    return message[:400] + ("..." if len(message) > 400 else "")


def cannot_load(model, err: BaseException) -> str:
    """The one-line message for ``model``, which :func:`from_pretrained` could not load (``err``, every line of it:
    some libraries list their reasons below the first), cut at 400 characters."""
    return f"cannot load {model}: {_damaged_file(err) or _one_line(err)}"


def _damaged_file(err: BaseException) -> str | None:
    """For diffusers' report of a weight file it could not read, which names the file twice and not why: the file
    and safetensors' reason, found down the exception chain (as ``tritoff convert`` says it); else None."""
    match = re.match(r"Unable to load weights from checkpoint file for '([^']+)'", str(err))
    if match is None:
        return None
    cause = next((c for c in _chain(err) if type(c).__name__ == "SafetensorError"), None)
    return None if cause is None else f"cannot read {match.group(1)}: {_one_line(cause)}; is the checkpoint complete?"


def _chain(err: BaseException):
    """``err`` and the exceptions it was raised from or while handling, in turn (each once: a chain may loop)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _streamed_components(directory: Path, dtype: torch.dtype) -> tuple[dict[str, nn.Module], dict]:
    """The diffusers components of the pipeline saved in ``directory`` that have safetensors files, built from their
    configs without weights, and a reader of each one's checkpoint: (components, readers). Tensors of a checkpoint
    that its model has no place for are warned of (the store leaves them out)."""
    from tritoff.warn import warn

    components, readers = {}, {}
    for name, spec in json.loads((directory / "model_index.json").read_text()).items():
        sub = directory / name
        if not (
            isinstance(spec, list)
            and spec[0] == "diffusers"
            and (list(sub.glob("*.safetensors")) or list(sub.glob("*.safetensors.index.json")))
        ):
            continue
        readers[name] = CheckpointReader(sub, "diffusers")
        components[name] = empty_diffusers_component(sub, spec[1], dtype, readers[name])
        unused = unused_tensors(sub, components[name], readers[name])
        if unused:
            tensors = f"{len(unused)} tensors" if len(unused) > 1 else "a tensor"
            warn(
                f"{sub}: {tensors} of its checkpoint ({unused[0]}{', ...' if len(unused) > 1 else ''}) have no place "
                "in the model its config.json builds; the store leaves them out"
            )
    return components, readers


def convert_pipeline(
    model: str | Path,
    out_dir: str | Path,
    storage: str | dict[str, str] | None = "fp8_e4m3",
    granularity: str = "row",
    skip: tuple[str, ...] = (),
    grouping: str = "block",
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    stream: bool = True,
    overwrite: bool = False,
) -> dict[str, PackedModel]:
    """Quantize every model component of the pipeline at ``model`` (a local directory or a hub id) into a store at
    ``out_dir``. With ``stream``, diffusers components are read group by group from their safetensors files (a hub id
    from its snapshot in the Hugging Face cache, downloaded first if need be: :func:`fetch_pipeline`); otherwise the
    pipeline is loaded with ``from_pretrained`` and released group by group.

    ``storage`` is what :func:`tritoff.enable` takes (a format for all but the VAEs, or ``{component: format}``).
    ``out_dir`` must be new or empty (or a store, replaced with ``overwrite``) and outside the model directory; this is
    checked before anything is read."""
    from tritoff.preflight import components_of
    from tritoff.sizing import groups_for

    directory = Path(model)
    check_target(out_dir, overwrite, model=directory)
    if stream and not directory.is_dir():  # a hub id is read from its snapshot, group by group
        directory = model = fetch_pipeline(model)
        check_target(out_dir, overwrite, model=directory)
    components: dict[str, nn.Module] = {}
    readers: dict[str, CheckpointReader] = {}
    with held_load_output() as held:
        try:
            if stream and (directory / "model_index.json").is_file():
                components, readers = _streamed_components(directory, dtype)
            # everything else loads normally (the streamed components are passed as None so they are not read)
            try:
                loaded = from_pretrained(model, dtype, **dict.fromkeys(readers))
            except Exception as err:
                # OSError and ValueError say what is wrong themselves, unless a config turned out to be at fault
                error = load_error(model, err, directory, kept=(OSError, ValueError))
                if error is None:
                    raise
                raise error from err
        except ConfigError:  # its one line says what the libraries' reports would have
            held.drop()
            raise
    for name, module in components_of(loaded).items():
        components.setdefault(name, module)
    components = {n: components[n] for n in sorted(components)}
    storages = resolve_storage(storage, components)
    source_dir = model_directory(model)
    # recorded before the weights are read: what the packs are made from
    source = describe_source(source_dir, components) if source_dir is not None else None
    fingerprints = {n: fingerprint(m) for n, m in components.items()}
    plans = {}
    warn_unmatched(skip, {n: m for n, m in components.items() if get_format(storages[n]).is_fp8})
    for name, module in components.items():
        groups = groups_for(module, grouping if grouping == "leaf" else "group")
        quantized = SkipRules.for_model(module, skip).quantized_names(module)
        plans[name] = groups, plan_layouts(groups, quantized, get_format(storages[name]), granularity, name)
    # each pack goes to disk as soon as it is made, so host memory holds one group whatever the model's size: into
    # its component's file of the store being written beside the target, where it stays
    partial = partial_store(out_dir, overwrite)
    try:
        layouts_of = {name: [(g.name, lay) for g, lay in zip(*plans[name], strict=True)] for name in components}
        files = reserve_store_files(partial, layouts_of)
        _check_disk(partial, sum(os.fstat(f.fd).st_size for f in files.values()))  # sparse so far: packs + headers
        packed = _pack(components, plans, readers, storages, granularity, skip, progress, files)
        save_store(
            out_dir,
            fingerprints,
            packed,
            skip,
            grouping,
            source=source,
            overwrite=overwrite,
            partial=partial,
            files=files,
        )
    finally:
        if partial.exists():  # interrupted or failed: nothing is left behind (save_store renamed it otherwise)
            shutil.rmtree(partial, ignore_errors=True)
        finished(partial)
    return packed


def _pack(components, plans, readers, storages, granularity, skip, progress, files) -> dict[str, PackedModel]:
    """Pack each component group by group, every pack written into its component's store file as it is made."""
    packed = {}
    for name, module in components.items():
        groups, layouts = plans[name]
        reader = readers.get(name)
        read_group = None
        if reader is not None:

            def read_group(group: Group, reader=reader) -> dict[str, torch.Tensor]:
                return reader.read([(n, p.dtype) for n, p in group.params])

        packed[name] = pack_model(
            module,
            storages[name],
            granularity=granularity,
            skip=skip,
            groups=groups,
            release=True,
            register=False,
            progress=progress,
            read_group=read_group,
            layouts=layouts,
            desc=f"packing {name}",
            held=set(),
            spill=files[name],
        )
    return packed


def _check_disk(directory: Path, packs: int) -> None:
    """Refuse, before packing, a store whose disk cannot hold its files (``packs`` bytes)."""
    from tritoff.budget import format_bytes

    free = shutil.disk_usage(directory).free
    if free < packs:
        raise ValueError(
            f"converting needs {format_bytes(packs)} of free disk in {directory.parent} for the store, which has "
            f"{format_bytes(free)}: write the store on a larger disk"
        )


def fetch_pipeline(model: str | Path) -> Path:
    """The pipeline directory of ``model``: itself when it is a directory, else the Hugging Face cache's snapshot of
    that hub id, downloaded into the cache first when it is not all there (the files ``from_pretrained`` would fetch).
    Reading weights from a directory is what lets ``convert`` and ``run --store`` read them group by group instead of
    loading the whole pipeline into RAM. Raises ``OSError`` when the id can be neither found nor downloaded (a
    machine's own error, a full disk, as it is)."""
    if Path(model).is_dir():
        return Path(model)
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging
    from huggingface_hub.utils import logging as hub_logging

    verbosity = logging.get_verbosity(), hub_logging.get_verbosity()
    # their "could not reach the hub, trying the cache" lines: the error below says it all
    logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    error, incomplete = None, ""
    try:
        for local_files_only in (True, False):  # the cache first: no network call for a pipeline fetched before
            try:
                directory = Path(DiffusionPipeline.download(str(model), local_files_only=local_files_only))
            except Exception as err:
                if isinstance(err, OSError) and err.errno is not None:  # the machine's: no space left, no permission
                    raise
                error = err
                continue
            missing = missing_component(directory)
            if missing is None:
                return directory
            incomplete = f" (its {missing} files are incomplete in {directory})"
    finally:
        logging.set_verbosity(verbosity[0])
        hub_logging.set_verbosity(verbosity[1])
    if type(error).__name__ == "HFValidationError":
        raise OSError(f"{model} is not a valid hub id ({str(error).splitlines()[0]}); give org/name, or a directory")
    offline = "; HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") else ""
    cause = _fetch_cause(error) if error is not None else "incomplete"
    raise OSError(
        f"cannot fetch {model} from the Hugging Face hub: it is not all in the local cache{incomplete} and could not "
        f"be downloaded ({cause}{offline}); check the id and the network, or give a local directory"
    )


def _fetch_cause(error: BaseException) -> str:
    """Why a download failed, in a few words: the network's own error where one lies down the chain (diffusers wraps
    it in a paragraph about the cache), else the first line of ``error``, cut at a word past 200 characters."""
    for cause in _chain(error):
        if isinstance(cause, (ConnectionError, TimeoutError, socket.gaierror)) or type(cause).__name__ in (
            "ConnectError",
            "ConnectTimeout",
        ):
            return f"the hub could not be reached: {_one_line(cause)}"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return first if len(first) <= 200 else first[:200].rsplit(" ", 1)[0] + " ..."


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".flashpack")


def missing_component(directory: Path) -> str | None:
    """The first component ``directory``'s model_index.json names whose files are not all there (a download cut
    short), else None: a folder without files, a file loading may read whose link leads nowhere (a blob missing from
    the Hugging Face cache), an index with some of its shards but not all, or a model (a torch module class) with no
    complete set of weights (a single file, or every shard of one of its indexes; an index of another format with
    none of its shards beside one is not a gap)."""
    try:
        index = json.loads((directory / "model_index.json").read_text())
    except (OSError, ValueError):
        return "model_index.json"
    for name, spec in index.items():
        if name.startswith("_") or not (isinstance(spec, list) and len(spec) == 2 and all(spec)):
            continue  # the pipeline's own keys, no component (null), or an attribute of the pipeline
        folder = directory / name
        entries = list(folder.iterdir()) if folder.is_dir() else []
        if not entries or any(_needed(e) and not e.exists() for e in entries):
            return name
        indexes = {i: _shards(i) for i in entries if _is_shard_index(i.name)}
        present = {i: {s for s in shards if (folder / s).is_file()} for i, shards in indexes.items()}
        if any(0 < len(present[i]) < len(shards) for i, shards in indexes.items()):
            return name  # some of an index's shards but not all: a download cut short
        sharded = {shard for shards in indexes.values() for shard in shards}
        singles = [e for e in entries if e.is_file() and e.name.endswith(WEIGHT_SUFFIXES) and e.name not in sharded]
        complete = singles or any(shards and present[i] == shards for i, shards in indexes.items())
        if not complete and (indexes or _is_model(spec)):
            return name
    return None


def _is_shard_index(name: str) -> bool:
    """``*.index.json``, or a variant's ``*.index.<variant>.json``."""
    return name.endswith(".json") and ".index." in name


def _needed(entry: Path) -> bool:
    """Whether a component's file may be one loading reads: anything but a README, a licence or a picture."""
    name = entry.name.lower()
    return not (name.startswith(("readme", "license", "licence", ".git")) or name.endswith((".md", ".png", ".jpg")))


def _shards(index: Path) -> set[str]:
    """The files a shard index names (none when it cannot be read)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return {str(f) for f in weight_map.values()} if isinstance(weight_map, dict) else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _is_model(spec: list) -> bool:
    """Whether a model_index.json entry ``[library, class]`` names a torch module (which has weights to load): the
    library is a package, or one of diffusers' pipeline modules (a safety checker)."""
    import importlib

    for module in (spec[0], f"diffusers.pipelines.{spec[0]}"):
        try:
            cls = getattr(importlib.import_module(module), spec[1])
        except Exception:  # a library or class this environment lacks: loading it would fail anyway
            continue
        return isinstance(cls, type) and issubclass(cls, torch.nn.Module)
    return False


def model_directory(model: str | Path) -> Path | None:
    """The local directory of ``model``: itself when it is a directory, else the hub cache's snapshot of that id (as
    ``from_pretrained`` left it), or None when there is none."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:  # not a hub id, or not in the cache: nothing to record or check
        return None

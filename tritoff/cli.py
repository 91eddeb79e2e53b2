"""The ``tritoff`` command line (also ``python -m tritoff``): demo, run, convert, plan, bench, info.

Every bad input ends with a one-line error and exit code 2, found before anything slow: options are checked before
torch is imported where they can be, and stores are checked before the pipeline is loaded. Outputs are written to a
temporary file or directory and renamed.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

from tritoff import __version__
from tritoff.allocator import prefer_expandable_segments
from tritoff.arguments import OneLineParser, at_least
from tritoff.atomic import can_create_in, nearest_existing
from tritoff.console import CliError, exit_after, exit_on_interrupt, one_line, run_command, say
from tritoff.planner import MODES
from tritoff.shapes import LIMITS

_MODEL_IS_A_FILE = "is a file: give the diffusers pipeline directory that holds model_index.json"
# tritoff.options.TRANSPORTS and tritoff.formats.FORMATS, known without importing torch, so that a typo is answered at
# once (a test keeps them equal)
TRANSPORTS = ("auto", "staged", "zero_copy")
MAX_FPS = 1_000  # beyond any player's rate (ffmpeg refuses a rate past 2^31 only after the whole run)
STORAGES = ("fp8_e4m3", "fp8_e5m2", "bf16", "fp16")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype: torch's names
STORAGE_HELP = (
    "a format (fp8_e4m3, fp8_e5m2; bf16 or fp16: no quantization, every tensor kept in its own dtype) for the text "
    "encoders and denoisers, VAEs keeping their own dtype; or component=format pairs, e.g. vae=fp8_e4m3"
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (the help says what happens then)."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _seed(value: str) -> int:
    number = at_least(0)(value)
    if number >= 2**64:
        raise argparse.ArgumentTypeError(f"must be below 2**64, got {value!r}")
    return number


def _finite(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value!r}")
    return number


def _path(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return value


_path.__name__ = "path"


def _prepare_backend(device: str | None) -> None:
    """Without CUDA, run Triton kernels in its interpreter (must be decided before triton is imported)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore", message="no CUDA device")  # the report names the device
    # a command stopped while enabling ends its process: there is no pipeline left to reload
    warnings.filterwarnings("ignore", message="enable stopped: ")


def _check_device(device: str | None) -> None:
    """A device tritoff can compute on (checked by name first) and that this machine has (imports torch for cuda)."""
    if device is None:
        return
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise CliError(f"unknown device {device!r}: use cuda, cuda:N or cpu")
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise CliError(
            f"--device {device} was asked for but CUDA is not available (torch {torch.__version__}); use --device cpu"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CliError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _check_budget(budget: str | None, what: str = "budget", percent: bool = True) -> None:
    from tritoff.budget import parse_size

    if budget is not None:  # syntax only: a percentage is resolved on the device later
        parse_size(budget, what=what, total=2**50, percent=percent)


def _check_reserve(reserve: str | None) -> None:
    from tritoff.budget import reserves_everything

    if reserves_everything(reserve):
        raise CliError(f"--reserve {reserve} leaves nothing of the budget for weights: use less than 100%")
    _check_budget(reserve, what="reserve")


def _check_spill_dir(args) -> None:
    """``--spill-dir`` only where it is used (with ``--host-budget``, without ``--store``), and a directory that is or
    can be made writable."""
    if args.spill_dir is None:
        return
    if args.host_budget is None or args.store is not None:
        why = "without it every pack is held" if args.host_budget is None else "a store's packs are read from it"
        raise CliError(f"--spill-dir is used only with --host-budget and without --store ({why})")
    path = Path(args.spill_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise CliError(f"--spill-dir {args.spill_dir} is not a directory")
    existing = nearest_existing(path)
    if not can_create_in(existing):  # (not a directory, or read-only for this process or for everyone)
        raise CliError(f"--spill-dir {args.spill_dir}: {existing} is not a writable directory")


def _check_percentage(budget: str | None, device: str | None) -> None:
    """A budget given as a percentage needs a GPU to take it of (imports torch)."""
    if budget is not None and budget.strip().endswith("%"):
        import torch

        if (device or "").startswith("cpu") or not torch.cuda.is_available():
            raise CliError(f"--budget {budget} is a share of GPU memory, but there is no GPU; give bytes, e.g. 4GB")


def _check_storage(storage: str | None, local: Path | None = None, models: tuple[str, ...] = ()):
    """``--storage``: a format (the same names and spellings ``tritoff.formats.get_format`` accepts) or
    ``component=format`` pairs, whose names the local pipeline directory ``local`` (or the ``models`` named) must
    have; returns what ``tritoff.enable`` takes."""
    from tritoff.storage import parse_storage, resolve_storage

    try:
        parsed = parse_storage(storage)
        if isinstance(parsed, dict) and models:
            resolve_storage(parsed, dict.fromkeys(models))
        if isinstance(parsed, dict) and local is not None and (local / "model_index.json").is_file():
            index = _json(local / "model_index.json")
            # models have a config.json; a scheduler or a tokenizer holds no weights to store
            models = [
                n for n, s in index.items() if isinstance(s, list) and s[0] and (local / n / "config.json").is_file()
            ]
            resolve_storage(parsed, dict.fromkeys(models))
        return parsed
    except ValueError as err:
        raise CliError(f"--storage {storage}: {err}" if "--storage" not in str(err) else str(err)) from None


def _size_hint(nbytes: int) -> str:
    """A budget string parse_size accepts that is at least ``nbytes``."""
    unit, scale = ("GB", 1e9) if nbytes >= 1e9 else ("MB", 1e6)
    return f"{math.ceil(nbytes / scale * 10) / 10:g}{unit}"


def _budget_error(err, mode: str | None = None, prefetch: int | None = None) -> CliError:
    """The planner's BudgetError in command-line terms: the budget to pass, and each alternative the engine planned
    that lowers it (``err.alternatives``) where the command has the option (``mode`` or ``prefetch`` None: it has
    not)."""
    facts = err.facts
    from tritoff.advice import option_words

    hints = [f"--budget {_size_hint(err.minimum)} or more"]
    for option, (value, needed) in err.alternatives.items():
        if (prefetch is None and option != "mode") or (mode is None and option != "prefetch"):
            continue  # the command has no such option
        enough = "this budget" if needed <= err.budget else f"--budget {_size_hint(needed)} or more"
        if enough != hints[0]:  # not when it needs what the budget is rounded up to anyway
            hints.append(f"{option_words(option, value, flags=True)} (with {enough})")
    advice = hints[0] if len(hints) == 1 else ", ".join(hints[:-1]) + ", or " + hints[-1]
    return CliError(f"{facts}; pass {advice}")


def _print_rows(rows: dict) -> None:
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"  {key:<{width}}  {value}")


DEMO_VAE = {"temperal_downsample": [False, True, True]}  # the demo's VAE (tritoff.tiny), read before torch is imported
DEMO_MODELS = ("text_encoder", "transformer", "vae")  # the demo pipeline's components (tritoff.tiny.tiny_wan_pipeline)
# a pipeline class -> (the image-to-video class that loads the same directory, the model_index.json option that makes
# it one): Wan 2.2 TI2V-5B is published as a WanPipeline with a timestep per token, and makes a video from a first
# frame as a WanImageToVideoPipeline (diffusers' documented way)
IMAGE_VARIANTS = {"WanPipeline": ("WanImageToVideoPipeline", "expand_timesteps")}


def _cmd_demo(args) -> int:
    from tritoff.shapes import check_dimensions
    from tritoff.video import check_writable

    _check_budget(args.budget)
    check_writable(args.out)
    storage = _check_storage(args.storage, models=DEMO_MODELS)
    check_dimensions(DEMO_VAE, {}, "--", frames=args.frames)
    _check_device(args.device)
    _check_percentage(args.budget, args.device)
    _prepare_backend(args.device)

    from tritoff.demo import run_demo
    from tritoff.planner import BudgetError
    from tritoff.video import write_video

    packs = _packs_of(storage, args.storage)
    print(f"tritoff demo: a Wan pipeline built locally (random weights), {packs}, blocks streamed")
    try:
        frames, engine, psnr = run_demo(storage, args.budget, args.steps, args.device, frames=args.frames)
    except BudgetError as err:
        raise _budget_error(err) from None
    path = write_video(frames, args.out, fps=8)
    print(engine.report())
    print(f"\n  frames PSNR against the plain bf16 pipeline: {psnr:.1f} dB")
    print(f"  video: {path}")
    return 0


def _read_image(path: str):
    """``--image``: the RGB image at ``path`` as it is displayed (turned as its EXIF orientation says; 16-bit and
    float pixels scaled to 8 bits rather than clipped), or a one-line error."""
    import numpy as np
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened)
            if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):  # RGB would clip them to white
                values = np.asarray(image, dtype=np.float64)
                top = 1.0 if image.mode == "F" and values.max(initial=0) <= 1 else 255.0 if image.mode == "F" else 65535
                image = Image.fromarray(np.clip(values / top * 255 + 0.5, 0, 255).astype(np.uint8), mode="L")
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as err:
        raise CliError(f"--image {path}: cannot read it as an image ({one_line(err)})") from None


def _check_image(args, local: Path) -> str | None:
    """A prompted video pipeline (one whose call takes ``prompt`` and ``num_frames``), given ``--image`` when it makes
    a video from an image, and only then (read from ``local``'s model_index.json, before anything is loaded); returns
    the pipeline class to load (None: a class diffusers lacks,
    which loading names). A directory whose pipeline has an image-to-video variant (``IMAGE_VARIANTS``) loads as it
    when given an image."""
    import diffusers
    from transformers.utils import logging as transformers_logging

    index = _json(local / "model_index.json")
    name = index.get("_class_name")
    if isinstance(name, list) and len(name) == 2 and name[0] == "diffusers":  # diffusers' own, named as a module's
        name = name[1]
    if isinstance(name, list):  # [module, class]: a pipeline defined in the directory itself
        raise CliError(
            f"{local} names a custom pipeline ({name}): tritoff run loads diffusers' own pipelines; load it in "
            "Python (DiffusionPipeline.from_pretrained(..., custom_pipeline=...)) and call tritoff.enable(pipe)"
        )
    variant = IMAGE_VARIANTS.get(name) if isinstance(name, str) else None
    if args.image is not None and variant is not None and index.get(variant[1]) is True:
        name = variant[0]
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # importing the class: its processors' notices come with the load
    try:
        cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    finally:
        transformers_logging.set_verbosity(verbosity)
    if not isinstance(cls, type):
        return None  # a pipeline diffusers lacks: loading it says so
    takes = inspect.signature(cls.__call__).parameters
    for needed in ("prompt", "num_frames"):
        if needed not in takes:  # found after loading, packing and (an image pipeline) a whole denoising loop
            raise CliError(
                f"{name}'s call takes no {needed}: tritoff run runs prompted video pipelines (Wan, CogVideoX and "
                "the like); for this one, call tritoff.enable(pipe) in Python"
            )
    image = takes.get("image")
    # an image-to-video pipeline may give its image a default (None) that its call then refuses, after the load (a
    # text-and-image one, TI2V, takes either)
    named = "ImageToVideo" in name or ("I2V" in name and "TI2V" not in name)
    needs_image = image is not None and (image.default is inspect.Parameter.empty or named)
    if args.image is None and needs_image:
        raise CliError(f"{name} makes a video from an image: give --image PATH (its first frame)")
    if args.image is not None and image is None:
        raise CliError(f"{name} takes no image: leave --image out, or give an image-to-video pipeline")
    return name


def _packs_of(storage: str | dict, given: str) -> str:
    """How the demo's first line names what ``--storage given`` (checked: ``storage``) packs."""
    if isinstance(storage, dict):
        return f"weights in packs ({given})"
    return "weights in their own dtype" if storage in ("bf16", "fp16") else f"weights in {storage} packs"


def _check_model(model: str) -> Path:
    """A local pipeline directory, or something shaped like a hub id; else a one-line error."""
    local = Path(model)
    if local.is_file():
        raise CliError(f"{model} {_MODEL_IS_A_FILE}")
    if local.exists() and not (local / "model_index.json").is_file():
        raise CliError(f"{model} is not a diffusers pipeline directory (no model_index.json)")
    if not local.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise CliError(f"model {model!r} not found: give a local pipeline directory or a hub id like org/name")
    if local.is_dir():  # its configs read here, so one that cannot be read is named (the libraries' errors do not)
        index = _json(local / "model_index.json")
        pipeline = index.get("_class_name")
        # a diffusers class, or [module file, class] for a pipeline defined in the directory
        if not (isinstance(pipeline, str) and pipeline) and not _names_component(pipeline):
            what = "no _class_name" if pipeline is None else f"_class_name {pipeline!r}, which names no class"
            raise CliError(f"{local / 'model_index.json'} has {what}: give a diffusers pipeline directory")
        for name, spec in index.items():
            # [library, class]: a component saved in its own directory ([null, null]: none)
            if not name.startswith("_") and _names_component(spec) and not (local / name).is_dir():
                raise CliError(
                    f"{local / name} is missing: model_index.json lists {name} ({spec[0]} {spec[1]}); give the whole "
                    "pipeline directory"
                )
            for config in ("config.json", "scheduler_config.json"):
                if (local / name / config).is_file():
                    _json(local / name / config)
            named = not name.startswith("_") and _names_component(spec)
            weights = [f for p in ("*.safetensors", "*.bin") for f in (local / name).glob(p)] if named else []
            if weights and not (local / name / "config.json").is_file():
                raise CliError(
                    f"{local / name / 'config.json'} is missing: {name}'s weights ({weights[0].name}) need the config "
                    "their model is built from; give the whole pipeline directory"
                )
    return local


def _names_component(spec) -> bool:
    """Whether a model_index.json entry names a component: [library, class], two names ([null, null]: none)."""
    return isinstance(spec, list) and len(spec) == 2 and all(isinstance(part, str) and part for part in spec)


def _fetch(model: str) -> Path:
    """The Hugging Face cache's snapshot of the hub id ``model``, downloaded first when it is not all there."""
    from tritoff.convert import fetch_pipeline

    try:
        return fetch_pipeline(model)
    except OSError as err:
        raise CliError(str(err)) from None


def _json(path: Path) -> dict:
    """A pipeline's JSON file (model_index.json, a config), or a one-line error."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CliError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise CliError(f"{path} is not a JSON object")
    return data


def _check_dimensions(args, vae: dict, denoiser: dict) -> None:
    from tritoff.shapes import check_dimensions

    check_dimensions(vae, denoiser, "--", frames=args.frames, height=args.height, width=args.width)


def _local_configs(local: Path) -> tuple[dict, dict]:
    index = _json(local / "model_index.json")
    # an entry [library, class] names a component; [null, null] (left out when saved) or [] names none
    named = [n for n in ("transformer", "unet") if isinstance(index.get(n), list) and index[n] and index[n][0]]
    denoiser = named[0] if named else None
    configs = []
    for name in ("vae", denoiser):
        path = local / name / "config.json" if name else None
        configs.append(_json(path) if path is not None and path.is_file() else {})
    vae = index.get("vae")
    if "_class_name" not in configs[0] and _names_component(vae):  # diffusers loads it by the index's class
        configs[0]["_class_name"] = vae[1]
    return configs[0], configs[1]


def _load_pipeline(model: str, dtype, store: str | None, pipeline: str | None = None):
    """``DiffusionPipeline.from_pretrained`` with one-line errors; components held in ``store`` are built empty.
    ``pipeline``: the diffusers class to load it as (default: the one model_index.json names)."""
    import torch

    from tritoff.checkpoint import ConfigError
    from tritoff.convert import from_pretrained, load_error
    from tritoff.load_output import held_load_output

    local = _check_model(model)
    kwargs = {}
    with held_load_output() as held:
        try:
            if store is not None and local.exists():
                from tritoff.loading import stored_components, whole_dtypes

                kwargs = stored_components(local, store, dtype)  # the packs replace their weights: none is read
                dtype = whole_dtypes(store, kwargs, dtype)
            try:
                pipe = from_pretrained(model, dtype, pipeline=pipeline, **kwargs)
            except Exception as err:
                # diffusers names no file when a model's constructor refuses its config's values: find the file
                error = load_error(model, err, local)
                if error is None:
                    raise
                raise (error if isinstance(error, ConfigError) else CliError(str(error))) from None
            _check_loaded(pipe, local, kwargs)
        except ConfigError as err:  # its one line says what the libraries' reports would have
            held.drop()
            raise CliError(str(err)) from None
    if not any(isinstance(getattr(pipe, n, None), torch.nn.Module) for n in ("transformer", "unet")):
        raise CliError(f"{model} has no transformer or unet: tritoff runs diffusion pipelines")
    return pipe


def _check_loaded(pipe, local: Path, built: dict) -> None:
    """Refuse, naming its config (:class:`ConfigError`), a component diffusers left parameters of on the meta device
    (those its config builds but its checkpoint lacks), where ``enable`` would name no file; components in ``built``
    are meant to be empty."""
    import torch

    from tritoff.checkpoint import checkpoint_fault

    if not local.is_dir():
        return
    for name, component in pipe.components.items():
        if name in built or not isinstance(component, torch.nn.Module):
            continue
        if any(param.is_meta for param in component.parameters()):
            fault = checkpoint_fault(local / name, component, missing=True)
            if fault is not None:
                raise fault


def _check_store(args, local: Path) -> dict:
    """The store's index (structure, own hash), its fit with --storage and --mode, and, for a local model, that it
    was made from MODEL's weight files; all cheap, before torch is imported."""
    from tritoff.storage import resolve_storage
    from tritoff.store import component_storages, read_index, stored_compute_dtype

    index = read_index(args.store)
    if args.storage is not None:
        held = component_storages(index)
        try:
            wanted = resolve_storage(_check_storage(args.storage), dict.fromkeys(held))
        except ValueError as err:
            raise CliError(f"--storage {args.storage}: {err}") from None
        for name, fmt in held.items():
            if wanted[name] != fmt:
                raise CliError(
                    f"--storage {args.storage} but the store {args.store} holds {fmt} for {name}; drop --storage"
                )
    if args.mode is None:  # left out: the store's grouping says leaf or not
        args.mode = "leaf" if index["grouping"] == "leaf" else "auto"
    if (args.mode == "leaf") != (index["grouping"] == "leaf"):
        wanted = "--mode leaf" if index["grouping"] == "leaf" else "a --mode other than leaf"
        raise CliError(f"the store {args.store} was made with {index['grouping']} groups; pass {wanted}")
    converted = stored_compute_dtype(args.store)
    if converted is not None and converted != DTYPE_NAMES[args.dtype]:
        flag = next(k for k, v in DTYPE_NAMES.items() if v == converted)
        raise CliError(
            f"the store {args.store} was converted in {flag} and the pipeline would load in {args.dtype}: pass "
            f"--dtype {flag}, or convert again with --dtype {args.dtype}"
        )
    if local.is_dir():
        _check_store_source(args.store, local, index)
    return index


def _check_store_source(store: str, local: Path, index: dict) -> None:
    """The store was made from the pipeline directory ``local``'s weight files, for every component it has weights
    for (from the files: before anything loads)."""
    from tritoff.store import check_components, check_source

    check_source(store, local, index)
    listed = [name for name, spec in _json(local / "model_index.json").items() if _names_component(spec)]
    check_components(store, local, index, listed)


def _cmd_run(args) -> int:
    from tritoff.video import check_writable

    _check_budget(args.budget)
    _check_reserve(args.reserve)
    if args.host_budget is not None:
        from tritoff.budget import parse_host_budget

        parse_host_budget(args.host_budget, what="--host-budget")
    _check_spill_dir(args)
    check_writable(args.out)
    local = _check_model(args.model)
    _check_storage(args.storage, local)
    image = _read_image(args.image) if args.image is not None else None
    if local.is_dir():
        _check_dimensions(args, *_local_configs(local))
    index = _check_store(args, local) if args.store else None
    args.mode = args.mode or "auto"
    _check_device(args.device)
    _check_percentage(args.budget, args.device)
    _prepare_backend(args.device)
    if not local.is_dir():  # a hub id: everything below reads its snapshot, as it reads a local directory
        local = _fetch(args.model)
        _check_storage(args.storage, local)
        _check_dimensions(args, *_local_configs(local))
        if index is not None:
            _check_store_source(args.store, local, index)
    pipeline = _check_image(args, local)  # it imports diffusers, which imports triton: after the backend is chosen

    import torch

    import tritoff
    from tritoff.planner import BudgetError
    from tritoff.report import host_rss
    from tritoff.store import verify_store
    from tritoff.video import write_video

    start = time.perf_counter()
    if index is not None:
        # every pack is read at enable without a host budget: hash the files whole now, before the slow pipeline load
        # (load_store does not hash these unchanged files again); with one, packs are checked as they are read
        verify_store(args.store, index, progress=True, full=args.host_budget is None)
    pipe = _load_pipeline(str(local), getattr(torch, DTYPE_NAMES[args.dtype]), args.store, pipeline)
    print(f"tritoff: enabling ({'reading the store' if args.store else 'packing'}, then placing the weights)")
    try:
        engine = tritoff.enable(
            pipe,
            _check_storage(args.storage),
            mode=args.mode,
            budget=args.budget,
            device=args.device,
            store=args.store,
            prefetch=args.prefetch,
            reserve=args.reserve,
            transport=args.transport,
            host_budget=args.host_budget,
            spill_dir=args.spill_dir,
        )
    except BudgetError as err:
        raise _budget_error(err, args.mode, args.prefetch) from None
    except torch.OutOfMemoryError:
        raise CliError(
            f"{args.device or 'the GPU'} ran out of memory while tritoff placed the weights (other processes may hold "
            "some of it: nvidia-smi); pass a smaller --budget"
        ) from None
    startup = time.perf_counter() - start
    rss = host_rss()
    call = dict(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=torch.Generator().manual_seed(args.seed),
        output_type="pt",
    )
    for key in ("num_frames", "height", "width"):
        if getattr(args, key.replace("num_", "")) is not None:
            call[key] = getattr(args, key.replace("num_", ""))
    if image is not None:
        call["image"] = image
    tokens = getattr(getattr(pipe, "transformer", None), "config", {}).get("max_text_seq_length")
    if tokens and "max_sequence_length" in inspect.signature(pipe.__call__).parameters:
        call["max_sequence_length"] = tokens  # CogVideoX: the prompt its transformer is made for (226 as published)
    pipe.set_progress_bar_config(desc="denoising")
    try:
        frames = pipe(**call).frames
    except torch.OutOfMemoryError:
        raise CliError(
            "the GPU ran out of memory while generating: the activations of this size need more room than the budget "
            "leaves; pass a smaller --budget (or --reserve more), or fewer --frames, or a smaller --height/--width"
        ) from None
    path = write_video(frames, args.out, fps=args.fps)
    print(engine.report())
    source = f" from store {args.store}" if args.store else ""
    memory = f"{rss / 2**20:.0f} MiB" if rss else "n/a"
    print(f"\n  startup (load + enable): {startup:.2f} s{source}, host RSS after enable: {memory}")
    print(f"  video: {path}")
    return 0


def _cmd_convert(args) -> int:
    from tritoff.partial import left_behind, real_target
    from tritoff.skip import skip_patterns
    from tritoff.store import check_target

    local = _check_model(args.model)
    _check_storage(args.storage, local)
    for pattern in args.skip:
        try:
            re.compile(pattern)
            skip_patterns(pattern)  # an empty one, which would match every module
        except re.error as err:
            raise CliError(f"--skip {pattern!r} is not a valid regular expression: {err}") from None
        except ValueError as err:
            raise CliError(f"--skip {pattern!r}: {err}") from None
    target = check_target(args.out_dir, args.overwrite, model=local)  # after the arguments: none needs another try
    real = real_target(target)
    parent = real.parent if str(real.parent) else Path(".")
    removed = left_behind(real)  # the conversion removes these
    for stale in removed:
        say(f"tritoff: removing {stale}, left by an interrupted conversion")
    name = glob.escape(real.name)
    for stale in sorted(parent.glob(f".{name}.*.partial")) + sorted(parent.glob(f".{name}.*.old")):
        # left by a conversion that was killed (SIGKILL, power loss) on another host, or while replacing a store
        if stale in removed:
            continue
        if stale.suffix == ".old" and not real.exists():  # killed between moving the old store aside and the new in
            advice = f"it holds the store a conversion was replacing: if none runs, move it back to {real}"
        else:
            advice = "delete it if none runs"
        say(f"tritoff: note: {stale} is from another conversion of this store; {advice}")
    _prepare_backend(None)
    if not local.is_dir():  # a hub id: read from its snapshot group by group, as a local directory is
        local = _fetch(args.model)
        _check_storage(args.storage, local)

    import torch

    from tritoff.convert import convert_pipeline
    from tritoff.storage import describe_storage

    packed = convert_pipeline(
        str(local),
        args.out_dir,
        _check_storage(args.storage),
        args.granularity,
        tuple(args.skip),
        "leaf" if args.mode == "leaf" else "block",
        dtype=getattr(torch, DTYPE_NAMES[args.dtype]),
        overwrite=args.overwrite,
    )
    total = sum(p.layout_bytes for p in packed.values())
    storage = describe_storage({name: p.storage.name for name, p in packed.items()})
    print(f"wrote {args.out_dir}: {len(packed)} components, {total / 2**20:.1f} MiB of packs ({storage})")
    return 0


def _cmd_bench(args) -> int:
    bench = Path(__file__).resolve().parent.parent / "bench"
    script = bench / f"{args.which}.py"
    if not script.is_file():
        raise CliError(f"{script} not found: the benchmarks ship with the source tree; run from a checkout")
    return subprocess.call([sys.executable, str(script), *args.rest], cwd=bench.parent)


def _cmd_plan(args) -> int:
    from tritoff.budget import parse_rate

    for what in ("budget", "host_budget", "link", "disk"):
        value = getattr(args, what)
        if value is not None and value.strip().endswith("%"):
            raise CliError(f"--{what.replace('_', '-')}: give bytes (e.g. 12GB), not a percentage")
        if what in ("link", "disk"):
            try:
                parse_rate(value, what)
            except ValueError:
                example = "25GB" if what == "link" else "2GB"
                raise CliError(f"--{what} {value}: give bytes per second, e.g. {example} or {example}/s") from None
        elif what != "host_budget":
            _check_budget(value, what.replace("_", " "), percent=False)
    from tritoff.budget import parse_host_budget
    from tritoff.presets import PRESETS, vae_shapes

    parse_host_budget(args.host_budget, what="--host-budget", percent=False)
    # the model and its dimensions from configs alone, before torch and diffusers are imported (seconds)
    if args.model in PRESETS:
        _check_dimensions(args, vae_shapes(args.model), PRESETS[args.model].transformer)
    elif Path(args.model).is_dir():
        if not (Path(args.model) / "model_index.json").is_file():
            raise CliError(
                f"{args.model} has no model_index.json: give a diffusers pipeline directory or a preset name"
            )
        _check_dimensions(args, *_local_configs(Path(args.model)))
    elif Path(args.model).is_file():
        raise CliError(f"{args.model} {_MODEL_IS_A_FILE}")
    else:
        raise CliError(f"{args.model} is neither a local pipeline directory nor a preset ({', '.join(PRESETS)})")
    import tritoff

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' dtype advice for models built on the meta device
        preview = tritoff.plan(
            args.model,
            args.budget,
            host_budget=args.host_budget,
            frames=args.frames,
            height=args.height,
            width=args.width,
            steps=args.steps,
            storage=_check_storage(args.storage),
            mode=args.mode,
            prefetch=args.prefetch,
            link=args.link,
            disk=args.disk,
            vae_tiling=args.vae_tiling,
            progress=True,
        )
    print(preview.json() if args.json else preview.text(flags=True))
    return 0 if preview.feasible else 1  # a script can ask before it downloads


def _cmd_info(args) -> int:
    _prepare_backend(None)
    import torch

    import tritoff
    from tritoff.kernels import has_triton, interpreting, native_fp8

    rows = {"tritoff": tritoff.__version__, "torch": torch.__version__}
    if has_triton():
        import triton

        rows["triton"] = triton.__version__
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        rows["device"] = f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})"
        rows["fp8 conversion"] = "native" if native_fp8("cuda") else "from uint8 bits (compute capability < 8.9)"
        rows["kernels"] = "Triton" if has_triton() else "PyTorch reference (triton not installed)"
        rows["transport"] = (
            "staged (what auto picks): copy engine DMA, then upcast in HBM (leaves SMs to compute); "
            "--transport zero_copy: a kernel reads host memory"
        )
        from tritoff import allocator

        conf = allocator.configured()
        if allocator.fragments(conf):
            rows["allocator"] = f"{conf or 'default'}: fixed segments fragment at video shapes, set "
            rows["allocator"] += f"PYTORCH_CUDA_ALLOC_CONF={allocator.EXPANDABLE}"
        elif allocator.set_by_command:
            rows["allocator"] = f"{conf} (set by the tritoff command; set it for your own Python processes too)"
        else:
            rows["allocator"] = conf
    else:
        rows["device"] = "cpu (no CUDA): packs and upcasts, offloads nothing"
        rows["kernels"] = "Triton interpreter" if has_triton() and interpreting() else "PyTorch reference"
        rows["transport"] = "none (no CUDA): packs are upcast from host memory in place"
    _print_rows(rows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tritoff`` command."""
    kw = dict(formatter_class=_Formatter)
    parser = OneLineParser(prog="tritoff", description="Run large diffusion video models on small GPUs.", **kw)
    parser.add_argument("--version", action="version", version=f"tritoff {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a small locally built Wan pipeline through tritoff; write the video", **kw)
    demo.add_argument("--storage", default="fp8_e4m3", help=STORAGE_HELP)
    demo.add_argument("--budget", default=None, help="GPU memory budget (default: 1.2x the smallest that works)")
    demo.add_argument("--steps", type=at_least(1, LIMITS["steps"]), default=4, help="denoising steps")
    demo.add_argument("--frames", type=at_least(1, LIMITS["frames"]), default=9, help="frames to generate")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    demo.add_argument("--out", type=_path, default="tritoff-demo.mp4", help="video path, .mp4 or .gif")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser("run", help="generate a video with a diffusers pipeline (local directory or hub id)", **kw)
    run.add_argument("model", type=_path, help="a local diffusers pipeline directory or a hub id")
    run.add_argument("--prompt", required=True, help="what to generate")
    run.add_argument("--negative-prompt", default=None, help="what to steer away from (default: none)")
    run.add_argument("--image", type=_path, default=None, help="the first frame, for an image-to-video pipeline")
    run.add_argument(
        "--budget",
        default=None,
        help="e.g. 12GB, 12GiB, 80%% (default: the GPU's free memory less 5%% of it or 512 MiB, whichever is more)",
    )
    run.add_argument("--storage", default=None, help=f"{STORAGE_HELP} (default: fp8_e4m3, or the store's)")
    run.add_argument(
        "--mode",
        default=None,
        choices=MODES,
        help="how components are split (default: auto, or leaf with a store of leaf groups; see docs/usage.md)",
    )
    run.add_argument("--prefetch", type=at_least(1), default=2, help="blocks in flight ahead of the running one")
    run.add_argument(
        "--reserve",
        default=None,
        help="GPU memory kept for activations, e.g. 2GB or 25%% of the budget (default: traced per phase)",
    )
    run.add_argument("--transport", default="auto", choices=TRANSPORTS, help="how streamed packs reach the GPU")
    run.add_argument("--steps", type=at_least(1, LIMITS["steps"]), default=30, help="denoising steps")
    run.add_argument(
        "--frames",
        type=at_least(1, LIMITS["frames"]),
        default=None,
        help="frames to generate (default: the pipeline's)",
    )
    run.add_argument("--height", type=at_least(1, LIMITS["height"]), default=None, help="(default: the pipeline's)")
    run.add_argument("--width", type=at_least(1, LIMITS["width"]), default=None, help="(default: the pipeline's)")
    run.add_argument("--seed", type=_seed, default=0, help="random seed of the initial noise")
    run.add_argument("--guidance", type=_finite, default=5.0, help="classifier-free guidance scale")
    run.add_argument("--fps", type=at_least(1, MAX_FPS), default=16, help="frames per second of the video")
    run.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default="bf16", help="the pipeline's compute dtype")
    run.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    run.add_argument("--out", type=_path, default="video.mp4", help="video path, .mp4 or .gif")
    run.add_argument(
        "--store", type=_path, default=None, help="a store written by `tritoff convert` (read, not re-quantized)"
    )
    run.add_argument(
        "--host-budget",
        default=None,
        help="host memory the packs may hold, e.g. 10GB or 50%% of RAM; the rest are read from disk (default: all)",
    )
    run.add_argument(
        "--spill-dir",
        type=_path,
        default=None,
        help="without --store: where packs beyond --host-budget are written (default: $XDG_CACHE_HOME/tritoff, else "
        "~/.cache/tritoff)",
    )
    run.set_defaults(func=_cmd_run)

    convert = sub.add_parser(
        "convert",
        help="quantize a pipeline once and save its packs as a store",
        # --skip takes every word after it, the store's directory too
        hints={"required: out_dir": "a --skip before it reads it as a pattern: put --skip last, or write --skip=REGEX"},
        **kw,
    )
    convert.add_argument("model", type=_path, help="a local diffusers pipeline directory or a hub id")
    convert.add_argument(
        "out_dir", type=_path, help="the store's directory: new, empty, or a store to replace with --overwrite"
    )
    convert.add_argument("--storage", default="fp8_e4m3", help=STORAGE_HELP)
    convert.add_argument(
        "--granularity",
        default="row",
        choices=("row", "tensor", "none"),
        help="one fp8 scale per row or tensor, or none",
    )
    convert.add_argument("--skip", nargs="+", default=[], help="extra regexes of module names to keep unquantized")
    convert.add_argument("--mode", default="group", choices=("group", "leaf"), help="grouping of the packs")
    convert.add_argument(
        "--dtype",
        choices=tuple(DTYPE_NAMES),
        default="bf16",
        help="the dtype the pipeline runs in (tritoff run --dtype)",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace the store already in OUT_DIR")
    convert.set_defaults(func=_cmd_convert)

    from tritoff.presets import PRESETS  # configs only: no torch

    preview = sub.add_parser(
        "plan", help="what a pipeline needs at a budget and video shape, from its configs alone (nothing read)", **kw
    )
    preview.add_argument(
        "model",
        type=_path,
        help=f"a local diffusers pipeline directory, or {', '.join(PRESETS)}",
    )
    preview.add_argument("--budget", default="12GB", help="GPU memory budget")
    preview.add_argument(
        "--host-budget", default=None, help="host memory the packs may hold; the rest is read from disk (default: all)"
    )
    preview.add_argument("--frames", type=at_least(1, LIMITS["frames"]), default=81, help="frames to generate")
    preview.add_argument("--height", type=at_least(1, LIMITS["height"]), default=480, help="video height")
    preview.add_argument("--width", type=at_least(1, LIMITS["width"]), default=832, help="video width")
    preview.add_argument("--steps", type=at_least(1, LIMITS["steps"]), default=50, help="denoising steps")
    preview.add_argument("--storage", default="fp8_e4m3", help=STORAGE_HELP)
    preview.add_argument("--mode", default="auto", choices=MODES, help="how components are split")
    preview.add_argument("--prefetch", type=at_least(1), default=2, help="blocks in flight ahead of the running one")
    preview.add_argument("--link", default="25GB", help="host-to-GPU bytes per second (25GB/s), for transfer times")
    preview.add_argument("--disk", default="2GB", help="disk read bytes per second, for --host-budget's read times")
    preview.add_argument("--vae-tiling", action="store_true", help="decode in tiles (pipe.vae.enable_tiling())")
    preview.add_argument("--json", action="store_true", help="print the plan as JSON")
    preview.set_defaults(func=_cmd_plan)

    bench = sub.add_parser("bench", help="run a benchmark of bench/ (kernels, e2e, quality)", **kw)
    bench.add_argument("which", choices=("kernels", "e2e", "quality"), help="which benchmark")
    rest = bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the script (e.g. --smoke)")
    rest.required = False  # none is fine: argparse would name it among the missing ones
    bench.set_defaults(func=_cmd_bench)

    info = sub.add_parser("info", help="versions, device, and which kernel path and transport will be used", **kw)
    info.set_defaults(func=_cmd_info)
    return parser


# options whose value may start with a dash: argparse reads "--budget -1GB" or "--negative-prompt '-blurry, dark'" as
# an option missing its value ("expected one argument") where the value is what was meant
_DASH_VALUES = (
    *("--budget", "--host-budget", "--reserve", "--link", "--disk", "--prompt", "--negative-prompt"),
    *("--image", "--out", "--store", "--spill-dir"),  # paths: a file may be named -x.png
)


def attach_dash_values(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``argv`` with each value starting with a dash that follows one of the options that take it written as
    ``--option=value``, which argparse reads as that option's value: a negative size (refused by its own check, which
    says what to give), a prompt or a path starting with a dash. The option may be abbreviated as argparse allows
    (``--neg``: the one option of its command starting so). A value that is an option (``-h``, ``--steps``) or ``--``
    stays what it is, and so does what follows ``--`` and what ``tritoff bench`` hands to its script."""
    command = next((token for token in argv if not token.startswith("-")), None)
    if command == "bench":
        return list(argv)
    options = _long_options(parser or build_parser(), command)
    out, tokens = [], iter(argv)
    for token in tokens:
        if token == "--":  # the rest are positional arguments
            return [*out, token, *tokens]
        value = next(tokens, None) if _full_option(token, options) in _DASH_VALUES else None
        if value is None:
            out.append(token)
        elif value.startswith("-") and not re.fullmatch(r"-h|--|--[A-Za-z][\w-]*(=.*)?", value, re.DOTALL):
            out.append(f"{token}={value}")
        else:
            out.extend((token, value))
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each of ``parser``'s commands, by name."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _long_options(parser: argparse.ArgumentParser, command: str | None) -> list[str]:
    """The long options ``command`` takes (none for a command ``parser`` does not know)."""
    sub = _subparsers(parser).get(command)
    return [o for o in sub._option_string_actions if o.startswith("--")] if sub is not None else []


def _full_option(token: str, options: list[str]) -> str | None:
    """The option ``token`` names: itself, or the one option it abbreviates (None where it names none or several)."""
    if token in options:
        return token
    matches = [o for o in options if token.startswith("--") and len(token) > 2 and o.startswith(token)]
    return matches[0] if len(matches) == 1 else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tritoff`` console script: parse ``argv`` (default: the process's) and run its command
    (:func:`tritoff.console.run_command`); returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(attach_dash_values(sys.argv[1:] if argv is None else argv, parser))
    if unknown:  # said by the command's own parser, whose --help lists the options it takes
        _subparsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(args.func, args)


def entry() -> None:
    """The ``tritoff`` console script: :func:`main`, then exit with its code, without Python's teardown of the modules
    it loaded. An interrupt before or after the command exits 130 with one line (none after "tritoff: interrupted")."""
    exit_on_interrupt()  # run_command puts it back once the command has ended
    prefer_expandable_segments()  # before torch starts CUDA: a budget holds only if the allocator does not fragment
    exit_after(main())


if __name__ == "__main__":
    entry()

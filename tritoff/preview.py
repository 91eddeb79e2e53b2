"""``tritoff.plan``: what a pipeline needs at a given budget and video shape, from its configs alone.

The components are built on the meta device (no weight is read, nothing is allocated), grouped and laid out exactly as
``tritoff.enable`` would, and each phase's activation peak is traced from the call the pipeline makes for the asked
shape (see ``tritoff/activations.py``). The planner then places every phase within the budget, as enable does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map
from tqdm.auto import tqdm

from tritoff.activations import meta_twin, reserve_bytes
from tritoff.advice import alternatives, clauses
from tritoff.budget import format_bytes, parse_host_budget, parse_rate, parse_size
from tritoff.experts import expert_steps
from tritoff.fingerprint import fingerprint
from tritoff.groups import is_host
from tritoff.host_default import host_by_default
from tritoff.planner import BudgetError, fit_together, mode_label
from tritoff.planner import plan as phase_plan
from tritoff.shapes import LIMITS, check_dimensions, latent_channels, positive_int, spatial_scale, temporal_multiple

# the call a pipeline makes per component, by family: prompt tokens, CFG as separate calls (Wan) or one batch of two
# (CogVideoX), the latent layout, and the VAE's temporal and spatial compression where its config does not say them
FAMILIES = {
    "wan": dict(tokens=512, cfg_batch=1, channels_first=True, temporal=4, spatial=8),
    "cogvideox": dict(tokens=226, cfg_batch=2, channels_first=False, temporal=4, spatial=8),
}
PIPELINE_FAMILIES = {
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan",
    "CogVideoXPipeline": "cogvideox",
    "CogVideoXImageToVideoPipeline": "cogvideox",
}
# the pipelines that encode a conditioning image with the VAE before denoising
IMAGE_TO_VIDEO = {"WanImageToVideoPipeline", "CogVideoXImageToVideoPipeline"}
# what model_index.json holds beside the components: the pipeline's own options
PIPELINE_OPTIONS = ("boundary_ratio", "expand_timesteps")
# the image tokens Wan 2.1 I2V's transformer attends to when the pipeline has no image encoder to size them: CLIP
# ViT-H/14's 16 x 16 patches and its class token
IMAGE_TOKENS = 257


class PipelineCalls(NamedTuple):
    """How a pipeline calls its components, beyond what their configs say."""

    expand_timesteps: bool = False  # a timestep per token (Wan 2.2 TI2V)
    image_to_video: bool = False  # the VAE encodes the conditioning image (or video) first
    # Wan 2.2: the first expert takes the steps whose timestep is at least this share of the train timesteps
    boundary_ratio: float | None = None
    scheduler: object | None = None  # the pipeline's scheduler (diffusers), to place the steps on the experts


class Call(NamedTuple):
    """One call a pipeline makes of a component: ``getattr(module, method)(*args, **kwargs)``."""

    method: str
    args: tuple
    kwargs: dict


@dataclass
class PhasePreview:
    """One phase of the preview: what it holds, streams and needs."""

    components: list[str]
    mode: str
    tiers: dict[str, int]
    gpu_peak_bytes: int
    activation_bytes: int
    resident_bytes: int
    streamed_bytes_per_call: int
    calls_per_run: int
    entry_bytes: int
    disk_bytes_per_call: int = 0  # streamed blocks the host budget leaves on disk, read every call
    disk_entry_bytes: int = 0  # of the entry bytes, those read from disk

    def as_dict(self) -> dict:
        """JSON-ready fields."""
        return dict(self.__dict__)

    @property
    def disk_bytes_per_run(self) -> int:
        """Bytes read from disk per pipeline call."""
        return self.disk_bytes_per_call * self.calls_per_run + self.disk_entry_bytes


@dataclass
class Preview:
    """What :func:`plan` returns; ``text()`` is what ``tritoff plan`` prints."""

    model: str
    budget: int
    feasible: bool
    minimum_budget: int
    host_bytes: int
    host_budget: int | None
    link_bytes_per_s: float
    shape: dict
    phases: list[PhasePreview] = field(default_factory=list)
    reason: str = ""
    # when it does not fit: a lower prefetch or another mode that lowers the smallest budget, {option: (value,
    # minimum)} (tritoff.advice)
    alternatives: dict = field(default_factory=dict)
    host_held_bytes: int | None = None  # packs the host budget holds (None: no host budget, all of them)
    disk_bytes_per_s: float | None = None
    # components whose call could not be traced on the meta device, and why: their activations are unknown (not
    # counted), so the plan cannot say that it fits
    untraced: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The object ``tritoff plan --json`` prints."""
        return {
            "model": self.model,
            "feasible": self.feasible,
            "budget": self.budget,
            "minimum_budget": self.minimum_budget,
            "host_bytes": self.host_bytes,
            "host_budget": self.host_budget,
            "host_held_bytes": self.host_held_bytes,
            "disk_bytes_per_run": sum(p.disk_bytes_per_run for p in self.phases),
            "link_bytes_per_s": self.link_bytes_per_s,
            "disk_bytes_per_s": self.disk_bytes_per_s,
            "shape": self.shape,
            "reason": self.reason,
            "alternatives": {option: list(pair) for option, pair in self.alternatives.items()},
            "untraced": dict(self.untraced),
            "phases": [  # an untraced call's activations are unknown: null, not the 0 the plan counted
                {**p.as_dict(), **({"activation_bytes": None} if set(p.components) & set(self.untraced) else {})}
                for p in self.phases
            ],
        }

    def json(self) -> str:
        """:meth:`as_dict` as indented JSON."""
        return json.dumps(self.as_dict(), indent=2)

    def text(self, flags: bool = False) -> str:
        """A readable table: one row per phase, then host memory and the verdict; ``flags``: the options that would
        lower the smallest budget named as the command line spells them (``--mode leaf``, not ``mode='leaf'``)."""
        s = self.shape
        units = "layers" if any(p.mode == "leaf" for p in self.phases) else "blocks"
        lines = [
            f"{self.model}: {s['frames']} frames at {s['height']}x{s['width']}, {s['steps']} steps, budget "
            f"{format_bytes(self.budget)}, link {self.link_bytes_per_s / 1e9:.0f} GB/s",
            f"  {'phase':<16}{'mode':<10}{units + ' bf16/fp8/stream':>24}{'activations':>13}{'GPU peak':>12}"
            f"{'streamed/call':>15}{'calls':>7}{'transfer/run':>14}",
        ]
        for p in self.phases:
            tiers = "/".join(str(p.tiers.get(t, 0)) for t in ("bf16", "fp8", "stream")) if p.tiers else "-"
            seconds = (p.streamed_bytes_per_call * p.calls_per_run + p.entry_bytes) / self.link_bytes_per_s
            untraced = any(name in self.untraced for name in p.components)
            activations = "unknown" if untraced else format_bytes(p.activation_bytes)
            lines.append(
                f"  {', '.join(p.components):<16}{p.mode:<10}{tiers:>24}{activations:>13}"
                f"{format_bytes(p.gpu_peak_bytes):>12}{format_bytes(p.streamed_bytes_per_call):>15}"
                f"{p.calls_per_run:>7}{seconds:>13.1f}s"
            )
        host = f"host memory for the packs: {format_bytes(self.host_bytes)}"
        if self.host_budget is not None and self.host_held_bytes is not None:
            disk = {", ".join(p.components): p.disk_bytes_per_run for p in self.phases if p.disk_bytes_per_run}
            read = ", ".join(f"{name} {format_bytes(n)}" for name, n in disk.items()) or "nothing"
            seconds = sum(disk.values()) / self.disk_bytes_per_s
            host += (
                f"; host budget {format_bytes(self.host_budget)} holds {format_bytes(self.host_held_bytes)}, the rest "
                f"is read from disk: per run {read} ({seconds:.0f} s at {format_bytes(self.disk_bytes_per_s)}/s, "
                "overlapping compute)"
            )
        elif self.host_budget is not None:
            host += f"; host budget {format_bytes(self.host_budget)}"
        lines.append("  " + host)
        verdict = "fits" if self.feasible else f"does not fit: {self.reason}"
        smallest = f"the smallest GPU budget that fits is {format_bytes(self.minimum_budget, up=True)}"
        if self.untraced:
            smallest += f" plus the activations of {', '.join(self.untraced)}"
        lines.append("  " + "; ".join([verdict, smallest, *clauses(self.alternatives, self.budget, flags)]))
        return "\n".join(lines)


def _load_directory(path: Path) -> tuple[str, dict[str, nn.Module], str, PipelineCalls]:
    """(family, meta components, pipeline class, how it calls them) of a local diffusers pipeline directory, from its
    configs."""
    from tritoff.convert import build_from_config
    from tritoff.presets import as_loaded

    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ValueError(f"{path} has no model_index.json: give a diffusers pipeline directory or a preset name")
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{index_file} cannot be read ({err}): give a diffusers pipeline directory") from None
    if not isinstance(index, dict):
        raise ValueError(f"{index_file} is not a pipeline index (a JSON object): give a diffusers pipeline directory")
    pipeline = index.get("_class_name", "")
    family = PIPELINE_FAMILIES.get(pipeline)
    if family is None:
        raise ValueError(
            f"tritoff plan knows the calls of {', '.join(PIPELINE_FAMILIES)}, not {pipeline or 'this pipeline'}"
        )
    components = {}
    for name, spec in index.items():
        if name.startswith("_") or name in PIPELINE_OPTIONS or not isinstance(spec, list) or spec == [None, None]:
            continue  # a pipeline option (boundary_ratio), or an optional component left out
        if name == "scheduler":  # no weights: read for Wan 2.2's experts only, where it can be (_scheduler)
            continue
        if len(spec) != 2 or not all(isinstance(part, str) and part for part in spec):
            raise ValueError(
                f"{index_file}: {name} is {spec!r}, not [library, class]: give a diffusers pipeline directory"
            )
        library, class_name = spec
        if library not in ("diffusers", "transformers"):
            raise ValueError(
                f"{index_file}: {name} comes from {library}; tritoff plan builds diffusers and transformers models"
            )
        module = __import__(library, fromlist=[class_name])
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ValueError(
                f"{index_file}: {name} is a {library}.{class_name}, which {library} {module.__version__} does not "
                f"have: upgrade {library}"
            )
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):  # a scheduler, a tokenizer: no weights
            continue
        if not (path / name / "config.json").is_file():
            raise ValueError(f"{path / name / 'config.json'} is missing: the plan needs every model's config")
        built = build_from_config(path / name, library, cls)
        if isinstance(built, nn.Module):
            components[name] = as_loaded(built, torch.bfloat16)  # as ``tritoff run`` loads it
    boundary = index.get("boundary_ratio")
    if boundary is not None and not isinstance(boundary, (int, float)):  # the pipeline multiplies it: 1000 * "0.5"
        raise ValueError(f"{index_file}: boundary_ratio is {boundary!r}, not a number: the pipeline cannot run with it")
    calls = PipelineCalls(
        expand_timesteps=index.get("expand_timesteps") is True,
        image_to_video=pipeline in IMAGE_TO_VIDEO,
        # as the pipeline compares it: any number, even one no timestep reaches (1.5: every step on the second)
        boundary_ratio=None if boundary is None else float(boundary),
        scheduler=_scheduler(path, index.get("scheduler")),
    )
    return family, components, pipeline, calls


def _scheduler(path: Path, spec):
    """The pipeline's diffusers scheduler, from its config; None where it cannot be built (its steps on Wan 2.2's
    experts are then placed as by a flow-matching scheduler without shift)."""
    import diffusers

    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] == "diffusers" and isinstance(spec[1], str)):
        return None
    cls = getattr(diffusers, spec[1], None)
    try:
        return cls.from_config(cls.load_config(path / "scheduler"))
    except Exception:  # a scheduler diffusers does not have, a config missing or broken: only the split is lost
        return None


def _geometry(family: str, components: dict[str, nn.Module], calls: PipelineCalls | None = None) -> dict:
    """What the pipeline's calls take, from the VAE's and the denoiser's configs (the family's where they say nothing):
    the prompt's tokens, the VAE's time and space compression, the channels its decode takes and those the denoiser
    takes (more where conditioning latents are concatenated), the denoiser's patch in frames (CogVideoX 1.5's 2: the
    pipeline pads the latent frames to it) and space, the image encoder's input size and the tokens it gives, and
    from ``calls`` whether each token gets its own timestep (Wan 2.2 TI2V) and whether the VAE encodes an image
    first."""
    f = FAMILIES[family]
    calls = calls or PipelineCalls()
    vae = dict(components["vae"].config) if "vae" in components else {}
    denoiser = components.get("transformer")
    config = dict(denoiser.config) if denoiser is not None else {}
    channels = latent_channels(vae) or 16
    patch = config.get("patch_size") or 1
    if isinstance(patch, (list, tuple)):  # Wan: (frames, height, width); fewer: the leading ones are 1
        patch = (1, 1, 1, *patch)[-3:]
    else:
        patch = (config.get("patch_size_t") or 1, patch, patch)
    image = getattr(components.get("image_encoder"), "config", None)  # a transformers config (CLIP vision)
    image_size, image_patch = (positive_int(getattr(image, key, None)) for key in ("image_size", "patch_size"))
    return dict(
        tokens=positive_int(config.get("max_text_seq_length")) or f["tokens"],  # CogVideoX's: 226
        temporal=temporal_multiple(vae) or f["temporal"],
        spatial=spatial_scale(vae) or f["spatial"],
        vae_channels=channels,
        denoiser_channels=positive_int(config.get("in_channels")) or channels,
        patch=tuple(positive_int(n) or 1 for n in patch),
        expand_timesteps=calls.expand_timesteps,
        image_to_video=calls.image_to_video,
        image_size=image_size or 224,
        image_embeds=bool(positive_int(config.get("image_dim"))),
        # the hidden states the pipeline takes from the image encoder: a token per patch and the class token
        image_tokens=(image_size // image_patch) ** 2 + 1 if image_size and image_patch else IMAGE_TOKENS,
    )


def _latent(geometry: dict, channels: int, channels_first: bool, frames, height, width, batch, dtype) -> torch.Tensor:
    """The latents of ``frames`` latent frames of ``height`` x ``width`` pixels."""
    shape = (batch, channels, frames, height // geometry["spatial"], width // geometry["spatial"])
    if not channels_first:
        shape = (shape[0], shape[2], shape[1], shape[3], shape[4])
    return torch.empty(shape, dtype=dtype, device="meta")


def _shapes(tree) -> str:
    """``tree`` (a call's arguments) with every tensor as its shape and dtype: what a meta trace depends on."""
    return repr(tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, tree))


def _calls(
    family: str, geometry: dict, name: str, module: nn.Module, frames: int, height: int, width: int
) -> tuple[list[Call], int, bool]:
    """(the calls the pipeline makes of a component, how many per step or per pipeline call, whether it is called
    every step)."""
    f = FAMILIES[family]
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():  # the compute dtype: most of the weights (a few modules may be kept in fp32)
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    dtype = max(counts, key=counts.get)
    if name.startswith("text_encoder"):
        ids = torch.zeros(1, geometry["tokens"], dtype=torch.long, device="meta")
        return [Call("forward", (), dict(input_ids=ids, attention_mask=torch.ones_like(ids)))], 2, False
    if name.startswith("image_encoder"):
        if not geometry["image_embeds"]:  # the pipeline embeds the image only for a denoiser that takes it (Wan 2.1)
            return [], 0, False
        # the image processor's pixels (fp32: the encoder casts them), the hidden states of every layer asked for
        size = geometry["image_size"]
        pixels = torch.empty(1, 3, size, size, dtype=torch.float32, device="meta")
        return [Call("forward", (), dict(pixel_values=pixels, output_hidden_states=True))], 1, False
    latent_frames = (frames - 1) // geometry["temporal"] + 1
    if name.startswith("vae"):
        # decode takes channels first in both families
        latent = _latent(geometry, geometry["vae_channels"], True, latent_frames, height, width, 1, dtype)
        decode = Call("decode", (latent,), dict(return_dict=False))
        if not geometry["image_to_video"]:
            return [decode], 1, False
        # image to video: the RGB image encoded first, as one frame (CogVideoX, Wan 2.2 TI2V) or as the first of a
        # video of zeros (Wan)
        one_frame = family == "cogvideox" or geometry["expand_timesteps"]
        video = torch.empty(1, 3, 1 if one_frame else frames, height, width, dtype=dtype, device="meta")
        return [Call("encode", (video,), {}), decode], 2, False
    batch = f["cfg_batch"]
    pt, ph, pw = geometry["patch"]
    latent_frames += -latent_frames % pt  # CogVideoX 1.5's pipeline pads them to its frame patch (and drops them after)
    hidden = _latent(
        geometry, geometry["denoiser_channels"], f["channels_first"], latent_frames, height, width, batch, dtype
    )
    patches = latent_frames // pt * (height // geometry["spatial"] // ph) * (width // geometry["spatial"] // pw)
    if geometry["expand_timesteps"]:  # a timestep per token (Wan 2.2 TI2V)
        timestep = torch.zeros(batch, patches, dtype=torch.long, device="meta")
    else:
        timestep = torch.zeros(batch, dtype=torch.long, device="meta")
    width_text = module.config.get("text_dim", module.config.get("text_embed_dim", 4096))
    kwargs = dict(
        hidden_states=hidden,
        timestep=timestep,
        encoder_hidden_states=torch.empty(batch, geometry["tokens"], width_text, dtype=dtype, device="meta"),
        return_dict=False,
    )
    head = positive_int(module.config.get("attention_head_dim"))
    if module.config.get("use_rotary_positional_embeddings") is True and head:
        # CogVideoX's pipeline passes the rotary table (cos, sin: fp32, a row per video token); the attention's rotation
        # of q and k makes fp32 temporaries of their size (187 MiB more peak for CogVideoX-5B at 49x480x720)
        kwargs["image_rotary_emb"] = tuple(torch.empty(patches, head, dtype=torch.float32, device="meta") for _ in "cs")
    image_dim = positive_int(module.config.get("image_dim"))
    if image_dim:  # Wan 2.1 I2V: the image encoder's hidden states, attended to in every block
        kwargs["encoder_hidden_states_image"] = torch.empty(
            batch, geometry["image_tokens"], image_dim, dtype=dtype, device="meta"
        )
    if module.config.get("ofs_embed_dim"):  # CogVideoX 1.5 I2V: the pipeline's frame offset embedding input
        kwargs["ofs"] = torch.empty(1, dtype=dtype, device="meta")
    return [Call("forward", (), kwargs)], 2 // batch, True


@host_by_default
def plan(
    target,
    budget: int | str = "12GB",
    *,
    host_budget: int | str | None = None,
    frames: int = 81,
    height: int = 480,
    width: int = 832,
    steps: int = 50,
    storage: str | dict = "fp8_e4m3",
    mode: str = "auto",
    prefetch: int = 2,
    link: int | str = "25GB",
    disk: int | str = "2GB",
    vae_tiling: bool = False,
    vae_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Preview:
    """Plan ``target`` (a preset name such as ``"wan2.1-t2v-14b"``, or a local diffusers pipeline directory) for a
    ``frames`` x ``height`` x ``width`` video at ``budget`` of GPU memory, from configs alone.

    ``link``: host-to-GPU bytes per second (``"25GB"``: PCIe 4.0 x16 in practice) for the transfer times.
    ``host_budget``: host memory the packs may hold; the preview says which packs it holds (as enable would) and what
    is read from disk per run, timed at ``disk`` bytes per second (``"2GB"``: a PCIe 3.0 NVMe SSD).
    ``vae_tiling``: decode in tiles (``pipe.vae.enable_tiling()``); ``vae_dtype``: the VAE's dtype (default: bf16,
    as ``tritoff run`` loads every component; Wan's own examples decode in fp32). ``progress``: a bar while each
    component's call is traced on the meta device (seconds each for a 14B model). Returns a :class:`Preview`
    (``.text()``, ``.as_dict()``), feasible or not, with the smallest budget that fits.
    """
    from tritoff.formats import get_format
    from tritoff.options import check_prefetch
    from tritoff.packer import pack_offsets, plan_layouts
    from tritoff.presets import PRESETS, as_loaded, build_preset
    from tritoff.sizing import groups_for, shared_bytes, sizes_of
    from tritoff.skip import SkipRules
    from tritoff.storage import resolve_storage

    if not isinstance(target, (str, os.PathLike)):
        raise ValueError(f"target must be a preset name or a pipeline directory, got {type(target).__name__}")
    for what, value in (("frames", frames), ("height", height), ("width", width), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMITS[what]:
            raise ValueError(f"{what} must be an integer from 1 to {LIMITS[what]}, got {value!r}")
    check_prefetch(prefetch)
    if vae_dtype is not None and not isinstance(vae_dtype, torch.dtype):
        raise ValueError(f"vae_dtype must be a torch dtype such as torch.float32, got {vae_dtype!r}")
    budget_bytes = parse_size(budget, percent=False)  # a plan has no GPU to take a share of
    host_bytes_budget = parse_host_budget(host_budget, what="host budget")
    link_rate = float(parse_rate(link, what="link"))
    disk_rate = float(parse_rate(disk, what="disk"))
    if str(target) in PRESETS:
        model = str(target)
        family, components = build_preset(model)
        preset = PRESETS[model]
        scheduler = None
        if preset.flow_shift is not None:  # the Wan 2.2 pipelines' scheduler
            from diffusers import UniPCMultistepScheduler

            scheduler = UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=preset.flow_shift
            )
        pipeline_calls = PipelineCalls(
            expand_timesteps=preset.expand_timesteps,
            image_to_video=preset.image_to_video,
            boundary_ratio=preset.boundary_ratio,
            scheduler=scheduler,
        )
    else:
        path = Path(target)
        if path.is_file():
            raise ValueError(f"{target} is a file: give the diffusers pipeline directory that holds model_index.json")
        if not path.is_dir():
            raise ValueError(f"{target} is neither a local pipeline directory nor a preset ({', '.join(PRESETS)})")
        family, components, model, pipeline_calls = _load_directory(path)
        model = f"{path.name} ({model})"
    vae = components.get("vae")
    denoiser = components.get("transformer")
    if vae is not None and denoiser is not None:
        config = {**vae.config, "_class_name": type(vae).__name__}  # as a saved config names it
        check_dimensions(config, dict(denoiser.config), frames=frames, height=height, width=width)
    if vae is not None:
        if vae_dtype is not None:
            as_loaded(vae, vae_dtype)
        if vae_tiling:
            vae.enable_tiling()
    formats = resolve_storage(storage, components)
    group_lists, layouts = {}, {}
    for name, module in components.items():
        group_lists[name] = groups_for(module, mode)
        quantized = SkipRules.for_model(module, ()).quantized_names(module)
        layouts[name] = plan_layouts(group_lists[name], quantized, get_format(formats[name]), "row", name)
    sizes = sizes_of(components, group_lists, layouts, mode)
    chunks, fixed = shared_bytes(sizes, group_lists, layouts, components, True, False, prefetch)
    reserves, calls, loops, untraced, failed = {}, {}, {}, {}, {}
    traced = {}  # (architecture, method, input shapes) -> (reserve, error): Wan 2.2's two experts are traced once
    geometry = _geometry(family, components, pipeline_calls)
    # the denoiser is called at each of the scheduler's timesteps (2n - 1 for a second-order one), split between Wan
    # 2.2's experts by their timestep
    first, second = expert_steps(steps, pipeline_calls.boundary_ratio, pipeline_calls.scheduler)
    with tqdm(components, desc="tracing activations", unit="component", disable=not progress, leave=False) as bar:
        for name in bar:
            bar.set_postfix_str(name)
            module = components[name]
            made, per_call, looped = _calls(family, geometry, name, module, frames, height, width)
            twin = None
            reserves[name] = 0
            for call in made:  # a component called more ways (a VAE's encode and decode) reserves for the largest
                key = (fingerprint(module), call.method, _shapes((call.args, call.kwargs)))
                if key not in traced:
                    if twin is None:
                        twin = module if next(module.parameters()).is_meta else meta_twin(module)
                    traced[key] = _reserve(twin, call.args, call.kwargs, call.method)
                reserve, error = traced[key]
                reserves[name] = max(reserves[name], reserve)
                if error is not None and name not in untraced:
                    untraced[name], failed[name] = error, call.method
            calls[name] = per_call * (first + second if looped else 1)
            loops[name] = looped
    shares = None
    if "transformer_2" in components:  # Wan 2.2: the steps are placed on the experts by their timestep
        per_step = calls["transformer_2"] // (first + second)
        calls["transformer"], calls["transformer_2"] = per_step * first, per_step * second
        shares = {"transformer": first / (first + second), "transformer_2": second / (first + second)}
    host = sum(pack_offsets(lays)[1] for lays in layouts.values())
    shape = dict(frames=frames, height=height, width=width, steps=steps, vae_tiling=vae_tiling)
    preview = Preview(model, budget_bytes, False, 0, host, host_bytes_budget, link_rate, shape, untraced=untraced)
    by_name = {s.name: s for s in sizes}
    phases, too_small = {}, []
    for name in components:
        try:  # the smallest budget of each phase: the planner names it when given one byte
            phase_plan([by_name[name]], 1, mode, prefetch, reserves[name], True, None, fixed)
        except BudgetError as err:
            preview.minimum_budget = max(preview.minimum_budget, err.minimum)
        try:
            phases[name] = phase_plan([by_name[name]], budget_bytes, mode, prefetch, reserves[name], True, None, fixed)
        except BudgetError as err:
            phases[name] = None
            too_small.append(f"{name} needs {format_bytes(err.minimum, up=True)}")
    together = not too_small and fit_together(phases.values(), fixed, reserves, budget_bytes)
    preview.phases = [
        _phase(name, phases[name], by_name[name], calls[name], reserves[name], together, mode) for name in components
    ]
    if host_bytes_budget is not None:
        preview.disk_bytes_per_s = disk_rate
        if not too_small:
            _disk_reads(preview, group_lists, layouts, phases, loops, shares)
    if too_small:
        preview.alternatives = _alternatives(components, group_lists, layouts, reserves, mode, prefetch, preview)
    unknown = [
        f"{name}'s {'call' if failed[name] == 'forward' else failed[name]} could not be traced on the meta device at "
        f"this shape ({error}), so its activations are unknown"
        for name, error in untraced.items()
    ]
    preview.reason = "; ".join([*unknown, *too_small])
    preview.feasible = not preview.reason
    return preview


def _reserve(twin: nn.Module, args, kwargs, method: str) -> tuple[int, str | None]:
    """(the activation reserve of ``twin.method(*args, **kwargs)``, None), as the engine reserves it on a GPU; or
    (0, why) when the call cannot be traced on the meta device: the model's own error at this shape (a video longer
    than its position table), or code a meta trace cannot run."""
    try:
        return reserve_bytes(twin, args, kwargs, method), None
    except Exception as err:
        lines = str(err).strip().splitlines()
        message = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
        return 0, message if len(message) <= 200 else message[:199] + "…"


def _alternatives(components, group_lists, layouts, reserves, mode: str, prefetch: int, preview: Preview) -> dict:
    """The lower prefetch and the other mode that lower ``preview``'s smallest budget (:func:`tritoff.advice.advise`),
    each planned as :func:`plan` plans ``mode``."""
    from tritoff.sizing import minimum_for

    minimum = minimum_for(components, group_lists, layouts, reserves)
    return alternatives(preview.minimum_budget, mode, prefetch, preview.budget, minimum)


def _disk_reads(preview: Preview, group_lists, layouts, phases, looped, shares) -> None:
    """Which packs the host budget holds (as ``enable`` places them) and what each phase then reads from disk."""
    from types import SimpleNamespace

    from tritoff.arena import PAGE
    from tritoff.host_plan import hold_plan
    from tritoff.pack import align

    held = hold_plan(group_lists, layouts, SimpleNamespace(phases=phases), looped, preview.host_budget, shares)
    preview.host_held_bytes = sum(
        align(lay.nbytes, PAGE)
        for name, lays in layouts.items()
        for g, lay in zip(group_lists[name], lays, strict=True)
        if g.name in held[name]
    )
    reads_for(preview, group_lists, layouts, phases, held)


def reads_for(preview: Preview, group_lists, layouts, phases, held: dict[str, set[str]]) -> None:
    """Set what each phase of ``preview`` reads from disk per call and per entry where the host holds ``held``
    ({component: group names}; ``bench/host_placement.py`` counts other placements with it)."""
    for row in preview.phases:
        (name,) = row.components
        tiers = phases[name].tiers.get(name, {})
        on_disk = [
            (g, lay) for g, lay in zip(group_lists[name], layouts[name], strict=True) if g.name not in held[name]
        ]
        streamed = [lay.nbytes for g, lay in on_disk if row.mode in ("group", "leaf") and tiers.get(g.name) == "stream"]
        row.disk_bytes_per_call = sum(streamed)
        entry = sum(lay.nbytes for g, lay in on_disk if not is_host(g)) - row.disk_bytes_per_call
        row.disk_entry_bytes = entry if row.entry_bytes else 0  # phases that fit together are entered once


def _phase(name: str, p, size, calls: int, reserve: int, together: bool, requested: str) -> PhasePreview:
    """One row of the preview (``p`` None: the phase does not fit the budget); ``requested``: the mode asked for."""
    if p is None:
        return PhasePreview([name], "too small", {}, 0, reserve, 0, 0, calls, 0)
    tiers = p.tiers.get(name, {})
    mode = p.modes[name]
    streamed = 0 if mode != "group" else sum(g.packed for g in size.blocks if tiers.get(g.name) == "stream")
    # entering the phase uploads its resident blocks (fp8 packs, or bf16 upcast from the packs) and its unit: once
    # per pipeline call when the phases do not fit together, else once
    kept = [g for g in size.blocks if mode == "resident" or tiers.get(g.name) in ("bf16", "fp8")]
    entry = (size.rest.packed if size.rest else 0) + sum(g.packed for g in kept)  # host bytes, as the engine counts
    counts = p.tier_counts(name) if mode == "group" else {}
    label = mode_label(requested, mode)
    return PhasePreview(
        [name], label, counts, p.planned_bytes, reserve, p.resident_bytes, streamed, calls, 0 if together else entry
    )

"""What ``tritoff.enable`` and ``tritoff.disable`` refuse about their target before anything changes: components
carrying other offload hooks, replaced or shared since, managed by another engine, not loaded, called right now, or a
VAE its pipeline would cast to float32.

Every engine ``enable`` makes is registered here (``ENGINES``, and its target's ``ENGINE_ATTR``), so that a module
another engine holds is named as that engine names it."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from tritoff import torn_down
from tritoff.adapters import named_parameters
from tritoff.manager import ComponentHook, GroupHook

if TYPE_CHECKING:
    from tritoff.engine import Engine
    from tritoff.options import Options

ENGINE_ATTR = "_tritoff_engine"
# every engine made by enable; those still their target's engine own their components' parameters
ENGINES: weakref.WeakSet = weakref.WeakSet()
# diffusers' registry hooks that move or cast weights: group offloading and layerwise casting
WEIGHT_HOOKS = {
    "group_offloading",
    "layer_execution_tracker",
    "lazy_prefetch_group_offloading",
    "layerwise_casting",
    "peft_autocast_disable",
}


def unwrap(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles (tritoff manages, and hooks, the module itself)."""
    return module._orig_mod if type(module).__name__ == "OptimizedModule" else module


def wrapped_components(target, caller: str = "enable") -> dict[str, nn.Module]:
    """The model components of ``target`` as it holds them (a ``torch.compile`` wrapper as such)."""
    if isinstance(target, nn.Module):
        return {"model": target}
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"tritoff.{caller} needs a diffusers pipeline or an nn.Module, got {type(target).__name__}")
    modules = {name: m for name, m in components.items() if isinstance(m, nn.Module)}
    if not modules:
        raise ValueError("this pipeline has no model components to manage")
    return modules


def components_of(target, caller: str = "enable") -> dict[str, nn.Module]:
    """The model components of ``target`` (a pipeline's, or ``{"model": target}`` for a module), each the module
    itself where a ``torch.compile`` wrapper holds it."""
    return {name: unwrap(m) for name, m in wrapped_components(target, caller).items()}


def check_no_foreign_hooks(components: dict[str, nn.Module]) -> None:
    """Refuse components loaded with a device_map or carrying accelerate's offload hooks or diffusers' weight hooks:
    both move or cast the weights tritoff holds."""
    for name, component in components.items():
        if getattr(component, "hf_device_map", None):
            raise ValueError(
                f"{name} was loaded with a device_map; load it without device_map (tritoff places weights itself)"
            )
        for module_name, module in component.named_modules():
            where = f"{name}.{module_name}" if module_name else name
            hook = getattr(module, "_hf_hook", None)
            if hook is not None and not isinstance(hook, (ComponentHook, GroupHook, torn_down.TornDown)):
                raise ValueError(
                    f"{where} carries accelerate hooks (enable_model_cpu_offload, enable_sequential_cpu_offload or "
                    "cpu_offload); call pipe.remove_all_hooks() first"
                )
            # diffusers' caches and layer skip compose with tritoff (chain.py); its offloading and casting move or
            # cast the weights tritoff holds
            moving = [n for n in getattr(getattr(module, "_diffusers_hook", None), "hooks", ()) if n in WEIGHT_HOOKS]
            if moving:
                raise ValueError(
                    f"{where} carries diffusers hooks ({', '.join(moving)}); undo enable_group_offload / "
                    "enable_layerwise_casting (e.g. reload the model) before tritoff.enable"
                )


def check_components(components: dict[str, nn.Module], previous) -> None:
    """Refuse, before anything changes, components replaced since the previous enable (its packs hold the old weights)
    and parameters shared between components (each component is packed and placed on its own)."""
    if previous is not None:
        before = previous.components
        changed = [n for n in {**before, **components} if before.get(n) is not components.get(n)]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} changed since tritoff.enable (replaced, added or removed) while tritoff holds "
                "the weights it had; call tritoff.disable(pipe) before changing components, then tritoff.enable again"
            )
    where: dict[int, tuple[str, str]] = {}
    for name, component in components.items():
        for pname, param in named_parameters(component):
            first = where.setdefault(id(param), (name, pname))
            if first[0] != name:
                raise ValueError(
                    f"{'.'.join(first)} and {name}.{pname} are one parameter shared by two components, which tritoff "
                    "packs and places each on its own: give each component its own copy, or enable tritoff on one"
                )


def enabled_engines() -> list[Engine]:
    """The engines still their target's engine (not replaced by enabling it again, nor disabled)."""
    return [engine for engine in list(ENGINES) if getattr(engine.target, ENGINE_ATTR, None) is engine]


def engine_held_by(components: dict[str, nn.Module]) -> Engine | None:
    """The enabled engine of a pipeline every model component of which is among ``components`` (another pipeline's,
    as one made from its components, ``OtherPipeline(**pipe.components)``, holds them), or None."""
    held = {id(module) for module in components.values()}
    for engine in enabled_engines():
        if not isinstance(engine.target, nn.Module) and all(id(m) in held for m in engine.components.values()):
            return engine
    return None


def managed_elsewhere(target) -> str | None:
    """``target`` (a module not hooked itself: a layer of a block, a component's ``proj_out``, an activation) named
    as the engine holding it names it, or None when no engine (enabled, or torn down) holds it."""
    if not isinstance(target, nn.Module):
        return None
    for engine in enabled_engines():
        if not engine._released:
            name = name_in(engine, target)
            if name is not None:
                return name
    return None


def name_in(engine: Engine, module: nn.Module) -> str | None:
    """``module`` named as ``engine`` names it (``transformer.blocks.0``), or None when its components hold none."""
    for name, component in engine.components.items():
        for module_name, candidate in component.named_modules():
            if candidate is module:
                return f"{name}.{module_name}" if module_name else name
    return None


def hooked_elsewhere(components: dict[str, nn.Module], own) -> str | None:
    """The first module of ``components`` that an engine other than the one of manager ``own`` hooked, named by
    whichever of the two was given a pipeline (``transformer.blocks.0``, not ``model.blocks.0``: ``model`` is what a
    module enabled on its own is called), else by its class."""
    for name, component in components.items():
        for module_name, module in component.named_modules():
            hook = getattr(module, "_hf_hook", None)
            if isinstance(hook, (ComponentHook, GroupHook)) and hook.manager is not own:
                owner = next((e for e in list(ENGINES) if e.manager is hook.manager), None)
                theirs = (
                    name_in(owner, module) if owner is not None and not isinstance(owner.target, nn.Module) else None
                )
                ours = None if name == "model" else f"{name}.{module_name}".rstrip(".")
                return theirs or ours or type(module).__name__
    return None


def check_not_managed_elsewhere(components: dict[str, nn.Module], previous) -> None:
    """Refuse components (or weights) another engine than ``previous`` manages: shared components cannot be packed
    twice."""
    where = hooked_elsewhere(components, previous.manager if previous is not None else None)
    if where is not None:
        raise ValueError(
            f"{where} is already managed by tritoff through another pipeline or module (shared components cannot be "
            "packed twice); call tritoff.disable on that one first"
        )
    # a shared module without a hook of its own (inside another engine's rest group): its parameters tell
    mine = {id(p): f"{name}.{pname}" for name, c in components.items() for pname, p in named_parameters(c)}
    for engine in enabled_engines():
        if engine is previous:
            continue
        for component in engine.components.values():
            for _, param in named_parameters(component):
                if id(param) in mine:
                    raise ValueError(
                        f"{mine[id(param)]} is already managed by tritoff through another pipeline or module (shared "
                        "weights cannot be packed twice); call tritoff.disable on that one first"
                    )


def check_not_in_a_call(engine: Engine, what: str) -> None:
    """Refuse ``what`` (``disable``, ``enable`` again) from inside a forward of a module ``engine`` manages, from a hook
    or callback on this thread: the forward would go on with its hooks gone. A forward running on another thread is
    waited for instead (the manager's lock), as a teardown does; the rest of that thread's pipeline call is not."""
    manager = engine.manager
    if manager is None:
        return
    with manager.lock:
        if manager.guarded_calls:
            names = list(dict.fromkeys(c.name for c in manager.running))
            running = type(engine.target).__name__ if names in ([], ["model"]) else ", ".join(names)
            raise RuntimeError(
                f"tritoff.{what} was called during a forward of {running} (from a hook or callback inside it); call "
                "it after that call returns"
            )


def check_still_there(components: dict[str, nn.Module], previous: Engine) -> None:
    """Refuse enabling again a component whose managed weights are not where they were: one gone (its module deleted,
    moved or wrapped: tritoff still holds it under its old name, which only ``disable`` gives back), or one added
    (a module put in since, which the packs do not hold)."""
    for name, module in components.items():
        own = previous._own_params[name]
        now = {n: id(p) for n, p in named_parameters(module)}
        gone = next((n for n, p in own.items() if now.get(n) != id(p)), None)
        if gone is not None:
            raise ValueError(
                f"{name}.{gone} is no longer in {name} under that name (its module was deleted, moved, wrapped or "
                "aliased since enable), and tritoff still holds its weight: call tritoff.disable(pipe) before changing "
                "a component's modules"
            )
        added = next((n for n in now if n not in own), None)
        if added is not None:
            raise ValueError(
                f"{name}.{added} was added to {name} since enable and tritoff's packs do not hold it: call "
                "tritoff.disable(pipe) before changing a component's modules, then enable again"
            )


def check_not_inference(components: dict[str, nn.Module]) -> None:
    """Refuse weights made under ``torch.inference_mode()`` (loaded inside it): such a tensor counts no writes and
    cannot be given other data, as tritoff gives every weight it manages."""
    for name, component in components.items():
        for pname, param in named_parameters(component):
            if param.is_inference() and not param.is_meta:  # a meta one is replaced, filled from a store
                raise ValueError(
                    f"{name}.{pname} was made under torch.inference_mode(), whose tensors tritoff cannot manage: load "
                    "the pipeline outside torch.inference_mode() (calling it inside is fine), then tritoff.enable"
                )


def check_packable(components: dict[str, nn.Module]) -> None:
    """Refuse what packs cannot hold or hooks cannot serve, before anything changes: a TorchScript module holding
    weights (its compiled code calls no Python hooks), a sparse or conjugate-view weight (packs hold dense bytes),
    an embedding with ``max_norm`` (each lookup renormalises its table in place, which tritoff refuses at every
    call)."""
    for name, component in components.items():
        for path, module in component.named_modules():
            where = f"{name}.{path}" if path else name
            if isinstance(module, torch.jit.ScriptModule) and any(True for _ in module.parameters()):
                raise ValueError(
                    f"{where} is a TorchScript module, whose compiled code calls no hooks: enable tritoff on the "
                    "Python module (torch.compile works with tritoff)"
                )
            if isinstance(module, nn.Embedding) and module.max_norm is not None:
                raise ValueError(
                    f"{where} is an nn.Embedding with max_norm, which rewrites its table in place at each lookup: "
                    "set its max_norm to None before enable (renormalising the table once first, if its rows exceed it)"
                )
        for pname, param in named_parameters(component):
            if param.layout != torch.strided:
                raise ValueError(
                    f"{name}.{pname} is a sparse tensor, and packs hold dense weights: make it dense "
                    "(nn.Parameter(weight.to_dense())) before enable"
                )
            if param.is_conj():
                raise ValueError(
                    f"{name}.{pname} is a conjugate view, which packs cannot hold: resolve it "
                    "(nn.Parameter(weight.resolve_conj())) before enable"
                )


def check_no_vae_upcast(target, components: dict[str, nn.Module]) -> None:
    """Refuse a component whose config asks for ``force_upcast`` in a pipeline that then casts it to float32 around
    its VAE calls (Stable Video Diffusion, the SDXL, SD and AnimateDiff families): tritoff refuses that cast, so the
    call would fail midway (after the denoising loop, in some)."""
    if isinstance(target, nn.Module):
        return
    cast = _upcast_dtypes(type(target))
    for name, module in components.items():
        config = getattr(module, "config", None)
        dtype = getattr(module, "dtype", None)
        if dtype in cast and getattr(config, "force_upcast", False) is True:
            kind = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"{name} is {kind} with force_upcast=True in its config, so {type(target).__name__} casts it to "
                f"float32 around its {name} calls, which tritoff cannot do to weights it holds: call "
                f"pipe.{name}.register_to_config(force_upcast=False) before enable (for a {name} that decodes well "
                f"in {kind}), or load {name} in float32 where the pipeline runs with a float32 {name}"
            )


def _upcast_dtypes(cls: type) -> set[torch.dtype]:
    """The VAE dtypes a pipeline class (with its bases below diffusers' ``DiffusionPipeline``) casts to float32 when
    the VAE's config says ``force_upcast``, as its source reads: float16 where each check compares with float16
    (SDXL's text to image), any 16-bit dtype where one does not (SDXL's image to image, AnimateDiff's video to video),
    none where it never reads the flag or its source is not shipped."""
    import inspect

    lines = []
    for base in cls.__mro__:
        if base.__name__ == "DiffusionPipeline" or base is object:
            break
        try:
            lines += [line for line in inspect.getsource(base).splitlines() if "force_upcast" in line]
        except (OSError, TypeError):  # no source shipped: nothing to tell
            continue
    if not lines:
        return set()
    if all("float16" in line for line in lines):
        return {torch.float16}
    return {torch.float16, torch.bfloat16}


def check_loaded(module: nn.Module, component: str) -> None:
    """Refuse a module whose weights are on the meta device: there are no values to pack."""
    for name, tensor in (*named_parameters(module), *module.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"{component}.{name} is on the meta device, so there are no weights to pack: load the weights "
                "before tritoff.enable (a pipeline from tritoff.load_pipeline: pass the store it was loaded for, "
                "store=...)"
            )


def check_fillable(module: nn.Module, component: str) -> None:
    """Refuse, for a module to be filled from a store, a tensor on the meta device that the store does not hold: an
    adapter's weight (a LoRA loaded onto a component built without its weights got no values) or a buffer."""
    from tritoff.adapters import adapter_parameters

    adapters = {id(p) for p in adapter_parameters(module)}
    for name, param in module.named_parameters():
        if param.is_meta and id(param) in adapters:
            raise ValueError(
                f"{component}.{name} (an adapter's weight) is on the meta device: a LoRA loaded onto a component "
                "built without its weights gets no values; load it after tritoff.enable"
            )
    for name, buffer in module.named_buffers():
        if buffer.is_meta:
            raise ValueError(
                f"{component}.{name} is a buffer on the meta device, which a store does not hold: build the component "
                "with its buffers (tritoff.load_pipeline does), or load it whole"
            )


def check_finite(module: nn.Module, quantized: set[str], component: str) -> None:
    """Refuse a weight to be quantized that holds NaN or Inf: no scale represents it."""
    for name, param in named_parameters(module):
        if name in quantized and not torch.isfinite(param.detach()).all():
            raise ValueError(f"{component}.{name} contains NaN or Inf: fix or skip this weight before tritoff.enable")


def check_zero_copy(options: Options, arenas: dict) -> None:
    """transport='zero_copy' needs every arena page-locked; refuse before anything changes if one is not."""
    if not options.reads_host_directly:
        return
    for name, arena in arenas.items():
        arena = getattr(arena, "arena", arena)
        if arena.nbytes and not arena.registered:
            raise ValueError(
                f"transport='zero_copy' needs page-locked host memory, and {name}'s packs could not be locked "
                f"({arena.register_error}); use transport='staged', or free host memory"
            )

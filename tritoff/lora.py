"""Fusing adapters into packs: peft's ``merge``/``unmerge`` on weights that live in tritoff's packs.

peft fuses a LoRA by adding its delta to the base layer's weight in place. A weight tritoff manages holds a
placeholder (or a view of a GPU buffer) between forwards; its canonical copy is its pack in the host arena. So
tritoff wraps the ``merge`` and ``unmerge`` of every tuner layer of an enabled pipeline (those present at enable, and
those created later: a module registration hook sees them appear). For the call, the base layer's parameters hold
their exact dequantized values on the compute device; peft changes them as it always does; then every changed tensor
is written back into its pack (an fp8 weight is quantized again exactly as when it was packed, and the SNR of the
result is recorded for the report), and the GPU copies (resident packs, resident and pooled tensors) are refreshed.
``disable`` then returns the fused weights, and a re-plan keeps them.

Fusing is refused in one line where a pack is served from disk (beyond ``host_budget``: its file is not tritoff's
to rewrite). ``fuse_lora`` (the pipeline's and the components') first checks every layer it would fuse: an adapter
whose delta holds NaN or Inf, or a layer whose pack is on disk, is refused before any weight changes; a layer that
still fails (its fused weight overflows) is left, with peft's record of its merged adapters, as it was. Unfusing a
layer with nothing merged changes nothing, as in peft.
"""

from __future__ import annotations

import functools
import weakref

import torch

from tritoff.adapters import is_tuner_layer, tuner_layers
from tritoff.onload import GroupRuntime
from tritoff.pack import KIND_FP8, read_entry, write_entry

# engines whose components may hold tuner layers; the registration hook is installed with the first one
_ENGINES: weakref.WeakSet = weakref.WeakSet()
_HOOK = None


def attach(engine) -> None:
    """Wrap the tuner layers of ``engine``'s components, and those created while it lives, and the ``fuse_lora`` of
    the pipeline and its components."""
    global _HOOK
    _ENGINES.add(engine)
    if _HOOK is None:
        _HOOK = torch.nn.modules.module.register_module_module_registration_hook(_on_register)
    for module in engine.components.values():
        for layer in tuner_layers(module):
            _wrap(layer)
    for owner in {id(o): o for o in (engine.target, *engine.components.values())}.values():
        if callable(getattr(type(owner), "fuse_lora", None)) and "fuse_lora" not in owner.__dict__:
            owner.fuse_lora = _checked_fuse(owner, engine)
        if not isinstance(owner, torch.nn.Module) and callable(getattr(type(owner), "unfuse_lora", None)):
            if "unfuse_lora" not in owner.__dict__:
                owner.unfuse_lora = _checked_unfuse(owner)


def detach(engine, unwrap: bool) -> None:
    """Forget ``engine``; with ``unwrap``, give its tuner layers peft's own ``merge``/``unmerge`` back."""
    _ENGINES.discard(engine)
    for owner in (engine.target, *engine.components.values()):
        for name in ("fuse_lora", "unfuse_lora"):
            if getattr(owner.__dict__.get(name), "_tritoff", False):
                delattr(owner, name)
    if unwrap:
        for module in engine.components.values():
            for layer in tuner_layers(module):
                for name in ("merge", "unmerge"):
                    if getattr(layer.__dict__.get(name), "_tritoff", False):
                        delattr(layer, name)


def _compiled_whole(pipe, what: str, args, kwargs) -> None:
    """Refuse a pipeline-level fuse/unfuse naming a component compiled whole: diffusers skips such a wrapper
    without a word (it is not a ModelMixin), so the LoRA would silently stay as it was."""
    components = kwargs.get("components", args[0] if args else None) or ()
    for name in components:
        if type(getattr(pipe, name, None)).__name__ == "OptimizedModule":
            raise ValueError(
                f"{what}: pipe.{name} is compiled whole (torch.compile's wrapper), which diffusers' {what} skips "
                f"without a word; call pipe.{name}._orig_mod.{what}(...), or {what} before compiling, or compile "
                "regionally (compile_repeated_blocks)"
            )


def _checked_unfuse(pipe):
    original = pipe.unfuse_lora

    @functools.wraps(original)
    def unfuse_lora(*args, **kwargs):
        _compiled_whole(pipe, "unfuse_lora", args, kwargs)
        return original(*args, **kwargs)

    unfuse_lora._tritoff = True
    return unfuse_lora


def _checked_fuse(owner, engine):
    """``fuse_lora`` that refuses, before fusing anything, an adapter whose delta holds NaN or Inf (and, on a
    pipeline, a component compiled whole)."""
    original = owner.fuse_lora

    @functools.wraps(original)
    def fuse_lora(*args, **kwargs):
        if not isinstance(owner, torch.nn.Module):
            _compiled_whole(owner, "fuse_lora", args, kwargs)
        names = kwargs.get("adapter_names")
        for component, module in engine.components.items():
            for layer_name, layer in module.named_modules():
                if not is_tuner_layer(layer) or not hasattr(layer, "get_delta_weight"):
                    continue
                wanted = names if names is not None else layer.active_adapters
                for adapter in wanted:
                    if adapter in getattr(layer, "merged_adapters", ()) or adapter not in getattr(layer, "lora_A", ()):
                        continue
                    if not torch.isfinite(layer.get_delta_weight(adapter)).all():
                        raise ValueError(
                            f"fuse_lora: adapter {adapter!r} has NaN or Inf in its delta for {component}.{layer_name}; "
                            "nothing was fused: fix or unload that adapter"
                        )
                    _refuse_disk(engine, layer, "fuse")
        return original(*args, **kwargs)

    fuse_lora._tritoff = True
    return fuse_lora


def _on_register(module, name, submodule):
    """Called for every submodule registered anywhere: cheap unless an engine lives and peft is at work."""
    if not len(_ENGINES) or not isinstance(submodule, torch.nn.Module):
        return None
    if name == "base_layer" and is_tuner_layer(module):
        _wrap(module)  # peft builds a tuner layer around its base layer: ``self.base_layer = base_layer``
    elif is_tuner_layer(submodule):  # peft puts the adapted layer where the base layer was
        _move_hook(submodule.get_base_layer(), submodule)
    else:  # unloading puts the base layer back where its tuner layer was
        old = module._modules.get(name)
        if old is not None and old is not submodule and is_tuner_layer(old) and old.get_base_layer() is submodule:
            _move_hook(old, submodule)
    return None


def _move_hook(src, dst) -> None:
    # only leaf mode hooks a layer peft wraps; blocks and components are never wrapped
    from tritoff.manager import GroupHook

    hook = getattr(src, "_hf_hook", None)
    if isinstance(hook, GroupHook):
        for engine in list(_ENGINES):
            if engine.manager is hook.manager:
                engine.move_hook(src, dst)
                return


def _wrap(layer) -> None:
    if getattr(layer.__dict__.get("merge"), "_tritoff", False):
        return
    merge, unmerge = layer.merge, layer.unmerge

    @functools.wraps(merge)
    def tritoff_merge(*args, **kwargs):
        return _edit(layer, functools.partial(merge, *args, **kwargs), "fuse")

    @functools.wraps(unmerge)
    def tritoff_unmerge(*args, **kwargs):
        return _edit(layer, functools.partial(unmerge, *args, **kwargs), "unfuse")

    tritoff_merge._tritoff = tritoff_unmerge._tritoff = True
    # instance attributes shadow peft's methods; diffusers and peft call ``module.merge(...)``
    layer.merge, layer.unmerge = tritoff_merge, tritoff_unmerge


def _where(engine) -> dict[int, tuple[GroupRuntime, int]]:
    """Parameter id -> (its group, its index in the group's pack), built once per engine."""
    where = engine.__dict__.get("_param_places")
    if where is None:
        where = {id(p): (g, i) for comp in engine._runtimes for g in comp.groups for i, p in enumerate(g.params)}
        engine._param_places = where
    return where


def _owner(params):
    for engine in list(_ENGINES):
        if engine.manager is None:
            continue
        where = _where(engine)
        located = [(p, *where[id(p)]) for p in params if id(p) in where]
        if located:
            return engine, located
    return None, []


def _refuse_disk(engine, layer, what: str) -> None:
    """Refuse to ``what`` a LoRA into ``layer`` when a weight of its base layer is in a pack served from disk."""
    where = _where(engine)
    for param in layer.get_base_layer().parameters():
        g, i = where.get(id(param), (None, None))
        if g is not None and g.pack.on_disk:
            raise ValueError(
                f"cannot {what} a LoRA into {g.component}.{g.layout.entries[i].name}: its pack is served from disk "
                "(beyond host_budget); nothing was fused: raise host_budget so it is held in memory, or keep the "
                "LoRA unfused"
            )


def _edit(layer, change, what: str):
    engine, located = _owner(list(layer.get_base_layer().parameters()))
    if engine is None or (what == "unfuse" and not getattr(layer, "merged_adapters", None)):
        return change()  # unfusing a layer with nothing merged changes no weight
    _refuse_disk(engine, layer, what)
    engine.manager.drop_prefetch()
    device = engine.options.device
    merged = list(getattr(layer, "merged_adapters", []))
    bound = [(p, p.data) for p, _, _ in located]
    try:
        before = []
        for p, g, i in located:
            p.data = read_entry(g.layout, g.pack.data, g.layout.entries[i]).to(device)
            before.append(p.data.clone())
        result = change()
        changed = []
        for (p, g, i), old in zip(located, before, strict=True):
            e = g.layout.entries[i]
            new = p.data
            if tuple(new.shape) != e.shape:
                raise ValueError(f"{what} changed the shape of {g.component}.{e.name}; tritoff cannot store that")
            if e.kind == KIND_FP8 and not torch.isfinite(new).all():
                raise ValueError(
                    f"{what} gives NaN or Inf in {g.component}.{e.name}: the adapter is broken; nothing was changed"
                )
            if not torch.equal(new, old):
                changed.append((g, i, new))
        for g, i, new in changed:  # checked above: none of these writes can fail halfway
            _store(engine, g, i, new, what)
    except BaseException:
        if hasattr(layer, "merged_adapters"):
            layer.merged_adapters[:] = merged
        raise
    finally:
        for p, data in bound:
            p.data = data
    return result


def _store(engine, g: GroupRuntime, i: int, value: torch.Tensor, what: str) -> None:
    """Write ``value`` into entry ``i`` of ``g``'s pack and refresh every GPU copy of it."""
    from tritoff.packer import _quantizer, quantize_device

    layout, e = g.layout, g.layout.entries[i]
    snr: dict[str, float] = {}
    write_entry(layout, g.pack.data, e, value, _quantizer(quantize_device(engine.options.device)), snr)
    if g.device_pack is not None:  # fp8 tier: the resident pack
        for start, nbytes in ((e.offset, e.nbytes), (e.scale_offset, 4 * e.num_scales)):
            if start >= 0 and nbytes:
                g.device_pack[start : start + nbytes].copy_(g.pack.data[start : start + nbytes])
    if g.buffer is not None:  # bf16 tier or a loaded pool unit: the tensor itself, as the kernels would unpack it
        layout.views(g.buffer)[e.name].copy_(read_entry(layout, g.pack.data, e))
    name = f"{g.component}.{e.name}"
    if e.name in snr:
        engine.snr[name] = snr[e.name]
        engine.requantized[name] = (what, snr[e.name])

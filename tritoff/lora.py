"""Fusing adapters into packs: peft's ``merge``/``unmerge`` on weights that live in tritoff's packs.

peft fuses a LoRA by adding its delta to the base layer's weight in place. A weight tritoff manages holds a
placeholder (or a view of a GPU buffer) between forwards; its canonical copy is its pack in the host arena. So
tritoff wraps the ``merge`` and ``unmerge`` of every tuner layer of an enabled pipeline (those present at enable, and
those created later: a module registration hook sees them appear). For the call, the base layer's parameters hold
their exact dequantized values on the compute device; peft changes them as it always does; then every changed tensor
is written back into its pack (an fp8 weight is quantized again exactly as when it was packed, and the SNR of the
result is recorded for the report), and the GPU copies (resident packs, resident and pooled tensors) are refreshed.
``disable`` then returns the fused weights, and a re-plan keeps them. peft also unfuses on its own, inside a layer's
forward once adapters are disabled (``disable_lora`` after ``fuse_lora``): there a streamed block's weights are the
parameters of the ring slot it runs from, which are located too, and the slot is refreshed for the rest of that forward.

Fusing is refused in one line where a pack is served from disk (beyond ``host_budget``: its file is not tritoff's
to rewrite), and so is unfusing. ``fuse_lora`` and ``unfuse_lora`` (the pipeline's and the components') first check
every layer of the components the call names: an adapter whose delta holds NaN or Inf, or a layer whose pack is on
disk, is refused before any weight changes; a layer that still fails (its fused weight overflows) is left, with peft's
record of its merged adapters, as it was. Unfusing a layer with nothing merged changes nothing, as in peft.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from tritoff.adapters import is_tuner_layer, tuner_layers
from tritoff.atomic import interrupts_held
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
        for what in ("fuse", "unfuse"):
            name = f"{what}_lora"
            if callable(getattr(type(owner), name, None)) and name not in owner.__dict__:
                setattr(owner, name, _checked(owner, engine, what))


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


def _compiled_whole(pipe, what: str, names) -> None:
    """Refuse a pipeline-level fuse/unfuse naming a component compiled whole: diffusers skips such a wrapper
    without a word (it is not a ModelMixin), so the LoRA would silently stay as it was."""
    for name in names:
        if type(getattr(pipe, name, None)).__name__ == "OptimizedModule":
            raise ValueError(
                f"{what}: pipe.{name} is compiled whole (torch.compile's wrapper), which diffusers' {what} skips "
                f"without a word; call pipe.{name}._orig_mod.{what}(...), or {what} before compiling, or compile "
                "regionally (compile_repeated_blocks)"
            )


def _arguments(method, args, kwargs) -> dict | None:
    """The arguments of a call of ``method``, defaults included; None when they do not fit (the call will say so)."""
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound.arguments


def _targets(owner, engine, arguments: dict | None) -> dict[str, torch.nn.Module]:
    """The components a ``fuse_lora``/``unfuse_lora`` call on ``owner`` changes: ``owner`` itself when it is one,
    else those its ``components`` argument names (the pipeline class's default when left out; all of them when the
    method takes no such argument)."""
    if isinstance(owner, torch.nn.Module):
        return {n: m for n, m in engine.components.items() if m is owner} or dict(engine.components)
    if arguments is None or "components" not in arguments:
        return dict(engine.components)
    names = arguments["components"] or ()
    return {n: engine.components[n] for n in names if n in engine.components}


def _checked(owner, engine, what: str):
    """``owner.fuse_lora`` or ``owner.unfuse_lora`` (``what``: ``"fuse"`` or ``"unfuse"``) that refuses, before any
    weight changes, a layer it would change whose pack is served from disk, an adapter it would fuse whose delta holds
    NaN or Inf, and (on a pipeline) a component compiled whole: peft changes layer after layer, so a refusal from
    within would leave the model part fused."""
    original = getattr(owner, f"{what}_lora")

    @functools.wraps(original)
    def call(*args, **kwargs):
        arguments = _arguments(original, args, kwargs)
        if not isinstance(owner, torch.nn.Module):
            names = (arguments or {}).get("components") or ()
            _compiled_whole(owner, f"{what}_lora", names)
        wanted = (arguments or kwargs).get("adapter_names")
        scale = (arguments or kwargs).get("lora_scale", 1.0)
        scale = scale if isinstance(scale, (int, float)) else 1.0
        for component, module in _targets(owner, engine, arguments).items():
            for layer_name, layer in module.named_modules():
                if not is_tuner_layer(layer):
                    continue
                if what == "unfuse":
                    if getattr(layer, "merged_adapters", None):
                        _refuse_disk(engine, layer, "unfuse", "nothing was unfused")
                    continue
                if not hasattr(layer, "get_delta_weight"):
                    continue
                for adapter in wanted if wanted is not None else layer.active_adapters:
                    if adapter in getattr(layer, "merged_adapters", ()) or adapter not in getattr(layer, "lora_A", ()):
                        continue
                    if not torch.isfinite(layer.get_delta_weight(adapter) * scale).all():
                        raise ValueError(
                            f"fuse_lora: adapter {adapter!r} has NaN or Inf in its delta for {component}.{layer_name}; "
                            "nothing was fused: fix or unload that adapter"
                        )
                    _refuse_disk(engine, layer, "fuse", "nothing was fused")
        return original(*args, **kwargs)

    call._tritoff = True
    return call


def _on_register(module, name, submodule):
    """Called for every submodule registered anywhere: cheap unless an engine lives and peft is at work."""
    if not len(_ENGINES) or not isinstance(submodule, torch.nn.Module):
        return None
    if name == "base_layer" and is_tuner_layer(module):
        # peft builds a tuner layer around its base layer (``self.base_layer = base_layer``): wrapped when an engine
        # holds the base layer's weights, never in a model tritoff does not manage
        if _owner(list(submodule.parameters()))[0] is not None:
            _wrap(module)
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


def _locate(engine, params) -> list[tuple[torch.nn.Parameter, GroupRuntime, int]]:
    """(parameter, its group, its entry in the group's pack) of each of ``params`` that ``engine`` manages: a
    group's own parameters, or, inside a streamed group's forward, the slot's parameters the modules then hold (peft
    unfuses there when adapters are disabled with a LoRA fused: ``disable_lora`` after ``fuse_lora``)."""
    where = _where(engine)
    located = [(p, *where[id(p)]) for p in params if id(p) in where]
    if located:
        return located
    wanted = {id(p) for p in params}
    for comp in engine._runtimes:
        for g in comp.groups:
            if g.bound:  # a tied parameter has a place per home: located once
                places = {id(p): (p, g, g.entry_of_place(k)) for k, p in enumerate(g.bound_params) if id(p) in wanted}
                located.extend(places.values())
    return located


def _owner(params):
    for engine in list(_ENGINES):
        if engine.manager is None:
            continue
        located = _locate(engine, params)
        if located:
            return engine, located
    return None, []


def _refuse_disk(engine, layer, what: str, unchanged: str) -> None:
    """Refuse to ``what`` (fuse or unfuse) a LoRA in ``layer`` when a weight of its base layer is in a pack served
    from disk; ``unchanged`` says what the refusal left as it was."""
    for _, g, i in _locate(engine, list(layer.get_base_layer().parameters())):
        if g.pack.on_disk:
            into, keep = ("into", "unfused") if what == "fuse" else ("from", "fused")
            raise ValueError(
                f"cannot {what} a LoRA {into} {g.component}.{g.layout.entries[i].name}: "
                f"its pack is served from disk (beyond host_budget); {unchanged}: raise host_budget so it is held in "
                f"memory, or keep the LoRA {keep}"
            )


def _refuse_lazy_unfuse(engine, layer) -> None:
    """peft unfuses each fused layer in its own forward once adapters are disabled (``disable_lora``), layer after
    layer: before the first changes, refuse if any of them in ``layer``'s component is in a pack on disk."""
    if not any(g.pack.on_disk for comp in engine._runtimes for g in comp.groups):
        return  # all packs held (the usual case): nothing to look for, at each of the layers peft unfuses
    for module in engine.components.values():
        if any(m is layer for m in module.modules()):
            for other in tuner_layers(module):
                if getattr(other, "merged_adapters", None) and getattr(other, "disable_adapters", False):
                    _refuse_disk(
                        engine,
                        other,
                        "unfuse",
                        "nothing was unfused (peft unfuses a fused LoRA in the first call after disable_lora; "
                        "enable_lora() undoes that)",
                    )


def _edit(layer, change, what: str):
    if id(layer) in _EDITING:
        # peft's own merge calling unmerge and merge again (a DoRA fused after other adapters recovers the unmerged
        # weight): the outer call holds the weights being changed and stores its final result
        return change()
    engine, located = _owner(list(layer.get_base_layer().parameters()))
    if engine is None or (what == "unfuse" and not getattr(layer, "merged_adapters", None)):
        return change()  # unfusing a layer with nothing merged changes no weight
    if what == "unfuse" and getattr(layer, "disable_adapters", False):
        _refuse_lazy_unfuse(engine, layer)
    _refuse_disk(engine, layer, what, "this layer was left as it was")
    if not all(g.bound for _, g, _ in located):
        # outside a forward: groups in flight may hold this layer's weights as they were. Inside one (peft unfusing
        # in its forward), the groups in flight are the next blocks, and the running one is refreshed in _store
        engine.manager.drop_prefetch()
    _EDITING.add(id(layer))
    try:
        return _edit_weights(engine, layer, located, change, what)
    finally:
        _EDITING.discard(id(layer))


# tuner layers whose merge or unmerge is running under _edit, by id
_EDITING: set[int] = set()


def _edit_weights(engine, layer, located, change, what: str):
    """Run ``change`` (peft's merge or unmerge) on the exact dequantized weights of ``located``, then store each
    changed one into its pack (and every GPU copy)."""
    device = engine.options.device
    merged = list(getattr(layer, "merged_adapters", []))
    bound = [(p, p.data) for p, _, _ in located]
    stored = False
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
                    f"{what} gives NaN or Inf in {g.component}.{e.name}: the adapter is broken; this layer was left "
                    "as it was"
                )
            if not torch.equal(new, old):
                changed.append((g, i, new))
        # checked above: none of these writes can fail halfway. Ctrl-C waits for them: once they are made, peft's
        # record of what is merged is what the packs hold, and is not put back
        with interrupts_held():
            for g, i, new in changed:
                _store(engine, g, i, new, what)
            stored = True
    except BaseException:
        if not stored and hasattr(layer, "merged_adapters"):
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
    g.pack.rewritten = True
    if g.device_pack is not None:  # fp8 tier: the resident pack
        for start, nbytes in ((e.offset, e.nbytes), (e.scale_offset, 4 * e.num_scales)):
            if start >= 0 and nbytes:
                g.device_pack[start : start + nbytes].copy_(g.pack.data[start : start + nbytes])
    # the tensor itself, as the kernels would unpack it: a bf16-tier group's or loaded pool unit's buffer, and inside
    # its forward a slot's views (the rest of that forward computes with the new weight)
    if g.buffer is not None or g.bound:
        unpacked = read_entry(layout, g.pack.data, e)
        if g.buffer is not None:
            layout.views(g.buffer)[e.name].copy_(unpacked)
        if g.bound:
            engine.manager.components[g.component].ring.refresh(g, g.bound_views(i), unpacked)
    name = f"{g.component}.{e.name}"
    if e.name in snr:
        engine.snr[name] = snr[e.name]
        engine.requantized[name] = (what, snr[e.name])

"""Pipeline and module operations after :func:`tritoff.enable`: they work, or are refused in one line saying what to do.

tritoff owns where every managed weight lives, so operations that would move, cast, re-hook or rebuild those weights
behind its back are intercepted on the enabled pipeline and its components (instance attributes shadowing the
methods; :func:`remove` gives the originals back):

- ``.to(...)``, ``.cuda()``, ``.cpu()``, ``.half()``, ``share_memory()``... (all through ``nn.Module._apply``) on the
  pipeline, a component or any of its submodules: a move or cast that leaves every managed weight where and what it
  is (``pipe.to("cuda")`` with tritoff on that GPU, ``.to(memory_format=torch.channels_last)``) works and leaves them
  as tritoff lays them out; one that would move managed weights elsewhere or change their dtype is refused before
  anything moves (a block cast on its own would fill its placeholders to full size, or, inside a forward, cast the
  slot it computes from);
- diffusers' offloading (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``, ``enable_group_offload``),
  ``enable_layerwise_casting`` and ``remove_all_hooks``: refused, since they would strip or fight tritoff's hooks;
- ``fuse_qkv_projections``, and an attention module's own ``fuse_projections``: refused, since they would
  concatenate placeholders; fusing before ``enable`` works;
- ``save_pretrained``: refused, since it would write placeholders as weights; ``Engine.save`` writes the packs;
- ``to_empty(...)`` on a component or any of its submodules: refused, since it would leave the buffers uninitialized
  (it keeps dtype and device, so the ``_apply`` check above would let it through);
- copying and pickling (``copy.deepcopy``, ``pickle``, ``torch.save`` of a module, all through ``__reduce_ex__``):
  refused, since the copy would hold placeholders and share the original's hooks;
- ``load_state_dict(...)`` of a component or any of its submodules naming a managed weight: refused, since it would
  write into placeholders (or, with ``assign=True``, replace weights tritoff holds); one naming only other tensors
  (peft's adapter weights) works;
- ``block.compile(...)`` on a streamed or fp8-resident block (what diffusers' ``compile_repeated_blocks`` calls):
  compiles the block's own forward, inside tritoff's hooks rather than around them, so ``fullgraph=True`` works and
  binding the block's weights to a slot is never traced. ``component.compile(fullgraph=True)`` on a component split
  into blocks is refused (tritoff's hooks, on resident blocks too, are graph breaks inside it); without ``fullgraph``
  it works. A module compiled before ``enable`` has its own forward compiled the same way inside the hooks
  (:func:`compile_inside_hooks`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from tritoff.chain import registry_slot

DISABLE_FIRST = "call tritoff.disable(pipe) first"
REFUSED = {
    "enable_model_cpu_offload": f"tritoff already places every weight within its budget; {DISABLE_FIRST} to use "
    "diffusers' offloading instead",
    "enable_sequential_cpu_offload": f"tritoff already places every weight within its budget; {DISABLE_FIRST} to "
    "use diffusers' offloading instead",
    "enable_group_offload": f"tritoff already streams the weights group by group; {DISABLE_FIRST} to use diffusers' "
    "group offloading instead",
    "enable_layerwise_casting": f"tritoff already stores the weights in its packs (storage=...); {DISABLE_FIRST} to "
    "use diffusers' layerwise casting instead",
    "remove_all_hooks": "the hooks on this pipeline are tritoff's: call tritoff.disable(pipe) to remove them",
    "fuse_qkv_projections": "fuse_qkv_projections() after tritoff.enable would concatenate weights that live in "
    "tritoff's packs: call it before tritoff.enable (the fused projections are then packed)",
    # state_dict() gives the parameters as they are between forwards (placeholders): never written as weights
    "save_pretrained": f"the weights live in tritoff's packs, not in the modules; {DISABLE_FIRST} (it restores them), "
    "or engine.save(directory) to write the packs as a store",
    # what copy.copy, copy.deepcopy, pickle and torch.save(module) call: the copy would hold placeholders and share
    # the original's hooks
    "__reduce_ex__": f"the weights live in tritoff's packs, not in the modules; {DISABLE_FIRST} (it restores them), "
    "then copy or save",
}
# on every submodule of a component: diffusers' per-attention fusing (what fuse_qkv_projections calls on each)
SUBMODULE_REFUSED = {
    "__reduce_ex__": REFUSED["__reduce_ex__"],
    "fuse_projections": "fusing an attention's projections after tritoff.enable would concatenate weights that live "
    "in tritoff's packs: fuse them before tritoff.enable (the fused projections are then packed)",
    # it keeps device and dtype, so the _apply check lets it through, and would fill buffers with uninitialized memory
    "to_empty": "it would give the module's tensors uninitialized memory while its weights live in tritoff's packs; "
    f"{DISABLE_FIRST}",
}
# how a refusal names what was called
CALLED = {"__reduce_ex__": "copying or pickling (copy.deepcopy, pickle, torch.save of a module)"}


def _refusal(name: str, message: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{CALLED.get(name, name + '()')}: {message}")

    refuse._tritoff = True
    return refuse


def refuse(objects, refusals: dict[str, str]) -> None:
    """Shadow each method named in ``refusals`` on each of ``objects`` (where its class has it and nothing shadows it
    yet) with a one-line refusal carrying its message; :func:`remove` takes them off."""
    for obj in {id(o): o for o in objects}.values():
        for name, message in refusals.items():
            if callable(getattr(type(obj), name, None)) and name not in obj.__dict__:
                setattr(obj, name, _refusal(name, message))


def install(
    target,
    components: dict,
    device: torch.device,
    blocks=(),
    managed: frozenset | set = frozenset(),
    leaf=False,
    lookups=(),
) -> None:
    """Intercept the operations above on ``target`` (a pipeline or module), on each of its ``components`` and on the
    hooked ``blocks`` (layers when ``leaf``); ``managed``: the ids of the parameters tritoff holds the weights of;
    ``lookups``: the layers looking up tables kept in host memory."""
    for block in blocks:
        install_block(block)
    refuse((target, *components.values()), REFUSED)
    hooked, looked_up = {id(b) for b in blocks}, {id(m) for m in lookups}
    host = {id(m.weight) for m in lookups}
    for name, module in components.items():
        for sub_name, sub in module.named_modules():  # any submodule may be moved, cast or loaded on its own
            where = f"{name}.{sub_name}" if sub_name else name
            if "_apply" not in sub.__dict__:
                sub._apply = _guarded_apply(sub, where, device, managed, host)
            if "load_state_dict" not in sub.__dict__:
                sub.load_state_dict = _guarded_load_state_dict(sub, where)
        # or copied or pickled on its own: its copy would hold placeholders (and could not pickle the guards above)
        refuse(list(module.modules()), SUBMODULE_REFUSED)
        # a module holding hooked ones compiled with fullgraph=True: the hooks are graph breaks inside it (the
        # component; in leaf mode, also each block and attention holding hooked layers)
        for sub_name, sub in module.named_modules():
            if "compile" in sub.__dict__ or id(sub) in hooked or id(sub) in looked_up:
                continue
            inside = {id(m) for m in sub.modules()}
            where = f"{name}.{sub_name}" if sub_name else name
            if inside & hooked:
                sub.compile = _compile_around_hooks(sub, where, name, leaf)
            elif inside & looked_up:
                sub.compile = _compile_around_lookups(sub, where)
    if not isinstance(target, torch.nn.Module) and callable(getattr(target, "to", None)) and "to" not in vars(target):
        target.to = _guarded_to(target, components, device, host)


def remove(target, components: dict, blocks=(), also=()) -> None:
    """Give back the methods :func:`install` shadowed (a block compiled meanwhile stays compiled), and those named in
    ``also`` that :func:`refuse` shadowed."""
    subs = [sub for module in components.values() for sub in module.modules()]
    for obj in (target, *components.values(), *blocks, *subs):
        for name in (*REFUSED, *SUBMODULE_REFUSED, "_apply", "to", "compile", "load_state_dict", *also):
            if getattr(obj.__dict__.get(name), "_tritoff", False):
                delattr(obj, name)


def _check(module: torch.nn.Module, component: str, fn, device: torch.device, host=frozenset()) -> None:
    """Refuse a move or cast ``fn`` (what ``_apply`` applies to each tensor) that would change a managed weight;
    ``host``: the ids of tables looked up in host memory, which a move leaves there (a cast would change them)."""
    from tritoff.adapters import named_parameters

    for dtype, where, hosted in {(p.dtype, p.device, id(p) in host) for _, p in named_parameters(module)}:
        # what the move or cast would do to a managed weight of this dtype, tried on an empty tensor
        probe = fn(torch.empty(0, dtype=dtype, device=where))
        if probe.dtype != dtype or (probe.device != where and not hosted):
            change = f"to {probe.dtype}" if probe.dtype != dtype else f"to {probe.device}"
            raise RuntimeError(
                f"moving or casting {component} {change}: its weights live in tritoff's packs and are placed on "
                f"{device} by tritoff; call tritoff.disable(pipe) first (it leaves ordinary modules holding the "
                "dequantized weights), or reload the pipeline in the dtype you want before tritoff.enable"
            )


def install_block(block: torch.nn.Module) -> None:
    """Make ``block.compile(...)`` compile the hooked block's own forward (inside tritoff's hooks)."""
    if "compile" not in block.__dict__:
        block.compile = _compile_inside_hooks(block)


def remove_block(block: torch.nn.Module) -> None:
    """Undo :func:`install_block`."""
    if getattr(block.__dict__.get("compile"), "_tritoff", False):
        del block.compile


class Recompile(NamedTuple):
    """How a module was compiled, to compile another function of it the same way."""

    compile: Callable  # function -> compiled function
    fullgraph: bool


def compiled_with(module: torch.nn.Module) -> Recompile | None | bool:
    """How ``module.compile(...)`` (what ``compile_repeated_blocks`` calls) compiled ``module``: None when it is not
    compiled that way, False when it is but torch keeps how where tritoff cannot read it.

    The compiled call is a function torch.compile made of the module's ``_call_impl``, over the dynamo context that
    holds every option given (backend, mode, fullgraph, dynamic): the same context compiles another function the same
    way (it is what ``torch._dynamo.optimize(...)`` returns, a decorator for any number of functions)."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None or getattr(compiled, "__func__", None) is torch.nn.Module._call_impl:  # compile(disable=True)
        return None
    known = getattr(compiled, "_tritoff_recompile", None)  # compiled by restore_forward
    if known is not None:
        return known
    code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    context = next((cell.cell_contents for name, cell in zip(names, cells, strict=False) if name == "self"), None)
    fullgraph = _fullgraph(context)
    if callable(context) and fullgraph is not None:
        return Recompile(context, fullgraph)
    return False


def _fullgraph(context) -> bool | None:
    """The ``fullgraph`` option a dynamo context holds, or None where it cannot be read. torch 2.8 on keeps it on the
    context; torch 2.6 and 2.7 only in its frame converter: the one that asserts one graph (``fullgraph=True``), or
    one falling back on graph breaks that holds such a converter inside (``_one_graph`` False)."""
    fullgraph = getattr(context, "fullgraph", None)
    if isinstance(fullgraph, bool):
        return fullgraph
    convert = getattr(getattr(context, "callback", None), "_torchdynamo_orig_callable", None)
    for converter in (convert, getattr(convert, "_inner_convert", None)):
        one_graph = getattr(converter, "_one_graph", None)
        if isinstance(one_graph, bool):
            return one_graph
    return None


def check_compiled(hooked: dict[str, list[torch.nn.Module]], components: dict[str, torch.nn.Module]) -> None:
    """Refuse, before anything changes, a module compiled before ``enable`` that holds modules tritoff hooks
    (``hooked``, per component) and was compiled with ``fullgraph=True``: the hooks inside are graph breaks. Warn of
    one whose options this torch keeps where tritoff cannot read them: its compiled call stays around the hooks, as
    without :func:`compile_inside_hooks` (graph breaks; with ``fullgraph=True``, an error at its first call)."""
    unread = []
    for name, component in components.items():
        inside = {id(m) for m in hooked[name]}
        for sub_name, module in component.named_modules():
            how = compiled_with(module)
            if how is None:
                how = compiled_inside_hooks(module)
            # a submodule given as torch.compile(layer, fullgraph=True): its graph holds the layer's hooks too
            wrapped_whole = type(module).__name__ == "OptimizedModule" and _fullgraph(
                getattr(module, "dynamo_ctx", None)
            )
            if how is None and not wrapped_whole:
                continue
            where = f"{name}.{sub_name}" if sub_name else name
            holds = any(id(m) in inside for m in module.modules() if m is not module)
            if how is False and (holds or id(module) in inside):
                unread.append(where)
            if holds and (wrapped_whole or (how and how.fullgraph)):
                raise ValueError(
                    f"{where} is compiled with fullgraph=True, and tritoff's hooks on modules inside it (blocks; "
                    "layers in leaf mode; lookups of embedding tables kept in host memory) would be graph breaks; "
                    "compile it again without fullgraph, or, in group mode, compile each block "
                    f"({name}.compile_repeated_blocks(fullgraph=True))"
                )
    if unread:
        from tritoff.warn import warn

        warn(
            f"{', '.join(unread[:3])}{', ...' if len(unread) > 3 else ''} compiled before tritoff.enable in a way "
            "tritoff cannot read (its options): the compiled call stays around tritoff's hooks, which are graph "
            "breaks there (an error with fullgraph=True); compile after tritoff.enable to compile inside them"
        )


def check_compiled_wrappers(wrapped: dict[str, torch.nn.Module]) -> None:
    """Refuse a component given as ``torch.compile(component, fullgraph=True)``: tritoff's hooks, on the component
    itself and its blocks, run inside that graph and break it (``wrapped``: the components as the pipeline holds
    them)."""
    for name, module in wrapped.items():
        if type(module).__name__ == "OptimizedModule" and _fullgraph(getattr(module, "dynamo_ctx", None)):
            raise ValueError(
                f"{name} is torch.compile(..., fullgraph=True): tritoff's hooks on it and its blocks would be graph "
                f"breaks inside that graph; compile it without fullgraph, or compile each block after tritoff.enable "
                f"({name}.compile_repeated_blocks(fullgraph=True))"
            )


def compiled_inside_hooks(module: torch.nn.Module) -> Recompile | None:
    """How a module's own forward was compiled inside tritoff's hooks (of an engine enabled now, or torn down for a
    re-plan), or None."""
    for name in ("_old_forward", "forward"):
        compiled = getattr(module.__dict__.get(name), "_tritoff_compile", None)
        if compiled is not None:
            return compiled[1]
    return None


def compile_inside_hooks(module: torch.nn.Module) -> None:
    """A module tritoff just hooked that was compiled before (``module.compile(...)``): its compiled call would run
    tritoff's hooks inside the graph (a graph break, an error with ``fullgraph=True``), so its own forward is compiled
    instead, the same way, between the hooks (:func:`check_compiled` refused what cannot be)."""
    how = compiled_with(module)
    if how:
        del module.__dict__["_compiled_call_impl"]
        _compile_forward(module, how)


def _compile_forward(module: torch.nn.Module, how: Recompile) -> None:
    # accelerate keeps the module's original forward here and calls it between the hooks; compiled already, it is
    # compiled again from its original (as module.compile(...) replaces an earlier compile)
    original = module._old_forward
    original = getattr(original, "_tritoff_compile", (original,))[0]
    module._old_forward = how.compile(original)
    module._old_forward._tritoff_compile = (original, how)


def _compile_inside_hooks(block: torch.nn.Module):
    def compile(*args, **kwargs):
        """``torch.compile`` the block's own forward; tritoff's hooks run around it, uncompiled."""
        how = Recompile(lambda fn: torch.compile(fn, *args, **kwargs), bool(kwargs.get("fullgraph")))
        _compile_forward(block, how)

    compile._tritoff = True
    return compile


def restore_forward(module: torch.nn.Module) -> None:
    """After accelerate's hook removal, which leaves ``module.forward`` as an instance attribute: drop it when it is
    the class's own forward, and turn a forward compiled inside tritoff's hooks into an ordinary ``module.compile``
    with the same options. A compiled closure over the module would otherwise follow it into copies (which would then
    compute with this module's weights) and make it unpicklable."""
    slot = registry_slot(module)  # under diffusers' hooks (a cache), the forward is the one their innermost calls
    forward = module.__dict__.get("forward") if slot is None else getattr(*slot)
    compiled = getattr(forward, "_tritoff_compile", None)
    original = compiled[0] if compiled is not None else forward
    own = getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is getattr(
        type(module), "forward", None
    )
    if not own:  # someone else's forward (a patch from before enable): left as it is
        return
    if slot is None:
        del module.forward
    else:
        setattr(*slot, original)
    if compiled is not None:
        how = compiled[1]
        module._compiled_call_impl = how.compile(module._call_impl)  # what module.compile(...) does
        module._compiled_call_impl._tritoff_recompile = how


def _compile_around_hooks(module: torch.nn.Module, where: str, component: str, leaf: bool):
    if leaf:
        return _refusing_fullgraph(
            module,
            f"{where}.compile(fullgraph=True): tritoff's hooks on the layers inside it (mode='leaf') are graph breaks "
            "inside it; drop fullgraph, or enable with mode='group' and compile each block "
            f"({component}.compile_repeated_blocks(fullgraph=True))",
        )
    return _refusing_fullgraph(
        module,
        f"{where}.compile(fullgraph=True): tritoff's hooks on its blocks (resident ones too: a re-plan may stream "
        f"them) are graph breaks inside it; use {component}.compile_repeated_blocks(fullgraph=True) (each block's "
        "own forward compiles as one graph), or drop fullgraph",
    )


def _compile_around_lookups(module: torch.nn.Module, where: str):
    return _refusing_fullgraph(
        module,
        f"{where}.compile(fullgraph=True): an embedding table it looks up stays in host memory, and tritoff's lookup "
        "there is a graph break inside it; drop fullgraph (the lookup runs between graphs)",
    )


def _refusing_fullgraph(module: torch.nn.Module, message: str):
    """``module.compile``, refusing ``fullgraph=True`` with ``message``: tritoff's hooks inside are graph breaks."""
    original = module.compile

    @functools.wraps(original)
    def compile(*args, **kwargs):
        if kwargs.get("fullgraph"):
            raise RuntimeError(message)
        return original(*args, **kwargs)

    compile._tritoff = True
    return compile


def _guarded_apply(module: torch.nn.Module, component: str, device: torch.device, managed, host=frozenset()):
    original = module._apply  # nn.Module's, bound

    @functools.wraps(original)
    def _apply(fn, *args, **kwargs):
        _check(module, component, fn, device, host)

        # what passes the check keeps device and dtype, and may still rebuild a tensor (a memory format, shared
        # memory): the managed weights stay as tritoff lays them out (a placeholder made dense would take the
        # weight's full size), everything else (buffers, adapters, parameters added since) is converted
        def convert(t):
            return t if id(t) in managed else fn(t)

        if not torch.__future__.get_overwrite_module_params_on_conversion():
            return original(convert, *args, **kwargs)
        # torch then wraps every parameter, even one handed back as it is, in a new nn.Parameter: put tritoff's back
        places = [(sub._parameters, k, p) for sub in module.modules() for k, p in sub._parameters.items()]
        result = original(convert, *args, **kwargs)
        for owner, key, param in places:
            if id(param) in managed:
                owner[key] = param
        return result

    _apply._tritoff = True
    return _apply


def _guarded_load_state_dict(module: torch.nn.Module, component: str):
    """``module.load_state_dict``, refusing a state dict that names a weight tritoff manages (adapter weights pass)."""
    from tritoff.adapters import named_parameters

    original = module.load_state_dict

    @functools.wraps(original)
    def load_state_dict(state_dict, *args, **kwargs):
        # every name of a managed weight: before adapters, and as the module names it now (tied, in a tuner layer)
        own = dict(named_parameters(module))
        ids = {id(p) for p in own.values()}
        managed = {*own, *(n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids)}
        hit = next((key for key in state_dict if key in managed), None)
        if hit is not None:
            raise RuntimeError(
                f"load_state_dict naming {component}.{hit}: the weights live in tritoff's packs, not in the modules; "
                f"{DISABLE_FIRST}, load the weights, then enable again"
            )
        return original(state_dict, *args, **kwargs)

    load_state_dict._tritoff = True
    return load_state_dict


def _guarded_to(pipe, components: dict, device: torch.device, host=frozenset()):
    """``pipe.to``: every component is checked before any moves, so a refusal leaves the whole pipeline as it was."""
    original = pipe.to

    @functools.wraps(original)
    def to(*args, **kwargs):
        options = {k: v for k, v in kwargs.items() if k in ("device", "dtype")}
        try:
            where, dtype, _, _ = torch._C._nn._parse_to(*args, **options)
        except (TypeError, RuntimeError):  # arguments only diffusers understands: each component checks itself
            return original(*args, **kwargs)

        def fn(t):
            return t.to(where, dtype if t.is_floating_point() or t.is_complex() else None)

        for name, module in components.items():
            _check(module, name, fn, device, host)
        return original(*args, **kwargs)

    to._tritoff = True
    return to

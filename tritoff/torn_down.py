"""What ``engine.teardown()`` leaves on a pipeline: refusals, in one line, to run or fuse into placeholders.

Teardown frees the GPU without dequantizing, so every managed parameter is a placeholder (a NaN scalar expanded to
its shape). Until ``tritoff.disable`` (ordinary modules again) or ``tritoff.enable`` (tritoff again), each module
tritoff had hooked refuses a forward (a forward pre-hook, so a block or a ``ModuleList``'s children called directly
refuse too) and diffusers' ``encode``/``decode`` (which call ``module._hf_hook.pre_forward`` and never ``forward``);
the pipeline and its components refuse ``fuse_lora``/``unfuse_lora`` (they would write into placeholders) and keep
the refusals of an enabled pipeline (``tritoff/operations.py``): ``save_pretrained`` would write NaN weights,
``fuse_qkv_projections`` would build real weights from placeholders, a move or cast would make each placeholder a
full-size NaN tensor, and so would a copy. A submodule reached below the hooked ones (a block's Linear, a VAE's
``tiled_decode``) reads the placeholders as it would on an enabled pipeline: NaN, never a plausible value.
"""

from __future__ import annotations

import torch.nn as nn
from accelerate.hooks import ModelHook

MESSAGE = (
    "holds no weights: its tritoff engine was torn down (engine.teardown()); call tritoff.disable(pipe) for ordinary "
    "modules, or tritoff.enable(pipe, ...) to run with tritoff again"
)
FUSING = ("fuse_lora", "unfuse_lora")


class TornDown(ModelHook):
    """A forward pre-hook, and a stand-in ``_hf_hook`` for diffusers' encode/decode, that refuses to run (an
    accelerate hook, so ``remove_hook_from_module`` can take it off)."""

    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def __call__(self, module: nn.Module, args) -> None:
        self.pre_forward(module)

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        """Refuse: the module's parameters are placeholders."""
        raise RuntimeError(f"{self.component} {MESSAGE}")


def guard(engine) -> list:
    """Install the refusals on what ``engine`` had hooked (its ``_unhooked`` modules), its target and components;
    returns what :func:`unguard` removes."""
    from tritoff import operations

    operations.install(engine.target, engine.components, engine.options.device, managed=engine.managed_ids)
    names = {id(m): name for name, component in engine.components.items() for m in component.modules()}
    handles = []
    for module in engine._unhooked:
        refusal = TornDown(names.get(id(module), type(module).__name__))
        handles.append(module.register_forward_pre_hook(refusal))
        if "_hf_hook" not in module.__dict__:
            module._hf_hook = refusal
    operations.refuse(
        (engine.target, *engine.components.values()), {name: f"the pipeline {MESSAGE}" for name in FUSING}
    )
    return handles


def unguard(engine, handles: list | None) -> None:
    """Remove what :func:`guard` installed (``handles``: what it returned; None: nothing is installed)."""
    from tritoff import operations

    if handles is None:
        return
    operations.remove(engine.target, engine.components, also=FUSING)
    for handle in handles:
        handle.remove()
    for module in engine._unhooked:
        if isinstance(module.__dict__.get("_hf_hook"), TornDown):
            del module._hf_hook

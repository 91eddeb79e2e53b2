"""Adapters (peft's LoRA layers) beside tritoff's packs: which parameters are the model's and which are adapters'.

peft wraps each adapted layer (``blocks.0.attn1.to_q``) in a tuner layer that holds the original module as
``base_layer`` and the adapter weights in new submodules (``lora_A``, ``lora_B``...). tritoff packs the model's own
parameters under the names they had before any adapter was injected (``blocks.0.attn1.to_q.weight``, never
``...to_q.base_layer.weight``), so packs, skip rules, groups and store fingerprints are the same with or without
adapters, whether they are loaded before or after :func:`tritoff.enable`. Adapter parameters never enter a pack: they
are small and stay resident on the compute device in the dtype peft gives them (the base layer's).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

_TUNER: list = []  # peft's BaseTunerLayer once imported (or None without peft): asked on every module registration


def tuner_layer_class() -> type | None:
    """peft's ``BaseTunerLayer``, or None without peft."""
    if not _TUNER:
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:
            BaseTunerLayer = None
        _TUNER.append(BaseTunerLayer)
    return _TUNER[0]


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer (an adapted layer wrapping its ``base_layer``)."""
    cls = tuner_layer_class()
    return cls is not None and isinstance(module, cls) and hasattr(module, "get_base_layer")


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """Every peft tuner layer under ``model``."""
    cls = tuner_layer_class()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls) and hasattr(m, "get_base_layer")]


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` as it was before adapters were injected: a tuner layer is replaced by its base layer
    (under the tuner layer's name) and adapter submodules are left out."""
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str):
        while is_tuner_layer(module):
            module = module.get_base_layer()
        if id(module) in seen:
            return
        seen.add(id(module))
        yield prefix, module
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}.{name}" if prefix else name)

    yield from walk(model, "")


def outer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Like :func:`named_modules`, but an adapted layer is its tuner layer (the module its parent calls), not the base
    layer inside: where a hook must sit so that it runs around the adapter's own use of the base weights."""
    outer = {}

    def walk(module: nn.Module, prefix: str):
        outer.setdefault(prefix, module)
        while is_tuner_layer(module):
            module = module.get_base_layer()
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    return outer


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The model's own parameters under their names before adapters were injected (no adapter parameter)."""
    seen: set[int] = set()
    for prefix, module in named_modules(model):
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield (f"{prefix}.{name}" if prefix else name), param


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters peft added to ``model`` (adapter weights): every parameter that is not the model's own."""
    own = {id(p) for _, p in named_parameters(model)}
    return [p for p in model.parameters() if id(p) not in own]


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of the adapter parameters of ``model``."""
    return sum(p.numel() * p.element_size() for p in adapter_parameters(model))


def move_adapters(model: nn.Module, device: torch.device) -> None:
    """Put every adapter parameter on ``device`` (their dtype is peft's choice: the base layer's)."""
    for param in adapter_parameters(model):
        if param.device != device:
            param.data = param.data.to(device)


def adapter_names(model: nn.Module) -> frozenset[str]:
    """Names of the peft adapters injected into ``model`` (diffusers and peft keep them in ``peft_config``)."""
    config = getattr(model, "peft_config", None)
    return frozenset(config) if isinstance(config, dict) else frozenset()


def merged_adapters(model: nn.Module) -> list[str]:
    """Names of the adapters fused into ``model``'s weights (peft's ``merged_adapters``), sorted."""
    return sorted({a for layer in tuner_layers(model) for a in getattr(layer, "merged_adapters", ())})

"""Which weights are quantized and which stay in the model's own dtype.

Only the floating-point ``weight`` (of two bytes or more per element) of ``nn.Linear`` and ``nn.Conv*`` layers is
quantized. Everything else keeps its dtype: integer, bool and already-fp8 weights (fp8 would change their values or
gain nothing), biases, embeddings, bare ``nn.Parameter``s (Wan's ``scale_shift_table``), buffers, and every layer whose
name matches a skip pattern: diffusers' layerwise-casting defaults, the embedders, the timestep/conditioning path and
modulation layers (fp8 there ruins images), the final layers, the model's own ``_skip_layerwise_casting_patterns`` and
``_keep_in_fp32_modules``, and the user's patterns; and every layer inside a module of a conditioning class (an
adaptive norm, a timestep embedding, a modulation), whatever its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

# diffusers' layerwise-casting defaults (regexes searched in the module's qualified name)
DIFFUSERS_DEFAULT_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
# the conditioning path and the layers around the blocks, by name: embedders of every kind (patch, positional, text,
# timestep: x_embedder, context_embedder, time_text_embed, ...), the timestep and guidance path (Chroma's
# distilled_guidance_layer makes every modulation vector), modulation layers (QwenImage's img_mod and txt_mod,
# LTX-2's scale_shift), SkyReels-V2's fps projection (added to the timestep's modulation) and the final layers
# (Cosmos' and Z-Image's final_layer, LTX-2's audio_proj_in/out, Kandinsky 5's out_layer)
CONDITIONING_PATTERNS = (
    "embed",
    "timestep",
    "time_proj",
    "guidance",
    "modulation",
    "adaln",
    r"_mod\b",
    "scale_shift",
    "fps_projection",
    "final_layer",
    r"^\w*proj_(in|out)$",
    r"^out_layer\b",
)
# the same by the class of a module holding the layer: diffusers' adaptive norms, timestep embeddings and modulation
# layers under any attribute name (LTX-2's cross-attention gates are LTX2AdaLayerNormSingle modules named *_gate)
CONDITIONING_CLASSES = r"AdaLayerNorm|Timestep|Modulation"

QUANTIZABLE_LAYERS = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


@dataclass(frozen=True)
class SkipRules:
    """Skip patterns (regexes over module names) and kept-in-fp32 module names (exact name components)."""

    patterns: tuple[str, ...] = DIFFUSERS_DEFAULT_PATTERNS + CONDITIONING_PATTERNS
    keep_modules: tuple[str, ...] = ()

    @classmethod
    def for_model(cls, model: nn.Module, extra: Iterable[str] = ()) -> SkipRules:
        """The default rules plus ``model``'s own skip lists and the user's ``extra`` patterns."""
        extra = skip_patterns(extra)
        for pattern in extra:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"skip pattern {pattern!r} is not a valid regular expression: {err}") from None
        own = tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or ())
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        return cls(patterns=cls.patterns + own + extra, keep_modules=keep)

    def skips_module(self, name: str) -> bool:
        """True when the module called ``name`` keeps its weights in their own dtype."""
        if any(part in self.keep_modules for part in name.split(".")):
            return True
        return any(re.search(p, name, flags=re.IGNORECASE) for p in self.patterns)

    def quantized_names(self, model: nn.Module) -> set[str]:
        """Qualified names of the parameters of ``model`` that are quantized."""
        names, kept = set(), []
        from tritoff.adapters import named_modules

        for module_name, module in named_modules(model):  # names before adapters were injected, parents first
            if re.search(CONDITIONING_CLASSES, type(module).__name__):
                kept.append(module_name + ".")
            if any((module_name + ".").startswith(prefix) for prefix in kept):
                continue
            if isinstance(module, QUANTIZABLE_LAYERS) and not self.skips_module(module_name):
                if _quantizable(getattr(module, "weight", None)):
                    names.add(f"{module_name}.weight" if module_name else "weight")
        return names


def _quantizable(weight) -> bool:
    # integer and bool weights would come back as other values, fp8 ones would gain nothing
    return weight is not None and weight.is_floating_point() and weight.element_size() > 1


def skip_patterns(skip: str | Iterable[str] | None) -> tuple[str, ...]:
    """The user's ``skip`` as a tuple of patterns: one string is one pattern (not one pattern per character)."""
    if skip is None:
        return ()
    patterns = (skip,) if isinstance(skip, str) else tuple(skip) if isinstance(skip, Iterable) else (skip,)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"skip takes regular expressions of module names (a string or a list), got {pattern!r}")
        if not pattern.strip():  # it would match every module: nothing would be quantized
            raise ValueError("skip has an empty pattern, which matches every module: leave it out (skip=() skips none)")
    return patterns


def warn_unmatched(skip, components: dict[str, nn.Module]) -> None:
    """Warn, for each of the user's ``skip`` patterns that keeps no weight of ``components`` (those stored in fp8)
    unquantized that the defaults quantize, that it changes nothing: a misspelt pattern, or one naming a module above
    the layers (``attn1$``), would otherwise quantize what it meant to keep without a word."""
    from tritoff.warn import warn

    patterns = skip_patterns(skip)
    if not patterns or not components:
        return
    quantized = {name: SkipRules.for_model(m, ()).quantized_names(m) for name, m in components.items()}
    largest = max(quantized, key=lambda name: len(quantized[name]))
    first = min(quantized[largest], default="weight")  # "weight": the module is the layer itself
    example = f"names such as {first.removesuffix('.weight')!r}" if "." in first else "the module itself, named ''"
    for pattern in patterns:
        if all(SkipRules.for_model(m, (pattern,)).quantized_names(m) == quantized[n] for n, m in components.items()):
            warn(
                f"skip pattern {pattern!r} keeps nothing unquantized: it matches none of the quantized layers of "
                f"{', '.join(components)} ({example})"
            )

"""Full-size model shapes for the benchmarks, built without downloads: random weights of realistic scale.

Models are created on the meta device and materialized one parameter at a time. Random numbers are drawn on the GPU
when there is one: a Wan-14B transformer materializes there in about a second (14e9 normal draws and a cast), where
drawing it on the host takes minutes. ``device="cuda"`` leaves the weights on the GPU, which is what the GPU benchmarks
want: tritoff then quantizes them in place with its Triton kernel, and diffusers' offloading moves them to the host
itself. The default (the host) copies each parameter back as it is drawn, so building never holds more than the
model plus one parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tritoff.presets import (  # noqa: F401  (the benchmarks' full-size shapes)
    COGVIDEOX_5B,
    UMT5_XXL,
    WAN_14B,
    fp32_modules,
    tie_weights,
)
from tritoff.tiny import COGVIDEOX_TINY, WAN_TINY

# small but not tiny: what --smoke runs on the CPU
WAN_SMOKE = {**WAN_TINY, "num_layers": 4, "ffn_dim": 1024, "num_attention_heads": 4, "attention_head_dim": 32}
COGVIDEOX_SMOKE = {
    **COGVIDEOX_TINY,
    "num_layers": 4,
    "attention_head_dim": 16,
    "time_embed_dim": 8,
    "use_rotary_positional_embeddings": True,
}


LINEAR_CONV = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@torch.no_grad()
def build(
    cls, config: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: torch.device | str | None = None
) -> nn.Module:
    """``cls(**config)`` with random weights on ``device`` (default: the host), one parameter at a time (no full-size
    fp32 copy).

    Parameters start on the meta device (buffers such as RoPE tables are computed for real); each is drawn on the GPU
    when there is one, then cast and moved to ``device``: Linear/Conv weights N(0, 1/sqrt(fan_in)), 1-D weights 1,
    embeddings N(0, 1), the rest N(0, 0.02). Modules ``from_pretrained`` keeps in fp32 stay fp32
    (:func:`tritoff.presets.fp32_modules`). Tables transformers ties are tied, and tied parameters stay tied. Buffers
    are left where the model computed them (tritoff and diffusers' offloading move them); ``device="cuda"`` moves
    them too.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls(**config)
    tie_weights(model)  # built on meta, UMT5's input embeddings are a second 1 GB table until tied
    work = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(work).manual_seed(seed)
    keep = fp32_modules(model, dtype)  # transformers keeps UMT5's `wo` in fp32 only for fp16 loads
    made: dict[int, nn.Parameter] = {}  # id of a meta parameter -> its materialized twin (keeps ties)
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in made:
                module._parameters[name] = made[id(param)]
                continue
            t = torch.empty(param.shape, dtype=torch.float32, device=work)
            if name == "weight" and isinstance(module, LINEAR_CONV):
                t.normal_(0, param[0].numel() ** -0.5, generator=gen)
            elif isinstance(module, nn.Embedding):
                t.normal_(0, 1.0, generator=gen)
            elif name == "weight" and param.dim() == 1:
                t.fill_(1.0)
            else:
                t.normal_(0, 0.02, generator=gen)
            full = f"{module_name}.{name}" if module_name else name
            fp32 = dtype != torch.float32 and any(part in keep for part in full.split("."))
            made[id(param)] = module._parameters[name] = nn.Parameter(
                t.to(target, torch.float32 if fp32 else dtype), requires_grad=False
            )
    if target.type == "cuda":
        model.to(target)  # buffers
    return model.eval()

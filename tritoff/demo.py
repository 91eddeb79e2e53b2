"""The README's main job: quantize, pack and onload a locally built Wan transformer, then compare its output."""

from __future__ import annotations

import time

import torch

from tritoff.kernels.upcast import BLOCK, upcast_pack, upcast_pack_reference
from tritoff.packer import pack_model
from tritoff.snr import snr_db
from tritoff.tiny import tiny_wan_transformer


def _inputs(model, device, dtype):
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 3, 16, 16, generator=gen).to(device, dtype)
    text = torch.randn(1, 16, model.config.text_dim, generator=gen).to(device, dtype)
    return dict(
        hidden_states=latents,
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=text,
        return_dict=False,
    )


def run_demo(storage: str = "fp8_e4m3", device: str | None = None) -> dict:
    """Quantize a 4-block Wan transformer into packs, onload every pack through the kernel, report sizes and SNR."""
    from tritoff.kernels import triton_runs_on

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = tiny_wan_transformer(num_layers=4, num_attention_heads=4, attention_head_dim=32, ffn_dim=512).eval()
    model.to(device)
    dtype = torch.bfloat16
    with torch.no_grad():
        reference = model(**_inputs(model, device, dtype))[0].float()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = pack_model(model, storage, release=True)
    use_kernel = triton_runs_on(device)
    params = dict(model.named_parameters())
    start = time.perf_counter()
    for pack in packed.packs:
        layout = pack.layout
        out = torch.empty(layout.out_nbytes, dtype=torch.uint8, device=device)
        if use_kernel:
            upcast_pack(
                pack.data.to(device),
                out,
                layout.table(BLOCK, device),
                layout.n_programs(),
                layout.out_dtype,
                packed.storage,
            )
        else:
            upcast_pack_reference(pack.data, out, layout.table(), layout.out_dtype, packed.storage)
        for name, tensor in layout.views(out).items():
            params[name].data = tensor
    if device.type == "cuda":
        torch.cuda.synchronize()
    onload_s = time.perf_counter() - start
    with torch.no_grad():
        output = model(**_inputs(model, device, dtype))[0].float()
    quantized = sum(1 for p in packed.packs for e in p.layout.entries if e.kind == 1)
    tensors = sum(len(p.layout.entries) for p in packed.packs)
    return {
        "device": str(device),
        "kernel": ("triton-interpreter" if device.type == "cpu" else "triton") if use_kernel else "pytorch-reference",
        "storage": packed.storage.name,
        "groups": len(packed.packs),
        "tensors quantized / kept": f"{quantized} / {tensors - quantized}",
        "model bytes": model_bytes,
        "packed bytes": packed.packed_bytes,
        "host arena bytes": packed.arena.nbytes,
        "onload (all packs)": f"{onload_s * 1e3:.1f} ms",
        "output SNR vs bf16": f"{snr_db(reference, output):.1f} dB",
    }

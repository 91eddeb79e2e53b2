"""Helpers shared by the engine tests: tiny pipelines, their dequantized twins, deterministic calls."""

import ctypes
import threading
import types

import torch

from tritoff.adapters import named_parameters
from tritoff.pack import unpack_reference
from tritoff.packer import pack_model
from tritoff.storage import FP8, resolve_storage
from tritoff.tiny import tiny_cogvideox_pipeline, tiny_wan_pipeline

# blocks large enough that small budgets force streaming
BIG_WAN = dict(num_layers=4, ffn_dim=1024, num_attention_heads=4, attention_head_dim=32)
WAN_CALL = dict(
    prompt="a cat", num_frames=5, height=16, width=16, num_inference_steps=3, max_sequence_length=16, output_type="pt"
)
COG_CALL = dict(
    prompt="a cat", num_frames=9, height=16, width=16, num_inference_steps=2, max_sequence_length=16, output_type="pt"
)


def run(pipe, call=WAN_CALL, **overrides):
    """The pipeline's frames for a fixed seed."""
    return pipe(**{**call, **overrides}, generator=torch.Generator().manual_seed(0)).frames


def denoiser_calls(pipe, steps: int) -> dict[str, int]:
    """The forward calls a tiny Wan pipeline makes of each of its denoisers (``transformer``, and ``transformer_2``
    where it has one) in a run of ``steps`` steps, with CFG: two per timestep."""
    counts = {name: 0 for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None}
    handles = [
        getattr(pipe, name).register_forward_pre_hook(lambda *_, _n=name: counts.__setitem__(_n, counts[_n] + 1))
        for name in counts
    ]
    call = dict(prompt="a cat", negative_prompt="blurry", num_frames=5, height=16, width=16, max_sequence_length=16)
    try:
        pipe(**call, num_inference_steps=steps, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    return counts


def dequantize_in_place(module: torch.nn.Module, storage: str = "fp8_e4m3", skip=()) -> torch.nn.Module:
    """Replace every weight by what tritoff would compute with: its pack, dequantized by the reference."""
    packed = pack_model(module, storage, skip=skip, progress=False)
    params = dict(named_parameters(module))  # names before adapters were injected, as in the packs
    for pack in packed.packs:
        for name, tensor in unpack_reference(pack.layout, pack.data).items():
            params[name].data = tensor
    return module


def dequantized_pipeline(factory, storage="fp8_e4m3", **kwargs):
    """A pipeline from ``factory`` whose weights are replaced by the values tritoff computes with for ``storage``
    (what ``tritoff.enable`` takes: VAEs keep their own dtype unless named)."""
    pipe = factory(**kwargs)
    modules = {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    for name, fmt in resolve_storage(storage, modules).items():
        if fmt in FP8:
            dequantize_in_place(modules[name], fmt)
    return pipe


def wan(**kwargs):
    """The tiny Wan pipeline with blocks that dominate its size."""
    return tiny_wan_pipeline(**{**BIG_WAN, **kwargs})


def cogvideox(**kwargs):
    """The tiny CogVideoX pipeline."""
    return tiny_cogvideox_pipeline(**kwargs)


def lora_state_dict(
    model: torch.nn.Module, prefix="transformer", targets=("to_q", "to_k", "to_v"), rank=2, seed=1, use_dora=False
):
    """A LoRA (or DoRA) for ``model``'s architecture in the format ``pipe.load_lora_weights`` takes, with random A and
    B (peft's default leaves B at zero, which would change nothing)."""
    import copy

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    twin = copy.deepcopy(model)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False, use_dora=use_dora
    )
    twin.add_adapter(config)
    return {f"{prefix}.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(twin).items()}


class Stack(torch.nn.Module):
    """A small model of the usual shape: an input projection, a list of blocks of Linear layers, a head."""

    def __init__(self, n=5, width=64):
        super().__init__()
        self.proj_in = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
            for _ in range(n)
        )
        self.head = torch.nn.Linear(width, 16)

    def forward(self, x):
        x = self.proj_in(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def enable_at_minimum(model, tried=1, **options):
    """``tritoff.enable(model, **options)`` at the smallest budget it takes (named by the refusal of ``tried``): every
    group that can stream does."""
    import pytest

    import tritoff

    with pytest.raises(tritoff.BudgetError) as small:
        tritoff.enable(model, budget=tried, **options)
    return tritoff.enable(model, budget=small.value.minimum, **options)


def stack(seed=0, **kwargs):
    """A bf16 :class:`Stack` with weights drawn reproducibly from ``seed``."""
    from tritoff.tiny import realistic_init

    return realistic_init(Stack(**kwargs), seed=seed).to(torch.bfloat16).eval()


# the prototypes of the libcuda calls tritoff makes (cuMemcpyHtoDAsync_v2, cuGetErrorName, the rest unused here)
COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
NAME = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
ANY = ctypes.CFUNCTYPE(ctypes.c_int)


class StandInDriver:
    """libcuda's calls as ctypes function pointers (``lib``, for ``cuda_host.bind``): a copy is a memmove at once
    (between host buffers); the first ``refusals`` copies return ``code``, and with ``context`` False every copy
    returns CUDA_ERROR_INVALID_CONTEXT until :meth:`bind_context` runs."""

    def __init__(self, refusals: int = 0, code: int = 201, context: bool = True):
        self.calls, self.refusals, self.code, self.context, self.binds = [], refusals, code, context, 0
        self.names = {201: b"CUDA_ERROR_INVALID_CONTEXT", 1: b"CUDA_ERROR_INVALID_VALUE"}
        self.lib = types.SimpleNamespace(
            cuMemcpyHtoDAsync_v2=COPY(self._copy),
            cuGetErrorName=NAME(self._name),
            cuMemHostRegister_v2=ANY(lambda: 0),
            cuMemHostUnregister=ANY(lambda: 0),
        )

    def bind_context(self):
        """What a runtime call does on a thread without a context: make one current."""
        self.context, self.binds = True, self.binds + 1

    def _copy(self, dst, src, nbytes, stream):
        self.calls.append((dst, src, nbytes, stream))
        if not self.context:
            return 201
        if self.refusals:
            self.refusals -= 1
            return self.code
        ctypes.memmove(dst, src, nbytes)
        return 0

    def _name(self, code, out):
        out[0] = self.names[code]  # bytes kept alive by self.names
        return 0


def in_threads(work, threads: int) -> list[BaseException]:
    """Run ``work()`` on ``threads`` threads at once; the exceptions they raised."""
    errors = []

    def guarded():
        try:
            work()
        except Exception as err:  # noqa: BLE001 - handed back to the test
            errors.append(err)

    running = [threading.Thread(target=guarded) for _ in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return errors


ROPE = dict(attention_head_dim=16, num_attention_heads=2)
# tiny transformers of families beyond tritoff.tiny's pipelines: (diffusers class, config)
TINY_TRANSFORMERS = {
    "qwen-image": (
        "QwenImageTransformer2DModel",
        dict(
            ROPE,
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
    ),
    "chroma": (
        "ChromaTransformer2DModel",
        dict(
            ROPE,
            patch_size=1,
            in_channels=8,
            num_layers=1,
            num_single_layers=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
            approximator_num_channels=16,
            approximator_hidden_dim=32,
            approximator_layers=2,
        ),
    ),
    "skyreels-v2": (
        "SkyReelsV2Transformer3DModel",
        dict(
            ROPE,
            patch_size=(1, 2, 2),
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_max_seq_len=32,
            inject_sample_info=True,
        ),
    ),
    "hunyuan-video-1.5": (
        "HunyuanVideo15Transformer3DModel",
        dict(
            ROPE,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            num_refiner_layers=1,
            text_embed_dim=32,
            text_embed_2_dim=32,
            image_embed_dim=32,
            rope_axes_dim=(4, 6, 6),
        ),
    ),
    "sd3": (
        "SD3Transformer2DModel",
        dict(
            ROPE,
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_layers=3,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=16,
            out_channels=4,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ),
    ),
    "ltx-2": (
        "LTX2VideoTransformer3DModel",
        dict(
            in_channels=8,
            out_channels=8,
            num_attention_heads=2,
            attention_head_dim=16,
            cross_attention_dim=32,
            audio_in_channels=8,
            audio_out_channels=8,
            audio_num_attention_heads=2,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            num_layers=2,
            caption_channels=32,
        ),
    ),
}


def tiny_transformer(family: str) -> torch.nn.Module:
    """A tiny bf16 transformer of ``family`` (``TINY_TRANSFORMERS``) with realistic random weights."""
    import warnings

    import diffusers

    from tritoff.tiny import realistic_init

    cls, config = TINY_TRANSFORMERS[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():  # deprecations, "modules that should be kept in float32: []"
        warnings.simplefilter("ignore")
        return realistic_init(getattr(diffusers, cls)(**config)).to(torch.bfloat16).eval()

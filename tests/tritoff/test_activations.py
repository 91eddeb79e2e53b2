"""tritoff/activations.py: meta twins of components, and the peak bytes of the tensors a forward creates, counted on
the meta device as the GPU would allocate them (fused attention: no score matrix)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tritoff.activations import CUDA_SLACK, MARGIN, _PeakBytes, _pure, estimate, meta_twin, peak_bytes
from tritoff.tiny import WAN_VAE_TINY, tiny_cogvideox_transformer, tiny_umt5, tiny_wan_transformer

FP32 = 4


def _meta(factory):
    with torch.device("meta"):
        return factory()


class Attention(nn.Module):
    """q, k and v given: the only tensor the call creates is the attention's output."""

    def __init__(self, keywords: bool = False):
        super().__init__()
        self.keywords = keywords

    def forward(self, q, k, v):
        if self.keywords:
            return F.scaled_dot_product_attention(query=q, key=k, value=v)
        return F.scaled_dot_product_attention(q, k, v)


class Steps(nn.Module):
    """Element-wise steps whose peak is easy to count by hand, with data-dependent branches."""

    def forward(self, x):
        y = x * 2  # 400 bytes for a 10 x 10 fp32 input
        if (y > 0).all():  # read as True on the meta device: the unpadded path
            z = y + 1  # 400 bytes, with y alive
        else:
            z = torch.cat([y, y, y, y])  # 1600 bytes: the path a real run could take, never traced
        n = int(x.sum().item())  # read as 1; the 4-byte sum dies at once
        return z * n  # 400 bytes more, with y and z alive


class Untraceable(nn.Module):
    def forward(self, x):
        return torch.from_numpy(x.cpu().numpy())  # meta tensors hold no data


# -- peak_bytes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keywords", [False, True], ids=["positional", "keywords"])
def test_attention_counts_only_the_fused_kernels_output_never_the_score_matrix(keywords):
    q, k = torch.randn(2, 4, 100, 16), torch.randn(2, 4, 100, 16)
    v = torch.randn(2, 4, 100, 24)  # the output takes v's head size
    peak = peak_bytes(Attention(keywords), (q, k, v))
    assert peak == 2 * 4 * 100 * 24 * FP32  # 76800 bytes; the math fallback's scores alone would be 320000


def test_data_dependent_scalars_read_as_one_and_true():
    # y, z and the output (400 bytes each) alive together; the cat path would have taken 400 + 1600 + 1600
    assert peak_bytes(Steps(), (torch.randn(10, 10),)) == 1200


def test_kwargs_and_a_named_method_are_traced():
    class Two(nn.Module):
        def forward(self, x):
            raise AssertionError("forward was traced instead of the named method")

        def decode(self, x, *, scale):
            return (x * scale).exp()  # two 8 x 8 fp32 tensors alive at once at the peak

    assert peak_bytes(Two(), (torch.randn(8, 8),), {"scale": torch.randn(8, 8)}, method="decode") == 2 * 256


def test_tensors_that_die_are_subtracted_from_the_running_count():
    class Chain(nn.Module):
        def forward(self, x):
            for _ in range(10):
                x = x + 1  # each step frees the previous one: never more than two alive
            return x

    assert peak_bytes(Chain(), (torch.randn(16, 16),)) == 2 * 16 * 16 * FP32


def test_deaths_among_many_live_storages_are_counted_where_the_peak_could_rise():
    # dead storages are looked for only when the running count passes the peak, or when many may have died since
    class ManyAlive(nn.Module):
        def forward(self, x):
            kept = [x + i for i in range(100)]  # 100 storages of 16 bytes alive to the end
            for n in (1, 2, 16, 8, 4, 2, 1, 3):
                scratch = x.new_empty(n * 1024)  # n * 4096 bytes; the previous one is dead by now
                del scratch
            many = [x * i for i in range(200)]  # 200 more storages that die at once
            del many
            return kept, x.new_empty(16000)  # 64000 bytes beside the 1600 kept: under the peak, unless the dead count

    assert peak_bytes(ManyAlive(), (torch.randn(4),)) == 100 * 16 + 16 * 4096


def test_a_storage_counts_until_the_last_tensor_on_it_dies():
    class Matmul(nn.Module):
        def forward(self, x, w):
            y = x @ w  # mm, then _unsafe_view: a new tensor on the mm's storage, and the mm's tensor dies at once
            return y * 2  # y's storage is still alive beside the result

    assert peak_bytes(Matmul(), (torch.randn(2, 8, 16), torch.randn(16, 32))) == 2 * 2 * 8 * 32 * FP32


@pytest.mark.parametrize(
    "factory,shape,expected",
    [
        # x @ W.t() + b: a GPU allocates the 8 x 128 output only; W.t() is a view of the weight, not a new storage
        pytest.param(lambda: nn.Linear(64, 128), (8, 64), 8 * 128 * FP32, id="linear"),
        pytest.param(lambda: nn.Linear(64, 128, bias=False), (8, 64), 8 * 128 * FP32, id="linear-no-bias"),
        # Linear -> GELU -> Linear: the first output and the GELU's alive together (the second output is smaller)
        pytest.param(
            lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)),
            (8, 64),
            2 * 8 * 128 * FP32,
            id="mlp",
        ),
        # flattening the input is a view of it: nothing is allocated
        pytest.param(lambda: nn.Flatten(0), (8, 64), 0, id="view-of-the-input"),
    ],
)
def test_views_of_parameters_and_inputs_are_not_new_storage(factory, shape, expected):
    assert peak_bytes(_meta(factory), (torch.randn(shape),)) == expected


class _GrowInput(nn.Module):
    """Grows its (empty) input's storage in place: ``resize_``, or a matmul written through ``out=``."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, buffer, x):
        if self.how == "resize":
            buffer.resize_(32, 32)
        else:
            torch.mm(x, x, out=buffer)
        return buffer


@pytest.mark.parametrize("how", ["resize", "out"])
def test_an_input_grown_in_place_counts_the_growth(how):
    assert peak_bytes(_GrowInput(how), (torch.empty(0), torch.randn(32, 32))) == 32 * 32 * FP32


# -- the memo of repeated ops -------------------------------------------------------------------------------------


def _wan_vae_tiled():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**WAN_VAE_TINY).eval()
    vae.enable_tiling(32, 32, 16, 16)  # tiles of 32 pixels every 16: 9 overlapping tiles for a 48 x 48 frame
    return vae, "decode", (torch.randn(1, WAN_VAE_TINY["z_dim"], 2, 6, 6),), {"return_dict": False}


def _wan():
    model = tiny_wan_transformer(seed=1)
    text = torch.randn(1, 8, 32, dtype=torch.bfloat16)
    return model, "forward", (torch.randn(1, 16, 3, 16, 16, dtype=torch.bfloat16), torch.tensor([500]), text), {}


def _cogvideox():
    model = tiny_cogvideox_transformer(seed=1)
    config = model.config
    latents = torch.randn(1, 3, config.in_channels, 16, 16, dtype=torch.bfloat16)
    text = torch.randn(1, config.max_text_seq_length, config.text_embed_dim, dtype=torch.bfloat16)
    return model, "forward", (latents, text, torch.tensor([500])), {}


def _umt5():
    return tiny_umt5(torch.float16, seed=1), "forward", (torch.randint(0, 256, (2, 9)),), {}


@pytest.mark.parametrize(
    "component", [_wan_vae_tiled, _wan, _cogvideox, _umt5], ids=["wan-vae-tiled", "wan", "cogvideox", "umt5"]
)
def test_ops_answered_from_the_memo_trace_the_same_peak_as_every_meta_kernel(component):
    model, method, args, kwargs = component()
    twin = meta_twin(model)
    assert twin is not None
    remembered = peak_bytes(twin, args, kwargs, method)
    assert remembered == peak_bytes(twin, args, kwargs, method, memo=False) > 0


def test_a_repeated_op_is_answered_from_the_memo_with_outputs_of_its_size_and_dtype():
    x = torch.empty(16, 8, device="meta")
    with _PeakBytes() as tracker:
        first = x * 2
        again = x * 2
        other = x.int() * 2.0  # an int tensor times a float: float, not the int the same op on 2 gives
        integer = x.int() * 2
    tracker.release()
    assert tracker.hits == 2  # the second x * 2 and the second x.int()
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata  # a new storage, counted as one
    assert (other.dtype, integer.dtype) == (torch.float32, torch.int32)


def test_the_memo_keys_what_meta_kernels_read_besides_shapes_the_default_dtype_and_a_subclass():
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass that dispatches on its own

    x = torch.empty(16, dtype=torch.int64, device="meta")
    pair = TwoTensor(torch.empty(16, 8, device="meta"), torch.empty(16, 8, device="meta"))
    with _PeakBytes() as tracker:
        single = x * 1.5  # int times a float: the default dtype
        torch.set_default_dtype(torch.float64)
        try:
            double = x * 1.5
        finally:
            torch.set_default_dtype(torch.float32)
        torch.empty(16, 8, device="meta") * 2
        paired = pair * 2  # the same op on the same shape, through the subclass's own dispatch
    tracker.release()
    assert (single.dtype, double.dtype) == (torch.float32, torch.float64)
    assert type(paired) is TwoTensor


class _Aliases(nn.Module):
    """Three aliases of one new tensor, made by an op whose schema does not say it aliases (``_unsafe_view``)."""

    def forward(self, x):
        y = x * 2
        views = [torch.ops.aten._unsafe_view(y, [y.numel()]) for _ in range(3)]
        return y, views


def test_ops_that_write_to_or_alias_their_inputs_always_run():
    assert _pure(torch.ops.aten.mul.Tensor) and _pure(torch.ops.aten.convolution.default)
    assert not _pure(torch.ops.aten.add_.Tensor) and not _pure(torch.ops.aten.view.default)  # in place, a view
    assert not _pure(torch.ops.aten.mm.out)  # writes to its out= argument
    # _unsafe_view returns its input's storage: answered from the memo, each repeat would count 256 bytes more
    assert peak_bytes(_Aliases(), (torch.randn(8, 8),)) == peak_bytes(_Aliases(), (torch.randn(8, 8),), memo=False)
    assert peak_bytes(_Aliases(), (torch.randn(8, 8),)) == 8 * 8 * FP32


# -- estimate -----------------------------------------------------------------------------------------------------


def test_the_estimate_is_the_peak_with_the_margin_and_on_cuda_the_workspaces():
    args = (torch.randn(2, 4, 100, 16), torch.randn(2, 4, 100, 16), torch.randn(2, 4, 100, 24))
    host = estimate(Attention(), args, cuda=False)
    assert host == int(76800 * MARGIN) and 88000 < host <= 88320  # 76800 bytes traced, 15% on top
    assert estimate(Attention(), args) == host + CUDA_SLACK
    assert CUDA_SLACK == 64 * 2**20


def test_no_twin_or_an_untraceable_call_gives_no_estimate():
    assert estimate(None, (torch.randn(4),)) is None
    assert estimate(Untraceable(), (torch.randn(4),)) is None
    with pytest.raises(NotImplementedError):  # peak_bytes itself does not hide the failure
        peak_bytes(Untraceable(), (torch.randn(4),))


# -- meta_twin ----------------------------------------------------------------------------------------------------


def test_plain_modules_and_models_that_need_more_than_their_config_have_no_twin():
    assert meta_twin(nn.Linear(4, 4)) is None  # no config to rebuild it from

    class NeedsMore(nn.Module):
        def __init__(self, config, extra):
            super().__init__()
            self.config = config

    assert meta_twin(NeedsMore({"width": 4}, extra=1)) is None


def test_a_diffusers_twin_has_the_class_config_and_every_dtype_of_the_original():
    model = tiny_wan_transformer(seed=1)  # bf16 with fp32 modules, as from_pretrained loads it
    model.rope.freqs_cos = model.rope.freqs_cos.double()  # a buffer in a dtype the constructor would not give
    twin = meta_twin(model)
    assert type(twin) is type(model) and twin is not model
    assert twin.config == model.config and not twin.training
    params, twin_params = dict(model.named_parameters()), dict(twin.named_parameters())
    assert list(twin_params) == list(params)
    assert {p.dtype for p in params.values()} == {torch.bfloat16, torch.float32}
    for name, param in twin_params.items():
        assert param.is_meta and param.shape == params[name].shape and param.dtype == params[name].dtype, name
    buffers, twin_buffers = dict(model.named_buffers()), dict(twin.named_buffers())
    assert list(twin_buffers) == list(buffers) == ["rope.freqs_cos", "rope.freqs_sin"]
    assert twin_buffers["rope.freqs_cos"].dtype == torch.float64 and twin_buffers["rope.freqs_sin"].is_meta
    assert all(p.device.type == "cpu" for p in model.parameters())  # the original is untouched


class _LegacyParameter(nn.Module):
    """A parameter and a buffer made with the legacy ``torch.Tensor([...])`` constructor, which ignores the meta
    device (as diffusers' AlphaBlender makes its mix_factor, in Stable Video Diffusion's UNet and VAE)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.mix = nn.Parameter(torch.Tensor([0.5]))
        self.register_buffer("alpha", torch.Tensor([0.25]))  # AlphaBlender's merge_strategy="fixed"
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * self.mix * self.alpha


def test_a_tensor_the_constructor_makes_on_the_cpu_anyway_is_on_meta_in_the_twin():
    model = _LegacyParameter({"width": 4}).to(torch.bfloat16)
    twin = meta_twin(model)
    assert {n: (p.is_meta, p.dtype) for n, p in twin.named_parameters()} == {
        n: (True, torch.bfloat16) for n in ("mix", "proj.weight", "proj.bias")
    }
    assert twin.alpha.is_meta and twin.alpha.dtype == torch.bfloat16
    assert peak_bytes(twin, (torch.empty(3, 4, dtype=torch.bfloat16, device="meta"),)) > 0


def test_a_transformers_twin_is_built_from_its_config():
    model = tiny_umt5(torch.float16, seed=1)
    twin = meta_twin(model)
    assert type(twin) is type(model) and twin.config.d_model == 32
    assert all(p.is_meta and p.dtype == torch.float16 for p in twin.parameters())


@pytest.mark.parametrize(
    "factory,args",
    [
        pytest.param(lambda: tiny_umt5(torch.float16, seed=1), lambda: (torch.randint(0, 256, (2, 9)),), id="umt5"),
        pytest.param(
            lambda: tiny_wan_transformer(seed=1),
            lambda: (
                torch.randn(1, 16, 3, 16, 16, dtype=torch.bfloat16),
                torch.tensor([500]),
                torch.randn(1, 8, 32, dtype=torch.bfloat16),
            ),
            id="wan",
        ),
    ],
)
def test_a_twin_traces_the_same_peak_as_the_model_itself_moved_to_meta(factory, args):
    model = factory()
    args = args()
    twin = meta_twin(model)
    moved = copy.deepcopy(model).to("meta")  # the same architecture in the same dtypes, by another road
    assert peak_bytes(twin, args) == peak_bytes(moved, args)
    wide = copy.deepcopy(model).float().to("meta")  # a twin in the wrong dtype would trace a different peak
    wide_args = [a.float() if a.is_floating_point() else a for a in args]
    assert peak_bytes(wide, wide_args) > peak_bytes(twin, args)


def test_the_twin_of_a_wan_transformer_never_holds_a_score_matrix():
    model = tiny_wan_transformer(seed=0)
    twin = meta_twin(model)
    frames, height, width = 5, 64, 64  # 5 x 32 x 32 = 5120 tokens after the 1x2x2 patches
    tokens = frames * (height // 2) * (width // 2)
    latents = torch.randn(1, 16, frames, height, width, dtype=torch.bfloat16)
    text = torch.randn(1, 16, 32, dtype=torch.bfloat16)
    peak = peak_bytes(twin, (latents, torch.tensor([500]), text))
    scores = 2 * tokens * tokens * 2  # heads x tokens x tokens in bf16: 100 MiB
    hidden = tokens * 24 * 2  # one hidden state of the 24-wide model
    assert 4 * hidden < peak < scores // 10


def test_a_callers_generator_is_not_drawn_from():
    """Noise a decode draws from the caller's generator (diffusers' randn_tensor draws on the generator's device):
    tracing the call on the meta twin must leave the generator as it was, or the real call gets other noise."""
    from diffusers.utils.torch_utils import randn_tensor

    class Noisy(nn.Module):
        def forward(self, x, generator=None):
            return x + randn_tensor(x.shape, generator=generator, device=x.device, dtype=x.dtype)

    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    for given in (generator, [generator]):
        assert estimate(Noisy().to("meta"), (torch.ones(1, 3),), dict(generator=given), cuda=False) is not None
    assert torch.equal(generator.get_state(), state)

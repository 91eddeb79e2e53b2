"""tritoff/activations.py: meta twins of components, and the peak bytes of the tensors a forward creates, counted on
the meta device as the GPU would allocate them (fused attention: no score matrix)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tritoff.activations import CUDA_SLACK, MARGIN, estimate, meta_twin, peak_bytes
from tritoff.tiny import tiny_umt5, tiny_wan_transformer

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

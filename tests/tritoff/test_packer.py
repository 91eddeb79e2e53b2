"""tritoff/packer.py: a model quantized group by group into one arena, and unpacked exactly through the kernel."""

import ctypes

import pytest
import torch

from tritoff.kernels.quantize import quantize_reference
from tritoff.kernels.upcast import BLOCK, upcast_pack
from tritoff.pack import unpack_reference
from tritoff.packer import pack_model
from tritoff.tiny import tiny_cogvideox_transformer, tiny_wan_transformer

from ..conftest import poisoned


@pytest.mark.parametrize("build", [tiny_wan_transformer, tiny_cogvideox_transformer], ids=["wan", "cogvideox"])
@pytest.mark.parametrize("storage", ["fp8_e4m3", "fp8_e5m2"])
def test_kernel_unpacks_every_group_exactly(build, storage, device):
    model = build()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    packed = pack_model(model, storage, progress=False)
    assert [p.name for p in packed.packs] == [g.name for g in packed.groups]
    seen = set()
    for pack in packed.packs:
        layout = pack.layout
        out = poisoned(layout.out_nbytes, device)
        upcast_pack(
            pack.data.to(device),
            out,
            layout.table(BLOCK, device),
            layout.n_programs(),
            layout.out_dtype,
            packed.storage,
        )
        expected = unpack_reference(layout, pack.data)
        for name, tensor in layout.views(out.cpu()).items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
            assert tensor.dtype == original[name].dtype, name  # fp32 stays fp32, bf16 stays bf16
            seen.add(name)
    assert seen == set(original)


def test_quantized_weights_are_their_pow2_dequantization_and_kept_are_untouched():
    model = tiny_wan_transformer()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    packed = pack_model(model, progress=False)
    for pack in packed.packs:
        for entry, (name, tensor) in zip(
            pack.layout.entries, unpack_reference(pack.layout, pack.data).items(), strict=True
        ):
            if entry.kind == 1:
                codes, scales = quantize_reference(original[name], packed.storage, "row")
                rows = codes.view(packed.storage.dtype).float().reshape(len(scales), -1) * scales[:, None]
                assert torch.equal(tensor, rows.reshape(tensor.shape).to(tensor.dtype)), name
            else:
                assert torch.equal(tensor, original[name]), name


def test_packs_are_aligned_and_smaller_than_the_model():
    model = tiny_wan_transformer(ffn_dim=256, num_attention_heads=4, attention_head_dim=32)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = pack_model(model, progress=False)
    for pack in packed.packs:
        assert pack.offset % 4096 == 0
        for e in pack.layout.entries:
            assert e.offset % 256 == 0 and e.out_offset % 256 == 0
            assert e.scale_offset == -1 or e.scale_offset % 256 == 0
    assert packed.unpacked_bytes >= model_bytes
    quantized = sum(p.layout.quantized_bytes for p in packed.packs)
    # fp8 halves the quantized bf16 weights; scales, kept tensors and alignment cost the rest
    assert packed.packed_bytes < model_bytes - 0.4 * quantized


def test_release_frees_weights_as_it_goes():
    model = tiny_wan_transformer()
    packed = pack_model(model, release=True, progress=False)
    assert all(p.numel() == 0 for p in model.parameters())
    assert packed.packed_bytes > 0


@pytest.mark.parametrize("stopped_close", [1, 2])
def test_a_stop_as_packing_ends_gives_the_released_weights_back_or_returns_the_packs(monkeypatch, stopped_close):
    """Ctrl-C in the progress bar's close (the last thing pack_model runs): either the call raises with every weight
    given back, or it has returned the packs. Never an empty parameter with no packs to restore it from."""
    from tritoff import packer

    class Interrupted(packer.tqdm):
        closes = 0

        def close(self):
            super().close()
            Interrupted.closes += 1
            if Interrupted.closes == stopped_close:
                raise KeyboardInterrupt

        def __del__(self):  # tqdm closes there too, as the bar dies; Python drops what is raised in __del__
            pass

    model = tiny_wan_transformer()
    monkeypatch.setattr(packer, "tqdm", Interrupted)
    try:
        packed = pack_model(model, release=True, progress=False)
    except KeyboardInterrupt:
        assert not any(p.numel() == 0 for p in model.parameters())
    else:
        assert all(p.numel() == 0 for p in model.parameters()) and len(packed.packs) == len(packed.groups)
    assert Interrupted.closes >= 1


def test_packs_made_are_handed_to_the_callers_list_as_they_are_made():
    # the caller gives released weights back from them wherever the packing stops; a list reused keeps its packs
    made = ["a pack of an earlier call"]
    packed = pack_model(tiny_wan_transformer(), release=True, progress=False, made=made)
    assert made == ["a pack of an earlier call", *packed.packs] and len(packed.packs) == len(packed.groups)


def test_nan_weight_is_refused_with_its_name():
    model = tiny_wan_transformer()
    with torch.no_grad():
        model.blocks[1].ffn.net[2].weight[3, 4] = float("inf")
    with pytest.raises(ValueError, match=r"blocks\.1\.ffn\.net\.2\.weight contains NaN or Inf"):
        pack_model(model, progress=False)


def test_sixteen_bit_storage_is_pure_offload():
    model = tiny_wan_transformer()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    packed = pack_model(model, "bf16", progress=False)
    for pack in packed.packs:
        for name, tensor in unpack_reference(pack.layout, pack.data).items():
            assert torch.equal(tensor, original[name]), name


def test_unknown_storage_and_granularity_are_refused():
    model = tiny_wan_transformer()
    with pytest.raises(ValueError, match="unknown storage 'fp4'.*fp8_e4m3"):
        pack_model(model, "fp4", progress=False)
    with pytest.raises(ValueError, match="unknown scale granularity 'block'"):
        pack_model(model, granularity="block", progress=False)


def test_the_arena_is_page_locked_once_its_packs_are_written(monkeypatch):
    from tritoff import cuda_host

    seen = []

    def register(ptr, nbytes):  # page-locking faults in every page: done before packing, it would double the peak
        seen.append(torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8).clone())

    monkeypatch.setattr(cuda_host, "register", register)
    monkeypatch.setattr(cuda_host, "unregister", lambda ptr: None)
    packed = pack_model(tiny_wan_transformer(), register=True, progress=False)
    assert packed.arena.registered and len(seen) == 1
    assert torch.equal(seen[0], packed.arena.buffer) and seen[0].any()


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_relayout_regroups_from_the_layouts_alone(granularity):
    from tritoff.formats import get_format
    from tritoff.groups import block_groups, leaf_groups
    from tritoff.packer import plan_layouts, relayout
    from tritoff.skip import SkipRules

    model = tiny_wan_transformer()
    quantized = SkipRules.for_model(model, ()).quantized_names(model)
    fmt = get_format("fp8_e4m3")
    blocks = plan_layouts(block_groups(model), quantized, fmt, granularity)
    leaves = leaf_groups(model)
    expected = plan_layouts(leaves, quantized, fmt, granularity)
    for param in model.parameters():  # the weights are not read: placeholders (after enable) relay out the same
        param.data = torch.empty(0, dtype=param.dtype)
    assert relayout(blocks, leaves) == expected
    assert len(expected) > len(blocks) and any(e.num_scales for lay in expected for e in lay.entries)
    with pytest.raises(KeyError):
        relayout(blocks[:1], leaves)

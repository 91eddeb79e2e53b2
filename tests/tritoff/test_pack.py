"""tritoff/pack.py: a pack's layout (every region 256-byte aligned, none overlapping, padding around each for the
kernel's 16-element bound), its kernel table, and tensors written into it read back as the kernels unpack them."""

import pytest
import torch

from tritoff.formats import get_format
from tritoff.kernels.quantize import quantize_reference
from tritoff.kernels.upcast import KIND_COPY, KIND_FP8, PAD, TABLE_COLUMNS
from tritoff.pack import ALIGN, MixedDtypes, PackLayout, TensorSpec, align, read_entry, unpack_reference, write_pack

E4M3 = get_format("fp8_e4m3")
SPECS = [
    TensorSpec("q.weight", (48, 40), torch.bfloat16, True),
    TensorSpec("q.bias", (47,), torch.bfloat16, False),
    TensorSpec("norm.weight", (5,), torch.float32, False),
    TensorSpec("conv.weight", (6, 3, 1, 2, 2), torch.bfloat16, True),
    TensorSpec("empty.weight", (0, 8), torch.bfloat16, True),
    TensorSpec("scalar", (), torch.bfloat16, False),
]


def _regions(layout):
    """Every (start, end) the pack uses: payloads and scales."""
    spans = [(e.offset, e.offset + e.nbytes) for e in layout.entries if e.nbytes]
    spans += [(e.scale_offset, e.scale_offset + 4 * e.num_scales) for e in layout.entries if e.scale_offset >= 0]
    return sorted(spans)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_regions_are_aligned_disjoint_and_padded_for_the_kernels_bound(granularity):
    layout = PackLayout.plan(SPECS, E4M3, granularity)
    spans = _regions(layout)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))  # disjoint
    assert spans[-1][1] <= layout.nbytes == align(spans[-1][1])
    for e in layout.entries:
        assert e.out_offset % ALIGN == 0
        # the kernel runs to the length rounded up to 16 units: the rounding stays inside the region's alignment
        unit = 1 if e.kind == KIND_FP8 else 4
        assert align(e.kernel_units, PAD) * unit <= align(e.nbytes) or e.nbytes == 0
    outs = sorted((e.out_offset, e.out_offset + e.out_nbytes) for e in layout.entries)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(outs, outs[1:], strict=False))
    assert layout.out_nbytes >= outs[-1][1]
    kinds = {e.name: e.kind for e in layout.entries}
    assert kinds == {
        "q.weight": KIND_FP8,
        "q.bias": KIND_COPY,
        "norm.weight": KIND_COPY,
        "conv.weight": KIND_FP8,
        "empty.weight": KIND_COPY,  # nothing to quantize
        "scalar": KIND_COPY,
    }
    scales = {e.name: e.num_scales for e in layout.entries if e.kind == KIND_FP8}
    assert scales == ({"q.weight": 48, "conv.weight": 6} if granularity == "row" else {"q.weight": 1, "conv.weight": 1})


@pytest.mark.parametrize("block", [16, 64, 4096])
def test_the_table_numbers_programs_tensor_after_tensor(block):
    layout = PackLayout.plan(SPECS, E4M3)
    table = layout.table(block)
    assert table.dtype == torch.int64 and table.shape == (len(SPECS), TABLE_COLUMNS)
    starts = table[:, 0].tolist()
    chunks = [-(-e.kernel_units // block) for e in layout.entries]
    assert starts == [sum(chunks[:i]) for i in range(len(chunks))]
    assert layout.n_programs(block) == sum(chunks)
    for row, e in zip(table.tolist(), layout.entries, strict=True):
        assert row[1:] == [e.kind, e.offset, e.out_offset, e.kernel_units, e.row_len, max(e.scale_offset, 0),
                           align(e.kernel_units, PAD)]  # fmt: skip


def test_written_tensors_read_back_as_the_kernels_unpack_them():
    layout = PackLayout.plan(SPECS, E4M3)
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: (torch.randn(s.shape, generator=gen) * 0.05).to(s.dtype) for s in SPECS}
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    snr = {}
    write_pack(layout, data, tensors, quantize_reference, snr)
    unpacked = unpack_reference(layout, data)
    for e in layout.entries:
        got = read_entry(layout, data, e)
        assert got.dtype == e.dtype and tuple(got.shape) == e.shape
        assert torch.equal(got, unpacked[e.name])
        if e.kind == KIND_COPY:
            assert torch.equal(got, tensors[e.name])  # kept tensors come back bit for bit
    assert set(snr) == {"q.weight", "conv.weight"} and all(db > 25 for db in snr.values())  # e4m3 rows: ~30 dB


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("storage", ["fp8_e4m3", "fp8_e5m2"])
def test_fp16_weights_near_its_largest_value_saturate_instead_of_coming_back_infinite(storage, granularity):
    # 64000 at scale 2^8 rounds to 256 in e4m3 (62000 at scale 2 to 32768 in e5m2): 65536, past fp16's 65504
    fmt = get_format(storage)
    w = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 100).to(torch.float16)
    w[0, 3], w[1, 5], w[2, 7] = 64000.0, -65504.0, 62000.0
    layout = PackLayout.plan([TensorSpec("w", (4, 64), torch.float16, True)], fmt, granularity)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    write_pack(layout, data, {"w": w}, quantize_reference)
    got = unpack_reference(layout, data)["w"]
    largest = 61440.0 if storage == "fp8_e4m3" else 57344.0  # the largest fp8 value times 2^k that fp16 holds
    assert torch.isfinite(got).all()
    assert got[0, 3] == largest and got[1, 5] == -largest and got[2, 7] == largest

    # every other code is the plain quantizer's, and bf16 weights (whose range holds any code) are left as they are
    def plain(weight):
        codes, scales = quantize_reference(weight, fmt, granularity)
        return (codes.view(fmt.dtype).float().view(len(scales), -1) * scales[:, None]).view(w.shape).to(weight.dtype)

    assert torch.isinf(plain(w)).any()  # the case this guards against does arise
    kept = torch.isfinite(plain(w))
    assert torch.equal(got[kept], plain(w)[kept])
    bf16 = PackLayout.plan([TensorSpec("w", (4, 64), torch.bfloat16, True)], fmt, granularity)
    write_pack(bf16, data, {"w": w.bfloat16()}, quantize_reference)
    assert torch.equal(unpack_reference(bf16, data)["w"], plain(w.bfloat16()))
    assert unpack_reference(bf16, data)["w"].float().abs().max() == 65536.0  # bf16 holds it: nothing stepped down


def test_a_weight_with_nan_or_the_wrong_shape_is_refused_by_name():
    layout = PackLayout.plan(SPECS[:1], E4M3)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    bad = torch.randn(48, 40).to(torch.bfloat16)
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="q.weight contains NaN or Inf"):
        write_pack(layout, data, {"q.weight": bad}, quantize_reference)
    with pytest.raises(ValueError, match=r"q.weight: shape \(40, 48\) does not match the pack's \(48, 40\)"):
        write_pack(layout, data, {"q.weight": torch.zeros(40, 48, dtype=torch.bfloat16)}, quantize_reference)


def test_quantized_weights_of_two_dtypes_cannot_share_a_pack_and_sixteen_bit_storage_copies_everything():
    specs = [TensorSpec("a", (4, 4), torch.bfloat16, True), TensorSpec("b", (4, 4), torch.float16, True)]
    with pytest.raises(MixedDtypes, match="must share one dtype, got a bfloat16, b float16") as info:
        PackLayout.plan(specs, E4M3)
    assert info.value.dtypes == {"a": torch.bfloat16, "b": torch.float16}
    layout = PackLayout.plan(specs, get_format("bf16"))  # pure offload: nothing is rounded, so any dtypes
    assert all(e.kind == KIND_COPY and e.num_scales == 0 for e in layout.entries)

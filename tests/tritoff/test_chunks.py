"""tritoff/chunks.py: a pack moved chunk by chunk through a small staging buffer unpacks exactly like the whole pack."""

import pytest
import torch

from tritoff.chunks import halving_chunk, smallest_chunk, split_pack, stage_chunk
from tritoff.formats import get_format
from tritoff.kernels.quantize import quantize_reference
from tritoff.kernels.upcast import BLOCK, upcast_pack, upcast_pack_reference
from tritoff.pack import PackLayout, TensorSpec, write_pack

E4M3 = get_format("fp8_e4m3")

SPECS = [  # an embedding-like kept table, row-scaled weights with long and short rows, a per-tensor-sized vector
    TensorSpec("embed.weight", (300, 24), torch.bfloat16, False),
    TensorSpec("ffn.weight", (40, 5120), torch.bfloat16, True),
    TensorSpec("ffn.bias", (5001,), torch.bfloat16, False),
    TensorSpec("proj.weight", (130, 70), torch.bfloat16, True),
    TensorSpec("norm.weight", (33,), torch.float32, False),
    TensorSpec("gate.weight", (1, 3000), torch.bfloat16, True),
]


def _pack(granularity="row"):
    layout = PackLayout.plan(SPECS, E4M3, granularity)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    tensors = {
        s.name: (torch.randn(s.shape) * torch.rand(s.shape[0], *[1] * (len(s.shape) - 1))).to(s.dtype) for s in SPECS
    }
    write_pack(layout, data, tensors, quantize_reference)
    return layout, data


def _unpack_through_chunks(layout, data, capacity, triton: bool):
    out = torch.full((layout.out_nbytes,), 0xFF, dtype=torch.uint8)
    staging = torch.empty(capacity, dtype=torch.uint8)
    chunks = split_pack(layout, capacity)
    for chunk in chunks:
        staging.fill_(0xAB)  # bytes of an earlier chunk must never be read
        staged = stage_chunk(chunk, data, staging)
        assert staged.numel() <= capacity
        if triton:
            upcast_pack(staged, out, chunk.table(BLOCK), chunk.n_programs(BLOCK), layout.out_dtype, E4M3)
        else:
            upcast_pack_reference(staged, out, chunk.table(), layout.out_dtype, E4M3)
    return out, chunks


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize(
    "capacity",
    [
        pytest.param(None, id="whole-pack"),
        pytest.param(64 * 1024, id="64KiB"),
        pytest.param(16 * 1024, id="16KiB"),
        pytest.param(0, id="smallest"),
    ],
)
def test_chunked_unpack_equals_the_whole_pack(granularity, capacity):
    layout, data = _pack(granularity)
    expected = upcast_pack_reference(
        data, torch.full((layout.out_nbytes,), 0xFF, dtype=torch.uint8), layout.table(), layout.out_dtype, E4M3
    )
    capacity = layout.nbytes if capacity is None else capacity or smallest_chunk(layout)
    for triton in (False, True):
        got, chunks = _unpack_through_chunks(layout, data, capacity, triton)
        assert (len(chunks) == 1) == (capacity >= layout.nbytes)
        views, ref = layout.views(got), layout.views(expected)
        for name in ref:
            assert torch.equal(views[name].view(torch.uint8), ref[name].view(torch.uint8)), (name, triton)


def test_cuts_land_on_aligned_offsets_and_whole_rows():
    layout, _ = _pack()
    for chunk in split_pack(layout, smallest_chunk(layout)):
        assert chunk.payload[0] % 256 == 0 and chunk.scale_base % 256 == 0
        for kind, src, dst, units, row_len, _scale, _padded in chunk.rows:
            assert src % 256 == 0 and dst % 256 == 0
            if kind == 1 and row_len != units:
                assert units % row_len == 0  # whole rows: every element keeps its own row's scale


def test_a_staging_buffer_too_small_for_one_piece_is_refused():
    layout, _ = _pack()
    with pytest.raises(ValueError, match="cannot hold one piece of"):
        split_pack(layout, smallest_chunk(layout) - 1)


WAN_BLOCK = [  # a Wan block's tensors, 1/40 of their width: two attentions, the ffn, their biases, norms and table
    *(TensorSpec(f"attn{a}.{p}.weight", (128, 128), torch.bfloat16, True) for a in (1, 2) for p in "qkvo"),
    *(TensorSpec(f"attn{a}.{p}.bias", (128,), torch.bfloat16, False) for a in (1, 2) for p in "qkvo"),
    TensorSpec("ffn.up.weight", (346, 128), torch.bfloat16, True),
    TensorSpec("ffn.down.weight", (128, 346), torch.bfloat16, True),
    TensorSpec("norm.weight", (128,), torch.float32, False),
    TensorSpec("scale_shift_table", (1, 6, 128), torch.float32, False),
]


@pytest.mark.parametrize("specs", [SPECS, WAN_BLOCK], ids=["mixed", "wan-block"])
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_a_halving_chunk_moves_the_pack_in_two_for_a_few_bytes_more_than_half(specs, granularity):
    # exactly half a pack leaves a third chunk of a few padded bytes, which takes a staging half of its own
    layout = PackLayout.plan(specs, E4M3, granularity)
    half = -(-layout.nbytes // 2)
    capacity = halving_chunk(layout)
    assert len(split_pack(layout, capacity)) == 2
    assert half <= capacity <= half + 16 * 1024
    assert len(split_pack(layout, half)) > 2 or capacity == max(-(-half // 256) * 256, smallest_chunk(layout))


def test_packs_of_one_geometry_are_cut_once_and_a_refusal_names_its_own_tensor(monkeypatch):
    import dataclasses

    from tritoff import chunks

    monkeypatch.setattr(chunks, "_CUTS", {})
    cuts = []
    split = chunks._split
    monkeypatch.setattr(chunks, "_split", lambda layout, capacity: cuts.append(capacity) or split(layout, capacity))
    layout = PackLayout.plan(SPECS, E4M3)
    renamed = PackLayout.plan([dataclasses.replace(s, name=f"blocks.7.{s.name}") for s in SPECS], E4M3)
    wider = PackLayout.plan([dataclasses.replace(SPECS[1], shape=(40, 5632)), *SPECS[2:]], E4M3)
    first = split_pack(layout, 16384)
    assert split_pack(renamed, 16384) == first and cuts == [16384]  # another block of the same shapes: no new cut
    assert split_pack(wider, 16384) != first and cuts == [16384, 16384]  # other shapes: cut on their own
    assert split_pack(layout, 12288) != first and len(cuts) == 3  # another capacity too
    with pytest.raises(ValueError, match=r"blocks\.7\.ffn\.weight"):
        split_pack(renamed, 256)


def test_a_layout_of_the_same_shapes_at_other_offsets_is_cut_on_its_own():
    # a store's layouts carry the file's own offsets: equal shapes must not share a cut made for other offsets
    import dataclasses

    layout = PackLayout.plan(SPECS, E4M3)

    def shifted(e):
        scales = e.scale_offset + 256 if e.scale_offset >= 0 else -1
        return dataclasses.replace(e, offset=e.offset + 256, scale_offset=scales, out_offset=e.out_offset + 256)

    moved = dataclasses.replace(
        layout,
        entries=tuple(shifted(e) for e in layout.entries),
        nbytes=layout.nbytes + 256,
        out_nbytes=layout.out_nbytes + 256,
    )
    first, second = split_pack(layout, 16384), split_pack(moved, 16384)
    assert [c.payload for c in second] == [(a + 256, b + 256) for a, b in (c.payload for c in first)]
    assert [r[2] for c in second for r in c.rows] == [r[2] + 256 for c in first for r in c.rows]  # output offsets

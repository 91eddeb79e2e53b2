"""kernels/upcast.py: one launch unpacks a whole pack exactly like the PyTorch reference."""

from types import SimpleNamespace

import pytest
import torch

from tritoff.formats import get_format
from tritoff.kernels import upcast as upcast_module
from tritoff.kernels.quantize import quantize_reference
from tritoff.kernels.upcast import (
    BLOCK,
    BLOCK_ZERO_COPY,
    row_pieces,
    table_extent,
    upcast_pack,
    upcast_pack_reference,
    upcast_pack_zero_copy,
)
from tritoff.pack import PackLayout, TensorSpec, write_pack

from ..conftest import poisoned

E4M3, E5M2 = get_format("fp8_e4m3"), get_format("fp8_e5m2")

MIXED = [  # a block's worth of odd shapes: quantized weights, kept bf16 and fp32 tensors, a bias of odd length
    TensorSpec("to_q.weight", (96, 80), torch.bfloat16, True),
    TensorSpec("to_q.bias", (95,), torch.bfloat16, False),
    TensorSpec("ffn.weight", (33, 4100), torch.bfloat16, True),
    TensorSpec("one_row.weight", (1, 7), torch.bfloat16, True),
    TensorSpec("norm.weight", (17,), torch.float32, False),
    TensorSpec("scale_shift_table", (1, 6, 24), torch.float32, False),
    TensorSpec("conv.weight", (8, 3, 1, 2, 2), torch.bfloat16, True),
]


def _tensors(specs):
    out = {}
    for s in specs:
        t = torch.randn(s.shape) * torch.logspace(-3, 0, s.shape[0]).reshape(-1, *[1] * (len(s.shape) - 1))
        out[s.name] = t.to(s.dtype)
    return out


def _build(specs, fmt, granularity="row"):
    layout = PackLayout.plan(specs, fmt, granularity)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    tensors = _tensors(specs)
    write_pack(layout, data, tensors, quantize_reference)
    return layout, data, tensors


def _native_compiles(device) -> bool:
    """The hardware e4m3/e5m2 conversions exist from compute capability 8.9 (the interpreter emulates them)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _skip_native_below_sm89(native, device):
    if native and not _native_compiles(device):
        pytest.skip("native fp8 conversion needs compute capability >= 8.9")


def _compare(layout, out, data):
    expected = upcast_pack_reference(
        data, poisoned(layout.out_nbytes, "cpu"), layout.table(), layout.out_dtype, layout.storage
    )
    got = layout.views(out.cpu())
    for name, ref in layout.views(expected).items():
        torch.testing.assert_close(got[name], ref, rtol=0, atol=0, equal_nan=False, msg=name)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["row", "tensor", "none"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "from-bits"])
def test_staged_matches_reference(fmt, granularity, native, device):
    _skip_native_below_sm89(native, device)
    layout, data, _ = _build(MIXED, fmt, granularity)
    out = poisoned(layout.out_nbytes, device)
    upcast_pack(
        data.to(device),
        out,
        layout.table(BLOCK, device),
        layout.n_programs(BLOCK),
        layout.out_dtype,
        fmt,
        native=native,
    )
    _compare(layout, out, data)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_zero_copy_matches_reference(fmt, device):
    layout, data, _ = _build(MIXED, fmt)
    if device.type == "cuda":
        pytest.skip("the GPU version reads a registered arena: tests/tritoff/test_arena.py")
    out = poisoned(layout.out_nbytes, device)
    upcast_pack_zero_copy(
        data, out, layout.table(BLOCK_ZERO_COPY), layout.n_programs(BLOCK_ZERO_COPY), layout.out_dtype, fmt
    )
    _compare(layout, out, data)


def test_reference_recovers_kept_tensors_and_dequantizes_exactly():
    layout, data, tensors = _build(MIXED, E4M3)
    out = upcast_pack_reference(data, poisoned(layout.out_nbytes, "cpu"), layout.table(), layout.out_dtype, E4M3)
    views = layout.views(out)
    for spec in MIXED:
        got, original = views[spec.name], tensors[spec.name]
        assert got.dtype == spec.dtype and got.shape == original.shape
        if not spec.quantize:
            assert torch.equal(got, original), spec.name  # kept tensors come back bit for bit, fp32 stays fp32
        else:
            codes, scales = quantize_reference(original, E4M3, "row")
            rows = codes.view(E4M3.dtype).double().reshape(codes.shape[0], -1) * scales.double()[:, None]
            assert torch.equal(got.double(), rows.reshape(got.shape)), spec.name


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_compute_dtypes(out_dtype, device):
    specs = [TensorSpec("w", (40, 70), out_dtype, True), TensorSpec("b", (40,), out_dtype, False)]
    layout, data, _ = _build(specs, E4M3)
    assert layout.out_dtype == out_dtype
    out = poisoned(layout.out_nbytes, device)
    upcast_pack(data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), out_dtype, E4M3)
    _compare(layout, out, data)


@pytest.mark.parametrize("storage", ["bf16", "fp16"])
def test_sixteen_bit_storage_copies_every_dtype_exactly(storage, device):
    fmt = get_format(storage)
    specs = [TensorSpec("w", (33, 65), torch.float32, True), TensorSpec("b", (33,), torch.bfloat16, False)]
    layout, data, tensors = _build(specs, fmt)
    out = poisoned(layout.out_nbytes, device)
    upcast_pack(data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), layout.out_dtype, fmt)
    got = layout.views(out.cpu())
    assert torch.equal(got["w"], tensors["w"]) and torch.equal(got["b"], tensors["b"])


def test_subnormal_and_extreme_codes(device):
    # every fp8 code except NaN, as a weight with scale 1: subnormals, +-max and signed zeros all decode exactly
    for fmt in (E4M3, E5M2):
        codes = torch.arange(256, dtype=torch.uint8)
        finite = codes.view(fmt.dtype).float().isfinite()
        specs = [TensorSpec("w", (1, int(finite.sum())), torch.bfloat16, True)]
        layout = PackLayout.plan(specs, fmt, "none")
        data = torch.zeros(layout.nbytes, dtype=torch.uint8)
        e = layout.entries[0]
        data[e.offset : e.offset + e.nbytes] = codes[finite]
        data[e.scale_offset : e.scale_offset + 4].view(torch.float32)[0] = 1.0
        for native in (True, False) if _native_compiles(device) else (False,):
            out = poisoned(layout.out_nbytes, device)
            upcast_pack(
                data.to(device),
                out,
                layout.table(BLOCK, device),
                layout.n_programs(),
                torch.bfloat16,
                fmt,
                native=native,
            )
            got = layout.views(out.cpu())["w"].flatten()
            expected = codes[finite].view(fmt.dtype).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (fmt.name, native)


def test_many_tensors_in_one_pack(device):
    # more tensors than the kernel's smallest tensor-index vector (16)
    specs = [TensorSpec(f"l{i}.weight", (3 + i, 5 + 2 * i), torch.bfloat16, i % 3 != 0) for i in range(40)]
    layout, data, _ = _build(specs, E4M3)
    out = poisoned(layout.out_nbytes, device)
    upcast_pack(data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), layout.out_dtype, E4M3)
    _compare(layout, out, data)


def test_bad_buffers_are_refused():
    layout, data, _ = _build(MIXED, E4M3)
    out = torch.empty(layout.out_nbytes, dtype=torch.uint8)
    with pytest.raises(TypeError, match="uint8"):
        upcast_pack(data.float(), out, layout.table(), layout.n_programs(), torch.bfloat16, E4M3)
    with pytest.raises(ValueError, match="table"):
        upcast_pack(data, out, layout.table()[:, :4], layout.n_programs(), torch.bfloat16, E4M3)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((5, 4096), id="rows-of-one-block"),
        pytest.param((3, 6000), id="rows-between-one-and-two-blocks"),
        pytest.param((2, 9000), id="rows-over-two-blocks"),
        pytest.param((9, 3072), id="rows-of-three-quarters-of-a-block"),
        pytest.param((12, 1366), id="rows-of-a-third-of-a-block"),
        pytest.param((12, 1365), id="rows-just-under-a-third-of-a-block"),
        pytest.param((70, 130), id="many-rows-per-block"),
    ],
)
def test_scales_at_row_boundaries(shape, device):
    # each program loads the scales of the rows it spans as scalars (rows of BLOCK / 3 or more: up to four rows) or
    # gathers them (shorter rows): rows spanning a block boundary must take the right scale on each side, scales
    # differing by powers of two from row to row
    layout, data, _ = _build([TensorSpec("w", shape, torch.bfloat16, True)], E4M3)
    out = poisoned(layout.out_nbytes, device)
    upcast_pack(data.to(device), out, layout.table(BLOCK, device), layout.n_programs(), layout.out_dtype, E4M3)
    _compare(layout, out, data)


@pytest.mark.parametrize("block,warps", [(2048, 4), (16384, 4), (4096, 8), (16384, 8)])
@pytest.mark.parametrize(
    "shape", [pytest.param((3, 6000), id="rows-over-blocks"), pytest.param((70, 130), id="many-rows-per-block")]
)
def test_other_elements_and_warps_per_program_unpack_exactly(block, warps, shape, device):
    # bench/kernels.py sweeps the elements and warps per program: a table built for another block size, run by more
    # warps, gives the same bytes (the interpreter runs a program as one: warps count on the GPU)
    layout, data, _ = _build([TensorSpec("w", shape, torch.bfloat16, True), *MIXED], E4M3)
    out = poisoned(layout.out_nbytes, device)
    table, programs = layout.table(block, device), layout.n_programs(block)
    upcast_pack(data.to(device), out, table, programs, layout.out_dtype, E4M3, block=block, warps=warps)
    _compare(layout, out, data)


@pytest.mark.parametrize("block", [BLOCK, 2048])
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(TensorSpec("kept", (BLOCK + 3000,), torch.float32, False), id="ends-in-second-half"),
        pytest.param(TensorSpec("kept", (BLOCK + 404,), torch.float32, False), id="ends-in-first-half"),
        pytest.param(TensorSpec("kept", (3, 3001), torch.bfloat16, False), id="odd-bf16"),
    ],
)
def test_kept_tensors_over_several_programs_copy_exactly(spec, block, device):
    # a program copies its words in two halves (each laid out as its stores): a tensor's last program may end in
    # either half, or fill one and leave the other masked off
    layout, data, _ = _build([spec, *MIXED], E4M3)
    out = poisoned(layout.out_nbytes, device)
    table, programs = layout.table(block, device), layout.n_programs(block)
    upcast_pack(data.to(device), out, table, programs, layout.out_dtype, E4M3, block=block)
    _compare(layout, out, data)


def test_a_grid_bound_in_the_interpreter_still_covers_every_chunk(monkeypatch):
    # the interpreter runs every launch one program per chunk (see _kernel_arguments): a bound changes nothing there
    seen = []
    original = upcast_module._kernel_arguments

    def spy(*args):
        grid, *rest = original(*args)
        seen.append((grid, rest[1]["PERSISTENT"]))
        return (grid, *rest)

    monkeypatch.setattr(upcast_module, "_kernel_arguments", spy)
    layout, data, _ = _build(MIXED, E4M3)
    out = poisoned(layout.out_nbytes, "cpu")
    upcast_pack(data, out, layout.table(BLOCK), layout.n_programs(BLOCK), layout.out_dtype, E4M3, programs=3)
    _compare(layout, out, data)
    assert seen == [((layout.n_programs(BLOCK),), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3, 1000], ids=["one-program", "three-programs", "more-than-chunks"])
@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero-copy"])
def test_a_bounded_grid_covers_every_chunk(zero_copy, programs):
    # compiled only: on the CPU the interpreter runs every launch one program per chunk (see _kernel_arguments)
    from tritoff.arena import HostArena

    layout, data, _ = _build(MIXED, E4M3)
    block = BLOCK_ZERO_COPY if zero_copy else BLOCK
    assert layout.n_programs(block) > 3  # the programs really stride over several chunks each
    out = poisoned(layout.out_nbytes, "cuda")
    table, n_programs = layout.table(block, "cuda"), layout.n_programs(block)
    if zero_copy:
        arena = HostArena(layout.nbytes)
        assert arena.registered
        arena.buffer.copy_(data)
        src = arena.device_view(0, layout.nbytes)
        upcast_pack_zero_copy(src, out, table, n_programs, layout.out_dtype, E4M3, programs=programs)
    else:
        upcast_pack(data.cuda(), out, table, n_programs, layout.out_dtype, E4M3, programs=programs)
    _compare(layout, out, data)
    if zero_copy:
        arena.close()


def test_the_interpreter_refuses_out_of_bounds_accesses():
    """conftest makes Triton's interpreter check every address: a destination one tensor too short is an error, not a
    silent write past its end (which is how an out-of-bounds kernel would corrupt memory on the CPU)."""
    from tritoff.kernels import interpreting

    if not interpreting():
        pytest.skip("the bounds check wraps Triton's interpreter")
    from tritoff.kernels.upcast import BLOCK, WARPS, _upcast_pack_eager

    layout, data, _ = _build(MIXED, E4M3)
    short = torch.empty(layout.entries[-1].out_offset, dtype=torch.uint8)
    # the launcher itself, past upcast_pack's own bounds check (test_buffers_too_short_are_refused_in_one_line)
    with pytest.raises(Exception, match="outside its arguments"):
        _upcast_pack_eager(data, short, layout.table(), layout.n_programs(), 0, False, False, BLOCK, 0, WARPS)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero-copy"])
def test_buffers_too_short_or_misaligned_are_refused_in_one_line(zero_copy, device):
    # an 8 KiB pack upcast into 16 bytes wrote the 8 KiB past them, silently
    layout, data, _ = _build(MIXED, E4M3)
    block = BLOCK_ZERO_COPY if zero_copy else BLOCK
    table, n = layout.table(block).to(device), layout.n_programs(block)
    upcast = upcast_pack_zero_copy if zero_copy else upcast_pack
    data, dst = data.to(device), torch.zeros(layout.out_nbytes, dtype=torch.uint8, device=device)
    need_src, need_dst = table_extent(table, layout.out_dtype)
    assert need_src <= layout.nbytes and need_dst <= layout.out_nbytes  # the layout's own sizes are enough
    # buffers of exactly the extent are enough: on the CPU, conftest's interpreter checks every address the kernel
    # reaches against its arguments' storages, here no larger than the extent
    exact = torch.zeros(need_dst, dtype=torch.uint8, device=device)
    upcast(data[:need_src].clone(), exact, table, n, layout.out_dtype, E4M3)
    reach = r"^the table reaches \d+ bytes of the pack and \d+ of the destination, but they hold \d+ and \d+: give"
    for src, out in ((data, dst[:16]), (data, dst[: need_dst - 1]), (data[:100], dst), (data[: need_src - 1], dst)):
        dst.fill_(7)
        with pytest.raises(ValueError, match=reach):
            upcast(src, out, table, n, layout.out_dtype, E4M3)
        assert (dst == 7).all()  # nothing written
    upcast(data, dst.zero_(), table, n, layout.out_dtype, E4M3)
    assert torch.equal(dst[:need_dst], exact) and not dst[need_dst:].any()
    odd = torch.zeros(layout.out_nbytes + 16, dtype=torch.uint8, device=device)[1:]
    with pytest.raises(ValueError, match=r"^pack and destination must start at 16-byte aligned addresses, got 0 and 1"):
        upcast(data, odd, table, n, layout.out_dtype, E4M3)


def test_what_a_table_reaches_is_read_from_its_rows(device):
    layout, data, _ = _build(MIXED, E4M3)
    table = layout.table()
    with torch.inference_mode():  # an inference tensor counts no versions: enable runs under inference_mode too
        frozen = table.clone()
    assert table_extent(frozen.to(device), torch.bfloat16) == table_extent(table.to(device), torch.bfloat16)
    dst = torch.zeros(layout.out_nbytes, dtype=torch.uint8)
    upcast_pack(data, dst[:16], table, 0, layout.out_dtype, E4M3)  # no programs: nothing reached, nothing written
    assert not dst.any()
    on_device = table.to(device)
    before = table_extent(on_device, torch.bfloat16)
    on_device[-1, 7] += 4096  # an in-place write: seen (one through .data or numpy is not, on a GPU)
    assert table_extent(on_device, torch.bfloat16)[1] == before[1] + 4096 * 2
    broken = table.clone()
    broken[0, 4] = 0  # no elements, yet a padded length the kernel would write
    with pytest.raises(ValueError, match=r"^table rows hold offsets >= 0 and, where padded > 0, numel and row_len > 0"):
        table_extent(broken, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^out dtype must be bf16, fp16 or fp32, got torch.float64$"):
        table_extent(table, torch.float64)


@pytest.mark.parametrize("rows,row_len,piece", [(7, 5, 12), (3, 10, 4), (4, 6, 6), (2, 0, 4), (0, 5, 4)])
def test_row_pieces_cover_the_matrix_once_in_order(rows, row_len, piece):
    seen = []
    for r, c in row_pieces(rows, row_len, piece):
        cells = [(i, j) for i in range(rows)[r] for j in range(row_len)[c]]
        assert 0 < len(cells) <= piece
        seen += cells
    assert seen == [(i, j) for i in range(rows) for j in range(row_len)]


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("piece", [5, 100, 1 << 22])  # parts of rows, whole rows, whole tensors
def test_reference_dequantizes_in_pieces_exactly(monkeypatch, granularity, piece):
    # the reference dequantizes a bounded number of elements at a time (on a GPU its temporaries are outside the
    # budget): the pieces give the bytes the kernel gives
    layout, data, _ = _build(MIXED, E4M3, granularity)
    whole = upcast_pack_reference(data, poisoned(layout.out_nbytes, "cpu"), layout.table(), layout.out_dtype, E4M3)
    monkeypatch.setattr(upcast_module, "REFERENCE_PIECE", piece)
    pieces = upcast_pack_reference(data, poisoned(layout.out_nbytes, "cpu"), layout.table(), layout.out_dtype, E4M3)
    assert torch.equal(pieces, whole)
    out = poisoned(layout.out_nbytes, "cpu")
    upcast_pack(data, out, layout.table(BLOCK), layout.n_programs(BLOCK), layout.out_dtype, E4M3, native=False)
    kernel = layout.views(out)  # the kernel also writes zeros into padding, which no tensor views
    for name, tensor in layout.views(pieces).items():
        assert torch.equal(tensor, kernel[name]), name


class _CompiledStandIn:
    """Stands in on the CPU for what Triton compiles (``kernel[grid](*parameters, stream=...)``: every parameter from
    Triton 3.3 on, those not constexpr under 3.2, whose launcher has the constexprs compiled in): the positional
    arguments are matched to the kernel's parameters by name, then the interpreter runs it."""

    def __init__(self, kernel, launches: list, constants: dict, takes_constexprs: bool):
        self.kernel, self.launches = kernel, launches
        self.constexprs = {n: v for n, v in constants.items() if n in kernel.arg_names}
        self.takes_constexprs = takes_constexprs

    def __getitem__(self, grid):
        def runner(*args, stream):
            names = [n for n in self.kernel.arg_names if self.takes_constexprs or n not in self.constexprs]
            assert len(args) == len(names)
            self.launches.append((grid, stream))
            self.kernel[grid[:1]](**{**self.constexprs, **dict(zip(names, args, strict=True))})

        return runner


class _Kernel:
    """Stands in for the ``@triton.jit`` kernel: ``warmup`` hands over what ``handed`` says (the compiled kernel, a
    future of it as under Triton's asynchronous compile, or nothing, as when a ``jit_cache_hook`` declines); a launch
    through ``[grid]`` runs the interpreted kernel."""

    def __init__(self, kernel, handed: str, takes_constexprs: bool = True):
        self.kernel, self.handed, self.warmups, self.launches, self.jit_launches = kernel, handed, [], [], 0
        self.takes_constexprs = takes_constexprs

    def warmup(self, *args, grid, **constants):
        self.warmups.append((args[3:], grid, constants))
        compiled = _CompiledStandIn(self.kernel, self.launches, constants, self.takes_constexprs)
        if self.handed == "future":
            return SimpleNamespace(result=lambda: compiled)
        return compiled if self.handed == "kernel" else None

    def __getitem__(self, grid):
        self.jit_launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("handed", ["kernel", "future", "none"])
@pytest.mark.parametrize("takes_constexprs", [True, False], ids=["triton>=3.3", "triton-3.2"])
def test_a_prepared_launch_passes_every_parameter_in_order_and_compiles_once(
    fmt, handed, takes_constexprs, monkeypatch
):
    """The hooks launch through ``PreparedUpcast``: the compiled kernel found once, then called with its parameters
    by position on the stream given (the constexprs too where the launcher takes them). Here the interpreter runs what
    the compiled kernel would."""
    import contextlib

    from tritoff.kernels import interpreting

    if not interpreting():
        pytest.skip("the stand-in runs Triton's interpreter (tests/tritoff/test_gpu.py launches the compiled one)")
    kernel = _Kernel(upcast_module._upcast_pack_kernel, handed, takes_constexprs)
    monkeypatch.setattr(upcast_module, "LAUNCHER_TAKES_CONSTEXPRS", takes_constexprs)
    monkeypatch.setattr(upcast_module, "_INTERPRETED", False)
    monkeypatch.setattr(upcast_module, "_upcast_pack_kernel", kernel)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())  # the usual launch's switch
    layout, data, _ = _build(MIXED, fmt)
    prepared = upcast_module.PreparedUpcast(layout.table(), layout.n_programs(), layout.out_dtype, fmt, native=False)
    stream = SimpleNamespace(cuda_stream=1234)
    for _ in range(2):
        out = poisoned(layout.out_nbytes, "cpu")
        prepared(data, out, stream)
        _compare(layout, out, data)
    n_tensors, n_chunks = kernel.warmups[0][0]
    assert (n_tensors, n_chunks) == (len(layout.entries), layout.n_programs())
    if handed == "none":  # nothing to keep: asked again each time, launched through Triton's JIT
        assert len(kernel.warmups) == 2 and kernel.jit_launches == 2 and not kernel.launches
    else:
        assert len(kernel.warmups) == 1 and kernel.jit_launches == 0
        assert kernel.launches == [((layout.n_programs(), 1, 1), 1234)] * 2
    with pytest.raises(TypeError, match="uint8"):
        prepared(data.view(torch.int8), out, stream)
    launched = len(kernel.launches) + kernel.jit_launches
    with pytest.raises(ValueError, match=r"^the table reaches \d+ bytes of the pack and \d+ of the destination"):
        prepared(data, out[:16], stream)  # too short: refused before anything is launched
    assert len(kernel.launches) + kernel.jit_launches == launched


def test_a_prepared_launch_needs_compiled_triton():
    from tritoff.kernels import interpreting

    if not interpreting():
        pytest.skip("compiled Triton prepares launches")
    layout, _, _ = _build(MIXED, E4M3)
    with pytest.raises(ValueError, match="interpreter"):
        upcast_module.PreparedUpcast(layout.table(), layout.n_programs(), layout.out_dtype, E4M3, native=False)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [0, 3], ids=["program-per-chunk", "bounded-grid"])
@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero-copy"])
def test_a_prepared_launch_on_a_stream_not_current_matches_the_reference(zero_copy, programs):
    from tritoff.arena import HostArena
    from tritoff.kernels import native_fp8

    layout, data, _ = _build(MIXED, E4M3)
    block = BLOCK_ZERO_COPY if zero_copy else BLOCK
    if zero_copy:
        arena = HostArena(layout.nbytes)
        arena.buffer.copy_(data)
        src = arena.device_view(0, layout.nbytes)
    else:
        src = data.cuda()
    prepared = upcast_module.PreparedUpcast(
        layout.table(block, "cuda"),
        layout.n_programs(block),
        layout.out_dtype,
        E4M3,
        native=native_fp8("cuda"),
        block=block,
        programs=programs,  # 3: the programs stride over the chunks
    )
    side, outputs = torch.cuda.Stream(), []
    for _ in range(2):
        out = poisoned(layout.out_nbytes, "cuda")
        side.wait_stream(torch.cuda.current_stream())  # the poison is written before the upcast
        prepared(src, out, side)
        outputs.append(out)
    torch.cuda.synchronize()
    for out in outputs:
        _compare(layout, out, data)
    assert len(prepared._runners) == 1
    if zero_copy:
        arena.close()


@pytest.mark.parametrize("programs", [-1, 2.5, "64", True])
def test_a_grid_bound_that_is_not_a_count_is_refused_before_any_launch(programs):
    layout, data, _ = _build(MIXED, E4M3)
    out = poisoned(layout.out_nbytes, "cpu")
    with pytest.raises(ValueError, match=f"programs must be an int >= 0 .*got {programs!r}"):
        upcast_pack(data, out, layout.table(), layout.n_programs(), layout.out_dtype, E4M3, programs=programs)

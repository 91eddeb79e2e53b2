"""Turn a whole pack into the tensors a block computes with, in one launch: Triton kernel, launchers, PyTorch reference.

A pack is a byte buffer holding fp8 payloads, their fp32 scales and tensors kept as they are. Its *table* (int64,
``TABLE_COLUMNS`` per tensor, on the kernel's device) says where each tensor is and where its output goes:

    chunk_start  first program id of this tensor (programs are numbered tensor after tensor)
    kind         KIND_COPY: copy 4-byte words; KIND_FP8: fp8 codes * per-row scale -> out dtype
    src_offset   byte offset of the payload in the pack (256-byte aligned)
    dst_offset   byte offset of the output in the destination buffer (256-byte aligned)
    numel        elements (KIND_COPY: 4-byte words, the payload rounded up; padding is allocated on both sides)
    row_len      elements per scale row (numel for a per-tensor scale)
    scale_offset byte offset of the fp32 scales in the pack (a program whose rows are at least a third of ``BLOCK``
                 long loads the scales of the two to four rows it spans as scalars; shorter rows gather one per
                 element)
    padded       numel rounded up to 16: the kernel's bound, so masks are 16-aligned and accesses vectorize; the
                 regions are padded to 256 bytes on both sides, so the extra elements land in padding

Two transports share the kernel. ``upcast_pack`` reads a GPU staging copy of the pack (its bytes arrive by one
cudaMemcpyAsync on the copy engine). ``upcast_pack_zero_copy`` reads the page-locked host arena directly over PCIe, so
copy and upcast are one pass; its grid is bounded (``ZERO_COPY_PROGRAMS`` programs striding over the chunks) so it
leaves most SMs to the compute it overlaps. Chunk offsets are int64, so a tensor may exceed 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tritoff.formats import StorageFormat, get_format

from .backend import eager, holds_values, launch, launch_device, library_interpreted, native_fp8, register_op
from .fp8_bits import decode_fp8_bits

KIND_COPY, KIND_FP8 = 0, 1
TABLE_COLUMNS = 8
COL_CHUNK_START, COL_KIND, COL_SRC, COL_DST, COL_NUMEL, COL_ROW_LEN, COL_SCALE, COL_PADDED = range(8)
PAD = 16

# Elements per program. 4096 fp8 codes = 4 KiB read and 8 KiB of bf16 written per program: 32 elements a thread at
# 4 warps, enough independent 16-byte accesses in flight; an ffn weight of Wan-14B (5120x13824) is ~17k programs.
BLOCK = 4096
# Warps per program: 4 x 32 threads, 32 elements each at BLOCK (bench/kernels.py also times 8).
WARPS = 4
# Zero-copy reads cross PCIe with ~1-2 us latency, so more bytes per program keeps more requests in flight.
BLOCK_ZERO_COPY = 8192
# Programs of a zero-copy launch. A PCIe read is latency-bound, not SM-bound: a few dozen programs keep enough
# requests in flight (nvbandwidth-style SM reads reach ~35 GB/s; vLLM saw ~12 SMs come within 5% of the peak), and the
# other SMs stay free for the block computing meanwhile. bench/kernels.py sweeps it on the GPU.
ZERO_COPY_PROGRAMS = 32
# Programs of the hooks' HBM-side upcasts (staged chunks, fp8-resident packs); 0: one program per chunk. Such an upcast
# runs beside a block's compute: one program per chunk takes every SM it frees until the upcast ends, a bounded grid
# leaves the others to the compute. bench/kernels.py (g) measures both ways: the upcast's rate alone and how much it
# slows a matmul running beside it. Read when a pipeline is enabled.
UPCAST_PROGRAMS = 0
# Bytes of fp8 codes a thread loads at once; 0: as many as its outputs fill in one 16-byte store (8 for bf16 and fp16,
# 4 for fp32), so loads and stores share one register layout. Triton lays each access out by its own width: 16-byte
# loads beside 8-wide bf16 stores compile to a round trip of every output through shared memory, with a barrier per
# piece, between them (tests/kernels/ptx_probe.py shows it). bench/kernels.py (f) times 16 beside the default.
CODE_LOAD_BYTES = 0

_OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_OUT_TL = (tl.bfloat16, tl.float16, tl.float32)
_OUT_SIZES = (2, 2, 4)
# the dtypes the kernel gives fp8 weights back in (a pack of float64 weights unpacks through the PyTorch reference)
OUT_DTYPES = tuple(_OUT_CODES)


def chunks_for(numel: int, block: int = BLOCK) -> int:
    """Programs the kernel spends on a tensor of ``numel`` units."""
    return -(-numel // block)


def chunk_starts(numels: list[int], block: int = BLOCK) -> list[int]:
    """The ``chunk_start`` column for tensors of ``numels`` units, and (last entry) the total number of programs."""
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + chunks_for(n, block))
    return starts


@triton.jit
def _upcast_chunk(
    pid,
    src_ptr,
    dst_ptr,
    table_ptr,
    n_tensors,
    OUT_DTYPE: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    EXPONENT_BIAS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    MAX_TENSORS: tl.constexpr,
    BLOCK: tl.constexpr,
    CODE_ALIGN: tl.constexpr,
):
    # Which tensor chunk ``pid`` belongs to: count the chunk starts at or below it (one vector load, no search loop).
    t_idx = tl.arange(0, MAX_TENSORS)
    starts = tl.load(table_ptr + t_idx * 8, mask=t_idx < n_tensors, other=2**62)
    t = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    row = table_ptr + t * 8
    # first unit of this chunk, in int64: a tensor may hold more than 2^31 elements (offsets below stay int32)
    first = (pid - tl.load(row)) * BLOCK
    kind = tl.load(row + 1)
    # every offset in a pack is 256-byte aligned: saying so lets the compiler emit 16-byte vector loads and stores
    # (without the hints the sm_90 PTX loads fp8 codes one byte at a time: 32 ld.global.b8 per thread)
    src = src_ptr + tl.multiple_of(tl.load(row + 2), 256)
    dst = dst_ptr + tl.multiple_of(tl.load(row + 3), 256)
    # the bound is the tensor's length rounded up to 16 (its padding absorbs the extra elements), so it stays a
    # multiple of 16 relative to this chunk and masks do not split vectors
    limit = tl.multiple_of(tl.minimum(tl.load(row + 7) - first, BLOCK).to(tl.int32), 16)
    offs = tl.arange(0, BLOCK)
    mask = offs < limit
    if kind == 1:
        # fp8 codes are loaded CODE_ALIGN bytes a thread (as many as its outputs fill in one 16-byte store): Triton
        # lays each access out by its own width, and 16-byte loads beside 8-wide stores would pass every output
        # through shared memory between them (see CODE_LOAD_BYTES)
        codes = src_ptr + tl.multiple_of(tl.load(row + 2), CODE_ALIGN)
        bits = tl.load(codes + first + offs, mask=mask, other=0)
        if NATIVE_FP8:
            x = bits.to(FP8_DTYPE, bitcast=True).to(tl.float32)
        else:
            x = decode_fp8_bits(bits, MANTISSA_BITS, EXPONENT_BIAS)
        row_len = tl.load(row + 5)
        last_row = (tl.load(row + 4) - 1) // row_len  # padding elements reuse the last row's scale
        scales = (src_ptr + tl.load(row + 6)).to(tl.pointer_type(tl.float32), bitcast=True)
        r0 = first // row_len
        if row_len >= BLOCK:
            # the chunk spans at most two rows: two scalar loads and a select, no per-element division or gather
            s0 = tl.load(scales + tl.minimum(r0, last_row))
            s1 = tl.load(scales + tl.minimum(r0 + 1, last_row))
            boundary = tl.minimum((r0 + 1) * row_len - first, BLOCK).to(tl.int32)
            s = tl.where(offs < boundary, s0, s1)
        elif row_len * 3 >= BLOCK:
            # rows of a third of a chunk or more (CogVideoX-5B's 3072, Wan-14B's 5120 in a zero-copy chunk of 8192):
            # at most four rows, four scalar loads and three selects
            s = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(scales + tl.minimum(r0, last_row))
            for k in tl.static_range(1, 4):
                start = tl.minimum((r0 + k) * row_len - first, BLOCK).to(tl.int32)
                s = tl.where(offs >= start, tl.load(scales + tl.minimum(r0 + k, last_row)), s)
        else:
            # short rows (small layers, per-tensor scales of small tensors): one gathered scale per element
            local = (first - r0 * row_len).to(tl.int32)
            rows = r0 + ((offs + local) // row_len.to(tl.int32))
            s = tl.load(scales + tl.minimum(rows, last_row), mask=mask, other=1.0)
        # scale is a power of two: the product is exact, and so is the cast to the out dtype
        out = dst.to(tl.pointer_type(OUT_DTYPE), bitcast=True) + first
        tl.store(out + offs, (x * s).to(OUT_DTYPE), mask=mask)
    else:
        # 4-byte words, four a thread as they are stored: their own range in two halves, since loads sharing ``offs``
        # with the fp8 loads would be laid out at their width, and pass through shared memory to the stores
        half = tl.arange(0, BLOCK // 2)
        for k in tl.static_range(2):
            at = first + k * (BLOCK // 2)
            keep = half < limit - k * (BLOCK // 2)
            words = tl.load(src.to(tl.pointer_type(tl.int32), bitcast=True) + at + half, mask=keep, other=0)
            tl.store(dst.to(tl.pointer_type(tl.int32), bitcast=True) + at + half, words, mask=keep)


# counts are not specialised (Triton would compile a variant per value that is 1 or a multiple of 16)
@triton.jit(do_not_specialize=["n_tensors", "n_chunks"])
def _upcast_pack_kernel(
    src_ptr,
    dst_ptr,
    table_ptr,
    n_tensors,
    n_chunks,
    OUT_DTYPE: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    EXPONENT_BIAS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    MAX_TENSORS: tl.constexpr,
    BLOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,
    CODE_ALIGN: tl.constexpr,
):
    if PERSISTENT:
        # zero-copy: a bounded grid strides over the chunks, so the PCIe read does not hold every SM while blocks
        # compute
        for pid in tl.range(tl.program_id(0), n_chunks, tl.num_programs(0)):
            _upcast_chunk(
                pid,
                src_ptr,
                dst_ptr,
                table_ptr,
                n_tensors,
                OUT_DTYPE,
                FP8_DTYPE,
                MANTISSA_BITS,
                EXPONENT_BIAS,
                NATIVE_FP8,
                MAX_TENSORS,
                BLOCK,
                CODE_ALIGN,
            )
    else:
        # staged: one program per chunk
        _upcast_chunk(
            tl.program_id(0),
            src_ptr,
            dst_ptr,
            table_ptr,
            n_tensors,
            OUT_DTYPE,
            FP8_DTYPE,
            MANTISSA_BITS,
            EXPONENT_BIAS,
            NATIVE_FP8,
            MAX_TENSORS,
            BLOCK,
            CODE_ALIGN,
        )


def _max_tensors(n: int) -> int:
    # a power of two >= 16, so packs of similar size share one compiled variant (plain Python: it runs per launch)
    return max(16, 1 << (n - 1).bit_length())


# whether Triton made the kernel above, and its own library, interpreted, as it decided when decorating them (not
# os.environ, which a launch should not read, and which may have changed since)
_INTERPRETED = not isinstance(_upcast_pack_kernel, JITFunction) and library_interpreted()
# (major, minor) of the installed Triton, whose interfaces changed between 3.2 and 3.3
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
# a compiled kernel's launcher takes every parameter from Triton 3.3 on, the constexprs included (it skips them);
# Triton 3.2's takes only the others
LAUNCHER_TAKES_CONSTEXPRS = TRITON_VERSION >= (3, 3)


def _kernel_arguments(src, dst, table, n_programs, out_code, fp8_e5m2, native, block, grid, warps):
    """The grid, the arguments, the compile-time constants (in the kernel's parameter order) and the launch options of
    one launch. ``grid``: the bound of a zero-copy launch, never more than one program per chunk (0: one per chunk)."""
    n_tensors = table.shape[0]
    # Triton's interpreter runs the strided loop with memory corruption in later, unrelated calls (seen after
    # torch.library.opcheck): on the CPU every launch is one program per chunk, the bound matters only for PCIe
    persistent = bool(grid) and not _INTERPRETED
    constants = dict(
        OUT_DTYPE=_OUT_TL[out_code],
        FP8_DTYPE=tl.float8e5 if fp8_e5m2 else tl.float8e4nv,
        MANTISSA_BITS=2 if fp8_e5m2 else 3,
        EXPONENT_BIAS=15 if fp8_e5m2 else 7,
        NATIVE_FP8=native,
        MAX_TENSORS=_max_tensors(n_tensors),
        BLOCK=block,
        PERSISTENT=persistent,
        CODE_ALIGN=CODE_LOAD_BYTES or 16 // _OUT_SIZES[out_code],
    )
    grid = (min(grid, n_programs) if persistent else n_programs,)
    return grid, (src, dst, table, n_tensors, n_programs), constants, dict(num_warps=warps)


def _upcast_pack_launcher(traceable: bool):
    """The launcher of the upcast kernel. ``traceable``: through ``wrap_triton``, for the registered op's body, where
    torch.compile and ``make_fx`` trace into the kernel. Eager calls launch the kernel itself: outside ``triton_op``'s
    own wrapper, ``wrap_triton`` sends every launch through a higher-order op (hundreds of µs, and a side-table entry
    that is never freed)."""

    def upcast_pack_launch(
        src: torch.Tensor,
        dst: torch.Tensor,
        table: torch.Tensor,
        n_programs: int,
        out_code: int,
        fp8_e5m2: bool,
        native: bool,
        block: int,
        grid: int,
        warps: int,
    ) -> None:
        kernel = launch(_upcast_pack_kernel) if traceable else _upcast_pack_kernel
        grid, args, constants, options = _kernel_arguments(
            src, dst, table, n_programs, out_code, fp8_e5m2, native, block, grid, warps
        )
        kernel[grid](*args, **constants, **options)

    return upcast_pack_launch


_upcast_pack_eager = _upcast_pack_launcher(traceable=False)
# the op torch.compile and fake-tensor tracing see; eager calls launch directly (see ``backend.eager``)
_upcast_pack_op = register_op("upcast_pack", mutates_args=("dst",))(_upcast_pack_launcher(traceable=True))


def check_programs(programs, what: str = "programs") -> int:
    """``programs``, a grid bound (an int >= 0; 0: one program per chunk), or a one-line ValueError naming ``what``."""
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
        raise ValueError(f"{what} must be an int >= 0 (0: one program per chunk), got {programs!r}")
    return programs


# a table on a GPU: its rows, read back once (a sync) or given by GroupRuntime, which builds them on the CPU, and the
# extents found from them per output size, kept on the table object until an in-place write bumps its version
_REACH = "_tritoff_reach"


def table_extent(table: torch.Tensor, out_dtype: torch.dtype, cpu_rows: torch.Tensor | None = None) -> tuple[int, int]:
    """``(source bytes, destination bytes)`` that launches of ``table`` reach: each tensor's region up to its padded
    length, where its masked accesses end, and its scales. A table on the CPU is read at every call; one on a GPU once
    (or from ``cpu_rows``, its rows on the CPU), then again after an in-place write: a write through ``.data`` or
    numpy, which torch does not count, is not seen there."""
    _check_table(table, out_dtype)
    out_size = out_dtype.itemsize
    if table.device.type == "cpu":
        return _extent(table.tolist(), out_size)
    version = None if table.is_inference() else table._version  # inference tensors count no writes
    seen = getattr(table, _REACH, None)
    if seen is None or seen[0] != version:
        seen = (version, (table if cpu_rows is None else cpu_rows).cpu().tolist(), {})
        setattr(table, _REACH, seen)
    if out_size not in seen[2]:
        seen[2][out_size] = _extent(seen[1], out_size)
    return seen[2][out_size]


def _extent(rows: list, out_size: int) -> tuple[int, int]:
    src_end = dst_end = 0
    for _, kind, src, dst, numel, row_len, scale, padded in rows:
        fields = [src, dst, numel, row_len, scale, padded]
        if min(fields) < 0 or (padded > 0 and (numel <= 0 or row_len <= 0)):
            raise ValueError(f"table rows hold offsets >= 0 and, where padded > 0, numel and row_len > 0; got {fields}")
        if padded == 0:
            continue  # its programs' accesses are all masked off
        if kind == KIND_FP8:  # one byte per code, fp32 scales up to the last row's
            src_end = max(src_end, src + padded, scale + 4 * ((numel - 1) // row_len + 1))
            dst_end = max(dst_end, dst + padded * out_size)
        else:  # 4-byte words
            src_end = max(src_end, src + 4 * padded)
            dst_end = max(dst_end, dst + 4 * padded)
    return src_end, dst_end


def _check_reach(src: torch.Tensor, dst: torch.Tensor, reach: tuple[int, int]) -> None:
    if src.numel() < reach[0] or dst.numel() < reach[1]:
        raise ValueError(
            f"the table reaches {reach[0]} bytes of the pack and {reach[1]} of the destination, but they hold "
            f"{src.numel()} and {dst.numel()}: give buffers at least that large (the layout's nbytes and out_nbytes)"
        )


def _check(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, out_dtype: torch.dtype, reach: bool) -> None:
    """Refuse, in one line, what the kernel cannot take; ``reach``: also buffers shorter than the table reaches."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        raise TypeError(f"pack and destination must be uint8 byte buffers, got {src.dtype} and {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("pack and destination buffers must be contiguous")
    _check_table(table, out_dtype)
    if table.device != dst.device:
        raise ValueError(f"table is on {table.device} but the destination is on {dst.device}")
    if not reach or not holds_values(src, dst, table):  # traced (torch.compile, fake tensors): nothing to read yet
        return
    # the kernel reads scales and words 4 bytes at a time, and vectors of 16, at the table's 256-byte aligned offsets
    if src.data_ptr() % 16 or dst.data_ptr() % 16:
        raise ValueError(
            f"pack and destination must start at 16-byte aligned addresses, got {src.data_ptr() % 16} and "
            f"{dst.data_ptr() % 16} bytes past one: slice them at multiples of 256, as packs are laid out"
        )
    _check_reach(src, dst, table_extent(table, out_dtype))


def _check_table(table: torch.Tensor, out_dtype: torch.dtype) -> None:
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != TABLE_COLUMNS:
        raise ValueError(f"table must be int64 of shape (n, {TABLE_COLUMNS}), got {table.dtype} {tuple(table.shape)}")
    if out_dtype not in _OUT_CODES:
        raise ValueError(f"out dtype must be bf16, fp16 or fp32, got {out_dtype}")


def _run(src, dst, table, n_programs, out_dtype, fmt, native, block, grid=0, warps=WARPS):
    fmt = get_format(fmt)  # a name works as well as the format
    _check(src, dst, table, out_dtype, reach=n_programs > 0)
    check_programs(grid)
    if n_programs == 0:
        return dst
    use_native = native_fp8(dst.device) if native is None else native
    e5m2 = fmt.dtype == torch.float8_e5m2
    call = _upcast_pack_eager if eager(src, dst, table) else _upcast_pack_op
    with launch_device(dst):
        call(src, dst, table, n_programs, _OUT_CODES[out_dtype], e5m2, use_native, block, grid, warps)
    return dst


def upcast_pack(
    staged: torch.Tensor,
    dst: torch.Tensor,
    table: torch.Tensor,
    n_programs: int,
    out_dtype: torch.dtype,
    fmt: StorageFormat | str,
    *,
    native: bool | None = None,
    block: int = BLOCK,
    warps: int = WARPS,
    programs: int = 0,
) -> torch.Tensor:
    """Upcast a pack staged in device memory into ``dst`` (uint8) in one launch; returns ``dst``.

    ``table`` and ``n_programs`` (its chunk count) come from the pack, built with ``block`` elements per program;
    ``warps``: warps per program (bench/kernels.py sweeps both); ``native`` forces the hardware fp8 conversion on or
    off (default: on where the device has it); ``programs`` bounds the grid, that many programs striding over the
    chunks (0: one program per chunk; compiled kernels only, the interpreter runs one per chunk).
    """
    return _run(staged, dst, table, n_programs, out_dtype, fmt, native, block, programs, warps)


def upcast_pack_zero_copy(
    host: torch.Tensor,
    dst: torch.Tensor,
    table: torch.Tensor,
    n_programs: int,
    out_dtype: torch.dtype,
    fmt: StorageFormat | str,
    *,
    native: bool | None = None,
    programs: int = ZERO_COPY_PROGRAMS,
) -> torch.Tensor:
    """Upcast a pack read directly from page-locked host memory into ``dst``; returns ``dst``.

    ``host`` is a device-accessible view of the pack (see ``HostArena.device_view``; on the CPU, the pack itself).
    ``table`` and ``n_programs`` come from the pack built with ``BLOCK_ZERO_COPY``. ``programs`` bounds the grid:
    that many programs stride over the chunks, leaving the other SMs to the blocks computing meanwhile.
    """
    return _run(host, dst, table, n_programs, out_dtype, fmt, native, BLOCK_ZERO_COPY, programs)


class PreparedUpcast:
    """One launch made again and again with the same table (a chunk of a streamed group), on a stream it is given.

    A streamed block's hook launches the upcast for the blocks ahead, a few launches per block, and each went through
    Triton's own work per launch (binding and specializing every argument, finding the compiled kernel, reading the
    current stream) and the checks of :func:`upcast_pack`: 42 µs per launch, all included, on the H100 machine's host
    (``bench/hooks.py``). A prepared launch checks once, finds the compiled kernel once per device and pointer
    alignment (all Triton specializes these arguments on; the counts are not specialized on their values, and are
    fixed for each prepared launch anyway) and launches it on ``stream`` directly, so the caller need not make that
    stream current either. Eager CUDA only: the interpreter has no compiled kernel, and torch.compile traces
    :func:`upcast_pack`'s op.

    ``block``: elements per program the table was built for; ``programs``: the zero-copy bound (0: one program per
    chunk, as :func:`upcast_pack`); ``warps``: warps per program.
    """

    def __init__(
        self,
        table: torch.Tensor,
        n_programs: int,
        out_dtype: torch.dtype,
        fmt: StorageFormat | str,
        *,
        native: bool,
        block: int = BLOCK,
        programs: int = 0,
        warps: int = WARPS,
    ):
        if _INTERPRETED:
            raise ValueError("a prepared upcast launches a compiled kernel, which Triton's interpreter has none of")
        check_programs(programs)
        self._reach = table_extent(table, out_dtype)  # checks the table first
        self.table = table
        self.n_programs = n_programs
        e5m2 = get_format(fmt).dtype == torch.float8_e5m2
        self.grid, _, constants, self._options = _kernel_arguments(
            None, None, table, n_programs, _OUT_CODES[out_dtype], e5m2, native, block, programs, warps
        )
        self.grid = (self.grid[0], 1, 1)
        self._constants = constants
        self._values = tuple(constants.values()) if LAUNCHER_TAKES_CONSTEXPRS else ()  # after args, in order
        self._runners: dict[tuple, object] = {}  # (device, src aligned, dst aligned) -> the compiled kernel's launcher

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Upcast ``src`` (the staged chunk, the resident pack, or the host view read zero-copy) into ``dst`` on
        ``stream``. Both are contiguous uint8 buffers on the table's device, which must be the current device: the
        launch runs in the current context."""
        if src.dtype is not torch.uint8 or dst.dtype is not torch.uint8:
            raise TypeError(f"pack and destination must be uint8 byte buffers, got {src.dtype} and {dst.dtype}")
        if self.n_programs == 0:
            return
        _check_reach(src, dst, self._reach)
        args = (src, dst, self.table, self.table.shape[0], self.n_programs)
        key = (dst.device.index, src.data_ptr() % 16 == 0, dst.data_ptr() % 16 == 0)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runner(args, dst)
            if runner is None:  # a Triton hook declined to hand the kernel over: launch it the usual way
                with torch.cuda.stream(stream), launch_device(dst):
                    _upcast_pack_kernel[self.grid[:1]](*args, **self._constants, **self._options)
                return
            self._runners[key] = runner
        runner(*args, *self._values, stream=stream.cuda_stream)

    def _runner(self, args: tuple, dst: torch.Tensor):
        """The compiled kernel's launcher for ``args`` (compiled now, or the kernel Triton compiled already), with its
        binary loaded on ``dst``'s device: Triton compiles for the current device and loads when the launcher is made.
        None when Triton gives no kernel back (a ``jit_cache_hook`` declining a warm-up)."""
        with launch_device(dst):
            compiled = _upcast_pack_kernel.warmup(*args, grid=self.grid, **self._constants, **self._options)
            if compiled is not None and hasattr(compiled, "result"):  # compiling asynchronously: wait for it
                compiled = compiled.result()
            return None if compiled is None else compiled[self.grid]


# elements the reference dequantizes at once: float32 copies of a whole weight (Wan-14B's largest has 70.8M elements)
# would take hundreds of MB beside the buffers a budget counts
REFERENCE_PIECE = 1 << 22


def row_pieces(rows: int, row_len: int, piece: int | None = None):
    """``(row slice, column slice)`` pieces covering a ``rows x row_len`` matrix of scaled rows in order, each of at
    most ``piece`` elements (default :data:`REFERENCE_PIECE`): whole rows when they are shorter, else parts of one."""
    piece = REFERENCE_PIECE if piece is None else piece
    if row_len >= piece:
        for r in range(rows):
            for c in range(0, row_len, piece):
                yield slice(r, r + 1), slice(c, c + piece)
    elif row_len:
        step = piece // row_len
        for r in range(0, rows, step):
            yield slice(r, r + step), slice(0, row_len)


def upcast_pack_reference(
    src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, out_dtype: torch.dtype, fmt: StorageFormat
) -> torch.Tensor:
    """PyTorch reference of the kernel (any table block size): the test oracle and the fallback without Triton."""
    out_size = out_dtype.itemsize
    for _, kind, src_off, dst_off, numel, row_len, scale_off, _ in table.tolist():
        if kind == KIND_COPY:
            dst[dst_off : dst_off + 4 * numel].copy_(src[src_off : src_off + 4 * numel])
            continue
        out = dst[dst_off : dst_off + numel * out_size].view(out_dtype).view(-1, row_len)
        x = src[src_off : src_off + numel].view(fmt.dtype).view(-1, row_len)
        scales = src[scale_off : scale_off + 4 * (numel // row_len)].view(torch.float32)
        for r, c in row_pieces(*x.shape):
            out[r, c].copy_(x[r, c].to(torch.float32) * scales[r, None])
    return dst

"""Kernel microbenchmarks: how fast packs reach the GPU as bf16, against the PCIe and HBM rooflines.

For packs from 1 MB to 1 GB built from Wan-14B block tensor shapes (rows of 5120 plus kept norms and biases): (a)
cudaMemcpyAsync H2D of the fp8 bytes from the registered arena (the PCIe roofline), (b) the same for bf16 bytes, (c)
staged: copy + ``upcast_pack``, (c') the same for 4 packs in a row, streamed as the engine streams them (two chunks a
pack through two staging halves, the DMA of one overlapping the upcast of the other), (d) ``upcast_pack_zero_copy``,
(e) the PyTorch way per tensor (``w.to("cuda", non_blocking=True).to(bf16) * scale``), (f) the HBM-side upcast alone
against a device-to-device copy and PyTorch's own cast of as many fp8 codes to bf16 (the upcast's mix of one byte
read to two written), also with 2048 to 16384 elements and 4 or 8 warps per program, and with 16-byte code loads
(``CODE_LOAD_BYTES``: outputs through shared memory; (d) too), all timed on the device alone
(queued behind a spin kernel, so the host's launch is not counted). Then (c) and (d) beside
a large matmul: how much each slows it. Last, (g): a Wan-14B block's compute at one frame (its linear layers' matmuls at
1,560 tokens) with the next block's 351 MB pack upcast from HBM beside it, as tritoff runs fp8-resident blocks, for
grids of one program per chunk and grids bounded to a share of the SMs (``UPCAST_PROGRAMS``): time per block against
the matmuls alone, and each grid's upcast rate alone. (h): the HBM upcast of a 256 MB pack of one row length for each
way the kernel finds a row's scale (``ROW_LENGTHS``), against a device-to-device copy.

Usage: python bench/kernels.py [--smoke] [--out DIR] [--deadline SECONDS]
  --smoke: tiny packs on the CPU through the Triton interpreter. --out: where kernels.json goes (default
  bench/results). --deadline: seconds since the epoch after which no further pack size is started (the JSON is
  rewritten after every size, so a run stopped from outside keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import markdown_table, out_directory, plot_lines, write_result  # noqa: E402

from tritoff.arena import HostArena  # noqa: E402
from tritoff.arguments import OneLineParser, at_least  # noqa: E402
from tritoff.chunks import halving_chunk, split_pack, stage_chunk  # noqa: E402
from tritoff.formats import get_format  # noqa: E402
from tritoff.kernels import upcast as upcast_module  # noqa: E402
from tritoff.kernels.quantize import quantize, quantize_reference  # noqa: E402
from tritoff.kernels.upcast import (  # noqa: E402
    BLOCK,
    BLOCK_ZERO_COPY,
    WARPS,
    upcast_pack,
    upcast_pack_reference,
    upcast_pack_zero_copy,
)
from tritoff.pack import PackLayout, TensorSpec, write_pack  # noqa: E402

WIDTH = 5120  # Wan-14B hidden size
# elements and warps per program swept for (f), the kernels' BLOCK and WARPS among them: the next tuning of the HBM
# upcast starts here
UPCAST_BLOCKS = (2048, 4096, 8192, 16384)
UPCAST_WARPS = (4, 8)
SIZES_MB = (1, 4, 16, 32, 64, 128, 256, 351, 1024)  # 351 MB: one Wan-14B block in fp8
# (g): programs per HBM upcast as a multiple of the SM count (0: one per chunk), each with (elements, warps) per program
UPCAST_GRID_SHARES = (0, 0.25, 0.5, 1, 2)
UPCAST_GRID_SHAPES = ((BLOCK, WARPS), (16384, 8))
TOKENS_ONE_FRAME = 1560  # Wan at 480x832, 1 frame
STREAMED = 4  # packs onloaded in a row for (c')
SPIN_CYCLES = 1_000_000  # the spin ahead of a device-timed call: ~0.5 ms at ~2 GHz, past any launch's host time
# (h): a row length for each way a program of BLOCK elements finds its scales (kernels/upcast.py): a gather per
# element (rows under BLOCK / 3), up to four rows' scalars (CogVideoX-5B's 3072), one or two rows' (Wan-14B's 5120)
ROW_LENGTHS = {1024: "gather", 3072: "four rows", 5120: "two rows"}


def block_specs(target_bytes: int, width: int = WIDTH) -> list[TensorSpec]:
    """Linear weights of ``width`` columns (like Wan's q/k/v/o and ffn) adding up to ~``target_bytes`` of fp8, plus the
    kept tensors a block carries (biases, norm weights)."""
    shapes = [(width, width)] * 8 + [(13824, width), (width, 13824)]  # a Wan block: 2 attentions, the ffn
    specs, total, i = [], 0, 0
    while total < target_bytes:
        rows, cols = shapes[i % len(shapes)]
        rows = min(rows, max(1, (target_bytes - total) // cols))
        specs.append(TensorSpec(f"w{i}.weight", (rows, cols), torch.bfloat16, True))
        specs.append(TensorSpec(f"w{i}.bias", (rows,), torch.bfloat16, False))
        total += rows * cols
        i += 1
    specs.append(TensorSpec("norm.weight", (width,), torch.float32, False))
    return specs


def build_pack(target_bytes: int, width: int, register: bool, specs: list[TensorSpec] | None = None):
    """A pack of ~``target_bytes`` (or of ``specs``) in its own arena. On a GPU its tensors are drawn there and
    quantized by tritoff's Triton kernel (a 1 GB pack in about a second; drawing and quantizing 1e9 weights on the
    host takes tens of seconds)."""
    fmt = get_format("fp8_e4m3")
    layout = PackLayout.plan(specs or block_specs(target_bytes, width), fmt)
    arena = HostArena(layout.nbytes, register=register)
    work = torch.device("cuda" if register and torch.cuda.is_available() else "cpu")
    gen = torch.Generator(work).manual_seed(0)
    tensors = {
        e.name: (torch.randn(e.shape, generator=gen, device=work) * (0.02 if len(e.shape) > 1 else 1.0)).to(e.dtype)
        for e in layout.entries
    }
    quantizer = (lambda w, f, granularity: quantize(w, f, granularity)) if work.type == "cuda" else quantize_reference
    write_pack(layout, arena.buffer, tensors, quantizer)
    return layout, arena, fmt


def timed(fn, device, reps: int, setup=None) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, wall clock on the CPU), after a warm-up; ``setup``, if given,
    runs before each timed call, outside the window (work it queues on other streams overlaps the call)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            if setup is not None:
                setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_timed(fn, device, reps: int) -> float:
    """:func:`timed` for work that runs on the device alone (the HBM upcast, a device-to-device copy): on a GPU a spin
    kernel is queued ahead of each timed call, so the call is queued while the GPU spins and the window holds its
    device time, not the host's launch (Triton's launch from Python takes ~35 µs on the H200, a third of a 32 MiB
    upcast). The engine queues its upcasts ahead of the compute the same way."""
    return timed(fn, device, reps, setup=_spin if device.type == "cuda" else None)


def _spin() -> None:
    torch.cuda._sleep(SPIN_CYCLES)


def streamed_onload(layout: PackLayout, host: torch.Tensor, out: torch.Tensor, fmt, device: torch.device):
    """A call that onloads the pack in ``host`` into ``out`` :data:`STREAMED` times in a row as ``Transfer.fill``
    does (``tritoff/transfer.py``): two chunks per pack, each copied into one of two staging halves on a copy stream
    and upcast from there on an upcast stream, events only; the current stream waits for the last upcast. On the CPU
    (the smoke run) the same steps run one after the other. Returns the call, a call that poisons both halves (run
    before the checked call, so an upcast reading a half before its copy lands fails the check) and the chunks."""
    cuda = device.type == "cuda"
    capacity = halving_chunk(layout)  # the engine's staging half: two chunks per pack
    chunks = split_pack(layout, capacity)
    tables = [(c.table(BLOCK, device), c.n_programs(BLOCK)) for c in chunks]
    halves = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(2)]
    copy_stream = upcast_stream = None
    if cuda:
        copy_stream, upcast_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        staged_events, free_events = [torch.cuda.Event() for _ in halves], [torch.cuda.Event() for _ in halves]

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def onload():
        if cuda:
            current = torch.cuda.current_stream(device)
            copy_stream.wait_stream(current)
            upcast_stream.wait_stream(current)
        for step in range(STREAMED * len(chunks)):
            half, chunk = step % 2, chunks[step % len(chunks)]
            table, programs = tables[step % len(chunks)]
            with on(copy_stream):
                if cuda and step >= 2:
                    copy_stream.wait_event(free_events[half])
                staged = stage_chunk(chunk, host, halves[half])
                if cuda:
                    staged_events[half].record(copy_stream)
            with on(upcast_stream):
                if cuda:
                    upcast_stream.wait_event(staged_events[half])
                upcast_pack(staged, out, table, programs, layout.out_dtype, fmt)
                if cuda:
                    free_events[half].record(upcast_stream)
        if cuda:
            current.wait_stream(upcast_stream)

    def poison():
        for half in halves:
            half.fill_(0xFF)

    return onload, poison, len(chunks)


@contextlib.contextmanager
def code_loads(nbytes: int):
    """Upcasts launched inside load ``nbytes`` of fp8 codes a thread (``kernels/upcast.py``: ``CODE_LOAD_BYTES``)."""
    upcast_module.CODE_LOAD_BYTES = nbytes
    try:
        yield
    finally:
        upcast_module.CODE_LOAD_BYTES = 0


def measure_size(target_bytes: int, device: torch.device, width: int, reps: int) -> dict:
    """Every transport's time for a pack of about ``target_bytes`` (median of ``reps``), and its checks."""
    cuda = device.type == "cuda"
    layout, arena, fmt = build_pack(target_bytes, width, register=cuda)
    host = arena.buffer
    wire, out_bytes = layout.nbytes, layout.out_nbytes
    staged = torch.empty(wire, dtype=torch.uint8, device=device)
    out = torch.empty(out_bytes, dtype=torch.uint8, device=device)
    table, programs = layout.table(BLOCK, device), layout.n_programs(BLOCK)
    results = {"pack_bytes": wire, "bf16_bytes": out_bytes}

    def record(name, seconds, moved, delivered):
        results[name] = {
            "seconds": seconds,
            "wire_GBps": moved / seconds / 1e9,
            "delivered_bf16_GBps": delivered / seconds / 1e9,
        }

    record("a_h2d_fp8", timed(lambda: staged.copy_(host, non_blocking=True), device, reps), wire, 0)
    # the reference runs where the pack is (on a GPU: the staged bytes), so checking a 1 GB pack takes no host time
    expected = upcast_pack_reference(
        staged, torch.empty(out_bytes, dtype=torch.uint8, device=device), layout.table(), layout.out_dtype, fmt
    )
    exact = {"h2d": torch.equal(staged.cpu(), host)}

    def check(name):
        exact[name] = all(
            torch.equal(a, b) for a, b in zip(layout.views(out).values(), layout.views(expected).values(), strict=True)
        )
        out.fill_(0xFF)  # NaN in bf16: whatever the next path leaves unwritten fails its check

    bf16_host = HostArena(out_bytes, register=cuda)
    bf16_host.buffer.fill_(1)
    record(
        "b_h2d_bf16", timed(lambda: out.copy_(bf16_host.buffer, non_blocking=True), device, reps), out_bytes, out_bytes
    )

    def staged_path():
        staged.copy_(host, non_blocking=True)
        upcast_pack(staged, out, table, programs, layout.out_dtype, fmt)

    out.fill_(0xFF)
    record("c_staged", timed(staged_path, device, reps), wire, out_bytes)
    check("staged")
    # (c') the same pack STREAMED times in a row as the engine moves packs: in two chunks through two staging halves,
    # so each chunk's DMA overlaps the previous one's upcast; a lone pack's upcast tail is paid once, not per pack
    streamed, poison, results["streamed_chunks"] = streamed_onload(layout, host, out, fmt, device)
    record("c2_staged_streamed", timed(streamed, device, reps, setup=poison), STREAMED * wire, STREAMED * out_bytes)
    check("staged_streamed")
    if cuda:
        zc_table, zc_programs = layout.table(BLOCK_ZERO_COPY, device), layout.n_programs(BLOCK_ZERO_COPY)
        host_view = arena.device_view(0, wire, device)

        def zero_copy():
            upcast_pack_zero_copy(host_view, out, zc_table, zc_programs, layout.out_dtype, fmt)

        record("d_zero_copy", timed(zero_copy, device, reps), wire, out_bytes)
        check("zero_copy")
        with code_loads(16):  # beside the former 16-byte code loads, as (f)
            record("d_zero_copy_wide_code_loads", timed(zero_copy, device, reps), wire, out_bytes)
        check("zero_copy_wide_code_loads")

        def torch_way():
            for e in layout.entries:
                payload = host[e.offset : e.offset + e.nbytes]
                if e.kind == 1:
                    w = payload.to(device, non_blocking=True).view(fmt.dtype).to(torch.bfloat16).view(e.shape[0], -1)
                    s = host[e.scale_offset : e.scale_offset + 4 * e.num_scales].view(torch.float32)
                    w * s.to(device, non_blocking=True).to(torch.bfloat16)[:, None]
                else:
                    payload.to(device, non_blocking=True)

        record("e_torch_per_tensor", timed(torch_way, device, reps), wire, out_bytes)
        d2d_src = torch.empty(out_bytes, dtype=torch.uint8, device=device)
        d2d_dst = torch.empty_like(d2d_src)
        seconds = device_timed(lambda: d2d_dst.copy_(d2d_src), device, reps)
        results["hbm_d2d"] = {"seconds": seconds, "GBps_read_plus_write": 2 * out_bytes / seconds / 1e9}
    results["hbm_cast_torch"] = torch_cast(out_bytes // 2, fmt, device, reps)
    # (f) at every swept size of program; the kernels' own (BLOCK, WARPS) is timed once, as the (f) figure
    seconds_by_config = {}
    # Triton's interpreter (the smoke run) runs a program's warps as one: on the CPU they would time the same launch
    warps_swept = UPCAST_WARPS if device.type == "cuda" else (WARPS,)
    for block in UPCAST_BLOCKS:
        block_table, block_programs = layout.table(block, device), layout.n_programs(block)
        for warps in warps_swept:

            def upcast(block=block, warps=warps, block_table=block_table, block_programs=block_programs):
                upcast_pack(staged, out, block_table, block_programs, layout.out_dtype, fmt, block=block, warps=warps)

            seconds_by_config[block, warps] = device_timed(upcast, device, reps)
            check("hbm_upcast" if (block, warps) == (BLOCK, WARPS) else f"hbm_upcast_{block}x{warps}")
    seconds = seconds_by_config[BLOCK, WARPS]
    rate = {config: (wire + out_bytes) / t / 1e9 for config, t in seconds_by_config.items()}
    results["f_hbm_upcast"] = {"seconds": seconds, "GBps_read_plus_write": rate[BLOCK, WARPS]}
    # the kernels' own launch with 16-byte code loads, whose outputs pass through shared memory on their way to the
    # stores: what loads laid out as their stores gain
    with code_loads(16):
        wide = device_timed(lambda: upcast_pack(staged, out, table, programs, layout.out_dtype, fmt), device, reps)
    check("hbm_upcast_wide_code_loads")
    results["f_hbm_upcast_wide_code_loads_GBps"] = (wire + out_bytes) / wide / 1e9
    results["f_hbm_upcast_GBps_by_block"] = {str(b): rate[b, WARPS] for b in UPCAST_BLOCKS}
    # "elements x warps" per program
    results["f_hbm_upcast_GBps_by_config"] = {f"{b}x{w}": r for (b, w), r in rate.items()}
    results["exact_by_path"] = exact
    results["exact"] = all(exact.values())
    arena.close()
    bf16_host.close()
    return results


def torch_cast(elements: int, fmt, device: torch.device, reps: int) -> dict:
    """PyTorch's own elementwise cast of ``elements`` fp8 codes to bf16 (no scale): one byte read and two written per
    element, the upcast's mix, where the D2D copy reads and writes alike. What a plain elementwise kernel reaches
    with that mix tells the kernel's own cost apart from the memory's."""
    codes = torch.empty(elements, dtype=torch.uint8, device=device).view(fmt.dtype)
    out = torch.empty(elements, dtype=torch.bfloat16, device=device)
    seconds = device_timed(lambda: out.copy_(codes), device, reps)
    return {"seconds": seconds, "GBps_read_plus_write": 3 * elements / seconds / 1e9}


def overlap(device: torch.device, target_bytes: int, reps: int) -> dict:
    """How much the staged and zero-copy onloads slow a large matmul running on the compute stream: the matmuls'
    own time (events on the compute stream around them alone) with enough onloads queued on a side stream first to
    run through the whole window, against the matmuls alone."""
    layout, arena, fmt = build_pack(target_bytes, WIDTH, register=True)
    staged = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(layout.out_nbytes, dtype=torch.uint8, device=device)
    table, programs = layout.table(BLOCK, device), layout.n_programs(BLOCK)
    zc_table, zc_programs = layout.table(BLOCK_ZERO_COPY, device), layout.n_programs(BLOCK_ZERO_COPY)
    host_view = arena.device_view(0, layout.nbytes, device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device)

    def matmuls():
        for _ in range(20):
            a @ a

    alone = timed(matmuls, device, reps)
    onload_s = timed(lambda: staged.copy_(arena.buffer, non_blocking=True), device, 3)
    # onloads queued ahead of the matmuls must outlast them, or part of the window runs with nothing to slow it
    queued = max(4, math.ceil(2 * alone / onload_s))
    results = {"matmul_alone_s": alone, "onloads_queued": queued}
    for name, onload in (
        (
            "staged",
            lambda: (
                staged.copy_(arena.buffer, non_blocking=True),
                upcast_pack(staged, out, table, programs, layout.out_dtype, fmt),
            ),
        ),
        ("zero_copy", lambda: upcast_pack_zero_copy(host_view, out, zc_table, zc_programs, layout.out_dtype, fmt)),
    ):

        def queue(onload=onload):
            torch.cuda.synchronize(device)  # the last rep's onloads too: each rep starts with the side stream idle
            with torch.cuda.stream(side):
                for _ in range(queued):
                    onload()

        with_onload = timed(matmuls, device, reps, setup=queue)
        results[f"matmul_with_{name}_s"] = with_onload
        results[f"slowdown_{name}_pct"] = 100 * (with_onload / alone - 1)
    torch.cuda.synchronize(device)  # the last onloads, before their buffers and the arena go
    arena.close()
    return results


def upcast_beside_compute(device: torch.device, target_bytes: int, width: int, reps: int, blocks: int = 8) -> dict:
    """(g) ``blocks`` Wan-14B blocks' linear layers at one frame on the compute stream, each block's matmuls waiting for
    its pack's upcast from HBM, which ran on a side stream beside the previous block's matmuls (tritoff's fp8-resident
    tier), for every grid of :data:`UPCAST_GRID_SHARES` x :data:`UPCAST_GRID_SHAPES`: seconds per block against the
    matmuls alone, and each grid's upcast alone (GB/s read + written). On the CPU (the smoke run) the same steps run
    one after the other, for the grid shapes alone: the interpreter runs one program per chunk whatever the bound."""
    cuda = device.type == "cuda"
    layout, arena, fmt = build_pack(target_bytes, width, register=cuda)
    staged = arena.buffer.to(device, copy=True)
    arena.close()
    outs = [torch.empty(layout.out_nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    expected = upcast_pack_reference(staged, torch.empty_like(outs[0]), layout.table(), layout.out_dtype, fmt)
    tokens, hidden = (TOKENS_ONE_FRAME, 13824) if cuda else (16, 2 * width)
    x = torch.randn(tokens, width, dtype=torch.bfloat16, device=device)
    square = torch.randn(width, width, dtype=torch.bfloat16, device=device) / width**0.5
    up = torch.randn(width, hidden, dtype=torch.bfloat16, device=device) / width**0.5
    down = torch.randn(hidden, width, dtype=torch.bfloat16, device=device) / hidden**0.5
    side = torch.cuda.Stream(device) if cuda else None
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4

    def on_side():
        return torch.cuda.stream(side) if cuda else contextlib.nullcontext()

    def block_compute():
        for _ in range(8):  # q, k, v, o of self- and cross-attention
            x @ square
        (x @ up) @ down

    alone = timed(lambda: [block_compute() for _ in range(blocks)], device, reps) / blocks
    results = {"sms": sms, "tokens": tokens, "compute_alone_s_per_block": alone, "grids": {}}
    for share in UPCAST_GRID_SHARES if cuda else (0,):  # the interpreter runs one program per chunk whatever the bound
        programs = round(share * sms)
        for block, warps in UPCAST_GRID_SHAPES:
            table, n_programs = layout.table(block, device), layout.n_programs(block)

            def upcast(out, block=block, warps=warps, table=table, n_programs=n_programs, programs=programs):
                upcast_pack(
                    staged, out, table, n_programs, layout.out_dtype, fmt, block=block, warps=warps, programs=programs
                )

            upcast_s = device_timed(lambda upcast=upcast: upcast(outs[0]), device, reps)
            ready = [torch.cuda.Event() if cuda else None for _ in range(blocks + 1)]

            def first(upcast=upcast, ready=ready):  # the first block's pack, before the window, as in a steady run
                with on_side():
                    upcast(outs[0])
                    if cuda:
                        ready[0].record(side)
                        torch.cuda.synchronize(device)

            def forward(upcast=upcast, ready=ready):
                compute = torch.cuda.current_stream(device) if cuda else None
                for k in range(blocks):
                    if cuda:
                        compute.wait_event(ready[k])
                    with on_side():
                        if cuda:
                            side.wait_stream(compute)  # its slot was read by the block before, as in the ring
                        upcast(outs[(k + 1) % 2])  # the next block's pack, beside this block's matmuls
                        if cuda:
                            ready[k + 1].record(side)
                    block_compute()
                if cuda:
                    compute.wait_stream(side)

            for out in outs:
                out.fill_(0xFF)  # NaN in bf16: a grid that left chunks unwritten fails the check
            beside = timed(forward, device, reps, setup=first) / blocks
            got, want = layout.views(outs[0]), layout.views(expected)
            results["grids"][f"{programs}x{block}x{warps}"] = {
                "programs": programs,
                "elements": block,
                "warps": warps,
                "upcast_alone_GBps": (layout.nbytes + layout.out_nbytes) / upcast_s / 1e9,
                "s_per_block": beside,
                "slowdown_pct": 100 * (beside / alone - 1),
                "exact": all(torch.equal(got[name], want[name]) for name in want),
            }
    return results


def upcast_by_row_length(device: torch.device, target_bytes: int, reps: int) -> dict:
    """(h) The HBM upcast (``BLOCK`` x ``WARPS``) of a pack holding one weight of ~``target_bytes`` for each row length
    of :data:`ROW_LENGTHS`, against a device-to-device copy of its output (GB/s read + written), and its check."""
    return {
        str(row_len): {"path": path, **upcast_rows_of(row_len, device, target_bytes, reps)}
        for row_len, path in ROW_LENGTHS.items()
    }


def upcast_rows_of(row_len: int, device: torch.device, target_bytes: int, reps: int) -> dict:
    """One row length of (h)."""
    spec = TensorSpec("w.weight", (max(1, target_bytes // row_len), row_len), torch.bfloat16, True)
    layout, arena, fmt = build_pack(target_bytes, row_len, register=device.type == "cuda", specs=[spec])
    staged = arena.buffer.to(device, copy=True)
    arena.close()
    out = torch.full((layout.out_nbytes,), 0xFF, dtype=torch.uint8, device=device)
    table, programs = layout.table(BLOCK, device), layout.n_programs(BLOCK)
    seconds = device_timed(lambda: upcast_pack(staged, out, table, programs, layout.out_dtype, fmt), device, reps)
    expected = upcast_pack_reference(staged, torch.empty_like(out), layout.table(), layout.out_dtype, fmt)
    rate = (layout.nbytes + layout.out_nbytes) / seconds / 1e9
    row = {"pack_bytes": layout.nbytes, "seconds": seconds, "GBps_read_plus_write": rate}
    if device.type == "cuda":
        copy = torch.empty_like(out)
        d2d = 2 * layout.out_nbytes / device_timed(lambda: copy.copy_(out), device, reps) / 1e9
        row |= {"hbm_d2d_GBps": d2d, "pct_of_d2d": 100 * rate / d2d}
    row["exact"] = torch.equal(layout.views(out)["w.weight"], layout.views(expected)["w.weight"])
    return row


def main() -> None:
    """Run, print tables, write kernels.json (after every pack size, so a stopped run keeps what it measured)."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny packs on the CPU (CI)")
    parser.add_argument("--reps", type=at_least(1), default=None, help="timed runs per measurement (20; --smoke: 2)")
    parser.add_argument(
        "--out", type=out_directory, default=None, help="where kernels.json and .png go (default bench/results)"
    )
    parser.add_argument("--deadline", type=float, default=None, help="epoch seconds: start no pack size after this")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(
            "bench/kernels.py measures a GPU's transfers and kernels, and no CUDA device is here: run it on a GPU, or "
            "with --smoke for tiny packs on the CPU (Triton's interpreter)"
        )
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes = [2**16, 2**18] if args.smoke else [mb * 2**20 for mb in SIZES_MB]
    width = 256 if args.smoke else WIDTH
    reps = args.reps or (2 if args.smoke else 20)
    rows, table = [], []
    data = {
        "sizes": rows,
        "reps": reps,
        "device_timed": "(f), (h), D2D copies, the PyTorch cast, (g) upcast alone: behind a spin",
    }
    slowest = 0.0
    for size in sizes:
        if args.deadline and time.time() + 2 * slowest > args.deadline:
            data["stopped"] = f"time budget: sizes from {size / 2**20:.0f} MiB on were not run"
            print(data["stopped"])
            break
        start = time.perf_counter()
        r = measure_size(size, device, width, reps)
        r["wall_s"] = time.perf_counter() - start
        slowest = max(slowest, r["wall_s"])
        rows.append(r)
        write_result("kernels", data, smoke=args.smoke, out=args.out)
        roof = r["a_h2d_fp8"]["wire_GBps"]
        cells = [f"{r['pack_bytes'] / 2**20:.1f}", f"{roof:.1f}", f"{r['b_h2d_bf16']['wire_GBps']:.1f}"]
        for key in (
            "c_staged",
            "c2_staged_streamed",
            "d_zero_copy",
            "d_zero_copy_wide_code_loads",
            "e_torch_per_tensor",
        ):
            if key in r:
                cells.append(f"{r[key]['wire_GBps']:.1f} ({100 * r[key]['wire_GBps'] / roof:.0f}%)")
            else:
                cells.append("-")
        hbm = r.get("hbm_d2d", {}).get("GBps_read_plus_write")
        up = r["f_hbm_upcast"]["GBps_read_plus_write"]
        cast = r["hbm_cast_torch"]["GBps_read_plus_write"]
        wide = r["f_hbm_upcast_wide_code_loads_GBps"]
        cells.append(f"{up:.0f}" + (f" ({100 * up / hbm:.0f}%)" if hbm else ""))
        cells.append(f"{wide:.0f}" + (f" ({100 * wide / hbm:.0f}%)" if hbm else ""))
        cells.append(f"{cast:.0f}" + (f" ({100 * cast / hbm:.0f}%)" if hbm else ""))
        cells.append("yes" if r["exact"] else "NO")
        table.append(cells)
    header = [
        "pack MiB",
        "(a) H2D fp8 GB/s",
        "(b) H2D bf16",
        "(c) staged",
        f"(c') staged, {STREAMED} in a row",
        "(d) zero-copy",
        "(d) with 16-byte code loads",
        "(e) torch",
        "(f) HBM upcast GB/s (% of D2D)",
        "(f) with 16-byte code loads",
        "PyTorch fp8->bf16 cast (% of D2D)",
        "exact",
    ]
    print(f"device: {device}; wire GB/s (fp8 bytes per second; % of (a)); (f) counts read + write bytes")
    print(markdown_table(header, table))
    configs = list(rows[0]["f_hbm_upcast_GBps_by_config"]) if rows else []
    sweep = [
        [f"{r['pack_bytes'] / 2**20:.1f}"] + [f"{r['f_hbm_upcast_GBps_by_config'][c]:.0f}" for c in configs]
        for r in rows
    ]
    print(f"\n(f) HBM upcast GB/s by elements x warps per program (the kernels use {BLOCK}x{WARPS}):")
    print(markdown_table(["pack MiB", *configs], sweep))
    # the overlap probe and (g) take about 20 s on an H100: not started with less time than that left
    late = args.deadline is not None and time.time() + 30 > args.deadline
    if late and "stopped" not in data:
        data["stopped"] = "time budget: the overlap probe and (g) were not run"
        print(data["stopped"])
    if device.type == "cuda" and "stopped" not in data:
        ov_reps = max(3, reps // 4)  # each timing runs a window of large matmuls
        data["overlap_351MB"] = ov = {**overlap(device, 351 * 2**20, ov_reps), "reps": ov_reps}
        print(
            f"\nmatmul slowdown while onloading: staged {ov['slowdown_staged_pct']:.1f}%, "
            f"zero-copy {ov['slowdown_zero_copy_pct']:.1f}%"
        )
    if "stopped" not in data:
        write_result("kernels", data, smoke=args.smoke, out=args.out)
        try:
            cuda = device.type == "cuda"
            g_reps = max(2, reps // 4)  # each of its timings runs 8 blocks' matmuls, or a pack upcast per grid
            g = upcast_beside_compute(device, 351 * 2**20 if cuda else 2**16, width, g_reps, 8 if cuda else 2)
            g["reps"] = g_reps
        except Exception as err:  # keep what was measured before it
            g = {"error": f"{type(err).__name__}: {err}"[:500], "grids": {}}
            print(f"(g) failed: {g['error']}")
        data["upcast_beside_compute"] = g
        if "error" not in g:
            print(
                f"\n(g) a Wan-14B block's matmuls at 1 frame: {1e3 * g['compute_alone_s_per_block']:.2f} ms "
                "alone; with the next block's pack upcast from HBM beside them, by programs x elements x warps per "
                "launch (0 programs: one per chunk):"
            )
            grid_rows = [
                [
                    name,
                    f"{r['upcast_alone_GBps']:.0f}",
                    f"{1e3 * r['s_per_block']:.2f}",
                    f"{r['slowdown_pct']:+.1f}%",
                    "yes" if r["exact"] else "NO",
                ]
                for name, r in g["grids"].items()
            ]
            print(markdown_table(["grid", "upcast alone GB/s", "ms / block", "slowdown", "exact"], grid_rows))
    # (h) takes a few seconds on an H100 (three 256 MB packs built and upcast)
    if args.deadline is not None and time.time() + 15 > args.deadline and "stopped" not in data:
        data["stopped"] = "time budget: (h) was not run"
        print(data["stopped"])
    if "stopped" not in data:
        write_result("kernels", data, smoke=args.smoke, out=args.out)  # (g), kept if (h) fails or is stopped
        h_reps = max(3, reps // 2)
        try:
            h = upcast_by_row_length(device, 256 * 2**20 if device.type == "cuda" else 2**16, h_reps)
        except Exception as err:  # keep what was measured before it
            h = {}
            data["upcast_by_row_length_error"] = f"{type(err).__name__}: {err}"[:500]
            print(f"(h) failed: {data['upcast_by_row_length_error']}")
        data["upcast_by_row_length"] = {"reps": h_reps, "rows": h}
        print(f"\n(h) HBM upcast ({BLOCK} elements x {WARPS} warps per program) by row length:")
        h_rows = [
            [
                row_len,
                r["path"],
                f"{r['GBps_read_plus_write']:.0f}",
                f"{r['pct_of_d2d']:.0f}%" if "pct_of_d2d" in r else "-",
                "yes" if r["exact"] else "NO",
            ]
            for row_len, r in h.items()
        ]
        print(markdown_table(["row length", "scales", "GB/s", "% of D2D", "exact"], h_rows))
    print(f"\nwrote {write_result('kernels', data, smoke=args.smoke, out=args.out)}")
    mib = [r["pack_bytes"] / 2**20 for r in rows]
    series = {
        label: (mib, [r[key]["delivered_bf16_GBps"] if key != "a_h2d_fp8" else r[key]["wire_GBps"] for r in rows])
        for key, label in (
            ("a_h2d_fp8", "(a) H2D fp8 wire (roofline)"),
            ("b_h2d_bf16", "(b) H2D bf16"),
            ("c_staged", "(c) staged: bf16 delivered"),
            ("c2_staged_streamed", f"(c') staged, {STREAMED} in a row: bf16 delivered"),
            ("d_zero_copy", "(d) zero-copy: bf16 delivered"),
            ("e_torch_per_tensor", "(e) torch per tensor: bf16 delivered"),
        )
        if rows and key in rows[0]
    }
    plot = plot_lines(
        "kernels",
        series,
        "pack size (MiB)",
        "GB/s",
        f"onload rates on {device}",
        logx=True,
        smoke=args.smoke,
        out=args.out,
    )
    if plot:
        print(f"wrote {plot}")
    beside = data.get("upcast_beside_compute", {}).get("grids", {}).values()
    by_row_length = data.get("upcast_by_row_length", {}).get("rows", {}).values()
    if not all(r["exact"] for r in [*rows, *beside, *by_row_length]):
        sys.exit("a kernel result differed from the reference")


if __name__ == "__main__":
    main()

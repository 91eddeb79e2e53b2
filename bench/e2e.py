"""End to end: transformer forwards (the step that repeats) and whole pipelines under a GPU memory cap.

Transformer rows, same weights and inputs: all-resident bf16 (no cap); tritoff group fp8 and tritoff auto at the cap;
diffusers at the same cap: bf16 ``enable_group_offload(block_level, 1 block, use_stream=True, record_stream=True)``
(its fastest published configuration), ``enable_layerwise_casting(fp8)`` then the same group offload (the order that
really sends fp8), and model offload (accelerate's ``cpu_offload_with_hook``, what ``enable_model_cpu_offload`` does
per component). ``--compile`` adds all-resident + regional compile and tritoff group + regional compile (each block's
forward compiled; for tritoff, ``compile_repeated_blocks(fullgraph=True)`` after ``enable``, as users do: the hooks
stay outside the compiled region). Columns: seconds per forward (median after a
warm-up forward), ratio to all-resident, peak VRAM, host RSS over the process's baseline, bytes moved per forward and
the transfer bound they imply at the measured H2D rate, compute-stream wait, host time in tritoff's hooks per group.

``--configs video@12GB,image@12GB,video@8GB`` measures several tables in one process with one build per row kind:
the resident model is measured once per shape, tritoff packs once and re-plans for every row, and each diffusers
setup is measured under every cap. Models are built directly on the GPU (bench/models.py), and each row's setup
(packing, offloading) runs before its cap is set: the cap and the peak cover the forwards, counting every buffer the
setup left on the GPU. The allocator's limit is 3% above the budget (a 12 GB card's 12 GiB, less the CUDA
context's ~0.5 GB, is 1.03x 12e9 bytes), so a row that goes past its budget is measured and shown past it instead of
failing; every row's peak is compared with the budget itself. tritoff's counters (bytes moved, waits, disk reads) are
per timed forward: the warm-up's phase entry, tracing and first onloads are left out. The tritoff auto row runs with
tritoff's default activation reserve (traced per phase), the other tritoff rows with ``--reserve``, raised to 1.15x
what the resident row measured. Every table's JSON is rewritten after every measurement, and ``--deadline`` stops
starting measurements that would not finish in time, so a part stopped from outside keeps what it measured.

Usage:
  python bench/e2e.py [--model wan|cogvideox] [--shape video|image] [--budget 12GB]
  python bench/e2e.py --model wan --configs video@12GB,image@12GB,video@8GB
  python bench/e2e.py --pipeline [--model wan|cogvideox]     whole pipeline: peak VRAM and time per stage, per row
  python bench/e2e.py --smoke [...]                          small models on the CPU (CI)
Options: --rows KIND,... (a subset of the row kinds), --reps N, --out DIR (default bench/results), --tag TAG
  (appended to the JSON names), --deadline EPOCH_SECONDS, --compile.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from tritoff.allocator import prefer_expandable_segments

# Expandable segments for every row (a user's own setting is kept): at Wan-14B's 32,760 tokens the caching
# allocator's fixed segments fragment by gigabytes (the resident row reserved 2.7 GB past its allocated peak), and a
# capped row then fails on reserved memory while its allocated memory fits.
prefer_expandable_segments()

import torch  # noqa: E402

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import psutil  # noqa: E402
from common import markdown_table, out_directory, share_or_size, size, tag, write_result  # noqa: E402
from models import COGVIDEOX_5B, COGVIDEOX_SMOKE, UMT5_XXL, WAN_14B, WAN_SMOKE, build  # noqa: E402
from rows import COMPILE_ROWS, PIPELINE_ROWS, TRANSFORMER_ROWS  # noqa: E402

import tritoff  # noqa: E402
from tritoff.arguments import OneLineParser, at_least  # noqa: E402
from tritoff.budget import parse_size  # noqa: E402
from tritoff.kernels import upcast as upcast_kernels  # noqa: E402

# (frames, height, width) per model and shape
SHAPES = {
    ("wan", "video"): (81, 480, 832),
    ("wan", "image"): (1, 480, 832),
    ("cogvideox", "video"): (49, 480, 720),
    ("cogvideox", "image"): (1, 480, 720),
}
SMOKE_SHAPES = {"video": (5, 32, 32), "image": (1, 32, 32)}
DEFAULT_BUDGET, SMOKE_BUDGET = "12GB", "5MB"
# the tritoff-disk row's host budget, as a share of the packs (the rest is read from disk every forward)
HOST_FRACTION = 0.3
# the allocator's limit over the budget: a row past its budget is then measured and shown past it, not failed
CAP_HEADROOM = 1.03

LABELS = {
    "resident": "all-resident bf16 (no cap)",
    "resident-compile": "all-resident bf16 + regional compile (no cap)",
    "tritoff": "tritoff auto @ {b}",
    "tritoff-group": "tritoff group fp8 @ {b}",
    "tritoff-auto": "tritoff auto @ {b}",
    "tritoff-auto-upcast": "tritoff auto, HBM upcasts on {p} programs @ {b}",
    "tritoff-disk": "tritoff group fp8, host budget {h} of the packs (the rest read from disk) @ {b}",
    "tritoff-group-compile": "tritoff group fp8 + regional compile @ {b}",
    "diffusers-bf16-group": "diffusers bf16 group offload (block, streams, record_stream) @ {b}",
    "diffusers-fp8-group": "diffusers layerwise fp8 + group offload (block, streams, record_stream) @ {b}",
    "diffusers-model-offload": "diffusers model offload @ {b}",
}


def transformer_class(model: str):
    """The diffusers transformer class of ``model`` (``wan`` or ``cogvideox``)."""
    from diffusers import CogVideoXTransformer3DModel, WanTransformer3DModel

    return WanTransformer3DModel if model == "wan" else CogVideoXTransformer3DModel


def make_inputs(model: str, config: dict, frames: int, height: int, width: int, device) -> dict:
    """The transformer's keyword arguments for one denoising forward at a video shape (random, fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    lat_f, lat_h, lat_w = (frames - 1) // 4 + 1, height // 8, width // 8
    if model == "wan":
        return dict(
            hidden_states=torch.randn(1, 16, lat_f, lat_h, lat_w, generator=gen).to(device, dtype),
            timestep=torch.tensor([500], device=device),
            encoder_hidden_states=torch.randn(1, 512, config["text_dim"], generator=gen).to(device, dtype),
            return_dict=False,
        )
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    patch = config["patch_size"]
    grid_h, grid_w = lat_h // patch, lat_w // patch
    rope = get_3d_rotary_pos_embed(
        embed_dim=config["attention_head_dim"],
        crops_coords=((0, 0), (grid_h, grid_w)),
        grid_size=(grid_h, grid_w),
        temporal_size=lat_f,
        device=device,
    )
    return dict(
        hidden_states=torch.randn(1, lat_f, config["in_channels"], lat_h, lat_w, generator=gen).to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, config["max_text_seq_length"], config["text_embed_dim"], generator=gen).to(
            device, dtype
        ),
        image_rotary_emb=rope,
        return_dict=False,
    )


class Cap:
    """Limit the allocator to ``CAP_HEADROOM`` x ``budget`` (set_per_process_memory_fraction) and track the peak
    (no-op on the CPU). The peak is compared with ``budget`` itself: with the limit at the budget, a row could only
    stay under it or fail.

    ``budget=None``: no cap (the peak is still tracked)."""

    def __init__(self, budget: int | None, device):
        self.budget, self.device = budget, device

    def __enter__(self):
        if self.device.type == "cuda":
            free_memory(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            limit = CAP_HEADROOM * self.budget if self.budget else total
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), self.index())
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.index())

    def index(self) -> int:
        """The device's index: set_per_process_memory_fraction refuses a bare ``cuda`` device."""
        return torch.cuda.current_device() if self.device.index is None else self.device.index

    def peak(self):
        """The allocator's peak of allocated memory (None on the CPU)."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def peak_reserved(self):
        """The allocator's peak of reserved memory (what the cap limits: allocated plus its cached blocks)."""
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else None


@contextlib.contextmanager
def upcast_grid(programs: int | None):
    """The HBM-side upcasts' grid bound (kernels.upcast.UPCAST_PROGRAMS, read at enable) set to ``programs`` inside
    (None: unchanged)."""
    saved = upcast_kernels.UPCAST_PROGRAMS
    if programs is not None:
        upcast_kernels.UPCAST_PROGRAMS = programs
    try:
        yield
    finally:
        upcast_kernels.UPCAST_PROGRAMS = saved


def free_memory(device) -> None:
    """Collect garbage and hand cached GPU memory (and PyTorch's cached pinned host memory) back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # diffusers' offloading pins through this cache
        if empty_host is not None:
            empty_host()


def check_released(released: weakref.ref, what: str, smoke: bool) -> None:
    """Say when a row's model outlived it (``released``: a weak reference to it), holding its memory through every
    row after it: an error in the smoke runs (CI), a warning on the GPU, where the rows after it still run."""
    if released() is None:
        return
    message = f"{what} outlived it, holding its memory through the rows after it"
    if smoke:
        raise RuntimeError(message)
    print(f"warning: {message}", file=sys.stderr)


def close_engine(engine) -> None:
    """Stop ``engine`` and free its host arenas, in a scope of its own: a pack left in a loop variable of the caller
    would keep the model alive through the rows after it."""
    engine.teardown()
    for packed in engine.packed.values():
        packed.arena.close()


def sync(device) -> None:
    """Wait for the GPU's queued work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rss() -> int:
    """This process's resident host memory, in bytes."""
    return psutil.Process().memory_info().rss


def time_forwards(
    module, inputs, device, reps: int, before=None, warmups: int = 1, after_warmup=None
) -> tuple[list[float], torch.Tensor]:
    """Seconds of ``warmups + reps`` forwards, the first ``warmups`` warming up (compilation, tracing, first onloads),
    and the last forward's output (fp32, on the host). ``before()``, when given, runs before each forward, untimed;
    ``after_warmup()`` once after the warm-ups (to read counters the timed forwards are measured against)."""
    times = []
    with torch.no_grad():
        for i in range(warmups + reps):
            if i == warmups and after_warmup is not None:
                after_warmup()
            if before is not None:
                before()
            sync(device)
            start = time.perf_counter()
            out = module(**inputs)
            sync(device)
            times.append(time.perf_counter() - start)
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    return times, out.detach().float().cpu()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (NaN anywhere gives NaN)."""
    return float((out - ref).norm() / ref.norm())


def measure_h2d(device) -> tuple[float | None, str | None]:
    """Host-to-device GB/s of a 256 MiB copy from a registered (page-locked) arena: the rate streamed bytes move at;
    and why page-locking failed (None when it worked: a pageable rate would inflate every transfer bound)."""
    if device.type != "cuda":
        return None, None
    from tritoff.arena import HostArena

    arena = HostArena(256 * 2**20, register=True)
    arena.buffer.fill_(1)
    dst = torch.empty(arena.nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(arena.buffer, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    arena.close()
    return arena.nbytes / statistics.median(times[1:]) / 1e9, arena.register_error


def regional_compile(model, backend: str) -> int:
    """Compile each repeated block's forward (diffusers' ``_repeated_blocks``); returns how many were wrapped (the
    all-resident rows: what ``compile_repeated_blocks`` does after ``tritoff.enable`` for the tritoff rows)."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.forward = torch.compile(module.forward, backend=backend, dynamic=False)
            count += 1
    if not count:
        raise ValueError(f"{type(model).__name__} names no _repeated_blocks to compile")
    return count


def bounded_kinds(shares: list[float], device) -> list[str]:
    """The row kinds ``tritoff-auto-bounded`` stands for: one per share of the SMs (``tritoff-auto-upcastN``, N
    programs per HBM-side upcast; kernels.upcast.UPCAST_PROGRAMS)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return list(dict.fromkeys(f"tritoff-auto-upcast{max(1, round(share * sms))}" for share in shares))


def bounded_programs(kind: str) -> tuple[str, int | None]:
    """``(label key, programs)`` of a row kind: the programs of a ``tritoff-auto-upcastN`` row, else None."""
    if kind.startswith("tritoff-auto-upcast"):
        return "tritoff-auto-upcast", int(kind.removeprefix("tritoff-auto-upcast"))
    return kind, None


@dataclass
class Table:
    """One table: a model at one shape under one cap, its rows keyed by row kind."""

    model: str
    shape: str
    budget_text: str
    budget: int
    reserve: int
    frames_hw: tuple[int, int, int]
    inputs: dict
    reps: int
    tag: str = ""
    rows: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The JSON file's stem: model, shape, and the budget and tag when not the defaults."""
        default = self.budget_text in (DEFAULT_BUDGET, SMOKE_BUDGET)
        budget = "" if default else f"-{self.budget_text}"
        return f"e2e-{self.model}-{self.shape}{budget}" + (f"-{self.tag}" if self.tag else "")

    def label(self, kind: str) -> str:
        """The printed name of a row of ``kind``."""
        base, programs = bounded_programs(kind)
        return LABELS[base].format(b=self.budget_text, h=f"{HOST_FRACTION:.0%}", p=programs)

    def data(self, h2d, kinds, h2d_pageable: str | None = None) -> dict:
        """The table as JSON: its rows in ``kinds`` order, with ratios to the resident row filled in.
        ``h2d_pageable``: why the H2D rate was measured from pageable memory (None: page-locked, as tritoff's)."""
        rows = [self.rows[k] for k in kinds if k in self.rows]
        for row in rows:
            base_kind = "resident-compile" if row["kind"].endswith("-compile") else "resident"
            base = self.rows.get(base_kind, {}).get("seconds_per_forward")
            if base and row.get("seconds_per_forward"):
                row["ratio_to_resident"] = row["seconds_per_forward"] / base
            held = self.rows.get("tritoff-group", {}).get("seconds_per_forward")
            if row["kind"] == "tritoff-disk" and held and row.get("seconds_per_forward"):
                row["slowdown_vs_all_packs_in_ram"] = row["seconds_per_forward"] / held
        return {
            "model": self.model,
            "shape": list(self.frames_hw),
            "shape_name": self.shape,
            "budget_bytes": self.budget,
            "reserve_bytes": self.reserve,
            "reps": self.reps,
            "h2d_GBps": h2d,
            "h2d_page_locked": None if h2d is None else h2d_pageable is None,
            **({"h2d_page_lock_error": h2d_pageable} if h2d_pageable else {}),
            "rows": rows,
        }


class Clock:
    """The part's deadline and what each table's measurements have cost so far (to skip what cannot finish)."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline
        self.cost: dict[str, float] = {}

    def allows(self, key: str, extra: float = 0.0) -> bool:
        """Whether a measurement costing what ``key`` cost before, plus ``extra`` seconds, ends before the deadline."""
        if self.deadline is None:
            return True
        return time.time() + self.cost.get(key, 0.0) + extra < self.deadline

    def spent(self, key: str, seconds: float) -> None:
        """Record that ``key`` took ``seconds`` (the largest cost seen is kept)."""
        self.cost[key] = max(self.cost.get(key, 0.0), seconds)


def _error_note(err: BaseException) -> str:
    """A failed row's note: the error's first line and where it was raised. Its whole traceback goes to stderr (the
    suite's log), unless it is running out of memory (a result for a peer that does not fit, not a failure to find)."""
    lines = str(err).strip().splitlines() or [""]
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    if not isinstance(err, torch.OutOfMemoryError):
        traceback.print_exception(err, file=sys.stderr)
    return f"{type(err).__name__}: {lines[0][:200]}{where}"


def drop_spill_pages(engine) -> None:
    """Evict the packs' files from the page cache, so every forward reads them from the disk: a machine with RAM to
    spare would otherwise serve a spill file written moments before from memory. Written pages are flushed first
    (the kernel keeps dirty pages)."""
    for fd in {p.file.fd for packed in engine.packed.values() for p in packed.packs if p.on_disk}:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def measure(model, table: Table, kind: str, device, budget: int | None, engine=None, h2d=None, reference=None) -> dict:
    """Time ``table.reps`` forwards after a warm-up under ``budget``; errors become the row's note. tritoff's counters
    are per timed forward (the warm-up's left out). A compile row warms up twice (a recompile would land in the
    first timed forward), and so does the tritoff auto row (its traced reserve may re-plan the phase at the second
    call, once, as in a user's first step).

    ``reference``: shape -> the resident row's output, which this row's output is compared with (and which the
    resident row fills in). A row reading packs from disk starts every forward with them out of the page cache."""
    row = {"row": table.label(kind), "kind": kind}
    start = time.perf_counter()
    cold = engine is not None and kind == "tritoff-disk" and hasattr(os, "posix_fadvise")
    if cold:
        row["page_cache"] = "cold: the spill file's pages are dropped before every forward"
    compiled = kind.endswith("-compile")
    warmed: dict = {}  # the counters after the warm-up

    def after_warmup():
        if engine is not None:
            stats, model_stats = engine.stats, engine.manager.components["model"].stats
            warmed.update(stats["total"], replans=stats["components"]["model"]["replans"])
            warmed.update(hook_ns=model_stats.hook_ns, hook_calls=model_stats.hook_calls)
        if compiled:
            from torch._dynamo.utils import counters

            warmed["unique_graphs"] = counters["stats"]["unique_graphs"]

    try:
        with Cap(budget, device) as cap:
            before = (lambda: drop_spill_pages(engine)) if cold else None
            warmups = 2 if compiled or kind.startswith("tritoff-auto") else 1
            times, out = time_forwards(model, table.inputs, device, table.reps, before, warmups, after_warmup)
            peak = cap.peak()
            row["peak_reserved_bytes"] = cap.peak_reserved()
        if reference is not None:
            if kind == "resident":
                reference[table.frames_hw] = out
            elif table.frames_hw in reference:  # fp8 rows differ by quantization; a wrong onload differs far more
                row["rel_err_vs_resident"] = relative_error(out, reference[table.frames_hw])
        row["first_forward_s"] = times[0]  # with compile rows: the compilation
        row["warmup_seconds"] = times[:warmups]
        if compiled:  # one graph reused by every block, or one per block; and none compiled while timed
            from torch._dynamo.utils import counters

            row["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]
            row["graphs_compiled_while_timed"] = counters["stats"]["unique_graphs"] - warmed["unique_graphs"]
        row["forward_seconds"] = times[warmups:]
        row["seconds_per_forward"] = statistics.median(times[warmups:])
        if kind == "diffusers-model-offload":  # the model stays on the GPU between forwards once it is there
            row["steady_state"] = "the model stays on the GPU after the warm-up: its onload is in first_forward_s"
            row["onload_s"] = times[0] - row["seconds_per_forward"]
        if engine is not None:
            stats = engine.stats
            total = stats["total"]
            if peak is not None:  # tritoff resets the allocator's peak to measure activations: take both
                peak = max(peak, total.get("peak_vram_bytes") or 0)

            def per_forward(key: str) -> float:  # over the timed forwards only
                return (total.get(key, 0) - warmed.get(key, 0)) / table.reps

            row["bytes_moved_per_forward"] = per_forward("bytes_h2d")
            row["bytes_moved_in_warmup"] = warmed.get("bytes_h2d", 0)  # the phase's entry, tracing, first onloads
            row["compute_wait_s_per_forward"] = per_forward("compute_wait_s")
            counted = engine.manager.components["model"].stats  # the timed forwards' own hook time
            hook_ns, hook_calls = (
                counted.hook_ns - warmed.get("hook_ns", 0),
                counted.hook_calls - warmed.get("hook_calls", 0),
            )
            row["hook_us_per_group"] = hook_ns / hook_calls / 1e3 if hook_calls else None
            row["packed_bytes"] = total["packed_bytes"]
            row["reserve_bytes_planned"] = stats["components"]["model"]["reserve_bytes"]
            row["activation_bytes"] = total.get("activation_bytes")
            row["sync_onloads"] = total["sync_onloads"] - warmed.get("sync_onloads", 0)
            row["replans_while_timed"] = stats["components"]["model"]["replans"] - warmed.get("replans", 0)
            row["pageable_host_bytes"] = total.get("pageable_host_bytes")  # > 0: page-locking failed, no overlap
            row["plan"] = engine.plan.summary()
            if engine.options.host_budget is not None:
                row["host_budget_bytes"] = engine.options.host_budget
                row["host_held_bytes"] = total["host_held_bytes"]  # packs held and the disk ring
                row["disk_pack_bytes"] = total["disk_pack_bytes"]
                row["disk_bytes_per_forward"] = per_forward("disk_bytes_read")
                row["disk_wait_s_per_forward"] = per_forward("disk_wait_s")
            if h2d:
                row["transfer_bound_s"] = row["bytes_moved_per_forward"] / (h2d * 1e9)
                if row["transfer_bound_s"] > 0:
                    row["ratio_to_transfer_bound"] = row["seconds_per_forward"] / row["transfer_bound_s"]
        elif peak is not None and kind.startswith("resident"):  # what the forward itself allocates at this shape
            row["activation_peak_bytes"] = peak - cap.base
        row["peak_vram_bytes"] = peak
        if peak is not None and budget is not None:
            row["peak_within_budget"] = peak <= budget
    except Exception as err:  # a peer that does not fit is a result; tritoff rows that fail fail the run
        row["note"] = _error_note(err)
    row["measure_s"] = time.perf_counter() - start
    row["host_rss_bytes"] = host_rss()
    free_memory(device)
    return row


def transformer_tables(args, device) -> list[dict]:
    """Measure every requested row kind for every table; returns each table's JSON."""
    cls, config = transformer_class(args.model), transformer_config(args)
    tables = []
    for shape, budget_text in args.configs:
        frames_hw = SMOKE_SHAPES[shape] if args.smoke else SHAPES[(args.model, shape)]
        budget = parse_size(budget_text)
        reps = args.reps if shape == "video" else max(args.reps, 5)  # image forwards are short: time more
        tables.append(
            Table(
                args.model,
                shape,
                budget_text,
                budget,
                parse_size(args.reserve, what="reserve", total=budget),
                frames_hw,
                make_inputs(args.model, config, *frames_hw, device),
                reps,
                args.tag,
            )
        )
    kinds = args.rows or (list(TRANSFORMER_ROWS) + (list(COMPILE_ROWS) if args.compile else []))
    if "tritoff-auto-bounded" in kinds:  # HBM upcasts on a bounded grid compete with a short compute: 1 frame only
        at = kinds.index("tritoff-auto-bounded")
        one_frame = any(t.frames_hw[0] == 1 for t in tables)
        kinds[at : at + 1] = bounded_kinds(args.upcast_grid, device) if one_frame else []
    h2d, h2d_pageable = measure_h2d(device)
    clock = Clock(args.deadline)
    backend = "eager" if args.smoke else "inductor"  # inductor's CPU compile would take minutes on the CI machine

    def save():
        for t in tables:
            write_result(t.name, t.data(h2d, kinds, h2d_pageable), smoke=args.smoke, out=args.out)

    def skipped(table, kind, why):
        table.rows[kind] = {"row": table.label(kind), "kind": kind, "note": f"not run: {why}"}

    def run(kind, table, model, budget, engine=None, setup=None):
        key = table.shape  # one shape costs about the same under any cap
        if not clock.allows(key):
            skipped(table, kind, "the part's time budget ran out")
        else:
            row = measure(model, table, kind, device, budget, engine, h2d, outputs)
            row.update(setup or {})
            table.rows[kind] = row
            clock.spent(key, row["measure_s"])
        save()

    def built(with_compile=False):
        baseline = host_rss()
        start = time.perf_counter()
        model = build(cls, config, device=device)
        info = {"build_s": time.perf_counter() - start, "host_rss_baseline_bytes": baseline}
        if with_compile:
            info["compiled_blocks"] = regional_compile(model, backend)
        return model, info

    first = tables[0].shape
    activations: dict[tuple, int] = {}  # shape -> the resident row's activation peak
    outputs: dict[tuple, torch.Tensor] = {}  # shape -> the resident row's output
    auto_kinds = [k for k in kinds if bounded_programs(k)[0] in ("tritoff-auto", "tritoff-auto-upcast")]
    for kind in kinds:
        if kind in auto_kinds and "tritoff-group" in kinds:
            continue  # measured with tritoff-group: one pack, re-planned for every row
        if not clock.allows(first, clock.cost.get("build", 0.0)):
            for t in tables:
                skipped(t, kind, "the part's time budget ran out")
            save()
            continue
        if kind.endswith("-compile"):  # dynamo's graphs and counters start empty (Inductor's disk cache stays)
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            counters.clear()
        if kind.startswith("resident"):
            model, info = built(kind.endswith("-compile"))
            done: dict[tuple, dict] = {}
            for t in tables:  # no cap: one measurement per shape serves every table of that shape
                if t.frames_hw in done:
                    t.rows[kind] = {**done[t.frames_hw], "row": t.label(kind), "shared": "measured once per shape"}
                    save()
                    continue
                run(kind, t, model, None, setup=info)
                done[t.frames_hw] = t.rows[kind]
                if t.rows[kind].get("activation_peak_bytes") and kind == "resident":
                    activations[t.frames_hw] = t.rows[kind]["activation_peak_bytes"]
        elif kind == "tritoff-disk":
            model, info = built()
            host_budget = int(HOST_FRACTION * packed_size(model))
            engine = None
            for t in tables:
                reserve, rule = reserve_for(t, activations)
                setup_start = time.perf_counter()
                try:
                    engine = tritoff.enable(
                        model,
                        mode="group",
                        budget=t.budget,
                        reserve=reserve,
                        device=device,
                        progress=False,
                        host_budget=host_budget,
                        spill_dir=args.spill_dir,
                    )
                except Exception as err:
                    t.rows[kind] = {"row": t.label(kind), "kind": kind, "note": _error_note(err)}
                    save()
                    continue
                setup = {**info, "setup_s": time.perf_counter() - setup_start, "reserve_bytes": reserve}
                setup["reserve_rule"] = rule
                clock.spent("build", info.get("build_s", 0.0) + setup["setup_s"])
                info = {"host_rss_baseline_bytes": info["host_rss_baseline_bytes"]}
                run(kind, t, model, t.budget, engine, setup)
            if engine is not None:
                engine.teardown()  # stops the disk reader; the spill file goes with the packs
            del engine
        elif kind.startswith("tritoff"):
            model, info = built()  # a compile row compiles after enable, as users do (the hooks stay outside)
            compile_pending = kind.endswith("-compile")
            modes = [("auto" if kind in auto_kinds else "group", kind)]
            if kind == "tritoff-group":
                modes += [("auto", k) for k in auto_kinds]
            engine = None
            for mode, row_kind in modes:
                programs = bounded_programs(row_kind)[1]
                for t in tables:
                    if programs is not None and t.frames_hw[0] != 1:
                        continue
                    if mode == "auto":  # what a user gets: enable(model, budget=...)
                        reserve, rule = None, "tritoff's default: traced per phase"
                    else:
                        reserve, rule = reserve_for(t, activations)
                    setup_start = time.perf_counter()
                    try:
                        with upcast_grid(programs):
                            engine = tritoff.enable(
                                model, mode=mode, budget=t.budget, reserve=reserve, device=device, progress=False
                            )
                    except Exception as err:
                        t.rows[row_kind] = {"row": t.label(row_kind), "kind": row_kind, "note": _error_note(err)}
                        save()
                        continue
                    if compile_pending:
                        model.compile_repeated_blocks(backend=backend, dynamic=False, fullgraph=True)
                        info["compiled_blocks"] = sum(
                            type(m).__name__ in model._repeated_blocks for m in model.modules()
                        )
                        compile_pending = False
                    what = f"quantize on {device.type}, pack, plan" if "build_s" in info else "re-plan (packs reused)"
                    setup = {**info, "setup_s": time.perf_counter() - setup_start, "setup": what}
                    setup.update(reserve_bytes=reserve, reserve_rule=rule)
                    clock.spent("build", info.get("build_s", 0.0) + setup["setup_s"])
                    info = {"host_rss_baseline_bytes": info["host_rss_baseline_bytes"]}  # packed once, re-planned
                    run(row_kind, t, model, t.budget, engine, setup)
            if engine is not None:
                close_engine(engine)
            del engine
        else:
            if kind == "diffusers-model-offload" and device.type == "cuda":
                need = weight_bytes(cls, config)
                over = [t for t in tables if need > t.budget]
                for t in over:  # building, pinning and filling the GPU until it runs out would only cost minutes
                    skipped(t, kind, f"model offload moves the whole model ({gib(need)} GiB of weights) past the cap")
                if len(over) == len(tables):
                    save()
                    continue
            model, info = built()
            setup_start = time.perf_counter()
            try:
                reset = diffusers_setup(kind, model, device)
                info["setup_s"] = time.perf_counter() - setup_start
            except Exception as err:
                for t in tables:
                    t.rows[kind] = {"row": t.label(kind), "kind": kind, "note": _error_note(err), **info}
                save()
                del model
                free_memory(device)
                continue
            clock.spent("build", info["build_s"] + info["setup_s"])
            for t in tables:  # the same offloaded model under every table's cap, starting offloaded each time
                if kind not in t.rows:
                    reset()
                    run(kind, t, model, t.budget, setup=info)
            reset()  # model offload's hook holds the model, on the GPU after a forward (or one that ran out of memory)
            del reset
        released = weakref.ref(model)
        if kind.endswith("-compile"):  # dynamo's compiled graphs hold the model
            torch._dynamo.reset()
        del model
        free_memory(device)
        check_released(released, f"the {kind} rows' model", args.smoke)
    save()
    return [t.data(h2d, kinds, h2d_pageable) for t in tables]


def transformer_config(args) -> dict:
    """The transformer's configuration: full size, or small for --smoke."""
    if args.model == "wan":
        return WAN_SMOKE if args.smoke else WAN_14B
    return COGVIDEOX_SMOKE if args.smoke else COGVIDEOX_5B


def weight_bytes(cls, config: dict) -> int:
    """Bytes of ``cls(**config)``'s parameters in bf16, from shapes alone (built on the meta device)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls(**config)
    return sum(p.numel() for p in model.parameters()) * 2


def packed_size(model) -> int:
    """Bytes of the fp8 packs tritoff would make of ``model`` (from shapes alone)."""
    from tritoff.formats import get_format
    from tritoff.groups import block_groups
    from tritoff.packer import plan_layouts
    from tritoff.skip import SkipRules

    groups = block_groups(model)
    quantized = SkipRules.for_model(model, ()).quantized_names(model)
    return sum(lay.nbytes for lay in plan_layouts(groups, quantized, get_format("fp8_e4m3"), "row"))


def raised_reserve(reserve: int, budget: int, measured: int | None) -> tuple[int, str | None]:
    """``reserve`` raised to 1.15x ``measured`` (the resident row's activation peak) where that is more, kept under
    ``budget``, and the rule that set it (None: ``reserve`` as given). The cap counts the activations; tritoff only
    warns when they exceed its reserve."""
    if measured and 1.15 * measured > reserve:
        return min(int(1.15 * measured), budget - 1), "1.15 x the resident row's activation peak"
    return reserve, None


def reserve_for(table: Table, activations: dict) -> tuple[int, str]:
    """tritoff's activation reserve for a table: ``--reserve`` of the budget, raised by :func:`raised_reserve` to the
    activations the resident row measured at that shape."""
    reserve, rule = raised_reserve(table.reserve, table.budget, activations.get(table.frames_hw))
    return reserve, rule or "--reserve of the budget"


def diffusers_setup(kind: str, model, device):
    """Apply one of diffusers' offloading configurations to a transformer (``kind`` from TRANSFORMER_ROWS); returns a
    function that puts the weights back off the GPU before a measurement (model offload leaves them on it)."""
    streams = device.type == "cuda"  # diffusers refuses streams on the CPU
    if kind == "diffusers-model-offload":
        from accelerate import cpu_offload_with_hook

        _, hook = cpu_offload_with_hook(model, device)
        return hook.offload
    if kind == "diffusers-fp8-group":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    model.enable_group_offload(
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=streams,
        record_stream=streams,
    )
    return lambda: None  # group offloading offloads each group after its forward


def build_pipeline(args, device):
    """The whole pipeline for ``args.model``, every component built on ``device`` (random weights)."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        AutoencoderKLWan,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from tritoff.tiny import COGVIDEOX_VAE_TINY, UMT5_TINY, WAN_VAE_TINY, tiny_tokenizer

    t5 = UMT5_TINY if args.smoke else UMT5_XXL
    encoder = build(UMT5EncoderModel, {"config": UMT5Config(**t5)}, device=device)
    tokenizer = tiny_tokenizer(min(t5["vocab_size"], 32000))
    if args.model == "wan":
        transformer = build(transformer_class("wan"), transformer_config(args), device=device)
        vae = build(AutoencoderKLWan, WAN_VAE_TINY if args.smoke else {}, dtype=torch.float32, device=device)
        pipe = WanPipeline(
            tokenizer=tokenizer,
            text_encoder=encoder,
            vae=vae,
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        )
    else:
        transformer = build(transformer_class("cogvideox"), transformer_config(args), device=device)
        vae = build(AutoencoderKLCogVideoX, COGVIDEOX_VAE_TINY if args.smoke else {}, device=device)
        pipe = CogVideoXPipeline(
            tokenizer=tokenizer,
            text_encoder=encoder,
            vae=vae,
            transformer=transformer,
            scheduler=CogVideoXDDIMScheduler(),
        )
    pipe.vae.enable_tiling()
    return pipe


def pipeline_setup(kind: str, pipe, device, budget: int, reserve: int):
    """Apply a row's configuration to a pipeline; returns tritoff's engine for the tritoff row."""
    streams = device.type == "cuda"
    if kind == "tritoff":
        return tritoff.enable(pipe, budget=budget, reserve=reserve, device=device, progress=False)
    if kind == "diffusers-model-offload":
        pipe.enable_model_cpu_offload(device=device)
    elif kind in ("diffusers-bf16-group", "diffusers-fp8-group"):
        if kind == "diffusers-fp8-group":  # the transformer only: the text encoder casts activations to its weights
            pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        pipe.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=streams,
            record_stream=streams,
        )
    return None


def run_pipeline(args, pipe, device, frames_hw) -> dict:
    """Text encoding, denoising with CFG (seconds per step), VAE decode (tiled): seconds per stage."""
    frames, height, width = frames_hw
    seq = 16 if args.smoke else (512 if args.model == "wan" else 226)
    stages: dict = {}
    with torch.no_grad():
        start = time.perf_counter()
        embeds, negative = pipe.encode_prompt(
            "a cat surfing a wave at sunset", "blurry", device=device, max_sequence_length=seq
        )[:2]
        sync(device)
        stages["text_encode_s"] = time.perf_counter() - start
        marks = []

        def on_step(_pipe, _step, _timestep, kwargs):
            sync(device)
            marks.append(time.perf_counter())
            return kwargs

        start = time.perf_counter()
        latents = pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=args.steps,
            guidance_scale=5.0,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
            callback_on_step_end=on_step,
        ).frames
        sync(device)
        stages["denoise_s"] = time.perf_counter() - start
        steps = [b - a for a, b in zip([start, *marks], marks, strict=False)]
        stages["step_seconds"] = steps
        # the first step pays for warm-up (kernel compilation, tracing, first onloads)
        stages["denoise_s_per_step"] = statistics.median(steps[1:] or steps)
        start = time.perf_counter()
        decode_in = latents.to(pipe.vae.dtype)
        if args.model == "cogvideox":
            decode_in = decode_in.permute(0, 2, 1, 3, 4) / pipe.vae.config.scaling_factor
        pipe.vae.decode(decode_in)
        sync(device)
        stages["vae_decode_s"] = time.perf_counter() - start
    return stages


def pipeline_rows(args, device) -> dict:
    """Every pipeline row kind, each with a freshly built pipeline, under the cap (the resident row uncapped)."""
    budget_text = args.configs[0][1]
    budget = parse_size(budget_text)
    reserve = parse_size(args.reserve, what="reserve", total=budget)
    frames_hw = (
        (SMOKE_SHAPES["video"] if args.model == "wan" else (9, 32, 32)) if args.smoke else SHAPES[(args.model, "video")]
    )
    kinds = args.rows or list(PIPELINE_ROWS)
    data = {
        "model": args.model,
        "shape": list(frames_hw),
        "budget_bytes": budget,
        "reserve_bytes": reserve,
        "vae": "tiling enabled",
        "steps": args.steps,
        "rows": [],
    }
    name = f"e2e-pipeline-{args.model}" + ("" if budget_text in (DEFAULT_BUDGET, SMOKE_BUDGET) else f"-{budget_text}")
    name += f"-{args.tag}" if args.tag else ""
    clock = Clock(args.deadline)
    activations = None  # the resident row's activation peak: tritoff's reserve is raised to 1.15x it
    for kind in kinds:
        label = LABELS[kind].format(b=budget_text)
        row: dict = {"row": label, "kind": kind}
        if not clock.allows("row"):
            row["note"] = "not run: the part's time budget ran out"
            data["rows"].append(row)
            write_result(name, data, smoke=args.smoke, out=args.out)
            continue
        if kind == "diffusers-model-offload" and device.type == "cuda":
            need = weight_bytes(transformer_class(args.model), transformer_config(args))
            if need > budget:  # building, pinning and filling the GPU until it runs out would only cost minutes
                row["note"] = f"not run: model offload moves the whole transformer ({gib(need)} GiB) past the cap"
                data["rows"].append(row)
                write_result(name, data, smoke=args.smoke, out=args.out)
                continue
        start = time.perf_counter()
        row["host_rss_baseline_bytes"] = host_rss()
        pipe, engine = None, None
        try:
            pipe = build_pipeline(args, device)
            row["build_s"] = time.perf_counter() - start
            setup_start = time.perf_counter()
            row_reserve, rule = raised_reserve(reserve, budget, activations) if kind == "tritoff" else (reserve, None)
            if rule:
                row["reserve_rule"] = rule
            row["reserve_bytes"] = row_reserve
            engine = pipeline_setup(kind, pipe, device, budget, row_reserve)
            row["setup_s"] = time.perf_counter() - setup_start
            cap_budget = None if kind == "resident" else budget
            with Cap(cap_budget, device) as cap:
                row.update(run_pipeline(args, pipe, device, frames_hw))
                peak = cap.peak()
                row["peak_reserved_bytes"] = cap.peak_reserved()
            if kind == "resident" and peak is not None:  # every stage's activations, the weights all resident
                activations = row["activation_peak_bytes"] = peak - cap.base
            if engine is not None:
                stats = engine.stats["total"]
                if peak is not None:
                    peak = max(peak, stats.get("peak_vram_bytes") or 0)
                row["bytes_h2d"] = stats["bytes_h2d"]
                row["sync_onloads"] = stats["sync_onloads"]
                row["activation_bytes"] = stats.get("activation_bytes")
                row["packed_bytes"] = stats["packed_bytes"]
                row["pageable_host_bytes"] = stats.get("pageable_host_bytes")
                row["report"] = engine.report()
            row["peak_vram_bytes"] = peak
            if peak is not None and cap_budget is not None:
                row["peak_within_budget"] = peak <= cap_budget
        except Exception as err:
            row["note"] = _error_note(err)
        row["host_rss_bytes"] = host_rss()
        row["wall_s"] = time.perf_counter() - start
        clock.spent("row", row["wall_s"])
        if engine is not None:
            close_engine(engine)
        released = weakref.ref(pipe.transformer)
        del pipe, engine
        free_memory(device)
        check_released(released, f"the {kind} row's pipeline", args.smoke)
        data["rows"].append(row)
        base = next((r for r in data["rows"] if r["kind"] == "resident" and "denoise_s_per_step" in r), None)
        for r in data["rows"]:
            if base and "denoise_s_per_step" in r:
                r["step_ratio_to_resident"] = r["denoise_s_per_step"] / base["denoise_s_per_step"]
        write_result(name, data, smoke=args.smoke, out=args.out)
    return data


def gib(value) -> str:
    """Bytes as GiB with two decimals, or '-'."""
    return f"{value / 2**30:.2f}" if value else "-"


def seconds(value, digits: int = 3) -> str:
    """``value`` in seconds for a table cell, or ``-``."""
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def print_transformer_table(table: dict) -> None:
    """Print a transformer table (from :meth:`Table.data`) as markdown."""
    f, h, w = table["shape"]
    print(f"\n{table['model']} transformer, {f}x{h}x{w}, cap {gib(table['budget_bytes'])} GiB, H2D {table['h2d_GBps']}")
    rows = []
    for r in table["rows"]:
        rss = r.get("host_rss_bytes", 0) - r.get("host_rss_baseline_bytes", 0) if "host_rss_bytes" in r else None
        rows.append(
            [
                r["row"],
                seconds(r["seconds_per_forward"]) if "seconds_per_forward" in r else r.get("note", "-"),
                seconds(r.get("ratio_to_resident")),
                gib(r.get("peak_vram_bytes")),
                gib(rss),
                gib(r.get("bytes_moved_per_forward")),
                gib(r.get("disk_bytes_per_forward")),
                seconds(r.get("transfer_bound_s")),
                f"{r['compute_wait_s_per_forward'] * 1e3:.1f}" if "compute_wait_s_per_forward" in r else "-",
                f"{r['hook_us_per_group']:.1f}" if r.get("hook_us_per_group") else "-",
                f"{r['rel_err_vs_resident']:.1e}" if "rel_err_vs_resident" in r else "-",
            ]
        )
    print(
        markdown_table(
            [
                "row",
                "s / forward",
                "x resident",
                "peak VRAM GiB",
                "host RSS over baseline GiB",
                "moved GiB / fwd",
                "disk GiB / fwd",
                "transfer bound s",
                "wait ms / fwd",
                "hook us / group",
                "rel err vs resident",
            ],
            rows,
        )
    )


def print_pipeline_table(data: dict) -> None:
    """Print a pipeline table as markdown."""
    f, h, w = data["shape"]
    cap = gib(data["budget_bytes"])
    print(f"\n{data['model']} pipeline, {f}x{h}x{w}, {data['steps']} steps with CFG, cap {cap} GiB")
    rows = [
        [
            r["row"],
            seconds(r.get("text_encode_s")),
            seconds(r.get("denoise_s_per_step")) if "denoise_s_per_step" in r else r.get("note", "-"),
            seconds(r.get("step_ratio_to_resident")),
            seconds(r.get("vae_decode_s")),
            gib(r.get("peak_vram_bytes")),
            gib(r["host_rss_bytes"] - r["host_rss_baseline_bytes"]) if "host_rss_baseline_bytes" in r else "-",
        ]
        for r in data["rows"]
    ]
    print(
        markdown_table(
            ["row", "text encode s", "s / step", "x resident", "VAE decode s", "peak VRAM GiB", "host RSS +GiB"],
            rows,
        )
    )
    for r in data["rows"]:
        if "report" in r:
            print(r["report"])


def parse_configs(args) -> list[tuple[str, str]]:
    """``--configs video@12GB,image@12GB`` (or ``--shape``/``--budget``) as (shape, budget) pairs, checked."""
    if not args.configs:
        return [(args.shape, args.budget or (SMOKE_BUDGET if args.smoke else DEFAULT_BUDGET))]
    configs = []
    for item in args.configs.split(","):
        shape, _, budget = item.strip().partition("@")
        if shape not in ("video", "image"):
            raise ValueError(f"--configs: unknown shape {shape!r} in {item!r} (video or image)")
        budget = budget or (SMOKE_BUDGET if args.smoke else DEFAULT_BUDGET)
        try:
            parse_size(budget)
        except ValueError as err:
            raise ValueError(f"--configs: {err}") from None
        configs.append((shape, budget))
    return configs


def main() -> None:
    """Parse arguments, run, print tables, write bench/results/e2e-*.json (or under --out)."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("wan", "cogvideox"), default="wan")
    parser.add_argument("--shape", choices=("video", "image"), default="video")
    parser.add_argument("--budget", type=size, default=None, help="GPU memory cap (default 12GB; --smoke: 5MB)")
    parser.add_argument("--configs", default=None, help="several tables: SHAPE@BUDGET,... e.g. video@12GB,image@12GB")
    parser.add_argument(
        "--reserve",
        type=share_or_size,
        default="25%",
        help="activation reserve given to tritoff (default 25%% of the budget)",
    )
    parser.add_argument("--rows", default=None, help="comma-separated row kinds (default: all)")
    parser.add_argument(
        "--reps", type=at_least(1), default=None, help="timed forwards after warm-up (3; --smoke: 1; image: 5 at least)"
    )
    parser.add_argument("--steps", type=at_least(1), default=2, help="--pipeline: denoising steps")
    parser.add_argument("--pipeline", action="store_true", help="whole pipeline instead of transformer forwards")
    parser.add_argument("--compile", action="store_true", help="add the regional-compile rows")
    parser.add_argument(
        "--out", type=out_directory, default=None, help="directory for the JSON (default bench/results)"
    )
    parser.add_argument("--tag", type=tag, default="", help="appended to the JSON names (e2e-wan-video-TAG.json)")
    parser.add_argument("--deadline", type=float, default=None, help="epoch seconds: start nothing that ends after")
    parser.add_argument("--smoke", action="store_true", help="small models on the CPU (CI)")
    parser.add_argument("--spill-dir", default=None, help="tritoff-disk row: where packs beyond the host budget go")
    parser.add_argument(
        "--upcast-grid",
        default="0.5,1",
        help="tritoff-auto-bounded rows (1 frame): programs per HBM upcast as shares of the SMs (default 0.5,1)",
    )
    args = parser.parse_args()
    try:
        shares = [float(share) for share in args.upcast_grid.split(",")]
    except ValueError:
        shares = []
    if not shares or not all(0 < share < 64 for share in shares):  # also refuses nan and inf
        parser.error(f"--upcast-grid: expected shares of the SMs above 0, such as 0.5,1, got {args.upcast_grid!r}")
    args.upcast_grid = shares
    try:
        args.configs = parse_configs(args)
    except ValueError as err:
        parser.error(str(err))
    known = PIPELINE_ROWS if args.pipeline else TRANSFORMER_ROWS + COMPILE_ROWS
    args.rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
    for r in args.rows or ():
        if r not in known:
            parser.error(f"--rows: unknown row kind {r!r}; known: {', '.join(known)}")
    compiles = args.compile or any(r.endswith("-compile") for r in args.rows or ())
    if compiles and not args.pipeline and not getattr(transformer_class(args.model), "_repeated_blocks", None):
        parser.error(f"--compile: the {args.model} transformer names no repeated blocks to compile regionally")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(
            "bench/e2e.py measures full-size models on a GPU, and no CUDA device is here: run it on a GPU, or with "
            "--smoke for small models on the CPU"
        )
    args.reps = args.reps or (1 if args.smoke else 3)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    failed = []
    if args.pipeline:
        data = pipeline_rows(args, device)
        print_pipeline_table(data)
        failed = [r for r in data["rows"] if r["kind"] == "tritoff" and "note" in r and "not run" not in r["note"]]
    else:
        for data in transformer_tables(args, device):
            print_transformer_table(data)
            # compile rows are findings, not failures: where torch.compile and tritoff do not work together yet
            failed += [
                r
                for r in data["rows"]
                if (
                    r["kind"] in ("tritoff-group", "tritoff-auto", "tritoff-disk")
                    or r["kind"].startswith("tritoff-auto-up")
                )
                and "note" in r
                and "not run" not in r["note"]
            ]
    print(f"\nwrote JSON under {args.out or 'bench/results'}")
    if failed:  # a peer that does not fit is a result; tritoff failing is a bug
        sys.exit(f"tritoff rows failed: {'; '.join(r['note'] for r in failed)}")


if __name__ == "__main__":
    main()

"""On a CUDA GPU: the streamed path equals the CPU path, stays within its budget, and hides its transfers."""

import warnings

import pytest
import torch
import torch.nn as nn

import tritoff
from tritoff.tiny import realistic_init

from .helpers import dequantize_in_place, dequantized_pipeline, enable_at_minimum, run, wan

pytestmark = pytest.mark.gpu


def test_pipeline_on_gpu_matches_the_dequantized_pipeline():
    reference = dequantized_pipeline(wan).to("cuda")
    expected = run(reference)
    for transport in ("staged", "zero_copy"):
        pipe = wan()
        engine = tritoff.enable(pipe, mode="group", budget="4MB", transport=transport, progress=False)
        assert engine.plan.tier_counts("transformer")["stream"] > 0
        assert pipe._execution_device.type == "cuda"
        assert torch.equal(run(pipe), expected), transport
        assert engine.stats["total"]["sync_onloads"] == 0
        assert engine.stats["total"]["pageable_host_bytes"] == 0  # every arena page-locked


def test_a_pipeline_whose_text_encoder_table_stays_on_the_host_matches_on_the_gpu(monkeypatch):
    # the UMT5 encoder looks its table up through `encoder.embed_tokens`, tied to `shared`: both must run on the host
    from tritoff import groups

    reference = dequantized_pipeline(wan).to("cuda")
    expected = run(reference)
    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 8 * 1024)  # the tiny UMT5's 16 KiB table stays on the host
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="4MB", progress=False)
    assert engine.stats["components"]["text_encoder"]["host_lookup_bytes"] == 256 * 32 * 2
    assert torch.equal(run(pipe), expected)
    pipe.to("cuda")  # as a user does after enable: the table stays on the host, where it is looked up
    assert pipe.text_encoder.shared.weight.device.type == "cpu"
    assert torch.equal(run(pipe), expected)


def test_a_pipeline_enabled_under_a_cuda_default_device_keeps_its_packs_on_the_host(tmp_path):
    # torch.set_default_device("cuda") (here its context form) around enable, save and disable: the packs, tables and
    # a store's checks tritoff makes without naming a device stay in host memory, and the pipeline runs as without it
    reference = dequantized_pipeline(wan).to("cuda")
    expected = run(reference)
    pipe = wan()
    with torch.device("cuda"):
        engine = tritoff.enable(pipe, mode="group", budget="4MB", progress=False)
        engine.save(tmp_path / "store")
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    assert engine.stats["total"]["pageable_host_bytes"] == 0  # an arena of host memory, page-locked
    assert torch.equal(run(pipe), expected)
    with torch.device("cuda"):
        tritoff.disable(pipe)
    stored = wan()
    tritoff.enable(stored, mode="group", budget="4MB", store=str(tmp_path / "store"), progress=False)
    assert torch.equal(run(stored), expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_engine_on_the_second_gpu_quantizes_and_streams_there_while_the_first_is_current():
    # Triton launches on the current device whatever its tensors' device: each launch makes theirs current
    reference = dequantized_pipeline(wan).to("cuda:1")
    expected = run(reference)
    torch.cuda.set_device(0)
    first_gpu = torch.cuda.memory_allocated(0)
    for transport in ("staged", "zero_copy"):
        pipe = wan()
        engine = tritoff.enable(pipe, mode="group", budget="4MB", device="cuda:1", transport=transport, progress=False)
        assert engine.plan.tier_counts("transformer")["stream"] > 0
        assert torch.equal(run(pipe), expected), transport
        assert torch.cuda.current_device() == 0
        assert torch.cuda.memory_allocated(0) == first_gpu  # nothing of it landed on the current GPU
        tritoff.disable(pipe)


class Heavy(nn.Module):
    """Blocks whose matmuls take much longer than their weights take to stream."""

    def __init__(self, n=8, width=4096):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(n)
        )
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_budget_holds_and_transfers_hide_behind_compute():
    torch.manual_seed(0)
    model = realistic_init(Heavy()).to(torch.bfloat16).eval()
    # compute-heavy: 2.2 TFLOP, ~3 ms of matmul per block, against ~0.7-1.4 ms to stream its 32 MiB pack (PCIe 5 or 4)
    rows = 32768
    x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    block_bytes, activation = 2 * 2 * 4096 * 4096, rows * 4096 * 2
    budget = 8 * block_bytes + activation * 5  # beside the reserve, less than the blocks and head weigh: some stream
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = tritoff.enable(model, mode="group", budget=budget, reserve=activation * 5, progress=False)
    assert engine.plan.tier_counts("model")["stream"] > 0
    with torch.no_grad():
        # the first forward waits for the phase's entry uploads and its first streamed block, with nothing queued to
        # hide them behind; the next ones find each block prefetched during the one before (the last ones' during the
        # previous forward's end)
        model(x)
        torch.cuda.synchronize()
        first = engine.stats["total"]
        first_moved, first_wait = first["bytes_h2d"], first["compute_wait_s"]
        for _ in range(2):
            model(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget
    total = engine.stats["total"]
    # the first forward's activations were measured: rows x 4096 bf16 tensors, a few alive at once
    assert activation <= total["activation_bytes"]["model"] <= activation * 8
    # the later forwards' transfer time at the measured H2D rate, against the time the compute stream waited for them
    moved = total["bytes_h2d"] - first_moved
    assert moved > 0  # blocks streamed in every forward
    src = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    transfer_s = moved / (src.numel() / (start.elapsed_time(end) / 1e3))
    waited = total["compute_wait_s"] - first_wait
    assert waited < 0.1 * transfer_s, (waited, transfer_s)


def test_enable_quantizes_on_the_gpu_in_bounded_scratch():
    # packing quantizes each weight on the GPU and measures its SNR there: float copies of a whole weight (Wan-14B's
    # largest has 70.8M elements) would take gigabytes beside the budget, where an 8 GB GPU has none to spare
    from tritoff.snr import CHUNK

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8192, 8192), nn.Linear(8192, 8192)).to(torch.bfloat16).eval()  # on the host
    budget, weight = 384 * 2**20, 8192 * 8192  # the planner's minimum is 355.64 MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    engine = tritoff.enable(model, mode="group", budget=budget, progress=False)
    assert engine.options.device.type == "cuda" and min(engine.snr.values()) > 25
    # one weight's bf16 copy and its codes (3 bytes per element), and one piece of the SNR in float64 (4 buffers)
    assert torch.cuda.max_memory_allocated() - base <= budget + 3 * weight + 4 * 8 * CHUNK
    assert torch.cuda.memory_reserved() - reserved <= budget + 64 * 2**20  # the scratch was given back


def test_enable_on_cuda_says_once_that_a_fragmenting_allocator_may_break_the_budget(monkeypatch):
    from tritoff import allocator

    monkeypatch.setattr(allocator, "_warned", False)
    for name in allocator.ENV_NAMES:  # torch's defaults, whatever this machine's environment says
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(tritoff.TritoffWarning, match="expandable_segments:True"):
        tritoff.enable(nn.Sequential(nn.Linear(256, 256)), budget="1GB", progress=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*expandable segments.*")
        tritoff.enable(nn.Sequential(nn.Linear(256, 256)), budget="1GB", progress=False)


def test_registered_arena_and_real_fp8_kernels():
    from tritoff.formats import get_format
    from tritoff.kernels import native_fp8, quantize, quantize_reference

    fmt = get_format("fp8_e4m3")
    w = torch.randn(4096, 5120, dtype=torch.bfloat16) * 0.02
    codes, scales = quantize(w.cuda(), fmt)
    ref_codes, ref_scales = quantize_reference(w, fmt)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert native_fp8("cuda")


def test_packs_that_could_not_be_page_locked_run_exactly_and_are_reported(monkeypatch):
    from tritoff import cuda_host

    reference = dequantized_pipeline(wan).to("cuda")
    expected = run(reference)
    monkeypatch.setattr(cuda_host, "register", lambda ptr, nbytes: "CUDA_ERROR_OUT_OF_MEMORY")
    pipe = wan()
    with pytest.warns(UserWarning, match="no longer overlap compute"):
        engine = tritoff.enable(pipe, mode="group", budget="4MB", progress=False)
    assert torch.equal(run(pipe), expected)
    total = engine.stats["total"]
    assert total["pageable_host_bytes"] == total["host_arena_bytes"] > 0
    assert "could not be page-locked" in engine.report()
    with pytest.raises(ValueError, match="transport='zero_copy' needs page-locked host memory"), pytest.warns():
        tritoff.enable(wan(), mode="group", budget="4MB", transport="zero_copy", progress=False)


# about 20-50 ms of GPU time on current parts: long enough for the transfer streams to run far ahead of compute
SLEEP_CYCLES = 50_000_000


class SleepyBlock(nn.Module):
    """A block that first holds the compute stream (so transfers race ahead of it), then uses its weights."""

    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return x + self.b(torch.relu(self.a(x)))


class Sleepy(nn.Module):
    def __init__(self, n=6, width=512):
        super().__init__()
        self.blocks = nn.ModuleList(SleepyBlock(width) for _ in range(n))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sleepy():
    torch.manual_seed(0)
    return realistic_init(Sleepy()).to(torch.bfloat16).eval()


def _minimum(model, **kwargs) -> int:
    from tritoff.planner import BudgetError

    with pytest.raises(BudgetError) as info:
        tritoff.enable(model, mode="group", budget=1000, progress=False, **kwargs)
    return info.value.minimum


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
@pytest.mark.parametrize("placement", ["streamed", "fp8-resident", "disk"])
def test_slots_are_not_overwritten_while_the_compute_stream_lags(tmp_path, placement, transport):
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    reference = dequantize_in_place(_sleepy()).cuda()
    with torch.no_grad():
        expected = reference(x)
    reserve = 64 * 512 * 2 * 8
    minimum = _minimum(_sleepy(), reserve=reserve, transport=transport)  # zero-copy needs no staging
    if placement == "streamed":  # every block through the ring of slots
        where = dict(budget=minimum)
    elif placement == "fp8-resident":  # some blocks upcast from HBM between streamed ones
        where = dict(budget=int(1.3 * minimum))
    else:  # every pack read from a spill file by the reader thread, through the two-buffer ring
        where = dict(budget=minimum, host_budget=0, spill_dir=str(tmp_path))
    model = _sleepy()
    engine = tritoff.enable(model, mode="group", reserve=reserve, transport=transport, progress=False, **where)
    tiers = engine.plan.tier_counts("model")
    if placement == "fp8-resident":
        assert tiers["fp8"] > 0 and tiers["stream"] > 0, tiers
    else:
        assert tiers["stream"] == 6
    if placement == "disk":
        assert engine.disk.threaded
    with torch.no_grad():
        outputs = [model(x) for _ in range(3)]  # no host synchronization between calls
    torch.cuda.synchronize()
    for out in outputs:
        assert torch.equal(out, expected)


def _enabled_sleepy(placement: str, transport: str):
    reserve = 64 * 512 * 2 * 8
    minimum = _minimum(_sleepy(), reserve=reserve, transport=transport)
    budget = minimum if placement == "streamed" else int(1.3 * minimum)
    model = _sleepy()
    engine = tritoff.enable(model, mode="group", budget=budget, reserve=reserve, transport=transport, progress=False)
    return model, engine


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
@pytest.mark.parametrize("placement", ["streamed", "fp8-resident"])
def test_a_forward_on_the_callers_own_stream_is_exact_and_leaves_that_stream_current(placement, transport):
    # each fill makes tritoff's streams current without torch.cuda.stream (tritoff/streams.py) and launches its
    # prepared upcasts on an explicit stream: the caller's stream must be current again after every hook
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    model, engine = _enabled_sleepy(placement, transport)
    mine = torch.cuda.Stream()
    mine.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(mine):
        outputs = [model(x) for _ in range(3)]
        assert torch.cuda.current_stream() == mine
    torch.cuda.current_stream().wait_stream(mine)
    torch.cuda.synchronize()
    for out in outputs:
        assert torch.equal(out, expected)
    assert any(g._prepared for g in engine.manager.components["model"].blocks)  # the hooks launched prepared


@pytest.mark.parametrize("placement", ["streamed", "fp8-resident"])
def test_hbm_upcasts_on_a_bounded_grid_are_exact(monkeypatch, placement):
    # UPCAST_PROGRAMS bounds the hooks' HBM-side upcasts (staged chunks, fp8-resident packs): two programs stride
    # over every chunk, slower than one program per chunk, so a fill racing the compute would show here too
    from tritoff.kernels import upcast as upcast_kernels

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    monkeypatch.setattr(upcast_kernels, "UPCAST_PROGRAMS", 2)
    model, engine = _enabled_sleepy(placement, "staged")
    with torch.no_grad():
        outputs = [model(x) for _ in range(3)]
    torch.cuda.synchronize()
    for out in outputs:
        assert torch.equal(out, expected)
    prepared = [p for g in engine.manager.components["model"].blocks for p in g._prepared.values()]
    assert prepared and all(p.grid[0] == min(2, p.n_programs) for p in prepared)


def test_a_dispatch_mode_sees_the_upcasts_the_hooks_launch():
    # prepared launches skip the registered op: under a dispatch mode (a flop counter, a logger) the op is used
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    model, _ = _enabled_sleepy("streamed", "staged")
    with torch.no_grad():
        expected = model(x)
        with Ops() as ops:
            out = model(x)
    assert any("upcast_pack" in name for name in ops.names)
    assert any("copy_" in name for name in ops.names)  # the staged copies too, through Tensor.copy_
    assert torch.equal(out, expected)


@pytest.mark.parametrize("served", ["host", "disk"])
def test_staged_copies_go_through_the_driver_and_fall_back_to_torch_after_a_refusal(monkeypatch, tmp_path, served):
    # packs from the arena or from the disk ring (whose buffer goes back to the reader after an event on the copy
    # stream): every copy on the copy stream, exact; a refusal part way through a chunk is warned about once, and the
    # chunk and every later one move through Tensor.copy_
    from tritoff import cuda_host, transfer
    from tritoff.warn import TritoffWarning

    monkeypatch.setattr(transfer, "_DRIVER_REFUSED", set())
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    reserve = 64 * 512 * 2 * 8
    disk = dict(host_budget=0, spill_dir=str(tmp_path)) if served == "disk" else {}
    model = _sleepy()
    engine = tritoff.enable(
        model, mode="group", budget=_minimum(_sleepy(), reserve=reserve), reserve=reserve, progress=False, **disk
    )
    comp = engine.manager.components["model"]
    issued, real = [], cuda_host.copy_async

    def counted(spans, stream, bind_context=None):
        issued.append((len(spans), stream))
        return real(spans, stream, bind_context)

    monkeypatch.setattr(cuda_host, "copy_async", counted)
    with torch.no_grad():
        outputs = [model(x) for _ in range(2)]
    assert comp.transfer.driver_copies and sum(n for n, _ in issued) >= 2 * 6  # each streamed block: payload, scales
    assert {stream for _, stream in issued} == {comp.transfer.copy_stream.cuda_stream}

    def refused(spans, stream, bind_context=None):  # the first span queued, the second refused even after a retry
        real(spans[:1], stream)
        return "CUDA_ERROR_STAND_IN"

    monkeypatch.setattr(cuda_host, "copy_async", refused)
    with torch.no_grad(), pytest.warns(TritoffWarning, match="CUDA_ERROR_STAND_IN") as seen:
        outputs += [model(x) for _ in range(2)]
    warned = [w for w in seen if issubclass(w.category, TritoffWarning)]
    assert len(warned) == 1 and not comp.transfer.driver_copies  # warned once, PyTorch's copies from then on
    tritoff.disable(model)

    def used(spans, stream, bind_context=None):
        raise AssertionError("the driver was used on a device where it refused a copy")

    monkeypatch.setattr(cuda_host, "copy_async", used)
    budget = _minimum(_sleepy(), reserve=reserve)
    engine = tritoff.enable(model, mode="group", budget=budget, reserve=reserve, progress=False, **disk)
    with torch.no_grad():
        outputs.append(model(x))
    assert not engine.manager.components["model"].transfer.driver_copies  # the device's next phases too
    torch.cuda.synchronize()
    for out in outputs:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("storage", ["fp8_e4m3", "fp8_e5m2"])
def test_two_experts_switch_on_the_gpu_in_either_fp8_format(storage):
    expected = run(dequantized_pipeline(wan, storage=storage, two_experts=True).to("cuda"))
    pipe = wan(two_experts=True)
    engine = tritoff.enable(pipe, storage=storage, mode="group", budget="4MB", progress=False)
    assert engine.plan.tier_counts("transformer_2")["stream"] > 0
    assert torch.equal(run(pipe), expected)
    with torch.inference_mode():  # the phases leave and enter again; inference tensors never reach the packs
        assert torch.equal(run(pipe), expected)
    assert torch.equal(run(pipe), expected)
    assert engine.stats["total"]["sync_onloads"] == 0


class Unit(nn.Module):
    """A component that moves whole: it holds the compute stream, then reads its weights."""

    def __init__(self, width=1024):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return self.b(torch.relu(self.a(x)))


class TwoUnits:
    """A pipeline-like object of two components, each moving whole."""

    def __init__(self, seed_a=0, seed_b=1):
        torch.manual_seed(seed_a)
        self.first = realistic_init(Unit(), seed=seed_a).to(torch.bfloat16).eval()
        torch.manual_seed(seed_b)
        self.second = realistic_init(Unit(), seed=seed_b).to(torch.bfloat16).eval()

    @property
    def components(self):
        return {"first": self.first, "second": self.second}


def _one_unit_at_a_time() -> tuple[TwoUnits, tritoff.Engine]:
    """TwoUnits enabled with room for one phase (its buffers and tables included), not both."""
    unit = 2 * (1024 * 1024 * 2 + 1024 * 2)
    reserve = 64 * 1024 * 2 * 6
    probe = tritoff.enable(TwoUnits(), mode="model", budget="1GB", reserve=reserve, progress=False)
    budget = probe.plan.planned_bytes + unit // 2
    tritoff.disable(probe.target)
    pipe = TwoUnits()
    engine = tritoff.enable(pipe, mode="model", budget=budget, reserve=reserve, progress=False)
    assert not engine.plan.together
    return pipe, engine


def _two_units_expected(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    reference = TwoUnits()
    for module in reference.components.values():
        dequantize_in_place(module).cuda()
    with torch.no_grad():
        return reference.first(x), reference.second(x)


def test_a_pool_unit_is_not_filled_into_memory_queued_kernels_still_read():
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    expected_first, expected_second = _two_units_expected(x)
    # the pool holds one unit: calling the second evicts the first while the first's kernels are still queued
    pipe, engine = _one_unit_at_a_time()
    with torch.no_grad():
        first = pipe.first(x)  # queued behind a sleep; its unit is evicted by the next call
        pointer = engine.manager.components["first"].unit[0].buffer.data_ptr()
        second = pipe.second(x)
        reused = engine.manager.components["second"].unit[0].buffer.data_ptr() == pointer
    torch.cuda.synchronize()
    assert engine.stats["components"]["first"]["evictions"] == 1
    assert torch.equal(first, expected_first) and torch.equal(second, expected_second)
    if not reused:
        pytest.skip("the allocator did not hand the evicted memory to the next unit: the race was not exercised")


def test_a_pipeline_enabled_on_the_cpu_then_on_the_gpu_streams_from_locked_packs():
    # the re-enable reuses the CPU engine's packs, which were never page-locked: zero-copy reads need them locked
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    model = _sleepy()
    engine = tritoff.enable(model, mode="group", budget="1GB", device="cpu", progress=False)
    assert not engine.packed["model"].arena.registered
    reserve = 64 * 512 * 2 * 8
    budget = _minimum(_sleepy(), reserve=reserve, transport="zero_copy")
    engine = tritoff.enable(model, mode="group", budget=budget, reserve=reserve, transport="zero_copy", progress=False)
    assert engine.packed["model"].arena.registered and engine.plan.tier_counts("model")["stream"] > 0
    with torch.no_grad():
        out = model(x)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_a_unit_read_on_the_callers_stream_is_not_filled_over_by_the_next_unit_on_another():
    # the first unit's phase is entered on the default stream (its memory comes from that stream's pool), then called
    # on a stream of the caller's, its kernels queued behind a sleep; the second unit, called on the default stream,
    # evicts it: the default stream, whose next allocations reuse that memory, must wait for the caller's stream
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    expected_first, expected_second = _two_units_expected(x)
    pipe, engine = _one_unit_at_a_time()
    mine = torch.cuda.Stream()
    with torch.no_grad():
        pipe.first(x)  # enters the phase on the default stream
        pointer = engine.manager.components["first"].unit[0].buffer.data_ptr()
        mine.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(mine):
            first = pipe.first(x)  # queued behind a sleep on the caller's stream
        second = pipe.second(x)  # on the default stream: evicts the first unit, fills its own
        reused = engine.manager.components["second"].unit[0].buffer.data_ptr() == pointer
    torch.cuda.synchronize()
    assert torch.equal(first, expected_first) and torch.equal(second, expected_second)
    if not reused:
        pytest.skip("the allocator did not hand the evicted memory to the next unit: the race was not exercised")


@pytest.mark.parametrize("owner", ["ring", "staging"])
def test_buffers_dropped_without_release_are_reused_only_after_the_fills_writing_them(owner):
    """A pipeline deleted without tritoff.disable drops its ring and staging with prefetches still queued on the
    transfer streams: their memory must not be handed to a new tensor before the fills writing it have run."""
    from tritoff.slots import SlotRing
    from tritoff.transfer import Transfer

    device, nbytes = torch.device("cuda"), 64 * 2**20
    transfer = Transfer(device, nbytes if owner == "staging" else 0)
    ring = SlotRing(device, 1, nbytes if owner == "ring" else nbytes // 2, transfer)
    written = ring.buffers if owner == "ring" else transfer.staging
    addresses = {buffer.data_ptr() for buffer in written}
    with torch.cuda.stream(transfer.upcast_stream):  # fills queued behind other transfers
        torch.cuda._sleep(SLEEP_CYCLES)
        for buffer in written:
            buffer.fill_(1)
    del written
    if owner == "staging":
        ring.release()  # the ring holds nothing written: only the transfer's own drop orders the frees
        del ring
        del transfer
    else:
        del ring
    fresh = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    reused = fresh.data_ptr() in addresses
    torch.cuda.synchronize()
    assert not fresh.any()
    if not reused:
        pytest.skip("the allocator did not hand the dropped memory to the new tensor: the race was not exercised")


def test_after_an_exception_the_gpu_engine_recovers():
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    reference = dequantize_in_place(_sleepy()).cuda()
    with torch.no_grad():
        expected = reference(x)
    model = _sleepy()
    engine = tritoff.enable(model, mode="group", budget=_minimum(_sleepy()), progress=False)
    calls = {"n": 0}

    def fail_once(module, args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.cuda.OutOfMemoryError("simulated")

    handle = model.blocks[3].b.register_forward_pre_hook(fail_once)
    with torch.no_grad(), pytest.raises(torch.cuda.OutOfMemoryError):
        model(x)
    handle.remove()
    assert not any(c.loaded for c in engine.manager.components.values()) and not engine.manager.inflight
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
    assert engine.stats["total"]["sync_onloads"] == 0


def test_memory_returns_to_baseline_after_enable_reenable_and_disable():
    import gc

    from tritoff.onload import placeholder

    # what stays allocated for the process once made, whichever test ran first: cuBLAS's workspaces (its first
    # matmul, and cuBLASLt's, which a Linear with a bias goes through) and the scalar behind weight placeholders
    a = torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")
    a @ a
    torch.nn.functional.linear(a, a, a[0])
    placeholder((1,), torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    model = _sleepy()
    budget = _minimum(_sleepy()) + 4 * 2**20
    tritoff.enable(model, mode="group", budget=budget, progress=False)
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    enabled = torch.cuda.memory_allocated()
    tritoff.enable(model, mode="group", budget=budget, progress=False)  # re-plan: the old buffers are freed
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == enabled
    tritoff.disable(model, device="cpu")
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base + x.numel() * x.element_size()


class BigEmbedding(nn.Module):
    """Small blocks beside a large embedding; with ``tied``, the table is also the output head, so it cannot stay on
    the host and its pool unit is many times the staging chunk."""

    def __init__(self, vocab=65536, width=1024, n=4, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n))
        self.head = nn.Linear(width, vocab, bias=False) if tied else None
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x) if self.head is not None else x


def _within_exact_budget(make, ids, reserve, expect_plan):
    """Run ``make()`` under tritoff at its smallest budget (plus allocator headroom) with the process capped there:
    any unplanned buffer fails. Returns nothing; asserts the output equals the dequantized model's."""
    import gc

    def fresh():  # the same weights each time: realistic_init redraws Linear weights, not an Embedding's
        torch.manual_seed(0)
        return realistic_init(make()).to(torch.bfloat16).eval()

    reference = dequantize_in_place(fresh()).cuda()
    with torch.no_grad():
        expected = reference(ids)
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    model = fresh()
    # allocator rounding (2 MiB segments for small blocks) comes on top of the planned bytes: some headroom
    budget = _minimum(fresh(), reserve=reserve) + 64 * 2**20
    base = torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((base + budget + 2**20) / total)
    try:
        engine = tritoff.enable(model, mode="group", budget=budget, reserve=reserve, progress=False)
        expect_plan(engine)
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            got = model(ids)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_reserved() - base <= budget
        assert torch.equal(got, expected), f"max abs difference {(got.float() - expected.float()).abs().max()}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_a_unit_larger_than_staging_stays_within_the_budget():
    ids = torch.randint(0, 65536, (2, 16), device="cuda")

    def chunked(engine):  # the tied table (128 MiB) moves in many chunks
        assert engine.plan.phases["model"].chunk_bytes < 65536 * 1024 * 2 // 8
        assert engine.stats["total"]["host_lookup_bytes"] == 0

    _within_exact_budget(lambda: BigEmbedding(tied=True), ids, 2 * 16 * 65536 * 2 * 8, chunked)


def test_a_large_table_is_looked_up_on_the_host_and_never_uploaded():
    ids = torch.randint(0, 65536, (8, 128), device="cuda")

    def on_host(engine):
        assert engine.stats["total"]["host_lookup_bytes"] == 65536 * 1024 * 2
        assert engine.plan.planned_bytes < 65536 * 1024 * 2  # the plan holds less than the table alone

    _within_exact_budget(BigEmbedding, ids, 8 * 128 * 1024 * 2 * 8, on_host)


def test_a_pack_over_2_gib_unpacks_exactly():
    from tritoff.formats import get_format
    from tritoff.kernels.upcast import BLOCK, upcast_pack
    from tritoff.pack import PackLayout, TensorSpec

    fmt = get_format("fp8_e4m3")
    rows, row_len = 2, 1_100_000_000  # 2.2e9 fp8 elements: element offsets past 2^31
    layout = PackLayout.plan([TensorSpec("w", (rows, row_len), torch.bfloat16, True)], fmt, "row")
    e = layout.entries[0]
    data = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    codes = data[e.offset : e.offset + e.nbytes]
    codes.copy_(torch.randint(0, 256, (e.nbytes,), dtype=torch.uint8, device="cuda"))
    codes.masked_fill_((codes & 0x7F) == 0x7F, 0x38)  # no NaN codes (0x38 is 1.0); no nonzero() over 2^31
    data[e.scale_offset : e.scale_offset + 8].view(torch.float32).copy_(torch.tensor([2.0**-7, 2.0**3]))
    out = torch.empty(layout.out_nbytes, dtype=torch.uint8, device="cuda")
    upcast_pack(data, out, layout.table(BLOCK, "cuda"), layout.n_programs(BLOCK), torch.bfloat16, fmt)
    got = layout.views(out)["w"]
    for r, scale in enumerate((2.0**-7, 2.0**3)):
        for start in range(0, row_len, 1 << 28):  # compare in pieces: the reference needs fp32 temporaries
            end = min(start + (1 << 28), row_len)
            piece = codes[r * row_len + start : r * row_len + end].view(fmt.dtype)
            expected = (piece.float() * scale).to(torch.bfloat16)
            assert torch.equal(got[r, start:end].view(torch.int16), expected.view(torch.int16)), (r, start)


@pytest.mark.parametrize("transport,bound", [("staged", 1.25), ("zero_copy", 1.5)])
def test_matmuls_slow_down_little_while_packs_stream(transport, bound):
    from tritoff.arena import HostArena
    from tritoff.formats import get_format
    from tritoff.kernels.upcast import BLOCK, BLOCK_ZERO_COPY, upcast_pack, upcast_pack_zero_copy
    from tritoff.pack import PackLayout, TensorSpec

    fmt = get_format("fp8_e4m3")
    layout = PackLayout.plan([TensorSpec("w", (8192, 16384), torch.bfloat16, True)], fmt, "row")  # 128 MiB pack
    arena = HostArena(layout.nbytes)
    arena.buffer.fill_(0x30)
    e = layout.entries[0]
    arena.view(e.scale_offset, 4 * 8192).view(torch.float32).fill_(1.0)
    out = torch.empty(layout.out_nbytes, dtype=torch.uint8, device="cuda")
    staging = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    copy, upcast = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def matmuls() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    table, programs = layout.table(BLOCK, "cuda"), layout.n_programs(BLOCK)
    zc_table, zc_programs = layout.table(BLOCK_ZERO_COPY, "cuda"), layout.n_programs(BLOCK_ZERO_COPY)
    host = arena.device_view(0, layout.nbytes)

    def onloads(n: int) -> None:
        for _ in range(n):
            if transport == "staged":
                with torch.cuda.stream(copy):
                    staging.copy_(arena.buffer, non_blocking=True)
                upcast.wait_stream(copy)
                with torch.cuda.stream(upcast):
                    upcast_pack(staging, out, table, programs, torch.bfloat16, fmt)
                copy.wait_stream(upcast)  # the next copy overwrites the staging buffer this upcast reads
            else:
                with torch.cuda.stream(upcast):
                    upcast_pack_zero_copy(host, out, zc_table, zc_programs, torch.bfloat16, fmt)

    matmuls()  # warm-up
    alone = min(matmuls() for _ in range(3))
    onloads(1)
    torch.cuda.synchronize()
    onloads(12)  # a few seconds of transfers queued on the side streams
    during = matmuls()
    torch.cuda.synchronize()
    arena.close()
    assert during / alone < bound, (transport, alone, during)


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
def test_a_saved_store_runs_on_the_gpu_like_fresh_packs(tmp_path, transport):
    expected = run(dequantized_pipeline(wan).to("cuda"))
    source = wan()
    tritoff.enable(source, mode="group", budget="4MB", progress=False).save(tmp_path / "store")
    pipe = wan()
    engine = tritoff.enable(
        pipe, mode="group", budget="4MB", transport=transport, store=str(tmp_path / "store"), progress=False
    )
    assert all(p.arena.registered for p in engine.packed.values())  # read into the page-locked arena
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    assert torch.equal(run(pipe), expected)


def test_a_pipeline_loaded_for_its_store_runs_on_the_gpu_like_the_loaded_one(tmp_path):
    # every stored component built without its weights (the text encoder's tied embeddings one parameter), then
    # filled from the packs on the GPU
    from tritoff.convert import convert_pipeline, from_pretrained

    wan().save_pretrained(tmp_path / "pipe")
    convert_pipeline(tmp_path / "pipe", tmp_path / "store", progress=False)
    outputs = []
    for pipe in (
        tritoff.load_pipeline(tmp_path / "pipe", tmp_path / "store"),
        from_pretrained(tmp_path / "pipe", torch.bfloat16),
    ):
        tritoff.enable(pipe, mode="group", budget="4MB", store=str(tmp_path / "store"), progress=False)
        outputs.append(run(pipe))
    assert torch.equal(*outputs) and outputs[0].abs().sum() > 0


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
def test_packs_beyond_the_host_budget_stream_from_disk_through_the_reader_thread(tmp_path, transport):
    expected = run(dequantized_pipeline(wan, num_layers=8).to("cuda"))
    tritoff.enable(wan(num_layers=8), mode="group", budget="4MB", progress=False).save(tmp_path / "store")
    pipe = wan(num_layers=8)
    engine = tritoff.enable(
        pipe, mode="group", budget="4MB", transport=transport, store=str(tmp_path / "store"), host_budget="1MB",
        progress=False,
    )  # fmt: skip
    assert engine.disk.threaded and engine.disk.arena.registered
    for _ in range(2):  # the second run reuses ring buffers whose last copies were fenced by events
        assert torch.equal(run(pipe), expected)
    total = engine.stats["total"]
    assert total["disk_bytes_read"] > 2 * total["disk_pack_bytes"] and total["sync_onloads"] == 0


def test_lora_adapters_live_on_the_gpu_and_fuse_exactly():
    from .helpers import lora_state_dict

    lora = lora_state_dict(wan().transformer, targets=("to_q", "to_k", "to_v", "to_out.0"))
    reference = dequantized_pipeline(wan).to("cuda")
    reference.load_lora_weights(lora, adapter_name="a")
    expected = run(reference)
    reference.fuse_lora(components=["transformer"])
    dequantize_in_place(reference.transformer)  # quantized again, as the packs are
    reference.transformer.to("cuda")
    expected_fused = run(reference)
    pipe = wan()
    pipe.load_lora_weights(lora, adapter_name="a")  # on the CPU, before enable: the adapters move with the plan
    engine = tritoff.enable(pipe, mode="group", budget="5MB", progress=False)  # 2 fp8, 2 streamed
    assert engine.plan.tier_counts("transformer")["stream"] > 0 and engine.plan.tier_counts("transformer")["fp8"] > 0
    adapters = [p for n, p in pipe.transformer.named_parameters() if "lora_" in n]
    assert adapters and all(p.is_cuda and p.dtype == torch.bfloat16 for p in adapters)
    assert torch.equal(run(pipe), expected)
    pipe.fuse_lora(components=["transformer"])  # written back into host packs and the resident fp8 packs
    assert torch.equal(run(pipe), expected_fused)
    # loaded after enable, through peft's low_cpu_mem_usage path too: placed beside the base layers' placeholders
    pipe.load_lora_weights(lora_state_dict(wan().transformer, seed=2), adapter_name="b", low_cpu_mem_usage=True)
    assert all(p.is_cuda for n, p in pipe.transformer.named_parameters() if "lora_" in n)


def test_regional_compile_with_inductor_while_blocks_stream():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="4MB", progress=False)
    assert engine.plan.tier_counts("transformer")["stream"] > 0
    eager = run(pipe).float()
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    first = run(pipe)
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(run(pipe), first) and counters["stats"]["unique_graphs"] == graphs  # no recompilation
    mse = (first.float() - eager).pow(2).mean().item()
    assert mse < 1e-4  # inductor's kernels round differently from eager ones, not more


def test_transfer_streams_are_made_once_per_device():
    from tritoff.transfer import Transfer

    device = torch.device("cuda", torch.cuda.current_device())
    first, second = Transfer(device, 0), Transfer(device, 2**20)
    # every phase entry makes a Transfer: new streams each time would cycle through PyTorch's pool onto busy ones
    assert first.copy_stream == second.copy_stream and first.upcast_stream == second.upcast_stream
    assert first.copy_stream != first.upcast_stream
    assert torch.cuda.current_stream(device) not in (first.copy_stream, first.upcast_stream)


def test_the_default_budget_leaves_headroom_and_runs():
    from tritoff.budget import default_budget

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    reference = dequantize_in_place(_sleepy()).cuda()
    with torch.no_grad():
        expected = reference(x)
    del reference
    model = _sleepy()
    free, _ = torch.cuda.mem_get_info()
    engine = tritoff.enable(model, progress=False)  # no budget: the free memory less the headroom
    assert engine.options.budget <= default_budget(free) < free - 500 * 2**20
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_cuda_graph_capture_over_streamed_blocks_is_refused_and_the_engine_goes_on():
    """Under torch.cuda.graph() the first hook refuses before it queues anything (recovery would queue work on the
    capturing stream, an error there); the engine then runs as before."""

    def heavy():
        torch.manual_seed(0)
        return realistic_init(Heavy(n=4, width=256)).to(torch.bfloat16).eval()

    model, reference = heavy(), dequantize_in_place(heavy()).cuda()
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(tritoff.BudgetError) as info:
        tritoff.enable(model, mode="group", budget=1, reserve=2**16, progress=False)
    engine = tritoff.enable(model, mode="group", budget=info.value.minimum, reserve=2**16, progress=False)
    assert engine.plan.tier_counts("model")["stream"] > 0
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(expected, reference(x))
        with pytest.raises(RuntimeError, match="which a CUDA graph cannot capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                model(x)
        assert torch.equal(model(x), expected)


def test_a_cuda_graph_captures_a_resident_model_after_its_first_call():
    """Every block resident and loaded: a capture (after the usual warm-up call) replays the engine's output; before
    the warm-up, it is refused in one line."""
    torch.manual_seed(0)
    model = realistic_init(Heavy(n=4, width=256)).to(torch.bfloat16).eval()
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    engine = tritoff.enable(model, mode="group", budget="1GB", reserve=2**20, progress=False)
    assert engine.plan.tier_counts("model")["bf16"] == len(model.blocks)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="model is not on the GPU yet"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                model(x)
        expected = model(x)  # the warm-up: uploads the blocks
        with torch.cuda.graph(graph):
            out = model(x)
    graph.replay()
    assert torch.equal(out, expected)
    x.copy_(torch.randn_like(x))
    graph.replay()
    with torch.no_grad():
        assert torch.equal(out, model(x)) and not torch.equal(out, expected)


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
@pytest.mark.parametrize("fallback", ["fp8-from-bits", "reference-kernels"])
def test_the_hooks_are_exact_without_native_fp8_or_without_triton(monkeypatch, fallback, transport):
    # below compute capability 8.9 (A100, RTX 30xx) the prepared launches upcast fp8 from its bits, which an H100 or
    # H200 never does through the hooks; kernels='reference' (what 'auto' gives where Triton is missing) runs
    # PyTorch's upcast in the fills, which must run on the upcast stream between the same events
    from tritoff import onload

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    reserve = 64 * 512 * 2 * 8
    budget = int(1.3 * _minimum(_sleepy(), reserve=reserve, transport=transport))  # fp8-resident and streamed
    if fallback == "fp8-from-bits":
        monkeypatch.setattr(onload, "native_fp8", lambda device: False)
    kernels = "reference" if fallback == "reference-kernels" else "auto"
    model = _sleepy()
    engine = tritoff.enable(
        model, mode="group", budget=budget, reserve=reserve, transport=transport, kernels=kernels, progress=False
    )
    tiers = engine.plan.tier_counts("model")
    assert tiers["fp8"] > 0 and tiers["stream"] > 0, tiers
    with torch.no_grad():
        outputs = [model(x) for _ in range(3)]  # no host synchronization between calls
    torch.cuda.synchronize()
    for out in outputs:
        assert torch.equal(out, expected)
    blocks = engine.manager.components["model"].blocks
    if fallback == "fp8-from-bits":
        assert all(not g.native for g in blocks) and any(g._prepared for g in blocks)
    else:
        assert not any(g.use_triton or g._prepared for g in blocks)


def test_zero_copy_whose_disk_ring_cannot_be_page_locked_is_refused_before_anything_changes(monkeypatch, tmp_path):
    # the disk ring is made (and page-locked) before any weight is packed: its refusal leaves the original weights
    from tritoff import cuda_host

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    reserve = 64 * 512 * 2 * 8
    budget = _minimum(_sleepy(), reserve=reserve, transport="zero_copy")
    monkeypatch.setattr(cuda_host, "register", lambda ptr, nbytes: "CUDA_ERROR_OUT_OF_MEMORY")
    model = _sleepy()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    refused = r"the disk ring could not be locked \(CUDA_ERROR_OUT_OF_MEMORY\)"
    with pytest.warns(tritoff.TritoffWarning, match="page-locking"), pytest.raises(ValueError, match=refused):
        tritoff.enable(
            model, mode="group", budget=budget, reserve=reserve, transport="zero_copy", host_budget=0,
            spill_dir=str(tmp_path), progress=False,
        )  # fmt: skip
    assert not hasattr(model, "_tritoff_engine") and not hasattr(model, "_hf_hook")
    for name, (param, value) in before.items():
        current = dict(model.named_parameters())[name]
        assert current is param and torch.equal(current, value), name
    with torch.no_grad():
        assert torch.equal(model.cuda()(x), _sleepy().cuda()(x))


def test_a_capture_of_components_that_do_not_fit_together_is_refused():
    # a graph of a phase that leaves the GPU when another needs the room would replay reads of freed memory
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    expected_first, expected_second = _two_units_expected(x)
    pipe, _ = _one_unit_at_a_time()
    with torch.no_grad():
        assert torch.equal(pipe.first(x), expected_first)  # the warm-up: the first phase is on the GPU
        with pytest.raises(RuntimeError, match="do not fit the budget together"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pipe.first(x)
        assert torch.equal(pipe.second(x), expected_second) and torch.equal(pipe.first(x), expected_first)


def test_a_capture_of_a_model_looking_a_table_up_in_host_memory_is_refused(monkeypatch):
    from tritoff import groups

    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 2**20)  # the 2 MiB table stays on the host

    def make():
        torch.manual_seed(0)
        return realistic_init(BigEmbedding(vocab=4096, width=256, n=2)).to(torch.bfloat16).eval()

    ids = torch.randint(0, 4096, (2, 16), device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(make()).cuda()(ids)
    model = make()
    engine = tritoff.enable(model, mode="group", budget="1GB", reserve=2**20, progress=False)
    assert engine.stats["total"]["host_lookup_bytes"] == 4096 * 256 * 2
    with torch.no_grad():
        assert torch.equal(model(ids), expected)  # the warm-up: every block resident
        with pytest.raises(RuntimeError, match="looked up in host memory"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                model(ids)
        assert torch.equal(model(ids), expected)


def test_forwards_from_other_threads_are_exact_and_keep_the_driver_copies(monkeypatch):
    # a server runs the pipeline on worker threads: the driver copies need the context current on that thread (a
    # refusal is retried after a runtime call binds it), and the prepared launches are compiled and launched there
    import threading

    from tritoff import cuda_host, transfer

    from .helpers import in_threads

    monkeypatch.setattr(transfer, "_DRIVER_REFUSED", set())
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    reserve = 64 * 512 * 2 * 8
    model = _sleepy()
    engine = tritoff.enable(
        model, mode="group", budget=_minimum(_sleepy(), reserve=reserve), reserve=reserve, progress=False
    )
    threads, real = set(), cuda_host.copy_async

    def counted(spans, stream, bind_context=None):
        threads.add(threading.current_thread())  # the objects, kept: a thread's ident may be reused
        return real(spans, stream, bind_context)

    monkeypatch.setattr(cuda_host, "copy_async", counted)
    outputs = []

    def call():
        with torch.no_grad():  # grad mode is per thread
            outputs.append(model(x))

    for _ in range(2):  # the first loads the phase and prepares the launches on its thread, the second reuses them
        assert in_threads(call, 1) == []
    torch.cuda.synchronize()
    assert len(outputs) == 2 and all(torch.equal(out, expected) for out in outputs)
    assert len(threads) == 2 and threading.main_thread() not in threads  # each thread's copies went through the driver
    assert engine.manager.components["model"].transfer.driver_copies and not transfer._DRIVER_REFUSED


def test_a_first_forward_over_its_reserve_is_measured_and_the_next_call_planned_around_it():
    # a module without a config has no meta twin: its activation reserve comes from what its first call allocates,
    # measured on CUDA only, then the next call re-plans once around it
    x = torch.randn(16384, 512, dtype=torch.bfloat16, device="cuda")  # 16 MiB per activation
    with torch.no_grad():
        expected = dequantize_in_place(_sleepy()).cuda()(x)
    model = _sleepy()
    engine = tritoff.enable(model, mode="group", budget="256MB", progress=False)  # reserve: 10% of the budget
    comp = engine.manager.components["model"]
    before = comp.plan.reserve
    with torch.no_grad():
        with pytest.warns(tritoff.TritoffWarning, match="for activations, more than its"):
            outputs = [model(x)]
        outputs += [model(x), model(x)]
    torch.cuda.synchronize()
    measured = engine.stats["total"]["activation_bytes"]["model"]
    assert measured > before
    assert comp.stats.replans == 1 and comp.plan.reserve >= measured  # re-planned once, not at every call
    for out in outputs:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
def test_packs_moved_between_memory_and_disk_after_a_replan_stream_exactly(tmp_path, transport, monkeypatch):
    # a larger reserve streams more of the first expert's blocks: inside the next call, their packs take the places of
    # the second expert's in the page-locked arenas, and the second's are read through the ring (tritoff/rehold.py)
    import tritoff.manager
    from tritoff.arena import PAGE
    from tritoff.pack import align

    expected = run(dequantized_pipeline(wan, num_layers=8, two_experts=True).to("cuda"))
    options = dict(mode="group", reserve=100_000, transport=transport, progress=False)
    probe = tritoff.enable(wan(num_layers=8, two_experts=True), budget="1GB", **options)
    block = align(probe.packed["transformer"].packs[0].layout.nbytes, PAGE)
    # room for about half the blocks of each expert as fp8 packs, beside the smallest ring of slots
    options["budget"] = _minimum(wan(num_layers=8, two_experts=True), reserve=100_000, transport=transport) + 4 * block
    probe = tritoff.enable(wan(num_layers=8, two_experts=True), **options)
    streamed = sum(probe.plan.tier_counts(name)["stream"] for name in ("transformer", "transformer_2"))
    pipe = wan(num_layers=8, two_experts=True)
    engine = tritoff.enable(pipe, **options, host_budget=streamed * block, spill_dir=str(tmp_path))
    assert torch.equal(run(pipe), expected)  # the reader thread and its events have run before the moves
    # copies still queued when the moves begin read the bytes from before: the moves wait for the device first
    held = [p for name in ("transformer", "transformer_2") for p in engine.packed[name].packs if not p.on_disk]
    before = [p.data.clone() for p in held]
    copies = [torch.empty(p.data.numel(), dtype=torch.uint8, device="cuda") for p in held]
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(300_000_000)  # ~0.15 s: the moves' reads would land while these copies wait
        for out, p in zip(copies, held, strict=True):
            out.copy_(p.data, non_blocking=True)
    # the next call's estimate stands in for a larger call's: each phase is re-planned around it inside that call
    larger = engine.manager.components["transformer"].plan.reserve + 2 * block
    monkeypatch.setattr(tritoff.manager, "estimate", lambda *args, **kwargs: larger)
    engine.manager.auto_reserve = True
    for comp in engine.manager.components.values():  # the first call's measured peaks (cuBLAS workspaces) left aside
        comp.measured = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # phases the larger reserve does not fit keep their plans, warned
        assert torch.equal(run(pipe), expected)
    torch.cuda.synchronize()
    assert all(torch.equal(out.cpu(), old) for out, old in zip(copies, before, strict=True))
    assert engine.reheld_bytes > 0
    comp = engine.manager.components["transformer"]
    moved = {p.name for p in engine.packed["transformer"].packs if not p.on_disk}
    assert {g for g, tier in comp.plan.tiers["transformer"].items() if tier == "stream"} <= moved
    assert torch.equal(run(pipe), expected)
    total = engine.stats["total"]
    assert total["sync_onloads"] == 0 and total["pageable_host_bytes"] == 0
    # enabled again, the packs are taken over where they lie: zero-copy maps each through the arena holding it
    tritoff.enable(pipe, **options, host_budget=streamed * block, spill_dir=str(tmp_path))
    assert torch.equal(run(pipe), expected)


@pytest.mark.parametrize("transport", ["staged", "zero_copy"])
def test_empty_packs_of_zero_size_parameters_launch_nothing_and_run_exactly(transport):
    # a group of zero-size tensors alone packs to no bytes: no copy, and no launch of zero programs (an error on CUDA)
    import copy

    torch.manual_seed(0)
    layers = [nn.Linear(256, 256), nn.Linear(256, 0), nn.Linear(0, 256), nn.Linear(256, 256)]
    model = nn.Sequential(*layers).to(torch.bfloat16).eval()
    twin = dequantize_in_place(copy.deepcopy(model)).cuda()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = twin(x)
    engine = enable_at_minimum(model, mode="leaf", transport=transport, progress=False)
    (name,) = engine.packed
    assert engine.plan.tier_counts(name)["stream"] > 0
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), expected)
    tritoff.disable(model)

"""tritoff/transfer.py: staged fills move every chunk exactly, and build the views their copies use only once."""

import pytest
import torch

import tritoff
from tritoff.planner import BudgetError

from .helpers import stack

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")
OPTIONS = dict(mode="group", reserve=1000, progress=False, kernels="reference")


def _smallest_budget() -> int:
    with pytest.raises(BudgetError) as info:
        tritoff.enable(stack(width=1024), budget=1000, **OPTIONS)
    return info.value.minimum


def _outputs(model, x, forwards: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for _ in range(forwards)]


@pytest.mark.parametrize("served", ["host", "disk"])
def test_staged_copies_reuse_their_views_and_stay_exact(served, tmp_path):
    # the disk ring hands out a new view of one of its buffers at every take: the views are cached by host address,
    # so the cache stops growing once every chunk has passed through every buffer and half
    budget, x = _smallest_budget(), torch.randn(4, 16, dtype=torch.bfloat16)
    resident = stack(width=1024)
    tritoff.enable(resident, budget="1GB", **OPTIONS)  # every block resident, from the same fp8 packs
    expected = _outputs(resident, x, 1)[0]
    model = stack(width=1024)
    disk = dict(host_budget=0, spill_dir=str(tmp_path)) if served == "disk" else {}
    engine = tritoff.enable(model, budget=budget, **OPTIONS, **disk)
    comp = engine.manager.components["model"]
    streamed = [g for g in comp.blocks if g.tier == "stream"]
    assert streamed and all(len(g.chunks) == 2 for g in streamed)  # each pack moves in two chunks, one per half
    first = _outputs(model, x, 3)
    cached = len(comp.transfer._copies)
    later = _outputs(model, x, 3)
    assert len(comp.transfer._copies) == cached  # built once: later forwards reuse them
    buffers = len(engine.manager.disk.buffers) if served == "disk" else 1
    assert 0 < cached <= sum(len(g.chunks) for g in streamed) * 2 * buffers
    for (_, address, half), (chunk, staged, copies, spans) in comp.transfer._copies.items():
        # each in its own half (on the CPU a fill is synchronous: a wrong half would still give the right bytes)
        home = comp.transfer.staging[half]
        assert staged.data_ptr() == home.data_ptr() and staged.numel() == chunk.staged_bytes
        for to, source in copies:
            assert home.data_ptr() <= to.data_ptr() and to.data_ptr() + to.numel() <= home.data_ptr() + home.numel()
            assert source.data_ptr() >= address
        # what a CUDA fill hands the driver: the same bytes, address for address
        assert spans == tuple((to.data_ptr(), source.data_ptr(), source.numel()) for to, source in copies)
    for out in first + later:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_every_streamed_block_of_a_wan_transformer_moves_in_two_chunks():
    # staging halves of exactly half a block cut each pack into three chunks, the third a few KiB of padding, which
    # took a half of its own and held the next block's first copy back
    from tritoff.tiny import tiny_wan_transformer

    config = dict(num_layers=4, ffn_dim=344, num_attention_heads=3, attention_head_dim=40)
    with pytest.raises(BudgetError) as info:
        tritoff.enable(tiny_wan_transformer(**config), budget=1, **OPTIONS)
    engine = tritoff.enable(tiny_wan_transformer(**config), budget=info.value.minimum, **OPTIONS)
    streamed = [g for g in engine.manager.components["model"].blocks if g.tier == "stream"]
    assert streamed and all(len(g.chunks) == 2 for g in streamed)


def test_copies_through_a_driver_stay_exact_and_a_refusal_falls_back_once_per_device(monkeypatch):
    # the CUDA path's copies, run on the CPU through a stand-in driver whose copy is a memmove: each chunk's payload
    # and scales reach staging from the cached addresses; a copy refused again after the context retry is warned about
    # once, its chunk is copied by Tensor.copy_ before the warning, and every Transfer on the device stops using it
    from types import SimpleNamespace

    from tritoff import cuda_host, transfer
    from tritoff.warn import TritoffWarning

    from .helpers import StandInDriver

    monkeypatch.setattr(transfer, "_DRIVER_REFUSED", set())
    budget, x = _smallest_budget(), torch.randn(4, 16, dtype=torch.bfloat16)
    resident = stack(width=1024)
    tritoff.enable(resident, budget="1GB", **OPTIONS)
    expected = _outputs(resident, x, 1)[0]
    model = stack(width=1024)
    engine = tritoff.enable(model, budget=budget, **OPTIONS)
    outputs = _outputs(model, x, 1)  # the phase is loaded: its Transfer exists
    moving = engine.manager.components["model"].transfer
    driver, retries = StandInDriver(), []
    monkeypatch.setattr(cuda_host, "_driver", lambda: cuda_host.bind(driver.lib))
    moving._driver, moving._copy_handle = True, 0xC0FFEE
    moving.copy_stream = SimpleNamespace(query=lambda: retries.append(True))
    other = transfer.Transfer(torch.device("cpu"), 0)  # another phase's, loaded on the same device
    other._driver = True
    assert moving.driver_copies and other.driver_copies
    outputs += _outputs(model, x, 2)
    streamed = [g for g in engine.manager.components["model"].blocks if g.tier == "stream"]
    assert len(driver.calls) >= 2 * len(streamed) * 2  # two forwards, two chunks a block, payload and scales each
    assert {call[3] for call in driver.calls} == {0xC0FFEE} and not retries
    driver.refusals, driver.code = 2, 1  # refused, and refused again after the retry
    with pytest.warns(TritoffWarning, match="CUDA_ERROR_INVALID_VALUE") as seen:
        outputs += _outputs(model, x, 2)
    assert len([w for w in seen if issubclass(w.category, TritoffWarning)]) == 1 and retries == [True]
    assert not moving.driver_copies and not other.driver_copies and transfer._DRIVER_REFUSED == {None}
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_disk_buffer_is_given_back_when_its_event_cannot_be_recorded(monkeypatch):
    # a CUDA error recording the event that ends a block's copies out of a disk ring buffer: the stream is waited
    # for (the reader must not refill the buffer under queued copies), then the buffer goes back to the ring without
    # an event; kept taken, every later take of it would wait forever
    from types import SimpleNamespace

    from tritoff.transfer import Transfer

    class Disk:
        def __init__(self):
            self.given = []

        def take(self, pack):
            return 3, torch.arange(8, dtype=torch.uint8)

        def give_back(self, index, event=None):
            self.given.append((index, event, stream.waited))

    class Stream:
        waited = False

        def synchronize(self):
            self.waited = True

    class FailingEvent:
        def __init__(self, blocking=False):
            pass

        def record(self, stream):
            raise RuntimeError("CUDA error: invalid resource handle")

    monkeypatch.setattr(torch.cuda, "Event", FailingEvent)
    disk, stream = Disk(), Stream()
    transfer = Transfer(torch.device("cpu"), 0, disk=disk)
    group = SimpleNamespace(pack=SimpleNamespace(on_disk=True))
    with pytest.raises(RuntimeError, match="invalid resource handle"):
        with transfer.host_bytes(group, stream=stream) as data:
            assert data.numel() == 8
    assert disk.given == [(3, None, True)]


class _Stream:
    """A CUDA stream as the transfer's ordering sees it: what it was made to wait for, in order."""

    def __init__(self, name, log, destroyed=False):
        self.name, self.log, self.destroyed = name, log, destroyed

    def wait_stream(self, other):
        if other.destroyed:  # recording an event on a stream whose handle was freed
            raise torch.AcceleratorError("CUDA error: invalid resource handle")
        self.log.append(f"{self.name} waits {other.name}")

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


def test_a_phases_memory_is_freed_after_every_stream_its_calls_ran_on(monkeypatch):
    """A call on a stream of the caller's waits once for the phase's uploads; the stream the memory came from waits
    for every such stream before the memory goes back to it, and synchronizes where one was destroyed since."""
    from tritoff.transfer import MAX_COMPUTE_STREAMS, Transfer

    log = []
    home, copy, upcast = (_Stream(name, log) for name in ("home", "copy", "upcast"))
    current = [home]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    transfer = Transfer.__new__(Transfer)  # its streams and flags, without a GPU
    transfer.cuda, transfer.device, transfer.compute_streams = True, torch.device("cuda"), set()
    transfer.home_stream, transfer.copy_stream, transfer.upcast_stream = home, copy, upcast

    transfer.note_compute_stream()  # on the home stream: it waited for the uploads at the phase's entry
    assert log == [] and not transfer.compute_streams
    mine = _Stream("mine", log)
    current[0] = mine
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    transfer.note_compute_stream()  # capturing a CUDA graph: no wait on a stream outside the capture
    assert log == [] and not transfer.compute_streams
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for _ in range(3):  # the uploads are waited for once
        transfer.note_compute_stream()
    assert log == ["mine waits copy", "mine waits upcast"]
    log.clear()
    current[0] = home  # the phase left from the home stream
    transfer.before_free()
    assert log == ["home waits copy", "home waits upcast", "home waits mine"]

    log.clear()
    gone = _Stream("gone", log)
    current[0] = gone
    transfer.note_compute_stream()
    gone.destroyed = True  # its owner freed it before the phase left: waiting on it fails, the device is synchronized
    current[0] = home
    transfer.before_free()
    assert "synchronize" in log and "home waits mine" in log

    transfer.compute_streams.clear()
    log.clear()
    streams = [_Stream(f"s{i}", log) for i in range(MAX_COMPUTE_STREAMS + 1)]
    for stream in streams:  # a new stream at every call: the set stays bounded, the older ones waited for first
        current[0] = stream
        transfer.note_compute_stream()
    assert transfer.compute_streams == {streams[-1]}
    assert {f"home waits s{i}" for i in range(MAX_COMPUTE_STREAMS)} <= set(log)
    assert log[-2:] == [f"s{MAX_COMPUTE_STREAMS} waits copy", f"s{MAX_COMPUTE_STREAMS} waits upcast"]

"""tritoff/streams.py: switching streams puts the caller's device and stream back; the current stream is rebuilt
only when it changes. On the CPU, torch's CUDA functions are stood in for by a model of its per-device state."""

import pytest

from tritoff import streams


class _Devices:
    """torch's current device and each device's current stream, as its functions read and set them."""

    def __init__(self, device: int):
        self.device = device
        self.current = {0: (0, 0, 1), 1: (0, 1, 1)}  # the default stream of each device

    def set_stream(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.current[device_index] = (stream_id, device_index, device_type)
        self.device = device_index  # torch makes the stream's device current too

    def set_device(self, index: int) -> None:
        self.device = index


@pytest.fixture
def devices(monkeypatch):
    state = _Devices(device=1)
    monkeypatch.setattr(streams, "_get_device", lambda: state.device)
    monkeypatch.setattr(streams, "_get_stream", lambda index: state.current[index])
    monkeypatch.setattr(streams, "_set_stream", state.set_stream)
    monkeypatch.setattr(streams, "_set_device", state.set_device)
    monkeypatch.setattr(streams, "_stream", lambda ids: list(ids))  # a new object each time, holding its ids
    monkeypatch.setattr(streams, "_CURRENT", {})
    return state


@pytest.mark.parametrize("caller", [0, 1], ids=["same-device", "other-device"])
def test_enter_and_leave_put_back_the_callers_device_and_streams(devices, caller):
    devices.device = caller
    devices.current[0] = (7, 0, 1)  # the caller runs device 0's work on a stream of its own
    before = dict(devices.current)
    state = streams.enter((3, 0, 1))
    assert devices.device == 0 and devices.current[0] == (3, 0, 1)
    streams.leave(state)
    assert devices.device == caller and devices.current == before


def test_the_current_stream_is_built_again_only_when_it_changes(devices):
    first = streams.current(0)
    assert first == [0, 0, 1] and streams.current(0) is first
    devices.current[0] = (5, 0, 1)
    second = streams.current(0)
    assert second == [5, 0, 1] and streams.current(0) is second
    assert streams.current(1) == [0, 1, 1] and streams.current(0) is second  # per device

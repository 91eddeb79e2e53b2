"""The current CUDA stream, read and switched in a few microseconds: the hooks do both for every block.

``torch.cuda.stream(s)`` builds Stream objects and saves the current stream of two devices at each entry: 17 µs per
entry and exit on the H100 machine's host (``bench/hooks.py``); ``torch.cuda.current_stream()`` builds a new Stream
object at every call. A fill makes its upcast stream current once (its copies, queued through the driver, name their
stream) with these helpers, which call the functions behind those with a stream's ids read once, and put the caller's
device and stream back afterwards, as the context manager does. Where torch lacks those functions (a build without
CUDA), the public calls stand in.
"""

from __future__ import annotations

import torch

StreamIds = tuple[int, int, int]  # (stream id, device index, device type), as torch packs a stream


def _public_get_stream(index: int) -> StreamIds:
    return ids(torch.cuda.current_stream(index))


def _public_set_stream(stream_id: int, device_index: int, device_type: int) -> None:
    torch.cuda.set_stream(_stream((stream_id, device_index, device_type)))


# torch's own functions behind torch.cuda.current_stream, set_stream (which also makes the stream's device current),
# current_device and set_device
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", _public_get_stream)
_set_stream = getattr(torch._C, "_cuda_setStream", _public_set_stream)
_get_device = getattr(torch._C, "_cuda_getDevice", lambda: torch.cuda.current_device())
_set_device = getattr(torch._C, "_cuda_setDevice", lambda index: torch.cuda.set_device(index))

# device index -> (ids, Stream) of the current stream last seen there
_CURRENT: dict[int, tuple[StreamIds, torch.cuda.Stream]] = {}


def ids(stream: torch.cuda.Stream) -> StreamIds:
    """``stream``'s ids, what :func:`enter` takes."""
    return stream.stream_id, stream.device_index, stream.device_type


def enter(stream: StreamIds) -> tuple[int, StreamIds]:
    """Make ``stream`` (ids) current, and its device; returns what :func:`leave` puts back."""
    device = _get_device()
    saved = _get_stream(stream[1])
    _set_stream(*stream)
    return device, saved


def leave(state: tuple[int, StreamIds]) -> None:
    """Put back the device and stream :func:`enter` found."""
    device, saved = state
    _set_stream(*saved)
    if device != saved[1]:
        _set_device(device)


def current(index: int) -> torch.cuda.Stream:
    """The current stream of device ``index``, as a Stream object rebuilt only when that stream changes."""
    now = _get_stream(index)
    seen = _CURRENT.get(index)
    if seen is None or seen[0] != now:
        seen = _CURRENT[index] = now, _stream(now)
    return seen[1]


def _stream(stream: StreamIds) -> torch.cuda.Stream:
    return torch.cuda.Stream(stream_id=stream[0], device_index=stream[1], device_type=stream[2])

"""The slot ring: preallocated GPU buffers that streamed groups land in, filled on side streams, CUDA events only.

A streamed group is written into the next free slot by the transfer streams (``tritoff/transfer.py``); the upcast
into the slot first waits (on the GPU) for the event marking the end of the slot's previous use on the compute stream.
The compute stream waits (on the GPU) for the group's ready event before its forward. The host never synchronizes. Slots
and staging are allocated once, so there is no allocator churn and no ``record_stream``.

On the CPU the same bookkeeping runs with synchronous fills, so the ring logic is tested without a GPU.
"""

from __future__ import annotations

import torch

from tritoff import streams
from tritoff.onload import GroupRuntime, SlotParameters
from tritoff.transfer import Transfer, free_after_transfers


class StallClock:
    """Time the compute stream waited for transfers, from pairs of timing events around each wait. It outlives the
    rings that record into it (a phase's ring is freed when the phase is evicted)."""

    def __init__(self):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # pairs read, ready to record again
        self.ms = 0.0

    def pair(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Two timing events to record around a wait: read ones are reused, since creating events in a block's hook
        costs microseconds."""
        if self.spare:
            return self.spare.pop()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def add(self, before: torch.cuda.Event, after: torch.cuda.Event) -> None:
        """Record one wait; finished pairs are folded in now and then, without blocking."""
        self.events.append((before, after))
        if len(self.events) > 256:
            self._collect(block=False)

    def _collect(self, block: bool) -> None:
        pending = []
        for before, after in self.events:
            if block or after.query():
                if block:
                    after.synchronize()
                self.ms += before.elapsed_time(after)
                self.spare.append((before, after))
            else:
                pending.append((before, after))
        self.events = pending

    def seconds(self) -> float:
        """Total wait (synchronizes: for reports, not the hot path)."""
        self._collect(block=True)
        return self.ms / 1e3


class SlotRing:
    """``n_slots`` buffers of ``slot_bytes`` on ``device``, filled through ``transfer``."""

    def __init__(
        self,
        device: torch.device,
        n_slots: int,
        slot_bytes: int,
        transfer: Transfer,
        timing: bool = True,
        stalls: StallClock | None = None,
    ):
        self.device = device
        self.transfer = transfer
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        self.cuda = device.type == "cuda"
        # one event object per slot, re-recorded at each release: creating events in the hot path costs microseconds
        self.free_events = [torch.cuda.Event() if self.cuda else None for _ in range(n_slots)]
        self.used = [False] * n_slots
        self.timing = timing and self.cuda
        self.stalls = stalls if stalls is not None else StallClock()
        self.seq = 0
        # the group each slot was last loaded for: it holds the slot while its ``slot`` still names it (in flight or
        # bound), so a block loaded while another is bound (a block calling a block) never overwrites it
        self.holders: list[GroupRuntime | None] = [None] * n_slots
        # each slot's count of in-place writes as its last load was issued: every view of a slot shares the count,
        # so a write through any of them before its block ends shows in one read
        self._versions = [0] * n_slots
        # (slot, view layout) -> parameters viewing that slot: blocks of one shape share them, so they are all built
        # during the first forward (a group lands in a different slot on every pass when the ring's size does not
        # divide the number of blocks)
        self._params: dict[tuple[int, int], SlotParameters] = {}
        self._users: dict[tuple[int, int], GroupRuntime] = {}  # the group that last bound each, to name a refusal

    @property
    def n_slots(self) -> int:
        """Slots in the ring."""
        return len(self.buffers)

    def free_slot(self) -> int | None:
        """The next slot in ring order that no group holds, or None when every one is in flight or bound."""
        for offset in range(self.n_slots):
            slot = (self.seq + offset) % self.n_slots
            holder = self.holders[slot]
            if holder is None or holder.slot != slot:
                return slot
        return None

    def load(self, group: GroupRuntime) -> int:
        """Start writing ``group`` into the next free slot (asynchronously on CUDA); returns the host bytes it reads."""
        slot = self.free_slot()
        if slot is None:
            raise RuntimeError(
                f"{group.component}: {group.name} was called while blocks held all {self.n_slots} of the slots its "
                "blocks stream through (blocks called inside other blocks' forwards); enable with a larger prefetch "
                "(one more slot each) or mode='model'"
            )
        self.seq = slot + 1
        self.holders[slot] = group
        group.slot = slot
        # the DMA into staging may run ahead; only the upcast into the slot waits for the slot's last use to end
        after = self.free_events[slot] if self.cuda and self.used[slot] else None
        nbytes = self.transfer.fill(group, self.buffers[slot], after)
        self._versions[slot] = self.buffers[slot]._version  # after the fill's own writes (on the CPU)
        if self.cuda:
            if group.ready is None:
                group.ready = torch.cuda.Event(enable_timing=False)
            group.ready.record(self.transfer.upcast_stream)
        return nbytes

    def wait(self, group: GroupRuntime) -> None:
        """Make the compute stream wait for ``group``'s transfer (its parameters may then view its slot)."""
        if self.cuda:
            stream = streams.current(self.device.index)
            if self.timing:
                before, after = self.stalls.pair()
                before.record(stream)
                stream.wait_event(group.ready)
                after.record(stream)
                self.stalls.add(before, after)
            else:
                stream.wait_event(group.ready)

    def parameters(self, group: GroupRuntime) -> SlotParameters:
        """Parameters viewing the slot ``group`` was loaded into, for :meth:`GroupRuntime.bind_slot`."""
        key = (group.slot, group.view_layout)
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = group.slot_parameters(self.buffers[group.slot])
        self._users[key] = group
        return params

    def written(self, group: GroupRuntime) -> bool:
        """Whether ``group``'s slot was written in place since its load (a forward hook's ``fill_`` on a weight while
        the block runs, or through a slot parameter kept from another block): the packs never see it, and the next
        load drops it."""
        return self.buffers[group.slot]._version != self._versions[group.slot]

    def refresh(self, group: GroupRuntime, views: list[torch.Tensor], value: torch.Tensor) -> None:
        """Copy ``value`` into ``views`` of ``group``'s bound slot (its pack changed during its forward): tritoff's own
        write, which :meth:`written` then does not count; a write before it still does."""
        earlier = self.written(group)
        for view in views:
            view.copy_(value)
        if not earlier:
            self._versions[group.slot] = self.buffers[group.slot]._version

    def check_parameters(self) -> RuntimeError | None:
        """The refusal of a slot parameter given new data during a forward (its views put back), or None."""
        for key, slot in self._params.items():
            error = self._users[key].slot_data_error(slot)
            if error is not None:
                return error
        return None

    def release(self) -> None:
        """Free the slots (teardown)."""
        self._params, self._users = {}, {}
        self.buffers = []
        self.holders = []
        self.free_events = []
        self.used = []

    def __del__(self):
        free_after_transfers(getattr(self, "transfer", None), getattr(self, "buffers", None))

    def done(self, group: GroupRuntime) -> None:
        """Mark the end of ``group``'s use of its slot on the compute stream."""
        if self.cuda:
            self.free_events[group.slot].record(streams.current(self.device.index))
        self.used[group.slot] = True
        group.slot = None

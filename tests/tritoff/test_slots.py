"""tritoff/slots.py: the stall clock's event pairs (the ring itself is exercised through the engine's tests)."""

from tritoff.slots import StallClock


class _Event:
    """What the clock reads of a CUDA timing event: whether it completed, and the time since another."""

    def __init__(self, at_ms: float, done: bool = True):
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end) -> float:
        return end.at_ms - self.at_ms


def test_read_event_pairs_are_recorded_again_rather_than_created():
    clock = StallClock()
    pairs = [(_Event(i), _Event(i + 0.5, done=i < 200)) for i in range(257)]
    for pair in pairs:
        clock.add(*pair)
    # the 257th wait folds in the 200 finished pairs without blocking; the others stay pending
    assert len(clock.events) == 57 and clock.ms == 200 * 0.5
    reused = [clock.pair() for _ in range(200)]
    assert sorted(id(e) for p in reused for e in p) == sorted(id(e) for p in pairs[:200] for e in p)
    assert clock.seconds() == 257 * 0.5 / 1e3 and not clock.events and len(clock.spare) == 57

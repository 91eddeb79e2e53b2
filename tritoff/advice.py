"""What to change when the budget is too small: each lower prefetch and each other mode is planned again, and named
only where it lowers the smallest budget that works.

None helps everywhere: fewer ring slots change nothing in a phase whose component moves whole (a VAE), one layer per
group can need more than blocks do (staging and kernel tables are cut per group, and a block's largest layer is most
of it), and a model without a block list can need less moving whole than streaming its layers. So every suggestion
carries the minimum it was planned to, and a mode enable would refuse there (a store grouped otherwise, a compiled
block) is never named.
"""

from __future__ import annotations

from collections.abc import Callable

from tritoff.budget import format_bytes
from tritoff.planner import MODES, BudgetError

# an alternative that does not fit the budget is named only when it needs at most this fraction of the minimum: fewer
# ring slots or smaller groups cost speed, which a saving the budget would be rounded up over does not repay
WORTH = 0.95


def advise(
    err: BudgetError,
    mode: str,
    prefetch: int,
    budget: int,
    minimum_for: Callable[[str, int], int | None],
    modes: tuple[str, ...] = MODES,
) -> BudgetError:
    """``err`` with the :func:`alternatives` to ``mode`` and ``prefetch`` that lower its minimum: in
    ``alternatives`` on the result, and in its message, each with what it would need."""
    found = alternatives(err.minimum, mode, prefetch, budget, minimum_for, modes)
    return BudgetError("; ".join([str(err), *clauses(found, budget)]), err.minimum, found, budget, err.facts)


def alternatives(
    minimum: int,
    mode: str,
    prefetch: int,
    budget: int,
    minimum_for: Callable[[str, int], int | None],
    modes: tuple[str, ...] = MODES,
) -> dict[str, tuple[object, int]]:
    """What lowers ``minimum`` (the smallest budget ``mode`` and ``prefetch`` work with), each planned with
    ``minimum_for(mode, prefetch)`` (the smallest budget that works with them; None: that mode cannot be planned
    here), where it fits ``budget`` or needs at most ``WORTH`` of the minimum.

    Maps ``"prefetch"`` and ``"mode"`` to ``(value, minimum)``: for prefetch the largest value below ``prefetch``
    that fits ``budget``, else the one needing least; for mode, of ``modes``, the one needing least. When neither
    fits ``budget``, ``"together"`` maps to ``((mode, 1), minimum)``: another mode with a prefetch of 1, where that
    needs less than each alone (smaller groups can leave the ring the largest need, which fewer slots then lower).
    """

    def worth(needed: int | None, than: int = minimum) -> bool:
        return needed is not None and (needed <= budget or needed <= WORTH * than)

    found = {}
    for fewer in range(prefetch - 1, 0, -1):  # fewer ring slots need less: the first that fits is the fastest
        needed = minimum_for(mode, fewer)
        if worth(needed):
            found["prefetch"] = (fewer, needed)
            if needed <= budget:
                break
    others = [(m, minimum_for(m, prefetch)) for m in modes if m != mode]
    others = [(m, needed) for m, needed in others if worth(needed)]
    if others:
        found["mode"] = min(others, key=lambda pair: pair[1])
    if prefetch > 1 and all(needed > budget for _, needed in found.values()):
        both = [((m, 1), minimum_for(m, 1)) for m in modes if m != mode]
        both = [(pair, needed) for pair, needed in both if needed is not None]
        best = min(both, key=lambda pair: pair[1], default=None)
        if best is not None and worth(best[1], min([n for _, n in found.values()] + [minimum])):
            found["together"] = best
    return found


def option_words(option: str, value, flags: bool = False) -> str:
    """One of :func:`alternatives`' options as Python arguments (``mode='leaf'``) or, with ``flags``, as the command
    line's options (``--mode leaf``)."""
    if flags:
        return f"--mode {value[0]} --prefetch {value[1]}" if option == "together" else f"--{option} {value}"
    return f"mode={value[0]!r} with prefetch={value[1]}" if option == "together" else f"{option}={value!r}"


def clauses(alternatives: dict[str, tuple[object, int]], budget: int, flags: bool = False) -> list[str]:
    """What each of ``alternatives`` (as :func:`advise` finds them) needs, in words; ``flags``: options named as the
    command line spells them."""
    said = []
    for option, (value, needed) in alternatives.items():
        what = option_words(option, value, flags)
        needs = "would fit this budget" if needed <= budget else f"needs only {format_bytes(needed, up=True)}"
        said.append(f"{what} {needs}")
    return said

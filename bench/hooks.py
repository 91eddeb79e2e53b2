"""Host time in tritoff's block hooks, with each block's own compute kept small.

Builds a Wan-shaped transformer (``tritoff.tiny``, ``--layers`` blocks of 27 tensors) and enables tritoff at the
smallest budget that works, so every block streams through the slot ring. Runs ``--forwards`` forwards on a tiny input
and reports the engine's own counter: host time in tritoff's hooks per group (each block's pre and post, and its share
of the component's entry and exit, where the weights' checks run once per call), after the first forward, synchronous
fills (the CPU's transfer) excluded; then, over a few more forwards, the same time split by hook method
(``breakdown_us_per_group``). The counter sees only the hooks' own methods; timed from outside, whole forwards with
tritoff against the same model resident without it give what the hooks add per group with everything around them
(accelerate's hook dispatch, the lock, the ``torch.compiler.disable`` wrappers): ``added_us_per_group``, on CUDA only
(the host's time; a CPU's bf16 compute takes milliseconds per block, which bury it). For scale, it also times the
parameter swaps alone: binding a block's tensors to slot views and back to placeholders, in a tight loop; and, on CUDA,
the host time to issue one block's transfer (copy, upcast launch, events), which the hooks do for the blocks ahead, and
each of those calls alone; and the hooks' bookkeeping alone: their methods in a tight loop with the transfers stubbed
out. Target: ≤ 20 µs per group.

Usage:
  python bench/hooks.py [--device cpu|cuda] [--layers 8] [--forwards 30] [--repeats 3] [--out DIR]
  python bench/hooks.py --smoke          tiny, CI
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    """Measure and write ``hooks-<device>.json``."""
    from common import out_directory

    from tritoff.arguments import OneLineParser, at_least

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--layers", type=at_least(1), default=8)
    parser.add_argument("--forwards", type=at_least(1), default=30)
    parser.add_argument("--repeats", type=at_least(1), default=3, help="engines measured; the median is reported")
    parser.add_argument(
        "--out", type=out_directory, default=None, help="directory for the JSON (default: bench/results)"
    )
    parser.add_argument("--smoke", action="store_true", help="2 blocks, 4 forwards, 1 repeat")
    parser.add_argument("--deadline", type=float, default=None, help="epoch seconds: start no repeat after it")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.forwards, args.repeats = 2, 4, 1
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import warnings

    from common import markdown_table, write_result

    import tritoff
    from tritoff.planner import BudgetError
    from tritoff.tiny import tiny_wan_transformer

    warnings.filterwarnings("ignore", message="no CUDA device")
    config = dict(num_layers=args.layers, ffn_dim=1024, num_attention_heads=4, attention_head_dim=32)
    kernels = "auto" if device.type == "cuda" else "reference"  # the interpreter's launches would dominate on a CPU
    runs = []
    for repeat in range(args.repeats):
        if runs and args.deadline is not None and time.time() > args.deadline - 30:
            break
        model = tiny_wan_transformer(seed=repeat, **config)
        inputs = _inputs(model, device)
        plain_us = None
        if device.type == "cuda":  # a CPU computes the blocks in milliseconds (bf16), which bury the hooks' µs
            # the same model without tritoff, resident on the device: what a forward costs with no hooks at all
            plain = copy.deepcopy(model).to(device)
            plain_us = _host_us_per_forward(plain, inputs, args.forwards, device)
            del plain
        common = dict(mode="group", reserve="100KB", device=device, kernels=kernels, progress=False)
        try:
            tritoff.enable(model, budget=1, **common)
        except BudgetError as err:
            minimum = err.minimum
        engine = tritoff.enable(model, budget=minimum, **common)
        tiers = engine.plan.tier_counts("model")
        with torch.no_grad():
            for _ in range(args.forwards):
                model(**inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        group = next(g for comp in engine.manager.components.values() for g in comp.blocks if g.tier == "stream")
        hook_us = engine.stats["components"]["model"]["hook_us_per_group"]
        # the whole forward again, timed from outside: what the hooks add, wrappers included (accelerate's dispatch,
        # the lock, torch.compiler.disable), less the synchronous fills (the CPU's transfer)
        added_us = forward_us = None
        if plain_us is not None:
            tritoff_us = _host_us_per_forward(model, inputs, args.forwards, device)
            added_us = (tritoff_us - plain_us) / args.layers
            forward_us = {"without tritoff": plain_us, "with tritoff": tritoff_us}
        runs.append(
            {
                "hook_us_per_group": hook_us,
                "added_us_per_group": added_us,
                "forward_us": forward_us,
                # after the measurement: the wrappers add their own time, which the counter above never sees
                "breakdown_us_per_group": _diagnostic(_breakdown, engine, model, inputs, min(args.forwards, 10)),
                "swap_us_per_group": _swap_us(group, device),
                "issue_us_per_group": _diagnostic(_issue_us, engine, group, device),
                "issue_steps_us": _diagnostic(_issue_steps_us, engine, group, device),
                "profile": _diagnostic(_profile, engine, model, inputs, min(args.forwards, 10)),
                "bookkeeping_us_per_group": _diagnostic(_bookkeeping_us, engine, device),
                "tensors_per_group": len(group.params),
                "tiers": tiers,
                "budget_bytes": minimum,
            }
        )
        tritoff.disable(model, device="cpu")
    hook = statistics.median(r["hook_us_per_group"] for r in runs)
    addeds = [r["added_us_per_group"] for r in runs if r["added_us_per_group"] is not None]
    added = statistics.median(addeds) if addeds else None
    swap = statistics.median(r["swap_us_per_group"] for r in runs)
    issues = [r["issue_us_per_group"] for r in runs if isinstance(r["issue_us_per_group"], float)]
    issue = statistics.median(issues) if issues else None
    result = {
        "config": {**config, "forwards": args.forwards, "device": str(device), "kernels": kernels},
        "tensors_per_group": runs[0]["tensors_per_group"],
        "runs": runs,
        "hook_us_per_group": hook,
        "added_us_per_group": added,
        "swap_us_per_group": swap,
        "issue_us_per_group": issue,
        "issue_steps_us": runs[-1]["issue_steps_us"],
        "breakdown_us_per_group": runs[-1]["breakdown_us_per_group"],
        "bookkeeping_us_per_group": runs[-1]["bookkeeping_us_per_group"],
        "profile": runs[-1]["profile"],
        "target_us": 20.0,
        "met": hook <= 20.0,
    }
    path = write_result(f"hooks-{device.type}", result, smoke=args.smoke, out=args.out)
    print(
        markdown_table(
            [
                "device",
                "blocks",
                "host µs per group in hooks",
                "added to a forward, per group",
                "of which param swaps (tight loop)",
                "issuing one transfer (tight loop)",
                "target ≤ 20 µs",
            ],
            [
                [
                    str(device),
                    args.layers,
                    f"{hook:.1f}",
                    "-" if added is None else f"{added:.1f}",
                    f"{swap:.1f}",
                    "-" if issue is None else f"{issue:.1f}",
                    "met" if hook <= 20 else "not met",
                ]
            ],
        )
    )
    breakdown = result["breakdown_us_per_group"]
    if breakdown and "error" not in breakdown:
        split = {k: round(v, 1) for k, v in breakdown.items()}
        print("per group, by hook (µs; issue is part of the hooks that issued it):", split)
    bookkeeping = result["bookkeeping_us_per_group"]
    if isinstance(bookkeeping, float):
        print(f"bookkeeping alone (hook methods in a tight loop, transfers stubbed): {bookkeeping:.1f} µs per group")
    profile = result["profile"]
    if profile and "error" in profile:
        print(f"profile in place failed: {profile['error']}")
    elif profile:
        top = ", ".join(f"{row['function']} {row['self_us']:.1f}" for row in profile["top"][:8])
        print(f"in place under cProfile, self µs per group (inflated by the profiler): {top}")
    if result["issue_steps_us"]:
        print("issuing one chunk, step by step (µs):", result["issue_steps_us"])
    print(f"wrote {path}")


def _inputs(model, device) -> dict:
    """A tiny input for ``model`` (one 16x16 frame, 16 text tokens): the blocks' own compute stays small."""
    import torch

    gen = torch.Generator().manual_seed(0)
    dims = model.config
    return dict(
        hidden_states=torch.randn(1, dims.in_channels, 1, 16, 16, generator=gen).to(device, torch.bfloat16),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, 16, dims.text_dim, generator=gen).to(device, torch.bfloat16),
        return_dict=False,
    )


def _host_us_per_forward(model, inputs, forwards: int, device) -> float:
    """Host µs per forward of ``model`` over ``forwards`` calls after a few to warm up, the GPU waited for before and
    after but not between them: on CUDA the host's time, which the GPU's work on tiny blocks keeps up with."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        sync()
        start = time.perf_counter_ns()
        for _ in range(forwards):
            model(**inputs)
        elapsed = time.perf_counter_ns() - start
        sync()
    return elapsed / forwards / 1e3


def _diagnostic(measure, *args):
    """``measure(*args)``, or the error it raised: a diagnostic, whose failure must not cost the measurement."""
    try:
        return measure(*args)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def _breakdown(engine, model, inputs, forwards: int) -> dict:
    """Where the hooks' time goes, in place: host µs per group (per block call) in each hook method over ``forwards``
    more forwards, each timed around the call (the wrappers' own time included, synchronous fills left out as in the
    counter). ``issue`` (the transfers' launches) is also shown on its own: it is part of the hook that issued
    them (``group_pre`` for the blocks ahead; ``component_pre`` for the first ones). The component's hooks run once per
    call and are shared out over its blocks."""
    import torch

    manager = engine.manager
    names = ("component_pre", "group_pre", "_issue", "group_post", "component_post")
    spent = {name.lstrip("_"): 0 for name in names}

    def timed(name):
        method, key = getattr(manager, name), name.lstrip("_")

        def wrapper(*args, **kwargs):
            start = time.perf_counter_ns() - manager.transfer_ns
            try:
                return method(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter_ns() - manager.transfer_ns - start

        return wrapper

    for name in names:  # instance attributes: the hooks call these through the manager
        setattr(manager, name, timed(name))
    comp = manager.components["model"]
    calls = comp.stats.hook_calls
    try:
        with torch.no_grad():
            for _ in range(forwards):
                model(**inputs)
        if manager.device.type == "cuda":
            torch.cuda.synchronize(manager.device)
    finally:
        for name in names:
            delattr(manager, name)
    blocks = comp.stats.hook_calls - calls
    return {key: ns / blocks / 1e3 for key, ns in spent.items()} if blocks else {}


PROFILE_ROWS = 30
ROOT = Path(__file__).resolve().parent.parent


def _profile(engine, model, inputs, forwards: int) -> dict:
    """Where the hooks' host time goes in place, function by function: ``forwards`` more forwards under cProfile;
    of tritoff's functions and those they call directly (PyTorch's, Triton's, built-ins: their calls from tritoff
    only), the ``PROFILE_ROWS`` with the most time of their own, per block call (µs and calls), the hooks' total
    beside them. The profiler adds about a µs to every Python call it sees, so the figures are inflated; they rank
    what a tight loop cannot show (the issue in place costs 2.5x the same call in a loop on the H200's host). A driver
    call made through ctypes counts as its caller's own time."""
    import cProfile
    import pstats

    import torch

    comp = engine.manager.components["model"]
    calls = comp.stats.hook_calls
    profiler = cProfile.Profile()
    with torch.no_grad():
        profiler.enable()
        try:
            for _ in range(forwards):
                model(**inputs)
        finally:
            profiler.disable()
    if engine.manager.device.type == "cuda":
        torch.cuda.synchronize(engine.manager.device)
    blocks = comp.stats.hook_calls - calls
    if not blocks:
        return {}
    # (file, line, name) -> (primitive calls, calls, own s, cumulative s, {caller: ...})
    stats = pstats.Stats(profiler).stats
    # (calls, own s, cumulative s) of tritoff's functions, and of the others' their share called from tritoff's
    ours = {}
    for key, (_, count, own, cumulative, callers) in stats.items():
        if _ours(key[0]):
            ours[key] = (count, own, cumulative)
        elif shares := [v for caller, v in callers.items() if _ours(caller[0])]:
            ours[key] = tuple(sum(v[i] for v in shares) for i in (1, 2, 3))
    rows = sorted(ours.items(), key=lambda item: item[1][1], reverse=True)[:PROFILE_ROWS]
    hooks = ("component_pre", "group_pre", "group_post", "component_post")
    in_hooks = sum(v[3] for (file, _, name), v in stats.items() if name in hooks and file.endswith("manager.py"))
    return {
        "forwards": forwards,
        "hooks_us_per_group": in_hooks / blocks * 1e6,
        "top": [
            {
                "function": _where(file, line, name),
                "self_us": own / blocks * 1e6,
                "cumulative_us": cumulative / blocks * 1e6,
                "calls": count / blocks,
            }
            for (file, line, name), (count, own, cumulative) in rows
        ],
    }


def _ours(file: str) -> bool:
    """Whether ``file`` is tritoff's (the package or its kernels, in this checkout; not a virtual environment's)."""
    path = Path(file)
    inside = path.parts[len(ROOT.parts) :] if path.is_relative_to(ROOT) else ()
    return bool(inside) and inside[0] != "bench" and not {"site-packages", "dist-packages"} & set(inside)


def _where(file: str, line: int, name: str) -> str:
    """``tritoff/transfer.py:151(fill)``: a profiled function, its path from the checkout or site-packages down."""
    if file == "~":  # a built-in
        return name
    path = Path(file)
    if _ours(file):
        short = path.relative_to(ROOT).as_posix()
    else:
        parts = path.parts
        site = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
        short = "/".join(parts[site[-1] + 1 :]) if site else path.name
    return f"{short}:{line}({name})"


def _bookkeeping_us(engine, device) -> float:
    """Host µs per group of the hooks' own bookkeeping: the manager's hook methods called directly in a tight loop, as
    one forward calls them (the component's entry, each block's pre and post in the traced order, the exit), with
    the transfers stubbed out (no copy, no launch; the events and stream waits stay). What remains of the in-place
    counter once issuing transfers and the forward's own work are taken away. Run last: the slots then hold nothing
    usable, so what is in flight is dropped after."""
    import torch

    manager = engine.manager
    comp = manager.components["model"]
    blocks = [comp.blocks[i] for i in comp.order]

    def call():
        manager.component_pre(comp, (), {})
        for group in blocks:
            manager.group_pre(group)
            manager.group_post(group)
        manager.component_post(comp)

    transfer = comp.ring.transfer  # the one the ring fills through
    transfer.fill = lambda group, dst, after=None: group.packed_bytes
    try:
        with torch.no_grad():
            for _ in range(20):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter_ns()
            for _ in range(200):
                call()
            elapsed = time.perf_counter_ns() - start
    finally:
        del transfer.fill
        manager._invalidate()
    return elapsed / 200 / len(blocks) / 1e3


def _swap_us(group, device) -> float:
    """µs to put a streamed ``group``'s slot parameters in its modules and take them out again, in a tight loop."""
    import torch

    params = group.slot_parameters(torch.empty(group.unpacked_bytes, dtype=torch.uint8, device=device))
    for _ in range(100):
        group.bind_slot(params)
        group.unbind_slot()
    start = time.perf_counter_ns()
    for _ in range(2000):
        group.bind_slot(params)
        group.unbind_slot()
    return (time.perf_counter_ns() - start) / 2000 / 1e3


def _issue_us(engine, group, device) -> float | None:
    """Host µs to issue a streamed ``group``'s transfer into a slot (copy, upcast launch, events), in a tight loop;
    None on the CPU, where the fill itself runs synchronously."""
    if device.type != "cuda":
        return None
    comp = engine.manager.components[group.component]
    return _cuda_host_us(lambda: comp.transfer.fill(group, comp.ring.buffers[0]), device)


def _cuda_host_us(step, device) -> float:
    """Host µs per call of ``step`` (which queues CUDA work) in a tight loop of 200, after 20 to warm up; the GPU is
    idle before, and waited for after."""
    import torch

    torch.cuda.synchronize(device)
    for _ in range(20):
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter_ns()
    for _ in range(200):
        step()
    elapsed = time.perf_counter_ns() - start
    torch.cuda.synchronize(device)
    return elapsed / 200 / 1e3


def _issue_steps_us(engine, group, device) -> dict | None:
    """On CUDA, host µs of each call a staged fill makes per chunk, each in a tight loop: what issuing a transfer is
    made of (a fill makes its upcast stream current once and puts the caller's back; per chunk it records an event
    twice, waits once or twice, copies and launches), each beside what it replaced: the ``torch.cuda.stream`` context
    manager (and ``torch.cuda.set_stream``), ``Tensor.copy_`` (slicing its views every time, or over cached views)
    where the fill queues its copies through the driver, the upcast launched through Triton's JIT and
    ``upcast_pack``'s checks. None on the CPU, or for a group with no staging."""
    if device.type != "cuda" or not group.chunks:
        return None
    import torch

    from tritoff import streams
    from tritoff.chunks import chunk_views, stage_chunk

    comp = engine.manager.components[group.component]
    transfer, dst, chunk = comp.transfer, comp.ring.buffers[0], group.chunks[0]
    stream, event = transfer.upcast_stream, torch.cuda.Event()
    staged, *copies = chunk_views(chunk, group.pack.data, transfer.staging[0])

    def switch():
        with torch.cuda.stream(stream):
            pass

    def set_stream():  # the same switch and back, without the context manager's device bookkeeping
        compute = torch.cuda.current_stream(device)
        torch.cuda.set_stream(stream)
        torch.cuda.set_stream(compute)

    def tritoff_switch():  # what a fill does: torch's functions behind the context manager, ids read once
        streams.leave(streams.enter(ids))

    ids = streams.ids(stream)

    def cached_copies():
        for to, source in copies:
            to.copy_(source, non_blocking=True)

    steps = {
        "stream switch": switch,
        "stream switch (set_stream)": set_stream,
        "stream switch (tritoff.streams)": tritoff_switch,
        "event record": lambda: event.record(stream),
        "stream wait": lambda: stream.wait_event(event),
        "H2D copy issue": lambda: stage_chunk(chunk, group.pack.data, transfer.staging[0]),
        "H2D copy issue (views cached)": cached_copies,
        "upcast launch": lambda: group.fill_chunk(0, staged, dst),
        "upcast launch (prepared)": lambda: group.fill_chunk(0, staged, dst, stream=stream),
    }
    driver = "H2D copy issue (driver)"
    if transfer.driver_copies:  # what a fill pays: its cached addresses looked up, one driver call per span
        steps[driver] = lambda: transfer._stage(chunk, group.pack.data, 0)
    timed = {name: _cuda_host_us(step, device) for name, step in steps.items()}
    if not transfer.driver_copies:  # refused meanwhile (warned): the row timed Tensor.copy_
        timed.pop(driver, None)
    return timed


if __name__ == "__main__":
    main()

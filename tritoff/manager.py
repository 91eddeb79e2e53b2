"""The hook manager: one owner for casting, grouping, prefetch and residency.

Every component's root module carries a :class:`ComponentHook`, which enters its phase (``tritoff/residency.py``);
every block of a split component carries a :class:`GroupHook` (whatever its tier, so a re-plan can move it). Both
are accelerate ``ModelHook``s (put under diffusers' own hooks, and taken off, by ``tritoff/chain.py``) whose
``execution_device`` is the GPU, so diffusers pipelines create latents and embeddings there. Because one manager does
everything, nothing depends on the order features were enabled in.

Prefetch: the order of a component's groups starts as their module order and is replaced by the order traced during
its first forward; a call whose key (input shapes, flags, keyword names: ``_call_key``) came before follows the order
its first call with that key traced (a call skipping blocks by an argument, a model looping over its inputs, run
another order), any other call the first forward's. After a
group's forward starts, the next ``depth`` groups in that order (wrapping to the first block of the next forward) are
already being written into ring slots on the side stream. A group that runs out of that order is loaded synchronously
and counted; one the traced forward skipped then joins the order where it ran.

Under ``torch.compile`` the hooks stay outside the compiled regions (``torch.compiler.disable``): a block's body
compiles to one graph, reused for every block of the same class whatever slot its weights sit in, and the binding of
parameters to slots never becomes part of a graph or of its guards.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from accelerate.hooks import ModelHook
from accelerate.utils import send_to_device
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from tritoff import chain
from tritoff.activations import MARGIN, estimate, meta_twin
from tritoff.budget import format_bytes
from tritoff.host_lookup import HostTable
from tritoff.onload import GroupRuntime
from tritoff.planner import BudgetError, PhasedPlan, Plan
from tritoff.residency import Residency
from tritoff.slots import SlotRing, StallClock
from tritoff.transfer import Transfer
from tritoff.warn import warn

# what torch.utils.checkpoint raises inside a recomputed forward to end it once the tensors the backward needs exist
# again (its default "early stop"): control flow, not a failure
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())

# a component's methods other than forward that diffusers calls through apply_forward_hook (the hook without inputs)
PLANNED_METHODS = ("encode", "decode")


# call keys whose traced orders a component keeps (a model called with another key at every call keeps the latest)
MAX_ORDERS = 16


class RefusedUnchanged(RuntimeError):
    """A call refused before its hook changed anything: that call needs no recovery, which would release what the
    calls around it still hold (a block whose forward catches the refusal goes on with its weights); the calls it
    leaves on its way out recover as from any error (``unchanged`` is cleared once it leaves the first)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.unchanged = True


class CaptureRefused(RefusedUnchanged):
    """A CUDA graph capture of memory tritoff reuses or frees (streamed blocks, a phase not uploaded yet or evicted
    later, a re-plan), refused before the hook changed anything: the call that raised it needs no recovery (which
    would queue work on the capturing stream, itself an error there)."""


@dataclass
class ComponentStats:
    """Counters of one component."""

    bytes_h2d: int = 0
    onloads: int = 0
    sync_onloads: int = 0  # groups that ran out of the traced order
    trace_sync_onloads: int = 0  # the first forward, while its order was being traced
    pool_loads: int = 0  # phase entries that uploaded it
    entry_bytes: int = 0  # host bytes those entries moved
    evictions: int = 0
    calls: int = 0
    replans: int = 0
    hook_ns: int = 0  # host time in the component's and its groups' hooks after the first (tracing) forward
    hook_calls: int = 0


@dataclass
class ComponentRuntime:
    """A component at run time (one phase): its plan, its blocks, its unit, and what is loaded."""

    name: str
    module: torch.nn.Module
    plan: Plan
    looped: bool
    groups: list[GroupRuntime] = field(default_factory=list)  # all of them, in module order
    blocks: list[GroupRuntime] = field(default_factory=list)  # split blocks, whatever their tier
    unit: list[GroupRuntime] = field(default_factory=list)  # loaded whole when the phase is entered
    host: list[HostTable] = field(default_factory=list)  # lookup tables kept in host memory
    reads_disk: bool = False  # some block is served from disk (kept, not derived: the hooks ask at every block)
    order: list[int] = field(default_factory=list)  # module order until the first forward is traced
    orders: dict = field(default_factory=dict)  # _call_key -> the order traced on the first call with that key
    default_order: list[int] = field(default_factory=list)  # the first call's: for keys without an order of their own
    call_key: tuple | None = None  # the outermost running call's
    trace: list[int] | None = None
    traced: bool = False
    loaded: bool = False
    transfer: Transfer | None = None
    ring: SlotRing | None = None
    active: int = 0
    last_used: int = 0
    estimates: dict = field(default_factory=dict)  # input shapes -> activation estimate (None: not traceable)
    latest_key: tuple | None = None  # the estimates' key of the latest call planned
    unplannable: set = field(default_factory=set)  # (input shapes, reserve) the budget could not fit: warned once
    twin: object = None  # meta twin for estimates (False: cannot be built)
    measured: int | None = None  # activations of the first forward, measured on CUDA
    reserve_traced: bool = False  # the reserve was planned from a call's estimate (the default's placeholder before)
    last_ran: int | None = None  # the block that ran last in the current call
    # the current call counts toward the hooks' time: the steady state (traced before, no new input shapes to trace,
    # no re-plan), as component_pre found it
    steady: bool = False
    stats: ComponentStats = field(default_factory=ComponentStats)
    stalls: StallClock = field(default_factory=StallClock)

    def note_disk(self) -> None:
        """Set :attr:`reads_disk` from where its blocks' packs are now (built, or moved: ``tritoff/rehold.py``)."""
        self.reads_disk = any(g.pack.on_disk for g in self.blocks)

    def check_unchanged(self) -> None:
        """Refuse, in one line, a managed weight replaced, written in place or given new data since enable."""
        for g in self.groups:
            g.check_homes()
        for table in self.host:
            table.check()

    @property
    def estimate(self) -> int | None:
        """The activation estimate of its latest call's input shapes (None: not traced)."""
        return self.estimates.get(self.latest_key)

    @property
    def mode(self) -> str:
        """``resident``, ``model`` or ``group``, as planned."""
        return self.plan.modes[self.name]


def _settings(module: torch.nn.Module, twin) -> tuple:
    """``module``'s plain settings (``enable_tiling()``'s flag and tile sizes, slicing), copied to its meta ``twin``."""
    if not twin:
        return ()
    settings = tuple(
        (k, v)
        for k, v in vars(module).items()
        if type(v) in (bool, int, float) and not k.startswith("_") and k in vars(twin)
    )
    for k, v in settings:
        setattr(twin, k, v)
    return settings


def planned_method(manager: HookManager, comp: ComponentRuntime, method: str):
    """``comp.module.method`` (``encode``, ``decode``) planning its activations first
    (:meth:`HookManager.plan_method`): diffusers' hook on these runs without their inputs."""
    original = getattr(comp.module, method)

    def planned(*args, **kwargs):
        manager.plan_method(comp, method, args, kwargs)
        return original(*args, **kwargs)

    @functools.wraps(original)
    def call(*args, **kwargs):
        return manager.call_guarded(planned, args, kwargs, comp)  # diffusers' hook on it runs inside: no guard

    call._tritoff = True
    return call


def _call_key(args, kwargs) -> tuple:
    """What picks a call's block order: its tensors' shapes and dtypes, and its flags, names and counts (``bool``,
    ``int``, ``str``, ``None``: ``skip_layers=[2]``, ``kv_cache_mode="cached"``), each keyword argument by its name;
    other values (and nested tensors, whose sizes vary within) by their type only."""

    def leaves(tree) -> tuple:
        return tuple(
            (tuple(t.shape), t.dtype)
            if isinstance(t, torch.Tensor) and not t.is_nested
            else (type(t).__name__, t)
            if t is None or isinstance(t, (bool, int, str))
            else type(t).__name__
            for t in tree_leaves(tree)
        )

    return leaves(args), tuple((name, leaves(value)) for name, value in sorted(kwargs.items()))


def _shapes(args, kwargs) -> tuple:
    return tuple(
        (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in tree_leaves((args, kwargs))
    )


class HookManager:
    """Runs the plan: phase residency, the slot rings and prefetch, activation estimates, and the counters.

    ``replan(component, reserve) -> Plan`` plans a phase again with another activation reserve; with
    ``auto_reserve``, each new input shape of a component is traced on the meta device first and its phase re-planned
    around the estimate (see ``tritoff/activations.py``), then ``replanned(component)`` is called (the engine places
    the packs the host budget holds again: ``tritoff/rehold.py``). ``disk``: the ring packs served from disk are read
    into; prefetch issues such a pack only once it is read (it never holds the compute stream's work back waiting for
    the disk), and names the next ones for the ring's reader.
    """

    def __init__(
        self,
        device: torch.device,
        components: list[ComponentRuntime],
        phased: PhasedPlan,
        depth: int,
        replan=None,
        auto_reserve: bool = False,
        disk=None,
        replanned=None,
    ):
        self.device = device
        self.components = {c.name: c for c in components}
        self.phased = phased
        self.disk = disk  # the DiskRing of packs served from disk (None: every pack is in host memory)
        self.residency = Residency(device, phased.budget, phased.fixed_bytes, disk, evict=self.leave, busy=self._busy)
        self.depth = depth
        self.replan = replan
        self.replanned = replanned
        self.auto_reserve = auto_reserve
        self.inflight: deque[GroupRuntime] = deque()
        self.cursor: tuple[str, int] | None = None  # (component, order position) of the last group issued
        self.index = {id(g): i for c in components for i, g in enumerate(c.blocks)}
        self.activation_peaks: dict[str, int] = {}
        self.peak_seen = 0
        self._activation_base: dict[str, int] = {}
        self._saved_hooks: list[saved_tensors_hooks] = []
        # one forward at a time: calls from several threads take turns (the slots, the prefetch queue and the phases
        # are shared state); re-entrant, since a component's forward calls its blocks' hooks
        self.lock = threading.RLock()
        self.guarded_calls = 0  # hooked forwards running (guard_forward): nested ones inside a component's
        self.running: list[ComponentRuntime] = []  # components whose hooked forward (or encode/decode) is running
        self.running_blocks: list[GroupRuntime] = []  # blocks whose hooked forward is running

    @property
    def transfer_ns(self) -> int:
        """Host time spent filling synchronously (the CPU path) or waiting for the disk: transfer time, not hook
        overhead."""
        waited = self.disk.wait_ns if self.disk is not None else 0
        if self.device.type == "cuda":  # fills are asynchronous there (this runs four times per block)
            return waited
        return waited + self.residency.fills.ns

    def slot_storages(self) -> set[int]:
        """The storages of every loaded ring slot."""
        return {b.untyped_storage().data_ptr() for c in self.components.values() if c.ring for b in c.ring.buffers}

    # phases -----------------------------------------------------------------------------------------------------
    def enter(self, comp: ComponentRuntime) -> None:
        """Make ``comp``'s phase resident (uploading what its plan keeps there)."""
        if not comp.loaded:
            self._forget_inflight(lambda g: self.components[g.component].loaded is False)
        self.residency.enter(comp, list(self.components.values()))

    def leave(self, comp: ComponentRuntime) -> None:
        """Evict ``comp``'s phase."""
        self._forget_inflight(lambda g: g.component == comp.name)
        if self.cursor is not None and self.cursor[0] == comp.name:
            self.cursor = None
        self.residency.leave(comp)

    def apply_plan(self, comp: ComponentRuntime, new: Plan) -> None:
        """Give ``comp`` a new phase plan: evicted first if loaded, unless only its activation reserve changes (the
        same buffers stay, and other phases leave if the larger reserve needs their room)."""
        same = comp.loaded and _holdings(comp.plan) == _holdings(new)
        if not same:
            self.leave(comp)
        comp.plan = new
        self.phased.phases[comp.name] = new
        if same:
            self.residency.make_room(comp, list(self.components.values()))
        tiers = new.tiers.get(comp.name, {})
        for g in comp.blocks:
            g.tier = "bf16" if new.modes[comp.name] == "resident" else tiers.get(g.name, "pool")
        comp.stats.replans += 1

    @torch.compiler.disable  # outside a compiled decode's graph, as the hooks are
    def plan_method(self, comp: ComponentRuntime, method: str, args, kwargs) -> None:
        """Before ``comp.method(*args, **kwargs)`` (a VAE's ``encode`` or ``decode``, whose hook diffusers calls
        without the inputs): plan its activations as a forward's are."""
        with self.lock, normal_mode():
            self._plan_activations(comp, args, kwargs, method)

    def _plan_activations(self, comp: ComponentRuntime, args, kwargs, method: str = "forward") -> None:
        """Before a call with new input shapes: estimate its activations and re-plan the phase around them."""
        if not (self.auto_reserve and self.replan is not None and (args or kwargs)) or comp.active:
            return
        if comp.twin is None:
            comp.twin = meta_twin(comp.module) or False
        # settings such as enable_tiling()'s change what a call allocates: the twin takes them, the key holds them
        key = (method, _settings(comp.module, comp.twin), _shapes(args, kwargs))
        comp.latest_key = key
        if key not in comp.estimates:
            comp.estimates[key] = estimate(comp.twin or None, args, kwargs, method, cuda=self.device.type == "cuda")
        needed = comp.estimates[key]
        if comp.measured is not None:
            needed = max(needed or 0, int(comp.measured * MARGIN))
        if needed is None or needed == comp.plan.reserve or (key, needed) in comp.unplannable:
            return
        if comp.reserve_traced and needed < comp.plan.reserve:
            return  # a reserve planned from a call only grows: calls alternating shapes would re-upload every time
        if self.capturing():
            if needed <= comp.plan.reserve:
                return  # the plan has room for this call: a smaller reserve waits for a call outside the capture
            raise CaptureRefused(
                f"{comp.name} needs a larger activation reserve for these input shapes, which a CUDA graph cannot "
                "capture (the phase is planned again); run one call with them before capturing"
            )
        try:
            new = self.replan(comp.name, needed)
        except BudgetError as err:
            comp.unplannable.add((key, needed))  # the budget is the same at the next call: say it once
            # a VAE decoding whole holds the whole video's activations; in tiles, one tile's
            tiles = hasattr(comp.module, "enable_tiling") and getattr(comp.module, "use_tiling", None) is False
            warn(
                f"{comp.name}: this call needs about {format_bytes(needed)} of activations, more than the budget "
                f"leaves ({err}); it may run out of memory: raise the budget"
                + (f", decode in tiles ({_tiling_call(comp.name)})" if tiles else "")
                + ", or lower frames or resolution"
            )
            return
        self.apply_plan(comp, new)
        comp.reserve_traced = True
        if self.replanned is not None:
            self.replanned(comp.name)

    # component entry and exit -----------------------------------------------------------------------------------
    def component_pre(self, comp: ComponentRuntime, args, kwargs):
        """Before a component's forward (or encode/decode): plan its activations, enter its phase, start prefetching
        its first blocks."""
        start, loaded = time.perf_counter_ns() - self.transfer_ns, comp.loaded
        # named by a block that streams, not one that may be resident
        self._refuse_capture(comp, next((g for g in comp.blocks if g.tier in ("fp8", "stream")), None))
        if torch.is_grad_enabled():
            for g in comp.unit:
                _check_frozen(g)
        for g in comp.blocks:
            if g.hooked is not None and g.hooked[0].__dict__.get("_hf_hook") is not g.hooked[1]:
                raise _hook_replaced(g)
        for g in comp.groups:
            g.check_before_forward()
        for table in comp.host:
            table.check()
        shapes_seen, replans = len(comp.estimates), comp.stats.replans
        self._plan_activations(comp, args, kwargs)  # may refuse a capture: before anything is counted or changed
        # a call tracing new input shapes, or re-planning, is left out (its block hooks too), as the first call is:
        # the counter is the steady state's
        steady = comp.traced and len(comp.estimates) == shapes_seen and comp.stats.replans == replans
        if comp.blocks and not comp.active:  # the outermost call's: encode/decode (no blocks) and nested calls keep it
            comp.steady = steady
        counted = steady and loaded  # entering the phase here is an upload, not the hooks' overhead
        comp.stats.calls += 1
        comp.last_ran = None
        outermost = not comp.active
        if comp.blocks:  # encode/decode run pre_forward only (diffusers' apply_forward_hook): never marked active
            comp.active += 1
        self.enter(comp)
        comp.transfer.note_compute_stream()
        if comp.blocks:
            if not comp.order:
                comp.order = list(range(len(comp.blocks)))
            if outermost:
                comp.call_key = _call_key(args, kwargs)
                own = comp.orders.pop(comp.call_key, None)
                if own is not None:
                    comp.orders[comp.call_key] = own  # the most recently used last: the oldest is dropped first
                comp.order = own or comp.default_order or comp.order
                if comp.trace is None and (not comp.traced or own is None):  # the first call, or first of its key
                    comp.trace = []
                    if not comp.traced:
                        self._start_activation_measure(comp)
            head = self.inflight[0] if self.inflight else None
            # a call's first blocks in flight, prefetched at the end of the last call: kept where they are the ones
            # this call's order starts with (another kind of call may have left others)
            if head is None or head.component != comp.name or (outermost and not self._follows_order(comp)):
                self._restart_prefetch(comp)
        if counted:  # the component's hooks count with its blocks': their checks run here, once per call
            comp.stats.hook_ns += time.perf_counter_ns() - self.transfer_ns - start
        return send_to_device(args, self.device), send_to_device(kwargs, self.device)

    def component_post(self, comp: ComponentRuntime) -> None:
        """After a component's forward: finish its trace on the first call; check its slots' parameters."""
        start, counted = time.perf_counter_ns() - self.transfer_ns, comp.steady  # (steady implies traced)
        comp.active = max(comp.active - 1, 0)
        if comp.trace is not None and comp.active == 0:
            self._finish_activation_measure(comp)
            traced, comp.trace = comp.trace, None
            first = not comp.traced
            comp.traced = comp.traced or bool(traced)
            if first and not traced and any(g.tier in ("fp8", "stream") for g in comp.blocks):
                # resident blocks hold their weights from the phase's entry: only those moving through slots need
                # their hooks (a forward that calls none is traced again, so a re-plan that streams them is seen)
                raise _blocks_never_called(comp)
            if traced:
                if len(comp.orders) >= MAX_ORDERS:  # a key changing at every call: keep the latest used
                    del comp.orders[next(iter(comp.orders))]
                # its own copy: calls of keys without an order follow the first call's, and blocks they run out of it
                # join that one, not this key's
                comp.orders[comp.call_key] = list(traced)
            # a later key's order waits for its next call: a key that never comes back (a step counter) leaves the
            # prefetch on the first call's order, as if it were not traced
            if first and traced:
                comp.default_order, comp.order, before = traced, traced, comp.order
                if traced != before and self.cursor is not None and self.cursor[0] == comp.name:
                    # prefetch was following the module order: restart it on the traced one
                    self._restart_prefetch(comp)
        self._check_slots(comp)
        for g in comp.groups:  # a write during the call (a hook's fill_): refused before the call returns
            g.check_writes()
        for table in comp.host:
            table.check()
        if counted:
            comp.stats.hook_ns += time.perf_counter_ns() - self.transfer_ns - start

    def _check_slots(self, comp: ComponentRuntime) -> None:
        """Refuse a forward during which a slot's parameter was given new data (``.data = ...`` from a forward hook):
        the blocks sharing that slot computed with data tritoff does not hold. The slot's views are put back, so the
        next call computes as before. Once per call, not per block: a few dozen pointers."""
        if comp.ring is not None:
            error = comp.ring.check_parameters()
            if error is not None:
                raise error

    def _start_activation_measure(self, comp: ComponentRuntime) -> None:
        if self.device.type != "cuda":
            return
        self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._activation_base[comp.name] = torch.cuda.memory_allocated(self.device)

    def _finish_activation_measure(self, comp: ComponentRuntime) -> None:
        base = self._activation_base.pop(comp.name, None)
        if base is None:
            return
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.activation_peaks[comp.name] = comp.measured = peak
        if peak > comp.plan.reserve:
            how = "the next call is planned around it" if self.auto_reserve else f"re-enable with reserve={peak}"
            warn(
                f"{comp.name}'s first forward used {format_bytes(peak)} for activations, more than its "
                f"{format_bytes(comp.plan.reserve)} reserve: peak memory may exceed the budget; {how}"
            )

    def peak_bytes(self) -> int:
        """Peak GPU memory allocated since the process started (the measurements reset the allocator's peak)."""
        return max(self.peak_seen, torch.cuda.max_memory_allocated(self.device))

    # failures and teardown --------------------------------------------------------------------------------------
    def call_guarded(self, fn, args, kwargs, comp: ComponentRuntime | None = None, group: GroupRuntime | None = None):
        """``fn(*args, **kwargs)``, a hooked forward or encode/decode (of ``comp``'s root, or of block ``group``):
        calls from several threads take turns (the lock), and an exception escaping it resets the manager
        (:meth:`recover`) before it propagates. ``comp`` counts as running again as before the call (its exit hook
        did not run)."""
        with self.lock:
            self.guarded_calls += 1
            running, block = comp is not None, group is not None
            if running:
                self.running.append(comp)
                active = comp.active
            if block:
                self.running_blocks.append(group)
            try:
                return fn(*args, **kwargs)
            except BaseException as err:
                if _recompute_ended(err, comp, group):  # its weights stay bound: the backward reads them
                    if running:
                        comp.active = active  # its exit hook did not run
                    raise
                refused = isinstance(err, RefusedUnchanged) and err.unchanged
                if isinstance(err, RefusedUnchanged):
                    # only the call whose hook refused changed nothing; a capture is refused wherever it runs (there,
                    # recovering would queue work on the capturing stream)
                    err.unchanged = isinstance(err, CaptureRefused)
                if not refused:
                    if running:  # no longer running: recover may evict its phase
                        comp.active = active
                        self.running.pop()
                        running = False
                    if block:
                        self.running_blocks.pop()
                        block = False
                    self.recover(outermost=self.guarded_calls == 1, left=group)
                raise
            finally:
                self.guarded_calls -= 1
                if running:
                    self.running.pop()
                if block:
                    self.running_blocks.pop()

    def recover(self, outermost: bool = True, left: GroupRuntime | None = None) -> None:
        """After an exception escaped a forward (an error in a block, Ctrl-C, a CUDA OOM a caller catches): release
        what the interrupted call held, so the next call runs exactly as on a fresh engine.

        Slots the interrupted blocks held are freed behind whatever the compute stream had queued; a partial trace
        is discarded (the next call traces again); every phase is evicted (its memory is what a caller retrying after
        an out-of-memory error needs back), except those of components whose forwards are still running (the
        exception left a block or a nested call, which their forward may catch and go on from): their blocks keep
        their slots, but for the one the exception left (``left``).
        """
        while self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        if self.capturing():
            # an error inside a capture (which tritoff let start: every block resident, nothing in flight): only the
            # host's bookkeeping is reset, since freeing or waiting on the capturing stream is itself an error there
            for comp in self.components.values():
                comp.trace = None
                comp.active = 0 if outermost else comp.active
                self._activation_base.pop(comp.name, None)
            return
        if outermost and self.disk is not None:
            self.disk.recover()
        inflight = {id(g) for g in self.inflight}
        # a block whose forward still runs (one called on its own, which calls another) keeps its component running
        running = self._running() if not outermost else set()
        self._invalidate()
        self.cursor = None
        for comp in self.components.values():
            for g in comp.blocks:
                bound = g.slot is not None and id(g) not in inflight and comp.ring is not None
                if bound and (id(comp) not in running or g is left):
                    comp.ring.done(g)
                    g.release()
            comp.trace = None
            if outermost:
                comp.active = 0  # whatever the exception skipped, nothing runs any more
            self._activation_base.pop(comp.name, None)
            if id(comp) not in running:
                self.residency.leave(comp)

    def _busy(self, comp: ComponentRuntime) -> bool:
        """Whether ``comp``'s phase must stay loaded for a forward that runs (its own, or one of its blocks')."""
        return bool(comp.active) or id(comp) in self._running()

    def _running(self) -> set[int]:
        """The ids of the components whose forward (or encode/decode) runs, or one of whose blocks runs on its own:
        their phases stay loaded."""
        return {id(c) for c in self.running} | {id(self.components[g.component]) for g in self.running_blocks}

    def capturing(self) -> bool:
        """Whether the compute stream (the engine device's current stream) is being captured into a CUDA graph."""
        if self.device.type != "cuda":
            return False
        if torch.cuda.current_device() == self.device.index:
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(self.device):  # the check reads the current device's stream
            return torch.cuda.is_current_stream_capturing()

    def _refuse_capture(self, comp: ComponentRuntime, streamed: GroupRuntime | None = None) -> None:
        """Under a CUDA graph capture, refuse (before anything changes) a call whose replays would read GPU memory
        tritoff reuses or frees: a ``streamed`` block's slots, a phase not uploaded yet, or one evicted later."""
        if not self.capturing():
            return
        if streamed is not None:
            raise CaptureRefused(
                f"{streamed.component}.{streamed.name} streams through reused GPU slots, which a CUDA graph cannot "
                "capture; capture without tritoff, or with a budget that keeps every block resident"
            )
        if comp.host:
            group = comp.host[0].group
            raise CaptureRefused(
                f"{comp.name}.{group.name} is looked up in host memory (its ids go to the CPU at every call), which a "
                "CUDA graph cannot capture; capture without tritoff"
            )
        if not self.phased.together:
            raise CaptureRefused(
                f"{comp.name} leaves the GPU whenever another component needs the room (the components do not fit "
                "the budget together), and a CUDA graph would then read freed memory; capture with a budget that "
                "fits every component, or without tritoff"
            )
        if not comp.loaded:
            raise CaptureRefused(
                f"{comp.name} is not on the GPU yet and a CUDA graph cannot capture its upload; run one call before "
                "capturing (the usual warm-up)"
            )

    def _refuse_slot_tensor(self, group: GroupRuntime):
        slots = self.slot_storages()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() in slots:
                raise RuntimeError(
                    f"{group.component}.{group.name}: autograd would save a weight that lives in a reused GPU slot "
                    "(an input or adapter requires grad); run under torch.no_grad(), or use a budget that keeps this "
                    "block resident"
                )
            return tensor

        return pack

    def drop_prefetch(self) -> None:
        """Forget the groups in flight, after waiting for every transfer: their packs are about to change (a fused
        adapter), so what the slots hold is stale; the next forward loads them again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._invalidate()
        self.cursor = None

    def release(self) -> None:
        """Evict every phase (teardown, recovery)."""
        self._invalidate()
        self.cursor = None
        for comp in self.components.values():
            self.residency.leave(comp)

    # groups -----------------------------------------------------------------------------------------------------
    def group_pre(self, group: GroupRuntime) -> None:
        """Before a block's forward: make sure it is loaded (or loading), wait for it on the GPU, bind, prefetch."""
        start = time.perf_counter_ns() - self.transfer_ns
        comp = self.components[group.component]
        loaded = comp.loaded  # a block called on its own may enter its phase here: an upload, not hook overhead
        # bound to its slot and not prefetched: its own forward is running (an interrupted unbind leaves a group
        # bound with its slot freed, and a prefetch then takes it into flight)
        if group.bound and group.slot is not None and group not in self.inflight:
            raise _called_inside_itself(group)
        if not comp.active:  # called on its own (inside its component's call, the component's hook checked)
            if chain.inside_forward(comp.module):  # inside a component forward that no longer runs tritoff's hook
                raise _forward_bypassed(comp)
            # first: a block called on its own would otherwise load its phase
            self._refuse_capture(comp, group if group.tier in ("fp8", "stream") else None)
        if torch.is_grad_enabled():
            _check_frozen(group)
        if not comp.loaded:  # a block called on its own, outside its component's forward
            self.enter(comp)
            if not comp.order:  # a root that is never called itself (a ModuleList): prefetch in module order
                comp.order = list(range(len(comp.blocks)))
        if comp.trace is not None:
            comp.trace.append(self.index[id(group)])
        if not comp.active:  # called on its own: its component's hook (checks all groups, notes the stream) did not run
            group.check_before_forward()
            for g in comp.unit:  # weights tied across blocks live with the rest of the component
                g.check_homes()
            comp.transfer.note_compute_stream()
        if group.tier in ("fp8", "stream"):
            if torch.is_grad_enabled():
                # slot views must never be saved for a backward pass: the slot is overwritten by a later block
                hooks = saved_tensors_hooks(self._refuse_slot_tensor(group), _unpack_saved)
                hooks.__enter__()
                self._saved_hooks.append(hooks)
            if group in self.inflight:
                while self.inflight[0] is not group:  # skipped (conditional) groups: their slots are simply reused
                    self.inflight.popleft().slot = None
                self.inflight.popleft()
            else:
                self._invalidate()
                # the first call traces the order: its misses are the warm-up's (a later key's count as misses)
                warm_up = comp.trace is not None and not comp.traced
                if warm_up:
                    comp.stats.trace_sync_onloads += 1
                else:
                    comp.stats.sync_onloads += 1
                self._issue(group)
                index = self.index[id(group)]
                if index not in comp.order and not warm_up:
                    # a block the traced call skipped (a condition): it goes after the block that ran before it in
                    # this call, so later calls prefetch it
                    after = comp.order.index(comp.last_ran) if comp.last_ran in comp.order else -1
                    comp.order.insert(after + 1, index)
                self.cursor = (comp.name, comp.order.index(index) if index in comp.order else -1)
            comp.ring.wait(group)
            group.bind_slot(comp.ring.parameters(group))
            self._top_up()
        comp.last_ran = self.index[id(group)]
        # host time in the hook itself: synchronous fills (the CPU path) are the transfer, not overhead
        end = time.perf_counter_ns() - self.transfer_ns
        group.hook_counted = loaded and (comp.steady if comp.active else comp.traced)  # no warm-up, tracing, entry
        if group.hook_counted:
            comp.stats.hook_ns += end - start
            comp.stats.hook_calls += 1

    def group_post(self, group: GroupRuntime) -> None:
        """After a block's forward: free its slot (an event on the compute stream) and unbind its parameters."""
        start = time.perf_counter_ns() - self.transfer_ns
        if self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        comp = self.components[group.component]
        if group.tier in ("fp8", "stream") and group.slot is not None:
            written = comp.ring.written(group)
            comp.ring.done(group)
            group.unbind_slot()
            if written:
                raise _written_during_forward(group)
            if not comp.active:  # called on its own: the component's exit, which checks the slots, will not run
                self._check_slots(comp)
                group.check_writes()
        if comp.reads_disk and not self.inflight and self.cursor is not None and self.cursor[0] == comp.name:
            # the block's kernels are queued (whatever its tier): wait for the next pack's disk read now, while the
            # GPU computes, rather than in the next block's hook with nothing queued
            self._top_up(block=True)
        if group.hook_counted:
            comp.stats.hook_ns += time.perf_counter_ns() - self.transfer_ns - start

    def _issue(self, group: GroupRuntime) -> None:
        comp = self.components[group.component]
        comp.stats.bytes_h2d += comp.ring.load(group)
        comp.stats.onloads += 1

    def _restart_prefetch(self, comp: ComponentRuntime) -> None:
        """Drop whatever is in flight and start prefetching ``comp``'s first groups (waiting for the first one's disk
        read, if it has one: nothing is queued for this component yet)."""
        self._invalidate()
        self.cursor = (comp.name, -1)
        self._top_up(block=True)

    def _follows_order(self, comp: ComponentRuntime) -> bool:
        """Whether the groups in flight are the first ones ``comp``'s order loads; if so the cursor moves to the last
        of them in this order."""
        position, expected = -1, []
        for step in range(len(comp.order)):
            group = comp.blocks[comp.order[step]]
            if group.tier in ("fp8", "stream") and group not in expected:
                expected.append(group)
                position = step
                if len(expected) == len(self.inflight):
                    break
        if expected != list(self.inflight):
            return False
        self.cursor = (comp.name, position)
        return True

    def _invalidate(self) -> None:
        while self.inflight:
            self.inflight.popleft().slot = None

    def _forget_inflight(self, which) -> None:
        kept = deque()
        for g in self.inflight:
            if which(g):
                g.slot = None
            else:
                kept.append(g)
        self.inflight = kept

    def _top_up(self, block: bool = False) -> None:
        """Issue loads for the groups after the cursor until ``depth`` are in flight. A pack served from disk is
        issued once the disk ring has read it, or (``block``) when nothing else is in flight."""
        if self.cursor is None:
            return
        name, position = self.cursor
        comp = self.components[name]
        if comp.ring is None:
            return
        order = comp.order
        for _ in range(len(order)):
            if len(self.inflight) >= self.depth:
                break
            step = (position + 1) % len(order)
            group = comp.blocks[order[step]]
            if group.tier in ("bf16", "pool") or group in self.inflight or group.slot is not None:
                position = step
                continue
            # an fp8-tier block fills from its pack on the GPU: only a streamed one reads the disk
            disk = group.tier == "stream" and group.pack.on_disk
            if disk and not self.disk.ready(group.pack) and (self.inflight or not block):
                break
            if comp.ring.free_slot() is None:  # blocks bound inside other blocks' forwards hold the rest
                break
            position = step
            self._issue(group)
            self.inflight.append(group)
        self.cursor = (name, position)
        if comp.reads_disk:
            self._read_ahead(comp, position)

    def _read_ahead(self, comp: ComponentRuntime, position: int) -> None:
        """Name the disk packs of the streamed groups after ``position`` to the disk ring, soonest first."""
        wanted, order = [], comp.order
        for offset in range(1, len(order) + 1):
            group = comp.blocks[order[(position + offset) % len(order)]]
            if group.tier == "stream" and group.pack.on_disk and group not in self.inflight:
                wanted.append(group.pack)
                if len(wanted) == len(self.disk.buffers):
                    break
        self.disk.want(wanted)


def _recompute_ended(err: BaseException, comp: ComponentRuntime | None, group: GroupRuntime | None) -> bool:
    """Whether ``err`` is torch.utils.checkpoint ending the recompute of a checkpointed block or component early, where
    every weight it computes with stays bound while its phase does (resident tiers): control flow the backward goes on
    from, not a failure to recover from (recovering evicts every phase, and the backward would read placeholders)."""
    if not isinstance(err, _STOP_RECOMPUTATION):
        return False
    groups = [group] if group is not None else comp.groups if comp is not None else []
    return bool(groups) and all(g.tier in ("bf16", "pool") for g in groups)


def _check_frozen(group: GroupRuntime) -> None:
    """Refuse a managed weight that requires grad (set after enable): its values are overwritten on every load."""
    for param, entry in zip(group.params, group.layout.entries, strict=True):
        if param.requires_grad:
            raise RuntimeError(
                f"{group.component}.{entry.name} requires grad, but the weights tritoff manages are frozen (each load "
                "overwrites them from its packs): set requires_grad_(False), or call tritoff.disable(pipe) first to "
                "train"
            )


def _forward_bypassed(comp: ComponentRuntime) -> RuntimeError:
    """A block ran inside its component's forward while the component's hook did not run: the forward was replaced
    after enable by one that does not call the forward tritoff hooked (a cache patch assigned to ``module.forward``),
    so the component's layers outside the blocks computed with placeholders."""
    return RuntimeError(
        f"{comp.name}.forward was replaced after tritoff.enable by a function that does not call the forward tritoff "
        "hooked, so its weights were not loaded (NaN); call tritoff.disable(pipe), replace it, then tritoff.enable "
        "again (or make it call the forward it replaced)"
    )


def _hook_replaced(group: GroupRuntime) -> RuntimeError:
    """A block's accelerate hook replaced after enable (``add_hook_to_module`` without ``append``, which takes no hook
    off): the block would run without tritoff's, on placeholders."""
    return RuntimeError(
        f"the hook on {group.component}.{group.name} is no longer tritoff's (accelerate's add_hook_to_module replaced "
        "it after tritoff.enable), so the block would compute with placeholders (NaN); call tritoff.disable on the "
        "pipeline or module tritoff.enable was given (it puts the block's own forward back)"
    )


def _written_during_forward(group: GroupRuntime) -> RuntimeError:
    """A weight of a streamed block written in place while the block ran: the write went to the slot it streams
    through, which its next load overwrites from the packs."""
    return RuntimeError(
        f"a weight of {group.component}.{group.name} was written in place during its forward (a forward hook's "
        "fill_ or an in-place op on module.weight), into the slot it streams through, which the packs never see; call "
        "tritoff.disable(pipe) first, change the weights, then enable again"
    )


def _called_inside_itself(group: GroupRuntime) -> RefusedUnchanged:
    """A streamed block called again while its own forward runs: its weights come from a slot bound for one call at
    a time, which the inner call would take over and give back before the outer call uses them."""
    return RefusedUnchanged(
        f"{group.component}.{group.name} was called inside its own forward, but a streamed block lends its weights "
        "to one call at a time; enable with mode='model', or a budget that keeps it resident"
    )


def _blocks_never_called(comp: ComponentRuntime) -> RuntimeError:
    """A component's forward ran without calling any of its blocks: its model calls what is inside them directly
    (``block.attn(x)``), or reads a layer's weights without calling it, so the blocks' hooks never ran, and the
    layers computed without their weights."""
    from tritoff.skip import QUANTIZABLE_LAYERS

    first = comp.blocks[0].name
    try:
        leaf = isinstance(comp.module.get_submodule(first), QUANTIZABLE_LAYERS)  # leaf mode: layers are the blocks
    except AttributeError:
        leaf = False
    if leaf:
        return RuntimeError(
            f"{comp.name}'s forward called none of its layers ({first}, ...) but read their weights: tritoff's hooks "
            "on the layers never ran, so they had no weights; enable it with mode='model', or a budget that keeps "
            "them resident"
        )
    return RuntimeError(
        f"{comp.name}'s forward called none of its blocks ({first}, ...) but what is inside them: "
        "tritoff's hooks on the blocks never ran, so its layers had no weights; enable it with mode='leaf' (a hook on "
        "each layer) or mode='model'"
    )


def _tiling_call(name: str) -> str:
    """How to turn on tiled decoding for component ``name`` (``model``: a VAE enabled on its own)."""
    return "enable_tiling() on the VAE" if name == "model" else f"{name}.enable_tiling()"


def normal_mode():
    """Device buffers and their views are made outside inference mode whatever mode the caller runs in: tensors made
    under ``torch.inference_mode()`` could not be written, or saved for backward, by a later call in normal mode.
    Grad mode stays off, as the caller's inference mode had it (leaving inference mode turns it on)."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def outside_inference_mode(fn):
    """``fn`` run under :func:`normal_mode`: the weights, buffers and adapters it gives the modules are ordinary
    tensors whatever mode it is called in (``tritoff.enable``, ``tritoff.disable``)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with normal_mode():
            return fn(*args, **kwargs)

    return run


class _TritoffHook(ModelHook):
    """Common base: the execution device diffusers reads from ``module._hf_hook``."""

    no_grad = False

    def __init__(self, manager: HookManager, where: str):
        super().__init__()
        self.manager = manager
        self.execution_device = manager.device
        self.where = where

    def detach_hook(self, module):
        """Refuse accelerate's removal of this hook by anyone but tritoff (``remove_hook_from_module``, or the
        ``remove_all_hooks`` that diffusers' offloading starts with, called on another pipeline built from the same
        components): the module would compute with the placeholders tritoff leaves between forwards."""
        if not chain.removing(module):
            raise RuntimeError(
                f"the hook on {self.where} is tritoff's, which holds the module's weights, and accelerate would take "
                "it off (remove_hook_from_module, a pipeline's remove_all_hooks or offloading, add_hook_to_module "
                "with append=True): call tritoff.disable on the pipeline or module tritoff.enable was given first"
            )
        return module


class ComponentHook(_TritoffHook):
    """On a component's root module: pool unit, prefetch start, inputs moved to the GPU."""

    def __init__(self, manager: HookManager, component: ComponentRuntime):
        super().__init__(manager, component.name)
        self.component = component

    @torch.compiler.disable
    def pre_forward(self, module, *args, **kwargs):
        """Load what the component needs before it runs."""
        # the lock again: encode/decode run this hook alone, outside the guarded forward
        with self.manager.lock, normal_mode():
            return self.manager.component_pre(self.component, args, kwargs)

    @torch.compiler.disable
    def post_forward(self, module, output):
        """Record the call; finish the trace."""
        with normal_mode():
            self.manager.component_post(self.component)
        return output


class GroupHook(_TritoffHook):
    """On a streamed or fp8-resident block."""

    def __init__(self, manager: HookManager, group: GroupRuntime):
        super().__init__(manager, f"{group.component}.{group.name}")
        self.group = group

    @torch.compiler.disable
    def pre_forward(self, module, *args, **kwargs):
        """Wait for the block's tensors and bind them."""
        with normal_mode():
            self.manager.group_pre(self.group)
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module, output):
        """Release the block's slot."""
        with normal_mode():
            self.manager.group_post(self.group)
        return output


def _unpack_saved(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _holdings(plan: Plan) -> tuple:
    """What a phase allocates under ``plan``: plans equal in these differ only in their activation reserve."""
    return (
        plan.modes,
        plan.tiers,
        plan.ring_slots,
        plan.slot_bytes,
        plan.staging_bytes,
        plan.pool_bytes,
        plan.resident_bytes,
    )


def guard_forward(module: torch.nn.Module, manager: HookManager) -> None:
    """Wrap ``module.forward`` (already hooked) so that calls from several threads take turns (the manager's lock) and
    an exception escaping it resets the manager (:meth:`HookManager.call_guarded`) before it propagates.
    :func:`tritoff.chain.unhook` restores the original forward."""
    hooked = module.forward
    hook = getattr(module, "_hf_hook", None)
    comp = hook.component if isinstance(hook, ComponentHook) else None
    group = hook.group if isinstance(hook, GroupHook) else None

    @functools.wraps(hooked)
    def forward(*args, **kwargs):
        if module.__dict__.get("_hf_hook") is not hook and module.__dict__.get("forward") is not guarded:
            # unhooked after this call took its forward (tritoff.disable or enable from a forward pre-hook of the
            # module): the module's forward now is the one to run
            return module.forward(*args, **kwargs)
        return manager.call_guarded(hooked, args, kwargs, comp, group)

    # the wrapper itself is never traced (its try block would split graphs) but what it calls still compiles
    guarded = module.forward = torch.compiler.disable(forward, recursive=False)

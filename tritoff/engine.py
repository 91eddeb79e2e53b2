"""``tritoff.enable(pipe, ...)`` and ``tritoff.disable(pipe)``: the product users touch.

``enable`` checks its options (``tritoff/options.py``) and its target (``tritoff/preflight.py``), packs the weights
(``tritoff/packer.py``), plans each phase within the budget (``tritoff/sizing.py``, ``tritoff/planner.py``) and builds
the :class:`Engine`: the group runtimes, the hook manager and the hooks. Everything that can fail is checked before a
parameter changes; a failure after that gives the modules their weights back."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from tritoff import chain, disk, operations, preflight, torn_down
from tritoff.adapters import adapter_names, merged_adapters, move_adapters, named_parameters, outer_modules
from tritoff.allocator import warn_if_fragmenting
from tritoff.arena import HostArena
from tritoff.atomic import interrupts_held
from tritoff.budget import format_bytes
from tritoff.disk import DiskRing, spill_files
from tritoff.experts import expert_shares
from tritoff.formats import get_format
from tritoff.groups import Group, group_label, is_block, is_host
from tritoff.host_default import host_by_default
from tritoff.host_lookup import HostLookupHook, HostTable, host_views
from tritoff.host_plan import hold_plan
from tritoff.kernels import upcast as upcast_kernels
from tritoff.manager import (
    PLANNED_METHODS,
    ComponentHook,
    ComponentRuntime,
    GroupHook,
    HookManager,
    guard_forward,
    outside_inference_mode,
    planned_method,
)
from tritoff.onload import (
    GroupRuntime,
    is_placeholder,
    parameter_homes,
    placeholder,
    reset_placeholders,
    shared_versions,
)
from tritoff.options import Options, check_device, same_skip
from tritoff.options import resolve as resolve_options
from tritoff.pack import PackLayout
from tritoff.packer import (
    Pack,
    PackedModel,
    arena_holding,
    hold_packs,
    pack_model,
    pack_offsets,
    plan_layouts,
    quantize_device,
    restore_params,
)
from tritoff.packer import dequantized as _dequantized  # a module name of its own: tests watch what disable reads
from tritoff.planner import ComponentSize, PhasedPlan, Plan, plan
from tritoff.preflight import ENGINE_ATTR, ENGINES
from tritoff.rehold import rehold
from tritoff.report import Report
from tritoff.sizing import (
    check_callable,
    check_weight_hooks,
    groups_for,
    hooked_modules,
    looped,
    plan_for,
    sizes_of,
)
from tritoff.skip import SkipRules, skip_patterns, warn_unmatched
from tritoff.snr import LOST_DB
from tritoff.storage import describe_storage, resolve_storage
from tritoff.warn import warn

# buffers of the disk ring: one is read while the other is copied to the GPU
RING_BUFFERS = 2


class Engine:
    """What :func:`enable` returns: the plan, the counters, the report. ``disable`` undoes it."""

    def __init__(
        self,
        target,
        components: dict[str, nn.Module],
        options: Options,
        packed: dict[str, PackedModel],
        sizes: list[ComponentSize],
        the_plan: PhasedPlan,
        group_lists: dict[str, list[Group]],
        snr: dict,
        chunks: dict[str, int],
        auto_reserve: bool = False,
    ):
        self.target = target
        self.chunks = chunks
        self.auto_reserve = auto_reserve
        self.requires_grad: dict[tuple[str, str], bool] = {}
        self.adapters: dict[str, frozenset[str]] = {}  # each component's peft adapters when its flags were saved
        self.components = components
        self.options = options
        self.packed = packed
        self.sizes = sizes
        self.plan = the_plan
        self.snr = snr
        # weights written back into their packs by fusing or unfusing an adapter: name -> ("fuse"|"unfuse", SNR)
        self.requantized: dict[str, tuple[str, float]] = {}
        self._group_lists = group_lists
        # the parameters tritoff manages, by component and name: disable restores these objects, so one a caller put
        # in a module's place after enable (refused at the next forward) stays theirs, untouched
        self._own_params = {name: dict(named_parameters(module)) for name, module in components.items()}
        self._hooked: list[nn.Module] = []
        self._installed: dict[int, Callable] = {}  # id(module) -> the forward tritoff installed on it
        self._unhooked: list[nn.Module] = []  # what teardown unhooked: disable gives their forwards back
        self._host_views: set[int] = set()  # ids of the tables pointed at their packs' host bytes (host lookups)
        self._runtimes: list[ComponentRuntime] = []
        self._released = False  # disable dropped the packs
        self.manager: HookManager | None = None
        self.disk: DiskRing | None = None
        self.loops = {name: looped(name) for name in components}  # whether a component is called at every step
        self.shares: dict[str, float] | None = None  # the steps' share of each of two experts (host placement)
        self.reheld_bytes = 0  # read from disk moving packs into host memory after re-plans (rehold.py)
        self.rehold_failed = False  # a move failed (a full disk, a read error): the packs stay as placed from then on
        self._torn_down = False
        self._guards: list | None = None  # what teardown leaves refusing to run its placeholders (torn_down.py)

    # building -----------------------------------------------------------------------------------------------------
    def _use_triton(self) -> bool:
        from tritoff.kernels import triton_runs_on

        # kernels='triton' where Triton cannot run was refused by options.resolve
        return self.options.kernels != "reference" and triton_runs_on(self.options.device)

    def _build_runtime(self) -> None:
        """Group runtimes, the manager and the hooks; nothing is uploaded until a phase is first entered."""
        opts, device = self.options, self.options.device
        use_triton = self._use_triton()
        zero_copy = opts.transport == "zero_copy"
        sizes = {s.name: s for s in self.sizes}
        self.disk = self._disk_ring()
        runtimes = []
        for name, module in self.components.items():
            packed = self.packed[name]
            params_by_name = self._own_params[name]
            homes = parameter_homes(module)
            phase = self.plan.phases[name]
            comp = ComponentRuntime(name, module, phase, looped(name))
            split = bool(sizes[name].blocks)
            tiers = phase.tiers.get(name, {})
            chunk = self.chunks[name]
            for pack, group in zip(packed.packs, self._group_lists[name], strict=True):
                params = [params_by_name[n] for n, _ in group.params]
                places = [homes[id(p)] for p in params]
                if is_host(group):  # a lookup table that never leaves the host arena
                    for param, view in zip(params, host_views(pack), strict=True):
                        param.data = view
                        self._host_views.add(id(param))
                    comp.host.append(HostTable(name, group, params, places))
                    continue
                # a pack moved after a re-plan (rehold.py) may lie in another component's arena: a re-enable finds it
                host = self.disk.arena if pack.on_disk else arena_holding(self.packed, pack)
                triton = use_triton and pack.layout.out_dtype in upcast_kernels.OUT_DTYPES  # else the reference
                g = GroupRuntime(name, pack, packed, params, places, device, triton, zero_copy, chunk, host)
                if split and is_block(group):
                    g.tier = "bf16" if phase.modes[name] == "resident" else tiers[g.name]
                    comp.blocks.append(g)
                else:  # the rest of a split component, or any group of a whole-moving one
                    g.tier = "pool"
                    comp.unit.append(g)
                comp.groups.append(g)
            comp.note_disk()
            runtimes.append(comp)
        _share_versions(runtimes)
        for comp in runtimes:
            for g in comp.groups:
                g.release()
        self._runtimes = runtimes
        self.manager = HookManager(
            device,
            runtimes,
            self.plan,
            opts.prefetch,
            replan=self._replan,
            auto_reserve=self.auto_reserve,
            disk=self.disk,
            replanned=self._rehold,
        )
        for comp in runtimes:
            _move_buffers(comp.module, device)
            move_adapters(comp.module, device)
            modules = outer_modules(comp.module)  # an adapted leaf layer: its hook goes around the adapter too
            groups = [group for group in self._group_lists[comp.name] if not is_host(group)]
            for group, g in zip(groups, comp.groups, strict=True):
                if g in comp.blocks:
                    self._hook(modules[group.modules[0][0]], GroupHook(self.manager, g))
            for table in comp.host:  # on the layer itself: an adapter around it looks its own table up on the device
                for _, reader in table.group.modules:  # each layer once (named_modules skips repeats)
                    self._hook(reader, HostLookupHook(device))
            self._hook(comp.module, ComponentHook(self.manager, comp))

    def _disk_ring(self) -> DiskRing | None:
        """The bounce ring packs served from disk are read into, made by ``enable`` before any weight changed, or now
        (a re-plan, whose previous engine's ring is gone by then); None when the host budget holds every pack. Its
        counters name each pack's component."""
        on_disk = _packs_on_disk(self.packed, self._group_lists)
        ring = self.disk
        if ring is None:
            ring = make_disk_ring(self.options, [pack.layout for _, pack in on_disk])
        if ring is not None:
            ring.owners = {id(pack): name for name, pack in on_disk}
            if self.options.device.type == "cuda":
                ring.arena.register()  # page-locked now that packing is done (already, for zero-copy reads)
        return ring

    def _replan(self, name: str, reserve: int) -> Plan:
        """The phase of component ``name`` planned again with activation reserve ``reserve``."""
        size = next(s for s in self.sizes if s.name == name)
        opts = self.options
        return plan([size], opts.budget, opts.mode, opts.prefetch, reserve, opts.staged, None, self.plan.fixed_bytes)

    def _rehold(self, name: str) -> None:
        """After component ``name``'s phase was planned again: the packs the host budget holds placed again."""
        rehold(self, name)

    def _hook(self, module: nn.Module, hook) -> None:
        self._hooked.append(module)  # first: a teardown after an interruption in the middle unhooks it too
        self._installed[id(module)] = chain.hook_innermost(module, hook, lambda m: guard_forward(m, self.manager))
        if isinstance(hook, GroupHook):
            hook.group.hooked = (module, hook)
        operations.compile_inside_hooks(module)  # compiled before enable: its compiled call would hold the hooks

    def move_hook(self, src: nn.Module, dst: nn.Module) -> None:
        """Move a leaf layer's hook to the module its parent now calls: peft wrapped it in a tuner layer (whose
        adapter may read the base weights outside the base layer's forward), or unwrapped it again."""
        hook = src._hf_hook
        operations.remove_block(src)
        chain.unhook(src, self._installed.pop(id(src), None))
        self._hooked.remove(src)
        self._hook(dst, hook)
        operations.install_block(dst)

    # public -------------------------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters per component and in total, as data (see :meth:`report`)."""
        return Report(self).data()

    @property
    def managed_ids(self) -> set[int]:
        """The ids of the parameters whose weights tritoff holds (not adapters, not parameters added since)."""
        return {id(p) for params in self._own_params.values() for p in params.values()}

    def report(self) -> str:
        """A readable table: plan, bytes moved, onloads, synchronous fallbacks, stalls, memory, worst layers."""
        return Report(self).text()

    @host_by_default
    def save(self, directory, overwrite: bool = False) -> None:
        """Write the packs as a store that ``enable(..., store=directory)`` reads instead of quantizing again.

        ``directory`` must be new or empty; an existing store is replaced only with ``overwrite``."""
        from tritoff.store import save_store

        if self._released:
            raise RuntimeError(
                "engine.save: this engine no longer holds packs (tritoff.disable released them, or enable again "
                "handed them to the engine it returned); save the pipeline's current engine, before disable"
            )
        grouping = "leaf" if self.options.mode == "leaf" else "block"
        save_store(directory, self.fingerprints, self.packed, self.options.skip, grouping, overwrite=overwrite)

    def _release_packs(self) -> None:
        """After disable, whose modules hold their weights again: drop the packs (the host arena, spill and store
        files) and the runtime that refers to them, so an engine still referenced (a notebook's output) does not keep
        a second copy of the model in host memory. Its report and stats stay readable."""
        self.packed, self._runtimes, self._released = {}, [], True
        self.__dict__.pop("_param_places", None)  # lora's index of the runtime's groups

    def teardown(self) -> None:
        """Remove every hook and release every GPU buffer (slots, staging, pool units, resident tiers, cached views,
        kernel tables); parameters are left pointing at placeholders, so a forward is refused until
        ``tritoff.disable`` (ordinary modules again) or ``tritoff.enable`` (tritoff again).

        Done once: on an engine already torn down (disabled, or replaced by enabling the pipeline again) it does
        nothing, so it never touches the modules another engine now manages."""
        if self._torn_down:
            return
        self._teardown()
        self._guards = torn_down.guard(self)

    def _teardown(self) -> None:
        """:meth:`teardown` for disable and enable, which give the modules weights or hooks right after: no guard.
        It waits for a forward running on another thread (the manager's lock)."""
        torn_down.unguard(self, self._guards)  # a torn-down engine's refusals go once the modules are taken over
        self._guards = None
        if self._torn_down:
            return
        # done whole once the lock is taken (a Ctrl-C while waiting for it stops the wait): a Ctrl-C landing in the
        # middle would leave half of it for the next teardown
        with self.manager.lock if self.manager is not None else contextlib.nullcontext(), interrupts_held():
            self._release_everything()

    def _release_everything(self) -> None:
        from tritoff import lora

        self._torn_down = True
        try:
            lora.detach(self, unwrap=False)
            blocks = [m for m in self._hooked if isinstance(getattr(m, "_hf_hook", None), GroupHook)]
            operations.remove(self.target, self.components, blocks, also=PLANNED_METHODS)
            replaced = [m for m in self._hooked if not chain.unhook(m, self._installed.get(id(m)))]
            self._unhooked, self._hooked, self._installed = [*self._unhooked, *self._hooked], [], {}
            if replaced:
                warn(_forward_replaced(self, replaced))
            if self.options.device.type == "cuda":
                torch.cuda.synchronize(self.options.device)
            if self.manager is not None:
                self.manager.release()
            for comp in self._runtimes:
                for g in comp.groups:
                    g.drop_device_state()
            self.manager = None
            if self.disk is not None:
                self.disk.close()
                self.disk = None
        except BaseException:
            # not done: the next teardown (disable, a failed enable giving the weights back) does it all again, each
            # step a no-op where it was done already; with the hooks gone, forwards are refused until then (they
            # would compute with placeholders)
            self._torn_down = False
            if not self._hooked and self._guards is None:
                with contextlib.suppress(Exception):
                    self._guards = torn_down.guard(self)
            raise


def _share_versions(runtimes: list[ComponentRuntime]) -> None:
    """Tell each group which of its parameters share an autograd version counter with other managed parameters
    (views of one tensor: :func:`tritoff.onload.shared_versions`), so that a count its release adds to one is
    theirs too, not a write of the caller's to refuse. ``runtimes`` (an engine being built) are looked at with the
    weights of every other enabled engine, which may share their counters (one state dict loaded into two models):
    only the new engine's counters are marked, the others' read, and the others' groups learn of the new sharers."""
    own = _counted(runtimes)
    others = _counted(
        comp for engine in preflight.enabled_engines() if not engine._torn_down for comp in engine._runtimes
    )
    holders, mine = own + others, len(own)
    for indices in shared_versions([p for _, _, p in own], [p for _, _, p in others]):
        for a in indices:
            holder, i, _ = holders[a]
            if not isinstance(holder, GroupRuntime):  # a host table releases nothing
                continue
            # a group of the new engine learns of every sharer, another engine's of the new engine's (it knew the rest)
            new = [(weakref.ref(holders[b][0]), holders[b][1]) for b in indices if b != a and (a < mine or b < mine)]
            # a new dict, not changed in place: a release running meanwhile on another thread reads one or the other
            holder.shared_versions = {**holder.shared_versions, i: [*holder.shared_versions.get(i, ()), *new]}


def _counted(runtimes) -> list[tuple]:
    """(group or host table, index, parameter) of every managed parameter of ``runtimes``."""
    return [(h, i, p) for comp in runtimes for h in (*comp.groups, *comp.host) for i, p in enumerate(h.params)]


def _forward_replaced(engine: Engine, modules: list[nn.Module]) -> str:
    """What a teardown says of hooked ``modules`` whose forward was replaced after enable (:func:`chain.unhook`)."""
    where = ", ".join(preflight.name_in(engine, m) or type(m).__name__ for m in modules)
    return (
        f"{where}: forward was replaced after tritoff.enable (tritoff's hook no longer ran in it); tritoff put back "
        "the forward it had hooked: replace it again now, or before tritoff.enable"
    )


def _spill_path(directory) -> Path:
    """Where spill files go for ``spill_dir=directory`` (None: the default), resolved."""
    return (Path(directory).expanduser() if directory is not None else disk.default_spill_dir()).resolve()


def _spills_elsewhere(previous: Engine, directory) -> bool:
    """Whether the enabled ``previous`` engine spilled packs to a directory other than ``directory``: a re-plan keeps
    them where they are."""
    spilled = any(p.on_disk and p.file.spill for packed in previous.packed.values() for p in packed.packs)
    return spilled and _spill_path(directory) != _spill_path(previous.spill_dir)


def _check_unchanged(engine: Engine) -> None:
    """Refuse a weight of ``engine`` replaced, changed or gone since it was enabled. A function of its own: a loop
    variable left in ``enable`` naming a runtime would keep its packs past the disable a re-pack starts with."""
    for comp in engine._runtimes:
        comp.check_unchanged()


def _spill_files_of(engine: Engine) -> list[disk.PackFile]:
    """The spill files ``engine``'s packs are in (each once)."""
    files = {id(p.file): p.file for packed in engine.packed.values() for p in packed.packs if p.on_disk}
    return [f for f in files.values() if f.spill]


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)


@outside_inference_mode
@host_by_default
def enable(
    target,
    storage: str | dict[str, str] | None = None,
    mode: str | None = None,
    budget: int | str | None = None,
    *,
    device: str | torch.device | None = None,
    granularity: str | None = None,
    skip: str | tuple[str, ...] | list[str] | None = None,
    prefetch: int = 2,
    transport: str = "auto",
    reserve: int | str | None = None,
    kernels: str = "auto",
    store: str | None = None,
    verify: bool = True,
    progress: bool = True,
    host_budget: int | str | None = None,
    spill_dir: str | None = None,
) -> Engine:
    """Store ``target``'s weights off-GPU in ``storage`` and run it within ``budget`` of GPU memory.

    ``target`` is a diffusers pipeline or an ``nn.Module``. ``mode``: ``"auto"`` (default: everything resident when it
    fits, else the planner splits large components; with a store of leaf groups, ``"leaf"``), ``"model"``,
    ``"group"`` or ``"leaf"``. ``budget``: bytes,
    ``"12GB"``, ``"12GiB"`` or ``"80%"`` (default: the device's free memory less 5% of it or 512 MiB, whichever is
    more). ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (default: CUDA when available). ``progress``: progress
    bars while packing and placing the weights. ``prefetch``: groups in flight ahead of the running one.
    ``transport``: ``"staged"`` (copy engine then HBM upcast; what ``"auto"`` picks) or ``"zero_copy"``. ``reserve``:
    memory kept for activations (default: traced per phase from its call's shapes, 10% of the budget until then).
    ``granularity``: fp8 scales per ``"row"`` (default), ``"tensor"``, or ``"none"``.
    ``skip``: extra regexes of module names to keep unquantized (searched case-insensitively in their qualified
    names; default: none). ``kernels``: ``"auto"``, ``"triton"`` or ``"reference"`` (PyTorch).
    ``storage``: a format for the text encoders, image encoders and denoisers (default ``"fp8_e4m3"``; VAEs keep
    their own dtype), or ``{component: format}`` (the others get those defaults). ``store``: a directory written by
    ``Engine.save`` / ``tritoff convert`` whose packs are read instead of quantizing (its storage, granularity and
    skip patterns apply); every store file is checked against the hashes its index records unless ``verify=False``
    (for stores verified elsewhere), and a store of other weights than the pipeline holds is refused.
    ``host_budget``: host memory the packs may hold (bytes, ``"16GB"``, ``"50%"`` of
    RAM, or 0; default: all of them): the planner holds the packs read most often (a denoiser's streamed blocks) and
    the rest are read from disk when needed, through a small page-locked ring read ahead on a thread; from the store
    when there is one, else from a private spill file written into ``spill_dir`` (default
    ``$XDG_CACHE_HOME/tritoff``, else ``~/.cache/tritoff``).

    Raises ``ValueError`` (one line, saying what to do) on bad options, a budget too small (naming the smallest that
    works), a pipeline already carrying accelerate/diffusers hooks, or weights another engine manages or two components
    share; each is checked before a weight changes, so such a failure leaves ``target`` as it was. A failure after
    packing began (Ctrl-C, the GPU out of memory while the packs are placed) leaves ordinary modules holding their
    weights as the packs hold them, rounded to the storage format, and warns. Enabling an enabled pipeline re-plans it,
    reusing its packs: ``storage``, ``granularity``, ``skip`` and ``host_budget`` left out keep what it was packed and
    placed with, and other values are refused (the original weights are gone; so are a store packed otherwise and a
    component replaced or restructured since: disable first).
    """
    for flag, value in (("verify", verify), ("progress", progress)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag} must be True or False, got {value!r}")
    upcast_kernels.check_programs(upcast_kernels.UPCAST_PROGRAMS, "UPCAST_PROGRAMS")  # read again by each group
    components = preflight.components_of(target)
    previous: Engine | None = getattr(target, ENGINE_ATTR, None)
    given_spill_dir = spill_dir  # this call's: only it is warned about
    if previous is not None:
        preflight.check_not_in_a_call(previous, "enable")
    preflight.check_components(components, previous)
    preflight.check_not_managed_elsewhere(components, previous)
    if previous is None:
        preflight.check_no_foreign_hooks(components)
        preflight.check_not_inference(components)
        preflight.check_packable(components)
        preflight.check_no_vae_upcast(target, components)
    from tritoff.fingerprint import fingerprint

    # taken before any parameter changes (and reused on re-plans, when parameters hold placeholders)
    fingerprints = previous.fingerprints if previous is not None else {n: fingerprint(m) for n, m in components.items()}
    if store is not None:
        storage, granularity, skip, mode = _store_settings(store, components, storage, granularity, skip, mode)
    if previous is not None:  # what is left out keeps what the enabled engine packed with and placed
        storage = previous.options.storage if storage is None else storage
        granularity = previous.options.granularity if granularity is None else granularity
        skip = previous.options.skip if skip is None else skip
        host_budget = previous.options.host_budget if host_budget is None else host_budget
        spill_dir = previous.spill_dir if spill_dir is None else spill_dir
    elif granularity is None:
        granularity = "row"
    options = resolve_options(
        components, storage, granularity, skip, mode, budget, reserve, device, prefetch, transport, kernels, host_budget
    )
    if options.device.type == "cpu":
        warn("no CUDA device: tritoff packs and upcasts weights but offloads nothing")
    elif options.device.type == "cuda":
        warn_if_fragmenting()
    if given_spill_dir is not None and (options.host_budget is None or store is not None):
        why = "every pack is held in memory" if options.host_budget is None else "the store's packs are read from it"
        warn(f"spill_dir is used only with host_budget and without store ({why}): ignored")
    elif given_spill_dir is not None:  # refused now even if nothing spills yet (re-enabled in other groups, it may)
        from tritoff.disk import spill_directory

        spill_directory(given_spill_dir, create=False)  # made when something spills: a failed enable leaves nothing
    if previous is not None:
        options = _packed_alike(previous, options, components, store)
    # re-planning keeps the packs; switching to or from leaf groups re-packs, which is exact: quantizing a
    # dequantized pow2-scaled row gives back the same values (its scale may halve and its codes double, where the
    # row's largest value had rounded up to a power of two times the format's largest)
    reuse = previous is not None and (previous.options.mode == "leaf") == (options.mode == "leaf") and store is None
    if previous is not None and options.host_budget != previous.options.host_budget:
        raise ValueError(
            "host_budget cannot change while tritoff is enabled (the packs stay where they were placed); "
            "call tritoff.disable(pipe) first, or leave host_budget out to keep it"
        )
    if reuse and given_spill_dir is not None and _spills_elsewhere(previous, given_spill_dir):
        raise ValueError(
            f"spill_dir cannot change while tritoff is enabled (the packs beyond the host budget stay in "
            f"{_spill_path(previous.spill_dir)}); call tritoff.disable(pipe) first, or leave spill_dir out to keep it"
        )
    fmts = {name: get_format(fmt) for name, fmt in options.storage.items()}
    if previous is not None:  # a weight replaced, changed or gone since: refused now, before anything changes
        _check_unchanged(previous)
        preflight.check_still_there(components, previous)
    if reuse:
        group_lists = previous._group_lists
        layouts = {n: [p.layout for p in previous.packed[n].packs] for n in components}
    elif store is not None:
        from tritoff.loading import check_built_for
        from tritoff.store import check_packs, check_weights, load_store

        for name, module in components.items():
            preflight.check_fillable(module, name)
        check_built_for(components, store)
        group_lists = {n: groups_for(m, options.mode) for n, m in components.items()}
        stored = load_store(store, components, group_lists, fingerprints, verify=verify)
        layouts = {n: [p.layout for p in stored[n].packs] for n in components}
    else:
        group_lists = {n: groups_for(m, options.mode) for n, m in components.items()}
        layouts = {}
        if previous is None:
            warn_unmatched(options.skip, {n: m for n, m in components.items() if fmts[n].is_fp8})
        for name, module in components.items():
            quantized = SkipRules.for_model(module, options.skip).quantized_names(module)
            if previous is None:  # else placeholders: the weights come back from packs that hold finite values
                preflight.check_loaded(module, name)
                preflight.check_finite(module, quantized, name)
            layouts[name] = plan_layouts(group_lists[name], quantized, fmts[name], options.granularity, name)
    if options.kernels == "triton":
        _check_kernel_dtypes(layouts, group_lists)
    sizes = sizes_of(components, group_lists, layouts, options.mode)
    check_callable(components, sizes)
    hooked = hooked_modules(components, group_lists, sizes)
    check_weight_hooks(hooked, components)
    operations.check_compiled(hooked, components)
    operations.check_compiled_wrappers(preflight.wrapped_components(target))
    the_plan, chunks = plan_for(sizes, group_lists, layouts, components, options, fixed_groups=store is not None)
    loops = {name: looped(name) for name in components}
    shares = expert_shares(target) if options.host_budget is not None and not reuse else None
    in_ram = None if reuse else hold_plan(group_lists, layouts, the_plan, loops, options.host_budget, shares)
    if store is not None:
        # the packs the host budget holds are read (and checked) now, before anything changes; the rest stay on disk
        for name, packed_model in stored.items():
            hold_packs(
                packed_model,
                in_ram and in_ram[name],
                register=options.device.type == "cuda",  # a CPU engine on a CUDA machine locks nothing
                progress=progress,
                desc=f"reading {name}",
            )
            for pack, group in zip(packed_model.packs, group_lists[name], strict=True):
                if pack.on_disk and is_host(group):  # a lookup table, mapped later: checked now, read once
                    pack.file.check(pack)
        check_weights(store, components, stored)
        if previous is not None:  # placeholders: the weights are the enabled engine's packs
            check_packs(store, previous.packed, stored, progress=progress)
        preflight.check_zero_copy(options, stored)
    kept, spills = {}, {}
    if not reuse and store is None:
        # the packs beyond the host budget go to spill files, made (and their disk checked) before anything changes
        for name in components:
            pairs = zip(group_lists[name], layouts[name], strict=True)
            kept[name] = [lay for g, lay in pairs if in_ram is None or g.name in in_ram[name]]
        spilled = {n: sum(lay.nbytes for lay in layouts[n]) - sum(lay.nbytes for lay in kept[n]) for n in components}
        # a re-enable packing again disables first, which frees the enabled engine's spill files (not named here: a
        # reference kept to them would keep them, and their disk space, past that disable)
        spills = spill_files(spill_dir, spilled, freed=_spill_files_of(previous) if previous is not None else [])
    ring = None  # the disk ring: made now, where it can still be refused, except on a re-plan (see _disk_ring)
    if reuse:
        _lock_for(options, previous.packed)
    else:
        on_disk = _disk_layouts(group_lists, layouts, in_ram, stored if store is not None else None)
        ring = make_disk_ring(options, on_disk)
    # everything that can fail is checked before a parameter changes: from here on the pipeline is modified
    carried = None
    if previous is not None and not reuse:
        # other groups (leaf <-> block), or a store: pack again from the weights, restored on the host
        if store is None:  # packed again exactly: the SNR against the original weights, and LoRA fusing, still hold
            carried = (previous.snr, previous.requantized)
        try:
            disable(target, device="cpu")
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        previous = None
    # from here until the engine is installed, a failure (Ctrl-C included) gives the weights back: from the engine
    # (the previous one until the new one exists, on a re-plan), else from the packs this call made; from a store,
    # the flags set so far
    packed, engine, requires_grad, made = None, None, {}, {}
    try:
        if reuse:
            packed, snr = previous.packed, previous.snr
            requires_grad, requantized = previous.requires_grad, previous.requantized
            previous._teardown()
            for module in previous._unhooked:  # the new plan may hook fewer (group -> model): none keeps our forward
                operations.restore_forward(module)
            previous._release_packs()  # they are the new engine's: a disable of it must free them, however held
        elif store is not None:
            _freeze(components, requires_grad)
            for module in components.values():
                _replace_meta_params(module, options.device)
            packed, snr = stored, {}
        else:
            packed, snr = _pack_components(
                components, options, fmts, group_lists, layouts, kept, in_ram, spills, progress, requires_grad, made
            )
            if carried is None:  # a re-pack's figures are against weights quantized once, warned of then
                _warn_lost_weights(snr)
        if carried is not None:  # measured now against weights already quantized once: every layer would read inf dB
            snr = {**snr, **{k: v for k, v in carried[0].items() if k in snr}}
            requantized = carried[1]
        engine = Engine(target, components, options, packed, sizes, the_plan, group_lists, snr, chunks, reserve is None)
        engine.disk = ring
        engine.shares = shares if not reuse else previous.shares
        engine.fingerprints = fingerprints
        # where packs beyond the host budget go when a re-enable packs again: resolved now, as a relative path means
        engine.spill_dir = str(_spill_path(spill_dir)) if spill_dir is not None else None
        engine.requires_grad = requires_grad
        engine.adapters = previous.adapters if reuse else {n: adapter_names(m) for n, m in components.items()}
        if reuse or carried is not None:
            engine.requantized = requantized
        if reuse:  # the tables still view the packs this engine takes over
            engine._host_views = previous._host_views
        engine._build_runtime()
        _install(engine)
    except BaseException:
        if engine is None and reuse:  # its packs may have been handed over already
            previous.packed = previous.packed or packed
            engine = previous
        if engine is not None:
            # a failure while placing the packs (an out-of-memory GPU, Ctrl-C): leave ordinary modules holding the
            # (dequantized) weights rather than placeholders, on the CPU if the device has no room for them; what
            # _install shadowed goes with the teardown
            try:
                given = _restore(engine, options.device, released_only=True)
            except BaseException:
                given = _restore(engine, torch.device("cpu"), released_only=True)
            # weights released by this call (not a re-plan's, rounded to their packs before) come back rounded
            _warn_rounded([] if reuse or carried is not None else [n for n in components if n in given], fmts)
        else:  # the packs made so far, by component (none from a store): each released group gets its weights back
            rounded = [] if carried is not None else [n for n, packs in made.items() if packs]
            _weights_back(components, group_lists, made, requires_grad, rounded, fmts)
        if ring is not None:  # closed by the engine's teardown if it took it (closing again does nothing)
            ring.close()
        if hasattr(target, ENGINE_ATTR):  # a re-plan: the previous engine was torn down already
            delattr(target, ENGINE_ATTR)
        raise
    if reuse and options.device.type != "cuda":
        # the packs a GPU engine page-locked for its copies: an engine on the CPU makes none, so they are unlocked now
        # that nothing of the GPU engine runs (closing waits for copies still reading them, and keeps the packs)
        for packed_model in packed.values():
            packed_model.arena.close()
    return engine


def _disk_layouts(group_lists, layouts, in_ram, stored) -> list[PackLayout]:
    """The layouts of the packs that will be served from disk: those of ``stored`` (a store's packs, once the host
    budget's are read) left on disk, else those the host budget does not hold (``in_ram``); lookup tables aside,
    which are mapped, not read through the ring."""
    if stored is not None:
        return [pack.layout for _, pack in _packs_on_disk(stored, group_lists)]
    if in_ram is None:
        return []
    return [
        layout
        for name, groups in group_lists.items()
        for group, layout in zip(groups, layouts[name], strict=True)
        if group.name not in in_ram[name] and not is_host(group)
    ]


def _packs_on_disk(packed: dict[str, PackedModel], group_lists: dict) -> list[tuple[str, Pack]]:
    """(component, pack) of every pack served from disk through the ring (lookup tables are mapped instead)."""
    return [
        (name, pack)
        for name, model in packed.items()
        for pack, group in zip(model.packs, group_lists[name], strict=True)
        if pack.on_disk and not is_host(group)
    ]


def _lock_for(options: Options, packed: dict[str, PackedModel]) -> None:
    """Before a re-enable reuses ``packed``: on a GPU, page-lock the arenas a CPU engine made (copies from pageable
    memory wait for the GPU; zero-copy reads cannot run at all), trying again those whose lock failed (memory may
    have been freed since). Refused for zero-copy where one cannot be locked, the arenas locked here unlocked again:
    the enabled engine stays as it was."""
    locked = []
    if options.device.type == "cuda":
        for packed_model in packed.values():
            arena = packed_model.arena
            if not arena.registered:
                arena.register()
                if arena.registered:
                    locked.append(arena)
    try:
        preflight.check_zero_copy(options, packed)
    except BaseException:
        for arena in locked:
            arena.close()  # unlocks it; its packs stay where they are
        raise


def make_disk_ring(options: Options, on_disk: list[PackLayout]) -> DiskRing | None:
    """The disk ring for packs of layouts ``on_disk`` (None when there are none): two buffers the size of the largest,
    one read while the other is copied to the GPU. Refused in one line where zero-copy reads cannot page-lock it;
    otherwise it is page-locked once the packs are made (:meth:`Engine._disk_ring`): locking faults in every page,
    which would add the ring to the host memory packing holds at its peak, the original weights still there."""
    if not on_disk:
        return None
    ring = DiskRing(
        RING_BUFFERS,
        max(layout.nbytes for layout in on_disk),
        register=options.reads_host_directly,
        threaded=options.device.type == "cuda" or disk.READ_AHEAD_ON_CPU,
        owners={},
        device=options.device,
    )
    if options.reads_host_directly and not ring.arena.registered:
        ring.close()
        raise ValueError(
            f"transport='zero_copy' needs page-locked host memory, and the disk ring could not be locked "
            f"({ring.arena.register_error}); use transport='staged', or free host memory"
        )
    return ring


def _pack_components(
    components, options: Options, fmts, group_lists, layouts, kept, in_ram, spills, progress, requires_grad: dict, made
):
    """Pack every component (``kept``: the layouts of the packs held in the host arena, ``spills``: the files for the
    rest), releasing the original weights as each group is packed; returns the packs and the SNR of each quantized
    weight. Fills ``requires_grad`` with the parameters' flags (as it clears them) and ``made`` with each component's
    packs as they are made, from which the caller gives the weights back if the enable stops, here or later."""
    # zero-copy cannot run without page-locked packs: lock now, refusing before anything changes if that fails;
    # otherwise pack_model locks each arena once its packs are written (locking faults in every page at once)
    arenas = {name: HostArena(pack_offsets(kept[name])[1], register=options.reads_host_directly) for name in components}
    preflight.check_zero_copy(options, arenas)
    _freeze(components, requires_grad)
    packed, snr = {}, {}
    quantize_on = quantize_device(options.device)
    try:
        for name, module in components.items():
            stats: dict[str, float] = {}
            packed[name] = pack_model(
                module,
                fmts[name],
                granularity=options.granularity,
                skip=options.skip,
                groups=group_lists[name],
                release=True,
                progress=progress,
                snr=stats,
                layouts=layouts[name],
                desc=f"packing {name}",
                arena=arenas[name],
                register=options.device.type == "cuda",  # a CPU engine on a CUDA machine locks nothing
                held=in_ram and in_ram[name],
                spill=spills.get(name),
                quantize_on=quantize_on,
                made=made.setdefault(name, []),
            )
            snr.update({f"{name}.{k}": v for k, v in stats.items()})
    finally:
        if quantize_on.type == "cuda":
            with torch.cuda.device(quantize_on):  # empty_cache acts on the current device
                torch.cuda.empty_cache()  # quantizing's scratch: give it back before the budget's buffers are made
    return packed, snr


def _weights_back(components, group_lists, made: dict[str, list[Pack]], requires_grad, packed_now: list[str], fmts):
    """After an enable stopped once packing began: the released groups get their weights back from the packs
    ``made`` so far (by component, in the order of ``group_lists``; a component stopped midway has fewer) and every
    parameter its ``requires_grad`` flag; warns that ``packed_now`` (components this call packed, their originals
    released) hold what their fp8 packs hold."""
    for name, packs in made.items():
        for group, pack in zip(group_lists[name], packs, strict=False):
            restore_params(group, pack)
    params = {n: dict(named_parameters(module)) for n, module in components.items()}
    for (n, pname), flag in requires_grad.items():
        params[n][pname].requires_grad_(flag)
    _warn_rounded(packed_now, fmts, " packed so far")


def _warn_rounded(names: list[str], fmts, which: str = "") -> None:
    """Warn that the fp8 components among ``names``, their original weights released, hold what their packs hold."""
    rounded = [n for n in dict.fromkeys(names) if fmts[n].is_fp8]
    if rounded:
        warn(
            f"enable stopped: the weights of {', '.join(rounded)}{which} are back as their fp8 packs hold them (the "
            "originals were released as they were packed); reload the pipeline for the original weights"
        )


def _store_settings(store, components: dict[str, nn.Module], storage, granularity, skip, mode):
    """The storage, granularity and skip patterns of the store at ``store``, which apply to ``components``, and the
    mode (``mode`` left out: leaf for a store of leaf groups); the values given for them and ``mode`` are refused,
    before anything changes, where they disagree with the store."""
    from tritoff.store import component_storages, read_index

    index = read_index(store)
    for name, module in components.items():
        fused = merged_adapters(module)
        if fused:
            raise ValueError(
                f"{name} has LoRA adapters fused into its weights ({', '.join(fused)}) but the store at {store} "
                "holds weights without them: unfuse_lora() before enable(store=...), or enable without store="
            )
    held = {n: f for n, f in component_storages(index).items() if n in components}
    if storage is not None:
        wanted = resolve_storage(storage, components)
        for name in held:
            if wanted[name] != held[name]:
                raise ValueError(
                    f"storage for {name} is {wanted[name]} but the store at {store} holds {held[name]}; drop "
                    "storage= (the store's applies)"
                )
    if granularity is not None and granularity != index["granularity"]:
        raise ValueError(
            f"granularity={granularity!r} but the store at {store} was packed with {index['granularity']!r}; drop "
            "granularity= (the store's applies)"
        )
    if skip is not None and not same_skip(components, held, skip_patterns(skip), tuple(index["skip"])):
        raise ValueError(
            f"skip={list(skip_patterns(skip))} but the store at {store} was packed with skip={index['skip']}; "
            "drop skip= (the store's applies)"
        )
    if mode is None and index["grouping"] == "leaf":  # left out: the mode the store's groups were made for
        mode = "leaf"
    if (mode == "leaf") != (index["grouping"] == "leaf"):
        fits = "mode='leaf'" if index["grouping"] == "leaf" else "mode='group', 'auto' or 'model'"
        raise ValueError(f"the store at {store} was made with {index['grouping']} groups: use {fits} with it")
    return held, index["granularity"], tuple(index["skip"]), mode


def _packed_alike(previous: Engine, options: Options, components: dict[str, nn.Module], store) -> Options:
    """``options`` for enabling again over ``previous``, whose original weights are gone: refused in one line unless
    they pack as it did (the same storage, granularity and skipped modules)."""
    before, now = previous.options, options
    if (before.storage, before.granularity) != (now.storage, now.granularity) or not same_skip(
        components, now.storage, before.skip, now.skip
    ):
        enabled = (
            f"tritoff is already enabled with storage {describe_storage(before.storage)}, "
            f"granularity={before.granularity}, skip={list(before.skip)} and the original weights were released"
        )
        if store is not None:
            raise ValueError(
                f"{enabled}, but the store at {store} holds storage {describe_storage(now.storage)}, "
                f"granularity={now.granularity}, skip={list(now.skip)}: call tritoff.disable(pipe) (or reload the "
                "pipeline) before enabling it from this store"
            )
        raise ValueError(
            f"{enabled}; leave storage=, granularity= and skip= out to keep them, or reload the pipeline to change them"
        )
    return replace(options, skip=before.skip)  # the same modules skipped, however the patterns are written


def _check_kernel_dtypes(layouts: dict[str, list], group_lists: dict[str, list[Group]]) -> None:
    """Refuse ``kernels='triton'`` before anything changes where a pack's weights come back in a dtype the kernel
    does not give (float64): ``kernels='auto'`` unpacks those packs through the PyTorch reference."""
    for name, lays in layouts.items():
        for layout, group in zip(lays, group_lists[name], strict=True):
            if layout.out_dtype not in upcast_kernels.OUT_DTYPES:
                dtype = str(layout.out_dtype).removeprefix("torch.")
                raise ValueError(
                    f"kernels='triton' gives fp8 weights back in bf16, fp16 or fp32, and {group_label(name, group)} "
                    f"computes in {dtype}: use kernels='auto' (the PyTorch reference for those weights) or cast {name} "
                    "to float32"
                )


def _install(engine: Engine) -> None:
    """Make ``engine`` (its runtime built) its target's engine, with tritoff's wrappers of pipeline operations."""
    from tritoff import lora

    setattr(engine.target, ENGINE_ATTR, engine)
    ENGINES.add(engine)
    lora.attach(engine)  # fuse_lora / unfuse_lora write into the packs
    blocks = [m for m in engine._hooked if isinstance(getattr(m, "_hf_hook", None), GroupHook)]
    lookups = [m for m in engine._hooked if isinstance(getattr(m, "_hf_hook", None), HostLookupHook)]
    # .to(), offloading, qkv fusion, compile, save_pretrained
    leaf = engine.options.mode == "leaf"
    operations.install(
        engine.target, engine.components, engine.options.device, blocks, engine.managed_ids, leaf, lookups
    )
    for comp in engine._runtimes:  # a VAE's encode and decode plan their activations as forwards do
        for method in PLANNED_METHODS:
            if callable(getattr(type(comp.module), method, None)) and method not in vars(comp.module):
                setattr(comp.module, method, planned_method(engine.manager, comp, method))


def _freeze(components: dict[str, nn.Module], flags: dict[tuple[str, str], bool]) -> None:
    """Set ``requires_grad=False`` on every parameter (their storage is managed by tritoff), writing into ``flags``
    each one's flag, to restore on :func:`disable`, as it is read (an interrupted freeze leaves the flags so far)."""
    for name, module in components.items():
        for pname, param in named_parameters(module):  # adapters are not managed: they keep their flags
            flags[(name, pname)] = param.requires_grad
            param.requires_grad_(False)


def _replace_meta_params(module: nn.Module, device: torch.device) -> None:
    """Parameters created on the meta device (a model built without weights, to be filled from a store) cannot take
    data from another device: give them real zero-size parameters of the same dtype, one per meta parameter (a tied
    one, such as a text encoder's embeddings shared by two modules, stays one)."""
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (the meta one, kept alive: ids stay unique)
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in replaced:
                    empty = torch.empty(0, dtype=param.dtype, device=device)
                    replaced[id(param)] = (param, nn.Parameter(empty, requires_grad=False))
                sub._parameters[name] = replaced[id(param)][1]


def _warn_lost_weights(snr: dict[str, float]) -> None:
    """Warn of quantized weights whose SNR says fp8 lost them (magnitudes past the scales' range; NaN and Inf are
    refused before packing): enable goes on, as the user may not need those layers, but never silently."""
    lost = sorted((v, k) for k, v in snr.items() if v < LOST_DB)
    if not lost:
        return
    named = ", ".join(f"{name} {db:.1f} dB" for db, name in lost[:3])
    named += f" and {len(lost) - 3} more" if lost[3:] else ""
    warn(
        f"fp8 lost {len(lost)} weight{'s' if len(lost) > 1 else ''} ({named}; scaled fp8 keeps 25 dB or more): their "
        f"magnitudes lie beyond what fp8 with power-of-two scales holds (about 1e-31 to 1e33); keep those modules "
        "unquantized (skip=[...]) or store the component in bf16 (storage=...)"
    )


def _restore(engine: Engine, device: torch.device, released_only: bool = False) -> set[str]:
    """Tear ``engine`` down and give every parameter its dequantized weights on ``device`` and its requires_grad;
    ``released_only``: only those whose weights were released (a failed enable from a store, stopped before it had
    released them all, leaves the others' weights as they were). Returns the components whose weights it gave.

    If that fails (no room on ``device``, Ctrl-C), every parameter it gave weights points at its placeholder again,
    the packs are as they were, and the error propagates: nothing is lost."""
    from tritoff import lora

    engine._teardown()
    given: set[tuple[str, str]] = set()
    try:
        for name in engine.components:
            packed = engine.packed.get(name)
            if packed is not None:
                own = engine._own_params[name]
                for pack, group in zip(packed.packs, engine._group_lists[name], strict=True):
                    names = [n for n, _ in group.params]
                    if released_only:
                        shapes = {e.name: tuple(e.shape) for e in pack.layout.entries}
                        # a host table's view holds no weights of its own either: its arena closes below
                        names = [n for n in names if _released(own[n], shapes[n]) or id(own[n]) in engine._host_views]
                    tensors = _dequantized(pack, device) if names else {}
                    for pname in names:
                        own[pname].data = tensors[pname]
                        given.add((name, pname))
    except BaseException:
        _release(engine, None if not released_only else given)
        raise
    for name, module in engine.components.items():
        # peft freezes a model's own weights as it injects an adapter; one injected while enabled found them frozen
        # by tritoff already, and would find them so without it: they stay frozen
        injected = bool(adapter_names(module) - engine.adapters.get(name, frozenset()))
        for pname, param in named_parameters(module):
            saved = engine.requires_grad.get((name, pname))
            param.requires_grad_(param.requires_grad if saved is None else saved and not injected)
        _move_buffers(module, device)
        move_adapters(module, device)
    for packed in engine.packed.values():
        packed.arena.close()
    for module in engine._unhooked:  # ordinary modules again: no forward of tritoff's left on the instances
        operations.restore_forward(module)
    lora.detach(engine, unwrap=True)  # and peft's own merge on their tuner layers (a copy would fuse into these)
    return {name for name, _ in given}


def _released(param: torch.Tensor, shape: tuple) -> bool:
    """Whether ``param`` (of ``shape``) holds no weights of its own: a placeholder, or the empty tensor given to a
    parameter built on the meta device (:func:`_replace_meta_params`)."""
    return is_placeholder(param) or tuple(param.shape) != shape


def _release(engine: Engine, only: set[tuple[str, str]] | None = None) -> None:
    """Point every managed parameter (``only``: those named, as (component, parameter)) at its placeholder on the
    compute device (what the engine's runtime expects)."""
    for name, packed in engine.packed.items():
        params = engine._own_params[name]
        for pack in packed.packs:
            for entry in pack.layout.entries:
                if only is None or (name, entry.name) in only:
                    params[entry.name].data = placeholder(entry.shape, entry.dtype, engine.options.device)


@outside_inference_mode
@host_by_default
def disable(target, device: str | torch.device | None = None) -> None:
    """Remove every tritoff hook; leave ordinary modules holding the dequantized weights on ``device``.

    ``device`` defaults to the device tritoff computed on. Does nothing if tritoff is not enabled on ``target``; a
    component of a pipeline tritoff is enabled on, or what is neither a pipeline nor a module, is refused. A pipeline
    holding every component of an enabled one (``OtherPipeline(**pipe.components)``) disables that one.
    Raises ``ValueError`` for a device tritoff cannot use, before anything changes; if the weights do not fit on
    ``device`` (``torch.OutOfMemoryError``), a pack cannot be read back from its file (a damaged store, a spill file
    gone: ``StoreError``) or the call is interrupted, tritoff stays enabled, as it was.
    """
    engine: Engine | None = getattr(target, ENGINE_ATTR, None)
    if engine is None:
        # refused: what is neither a pipeline nor a module, and a component of a pipeline tritoff is enabled on
        components = getattr(target, "components", None)
        if isinstance(components, dict) and not any(isinstance(m, nn.Module) for m in components.values()):
            return  # a pipeline without models: nothing tritoff could have enabled
        held = preflight.components_of(target, "disable")
        # a pipeline made from an enabled one's components (OtherPipeline(**pipe.components)) disables that one,
        # when no other engine holds any of its components
        engine = None if isinstance(target, nn.Module) else preflight.engine_held_by(held)
        manager = engine.manager if engine is not None else None
        where = preflight.hooked_elsewhere(held, manager) or preflight.managed_elsewhere(target)
        if where is not None:
            raise ValueError(
                f"tritoff is enabled on {where} or on the pipeline or module holding it, not on this one; call "
                "tritoff.disable on that one"
            )
        if engine is None:
            return

    device = check_device(device) if device is not None else engine.options.device
    preflight.check_not_in_a_call(engine, "disable")
    was_torn_down = engine._torn_down
    try:
        _restore(engine, device)
    except BaseException as err:
        if not engine._torn_down:  # its teardown stopped: still hooked, or refusing forwards until a disable ends
            raise
        # the parameters point at their placeholders again: the engine goes back as it was, hooked or torn down
        if was_torn_down:
            engine._guards = torn_down.guard(engine)
        else:
            engine._torn_down = False
            engine._build_runtime()
            _install(engine)
        if isinstance(err, torch.OutOfMemoryError):
            total = sum(p.layout.out_nbytes for packed in engine.packed.values() for p in packed.packs)
            state = "tritoff stays torn down" if was_torn_down else "tritoff stays enabled"
            raise torch.OutOfMemoryError(
                f"the weights ({format_bytes(total)}) do not fit on {device}: {state}; free memory, or "
                "call tritoff.disable(pipe, device='cpu')"
            ) from err
        from tritoff.store import StoreError

        if isinstance(err, (StoreError, OSError)):  # a pack read back from its file (a store, a spill file)
            state = "tritoff stays torn down" if was_torn_down else "tritoff stays enabled"
            raise StoreError(
                f"tritoff cannot read the weights back to restore them: {err}; {state}, and the weights are in no "
                "other copy tritoff holds: load the pipeline again (from_pretrained) for them"
            ) from err
        raise
    delattr(engine.target, ENGINE_ATTR)
    engine._release_packs()
    reset_placeholders()  # a fill into one of this engine's placeholders no forward refused
    # the runtime's objects refer to each other (hooks and groups, the manager's callbacks): without a collection
    # the packs' host memory and spill files would stay until Python's collector ran, and an enable right after
    # (a re-enable packing again calls this first) would hold a second copy of the model or find its disk full
    gc.collect()


__all__ = ["Engine", "disable", "enable", "format_bytes"]

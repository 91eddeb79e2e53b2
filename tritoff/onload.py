"""A group at run time: where its pack is, how it becomes tensors on the GPU, and binding its parameters to them."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from tritoff.chunks import Chunk, split_pack
from tritoff.kernels import upcast as upcast_kernels
from tritoff.kernels.backend import interpreting, native_fp8
from tritoff.kernels.upcast import (
    BLOCK,
    BLOCK_ZERO_COPY,
    ZERO_COPY_PROGRAMS,
    PreparedUpcast,
    upcast_pack,
    upcast_pack_reference,
    upcast_pack_zero_copy,
)
from tritoff.pack import PackLayout
from tritoff.packer import Pack, PackedModel

# the CUDA caching allocator hands out blocks of at least 512 bytes: what a group's tables really cost
_ALLOCATION = 512
# each distinct unpacked layout (offsets, dtypes, shapes: the same for every block of a model) as a small int, so a
# slot's views are built once per layout and shared by the blocks that pass through it
_VIEW_LAYOUTS: dict[tuple, int] = {}
# one scalar per (dtype, device) behind every placeholder: NaN for floating dtypes, so a forward that reached an
# unloaded weight would poison its output rather than compute something plausible
_SCALARS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that costs nothing: a zero-stride view of one shared scalar.

    Code that reads a parameter's shape, dtype or device (diffusers and peft do when loading adapters) sees the real
    ones; writing into it raises (its elements overlap), and a fill, which overlap does not stop, is refused at the
    next forward (:meth:`GroupRuntime.check_writes`), so an in-place update never lands on it silently."""
    device = torch.device(device)
    key = (dtype, device)
    if key not in _SCALARS:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        # shared by every later engine: never an inference tensor (made under inference mode), which
        # reset_placeholders could not write outside it
        with torch.inference_mode(False):
            _SCALARS[key] = torch.full((), fill, dtype=dtype, device=device)
    return _SCALARS[key].expand(tuple(shape))


def shared_versions(params: list[torch.Tensor], others: list[torch.Tensor] = ()) -> list[list[int]]:
    """The indices (into ``params`` then ``others``) of the tensors that share an autograd version counter with one
    of ``params``, for each counter two or more share.

    Views of one tensor share its counter, and keep sharing it whatever data they are given later: weights loaded by
    slicing a fused tensor (``load_state_dict(assign=True)``, accelerate's ``set_module_tensor_to_device``, which
    diffusers' loaders call), made with ``nn.Parameter(other_weight)``, or two models loaded from one state dict. The
    counters of ``params`` are each set to a mark of their own, one after another (a shared counter ends with the
    last mark set through it), read with those of ``others``, then given their values back, which their sharers all
    read the same. ``others`` (another engine's weights, which may be in a forward on another thread) are only read:
    one sharing no counter with ``params`` is never disturbed."""
    others = list(others)
    if len(params) + len(others) < 2 or not params:
        return []
    before = [p._version for p in params]
    marks = [_MARK + i for i in range(len(params))]
    _set_versions(params, marks)
    seen = [t._version for t in (*params, *others)]
    _set_versions(params, before)
    sharing: dict[int, list[int]] = {}
    for index, mark in enumerate(seen):
        if mark >= _MARK:  # one of the marks: a counter of ``params`` (an unshared one of ``others`` reads its count)
            sharing.setdefault(mark, []).append(index)
    return [indices for indices in sharing.values() if len(indices) > 1]


# far above any count of writes a tensor reaches, within the counter's 32 bits (2**40 would wrap to 0)
_MARK = 2**30


def _set_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    # torch's own setter (what torch.compile uses to put counters back): a sequence of each, or one tensor at a time
    setter = torch._C._autograd._unsafe_set_version_counter
    try:
        setter(tuple(tensors), tuple(versions))
    except TypeError:
        for tensor, version in zip(tensors, versions, strict=True):
            setter(tensor, version)


def reset_placeholders() -> None:
    """Give the scalars behind every placeholder their value back (an in-place ``fill_`` or ``zero_``, which overlap
    does not stop, wrote into one)."""
    with torch.no_grad():
        for (dtype, _), scalar in _SCALARS.items():
            scalar.fill_(float("nan") if dtype.is_floating_point or dtype.is_complex else 0)


def is_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a :func:`placeholder` (no weight behind it)."""
    scalar = _SCALARS.get((tensor.dtype, tensor.device))
    return scalar is not None and tensor.data_ptr() == scalar.data_ptr()


def replaced_or_deleted(name: str) -> RuntimeError:
    """The refusal of managed weight ``name`` replaced or deleted in its module after enable."""
    return RuntimeError(
        f"{name} was replaced or deleted after tritoff.enable (its weights live in tritoff's packs); put it back, or "
        "call tritoff.disable first, change it, then enable again"
    )


def written_in_place(name: str) -> RuntimeError:
    """The refusal of managed weight ``name`` written in place after enable."""
    return RuntimeError(
        f"{name} was written in place after tritoff.enable; its weights live in tritoff's packs, which the write did "
        "not change: call tritoff.disable first, change it, then enable again"
    )


def given_new_data(name: str, when: str) -> RuntimeError:
    """The refusal of managed weight ``name`` given new data (``.data = ...``) ``when`` (after enable, during its
    block's forward)."""
    return RuntimeError(
        f"{name} was given new data (`.data = ...`) {when}; its weights live in tritoff's packs, which that did not "
        "change: call tritoff.disable first, change it, then enable again"
    )


def parameter_homes(root: torch.nn.Module) -> dict[int, list[tuple[dict, str]]]:
    """Where each parameter under ``root`` lives, by ``id``: every (owner's ``_parameters``, key) holding it."""
    homes: dict[int, list[tuple[dict, str]]] = {}
    for module in root.modules():
        for key, param in module._parameters.items():
            if param is not None:
                homes.setdefault(id(param), []).append((module._parameters, key))
    return homes


class SlotParameters(NamedTuple):
    """Parameters viewing a ring slot, one per place in a group's homes (:meth:`GroupRuntime.slot_parameters`), with
    the views they were made from and those views' data pointers: one whose pointer changed was given new data
    (``param.data = ...``) during a forward (:meth:`GroupRuntime.slot_data_error`)."""

    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]
    pointers: list[int]


def _launch_tables(layout: PackLayout, chunks: list[Chunk], zero_copy: bool) -> list[tuple[torch.Tensor, int]]:
    """(table, programs) of every launch a group may make: the whole pack (HBM or the CPU), the whole pack read
    zero-copy, then each staging chunk (a chunk that is the whole pack reuses the first table)."""
    tables = [(layout.table(BLOCK), layout.n_programs(BLOCK))]
    if zero_copy:
        tables.append((layout.table(BLOCK_ZERO_COPY), layout.n_programs(BLOCK_ZERO_COPY)))
    for chunk in chunks:
        whole = chunk.payload == (0, layout.nbytes) and not chunk.scales[1]
        tables.append(tables[0] if whole else (chunk.table(BLOCK), chunk.n_programs(BLOCK)))
    return tables


def table_bytes(layout: PackLayout, chunk_bytes: int, zero_copy: bool) -> int:
    """Device bytes of a group's kernel tables (one allocation), for the planner."""
    chunks = split_pack(layout, chunk_bytes) if chunk_bytes else []
    rows = sum(t.shape[0] for t, _ in {id(t): (t, n) for t, n in _launch_tables(layout, chunks, zero_copy)}.values())
    return -(-rows * 64 // _ALLOCATION) * _ALLOCATION


class GroupRuntime:
    """One pack's onload machinery; its parameters point at a GPU buffer while loaded and at placeholders otherwise.

    ``chunk_bytes``: the capacity of one staging half, which the pack is split to fit (0: no staging).
    ``host_arena``: the page-locked arena its bytes are read from (default: its component's; the disk ring's for a
    pack served from disk).
    ``homes``: for each of ``params``, where it lives (from :func:`parameter_homes`): (owner's ``_parameters``, key)
    pairs, more than one for a tied parameter.

    Resident groups bind by pointing each parameter's ``.data`` at its view. A streamed group lands in a different
    slot on most passes, so for each forward it swaps the modules' parameter entries instead: a dict store per
    tensor, against ``param.data = view`` costing ~1 µs each, twice per tensor per forward (bind and release).
    Between forwards the modules hold the group's own parameters again (placeholders).
    """

    def __init__(
        self,
        component: str,
        pack: Pack,
        packed: PackedModel,
        params: list[torch.nn.Parameter],
        homes: list[list[tuple[dict, str]]],
        device: torch.device,
        use_triton: bool,
        zero_copy: bool,
        chunk_bytes: int = 0,
        host_arena=None,
    ):
        self.component = component
        self.name = pack.name
        self.pack = pack
        self.layout = pack.layout
        self.arena = host_arena if host_arena is not None else packed.arena
        if device.type == "cuda":
            self.arena.readers.add(device)  # closing the arena waits for this device's copies
        self.storage = packed.storage
        self.params = params
        self.device = device
        self.use_triton = use_triton
        self.zero_copy = zero_copy and device.type == "cuda" and self.arena.registered
        self.native = native_fp8(device)  # asked once: each launch would ask the device again
        # launches from the hooks are prepared (compiled Triton on CUDA; see PreparedUpcast)
        self.prepares = use_triton and device.type == "cuda" and not interpreting()
        # the HBM-side upcasts' grid bound, as at enable
        self.upcast_programs = upcast_kernels.check_programs(upcast_kernels.UPCAST_PROGRAMS, "UPCAST_PROGRAMS")
        self.chunks = split_pack(self.layout, chunk_bytes) if chunk_bytes else []
        self._build_tables()
        # shapes from the layout: the parameters themselves were emptied when their group was packed
        self.placeholders = [placeholder(e.shape, e.dtype, device) for e in self.layout.entries]
        # each parameter's count of in-place writes: one made after enable (nn.init, fill_) landed on a placeholder
        # or a resident buffer, not in the packs, and is refused at the next forward
        self.versions = [p._version for p in params]
        # index -> the (holder, index) pairs of other managed parameters sharing its version counter (views of one
        # tensor): a count tritoff adds to it (release) is theirs too (see Engine._build_runtime)
        self.shared_versions: dict[int, list[tuple[weakref.ref, int]]] = {}
        # each parameter's data pointer as tritoff last set it (bind, release): one changed since was given new data
        # (``param.data = tensor``), which neither counts as a write nor changes the packs; None until first set
        self._pointers: list[int] | None = None
        self._data_replaced: int | None = None  # a parameter whose new data a release or bind overwrote, by index
        # (owner's parameter dict, key, the group's own parameter), flat: a tied parameter has one per place
        self.homes = [(owner, key, param) for param, places in zip(params, homes, strict=True) for owner, key in places]
        self._home_index = tuple(i for i, places in enumerate(homes) for _ in places)
        views_of = (tuple((e.out_offset, e.dtype, e.shape) for e in self.layout.entries), self._home_index)
        self.view_layout = _VIEW_LAYOUTS.setdefault(views_of, len(_VIEW_LAYOUTS))
        self._bound: SlotParameters | None = None  # the slot's parameters the modules hold (bind_slot to unbind_slot)
        self.tier = "stream"
        self.device_pack: torch.Tensor | None = None  # fp8 tier: the pack resident on the GPU
        self.buffer: torch.Tensor | None = None  # bf16 tier or pool unit: its own buffer
        self.slot: int | None = None  # ring slot holding it while streamed
        self.ready: torch.cuda.Event | None = None
        self._views: dict[int, list[torch.Tensor]] = {}
        self.hook_counted = False  # its pre hook counted toward the hooks' time in this call: so does its post
        self.hooked: tuple | None = None  # (module, hook): where the engine put its block hook, checked every call

    def _build_tables(self) -> None:
        # every table of the group in one device allocation, sliced per launch (each would cost 512 bytes alone)
        launches = _launch_tables(self.layout, self.chunks, self.zero_copy)
        unique = list({id(t): t for t, _ in launches}.values())
        cpu = torch.cat(unique)
        device = cpu.to(self.device)
        starts, at = {}, 0
        for t in unique:
            starts[id(t)] = at
            at += t.shape[0]
        self._launches = [
            (cpu[starts[id(t)] : starts[id(t)] + t.shape[0]], device[starts[id(t)] : starts[id(t)] + t.shape[0]], n)
            for t, n in launches
        ]
        if self.device.type == "cuda":  # the launches' bounds checks read a GPU table's rows here, not from the GPU
            for table_cpu, table, _ in self._launches:
                upcast_kernels.table_extent(table, self.layout.out_dtype, cpu_rows=table_cpu)
        self._prepared: dict[int, PreparedUpcast] = {}  # launch -> its prepared launch (CUDA hooks, made on use)

    @property
    def bound(self) -> bool:
        """Whether the modules hold a slot's parameters (between :meth:`bind_slot` and :meth:`unbind_slot`)."""
        return self._bound is not None

    @property
    def bound_params(self) -> list[torch.nn.Parameter]:
        """The slot's parameters the modules hold while bound, one per place in :attr:`homes` (else none)."""
        return self._bound.params if self._bound is not None else []

    def entry_of_place(self, place: int) -> int:
        """The pack entry (parameter index) of place ``place`` in :attr:`homes`."""
        return self._home_index[place]

    def bound_views(self, index: int) -> list[torch.Tensor]:
        """While bound: the slot's views of parameter ``index``, one per place it has (a tied parameter: several)."""
        return [self._bound.views[k] for k, i in enumerate(self._home_index) if i == index] if self._bound else []

    @property
    def packed_bytes(self) -> int:
        """Bytes of the pack (what crosses PCIe when streamed)."""
        return self.layout.nbytes

    @property
    def unpacked_bytes(self) -> int:
        """Bytes of its tensors on the GPU."""
        return self.layout.out_nbytes

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` for each parameter, cached per buffer (building them costs ~10 us per tensor)."""
        key = buffer.data_ptr()
        if key not in self._views:
            self._views[key] = self.build_views(buffer)
        return self._views[key]

    def build_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` for each parameter, in parameter order (uncached)."""
        by_name = self.layout.views(buffer)
        return [by_name[e.name] for e in self.layout.entries]

    def slot_parameters(self, buffer: torch.Tensor) -> SlotParameters:
        """Parameters viewing ``buffer`` (a ring slot), one per place in :attr:`homes`: what :meth:`bind_slot` takes.
        Groups of one :attr:`view_layout` can share them."""
        views = self.build_views(buffer)
        params = [torch.nn.Parameter(v, requires_grad=False) for v in views]
        places = [views[i] for i in self._home_index]
        return SlotParameters([params[i] for i in self._home_index], places, [v.data_ptr() for v in places])

    def bind(self, buffer: torch.Tensor) -> None:
        """Point every parameter at its view of ``buffer`` (a resident group: its own buffer, for many forwards)."""
        self._note_replaced_data()
        views = self.views(buffer)
        for param, view in zip(self.params, views, strict=True):
            param.data = view
        self._pointers = [v.data_ptr() for v in views]

    def bind_slot(self, slot: SlotParameters) -> None:
        """Put ``slot``'s parameters (from :meth:`slot_parameters`) in the modules for one forward."""
        self._bound = slot  # first: whatever interrupts the loop part way, release() undoes what it stored
        for (owner, key, param), bound in zip(self.homes, slot.params, strict=True):
            if owner.get(key) is not param:
                self.unbind_slot()
                raise self._replaced(owner, key)
            owner[key] = bound

    def unbind_slot(self) -> None:
        """Give the modules the group's own parameters back (placeholders) after its forward, wherever they hold the
        slot's (an entry the caller changed meanwhile stays as the caller left it)."""
        for (owner, key, param), bound in zip(self.homes, self._bound.params, strict=True):
            if owner.get(key) is bound:
                owner[key] = param
        self._bound = None

    def slot_data_error(self, slot: SlotParameters) -> RuntimeError | None:
        """Whether a parameter of ``slot`` (this group's layout) was given new data during a forward: every block of
        this layout landing in the slot would compute with it. Its views are put back, and the error naming it (as
        this group's) is returned for the caller to raise, else None."""
        if [p.data_ptr() for p in slot.params] == slot.pointers:
            return None
        place = next(i for i, (p, v) in enumerate(zip(slot.params, slot.pointers, strict=True)) if p.data_ptr() != v)
        for param, view in zip(slot.params, slot.views, strict=True):
            param.data = view
        return self._data_error(self._home_index[place], "during a forward")

    def check_homes(self) -> None:
        """Refuse a parameter replaced after enable (``module.weight = ...``, ``load_state_dict(assign=True)``, ``del
        module.weight``), or written in place (:meth:`check_writes`): the module would compute with it while tritoff
        holds the weight."""
        for owner, key, param in self.homes:
            if owner.get(key) is not param:
                raise self._replaced(owner, key)
        self.check_writes()
        self.check_data()

    def check_before_forward(self) -> None:
        """What a forward checks before it runs: everything (:meth:`check_homes`) for a group bound in place; the data
        and in-place writes of a streamed one, whose entries :meth:`bind_slot` checks as it sets them."""
        if self.tier in ("fp8", "stream"):
            self.check_writes()
            self.check_data()
        else:
            self.check_homes()

    def check_data(self) -> None:
        """Refuse a parameter given new data after enable (``param.data = tensor``): the module would compute with it
        while tritoff holds the weight, or tritoff's next load would drop it. Putting the data back before that
        load clears it; after, it stays refused until disable."""
        index = self._data_replaced if self._data_replaced is not None else self._replaced_data()
        if index is not None:
            raise self._data_error(index, "after tritoff.enable")

    def _replaced_data(self) -> int | None:
        """The index of the first parameter whose data is not what tritoff last gave it, or None."""
        if self._pointers is None:
            return None
        pointers = [p.data_ptr() for p in self.params]
        if pointers == self._pointers:
            return None
        return next(i for i, (a, b) in enumerate(zip(pointers, self._pointers, strict=True)) if a != b)

    def _note_replaced_data(self) -> None:
        # before tritoff sets the parameters' data again, which drops new data: remember the (first) one it drops
        if self._data_replaced is None:
            self._data_replaced = self._replaced_data()

    def _data_error(self, index: int, when: str) -> RuntimeError:
        return given_new_data(f"{self.component}.{self.layout.entries[index].name}", when)

    def check_writes(self) -> None:
        """Refuse a parameter written in place after enable (``fill_``, ``nn.init.constant_``): the write landed on
        its placeholder (whose scalar is put back) or its resident buffer, never in the packs it is loaded from."""
        if [p._version for p in self.params] != self.versions:
            index = next(i for i, p in enumerate(self.params) if p._version != self.versions[i])
            reset_placeholders()
            name = self.param_name(index)
            sharers = [holder.param_name(j) for holder, j in self._sharers(index)]
            if sharers:  # one counter: which of them was written cannot be told
                name = f"{name} (or {', '.join(sharers)}: views of one tensor)"
            raise written_in_place(name)

    def _sharers(self, index: int) -> list[tuple]:
        """The (group or host table, index) of the other managed parameters sharing parameter ``index``'s version
        counter, less those of another engine gone since."""
        return [(h, j) for ref, j in self.shared_versions.get(index, ()) if (h := ref()) is not None]

    def param_name(self, index: int) -> str:
        """The qualified name of parameter ``index`` (``transformer.blocks.0.attn1.to_q.weight``)."""
        return f"{self.component}.{self.layout.entries[index].name}"

    def _replaced(self, owner: dict, key: str) -> RuntimeError:
        place = next(i for i, (o, k, _) in enumerate(self.homes) if o is owner and k == key)
        return replaced_or_deleted(f"{self.component}.{self.layout.entries[self._home_index[place]].name}")

    def release(self) -> None:
        """Point every parameter at its placeholder on the compute device (its shape, no memory)."""
        if self._bound is not None:
            self.unbind_slot()
        self._note_replaced_data()
        for i, (param, empty) in enumerate(zip(self.params, self.placeholders, strict=True)):
            if param.data_ptr() != empty.data_ptr():
                # a backward still to run may have saved this weight (a resident phase evicted between a forward and
                # its backward): counted as a write, autograd then refuses it rather than read the placeholder's NaN
                # (data made under inference mode counts none, and autograd cannot have saved it)
                before = param._version
                torch.autograd.graph.increment_version(param)
                for holder, j in [(self, i), *self._sharers(i)]:
                    if holder.versions[j] == before:  # else a write of the caller's is still to refuse
                        holder.versions[j] = param._version
            param.data = empty
        self._pointers = [empty.data_ptr() for empty in self.placeholders]

    def forget_buffer(self, buffer: torch.Tensor) -> None:
        """Drop cached views of a buffer that is going away."""
        self._views.pop(buffer.data_ptr(), None)

    def rehome(self, arena) -> None:
        """Its pack's bytes now lie in ``arena`` (a component's, or the disk ring's: ``tritoff/rehold.py``)."""
        if self.zero_copy and not arena.registered:
            raise RuntimeError(f"{self.component}.{self.name}: zero-copy reads need a page-locked arena")
        self.arena = arena
        if self.device.type == "cuda":
            arena.readers.add(self.device)

    def drop_device_state(self, keep_tables: bool = False) -> None:
        """Release everything the group holds on the device: buffers, the resident pack, cached views (their memory
        may come back at the same address, holding something else) and, unless ``keep_tables``, its kernel tables."""
        self.release()
        self.buffer = None
        self.device_pack = None
        self.slot = None
        self._views.clear()
        if not keep_tables:
            self.ready = None
            self._launches = []
            self._prepared = {}

    # filling ------------------------------------------------------------------------------------------------------
    @property
    def direct(self) -> bool:
        """Whether the group fills without staging: from its resident fp8 pack, or zero-copy from the host."""
        return self.device_pack is not None or self.zero_copy

    def fill_direct(self, dst: torch.Tensor, host: torch.Tensor | None = None, stream=None) -> int:
        """Write the group's tensors into ``dst`` from the resident pack (HBM) or its ``host`` bytes (a view of its
        page-locked arena) read zero-copy; returns the host bytes read. ``stream``: the CUDA stream to launch on
        (it must be current for the reference path, which runs PyTorch ops)."""
        if self.device_pack is not None:
            self._upcast(self.device_pack, dst, 0, stream)
            return 0
        self._upcast(self.arena.device_view_of(host, self.device), dst, 1, stream)
        return self.packed_bytes

    def fill_chunk(self, index: int, staged: torch.Tensor, dst: torch.Tensor, stream=None) -> None:
        """Upcast chunk ``index`` (already copied into ``staged``) into its places in ``dst`` (on ``stream``, as
        :meth:`fill_direct`)."""
        self._upcast(staged, dst, (2 if self.zero_copy else 1) + index, stream)

    def fill_from_host(self, dst: torch.Tensor, host: torch.Tensor) -> int:
        """Write the group's tensors into ``dst`` from its ``host`` bytes (a CPU device: no staging needed)."""
        # Triton's interpreter copies every argument's whole storage back after a launch: a pack's view of the
        # arena would rewrite the whole arena, so the kernel gets a copy of the pack
        source = host.clone() if self.use_triton else host
        self._upcast(source, dst, 0)
        return self.packed_bytes

    def _upcast(self, src: torch.Tensor, dst: torch.Tensor, launch: int, stream=None) -> None:
        table_cpu, table, n_programs = self._launches[launch]
        zero_copy = launch == 1 and self.zero_copy
        if not self.use_triton:
            upcast_pack_reference(src, dst, table_cpu, self.layout.out_dtype, self.storage)
        elif stream is not None and self.prepares and not torch._C._len_torch_dispatch_stack():
            # the hooks' launches: prepared once per launch (a dispatch mode the caller runs under sees the op)
            prepared = self._prepared.get(launch)
            if prepared is None:
                prepared = self._prepared[launch] = PreparedUpcast(
                    table,
                    n_programs,
                    self.layout.out_dtype,
                    self.storage,
                    native=self.native,
                    block=BLOCK_ZERO_COPY if zero_copy else BLOCK,
                    programs=ZERO_COPY_PROGRAMS if zero_copy else self.upcast_programs,
                )
            prepared(src, dst, stream)
        elif zero_copy:
            upcast_pack_zero_copy(src, dst, table, n_programs, self.layout.out_dtype, self.storage, native=self.native)
        else:
            upcast_pack(
                src,
                dst,
                table,
                n_programs,
                self.layout.out_dtype,
                self.storage,
                native=self.native,
                programs=self.upcast_programs,
            )

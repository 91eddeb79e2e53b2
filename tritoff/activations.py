"""Peak activation memory of a forward, known before it runs: the component is run on the meta device.

A *meta twin* of a component (same class and config, parameters on the meta device in the dtypes tritoff computes
with) runs the call with meta copies of its inputs. Nothing is computed and nothing is allocated, but every tensor the
forward creates has its real size, so a dispatch mode that adds the bytes of each new storage and subtracts them when
the storage dies sees the peak the GPU would see. Attention is counted as the fused kernels the GPU runs (flash or
memory-efficient SDPA: the output, no score matrix); the math fallback would materialize a heads x tokens x tokens
matrix no GPU run allocates. A repeated op is answered from a memo of its outputs' sizes instead of its meta kernel,
so a Wan-14B forward at 480x832x81 traces in 0.3-0.4 s on a 2-core VM (1.2 s running every meta kernel), and
``tritoff plan`` of Wan 2.1 at 720p with the VAE traced in tiles takes 35 s there instead of 105 s (docs/design.md).

On CUDA the engine also measures each component's first forward, and re-plans when the estimate was short.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# the allocator's rounding and kernels' temporaries come on top of the tensors the trace sees, and on a GPU the
# cuBLAS and attention workspaces (tens of MB)
MARGIN = 1.15
CUDA_SLACK = 64 * 2**20


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as a fused kernel allocates it: the output only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value") if n in kwargs])[:3]
            return q.new_empty(*q.shape[:-1], v.shape[-1])
        return func(*args, **kwargs)


class _PeakBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are alive, and their peak.

    Each storage it counts is held by a weak reference (the key: the storage's address, which the reference keeps from
    being reused). A storage's death is noticed at the next allocation, when the peak can next rise. No Python runs as
    tensors die, so a Ctrl-C cannot land in a finalizer, where Python would print it and carry on. :meth:`release`
    drops the references.

    Many of PyTorch's meta kernels are Python (elementwise ops, norms: 0.25-1 ms each on a CPU), and a call repeats
    the same ops on the same shapes (blocks, a VAE's frames and tiles: 74,000 ops for one tiled decode of the tiny
    test VAE). So the outputs of an op that neither mutates nor aliases its inputs are remembered by the op and its
    inputs' shapes, strides, dtypes and other arguments (``memo``): a repeat makes empty tensors of those sizes, as the
    meta kernel would have. Views and in-place ops always run.
    """

    def __init__(self, memo: bool = True):
        super().__init__()
        self.live: dict[int, int] = {}  # storage key -> bytes
        self.now = 0
        self.peak = 0
        self.memo: dict | None = {} if memo else None  # (op, inputs' metadata) -> outputs' metadata
        self.hits = 0  # ops answered from the memo
        self._sweep_at = 64  # live storages counted (dead ones included) that trigger a look for dead ones

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            # a data-dependent scalar (.item(), a mask's .all()): meta tensors hold no data, so read it as 1 (True),
            # the path an unpadded input takes; the shapes that follow, and so the memory, do not depend on it
            return True if args[0].dtype == torch.bool else (1.0 if args[0].is_floating_point() else 1)
        # storages that existed before the trace (parameters, inputs): a view of one (a weight's transpose, a
        # reshaped input) allocates nothing, but one grown in place (resize_, an out= argument) allocates the growth
        before = {}
        for t in _tensors((args, kwargs)):
            if (key := _storage(t)) not in self.live:
                before[key] = t.untyped_storage().nbytes()
        out = self._run(func, args, kwargs or {})
        for t in _tensors(out):
            key = _storage(t)
            if key in before:
                grown = max(t.untyped_storage().nbytes() - before[key], 0)
                before[key] += grown
                self._add(grown)  # held past the trace, as the storage it grew
            else:
                self._track(t)
        return out

    def _run(self, func, args, kwargs):
        """``func(*args, **kwargs)``; for a repeat of a pure op on meta tensors, new tensors of its outputs' sizes."""
        if self.memo is None or not _pure(func):
            return func(*args, **kwargs)
        try:  # the default dtype too: factories and promotions of ints to floats read it
            key = (func, torch.get_default_dtype(), _metadata(args), _metadata(kwargs))
            shapes = self.memo.get(key)
        except TypeError:  # an argument that cannot be a key (a tensor on another device, an unhashable object)
            return func(*args, **kwargs)
        if shapes is None:
            out = func(*args, **kwargs)
            inputs = {_storage(t) for t in _tensors((args, kwargs))}
            self.memo[key] = _outputs(out, inputs)
            return out
        if shapes is _NOT_REMEMBERED:
            return func(*args, **kwargs)
        self.hits += 1
        kind, outputs = shapes
        made = [torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in outputs]
        return made[0] if kind is torch.Tensor else kind(made)

    def _add(self, nbytes: int) -> None:
        self.now += nbytes
        # look for dead storages only where the peak could rise: ``now`` counts them until then, so it is never below
        # the bytes alive, and at or under the peak so are they. (Also once the storages held have doubled, so dead
        # ones do not pile up.) A pass at every allocation was most of a long trace's time
        if self.now > self.peak or len(self.live) >= self._sweep_at:
            for key in [key for key in self.live if torch.UntypedStorage._expired(key)]:
                self.now -= self.live.pop(key)
                torch.UntypedStorage._free_weak_ref(key)
            self._sweep_at = max(64, 2 * len(self.live))
            self.peak = max(self.peak, self.now)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata in self.live:
            return
        nbytes = storage.nbytes()
        self._add(nbytes)
        self.live[storage._weak_ref()] = nbytes  # the weak reference's value is the storage's key

    def release(self) -> None:
        """Drop the weak references (the trace is over)."""
        for key in self.live:
            torch.UntypedStorage._free_weak_ref(key)
        self.live = {}


_NOT_REMEMBERED = object()  # an op whose outputs are not all new meta tensors: always run


_PURE: dict = {}  # aten overload -> whether it is pure, read from its schema once


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs: aten ops take and return tensors, scalars, and lists, tuples and
    dicts of them (``torch.utils._pytree.tree_leaves`` walks the same, several times slower)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return []
    found = []
    for item in value:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple, dict)):
            found.extend(_tensors(item))
    return found


def _pure(func) -> bool:
    """Whether ``func`` (an aten overload) neither writes to nor returns an alias of its arguments."""
    pure = _PURE.get(func)
    if pure is None:
        schema = func._schema
        pure = _PURE[func] = not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
    return pure


def _metadata(value):
    """``value`` as a key: tensors by their dtype, shape and strides (meta kernels read nothing else), sequences as
    tuples, dicts by their sorted items, scalars with their type (``1``, ``1.0`` and ``True`` promote differently). Only
    plain strided tensors on the meta device are keys (else TypeError): a subclass dispatches on its own, a nested
    tensor's sizes are symbolic."""
    if isinstance(value, torch.Tensor):
        if not _plain_meta(value):
            raise TypeError("only plain strided meta tensors are remembered")
        return (torch.Tensor, value.dtype, tuple(value.shape), value.stride())
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_metadata(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, _metadata(v)) for k, v in value.items())))
    return (type(value), value)


def _plain_meta(t) -> bool:
    """Whether ``t`` is a plain (not a subclass), strided, not nested tensor on the meta device."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout is torch.strided and not t.is_nested and t.is_meta


def _outputs(out, inputs: set[int]):
    """What a repeat must make: (torch.Tensor, [(size, stride, dtype)]) for a new meta tensor, (tuple or list, [...])
    for a sequence of them, each with a storage of its own; else ``_NOT_REMEMBERED`` (some ops alias an input
    unannounced: ``_unsafe_view``)."""
    kind = torch.Tensor if isinstance(out, torch.Tensor) else type(out)
    tensors = [out] if kind is torch.Tensor else out
    if kind not in (torch.Tensor, tuple, list) or not tensors:
        return _NOT_REMEMBERED
    if not all(isinstance(t, torch.Tensor) and _plain_meta(t) and t.storage_offset() == 0 for t in tensors):
        return _NOT_REMEMBERED
    storages = {_storage(t) for t in tensors}
    if len(storages) < len(tensors) or storages & inputs:
        return _NOT_REMEMBERED
    if any(t.untyped_storage().nbytes() != _strided_nbytes(t) for t in tensors):  # a kernel that allocates more
        return _NOT_REMEMBERED
    return kind, [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]


def _strided_nbytes(t: torch.Tensor) -> int:
    """The bytes ``torch.empty_strided`` allocates for ``t``'s size, strides and dtype."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def _storage(t: torch.Tensor) -> int:
    """A key for ``t``'s storage, shared by its views: its address."""
    return t.untyped_storage()._cdata


def meta_twin(module: nn.Module) -> nn.Module | None:
    """A copy of ``module``'s architecture on the meta device, in its parameters' and buffers' dtypes; None for a
    module that cannot be rebuilt from a config (plain ``nn.Module``\\ s)."""
    config = getattr(module, "config", None)
    cls = type(module)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            if hasattr(cls, "from_config"):
                twin = cls.from_config(config)
            else:
                twin = cls(config)
    except Exception:  # a model whose constructor needs more than its config
        return None
    dtypes = {n: p.dtype for n, p in module.named_parameters()}
    made = {}  # id of a twin parameter -> its replacement, so that tied parameters stay one
    for name, param in twin.named_parameters():
        if name in dtypes or not param.is_meta:
            # a new parameter, not ``param.data = ...``: one the constructor made on the CPU anyway (the legacy
            # ``torch.Tensor([...])`` ignores the meta device; diffusers' AlphaBlender) cannot take meta data
            meta = torch.empty(param.shape, dtype=dtypes.get(name, param.dtype), device="meta")
            made[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
    for sub in twin.modules():
        for name, param in list(sub._parameters.items()):
            if id(param) in made:
                sub._parameters[name] = made[id(param)]
    buffers = {n: b.dtype for n, b in module.named_buffers()}
    for sub_name, sub in twin.named_modules():
        for name, buf in list(sub._buffers.items()):
            full = f"{sub_name}.{name}" if sub_name else name
            if buf is not None and full in buffers:  # on meta too: one made on the CPU anyway, as parameters above
                sub._buffers[name] = buf.to("meta", buffers[full])
    return twin.eval()


def _to_meta(value):
    if _generators(value):  # the caller's: drawing from them on the meta twin would change their noise
        return None
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _generators(value) -> bool:
    """A generator, or a list of them (one per batch item, as diffusers takes them)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, torch.Generator) for v in value)
    return isinstance(value, torch.Generator)


def peak_bytes(twin: nn.Module, args=(), kwargs=None, method: str = "forward", memo: bool = True) -> int:
    """Peak bytes of the tensors ``twin.method(*args, **kwargs)`` creates (run on the meta device); ``memo=False``
    runs every op's meta kernel, even where it repeats."""
    args, kwargs = tree_map(_to_meta, (tuple(args), dict(kwargs or {})), is_leaf=_generators)
    tracker = _PeakBytes(memo)
    try:
        with torch.no_grad(), _FusedAttention(), tracker:
            out = getattr(twin, method)(*args, **kwargs)
            del out
    finally:
        tracker.release()
    return tracker.peak


def reserve_bytes(twin: nn.Module, args=(), kwargs=None, method: str = "forward", cuda: bool = True) -> int:
    """The activation reserve a call needs: its traced peak with a margin (and the GPU's workspaces when ``cuda``);
    raises what the trace raised."""
    return int(peak_bytes(twin, args, kwargs, method) * MARGIN) + (CUDA_SLACK if cuda else 0)


def estimate(twin: nn.Module | None, args=(), kwargs=None, method: str = "forward", cuda: bool = True) -> int | None:
    """:func:`reserve_bytes`, or None when the call cannot be traced."""
    if twin is None:
        return None
    try:
        return reserve_bytes(twin, args, kwargs, method, cuda)
    except Exception:  # code that cannot run on the meta device (data-dependent shapes, custom kernels)
        return None

"""tritoff/manager.py: prefetch order, conditional groups, fp8-casting text encoders, ring slot reuse."""

import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import tritoff
from tritoff.onload import is_placeholder
from tritoff.planner import BudgetError
from tritoff.tiny import realistic_init, tiny_umt5
from tritoff.warn import TritoffWarning

from .helpers import dequantize_in_place, dequantized_pipeline, enable_at_minimum, in_threads, run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


class Stack(nn.Module):
    """Blocks of Linear layers; ``skip`` names blocks to leave out, ``reverse`` runs them backwards."""

    def __init__(self, n=5, width=64):
        super().__init__()
        self.proj_in = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(n)
        )
        self.head = nn.Linear(width, 16)
        self.skip: set[int] = set()
        self.reverse = False

    def forward(self, x):
        x = self.proj_in(x)
        order = range(len(self.blocks) - 1, -1, -1) if self.reverse else range(len(self.blocks))
        for i in order:
            if i not in self.skip:
                x = x + self.blocks[i](x)
        return self.head(x)


def _stack():
    torch.manual_seed(0)
    return realistic_init(Stack()).to(torch.bfloat16).eval()


def _minimum(model, **options) -> int:
    """The smallest budget the planner accepts for ``model`` in group mode (every block streamed)."""
    with pytest.raises(BudgetError) as info:
        _enable(model, 1000, **options)
    return info.value.minimum


def _output(model, x):
    with torch.no_grad():
        return model(x)


def _enable(model, budget, **options):
    return tritoff.enable(
        model, mode="group", budget=budget, reserve=1000, progress=False, kernels="reference", **options
    )


def _streamed_stack():
    """A Stack with every block streamed, its engine, an input, and the output of its dequantized twin for it."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = _output(dequantize_in_place(_stack()), x)
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    return model, engine, x, expected


class _Calling(nn.Module):
    """A block whose forward calls other blocks of its stack (``calls``, not re-entering itself) before it uses its own
    weight."""

    def __init__(self, stack, calls):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.stack = [stack]  # a list: not a submodule
        self.calls = calls
        self.running = False
        self.catch = False  # a call that raises RuntimeError adds nothing, and the block goes on

    def forward(self, x):
        inner = torch.zeros_like(x)
        if not self.running:
            self.running = True
            try:
                for i in self.calls:
                    try:
                        inner = inner + self.stack[0].blocks[i](x)
                    except RuntimeError:
                        if not self.catch:
                            raise
            finally:
                self.running = False
        return self.lin(x) + inner


def _calling(calls: dict[int, list[int]]):
    """A Stack whose blocks ``calls`` keys call the blocks their values name (each still a Sequential, as blocks of one
    list are grouped when they are of one class)."""
    torch.manual_seed(0)
    model = Stack()
    for i, inner in calls.items():
        model.blocks[i] = nn.Sequential(_Calling(model, inner))
    return realistic_init(model).to(torch.bfloat16).eval()


def _enable_streamed(model, make, prefetch):
    """Enable ``model`` in group mode at the smallest budget for ``prefetch``: every block streamed."""
    engine = _enable(model, _minimum(make(), prefetch=prefetch), prefetch=prefetch)
    assert engine.plan.tier_counts("model")["stream"] == 5
    return engine


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("inner", [0, 3, 4])
def test_a_block_calling_another_block_keeps_its_own_weights(inner, prefetch):
    # block 1 is bound when it calls the other block, which loads synchronously: into a slot block 1 does not hold
    # (round-robin put it in block 1's slot whenever the ring came round, and block 1 computed with its weights)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = _output(dequantize_in_place(_calling({1: [inner]})), x)
    model = _calling({1: [inner]})
    _enable_streamed(model, lambda: _calling({1: [inner]}), prefetch)
    for _ in range(3):
        assert torch.equal(_output(model, x), expected)


def test_blocks_nested_deeper_than_the_ring_are_refused_and_the_next_call_is_exact():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _calling({1: [3], 3: [4]})
    _enable_streamed(model, lambda: _calling({1: [3], 3: [4]}), prefetch=1)  # two slots: 1 and 3 hold both
    with pytest.raises(RuntimeError, match=r"^model: blocks\.4 was called while blocks held all 2 of the") as info:
        _output(model, x)
    assert "\n" not in str(info.value) and "prefetch" in str(info.value)
    model.blocks[3][0].calls = []  # one level of nesting fits
    reference = _calling({1: [3], 3: [4]})
    reference.blocks[3][0].calls = []
    assert torch.equal(_output(model, x), _output(dequantize_in_place(reference), x))


def test_a_streamed_block_called_inside_its_own_forward_is_refused():
    # the inner call would take the block's slot over and give its placeholders back before the outer call used them
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _calling({1: [1]})
    _enable_streamed(model, lambda: _calling({1: [1]}), prefetch=2)
    for _ in range(2):  # each call, after the first one's recovery too
        with pytest.raises(RuntimeError, match=r"^model\.blocks\.1 was called inside its own forward.*mode='model'"):
            _output(model, x)
    model.blocks[1][0].calls = []
    reference = _calling({1: []})
    assert torch.equal(_output(model, x), _output(dequantize_in_place(reference), x))


def test_a_block_called_on_its_own_that_catches_an_error_of_a_block_it_calls_keeps_its_weights():
    # the error leaves the inner block; the outer one, whose forward goes on, keeps its slot and its phase
    model = _calling({1: [3]})
    _enable_streamed(model, lambda: _calling({1: [3]}), prefetch=2)
    _output(model, torch.randn(4, 16, dtype=torch.bfloat16))
    model.blocks[1][0].catch = True
    model.blocks[3][0].register_forward_pre_hook(_raise_once(RuntimeError("the inner block fails")))
    h = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(_output(model.blocks[1], h), _output(dequantize_in_place(_calling({1: []})).blocks[1], h))
    assert torch.equal(_output(model.blocks[1], h), _output(dequantize_in_place(_calling({1: [3]})).blocks[1], h))


def test_a_block_that_catches_the_refusal_of_calling_itself_keeps_its_weights():
    # the refusal changed nothing, so no recovery releases the slot the calling block still computes with
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _calling({1: [1]})
    _enable_streamed(model, lambda: _calling({1: [1]}), prefetch=2)
    model.blocks[1][0].catch = True
    expected = _output(dequantize_in_place(_calling({1: []})), x)  # the refused call adds nothing
    for _ in range(3):
        assert torch.equal(_output(model, x), expected)


def test_conditional_and_unused_groups_work_and_are_counted():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    engine = _enable(model, _minimum(_stack()))  # room for the ring only: every block is streamed
    assert engine.plan.tier_counts("model")["stream"] == 5
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # traces 0..4
        assert torch.equal(model(x), reference(x))
        model.skip = reference.skip = {2}  # a conditional block: skipped ones are passed over, no fallback
        assert torch.equal(model(x), reference(x))
        stats = engine.stats["components"]["model"]
        assert stats["sync_onloads"] == 0
        model.skip = reference.skip = set()
        model.reverse = reference.reverse = True  # out of the traced order: synchronous loads, counted
        assert torch.equal(model(x), reference(x))
    assert engine.stats["components"]["model"]["sync_onloads"] > 0


def test_a_forward_that_calls_what_is_inside_its_blocks_but_no_block_is_refused_not_nan():
    class Inside(Stack):
        def forward(self, x):  # the blocks' layers called directly: the blocks' own hooks never run
            x = self.proj_in(x)
            for block in self.blocks:
                x = x + block[2](block[1](block[0](x)))
            return self.head(x)

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = realistic_init(Inside()).to(torch.bfloat16).eval()
    _enable(model, _minimum(_stack()))
    for _ in range(2):  # and again: it stays refused
        with pytest.raises(RuntimeError, match=r"^model's forward called none of its blocks \(blocks.0, ...\).*'leaf'"):
            _output(model, x)
    reference = dequantize_in_place(realistic_init(Inside()).to(torch.bfloat16).eval())
    tritoff.enable(model, mode="leaf", budget="1GB", progress=False, kernels="reference")
    assert torch.equal(_output(model, x), _output(reference, x))
    # every block resident: their weights are in place from the phase's entry, no hook needed
    model = realistic_init(Inside()).to(torch.bfloat16).eval()
    engine = tritoff.enable(model, mode="group", budget="1GB", reserve=1000, progress=False, kernels="reference")
    assert engine.plan.tier_counts("model")["bf16"] == 5
    for _ in range(2):
        assert torch.equal(_output(model, x), _output(reference, x))
    _enable(model, _minimum(_stack()))  # a re-plan that streams them: refused at the next call
    with pytest.raises(RuntimeError, match="called none of its blocks"):
        _output(model, x)


def test_a_vaes_decode_is_planned_from_its_inputs_and_its_tiling_before_its_phase_is_entered():
    """diffusers calls the hook of ``encode``/``decode`` without their inputs: tritoff's wrapper plans from them."""
    from tritoff.activations import estimate, meta_twin

    pipe = wan()
    engine = tritoff.enable(pipe, budget="8MB", progress=False, kernels="reference")
    latents = []
    decode = pipe.vae.decode  # tritoff's: plans, then runs diffusers' decode

    def spy(z, *args, **kwargs):
        latents.append(z)
        return decode(z, *args, **kwargs)

    pipe.vae.decode = spy
    call = dict(num_frames=17, height=96, width=96, num_inference_steps=1)
    reference = dequantized_pipeline(wan)
    assert torch.equal(run(pipe, **call), run(reference, **call))
    vae = engine.manager.components["vae"]
    twin = meta_twin(pipe.vae)
    untiled = estimate(twin, (latents[-1],), dict(return_dict=False), "decode", cuda=False)
    assert vae.plan.reserve == engine.stats["components"]["vae"]["activation_estimate_bytes"] == untiled
    # it needs the room the transformer held; what fits beside it stays
    residency, phases = engine.manager.residency, engine.manager.components.values()
    assert not engine.manager.components["transformer"].loaded
    assert residency.held(phases) + residency.fixed + vae.plan.reserve <= residency.budget
    tiles = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16)
    for vaes in (pipe.vae, reference.vae, twin):
        vaes.enable_tiling(**tiles, tile_sample_stride_width=16)
    with pytest.warns(TritoffWarning, match="vae: this call needs about"):  # small tiles overlap: more here
        assert torch.equal(run(pipe, **call), run(reference, **call))
    tiled = estimate(twin, (latents[-1],), dict(return_dict=False), "decode", cuda=False)
    assert tiled != untiled and engine.stats["components"]["vae"]["activation_estimate_bytes"] == tiled
    pipe.vae.decode = decode
    tritoff.disable(pipe)
    assert "decode" not in vars(pipe.vae) and "encode" not in vars(pipe.vae)


def test_a_compiled_decode_is_planned_outside_its_graph():
    from tritoff.activations import estimate, meta_twin

    pipe, reference = wan(), dequantized_pipeline(wan)
    engine = tritoff.enable(pipe, budget="8MB", progress=False, kernels="reference")
    z = torch.randn(1, pipe.vae.config.z_dim, 2, 12, 12, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(pipe.vae.decode, backend="eager")  # its first call: the twin is built here
    with torch.no_grad():
        assert torch.equal(compiled(z, return_dict=False)[0], reference.vae.decode(z, return_dict=False)[0])
    expected = estimate(meta_twin(pipe.vae), (z,), dict(return_dict=False), "decode", cuda=False)
    assert engine.stats["components"]["vae"]["activation_estimate_bytes"] == expected


def test_calls_alternating_shapes_plan_once_each_then_move_nothing_more():
    from tritoff.tiny import tiny_wan_transformer

    from .helpers import BIG_WAN

    model = tiny_wan_transformer(**BIG_WAN).eval()
    reference = dequantize_in_place(tiny_wan_transformer(**BIG_WAN).eval())

    def inputs(frames, size):
        gen = torch.Generator().manual_seed(frames)
        shape = (1, model.config.in_channels, frames, size, size)
        return dict(
            hidden_states=torch.randn(shape, generator=gen).bfloat16(),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 16, model.config.text_dim, generator=gen).bfloat16(),
            return_dict=False,
        )

    small, large = inputs(2, 8), inputs(5, 32)
    engine = tritoff.enable(model, mode="auto", budget=12_000_000, progress=False, kernels="reference")
    for step, x in enumerate([small, large] * 3):
        with torch.no_grad():
            assert torch.equal(model(**x)[0], reference(**x)[0])
        if step == 1:
            planned = {k: engine.stats["components"]["model"][k] for k in ("replans", "evictions", "entry_bytes")}
    # the larger call's reserve stays: the smaller one fits in it, nothing is planned, evicted or uploaded again
    assert {k: engine.stats["components"]["model"][k] for k in planned} == planned


def test_blocks_the_traced_call_skipped_join_the_order_where_they_run():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    model.skip = {1, 3}  # the first, traced call runs blocks 0, 2 and 4 only
    with torch.no_grad():
        model(x)
        model.skip = set()
        assert torch.equal(model(x), reference(x))  # blocks 1 and 3 load when they run, and join the order
        synchronous = engine.stats["components"]["model"]["sync_onloads"]
        assert synchronous == 2 and engine.manager.components["model"].order == [0, 1, 2, 3, 4]
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    assert engine.stats["components"]["model"]["sync_onloads"] == synchronous  # prefetched from then on


class _Arguments(Stack):
    """A Stack whose calls say which blocks to skip and in which direction to run (skip layer guidance, a loop over
    its inputs)."""

    def forward(self, x, skip=(), reverse=False):
        self.skip, self.reverse = set(skip), reverse
        return super().forward(x)


def test_calls_whose_arguments_change_the_block_order_each_prefetch_their_own_traced_order():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    torch.manual_seed(0)
    reference = dequantize_in_place(realistic_init(_Arguments()).to(torch.bfloat16).eval())
    torch.manual_seed(0)
    model = realistic_init(_Arguments()).to(torch.bfloat16).eval()
    engine = _enable(model, _minimum(_stack()))
    assert engine.plan.tier_counts("model")["stream"] == 5
    kinds = [dict(), dict(skip=[1, 2, 3]), dict(reverse=True), dict(skip=[0], reverse=True)]
    with torch.no_grad():
        for kind in kinds:  # the first call of each kind traces its order
            assert torch.equal(model(x, **kind), reference(x, **kind))
        stats = dict(engine.stats["components"]["model"])
        for kind in kinds * 2 + kinds[::-1]:  # each later call prefetches the order its kind ran
            assert torch.equal(model(x, **kind), reference(x, **kind))
        after = dict(engine.stats["components"]["model"])
        # the first call of a kind ran out of the first call's order; none after it did
        assert stats["sync_onloads"] > 0 and after["sync_onloads"] == stats["sync_onloads"]
        for kind in kinds:  # calls of one kind in a row move each of their blocks once (a switch may drop a prefetch)
            model(x, **kind)
            before = engine.stats["components"]["model"]["onloads"]
            for _ in range(3):
                model(x, **kind)
            assert engine.stats["components"]["model"]["onloads"] - before == 3 * (5 - len(kind.get("skip", ())))


def test_a_key_that_never_comes_back_leaves_prefetch_on_the_first_calls_order():
    # a step counter among the arguments: every call is a new key, whose order is traced but never followed
    class Counted(_Arguments):
        def forward(self, x, step):
            return super().forward(x, skip=[1, 2, 3] if step % 2 else ())

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = realistic_init(Counted()).to(torch.bfloat16).eval()
    engine = _enable(model, _minimum(_stack()))
    misses = []
    with torch.no_grad():
        for step in range(40):
            before = engine.stats["components"]["model"]["sync_onloads"]
            model(x, step)
            misses.append(engine.stats["components"]["model"]["sync_onloads"] - before)
    # the full calls follow the first call's order; the skipping ones miss block 4 once each, as with one order
    assert misses[2::2] == [0] * 19 and misses[1::2] == [1] * 20
    assert len(engine.manager.components["model"].orders) == 16


def test_prefetch_runs_depth_groups_ahead_and_wraps_around():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    manager = engine.manager
    seen = []
    original = manager.group_pre

    def spy(group):
        original(group)
        seen.append((group.name, [g.name for g in manager.inflight]))

    manager.group_pre = spy
    with torch.no_grad():
        model(x)
        model(x)
    # while block i runs, blocks i+1 and i+2 are in flight; after the last block, the next forward's first ones
    assert seen[5 + 3] == ("blocks.3", ["blocks.4", "blocks.0"])
    assert seen[5 + 4] == ("blocks.4", ["blocks.0", "blocks.1"])
    assert engine.stats["components"]["model"]["onloads"] == 10 + 2


@pytest.mark.parametrize("prefetch", [4, 5, 20])
def test_prefetch_beyond_the_blocks_keeps_one_slot_per_block_and_runs_exactly(prefetch):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = _output(dequantize_in_place(_stack()), x)
    options = dict(mode="group", reserve=1000, progress=False, kernels="reference", prefetch=prefetch)
    with pytest.raises(BudgetError) as info:
        tritoff.enable(_stack(), budget=1000, **options)
    model = _stack()
    engine = tritoff.enable(model, budget=info.value.minimum, **options)
    assert engine.plan.phases["model"].ring_slots == 5  # the 5 blocks: the running one and the 4 others ahead
    for _ in range(3):
        assert torch.equal(_output(model, x), expected)
    assert engine.stats["components"]["model"]["sync_onloads"] == 0


def test_umt5_in_fp8_storage():
    """UMT5's feed-forward casts activations to ``wo``'s dtype: a whole block is upcast before it runs."""
    ids = torch.randint(0, 256, (2, 12))
    reference = dequantize_in_place(tiny_umt5())
    model = tiny_umt5()
    engine = _enable(model, _minimum(tiny_umt5()))
    assert engine.plan.tier_counts("model")["stream"] == 2
    with torch.no_grad():
        expected = reference(input_ids=ids).last_hidden_state
        got = model(input_ids=ids).last_hidden_state
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_ring_slots_are_reused_not_reallocated():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    comp = engine.manager.components["model"]
    with torch.no_grad():
        model(x)
        ring = comp.ring
        pointers = [b.data_ptr() for b in ring.buffers]
        for _ in range(3):
            model(x)
    assert comp.ring is ring and [b.data_ptr() for b in ring.buffers] == pointers  # a phase keeps its ring
    # between forwards, streamed blocks hold placeholders (their shapes, no memory), never stale slot views
    streamed = [g for g in engine.manager.components["model"].blocks if g.slot is None]
    weights = [p for g in streamed for p in g.params]
    assert weights and all(is_placeholder(p) for p in weights)
    assert {tuple(p.shape) for p in weights if p.dim() == 2} == {(64, 64)}


def test_blocks_of_one_shape_share_each_slots_views(monkeypatch):
    """Five blocks through three slots land in a different slot on each pass; their views of a slot are built once
    and shared (building them in the hooks of later forwards would count as hook time)."""
    from tritoff.onload import GroupRuntime

    model, engine, x, expected = _streamed_stack()
    ring_slots = engine.plan.phases["model"].ring_slots
    assert ring_slots == 3 and len(model.blocks) % ring_slots
    built = []
    original = GroupRuntime.build_views
    monkeypatch.setattr(
        GroupRuntime, "build_views", lambda self, buffer: built.append(self.name) or original(self, buffer)
    )
    for _ in range(4):
        assert torch.equal(_output(model, x), expected)
    assert [name for name in built if name.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"]
    assert len({g.view_layout for g in engine.manager.components["model"].blocks}) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_fp16_and_fp32_models_come_back_in_their_dtype(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=dtype)
    reference = dequantize_in_place(realistic_init(Stack()).to(dtype).eval())
    torch.manual_seed(0)
    model = realistic_init(Stack()).to(dtype).eval()
    engine = _enable(model, _minimum(realistic_init(Stack()).to(dtype)))
    assert engine.plan.tier_counts("model")["stream"] == 5
    with torch.no_grad():
        got = model(x)
    assert got.dtype == dtype and torch.equal(got, reference(x))


class Boom(Exception):
    """An error raised inside a block's forward."""


def _raise_once(error):
    state = {"raised": False}

    def hook(module, args):
        if not state["raised"]:
            state["raised"] = True
            raise error

    return hook


COUNTERS = ("bytes_h2d", "onloads", "sync_onloads", "trace_sync_onloads", "pool_loads", "evictions")


def _counters(engine):
    stats = engine.stats["components"]["model"]
    return {k: stats[k] for k in COUNTERS}


@pytest.mark.parametrize("failing_call", [0, 2], ids=["first-forward", "third-forward"])
@pytest.mark.parametrize("error", [Boom("in a block"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_after_an_exception_the_next_call_runs_as_on_a_fresh_engine(failing_call, error):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    minimum = _minimum(_stack())
    fresh_model = _stack()
    fresh = _enable(fresh_model, minimum)
    with torch.no_grad():
        fresh_model(x)
    first_call = _counters(fresh)

    model = _stack()
    engine = _enable(model, minimum)
    manager = engine.manager
    comp = manager.components["model"]
    with torch.no_grad():
        for _ in range(failing_call):
            model(x)
        handle = model.blocks[3][2].register_forward_pre_hook(_raise_once(error))
        with pytest.raises(type(error)):
            model(x)
        handle.remove()
        # nothing stays held: no active component, no slot, no pool unit, no open trace, weights on placeholders
        assert comp.active == 0 and not manager.inflight and not comp.loaded and comp.trace is None
        assert all(g.slot is None for g in comp.blocks)
        assert all(is_placeholder(p) for g in comp.groups for p in g.params)
        before = _counters(engine)
        assert torch.equal(model(x), reference(x))
    after = _counters(engine)
    # the call after the exception moved the same bytes, loaded and evicted the same units, as a fresh first call
    assert {k: after[k] - before[k] for k in COUNTERS} == first_call
    assert comp.traced and comp.trace is None and comp.order == list(range(5))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert engine.stats["components"]["model"]["sync_onloads"] == 0


class Probing(Stack):
    """A forward that tries each block with a keyword first (a common compatibility probe) and, on TypeError, calls
    it again without (``retry``) or leaves it out: the block's exception is caught inside the component's forward,
    which goes on."""

    retry = True

    def forward(self, x):
        x = self.proj_in(x)
        for block in self.blocks:
            try:
                x = x + block(x, scale=1.0)
            except TypeError:
                if self.retry:
                    x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("retry", [True, False], ids=["retrying", "skipping"])
@pytest.mark.parametrize("tier", ["stream", "bf16"])
def test_a_forward_that_catches_a_blocks_exception_and_goes_on_runs_exactly(retry, tier):
    """The component is still running: its layers outside the blocks (the head) keep their weights."""

    def model():
        torch.manual_seed(0)
        net = realistic_init(Probing()).to(torch.bfloat16).eval()
        net.retry = retry
        return net

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = _output(dequantize_in_place(model()), x)
    net = model()
    engine = _enable(net, _minimum(model()) if tier == "stream" else "100MB")
    assert engine.plan.tier_counts("model")[tier] == 5
    for _ in range(2):
        assert torch.equal(_output(net, x), expected)
    assert engine.manager.components["model"].active == 0


@pytest.mark.parametrize("mode,budget", [("group", "300KB"), ("model", "100MB")])
def test_a_component_whose_exception_another_components_forward_catches_runs_as_fresh_next(mode, budget):
    """The catching component keeps its phase (in model mode too, where it counts no blocks) and goes on exactly."""

    class Outer(Stack):
        def forward(self, x):
            try:
                self.inner[0](x)
            except RuntimeError:
                pass
            return super().forward(x)

    class Inner(Stack):
        fail = False

        def forward(self, x):
            if self.fail:
                self.blocks[0](self.proj_in(x))
                raise RuntimeError("in the inner component")
            return super().forward(x)

    class Pair:
        def __init__(self):
            torch.manual_seed(0)
            self.outer = realistic_init(Outer()).to(torch.bfloat16).eval()
            torch.manual_seed(1)
            self.inner = realistic_init(Inner()).to(torch.bfloat16).eval()
            object.__setattr__(self.outer, "inner", [self.inner])  # called, not owned

        @property
        def components(self):
            return {"outer": self.outer, "inner": self.inner}

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = Pair()
    for module in reference.components.values():
        dequantize_in_place(module)
    pair = Pair()
    engine = tritoff.enable(pair, mode=mode, budget=budget, reserve=1000, progress=False, kernels="reference")
    pair.inner.fail = True
    assert torch.equal(_output(pair.outer, x), _output(reference.outer, x))
    pair.inner.fail = False
    inner = engine.manager.components["inner"]
    assert inner.active == 0 and engine.manager.components["outer"].active == 0
    assert torch.equal(_output(pair.inner, x), _output(reference.inner, x))
    assert inner.trace is None and inner.traced == (mode == "group")


def test_the_hooks_time_is_the_steady_states():
    """The first call, and a call that traces new input shapes and re-plans around them, are left out of the hooks'
    time, block hooks included: warm-up and tracing are not the hooks' per-block overhead."""
    from tritoff.tiny import tiny_wan_transformer

    from .helpers import BIG_WAN

    model = tiny_wan_transformer(**BIG_WAN).eval()

    def inputs(frames, size):
        gen = torch.Generator().manual_seed(frames)
        return dict(
            hidden_states=torch.randn(1, model.config.in_channels, frames, size, size, generator=gen).bfloat16(),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 16, model.config.text_dim, generator=gen).bfloat16(),
            return_dict=False,
        )

    engine = tritoff.enable(model, mode="group", budget=12_000_000, progress=False, kernels="reference")
    stats = engine.manager.components["model"].stats
    with torch.no_grad():
        model(**inputs(2, 8))
        model(**inputs(5, 32))  # new shapes: a larger reserve, a new plan
        assert stats.replans >= 1 and stats.hook_calls == 0 and stats.hook_ns == 0
        model(**inputs(5, 32))
    # one per block (every block of a split component has its hook), of the third call only
    assert stats.hook_calls == len(engine.manager.components["model"].blocks) and stats.hook_ns > 0


def test_a_component_calling_itself_keeps_its_outer_calls_steady_flag():
    """The nested call plans nothing (the outer one did): it must not mark the outer call, which traced new shapes,
    as steady."""

    class Again(Stack):
        def forward(self, x, again=True):
            if again:
                self(x, again=False)
            return super().forward(x)

    torch.manual_seed(0)
    model = realistic_init(Again()).to(torch.bfloat16).eval()
    engine = tritoff.enable(model, mode="group", budget=2_000_000, progress=False, kernels="reference")
    stats = engine.manager.components["model"].stats
    _output(model, torch.randn(4, 16, dtype=torch.bfloat16))
    _output(model, torch.randn(64, 16, dtype=torch.bfloat16))  # new shapes, traced by the outer call
    assert stats.hook_calls == 0
    _output(model, torch.randn(64, 16, dtype=torch.bfloat16))
    assert stats.hook_calls == 2 * len(model.blocks)  # the outer call's blocks and the nested call's


def test_the_fill_time_taken_off_the_hooks_survives_phases_leaving(monkeypatch):
    """On the CPU the fills are the transfer, taken off the hooks' time: the count of it never goes back when a phase
    leaves (each phase has a Transfer of its own), so a phase evicted inside a hook cannot add its past fills to that
    hook's time; and a block called on its own that enters its phase in its hook does not count that upload."""
    from tritoff.onload import GroupRuntime

    class Pair:
        def __init__(self):
            self.components = {"first": _stack(), "second": _stack()}

    pair, x = Pair(), torch.randn(4, 16, dtype=torch.bfloat16)
    first, second = pair.components.values()
    engine = _enable(pair, _minimum(Pair()))  # one phase at a time
    upcast = GroupRuntime._upcast

    def slow_upcast(self, *args):
        time.sleep(0.02)
        return upcast(self, *args)

    monkeypatch.setattr(GroupRuntime, "_upcast", slow_upcast)
    manager = engine.manager
    for _ in range(2):
        _output(first, x)
        _output(second, x)
    filled = manager.transfer_ns
    assert filled >= 10 * 20_000_000  # every fill slept 20 ms
    manager.leave(manager.components["second"])
    assert manager.transfer_ns >= filled
    stats = manager.components["first"].stats
    calls, spent = stats.hook_calls, stats.hook_ns
    with torch.no_grad():
        first.blocks[0](first.proj_in(x))  # enters the first phase in the block's hook
    assert manager.components["first"].loaded and (stats.hook_calls, stats.hook_ns) == (calls, spent)


def test_weights_are_frozen_and_never_saved_for_backward():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    assert all(p.requires_grad for p in model.parameters())
    engine = _enable(model, _minimum(_stack()))
    assert not any(p.requires_grad for p in model.parameters())
    # grad mode on, nothing requiring grad: nothing is saved, the output is right
    assert torch.equal(model(x), reference(x))
    # an input that requires grad would make autograd keep a slot view that a later block overwrites: refused
    with pytest.raises(RuntimeError, match="autograd would save a weight that lives in a reused GPU slot"):
        model(x.clone().requires_grad_())
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # and the engine recovered
    assert engine.stats["components"]["model"]["sync_onloads"] == 0
    tritoff.disable(model)
    assert all(p.requires_grad for p in model.parameters())  # disable gives the flags back


def test_cuda_graph_capture_over_streamed_blocks_is_refused():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, _minimum(_stack()))
    with torch.no_grad():
        expected = model(x)
    manager = engine.manager
    recovered = []
    manager.recover = lambda: recovered.append(True)  # it would queue work on the capturing stream
    manager.capturing = lambda: True  # what torch.cuda.graph() makes the current stream report
    inflight = list(manager.inflight)
    for call in (lambda: model(x), lambda: model.blocks[2](torch.randn(4, 64, dtype=torch.bfloat16))):
        with torch.no_grad(), pytest.raises(RuntimeError, match="a CUDA graph cannot capture") as info:
            call()  # refused by the component's hook first, or by a streamed block called on its own
        assert "\n" not in str(info.value) and not recovered  # refused before anything changed
        assert list(manager.inflight) == inflight and manager.components["model"].active == 0
    del manager.capturing, manager.recover
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def _capturing(engine, on: bool) -> None:
    """Make ``engine`` see a CUDA graph capture (what torch.cuda.graph() makes the current stream report), or not."""
    if on:
        engine.manager.capturing = lambda: True
    else:
        del engine.manager.capturing


def test_capture_of_a_resident_component_waits_for_its_first_call():
    # a graph captured over the first call would replay its upload every time, into memory tritoff may have moved
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, 10**8)
    assert engine.plan.tier_counts("model")["bf16"] == len(model.blocks)
    _capturing(engine, True)
    for call in (lambda: model(x), lambda: model.blocks[1](torch.randn(4, 64, dtype=torch.bfloat16))):
        with pytest.raises(RuntimeError, match="model is not on the GPU yet .* run one call before capturing"):
            call()
    assert not engine.manager.components["model"].loaded
    assert engine.stats["components"]["model"]["calls"] == 0  # refused before anything was counted
    _capturing(engine, False)
    expected = _output(model, x)
    _capturing(engine, True)
    assert torch.equal(_output(model, x), expected)  # loaded, every block resident: the capture goes on


def test_capture_is_refused_where_the_components_do_not_fit_together():
    # a phase evicted when another component runs would leave a graph reading freed memory
    probe = tritoff.enable(wan(), mode="model", budget="50MB", reserve=10_000, progress=False, kernels="reference")
    budget = probe.plan.phases["transformer"].planned_bytes + probe.plan.phases["vae"].need_bytes // 2
    pipe = wan()
    engine = tritoff.enable(pipe, mode="model", budget=budget, reserve=10_000, progress=False, kernels="reference")
    assert not engine.manager.phased.together
    run(pipe, num_inference_steps=1)
    _capturing(engine, True)
    with pytest.raises(RuntimeError, match="do not fit the budget together"):
        run(pipe, num_inference_steps=1)


def test_capture_of_a_call_needing_a_larger_reserve_is_refused():
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="8MB", progress=False, kernels="reference")  # auto reserve
    expected = run(pipe)
    _capturing(engine, True)
    assert torch.equal(run(pipe), expected)  # shapes already planned for: captured as they are
    transformer = engine.stats["components"]["transformer"]
    with pytest.raises(RuntimeError, match="transformer needs a larger activation reserve for these input shapes"):
        run(pipe, height=32, width=32)
    assert engine.stats["components"]["transformer"]["replans"] == transformer["replans"]
    _capturing(engine, False)
    large = run(pipe, height=32, width=32)
    after = engine.stats["components"]["transformer"]
    assert after["replans"] > transformer["replans"]
    # every block resident: only the reserve changed, so the phase kept its buffers (nothing evicted or uploaded)
    assert after["evictions"] == transformer["evictions"] and after["pool_loads"] == transformer["pool_loads"]
    # both shapes now fit the reserve: capturing either re-plans nothing (the smaller reserve waits)
    _capturing(engine, True)
    assert torch.equal(run(pipe), expected) and torch.equal(run(pipe, height=32, width=32), large)
    assert engine.stats["components"]["transformer"]["replans"] == after["replans"]


def test_a_failed_call_under_capture_resets_only_the_hosts_bookkeeping():
    # freeing memory or waiting on the capturing stream would itself be an error there: nothing is evicted
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, 10**8)
    expected = _output(model, x)
    _capturing(engine, True)
    with pytest.raises(RuntimeError):
        _output(model, torch.randn(4, 17, dtype=torch.bfloat16))  # a shape error inside the component
    comp = engine.manager.components["model"]
    assert comp.loaded and comp.active == 0 and engine.stats["components"]["model"]["evictions"] == 0
    assert torch.equal(_output(model, x), expected)


def test_capture_over_a_table_looked_up_in_host_memory_is_refused(monkeypatch):
    from tritoff import groups

    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 8 * 1024)  # the tiny UMT5's table becomes a host group
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="1GB", progress=False, kernels="reference")
    assert engine.manager.components["text_encoder"].host
    run(pipe)
    _capturing(engine, True)
    with pytest.raises(RuntimeError, match=r"text_encoder\..* is looked up in host memory"):
        run(pipe)


def test_capture_is_checked_on_the_engines_device_not_the_current_one(monkeypatch):
    """torch reports capture for the current device's stream: an engine on cuda:1 asks with cuda:1 current (CUDA
    calls stubbed: one device, cuda:1, is capturing)."""
    import contextlib
    import types

    from tritoff.manager import HookManager

    current = [0]

    @contextlib.contextmanager
    def device(which):
        before, current[0] = current[0], torch.device(which).index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] == 1)
    on = {i: types.SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 1)}
    assert HookManager.capturing(on[1]) and not HookManager.capturing(on[0])
    current[0] = 1
    assert HookManager.capturing(on[1]) and not HookManager.capturing(on[0]) and current[0] == 1
    assert not HookManager.capturing(types.SimpleNamespace(device=torch.device("cpu")))


class _Tied(Stack):
    """Block 3 reuses block 1's first weight; ``extra``, outside the blocks, reuses block 0's last one."""

    def __init__(self):
        super().__init__()
        self.blocks[3][0].weight = self.blocks[1][0].weight
        self.extra = nn.Linear(64, 64)
        self.extra.weight = self.blocks[0][2].weight

    def forward(self, x):
        return super().forward(x) + self.head(self.extra(self.proj_in(x)))


def _tied():
    torch.manual_seed(0)
    return realistic_init(_Tied()).to(torch.bfloat16).eval()


@pytest.mark.parametrize("mode", ["group", "leaf"])
def test_weights_tied_across_blocks_stay_in_place_while_blocks_stream(mode):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_tied())
    options = dict(mode=mode, reserve=1000, progress=False, kernels="reference")
    with pytest.raises(BudgetError) as info:
        tritoff.enable(_tied(), budget=1000, **options)
    model = _tied()
    engine = tritoff.enable(model, budget=info.value.minimum, **options)
    assert engine.plan.tier_counts("model")["stream"] > 3
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "resident"])
def test_a_call_under_inference_mode_leaves_the_engine_usable_in_normal_mode(streamed):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    engine = _enable(model, _minimum(_stack()) if streamed else 10**8)
    assert engine.plan.tier_counts("model")["stream" if streamed else "bf16"] == 5
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))  # the first call: the phase is loaded under inference mode
    assert not any(p.is_inference() for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert torch.equal(model(x), reference(x))  # grad mode
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    if not streamed:  # resident weights may be saved for backward: gradients flow to the input
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        model(inputs[0]).float().sum().backward()
        reference(inputs[1]).float().sum().backward()
        assert torch.equal(inputs[0].grad, inputs[1].grad)


class _Checkpointed(Stack):
    """A Stack whose blocks are recomputed in the backward (torch.utils.checkpoint, as diffusers' gradient
    checkpointing calls it)."""

    def forward(self, x):
        x = self.proj_in(x)
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


@pytest.mark.parametrize("checkpointed", ["blocks", "component"])
def test_checkpointed_calls_recompute_with_their_resident_weights(checkpointed):
    # checkpoint ends a recompute early by raising inside it (in a block, then through the component's forward when
    # the whole component is checkpointed): not a failure that evicts the phase the backward reads
    torch.manual_seed(0)
    model = realistic_init(_Checkpointed() if checkpointed == "blocks" else Stack()).to(torch.bfloat16)
    reference = dequantize_in_place(copy.deepcopy(model))
    engine = _enable(model, 10**8)
    assert engine.plan.tier_counts("model")["bf16"] == 5

    def loss(module, x):
        if checkpointed == "component":
            return torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False).float().square().mean()
        return module(x).float().square().mean()

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    for _ in range(2):
        loss(model, inputs[0]).backward()
        loss(reference, inputs[1]).backward()
        assert torch.isfinite(inputs[0].grad).all() and torch.equal(inputs[0].grad, inputs[1].grad)
    assert engine.stats["components"]["model"]["evictions"] == 0
    assert engine.manager.components["model"].active == 0


def test_a_phase_evicted_between_a_forward_and_its_backward_is_refused_not_read_as_nan():
    # another component's call may evict this one before the backward: autograd saved weights that now point at NaN
    # placeholders, so their release counts as a write, which the backward refuses
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    engine = _enable(model, 10**8)
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    loss = model(inputs[0]).float().sum()
    engine.manager.leave(engine.manager.components["model"])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    model(inputs[0]).float().sum().backward()  # loaded again: the weights' own writes are not the user's
    reference(inputs[1]).float().sum().backward()
    assert torch.equal(inputs[0].grad, inputs[1].grad)


@pytest.mark.parametrize("name", ["head.weight", "blocks.2.0.weight"], ids=["unit", "streamed-block"])
def test_a_managed_weight_made_to_require_grad_is_refused_in_one_line(name):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    _enable(model, _minimum(_stack()))
    dict(model.named_parameters())[name].requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"model.{name} requires grad, but the weights tritoff manages are frozen"):
        model(x)
    with torch.no_grad():  # nothing is trained without grad mode: the call works, and the engine recovered
        assert torch.equal(model(x), reference(x))
    with torch.inference_mode():  # nor under inference mode, which the hooks leave with grad mode kept off
        assert torch.equal(model(x), reference(x))


def test_a_module_list_root_prefetches_its_blocks_in_module_order():
    def blocks():
        torch.manual_seed(0)
        return realistic_init(nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)))

    def run(model, x):
        for block in model:  # the root itself is never called
            x = x + block(x)
        return x

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    reference = dequantize_in_place(blocks().to(torch.bfloat16))
    model = blocks().to(torch.bfloat16)
    engine = _enable(model, _minimum(blocks().to(torch.bfloat16)))
    assert engine.plan.tier_counts("model")["stream"] == 6
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(run(model, x), run(reference, x))
    assert engine.stats["components"]["model"]["sync_onloads"] == 1  # only the very first block


def test_calls_from_two_threads_take_turns():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    with torch.no_grad():
        expected = reference(x)
    model = _stack()
    _enable(model, _minimum(_stack()))
    outputs = []

    def work():
        for _ in range(6):
            with torch.no_grad():
                outputs.append(model(x))

    assert not in_threads(work, 2) and len(outputs) == 12
    assert all(torch.equal(out, expected) for out in outputs)


@pytest.mark.parametrize("error", [Boom("no room for the third upload"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_phase_entry_that_fails_part_way_frees_what_it_allocated(monkeypatch, error):
    from tritoff.transfer import Transfer

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    reference = dequantize_in_place(_stack())
    model = _stack()
    engine = _enable(model, int(1.5 * _minimum(_stack())))
    comp = engine.manager.components["model"]
    tiers = engine.plan.tier_counts("model")
    assert tiers["stream"] and tiers["stream"] < 5  # some blocks resident: entering the phase uploads several groups
    fill, upload, calls = Transfer.fill, Transfer.upload, []

    def failing(original):
        def step(self, *args, **kwargs):
            calls.append(original.__name__)
            if len(calls) == 3:
                raise error
            return original(self, *args, **kwargs)

        return step

    monkeypatch.setattr(Transfer, "fill", failing(fill))
    monkeypatch.setattr(Transfer, "upload", failing(upload))
    with torch.no_grad(), pytest.raises(type(error)):
        model(x)
    assert len(calls) == 3 and not comp.loaded and comp.transfer is None
    # nothing half-loaded stays referenced: the next entry allocates afresh
    assert all(g.buffer is None and g.device_pack is None and g.slot is None for g in comp.groups)
    monkeypatch.setattr(Transfer, "fill", fill)
    monkeypatch.setattr(Transfer, "upload", upload)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))


def test_streamed_blocks_lend_their_modules_slot_parameters_for_one_forward():
    """A streamed block's modules hold parameters viewing its ring slot during its forward and the block's own
    parameters (placeholders) otherwise; a parameter tied between two of its layers is one parameter in both."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)

    def tied():
        model = _stack()
        for block in model.blocks:
            block[2].weight = block[0].weight
        return model

    expected = _output(dequantize_in_place(tied()), x)
    model = tied()
    own = [(block[0].weight, block[0].bias, block[2].bias) for block in model.blocks]
    engine = _enable(model, _minimum(tied()))
    assert engine.plan.tier_counts("model")["stream"] == 5
    seen = []

    for block in model.blocks:  # the GELU runs between the block's hooks
        block[1].register_forward_pre_hook(lambda _, args, b=block: seen.append((b[0].weight, b[2].weight, b[0].bias)))
    for _ in range(2):
        assert torch.equal(_output(model, x), expected)
    slots = {b.untyped_storage().data_ptr() for b in engine.manager.components["model"].ring.buffers}
    for weight, tied_weight, bias in seen:
        assert weight is tied_weight and not is_placeholder(weight) and not is_placeholder(bias)
        assert weight.untyped_storage().data_ptr() in slots and not weight.requires_grad
    for block, (weight, bias, bias_2) in zip(model.blocks, own, strict=True):
        assert block[0].weight is weight and block[2].weight is weight and block[0].bias is bias
        assert block[2].bias is bias_2 and is_placeholder(weight)


def test_a_parameter_replaced_after_enable_is_refused_and_kept():
    model, _, x, expected = _streamed_stack()
    block = model.blocks[1]
    own = {name: p for name, p in block.named_parameters()}
    mine = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False)
    block[2].weight = mine  # after the layer before it in the block: that one is bound first, then undone
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.1\.2\.weight was replaced or deleted") as info:
        _output(model, x)
    assert "\n" not in str(info.value) and "tritoff.disable" in str(info.value)
    assert block[2].weight is mine  # the caller's parameter is not overwritten
    assert block[0].weight is own["0.weight"] and block[0].bias is own["0.bias"]  # the partial bind undone
    block[2].weight = own["2.weight"]
    assert torch.equal(_output(model, x), expected)


def test_a_resident_parameter_replaced_after_enable_is_refused():
    """Resident blocks and the rest of a component bind once: the component's next forward refuses the replacement
    (the module would otherwise compute with it while tritoff holds the weight)."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, "1GB")
    assert engine.plan.tier_counts("model")["bf16"] == 5
    _output(model, x)
    own = model.head.weight
    model.head.weight = nn.Parameter(torch.randn(16, 64, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"^model\.head\.weight was replaced or deleted after tritoff\.enable"):
        _output(model, x)
    model.head.weight = own
    weight = model.blocks[3][0].weight
    with pytest.raises(RuntimeError, match=r"^load_state_dict naming model\.blocks\.3\.0\.weight: the weights live"):
        model.blocks[3][0].load_state_dict(
            {"weight": torch.randn(64, 64, dtype=torch.bfloat16), "bias": torch.randn(64, dtype=torch.bfloat16)},
            assign=True,
        )  # refused before it replaces anything
    assert model.blocks[3][0].weight is weight
    _output(model, x)


def test_a_resident_block_called_on_its_own_refuses_a_replaced_parameter():
    """A resident block called directly (outside its component's forward, whose hook checks the resident groups) checks
    its own parameters before it computes."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    engine = _enable(model, "1GB")
    assert engine.plan.tier_counts("model")["bf16"] == 5
    _output(model, x)
    block = model.blocks[2]
    hidden = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = block(hidden)
    own = block[0].weight
    block[0].weight = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.2\.0\.weight was replaced or deleted"):
        block(hidden)
    block[0].weight = own
    assert torch.equal(block(hidden), expected)


def _stack_in_tier(budget: str):
    """An enabled Stack whose blocks are all ``streamed`` or all ``resident``, an input, and the dequantized output,
    which its first call gives."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = _output(dequantize_in_place(_stack()), x)
    model = _stack()
    engine = _enable(model, _minimum(_stack()) if budget == "streamed" else "1GB")
    assert engine.plan.tier_counts("model")["stream" if budget == "streamed" else "bf16"] == 5
    assert torch.equal(_output(model, x), expected)
    return model, x, expected


@pytest.mark.parametrize("budget", ["streamed", "resident"])
def test_a_parameter_written_in_place_after_enable_is_refused(budget):
    """``nn.init`` or ``fill_`` on a managed weight writes its placeholder's shared scalar (overlap stops most in-place
    writes, not fills) or a resident buffer, never the packs: the next forward refuses it, the scalar is put back,
    and disable gives the packed weights back."""
    model, x, expected = _stack_in_tier(budget)
    with torch.no_grad():
        nn.init.constant_(model.blocks[2][0].weight, 1.0)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.2\.0\.weight was written in place after tritoff"):
        _output(model, x)
    if budget == "streamed":
        assert model.blocks[2][2].weight.isnan().all()  # the scalar its placeholder shares holds NaN again
    tritoff.disable(model)
    assert torch.equal(_output(model, x), expected)


@pytest.mark.parametrize("hooked", [1, 3, 4], ids=["before-its-block", "its-block", "after-its-block"])
def test_a_parameter_written_in_place_during_a_call_is_refused_before_the_call_returns(hooked):
    # a forward pre-hook of a block writes block 3's weight: before block 3 is bound, as it is, or after it ran
    model, _, x, expected = _streamed_stack()
    _output(model, x)

    def write(module, args):
        with torch.no_grad():
            model.blocks[3][0].weight.fill_(1.0)

    handle = model.blocks[hooked].register_forward_pre_hook(write)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.3\.0\.weight was written in place after tritoff"):
        _output(model, x)
    handle.remove()
    assert model.blocks[1][2].weight.isnan().all()  # the scalar every placeholder shares holds NaN again
    tritoff.disable(model)
    assert torch.equal(_output(model, x), expected)


@pytest.mark.parametrize("called", ["model", "block"])
def test_a_streamed_weight_written_in_place_while_its_block_runs_is_refused_in_that_call(called):
    # a pre-hook of a layer inside the block: the block holds its slot's parameters there, and the write lands in the
    # slot, which computed with it and which the next load overwrites from the packs
    model, _, x, expected = _streamed_stack()
    _output(model, x)

    def write(module, args):
        with torch.no_grad():
            module.weight.fill_(1.0)

    handle = model.blocks[3][0].register_forward_pre_hook(write)
    with pytest.raises(RuntimeError, match=r"^a weight of model\.blocks\.3 was written in place during its forward"):
        if called == "model":
            _output(model, x)
        else:
            _output(model.blocks[3], torch.randn(4, 64, dtype=torch.bfloat16))
    handle.remove()
    for _ in range(3):  # every slot comes round: none keeps the write
        assert torch.equal(_output(model, x), expected)


def test_a_write_through_a_slot_parameter_kept_from_another_block_is_refused_in_that_call():
    # a hook keeps block 0's first weight (a view of the slot block 0 ran in); block 2's hook writes through it while
    # that slot holds a block loaded ahead, which would compute with the write
    model, _, x, expected = _streamed_stack()
    _output(model, x)
    kept = {}

    def keep_weight(module, args):
        kept.setdefault("weight", module.weight)

    keep = model.blocks[0][0].register_forward_pre_hook(keep_weight)

    def write(module, args):
        with torch.no_grad():
            kept["weight"].fill_(1.0)

    handle = model.blocks[2].register_forward_pre_hook(write)
    with pytest.raises(RuntimeError, match=r"^a weight of model\.blocks\.\d was written in place during its forward"):
        _output(model, x)
    keep.remove()
    handle.remove()
    assert torch.equal(_output(model, x), expected)


@pytest.mark.parametrize("budget", ["streamed", "resident"])
@pytest.mark.parametrize("called", ["model", "block"])
def test_a_parameter_given_new_data_after_enable_is_refused(budget, called):
    """``param.data = tensor`` neither writes in place (no version bump) nor replaces the parameter: the next forward
    (of the component, or of the block called on its own) refuses it, and disable gives the packed weights back."""
    model, x, expected = _stack_in_tier(budget)
    model.blocks[2][2].weight.data = torch.ones(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.2\.2\.weight was given new data") as info:
        if called == "model":
            _output(model, x)
        else:
            _output(model.blocks[2], torch.randn(4, 64, dtype=torch.bfloat16))
    assert "\n" not in str(info.value) and "tritoff.disable" in str(info.value)
    with pytest.raises(RuntimeError, match="was given new data"):
        _output(model, x)  # it stays refused: the packs still hold the old weight
    tritoff.disable(model)
    assert torch.equal(_output(model, x), expected)


def test_new_data_given_to_a_slot_parameter_during_a_forward_is_refused_and_put_back():
    # a forward hook sets .data on what the module holds while its block streams: a slot's parameter, which every
    # block of the same shape landing in that slot shares; the call is refused and the slot gets its view back
    model, engine, x, expected = _streamed_stack()
    _output(model, x)

    def hook(module, args):
        module.weight.data = torch.zeros(64, 64, dtype=torch.bfloat16)

    handle = model.blocks[2][0].register_forward_pre_hook(hook)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.\d\.0\.weight was given new data .* during a forward"):
        _output(model, x)
    handle.remove()
    for _ in range(3):  # each block passes through each slot
        assert torch.equal(_output(model, x), expected)
    handle = model.blocks[2][0].register_forward_pre_hook(hook)
    with pytest.raises(RuntimeError, match="during a forward"):  # the block called on its own checks too
        _output(model.blocks[2], torch.randn(4, 64, dtype=torch.bfloat16))
    handle.remove()
    assert torch.equal(_output(model, x), expected)


def test_new_data_put_back_before_any_load_is_not_refused():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = _stack()
    _enable(model, "1GB")
    expected = _output(model, x)
    weight = model.blocks[2][0].weight
    old = weight.data
    weight.data = torch.zeros(64, 64, dtype=torch.bfloat16)
    weight.data = old
    assert torch.equal(_output(model, x), expected)


@pytest.mark.parametrize("how", ["data", "parameter"])
def test_a_re_plan_that_packs_again_refuses_a_weight_changed_since(how):
    # switching to leaf groups packs the weights again from what disable gives back: a weight changed since enable
    # is refused first, as a re-plan keeping the packs does
    model, _, x, expected = _streamed_stack()
    _output(model, x)
    mine = torch.zeros(64, 64, dtype=torch.bfloat16)
    if how == "data":
        model.blocks[2][0].weight.data = mine
    else:
        model.blocks[2][0].weight = nn.Parameter(mine, requires_grad=False)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.2\.0\.weight was (given new data|replaced or deleted)"):
        tritoff.enable(model, mode="leaf", budget="1GB", reserve=1000, progress=False, kernels="reference")
    assert model._tritoff_engine.options.mode == "group"  # nothing changed


@pytest.mark.parametrize("budget", ["streamed", "resident"])
def test_a_block_called_on_its_own_checks_the_weights_it_shares_with_the_rest(budget):
    # block 3 reuses block 1's first weight: tied weights live with the rest of the component, not with the block
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    options = dict(mode="group", reserve=1000, progress=False, kernels="reference")
    with pytest.raises(BudgetError) as info:
        tritoff.enable(_tied(), budget=1000, **options)
    model = _tied()
    tritoff.enable(model, budget=info.value.minimum if budget == "streamed" else "1GB", **options)
    _output(model, x)
    model.blocks[1][0].weight.data = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.1\.0\.weight was given new data"):
        _output(model.blocks[3], torch.randn(4, 64, dtype=torch.bfloat16))


def test_new_data_given_to_a_loaded_phase_is_refused_after_an_eviction_dropped_it():
    # the VAE's phase, loaded by the last call, is evicted when the transformer runs (the phases do not fit together);
    # the eviction points its parameters at placeholders again, which would drop the new data silently
    probe = tritoff.enable(wan(), mode="model", budget="50MB", reserve=10_000, progress=False, kernels="reference")
    budget = probe.plan.phases["transformer"].planned_bytes + probe.plan.phases["vae"].need_bytes // 2
    expected = run(dequantized_pipeline(wan))
    pipe = wan()
    engine = tritoff.enable(pipe, mode="model", budget=budget, reserve=10_000, progress=False, kernels="reference")
    assert torch.equal(run(pipe), expected)
    assert engine.manager.components["vae"].loaded
    weight = pipe.vae.post_quant_conv.weight
    weight.data = torch.zeros_like(weight)
    with pytest.raises(RuntimeError, match=r"^vae\.post_quant_conv\.weight was given new data"):
        run(pipe)
    assert engine.stats["components"]["transformer"]["calls"] > 0  # refused at the VAE's call, after the eviction
    tritoff.disable(pipe)
    assert torch.equal(run(pipe), expected)


def test_disable_puts_back_a_placeholder_scalar_a_fill_wrote_and_no_forward_refused():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    other, model = _stack(), _stack()
    _enable(other, _minimum(_stack()))
    _enable(model, _minimum(_stack()))
    with torch.no_grad():
        model.blocks[0][0].weight.fill_(1.0)  # the scalar behind every bf16 placeholder, in both engines
    assert not other.blocks[0][0].weight.isnan().any()
    tritoff.disable(model)
    assert other.blocks[0][0].weight.isnan().all()
    assert torch.equal(_output(model, x), _output(dequantize_in_place(_stack()), x))


def test_a_deleted_parameter_is_refused_and_an_interrupted_bind_is_undone(monkeypatch):
    from tritoff.slots import SlotRing

    model, _, x, expected = _streamed_stack()
    block = model.blocks[1]
    own = block[2].weight
    del block[2].weight  # what registering a parametrization does
    with pytest.raises(RuntimeError, match=r"^model\.blocks\.1\.2\.weight was replaced or deleted"):
        _output(model, x)
    assert "weight" not in block[2]._parameters and block[0].weight is not None and is_placeholder(block[0].weight)
    block[2].weight = own
    assert torch.equal(_output(model, x), expected)

    class Interrupting(list):  # a Ctrl-C arriving after the first parameter was stored
        def __iter__(self):
            yield self[0]
            raise KeyboardInterrupt

    original = SlotRing.parameters

    def interrupting(ring, group):
        slot = original(ring, group)
        return slot._replace(params=Interrupting(slot.params))

    monkeypatch.setattr(SlotRing, "parameters", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _output(model, x)
    monkeypatch.setattr(SlotRing, "parameters", original)
    assert all(is_placeholder(p) for p in model.blocks.parameters() if p.dim() == 2)
    assert torch.equal(_output(model, x), expected)


def test_disable_after_a_refused_replacement_leaves_the_new_parameter_as_it_is():
    model, _, x, expected = _streamed_stack()
    mine = nn.Parameter(torch.full((64, 64), 7.0, dtype=torch.bfloat16), requires_grad=False)
    model.blocks[1][2].weight = mine
    with pytest.raises(RuntimeError, match="was replaced or deleted"):
        _output(model, x)
    with pytest.raises(RuntimeError, match="was replaced or deleted"):  # a re-plan refuses it too, changing nothing
        _enable(model, "1GB")
    tritoff.disable(model)
    assert model.blocks[1][2].weight is mine and bool((mine == 7).all())
    model.blocks[1][2].weight = nn.Parameter(dequantize_in_place(_stack()).blocks[1][2].weight.detach())
    assert torch.equal(_output(model, x), expected)


def test_a_block_moved_or_cast_on_its_own_is_refused_before_anything_changes():
    model, _, x, expected = _streamed_stack()
    for cast in (lambda: model.blocks[1].float(), lambda: model.blocks[1][2].to(torch.float16)):
        with pytest.raises(RuntimeError, match=r"moving or casting model\.blocks\.1(\.2)? to torch\.float") as info:
            cast()
        assert "\n" not in str(info.value)
    assert all(is_placeholder(p) and p.dtype == torch.bfloat16 for p in model.blocks[1].parameters())
    model.blocks[1].to("cpu")  # where it computes already: nothing to refuse
    assert torch.equal(_output(model, x), expected)
    tritoff.disable(model)
    model.blocks[1].float()  # an ordinary module again
    assert model.blocks[1][0].weight.dtype == torch.float32


def test_a_call_the_budget_cannot_plan_for_warns_once_per_input_shape():
    """Enabled at the smallest budget (named for the default reserve), a call whose traced activations do not fit
    warns with the budget that would; the same shapes again change nothing, so they do not warn again."""
    import warnings

    model = tiny_umt5()
    with pytest.raises(BudgetError) as info:
        tritoff.enable(model, mode="group", budget=1, progress=False)
    tritoff.enable(model, mode="group", budget=info.value.minimum, progress=False)
    gen = torch.Generator().manual_seed(0)
    short, long = (torch.randint(3, 256, (1, n), generator=gen) for n in (12, 40))
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for ids in (short, short, short, long, long):
            model(input_ids=ids)
    warned = [w for w in seen if "of activations, more than the budget leaves" in str(w.message)]
    assert len(warned) == 2, [str(w.message) for w in warned]
    assert all("the smallest that works is" in str(w.message) for w in warned)
    assert all(w.filename == __file__ for w in warned)  # the caller's line, not a frame inside torch's module call


def test_a_decode_the_budget_cannot_plan_for_suggests_tiles_until_they_are_on():
    import warnings

    pipe = wan()
    with pytest.raises(BudgetError) as info:
        tritoff.enable(pipe, mode="group", budget=1, progress=False, kernels="reference")
    tritoff.enable(pipe, mode="group", budget=info.value.minimum, progress=False, kernels="reference")
    latent = torch.randn(1, pipe.vae.config.z_dim, 3, 48, 48, dtype=pipe.vae.dtype)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        pipe.vae.decode(latent)
        tiles = dict(tile_sample_min_height=64, tile_sample_min_width=64)
        pipe.vae.enable_tiling(**tiles, tile_sample_stride_height=48, tile_sample_stride_width=48)
        pipe.vae.decode(latent)
    warned = [str(w.message) for w in seen if "of activations, more than the budget leaves" in str(w.message)]
    assert len(warned) == 2 and all(m.startswith("vae: ") for m in warned), warned
    assert warned[0].endswith("raise the budget, decode in tiles (vae.enable_tiling()), or lower frames or resolution")
    assert "enable_tiling" not in warned[1]  # tiling is on: the tiles' activations still need more
    tritoff.disable(pipe)
    vae = wan().vae  # enabled on its own: the hint names no variable the caller does not have
    with pytest.raises(BudgetError) as info:
        tritoff.enable(vae, mode="group", budget=1, progress=False, kernels="reference")
    tritoff.enable(vae, mode="group", budget=info.value.minimum, progress=False, kernels="reference")
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        vae.decode(latent)
    assert any("decode in tiles (enable_tiling() on the VAE)" in str(w.message) for w in seen)


@pytest.mark.parametrize("budget", ["4.5MB", "5MB", "5.7MB"])
def test_a_loaded_phase_entered_with_a_larger_reserve_makes_room_for_it(budget):
    # the VAE, still loaded from the last call, decodes a larger video: its reserve grew while the other phases
    # were admitted beside it, so entering it must evict them until everything fits the budget again
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget=budget, progress=False, kernels="reference")  # auto reserve
    manager, within = engine.manager, []
    enter = manager.enter

    def checked(comp):
        enter(comp)
        held = manager.residency.held(manager.components.values())
        within.append(held + manager.residency.fixed + comp.plan.reserve <= manager.residency.budget)

    manager.enter = checked
    expected = run(dequantized_pipeline(wan), height=48, width=48)
    run(pipe)
    assert torch.equal(run(pipe, height=48, width=48), expected)
    assert within and all(within)


def test_whether_the_phases_fit_together_follows_their_re_plans():
    # enabled with reserves of a tenth of the budget, the phases do not fit together; the first call re-plans the
    # transformer and text encoder around their estimated activations, after which they do: the plan and the report
    # say what holds now, not what held at enable
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="7MB", progress=False, kernels="reference")
    phased = engine.manager.phased
    assert not phased.together and "all fit at once" not in engine.report()
    run(pipe)
    assert engine.stats["components"]["transformer"]["replans"] == 1
    held = sum(p.need_bytes for p in phased.phases.values()) + phased.fixed_bytes
    assert held + max(p.reserve for p in phased.phases.values()) <= phased.budget
    assert phased.together and "all fit at once" in engine.report()


def test_an_exception_in_a_vae_decode_gives_back_what_a_retry_needs():
    """diffusers calls the VAE's decode without its forward (no forward guard): an out-of-memory error there, caught
    to retry with tiling, still finds every phase evicted, and the retry decodes exactly."""
    reference = dequantized_pipeline(wan)
    expected = run(reference)
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference")
    decoder = pipe.vae.decoder
    decode = decoder.forward

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    decoder.forward = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        run(pipe)
    del decoder.forward
    assert decoder.forward == decode
    components = engine.manager.components.values()
    assert not any(c.loaded or c.active for c in components) and not engine.manager.inflight
    assert torch.equal(run(pipe), expected)


def test_a_block_that_catches_another_components_exception_keeps_its_weights():
    """A streamed block calling a component that raises, and going on: its slot stays bound (only the slot of the
    block the exception left is freed)."""

    class CallingBlock(nn.Module):
        def __init__(self, width=64):
            super().__init__()
            self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
            object.__setattr__(self, "other", None)  # called, not owned

        def forward(self, x):
            h = torch.nn.functional.gelu(self.a(x))
            if self.other is not None:
                try:
                    h = h + 0 * self.other(h[:, :16]).sum()
                except RuntimeError:
                    pass
            return self.b(h)

    class Failing(Stack):
        def forward(self, x):
            x = self.proj_in(x)
            x = x + self.blocks[0](x)
            raise RuntimeError("in the called component")

    class Pair:
        def __init__(self):
            torch.manual_seed(0)
            self.caller = realistic_init(Stack()).to(torch.bfloat16).eval()
            self.caller.blocks = nn.ModuleList(realistic_init(CallingBlock()).to(torch.bfloat16) for _ in range(5))
            torch.manual_seed(1)
            self.failing = realistic_init(Failing()).to(torch.bfloat16).eval()
            object.__setattr__(self.caller.blocks[1], "other", self.failing)

        @property
        def components(self):
            return {"caller": self.caller, "failing": self.failing}

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = _output(Pair().caller, x)
    pair = Pair()
    options = dict(storage="bf16", mode="group", reserve=1000, progress=False, kernels="reference")
    with pytest.raises(BudgetError) as info:
        tritoff.enable(Pair(), budget=1000, **options)
    engine = tritoff.enable(pair, budget=info.value.minimum, **options)
    assert engine.manager.components["caller"].blocks[1].tier == "stream"
    for _ in range(2):
        assert torch.equal(_output(pair.caller, x), expected)


def test_a_call_key_names_its_keyword_arguments_and_takes_any_tensor():
    from tritoff.manager import _call_key

    x = torch.randn(4, 16)
    # which keyword carries a value can change which blocks run
    assert _call_key((x,), dict(skip=[4])) != _call_key((x,), dict(order=[4]))
    assert _call_key((x,), dict(a=1, b=True)) == _call_key((x,), dict(b=True, a=1))
    assert _call_key((x,), dict(skip=[4])) != _call_key((x,), dict(skip=[3]))
    assert _call_key((x,), dict(scale=0.5)) == _call_key((x,), dict(scale=0.7))  # a float by its type only
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])  # it has no single shape
    assert _call_key((nested,), {}) == _call_key((torch.nested.nested_tensor([torch.randn(5, 4)]),), {})


def _calls_the_text_encoder(pipe):
    """A layer of the transformer that calls the text encoder inside the transformer's forward."""
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    pipe.transformer.blocks[0].register_forward_pre_hook(lambda module, args: pipe.text_encoder(ids) and None)
    return pipe


def test_a_component_moving_whole_stays_loaded_while_a_component_it_calls_runs():
    # mode='model', each phase fits alone but not both: the text encoder entering inside the transformer's forward
    # must not evict the transformer, whose layers after the call would compute with placeholders
    options = dict(mode="model", reserve=10_000, kernels="reference", progress=False)
    phases = tritoff.enable(wan(), budget="50MB", **options).plan.phases
    budget = phases["transformer"].planned_bytes + phases["text_encoder"].need_bytes // 2
    expected = run(_calls_the_text_encoder(dequantized_pipeline(wan)), output_type="latent", num_inference_steps=2)
    pipe = _calls_the_text_encoder(wan())
    engine = tritoff.enable(pipe, budget=budget, **options)
    assert torch.equal(run(pipe, output_type="latent", num_inference_steps=2), expected)
    assert engine.stats["components"]["transformer"]["evictions"] == 0


def test_the_activation_estimate_reported_is_the_latest_calls():
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", budget="5MB", kernels="reference", progress=False)
    seen = []
    for size in (16, 32, 16):
        run(pipe, height=size, width=size, num_inference_steps=1)
        seen.append(engine.stats["components"]["transformer"]["activation_estimate_bytes"])
    assert seen[0] != seen[1] and seen[2] == seen[0]


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.ff = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.ff(x + self.attn(x, x, x, need_weights=False)[0])


def test_multihead_attention_streams_in_leaf_mode_exactly():
    # its out_proj is read, never called: in leaf mode it moves with the rest, not as a layer of its own
    def model():
        torch.manual_seed(0)
        return realistic_init(torch.nn.Sequential(_Attention(), _Attention(), torch.nn.Linear(16, 16))).eval()

    x = torch.randn(1, 3, 16)
    reference = dequantize_in_place(model())
    enabled = model()
    engine = enable_at_minimum(enabled, 1000, mode="leaf", reserve=1000, progress=False, kernels="reference")
    assert engine.plan.tier_counts("model")["stream"] > 0
    for _ in range(2):
        assert torch.equal(_output(enabled, x), _output(reference, x))


def test_a_layer_read_but_never_called_in_leaf_mode_names_model_mode():
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):  # the layer's weight read directly: its hook never runs
            return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)

    torch.manual_seed(0)
    model = realistic_init(torch.nn.Sequential(Reads(), Reads())).to(torch.bfloat16).eval()
    enable_at_minimum(model, 1000, mode="leaf", reserve=1000, progress=False, kernels="reference")
    with pytest.raises(RuntimeError, match=r"^model's forward called none of its layers \(0.proj, ...\).*'model'") as e:
        _output(model, torch.randn(4, 16, dtype=torch.bfloat16))
    assert "'leaf'" not in str(e.value)


def test_transformer_encoder_layers_stream_in_leaf_mode_exactly():
    # PyTorch's fast path in eval reads every layer of an encoder layer without calling it: in leaf mode they move
    # with the rest, not as layers of their own (whose hooks never ran: NaN, silently, beside the layers called)
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(3)]
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), *layers, torch.nn.Linear(32, 32)).eval()
    x = torch.randn(2, 5, 32)
    expected = _output(model, x)
    options = dict(mode="leaf", storage="bf16", reserve=1000, progress=False, kernels="reference")
    engine = enable_at_minimum(model, 1000, **options)
    assert engine.plan.tier_counts("model")["stream"] > 0
    for _ in range(2):
        assert torch.equal(_output(model, x), expected)

"""tritoff/rehold.py: after a re-plan, the packs worth holding come into host memory in place of others.

The scenario: Wan 2.2's two experts, enable planned with its own reserve (three blocks of twelve streamed in each), the
host budget holding exactly those streamed blocks. The first call's traced reserve is larger and streams six blocks
of each: the first expert, called at most of the steps, then reads three of its streamed blocks from disk at every
call unless they take the place of the second expert's.
"""

import errno
import warnings

import pytest
import torch

import tritoff
from tritoff import disk, rehold
from tritoff.arena import PAGE
from tritoff.engine import Engine
from tritoff.pack import align
from tritoff.tiny import tiny_wan_pipeline

from .helpers import BIG_WAN, WAN_CALL

pytestmark = [
    pytest.mark.filterwarnings("ignore:no CUDA device"),
    # the tiny VAE decodes the call's video whole, over the budget: not what is tested here
    pytest.mark.filterwarnings("ignore:vae. this call needs"),
]

# a call whose traced reserve is larger than enable's (10% of the budget); 8 steps, 7 of them the first expert's
CALL = {**WAN_CALL, "height": 192, "width": 192, "num_inference_steps": 8}
BUDGET = "8MB"


def _pipe():
    pipe = tiny_wan_pipeline(two_experts=True, **{**BIG_WAN, "num_layers": 12})
    pipe.register_to_config(boundary_ratio=0.5)
    return pipe


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, mode="group", budget=BUDGET, progress=False, kernels="reference", **kwargs)


def _run(pipe):
    return pipe(**CALL, generator=torch.Generator().manual_seed(0)).frames


def _streamed(engine, name):
    return {g for g, tier in engine.plan.phases[name].tiers[name].items() if tier == "stream"}


def _held(engine, name):
    return {p.name for p in engine.packed[name].packs if not p.on_disk}


def _block_bytes(engine):
    return align(engine.packed["transformer"].packs[0].layout.nbytes, PAGE)


@pytest.fixture(scope="module")
def expected():
    return _run_enabled(_pipe(), None)


def _run_enabled(pipe, engine_kwargs):
    _enable(pipe, **(engine_kwargs or {}))
    return _run(pipe)


def _scenario(tmp_path):
    """The pipeline enabled with a host budget of exactly the blocks enable streams."""
    pipe = _pipe()
    probe = _enable(_pipe())
    streamed = len(_streamed(probe, "transformer")) + len(_streamed(probe, "transformer_2"))
    engine = _enable(pipe, host_budget=streamed * _block_bytes(probe), spill_dir=str(tmp_path))
    return pipe, engine


def _second_run_reads(pipe, engine):
    before = dict(engine.disk.bytes_read)
    frames = _run(pipe)
    return frames, {name: n - before.get(name, 0) for name, n in engine.disk.bytes_read.items()}


def test_blocks_a_replan_streams_come_into_memory_in_place_of_the_second_experts(tmp_path, expected):
    pipe, engine = _scenario(tmp_path)
    first, second = _streamed(engine, "transformer"), _streamed(engine, "transformer_2")
    assert first <= _held(engine, "transformer") and second <= _held(engine, "transformer_2")
    arena = engine.stats["total"]["host_arena_bytes"]
    held = {name: c["host_held_pack_bytes"] for name, c in engine.stats["components"].items()}

    assert torch.equal(_run(pipe), expected)  # the first call re-plans both experts: each streams more blocks
    more = _streamed(engine, "transformer")
    assert len(more) > len(first) and len(_streamed(engine, "transformer_2")) > len(second)
    # every block the first expert streams is held now; the second's gave their places
    assert more <= _held(engine, "transformer")
    moved = len(more) - len(first)
    assert len(_held(engine, "transformer_2") & second) == len(second) - moved
    stats = engine.stats["total"]
    assert stats["reheld_bytes"] == moved * engine.packed["transformer"].packs[0].layout.nbytes
    assert stats["host_arena_bytes"] == arena  # in place: the memory held does not grow
    components = engine.stats["components"]  # the report's "held" follows the packs, not the arenas they lie in
    assert components["transformer"]["host_held_pack_bytes"] == held["transformer"] + moved * _block_bytes(engine)
    assert components["transformer_2"]["host_held_pack_bytes"] == held["transformer_2"] - moved * _block_bytes(engine)
    assert "moved into memory after re-plans" in engine.report()

    frames, reads = _second_run_reads(pipe, engine)
    assert torch.equal(frames, expected)
    assert engine.stats["total"]["reheld_bytes"] == stats["reheld_bytes"]  # the same shapes: nothing moves again
    # against the placement enable made, kept: fewer bytes read from disk per run
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(Engine, "_rehold", lambda self, name: None)
    try:
        kept_pipe, kept = _scenario(tmp_path)
        assert torch.equal(_run(kept_pipe), expected)
        kept_frames, kept_reads = _second_run_reads(kept_pipe, kept)
    finally:
        monkeypatch.undo()
    assert torch.equal(kept_frames, expected)
    assert sum(reads.values()) < 0.8 * sum(kept_reads.values())


def test_from_a_store_the_store_file_serves_what_leaves(tmp_path, expected):
    store = tmp_path / "store"
    probe = _enable(_pipe())
    probe.save(store)
    streamed = len(_streamed(probe, "transformer")) + len(_streamed(probe, "transformer_2"))
    pipe = _pipe()
    engine = _enable(pipe, store=str(store), host_budget=streamed * _block_bytes(probe))
    files = sorted(store.iterdir())
    assert torch.equal(_run(pipe), expected)
    assert engine.stats["total"]["reheld_bytes"] > 0
    assert _streamed(engine, "transformer") <= _held(engine, "transformer")
    assert not any(p.file.spill for packed in engine.packed.values() for p in packed.packs)  # nothing written
    assert sorted(store.iterdir()) == files
    assert torch.equal(_run(pipe), expected)


def test_a_full_disk_while_a_pack_leaves_changes_nothing_and_warns(tmp_path, expected, monkeypatch):
    pipe, engine = _scenario(tmp_path)
    placed = {name: _held(engine, name) for name in engine.packed}

    def full(self, position, data):
        raise OSError(errno.ENOSPC, f"no space left on the disk of {self.path} {self.no_space}")

    monkeypatch.setattr(disk.PackFile, "write_at", full)
    with pytest.warns(UserWarning, match="could not move packs between host memory and disk.*no space left") as said:
        frames = _run(pipe)
    assert torch.equal(frames, expected)
    assert {name: _held(engine, name) for name in engine.packed} == placed
    assert engine.stats["total"]["reheld_bytes"] == 0
    # said once: the next re-plans (the second expert's, the next calls') would try the same moves, failing again
    assert len([w for w in said if "could not move packs" in str(w.message)]) == 1
    tried = []
    monkeypatch.setattr(rehold, "plan_moves", lambda *args: tried.append(args) or [])
    assert rehold.rehold(engine, "transformer") == 0 and not tried
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_run(pipe), expected)


def test_a_read_error_for_the_arriving_pack_puts_the_leaving_one_back(tmp_path, expected, monkeypatch):
    pipe, engine = _scenario(tmp_path)
    placed = {name: _held(engine, name) for name in engine.packed}
    arriving = {id(p) for p in engine.packed["transformer"].packs if p.on_disk}
    read = disk.PackFile.read

    def failing(self, pack, out, recheck=False):
        if id(pack) in arriving and out.data_ptr() not in {b.view.data_ptr() for b in engine.disk.buffers}:
            raise OSError(errno.EIO, "Input/output error")
        return read(self, pack, out, recheck)

    monkeypatch.setattr(disk.PackFile, "read", failing)
    with pytest.warns(UserWarning, match="could not move packs.*Input/output error"):
        frames = _run(pipe)
    assert torch.equal(frames, expected)  # the leaving pack's bytes came back from the spill file it was written to
    assert {name: _held(engine, name) for name in engine.packed} == placed


def test_a_pack_a_fused_lora_rewrote_never_leaves(tmp_path):
    from tritoff.rehold import _may_leave

    store = tmp_path / "store"
    probe = _enable(_pipe())
    probe.save(store)
    engine = _enable(_pipe(), store=str(store), host_budget=4 * _block_bytes(probe))
    held = next(p for p in engine.packed["transformer"].packs if not p.on_disk)
    assert _may_leave(engine, held)
    held.rewritten = True  # as lora's fuse marks it
    assert not _may_leave(engine, held)


def test_nothing_moves_inside_another_components_forward(tmp_path):
    from tritoff.rehold import rehold

    pipe, engine = _scenario(tmp_path)
    comp = engine.manager.components["transformer"]
    larger = engine._replan("transformer", comp.plan.reserve + 3 * _block_bytes(engine))
    assert len(larger.tiers["transformer"]) and larger.tiers != comp.plan.tiers
    engine.manager.apply_plan(comp, larger)
    other = engine.manager.components["vae"]
    engine.manager.running.append(other)
    try:
        assert rehold(engine, "transformer") == 0
    finally:
        engine.manager.running.remove(other)
    assert rehold(engine, "transformer") > 0


def test_moves_pair_each_wanted_pack_with_one_read_less_often_of_at_least_its_size():
    from tritoff.rehold import plan_moves

    # classes: (rank, -share, component): rank 0 streamed every step, 2 resident in a denoiser, 3 the rest
    classes = {
        ("t", "a"): (0, -0.9, 0),
        ("t", "b"): (0, -0.9, 0),
        ("t2", "c"): (0, -0.1, 1),
        ("t2", "d"): (0, -0.1, 1),
        ("vae", "e"): (3, 0.0, 2),
        ("t", "f"): (2, -0.9, 0),
    }
    sizes = {key: 100 for key in classes} | {("vae", "e"): 50}
    held = {("t2", "c"), ("t2", "d"), ("vae", "e"), ("t", "f")}
    wanted = [("t", "a"), ("t", "b"), ("t2", "c")]
    moves = plan_moves(wanted, held, classes, sizes, lambda key: True)
    # the VAE's pack is read least often but too small; then the resident block, then the second expert's block
    assert moves == [(("t", "f"), ("t", "a")), (("t2", "d"), ("t", "b"))]
    # a pack as often read never gives its place: the held ones of one class spread anew would cost reads only
    assert plan_moves([("t2", "c")], {("t2", "d")}, classes, sizes, lambda key: True) == []
    # nor one that may not leave (a rewritten pack bound for a store file, one larger than the ring's buffers)
    assert plan_moves(wanted, held, classes, sizes, lambda key: key != ("t", "f")) == [(("t2", "d"), ("t", "a"))]


def _arenas_hold_their_packs(engine):
    """Each group's runtime names the arena its pack's bytes lie in (zero-copy maps its views through it)."""
    for comp in engine._runtimes:
        for g in comp.groups:
            if g.pack.on_disk:
                assert g.arena is engine.disk.arena, g.name
                continue
            start = g.pack.data.data_ptr() - g.arena.buffer.data_ptr()
            assert 0 <= start <= g.arena.nbytes - g.layout.nbytes, g.name


def test_a_re_enable_after_moves_finds_each_pack_in_the_arena_it_lies_in(tmp_path, expected):
    pipe, engine = _scenario(tmp_path)
    assert torch.equal(_run(pipe), expected)
    assert engine.stats["total"]["reheld_bytes"] > 0
    _arenas_hold_their_packs(engine)
    again = _enable(pipe)  # the same groups: the packs are taken over where they lie
    _arenas_hold_their_packs(again)
    assert torch.equal(_run(pipe), expected)


def test_a_component_held_whole_at_enable_gets_a_spill_file_at_its_first_move_out(tmp_path, expected):
    # the first expert wholly held, the rest of the budget on the second's streamed blocks: once the first call
    # re-plans, the first expert's resident blocks (read once per phase entry) give their places to the second's
    # streamed blocks, read at every call
    probe = _enable(_pipe())
    whole = sum(align(p.layout.nbytes, PAGE) for p in probe.packed["transformer"].packs)
    pipe = _pipe()
    engine = _enable(pipe, host_budget=whole + 3 * _block_bytes(probe), spill_dir=str(tmp_path))
    assert not any(p.on_disk for p in engine.packed["transformer"].packs)
    assert not any(p.file for p in engine.packed["transformer"].packs)
    assert torch.equal(_run(pipe), expected)
    left = [p for p in engine.packed["transformer"].packs if p.on_disk]
    assert left and all(p.file.spill for p in left)
    assert _streamed(engine, "transformer_2") & _held(engine, "transformer_2")
    _arenas_hold_their_packs(engine)
    assert torch.equal(_run(pipe), expected)

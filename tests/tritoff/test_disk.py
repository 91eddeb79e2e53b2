"""tritoff/disk.py: packs served from disk under a host budget are read exactly, read ahead, and never held whole."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

import tritoff
from tritoff import disk, groups
from tritoff.disk import DiskRing, PackFile, spill_files
from tritoff.packer import pack_bytes, pack_model
from tritoff.planner import BudgetError
from tritoff.store import StoreError

from .helpers import dequantized_pipeline, run, stack, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")
ROOT = Path(__file__).resolve().parents[2]


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference", **kwargs)


def _spilled(tmp_path):
    """A Stack's packs all in a spill file, and the same packs held in memory."""
    held = pack_model(stack(), progress=False)
    spill = spill_files(tmp_path, {"model": held.packed_bytes})["model"]
    spilled = pack_model(stack(), progress=False, held=set(), spill=spill)
    return held, spilled


# files ---------------------------------------------------------------------------------------------------------------


def test_spilled_packs_read_back_exactly_from_a_file_nobody_else_sees(tmp_path):
    held, spilled = _spilled(tmp_path)
    assert spilled.arena.nbytes == 0 and all(p.on_disk for p in spilled.packs)
    for a, b in zip(held.packs, spilled.packs, strict=True):
        assert torch.equal(pack_bytes(a), pack_bytes(b))
    assert list(tmp_path.iterdir()) == []  # unlinked at creation: gone however the process ends


def test_a_spill_directory_without_room_is_refused_naming_what_is_needed(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 5))
    with pytest.raises(ValueError, match=r"need 1\.00 MiB of disk in .*5 B free: pass spill_dir="):
        spill_files(tmp_path, {"text_encoder": 2**19, "transformer": 2**19})  # the total is checked


def test_a_corrupt_pack_is_refused_when_read(tmp_path):
    held, _ = _spilled(tmp_path)
    path = tmp_path / "packs.bin"
    path.write_bytes(held.arena.buffer.numpy().tobytes())
    pack = held.packs[1]
    file = PackFile.open(path, 0)
    pack = type(pack)(pack.name, pack.layout, pack.offset, None, file, "0" * 32)
    with pytest.raises(StoreError, match=rf"packs\.bin is corrupt .*pack {pack.name} differs from its hash"):
        pack_bytes(pack)


def test_a_read_that_found_the_file_damaged_after_another_read_opened_its_repair_reads_the_repair(tmp_path):
    import xxhash

    from tritoff.arena import PAGE
    from tritoff.pack import align

    held, _ = _spilled(tmp_path)
    path = tmp_path / "packs.bin"
    good = held.arena.buffer.numpy().tobytes()
    path.write_bytes(good)
    file = PackFile.open(path, 0)

    def digest(pack):  # a store's hash: the pack and its padding to the next page
        return xxhash.xxh3_128_hexdigest(good[pack.offset : pack.offset + align(pack.layout.nbytes, PAGE)])

    first, second = (type(p)(p.name, p.layout, p.offset, None, file, digest(p)) for p in held.packs[:2])
    damaged = bytearray(good)
    damaged[first.offset + 7] ^= 0x40
    damaged[second.offset + 7] ^= 0x40
    path.write_bytes(bytes(damaged))  # in place: the open file is damaged
    old = file.fd
    (tmp_path / "new").write_bytes(good)
    os.replace(tmp_path / "new", path)  # the repair, a new file at the path
    assert torch.equal(pack_bytes(second), held.packs[1].data)  # found damaged, the repair opened and read
    assert file.fd != old
    out = torch.empty(first.layout.nbytes, dtype=torch.uint8)
    # a read of the first pack that began on the old file (the reader thread's) fails there, and retries on the repair
    with pytest.raises(StoreError, match="differs from its hash"):
        file._read_checked(first, memoryview(out.numpy()), False, old)
    assert file._reopen_if_replaced(old) and file.fd != old
    file._accept(first, digest(first), old)  # a check made on the old file counts for nothing on the new one
    assert first.offset not in file._verified
    assert torch.equal(pack_bytes(first), held.packs[0].data)
    assert first.offset in file._verified
    file.close()


def test_a_read_error_names_the_file_and_the_pack(tmp_path, monkeypatch):
    import errno

    _, spilled = _spilled(tmp_path)
    pack = spilled.packs[1]

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(OSError, match=rf"reading pack {pack.name} from .*spill file of model.* Input/output error"):
        pack.file.read(pack, torch.empty(pack.layout.nbytes, dtype=torch.uint8))


def test_a_buffer_smaller_than_the_pack_is_refused(tmp_path):
    _, spilled = _spilled(tmp_path)
    pack = spilled.packs[1]
    with pytest.raises(ValueError, match=rf"pack {pack.name} needs {pack.layout.nbytes} bytes"):
        pack.file.read(pack, torch.empty(pack.layout.nbytes - 1, dtype=torch.uint8))


# the ring ------------------------------------------------------------------------------------------------------------


class CountingFile:
    """A PackFile stand-in that counts reads, optionally failing or blocking them."""

    def __init__(self, real, fail=(), gate=None):
        self.real, self.fail, self.gate, self.reads = real, set(fail), gate, []

    def read(self, pack, out, recheck=False):
        if self.gate is not None:
            self.gate.wait()
        self.reads.append(pack.name)
        if pack.name in self.fail:
            raise OSError(f"cannot read {pack.name}")
        self.real.read(pack, out, recheck)


def _ring_packs(tmp_path, **file_kwargs):
    held, spilled = _spilled(tmp_path)
    counting = CountingFile(spilled.packs[0].file, **file_kwargs)
    for p in spilled.packs:
        p.file = counting
    return held, spilled.packs, counting


@pytest.mark.parametrize("threaded", [False, True])
def test_the_ring_serves_exact_bytes_and_reuses_what_it_read(tmp_path, threaded):
    held, packs, file = _ring_packs(tmp_path)
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=threaded, owners={})
    try:
        for _ in range(2):  # two passes over five packs with two buffers: every pack read once per pass
            for i, pack in enumerate(packs):
                index, data = ring.take(pack)
                assert torch.equal(data, pack_bytes(held.packs[i]))
                ring.give_back(index)
        assert sorted(file.reads) == sorted([p.name for p in packs] * 2)
        index, _ = ring.take(packs[-1])  # still in a buffer: not read again
        ring.give_back(index)
        assert len(file.reads) == 2 * len(packs)
    finally:
        ring.close()


def test_the_reader_thread_reads_ahead_what_is_wanted(tmp_path):
    gate = threading.Event()
    _, packs, file = _ring_packs(tmp_path, gate=gate)
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=True, owners={})
    try:
        ring.want(packs[1:3])
        assert not ring.ready(packs[1])  # the reader is held at the gate
        gate.set()
        for pack in packs[1:3]:
            index, _ = ring.take(pack)
            ring.give_back(index)
        assert file.reads[:2] == [packs[1].name, packs[2].name]
        assert ring.reads == 2 and ring.wait_ns >= 0
    finally:
        ring.close()
    assert ring._thread is None


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failed_read_reaches_the_taker_and_the_ring_stays_usable(tmp_path, threaded):
    held, packs, file = _ring_packs(tmp_path, fail={"blocks.2"})
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=threaded, owners={})
    try:
        with pytest.raises(OSError, match=r"cannot read blocks\.2"):
            ring.take(packs[2])
        file.fail.clear()
        index, data = ring.take(packs[2])  # read again, this time for real
        assert torch.equal(data, pack_bytes(held.packs[2]))
        ring.give_back(index)
    finally:
        ring.close()


def test_a_read_ahead_that_failed_is_read_again_by_the_take_that_needs_it(tmp_path):
    # the disk failed while the reader read ahead, and is back by the time the pack is needed: the take reads it again
    held, packs, file = _ring_packs(tmp_path, fail={"blocks.2"})
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=True, owners={})
    try:
        ring.want([packs[2]])
        with ring.cond:
            assert ring.cond.wait_for(lambda: ring._find(packs[2]) is not None and ring._find(packs[2]).error, 10)
        file.fail.clear()
        index, data = ring.take(packs[2])
        assert torch.equal(data, pack_bytes(held.packs[2]))
        ring.give_back(index)
        assert file.reads.count("blocks.2") == 2
    finally:
        ring.close()


# the engine ----------------------------------------------------------------------------------------------------------

BIG = dict(num_layers=8)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    directory = tmp_path_factory.mktemp("store")
    _enable(wan(**BIG)).save(directory)
    return directory


@pytest.fixture(scope="module")
def expected():
    return run(dequantized_pipeline(wan, **BIG))


def test_packs_several_times_the_host_budget_run_from_a_store_bit_exact(store, expected):
    pipe = wan(**BIG)
    engine = _enable(pipe, store=store, host_budget="1MB")
    assert torch.equal(run(pipe), expected)
    total = engine.stats["total"]
    assert total["packed_bytes"] > 3 * 10**6 > total["host_arena_bytes"] and total["host_arena_bytes"] <= 10**6
    assert total["disk_pack_bytes"] == total["packed_bytes"] - sum(
        p.layout.nbytes for m in engine.packed.values() for p in m.packs if not p.on_disk
    )
    # three steps with classifier-free guidance: six transformer calls, each reading every streamed block on disk
    tiers = engine.plan.phases["transformer"].tiers["transformer"]
    blocks = sum(
        p.layout.nbytes for p in engine.packed["transformer"].packs if p.on_disk and tiers.get(p.name) == "stream"
    )
    transformer = engine.stats["components"]["transformer"]
    assert transformer["disk_bytes_read"] >= 6 * blocks - 2 * max(
        p.layout.nbytes for p in engine.packed["transformer"].packs
    )
    assert "of packs served from disk" in engine.report()


def test_a_wait_for_the_disk_inside_a_fill_counts_once(tmp_path):
    # on the CPU a fill takes its pack from the disk ring, waiting for the read: that wait is the ring's, not also
    # fill time, since both are taken off the hooks' own time (a double count made it negative)
    from tritoff.planner import BudgetError

    options = dict(mode="group", reserve=1000, progress=False, kernels="reference")
    with pytest.raises(BudgetError) as info:
        tritoff.enable(stack(width=1024), budget=1000, **options)
    model, x = stack(width=1024), torch.randn(4, 16, dtype=torch.bfloat16)
    engine = tritoff.enable(model, budget=info.value.minimum, host_budget=0, spill_dir=str(tmp_path), **options)
    with torch.no_grad():
        for _ in range(4):
            model(x)
    assert engine.manager.disk.wait_ns > 0
    assert engine.stats["components"]["model"]["hook_us_per_group"] > 0


def test_without_a_store_the_packs_beyond_the_budget_go_to_a_private_spill_file(tmp_path, expected):
    pipe = wan(**BIG)
    engine = _enable(pipe, host_budget="1MB", spill_dir=str(tmp_path))
    assert torch.equal(run(pipe), expected)
    assert engine.stats["total"]["disk_pack_bytes"] > 2 * 10**6
    assert list(tmp_path.iterdir()) == []
    tritoff.disable(pipe, device="cpu")  # the weights come back from disk too
    assert torch.equal(run(pipe), expected)


def test_a_re_enable_packing_again_counts_the_spill_files_it_frees_as_free(tmp_path, monkeypatch):
    import gc
    import shutil
    import weakref

    pipe = wan()
    engine = tritoff.enable(pipe, budget="4MB", host_budget=1, spill_dir=tmp_path, progress=False, kernels="reference")
    before = run(pipe)
    files = {id(p.file): p.file for packed in engine.packed.values() for p in packed.packs if p.on_disk}
    held = sum(os.fstat(f.fd).st_blocks * 512 for f in files.values())
    assert held > 10**5
    files = [weakref.ref(f) for f in files.values()]
    # the disk holds the enabled engine's spill files and 4 KiB more: a re-pack (other groups) frees them first
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4096))
    gc.disable()  # freed by the re-enable itself, before it writes the new files, not by a later collection
    try:
        tritoff.enable(pipe, mode="leaf", budget="4MB", spill_dir=tmp_path, progress=False, kernels="reference")
        assert not any(ref() for ref in files)
    finally:
        gc.enable()
    assert engine.packed == {}
    assert torch.equal(run(pipe), before)
    # what those 4 KiB leave a pipeline no engine spilled for: refused
    with pytest.raises(ValueError, match=r"the packs beyond host_budget need .* which has 4\.00 KiB free"):
        tritoff.enable(wan(), mode="leaf", budget="4MB", host_budget=1, spill_dir=tmp_path, progress=False)


def test_a_disk_filling_up_while_packing_gives_every_weight_back(tmp_path, monkeypatch):
    import errno

    writes = []

    def write(self, pack, data):
        writes.append(pack.name)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, pack, data)

    real = PackFile.write
    monkeypatch.setattr(PackFile, "write", write)
    pipe = wan(**BIG)
    with pytest.raises(OSError, match="No space left"), pytest.warns(UserWarning, match="reload the pipeline") as w:
        _enable(pipe, host_budget="1MB", spill_dir=str(tmp_path))
    assert not hasattr(pipe, "_tritoff_engine")
    assert any("enable stopped: the weights of text_encoder" in str(x.message) for x in w)
    # every weight is back: those released before the failure as their packs hold them, the others untouched
    original, packed = wan(**BIG), dequantized_pipeline(wan, **BIG)
    for name in ("text_encoder", "transformer", "vae"):
        was = dict(getattr(original, name).named_parameters())
        rounded = dict(getattr(packed, name).named_parameters())
        for pname, param in getattr(pipe, name).named_parameters():
            assert param.shape == was[pname].shape and param.requires_grad == was[pname].requires_grad
            assert torch.equal(param, was[pname]) or torch.equal(param, rounded[pname]), f"{name}.{pname}"
    assert torch.isfinite(run(pipe)).all()


def test_read_ahead_on_a_thread_gives_the_same_frames(store, expected, monkeypatch):
    monkeypatch.setattr(disk, "READ_AHEAD_ON_CPU", True)
    pipe = wan(**BIG)
    engine = _enable(pipe, store=store, host_budget="1MB")
    assert engine.disk.threaded
    assert torch.equal(run(pipe), expected)
    assert torch.equal(run(pipe), expected)
    tritoff.disable(pipe)
    assert engine.disk is None  # the reader was stopped and the ring released


def test_host_budget_zero_serves_everything_from_disk_lookup_tables_mapped(store, expected, monkeypatch):
    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 8 * 1024)  # the tiny UMT5's table becomes a host group
    pipe = wan(**BIG)
    engine = _enable(pipe, host_budget=0, spill_dir=str(store.parent))
    assert torch.equal(run(pipe), expected)
    assert engine.stats["total"]["host_arena_bytes"] == 0
    table = pipe.text_encoder.shared.weight
    assert table.device.type == "cpu" and table.numel() > 0  # a view of the spill file's mapping


def test_a_store_saved_under_a_host_budget_is_the_same_store(store, tmp_path):
    engine = _enable(wan(**BIG), host_budget="1MB", spill_dir=str(tmp_path))
    engine.save(tmp_path / "again")
    first, again = (json.loads((d / "tritoff_store.json").read_text()) for d in (store, tmp_path / "again"))
    assert {n: c["hash"] for n, c in first["components"].items()} == {
        n: c["hash"] for n, c in again["components"].items()
    }


@pytest.mark.filterwarnings("ignore:Already unmerged")  # peft's word on unfusing what is not fused
def test_fusing_a_lora_into_a_pack_on_disk_is_refused_before_any_layer_is_fused(store, expected):
    from tritoff.adapters import merged_adapters

    from .helpers import lora_state_dict

    pipe = wan(**BIG)
    engine = _enable(pipe, store=store, host_budget="1MB")  # some blocks held, the others on disk
    held = {p.name for p in engine.packed["transformer"].packs if not p.on_disk}
    assert held and len(held) < len(engine.packed["transformer"].packs)
    pipe.load_lora_weights(lora_state_dict(wan(**BIG).transformer), adapter_name="a")
    pipe.unfuse_lora(components=["transformer"])  # nothing fused: nothing to do, as in diffusers
    with pytest.raises(ValueError, match=r"served from disk .*nothing was fused: raise host_budget") as info:
        pipe.fuse_lora(components=["transformer"])
    assert "\n" not in str(info.value)
    assert merged_adapters(pipe.transformer) == []  # not even the layers whose packs are held
    pipe.unload_lora_weights()
    assert torch.equal(run(pipe), expected)


def test_a_corrupt_lookup_table_served_from_disk_is_refused_at_enable(store, tmp_path, monkeypatch):
    import shutil

    from tritoff.store import _read_meta, read_index

    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 8 * 1024)  # the tiny UMT5's table becomes a host group
    directory = tmp_path / "store"
    _enable(wan(**BIG)).save(directory)
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    table = next(p for p in _read_meta(copy / "text_encoder.safetensors")["packs"] if p["name"].startswith("host:"))
    position = read_index(copy)["components"]["text_encoder"]["data_offset"] + table["offset"] + 5
    with open(copy / "text_encoder.safetensors", "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x40]))
    pipe = wan(**BIG)
    with pytest.raises(StoreError, match=rf"text_encoder\.safetensors is corrupt .*pack {table['name']} differs"):
        _enable(pipe, store=copy, host_budget=0)
    assert not hasattr(pipe, "_tritoff_engine")
    pipe = wan(**BIG)
    _enable(pipe, store=directory, host_budget=0)  # the intact store: the table is checked, then mapped
    assert torch.isfinite(run(pipe)).all()


@pytest.mark.parametrize("repair", ["in place", "written anew"])
def test_disable_checks_a_pack_again_that_the_store_file_changed_in_place_since_it_was_first_read(
    store, tmp_path, repair
):
    import shutil

    from tritoff.store import read_index

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    file = copy / "transformer.safetensors"
    good = file.read_bytes()
    pipe = wan(**BIG)
    engine = _enable(pipe, store=copy, host_budget=0)
    out = run(pipe)  # every pack read from the file, and checked
    pack = next(p for p in engine.packed["transformer"].packs if p.on_disk)
    position = read_index(copy)["components"]["transformer"]["data_offset"] + pack.offset + 100
    with open(file, "r+b") as f:  # the same file, changed in place
        f.seek(position)
        f.write(bytes([good[position] ^ 0x40]))
    with pytest.raises(StoreError, match=rf"transformer\.safetensors is corrupt .*pack {pack.name} differs"):
        tritoff.disable(pipe)
    assert hasattr(pipe, "_tritoff_engine")  # still enabled, as it was: nothing wrong handed back
    with open(file, "r+b") as f:  # truncated: said as a damaged store, with what to do
        f.truncate(position)
    with pytest.raises(StoreError, match=r"ended early while reading pack .*truncated; recreate the store"):
        run(pipe)
    if repair == "in place":  # copied over the damaged file
        file.write_bytes(good)
    else:  # a new file put in its place, as tritoff convert --overwrite does: the engine opens it again
        (tmp_path / "new").write_bytes(good)
        os.replace(tmp_path / "new", file)
    # repaired, the same engine serves it again
    assert torch.equal(run(pipe), out)
    tritoff.disable(pipe)
    assert torch.equal(run(pipe), out)


def test_a_failed_re_enable_leaves_the_pipeline_enabled(tmp_path, expected):
    pipe = wan(**BIG)
    _enable(pipe, host_budget="1MB", spill_dir=str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^spill_dir .*file is not a directory: pass a writable directory on a disk$"):
        tritoff.enable(
            pipe, mode="leaf", budget="4MB", progress=False, kernels="reference", host_budget="1MB",
            spill_dir=str(tmp_path / "file"),
        )  # fmt: skip
    assert hasattr(pipe, "_tritoff_engine")
    assert torch.equal(run(pipe), expected)


@pytest.mark.parametrize("value", [0, 0.0, "0", " 0 ", "0GB", "0%", "0.0 GiB"])
def test_zero_in_any_spelling_serves_every_pack_from_disk(value, tmp_path):
    engine = _enable(wan(), host_budget=value, spill_dir=str(tmp_path))
    assert engine.options.host_budget == 0 and engine.stats["total"]["host_arena_bytes"] == 0


@pytest.mark.parametrize("value", [123, ["a"]])
def test_a_spill_dir_that_is_not_a_path_is_refused_in_one_line(value):
    pipe = wan()
    with pytest.raises(ValueError, match="spill_dir must be a path"):
        _enable(pipe, host_budget=0, spill_dir=value)
    assert not hasattr(pipe, "_tritoff_engine")


@pytest.mark.parametrize("where", ["empty", "a-file", "under-a-file", "no-such-user", "dangling-link", "procfs"])
def test_a_spill_dir_that_cannot_hold_files_is_refused_even_when_nothing_spills_yet(tmp_path, where):
    # a host budget holding every pack spills nothing now, but enabled again in other groups (leaf <-> block) it may
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    value = {
        "empty": "",
        "a-file": str(tmp_path / "file"),
        "under-a-file": str(tmp_path / "file" / "spill"),
        "no-such-user": "~no-such-user-of-tritoff/spill",
        "dangling-link": str(tmp_path / "link"),
        "procfs": "/proc/tritoff-spill",  # its modes let root write, but no file can be made there
    }[where]
    message = {
        "empty": "spill_dir is empty",
        "a-file": "is not a directory",
        "under-a-file": "cannot hold the packs beyond host_budget",
        "no-such-user": "spill_dir ~no-such-user-of-tritoff/spill: ",
        "dangling-link": "link is a link to .*gone, which does not exist: create that directory",
        "procfs": r"spill_dir /proc/tritoff-spill cannot hold the packs beyond host_budget \(not writable\)",
    }[where]
    pipe = wan()
    with pytest.raises(ValueError, match=message) as info:
        _enable(pipe, host_budget="1GB", spill_dir=value)
    assert "\n" not in str(info.value) and not hasattr(pipe, "_tritoff_engine")


def test_a_spill_dir_is_made_only_when_something_spills(tmp_path):
    pipe = wan()
    with pytest.raises(BudgetError):  # a failed enable leaves no directory behind
        tritoff.enable(pipe, budget=1, host_budget=0, spill_dir=str(tmp_path / "failed" / "spill"), progress=False)
    assert not (tmp_path / "failed").exists()
    _enable(pipe, host_budget="1GB", spill_dir=str(tmp_path / "held" / "spill"))  # every pack held: nothing spills
    assert not (tmp_path / "held").exists()
    tritoff.disable(pipe)
    engine = _enable(pipe, host_budget=0, spill_dir=str(tmp_path / "spilled" / "spill"))
    assert engine.stats["total"]["host_arena_bytes"] == 0 and (tmp_path / "spilled" / "spill").is_dir()


def test_a_take_waiting_while_the_wanted_list_changes_still_gets_its_pack(tmp_path):
    gate = threading.Event()
    held, packs, _ = _ring_packs(tmp_path, gate=gate)
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=True, owners={})
    try:
        ring.want([packs[0]])  # the reader takes it up and waits at the gate
        got = {}
        taker = threading.Thread(target=lambda: got.update(taken=ring.take(packs[1])))
        taker.start()
        while not any(b.state == "reading" for b in ring.buffers):
            threading.Event().wait(0.01)
        ring.want([packs[2]])  # replaces the list the taker's pack was in
        gate.set()
        taker.join(timeout=30)
        assert not taker.is_alive()
        index, data = got["taken"]
        assert torch.equal(data, pack_bytes(held.packs[1]))
        ring.give_back(index)
    finally:
        gate.set()
        ring.close()


@pytest.mark.parametrize(
    "value,message",
    [
        ("abc", "invalid host_budget 'abc'"),
        ("150%", "at most 100%"),
        (-1, "give bytes, e.g. '8GB', or 0 to read every pack from disk"),
        (True, "invalid"),
        (float("nan"), "finite"),
    ],
)
def test_bad_host_budgets_are_refused_in_one_line(value, message):
    pipe = wan()
    with pytest.raises(ValueError, match=message):
        _enable(pipe, host_budget=value)
    assert not hasattr(pipe, "_tritoff_engine")


def test_a_relative_spill_dir_means_the_directory_it_named_at_enable(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path)
    pipe = wan()
    _enable(pipe, host_budget=0, spill_dir="a")
    monkeypatch.chdir(tmp_path / "a")  # "a" now names another directory
    _enable(pipe, spill_dir=str(tmp_path / "a"))
    with pytest.raises(ValueError, match=f"stay in {tmp_path / 'a'}\\); call tritoff.disable"):
        _enable(pipe, spill_dir="a")


def test_host_budget_cannot_change_on_a_re_enable_and_is_kept_when_left_out(tmp_path, monkeypatch):
    from tritoff import engine as engine_module

    spill = engine_module.spill_files
    pipe = wan()
    first = _enable(pipe, host_budget="1MB", spill_dir=str(tmp_path))
    packs = first.packed
    expected = run(pipe)
    with pytest.raises(ValueError, match="host_budget cannot change while tritoff is enabled.*leave host_budget out"):
        _enable(pipe, host_budget="2MB")
    # the packs spilled stay where they are: another directory is refused, the same one (however spelled) is not
    with pytest.raises(ValueError, match=f"spill_dir cannot change .*stay in {tmp_path}\\); call tritoff.disable"):
        _enable(pipe, spill_dir=str(tmp_path / "elsewhere"))
    _enable(pipe, spill_dir=f"{tmp_path}/./")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _enable(pipe)  # left out: kept, with the packs where they were placed
    assert not [w for w in caught if "spill_dir" in str(w.message)]  # kept, not given: nothing to warn about
    assert again.options.host_budget == first.options.host_budget == 10**6
    assert again.packed is packs and torch.equal(run(pipe), expected)
    # packed again (leaf groups): the packs beyond the host budget go where spill_dir said, kept too
    spilled = []

    def record(directory, *args, **kwargs):
        spilled.append(directory)
        return spill(directory, *args, **kwargs)

    monkeypatch.setattr(engine_module, "spill_files", record)
    leaf = tritoff.enable(pipe, mode="leaf", budget="4MB", progress=False, kernels="reference")
    assert [Path(d).resolve() for d in spilled] == [tmp_path.resolve()]
    assert leaf.options.host_budget == 10**6 and torch.equal(run(pipe), expected)


# memory --------------------------------------------------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import json, os, sys, warnings
    os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore")
    import torch
    import tritoff
    from tritoff.tiny import WAN_TINY, tiny_wan_pipeline
    from tests.tritoff.helpers import run

    store, host_budget, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    budget = config.pop("budget")
    torch.set_num_threads(1)
    # warm imports and the allocator up on a one-block twin, then swap in the transformer to fill from the store,
    # built without weights (as `tritoff run --store` builds it)
    pipe = tiny_wan_pipeline(**{**config, "num_layers": 1})
    run(pipe, num_inference_steps=1)
    from diffusers import WanTransformer3DModel
    from tritoff.tiny import cast_like_from_pretrained
    from accelerate import init_empty_weights
    with init_empty_weights():  # parameters on meta, buffers real
        transformer = WanTransformer3DModel(**{**WAN_TINY, **config})
    pipe.transformer = cast_like_from_pretrained(transformer, torch.bfloat16).eval()
    import gc
    gc.collect()

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    engine = tritoff.enable(
        pipe, mode="group", budget=budget, device="cpu", progress=False, kernels="reference",
        store=store, host_budget=None if host_budget == "none" else host_budget,
    )
    run(pipe)
    total = engine.stats["total"]
    print(json.dumps({"peak": status("VmHWM:") - base, "ring": total["disk_ring_bytes"],
                      "arena": total["host_arena_bytes"], "packed": total["packed_bytes"],
                      "read": total["disk_bytes_read"]}))
    """
)


def _peak(store, host_budget, config):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(store), host_budget, json.dumps(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        # one malloc arena, large blocks always mapped (freed at once) and one compute thread: per-thread arenas,
        # glibc's moving mmap threshold and per-thread buffers would add megabytes of noise to the peak
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "MALLOC_ARENA_MAX": "1",
            "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
            "OMP_NUM_THREADS": "1",
        },
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_peak_host_memory_stays_within_the_host_budget_plus_the_ring(tmp_path):
    # 8 blocks of 4.2 MB of fp8 each: 34 MB of packs, several times a 6 MB host budget
    config = dict(num_layers=8, num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, budget=40 * 2**20)
    model = {k: v for k, v in config.items() if k != "budget"}
    from tritoff.tiny import tiny_wan_pipeline

    _enable_kwargs = dict(mode="group", budget=config["budget"], progress=False, kernels="reference")
    tritoff.enable(tiny_wan_pipeline(**model), **_enable_kwargs).save(tmp_path / "store")
    budget = 6 * 10**6
    limited = _peak(tmp_path / "store", str(budget), model | {"budget": config["budget"]})
    full = _peak(tmp_path / "store", "none", model | {"budget": config["budget"]})
    assert limited["packed"] > 5 * budget and limited["arena"] <= budget and limited["read"] > limited["packed"]
    # the run without a host budget holds every pack; what else it holds (on the CPU the device budget's slots and
    # resident tiers, activations, the pipeline's tensors) is the same with one: the peak is what the host budget
    # holds, the ring, and that
    other = full["peak"] - full["arena"]
    assert full["arena"] >= limited["packed"] and other > 0
    # 12 MiB of slack: the limited peak measured 57.7-60.2 MiB on an idle machine and once 65.7 MiB on a loaded one (3
    # MiB over a 4 MiB slack); holding every pack would add 33.6 MiB, reading the store whole 37.8 MiB
    assert limited["peak"] <= limited["arena"] + limited["ring"] + other + 12 * 2**20, (limited, full)
    assert limited["peak"] < full["peak"] - limited["packed"] // 4, (limited, full)
    assert limited["arena"] + limited["ring"] < full["arena"] - limited["packed"] // 2  # several times smaller


def test_a_spill_file_is_closed_once_by_its_owner(tmp_path):
    """Closing a spill file closes its descriptor once: a second close could shut a file another thread has opened
    since under the same number."""
    spill = spill_files(tmp_path, {"transformer": 4096})["transformer"]
    owner = spill._owner
    spill.close()  # used to close the descriptor, then fail closing it again through its owner
    assert owner.closed and spill.fd == -1
    reused = os.open(tmp_path, os.O_RDONLY)  # the number is free again, and nothing closes it behind our back
    try:
        spill.close()
        del spill, owner
        os.fstat(reused)
    finally:
        os.close(reused)


def _stack_minimum() -> tuple[int, dict]:
    """The smallest budget a 6-block Stack streams at, and the options it was planned with."""
    options = dict(mode="group", reserve=1000, progress=False, kernels="reference")
    with pytest.raises(BudgetError) as info:
        tritoff.enable(stack(n=6, width=512), budget=1000, **options)
    return info.value.minimum, options


def _served_from_disk(tmp_path):
    """A 6-block Stack at its smallest budget with every pack on disk: (model, input, engine, its first output)."""
    minimum, options = _stack_minimum()
    model, x = stack(n=6, width=512), torch.randn(4, 16, dtype=torch.bfloat16)
    engine = tritoff.enable(model, budget=minimum, host_budget=0, spill_dir=str(tmp_path), **options)
    with torch.no_grad():
        return model, x, engine, model(x)


def test_an_interrupt_right_after_a_take_leaves_no_buffer_taken(tmp_path):
    # a Ctrl-C between the disk ring's take and the taker's cleanup: the forward's recovery gives the buffer back
    model, x, engine, expected = _served_from_disk(tmp_path)
    ring, take = engine.disk, engine.disk.take

    def interrupted(pack):
        take(pack)
        raise KeyboardInterrupt

    ring.take = interrupted
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(x)
    del ring.take
    assert all(buf.users == 0 for buf in ring.buffers)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_prefetch_goes_past_fp8_blocks_whose_packs_are_on_disk(tmp_path, monkeypatch):
    # an fp8-tier block fills from its pack on the GPU, never from the disk: prefetch does not wait for its disk read
    monkeypatch.setattr(disk, "READ_AHEAD_ON_CPU", True)
    minimum, options = _stack_minimum()
    model, x = stack(n=6, width=512), torch.randn(4, 16, dtype=torch.bfloat16)
    engine = tritoff.enable(
        model, budget=minimum + 2_000_000, host_budget=1_100_000, spill_dir=str(tmp_path), prefetch=2, **options
    )
    comp = engine.manager.components["model"]
    tiers = {(g.tier, g.pack.on_disk) for g in comp.blocks}
    assert ("fp8", True) in tiers and ("stream", True) in tiers, tiers
    manager, depths = engine.manager, []
    pre = manager.group_pre

    def counted(group):
        depths.append(len(manager.inflight))
        pre(group)

    monkeypatch.setattr(manager, "group_pre", counted)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    assert depths[-len(comp.blocks) :] == [2] * len(comp.blocks)
    assert engine.stats["components"]["model"]["sync_onloads"] == 0


def test_an_interrupt_as_the_taker_starts_its_own_read_leaves_the_ring_usable(tmp_path):
    # without a reader thread the take reads itself: a Ctrl-C arriving as that read starts leaves no buffer "reading"
    model, x, engine, expected = _served_from_disk(tmp_path)
    ring = engine.disk
    assert not ring.threaded

    def interrupted(buf, pack):
        raise KeyboardInterrupt

    ring._read = interrupted
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(x)
    del ring._read
    assert all(buf.state != "reading" and buf.users == 0 for buf in ring.buffers)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_recovery_frees_what_an_interrupt_left_taken_or_being_read(tmp_path):
    _, packs, _ = _ring_packs(tmp_path)
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=False, owners={})
    try:
        ring.take(packs[0])  # never given back
        ring.buffers[1].pack, ring.buffers[1].state = packs[1], "reading"  # a read its taker never began
        ring.recover()
        assert [(b.users, b.state) for b in ring.buffers] == [(0, "ready"), (0, "empty")]
        for pack in packs:  # both buffers serve again
            index, _ = ring.take(pack)
            ring.give_back(index)
    finally:
        ring.close()


def test_a_pack_forgotten_by_the_ring_is_read_again_from_its_file(tmp_path):
    # a pack moved into host memory and out again (rehold.py): what a buffer kept of it is not served again
    held, packs, file = _ring_packs(tmp_path)
    ring = DiskRing(2, max(p.layout.nbytes for p in packs), register=False, threaded=False, owners={})
    try:
        index, _ = ring.take(packs[0])
        ring.give_back(index)
        ring.forget(packs[0])
        index, data = ring.take(packs[0])
        assert file.reads == [packs[0].name] * 2 and torch.equal(data, pack_bytes(held.packs[0]))
        ring.forget(packs[0])  # in use: kept until given back
        assert ring.buffers[index].state == "ready"
        ring.give_back(index)
    finally:
        ring.close()

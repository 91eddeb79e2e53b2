"""tritoff/store.py: stores round-trip exactly, are written atomically, and refuse whatever does not match."""

import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest
import torch

import tritoff
from tritoff import store as store_module
from tritoff.packer import hold_packs
from tritoff.store import INDEX, StoreError, check_target, load_store, read_index, save_store, verify_store

from .helpers import run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference", **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("store")
    pipe = wan()
    _enable(pipe).save(directory)
    return directory, run(pipe)


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of the saved store, to break."""
    target = tmp_path / "copy"
    shutil.copytree(saved[0], target)
    return target


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_round_trip_is_exact_and_reads_every_pack_into_the_arena(saved):
    directory, expected = saved
    pipe = wan()
    engine = _enable(pipe, store=directory)
    assert torch.equal(run(pipe), expected)
    for packed in engine.packed.values():
        # no host budget: every pack is read into the (anonymous, registrable) arena, none is left on disk
        assert not any(p.on_disk for p in packed.packs)
        assert packed.arena.nbytes == packed.layout_bytes
    assert engine.options.storage == {"text_encoder": "fp8_e4m3", "transformer": "fp8_e4m3", "vae": "bf16"}


@pytest.mark.parametrize("where", ["building", "placing"])
def test_an_enable_from_a_store_stopped_before_it_released_a_weight_leaves_the_pipeline_as_it_was(
    saved, monkeypatch, where
):
    # Ctrl-C once the store's packs are read and the parameters frozen, before the engine is built or before it
    # placed a pack: the weights were never released (they stay as they were, not the store's fp8-rounded values),
    # and every requires_grad flag comes back
    import tritoff.engine as engine_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    directory, _ = saved
    pipe = wan()
    pipe.transformer.blocks[0].requires_grad_(False)
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in pipe.transformer.named_parameters()}
    if where == "building":
        monkeypatch.setattr(engine_module, "Engine", interrupted)
    else:
        monkeypatch.setattr(engine_module.Engine, "_build_runtime", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _enable(pipe, store=directory)
    monkeypatch.undo()
    assert not hasattr(pipe, "_tritoff_engine")
    after = {n: (p.detach(), p.requires_grad) for n, p in pipe.transformer.named_parameters()}
    assert all(torch.equal(after[n][0], w) and after[n][1] == flag for n, (w, flag) in before.items())
    assert any(not flag for _, flag in before.values()) and any(flag for _, flag in before.values())


def test_other_config_is_refused(saved):
    directory, _ = saved
    pipe = wan(num_layers=3)
    before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(StoreError, match=r"transformer does not match the store \(other parameter names or shapes"):
        _enable(pipe, store=directory)
    assert all(torch.equal(p, before[n]) for n, p in pipe.transformer.named_parameters())  # nothing changed


@pytest.mark.parametrize(
    "change, message",
    [
        # the same parameters under another config: what the pack headers cannot tell apart is said as such
        (
            lambda pipe: pipe.text_encoder.config.update({"dropout_rate": 0.5}),
            r"component text_encoder has the store's parameters under another config \(dropout_rate \(0\.0 in the "
            r"store, 0\.5 here\)\): load the model the store was made from",
        ),
        # another class of the same parameters and config
        (
            lambda pipe: setattr(pipe.transformer, "__class__", type("OtherWan", (type(pipe.transformer),), {})),
            r"component transformer is a OtherWan where the store holds a WanTransformer3DModel of the same "
            r"parameters: enable the model the store was made from",
        ),
        # a cast after loading also casts the modules diffusers keeps in float32: which, and how to load it
        (
            lambda pipe: pipe.transformer.to(torch.bfloat16),
            r"component transformer holds \d+ of its \d+ weights in bfloat16 where the store holds float32 "
            r"\(blocks\.0\.\S+ first\): load it as the store's pipeline was loaded",
        ),
    ],
)
def test_a_store_says_whether_the_config_or_some_dtypes_differ(saved, change, message):
    directory, _ = saved
    pipe = wan()
    change(pipe)
    with pytest.raises(StoreError, match=message) as info:
        _enable(pipe, store=directory)
    assert "\n" not in str(info.value) and not hasattr(pipe, "_tritoff_engine")


def test_config_keys_that_restate_the_parameters_are_not_part_of_the_fingerprint(saved, tmp_path):
    # transformers records dtype and architectures when a model is saved and loaded again (or cast): the same model
    # saved to disk and loaded was refused by a store saved from it in memory
    from tritoff.fingerprint import fingerprint
    from tritoff.store import _index_hash

    directory, expected = saved
    pipe = wan()
    pipe.text_encoder.config.update({"architectures": ["UMT5EncoderModel"], "dtype": "bfloat16"})
    _enable(pipe, store=directory)
    assert torch.equal(run(pipe), expected)
    # a store written before records the fingerprint with those keys: read as it was written
    legacy = tmp_path / "legacy"
    shutil.copytree(directory, legacy)
    index = json.loads((legacy / INDEX).read_text())
    for name, component in wan().components.items():
        if name in index["components"]:
            made = fingerprint(component)
            assert index["components"][name]["fingerprint"] == made
            assert (made != made.legacy) == (name == "text_encoder")  # only a transformers config records them
            index["components"][name]["fingerprint"] = made.legacy
    index["index_hash"] = _index_hash(index)
    (legacy / INDEX).write_text(json.dumps(index))
    _enable(wan(), store=legacy)


def _rewrite_index(directory, change):
    from tritoff.store import _index_hash

    index = json.loads((directory / INDEX).read_text())
    change(index)
    index["index_hash"] = _index_hash(index)
    (directory / INDEX).write_text(json.dumps(index))


def test_a_config_key_only_one_library_version_records_is_not_a_mismatch(saved, copy):
    # a diffusers or transformers release adds a model argument (or drops one): the store's fingerprint then differs
    # from the same model's, and the config the store records beside it says by what
    directory, expected = saved

    def older_library(index):
        for info in index["components"].values():
            info["fingerprint"] = "0" * 64  # hashed with the other key set
            info["config"].pop(sorted(info["config"])[0])  # a key this version records, the store's did not
            info["config"]["argument_of_another_release"] = 1  # and one the store's recorded, this one does not

    _rewrite_index(copy, older_library)
    pipe = wan()
    pipe.transformer.register_to_config(argument_of_a_later_release=2)  # a key only the model records
    _enable(pipe, store=copy)
    assert torch.equal(run(pipe), expected)
    # the same layout under a config one of whose shared keys differs: another model
    pipe = wan()
    pipe.transformer.register_to_config(num_layers=7)  # (the parameters do not say so; the config does)
    with pytest.raises(StoreError, match=r"transformer has the store's parameters under another config \(num_layers"):
        _enable(pipe, store=copy)
    assert not hasattr(pipe, "_tritoff_engine")


def test_a_store_that_recorded_no_config_refuses_any_other_config(copy):
    # written before stores recorded their config: a fingerprint that differs is all it can tell
    def unrecorded(index):
        for info in index["components"].values():
            del info["config"], info["layout_fingerprint"]

    _rewrite_index(copy, unrecorded)
    pipe = wan()
    pipe.transformer.register_to_config(argument_of_a_later_release=2)
    with pytest.raises(StoreError, match="component transformer has the store's parameters but not the config it"):
        _enable(pipe, store=copy)


def test_a_store_of_other_weights_is_refused_before_anything_changes(saved):
    directory, _ = saved
    pipe = wan()
    pipe.transformer = wan(seed=1).transformer  # the same architecture, another checkpoint
    before = {(c, n): p.detach().clone() for c in ("text_encoder", "transformer") for n, p in _params(pipe, c)}
    with pytest.raises(StoreError, match="made from other weights than this pipeline's transformer"):
        _enable(pipe, store=directory)
    assert all(torch.equal(p, before[c, n]) for c in ("text_encoder", "transformer") for n, p in _params(pipe, c))
    assert not hasattr(pipe, "_tritoff_engine")


@pytest.mark.parametrize(
    "granularity, host_budget", [("row", None), ("row", 0), ("tensor", None), ("none", 0)], ids=lambda v: str(v)
)
def test_a_store_of_the_weights_before_a_lora_was_fused_is_refused(saved, tmp_path, granularity, host_budget):
    # the group compared whole (the smallest) is the same: every weight's sampled rows are compared too, from the
    # packs read into memory or from the store file itself, in every granularity (tensor: the whole weight's scale)
    from .helpers import lora_state_dict

    directory = saved[0]
    if granularity != "row":
        directory = tmp_path / "store"
        _enable(wan(), granularity=granularity).save(directory)
    pipe = wan()
    lora = lora_state_dict(pipe.transformer, targets=("blocks.2.attn1.to_q",))  # blocks.0, compared whole, unchanged
    pipe.load_lora_weights(lora, adapter_name="style")
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    said = r"other weights than this pipeline's transformer \(transformer\.blocks\.2\.attn1\.to_q\.weight differs"
    with pytest.raises(StoreError, match=said):
        _enable(pipe, store=directory, host_budget=host_budget)
    assert not hasattr(pipe, "_tritoff_engine")
    if granularity != "row":  # the weights the store was made from are taken
        _enable(wan(), store=directory, host_budget=host_budget)


def test_weights_dequantized_by_disable_match_the_store_they_came_from(saved):
    """After an enable/disable cycle the pipeline holds its packs' dequantized values. Packing those again can give
    other bytes (a row whose largest value rounded up to the next power of two gets the smaller scale) for the same
    values: the store is still the one these weights came from, and loads. Enabling again from the store while
    enabled works too."""
    directory, expected = saved
    pipe = wan()
    _enable(pipe)
    tritoff.disable(pipe)
    _enable(pipe, store=directory)
    assert torch.equal(run(pipe), expected)
    tritoff.enable(pipe, mode="auto", budget="4MB", progress=False, kernels="reference", store=directory)
    assert torch.equal(run(pipe), expected)


def test_a_pipeline_loaded_without_a_component_uses_the_rest_of_the_store(saved, copy):
    # prompt embeddings computed once, the text encoder left out (from_pretrained(..., text_encoder=None)): its
    # file is neither needed nor read; a component enabled on its own is told which of the store's it is
    directory, _ = saved
    full = wan()
    _enable(full, store=directory)
    with torch.no_grad():
        embeds, negative = full.encode_prompt("a cat", max_sequence_length=16, device="cpu")
    prompt = dict(prompt=None, prompt_embeds=embeds, negative_prompt_embeds=negative)
    expected = run(full, **prompt)
    (copy / read_index(copy)["components"]["text_encoder"]["file"]).unlink()
    lean = wan()
    lean.text_encoder = None
    engine = _enable(lean, store=copy)
    assert set(engine.packed) == {"transformer", "vae"}
    assert torch.equal(run(lean, **prompt), expected)
    with pytest.raises(StoreError, match="holds this module as the pipeline's transformer: a store is read per"):
        _enable(wan().transformer, store=directory)


def test_a_store_that_is_no_path_is_refused_in_one_line():
    with pytest.raises(ValueError, match="a store is a directory, given as a str or pathlib.Path, got 123"):
        _enable(wan(), store=123)
    engine = _enable(wan())
    with pytest.raises(ValueError, match="a store is a directory, given as a str or pathlib.Path, got 5"):
        engine.save(5)


def _params(pipe, component):
    return getattr(pipe, component).named_parameters()


def test_truncated_missing_and_other_version_are_refused(copy, tmp_path):
    with open(copy / "transformer.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(StoreError, match="truncated"):
        _enable(wan(), store=copy)
    (copy / "transformer.safetensors").unlink()
    with pytest.raises(StoreError, match="transformer.safetensors is missing; recreate the store"):
        _enable(wan(), store=copy)
    (copy / "transformer.safetensors").mkdir()
    with pytest.raises(StoreError, match="transformer.safetensors is not a file; recreate the store"):
        _enable(wan(), store=copy)
    (copy / "transformer.safetensors").rmdir()
    index = json.loads((copy / INDEX).read_text())
    index["store_version"] = 1
    (copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match="store format 1, this tritoff reads formats 2, 3 and 4"):
        _enable(wan(), store=copy)
    for version, shown in (("4", "'4'"), (4.0, "4.0"), (True, "True")):  # a format number is an int
        index["store_version"] = version
        (copy / INDEX).write_text(json.dumps(index))
        with pytest.raises(StoreError, match=f"store format {shown}, this tritoff reads formats 2, 3 and 4"):
            _enable(wan(), store=copy)
    with pytest.raises(StoreError, match="not a tritoff store"):
        _enable(wan(), store=tmp_path)
    (tmp_path / INDEX).mkdir()
    with pytest.raises(StoreError, match=f"{INDEX} is not a file; recreate the store"):
        _enable(wan(), store=tmp_path)


def test_storage_other_than_the_stores_is_refused(saved):
    directory, _ = saved
    with pytest.raises(ValueError, match="holds fp8_e4m3"):
        _enable(wan(), store=directory, storage="fp8_e5m2")


def test_skip_other_than_the_stores_is_refused_and_the_same_one_accepted(saved):
    directory, expected = saved  # saved with no skip patterns of its own
    with pytest.raises(ValueError, match=r"skip=\['attn1'\] but the store at .* skip=\[\]; drop skip="):
        _enable(wan(), store=directory, skip="attn1")
    pipe = wan()
    assert _enable(pipe, store=directory, skip=()).options.skip == ()
    assert torch.equal(run(pipe), expected)


def test_a_store_packed_otherwise_than_the_enabled_pipeline_is_refused_naming_the_store(saved):
    directory, _ = saved  # no skip patterns
    pipe = wan()
    engine = _enable(pipe, skip=["attn1", "attn2.to_k"])
    expected = run(pipe)
    refusal = r"skip=\['attn1', 'attn2.to_k'\].*but the store at .* holds .*skip=\[\]: call tritoff.disable"
    with pytest.raises(ValueError, match=refusal):
        _enable(pipe, store=directory)
    assert pipe._tritoff_engine is engine and torch.equal(run(pipe), expected)


def test_an_enabled_pipeline_is_refused_a_store_of_other_weights(saved, tmp_path):
    directory, expected = saved  # made from wan(): the weights of the pipelines below
    _enable(wan(seed=1)).save(tmp_path / "other")
    for first in ({}, {"store": directory}, {"mode": "leaf"}):  # packed here, read from a store, grouped otherwise
        pipe = wan()
        engine = tritoff.enable(
            pipe, **{"mode": "group", "budget": "4MB", "progress": False, "kernels": "reference", **first}
        )
        with pytest.raises(StoreError, match="other was made from other weights than this pipeline's"):
            _enable(pipe, store=tmp_path / "other")
        assert pipe._tritoff_engine is engine and torch.equal(run(pipe), expected)
        _enable(pipe, store=directory)  # its own weights' store: accepted
        assert torch.equal(run(pipe), expected)
    # weights that differ in one layer of the last block only (a partial fine-tune, a LoRA merged into one layer)
    tuned = wan()
    with torch.no_grad():
        tuned.transformer.blocks[-1].ffn.net[2].weight.mul_(1.5)
    _enable(tuned).save(tmp_path / "tuned")
    for held in ({}, {"host_budget": 0, "spill_dir": str(tmp_path)}):  # every pack in memory, or every pack on disk
        pipe = wan()
        _enable(pipe, **held)
        with pytest.raises(StoreError, match=r"transformer \(transformer\.blocks\.3\.ffn\.net\.2\.weight differs\)"):
            _enable(pipe, store=tmp_path / "tuned")
    # the same weights given back by disable and packed again (into other bytes, for the same values): accepted
    pipe = wan()
    _enable(pipe)
    tritoff.disable(pipe)
    _enable(pipe)
    _enable(pipe, store=directory)
    assert torch.equal(run(pipe), expected)


def test_the_store_check_of_an_enabled_pipeline_shows_its_progress_and_closes_it_on_refusal(
    saved, tmp_path, monkeypatch
):
    import tqdm.auto

    bars = []

    class Recorder(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.shown = not self.disable  # close() disables a bar
            bars.append(self)

    def checks():
        return [(b.total, b.n, b.shown, b.disable) for b in bars if b.desc == "checking the store"]

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    directory, _ = saved
    stored = sum(
        p["nbytes"]
        for name in read_index(directory)["components"]
        for p in store_module._read_meta(directory / f"{name}.safetensors")["packs"]
    )
    pipe = wan()
    _enable(pipe)
    _enable(wan(seed=1)).save(tmp_path / "other")
    bars.clear()
    tritoff.enable(pipe, store=directory, progress=True)  # the same weights: every byte checked
    assert checks() == [(stored, stored, True, True)]  # shown, then closed
    bars.clear()
    with pytest.raises(StoreError, match="other weights"):
        tritoff.enable(pipe, store=tmp_path / "other", progress=True)
    ((total, done, shown, closed),) = checks()
    assert total == stored and 0 < done <= stored and shown and closed


def test_a_store_accepts_its_skip_patterns_in_any_order(tmp_path):
    pipe = wan()
    _enable(pipe, skip=["attn1", "attn2.to_k"]).save(tmp_path / "store")
    expected = run(pipe)
    again = wan()
    skip = ["attn2.to_k", "attn1", "attn1"]
    assert _enable(again, store=tmp_path / "store", skip=skip).options.skip == ("attn1", "attn2.to_k")
    assert torch.equal(run(again), expected)


@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda data: struct.pack("<Q", 2**36) + data[8:], "a header of 68719476736 bytes in a file of"),
        (lambda data: struct.pack("<Q", 2**63 - 1) + data[8:], "a header of 9223372036854775807 bytes"),
        (lambda data: data.replace(b"entries", b"entriez", 1), "a pack has no valid 'entries'"),
        (lambda data: data.replace(b"bfloat16", b"bfloat:6", 1), "pack blocks.0 has no valid out dtype"),
    ],
    ids=["huge-length", "largest-length", "renamed-field", "unknown-dtype"],
)
def test_headers_read_before_hashing_refuse_damage_in_one_line(copy, damage, why):
    """The CLI reads the store's dtypes from the file headers before hashing the files (to build models without
    weights): a damaged header is refused there in one line, not a MemoryError or KeyError traceback."""
    path = copy / "transformer.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    for read in (
        lambda: store_module.stored_compute_dtype(copy),
        lambda: store_module.stored_dtypes(copy, "transformer"),
    ):
        with pytest.raises(
            StoreError, match=rf"transformer\.safetensors has an unreadable header \({why}.*tritoff convert"
        ):
            read()


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_flipped_byte_is_refused_naming_the_file(copy, where):
    info = read_index(copy)["components"]["transformer"]
    last = max(store_module._read_meta(copy / "transformer.safetensors")["packs"], key=lambda p: p["offset"])
    # the last byte of the packs (a scale or a kept tensor), or a byte of the pack tables in the header
    end = info["data_offset"] + last["offset"] + last["nbytes"] - 1
    _flip(copy / "transformer.safetensors", end if where == "data" else 100)
    pipe = wan()
    with pytest.raises(StoreError, match=r"transformer\.safetensors is corrupt or from another conversion"):
        _enable(pipe, store=copy)
    assert not hasattr(pipe, "_tritoff_engine")  # refused before anything was used


def test_files_of_two_conversions_do_not_pass_as_one_store(copy, tmp_path):
    other = tmp_path / "e5m2"
    tritoff.enable(wan(), "fp8_e5m2", mode="group", budget="4MB", progress=False, kernels="reference").save(other)
    assert (other / "transformer.safetensors").stat().st_size == (copy / "transformer.safetensors").stat().st_size
    shutil.copy(other / "transformer.safetensors", copy / "transformer.safetensors")
    with pytest.raises(StoreError, match=r"transformer\.safetensors is corrupt or from another conversion"):
        _enable(wan(), store=copy)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda index: [1, 2, 3], "not a valid tritoff store index (not an object)"),
        (lambda index: {k: v for k, v in index.items() if k != "components"}, "no 'components'"),
        (lambda index: {**index, "skip": "x"}, "'skip' is not a list"),
        (lambda index: {**index, "components": {"vae": [1]}}, "component 'vae' is not an object"),
        (lambda index: {**index, "components": {"vae": {"file": "vae.safetensors"}}}, "has no str 'fingerprint'"),
        (lambda index: {**index, "storage": "fp8_e5m2"}, "was altered after it was written"),
    ],
    ids=["list", "missing-key", "wrong-type", "component-not-object", "component-missing-key", "edited-value"],
)
def test_a_malformed_or_edited_index_is_refused(copy, edit, message):
    index = json.loads((copy / INDEX).read_text())
    (copy / INDEX).write_text(json.dumps(edit(index)))
    with pytest.raises(StoreError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_index(copy)


def test_a_file_outside_the_store_is_refused(copy):
    index = json.loads((copy / INDEX).read_text())
    index["components"]["vae"]["file"] = "../vae.safetensors"
    (copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match="names a file outside the store"):
        read_index(copy)


def _packed_store_args(storage="fp8_e4m3"):
    engine = tritoff.enable(wan(), storage, mode="group", budget="4MB", progress=False, kernels="reference")
    return engine.fingerprints, engine.packed, engine.options.skip, "block"


def test_an_interrupted_save_leaves_the_old_store(copy, monkeypatch):
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    args = _packed_store_args("fp8_e5m2")
    written = []
    original = store_module._write_hashed

    def fail_on_second_file(path, chunks):
        written.append(path.name)
        if len(written) == 2:
            raise OSError("No space left on device")
        return original(path, chunks)

    monkeypatch.setattr(store_module, "_write_hashed", fail_on_second_file)
    with pytest.raises(OSError, match="No space left"):
        save_store(copy, *args, overwrite=True)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before  # untouched, not a mix of two conversions
    assert sorted(p.name for p in copy.parent.iterdir()) == ["copy"]  # the temporary directory is gone


def test_overwrite_replaces_a_store_and_only_a_store(copy, tmp_path):
    args = _packed_store_args("fp8_e5m2")
    with pytest.raises(StoreError, match="already holds a store: pass --overwrite"):
        save_store(copy, *args)
    save_store(copy, *args, overwrite=True)
    assert read_index(copy)["storage"] == "fp8_e5m2"
    verify_store(copy)
    assert sorted(p.name for p in copy.parent.iterdir()) == ["copy"]  # the old store was removed, not left aside
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not empty and holds no tritoff store"):
        save_store(tmp_path / "mine", *args, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="exists and is not a directory"):
        check_target(tmp_path / "file")
    with pytest.raises(StoreError, match="inside the model directory"):
        check_target(tmp_path / "mine" / "store", model=tmp_path / "mine")
    with pytest.raises(StoreError, match="inside the model directory"):
        check_target(tmp_path / "mine", overwrite=True, model=tmp_path / "mine")


def test_ctrl_c_while_the_old_store_is_deleted_leaves_no_part_of_it(copy, monkeypatch):
    # the new store is in place when the interrupt lands in the old one's deletion: the old one still goes, whole
    args = _packed_store_args("fp8_e5m2")
    real = shutil.rmtree
    interrupted = []

    def rmtree(path, *a, **k):
        if str(path).endswith(".old") and not interrupted:
            interrupted.append(path)
            next(p for p in Path(path).iterdir() if p.suffix == ".safetensors").unlink()  # part way through
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        save_store(copy, *args, overwrite=True)
    assert interrupted and sorted(p.name for p in copy.parent.iterdir()) == ["copy"]
    assert read_index(copy)["storage"] == "fp8_e5m2"
    verify_store(copy)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64, torch.uint16])
def test_parameters_of_any_dtype_are_stored_and_read_back(tmp_path, dtype):
    def with_extra():
        pipe = wan()
        values = torch.arange(64, dtype=torch.float32).to(dtype)
        pipe.transformer.register_parameter("extra", torch.nn.Parameter(values, requires_grad=False))
        return pipe

    _enable(with_extra()).save(tmp_path / "store")
    assert store_module.stored_dtypes(tmp_path / "store", "transformer")["extra"] == dtype
    pipe = with_extra()
    _enable(pipe, store=tmp_path / "store")
    tritoff.disable(pipe)
    assert torch.equal(pipe.transformer.extra.view(torch.uint8), with_extra().transformer.extra.view(torch.uint8))


def test_targets_a_store_cannot_be_renamed_into_are_refused_before_any_packing(copy, tmp_path, monkeypatch):
    args = _packed_store_args()
    # the current directory (or one holding it): the store would replace the shell's directory
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "empty")
    for target in (".", tmp_path / "empty", "sub/.."):
        with pytest.raises(StoreError, match="is the current directory or holds it.*name a directory to create"):
            check_target(target)
    monkeypatch.chdir(tmp_path / "empty" / "sub")
    with pytest.raises(StoreError, match="is the current directory or holds it"):
        check_target(tmp_path / "empty", overwrite=True)
    assert check_target(tmp_path / "new") == tmp_path / "new"  # elsewhere: fine
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    with pytest.raises(StoreError, match="the current directory was removed: give store as an absolute path"):
        check_target("store")
    monkeypatch.chdir(tmp_path)
    # a mount point, bind mounts too (rename gives EBUSY, after the whole conversion)
    assert store_module._is_mount_point(Path("/")) and not store_module._is_mount_point(tmp_path)
    monkeypatch.setattr(store_module, "_is_mount_point", lambda path: path == copy.resolve())
    with pytest.raises(
        StoreError, match=r"is a mount point.*write the store into a directory inside it \(.*copy/store\)"
    ):
        save_store(copy, *args, overwrite=True)
    verify_store(copy)  # left as it was
    # --overwrite of a store holding other files: they would be deleted with it
    monkeypatch.undo()
    (copy / "NOTES.txt").write_text("mine")
    (copy / "loras").mkdir()
    with pytest.raises(StoreError, match=r"holds files that are not the store's \(NOTES.txt, loras\).*move them out"):
        save_store(copy, *args, overwrite=True)
    assert (copy / "NOTES.txt").read_text() == "mine"
    (copy / "NOTES.txt").unlink()
    (copy / "loras").rmdir()
    (copy / "my_lora.safetensors").write_bytes(b"mine")  # not one the index lists
    with pytest.raises(StoreError, match=r"holds files that are not the store's \(my_lora.safetensors\)"):
        save_store(copy, *args, overwrite=True)
    (copy / "my_lora.safetensors").unlink()
    save_store(copy, *args, overwrite=True)


def test_store_files_follow_the_umask(tmp_path):
    args = _packed_store_args()
    previous = os.umask(0o027)
    try:
        save_store(tmp_path / "store", *args)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "store").iterdir()} == {0o640}


def test_loading_reads_headers_and_checks_each_pack_as_it_is_read(copy, monkeypatch):
    hashed = []
    original = store_module.file_hash
    monkeypatch.setattr(store_module, "file_hash", lambda path, progress=None: hashed.append(path) or original(path))
    engine = _enable(wan())
    components, groups = engine.components, engine._group_lists
    stored = load_store(copy, components, groups, engine.fingerprints)
    assert hashed == [] and all(p.on_disk for m in stored.values() for p in m.packs)  # headers only, no pack read
    verify_store(copy)
    assert hashed == []
    verify_store(copy, full=True)  # every byte, on request
    assert len(hashed) == 3
    vae = store_module._read_meta(copy / "vae.safetensors")["packs"][0]
    _flip(copy / "vae.safetensors", read_index(copy)["components"]["vae"]["data_offset"] + vae["offset"])
    stored = load_store(copy, components, groups, engine.fingerprints)
    with pytest.raises(StoreError, match=rf"vae\.safetensors is corrupt .*pack {vae['name']} differs"):
        hold_packs(stored["vae"], None)
    with pytest.raises(StoreError, match=r"vae\.safetensors is corrupt"):
        verify_store(copy, full=True)
    unchecked = load_store(copy, components, groups, engine.fingerprints, verify=False)
    hold_packs(unchecked["vae"], None)  # verify=False: the caller vouches for the files


def test_overwriting_through_a_link_replaces_the_linked_store(copy, tmp_path):
    (tmp_path / "link").symlink_to(copy)
    save_store(tmp_path / "link", *_packed_store_args("fp8_e5m2"), overwrite=True)
    assert (tmp_path / "link").is_symlink() and read_index(copy)["storage"] == "fp8_e5m2"
    verify_store(copy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "link"]


def test_disable_with_a_pack_damaged_on_disk_keeps_tritoff_enabled_and_says_so(copy, saved):
    pipe = wan()
    engine = _enable(pipe, store=copy, host_budget=0)  # every pack read from the store when needed
    meta = store_module._read_meta(copy / "transformer.safetensors")["packs"][-1]
    start = read_index(copy)["components"]["transformer"]["data_offset"] + meta["offset"]
    _flip(copy / "transformer.safetensors", start)
    message = r"^tritoff cannot read the weights back to restore them: .*transformer\.safetensors is corrupt.*enabled"
    with pytest.raises(StoreError, match=message):
        tritoff.disable(pipe)
    assert pipe._tritoff_engine is engine
    _flip(copy / "transformer.safetensors", start)  # repaired: the engine runs as before, and disable restores
    assert torch.equal(run(pipe), saved[1])
    tritoff.disable(pipe)
    assert not hasattr(pipe, "_tritoff_engine")
    assert torch.equal(run(pipe), saved[1])  # plain modules holding the dequantized weights: the store's output


def test_a_model_built_without_weights_fills_from_its_store_under_inference_mode(tmp_path):
    from .helpers import Stack, stack

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model = stack()
    engine = tritoff.enable(model, mode="group", budget=80_000, progress=False)
    with torch.no_grad():
        expected = model(x)
    engine.save(tmp_path / "store")
    tritoff.disable(model)
    with torch.inference_mode(), torch.device("meta"):  # built without weights, as `tritoff run --store` builds
        empty = Stack().to(torch.bfloat16)
    with torch.inference_mode():  # its new parameters are ordinary ones, which tritoff manages as any other
        tritoff.enable(empty, mode="group", budget=80_000, progress=False, store=tmp_path / "store")
        assert torch.equal(empty(x), expected)
    tritoff.disable(empty)
    with torch.no_grad():
        assert torch.equal(empty(x), expected)


class _TwoLayers(torch.nn.Module):
    """No block list: mode group streams its layers, modes auto and model move it as one group."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("saved_in", ["group", "auto"])
def test_a_block_store_of_a_model_without_block_lists_serves_every_mode_but_leaf(tmp_path, saved_in):
    # the store holds the layers (mode group) or the whole rest (auto): either is read in the other modes
    def model():
        torch.manual_seed(0)
        return _TwoLayers().eval()

    x = torch.randn(2, 16)
    source = model()
    with torch.no_grad():
        expected = source(x)
    engine = tritoff.enable(source, mode=saved_in, device="cpu", storage="bf16", progress=False)
    engine.save(tmp_path / "store")
    for mode in (None, "auto", "model", "group"):
        target = model()
        tritoff.enable(target, store=str(tmp_path / "store"), mode=mode, device="cpu", progress=False)
        with torch.no_grad():
            assert torch.equal(target(x), expected), mode
        tritoff.disable(target)

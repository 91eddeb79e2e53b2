"""tritoff/convert.py: reading the checkpoint group by group gives exactly the store of a fully loaded pipeline."""

import json

import pytest

from tritoff.checkpoint import CheckpointReader
from tritoff.convert import convert_pipeline

from .helpers import wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def test_streamed_conversion_equals_the_loaded_one(tmp_path, monkeypatch):
    from diffusers.models.modeling_utils import ModelMixin

    wan().save_pretrained(tmp_path / "pipe")
    reads, loaded = [], []
    original = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read", lambda self, items: reads.append(len(items)) or original(self, items))
    load = ModelMixin.from_pretrained.__func__
    spy = classmethod(lambda cls, *args, **kwargs: loaded.append(cls.__name__) or load(cls, *args, **kwargs))
    monkeypatch.setattr(ModelMixin, "from_pretrained", spy)
    streamed = convert_pipeline(tmp_path / "pipe", tmp_path / "a", progress=False, stream=True)
    # one read per group of the transformer (4 blocks + rest) and of the VAE: never the whole checkpoint at once, and
    # never loaded whole besides (Wan's transformer is an optional component, which diffusers loads unless told not to)
    assert len(reads) > 5 and max(reads) < sum(reads) / 2
    assert loaded == []
    convert_pipeline(tmp_path / "pipe", tmp_path / "b", progress=False, stream=False)
    assert set(streamed) == {"text_encoder", "transformer", "vae"}
    for file in sorted(p.name for p in (tmp_path / "b").iterdir()):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    # every pack went to a spill file as it was made: no arena held them (host memory is one group)
    assert all(m.arena.nbytes == 0 and all(p.on_disk for p in m.packs) for m in streamed.values())
    # and the files are the ones an engine holding every pack in memory saves
    import torch

    import tritoff
    from tritoff.convert import from_pretrained

    pipe = from_pretrained(tmp_path / "pipe", torch.bfloat16)
    tritoff.enable(pipe, budget="1GB", progress=False, kernels="reference").save(tmp_path / "c")
    for file in ("text_encoder.safetensors", "transformer.safetensors", "vae.safetensors"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "c" / file).read_bytes(), file


@pytest.fixture(scope="module")
def two_pipelines(tmp_path_factory):
    """Two saved tiny Wan pipelines of the same architecture with different random weights, and a store of the first."""
    from tritoff.tiny import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("sources")
    tiny_wan_pipeline(seed=0).save_pretrained(root / "a")
    tiny_wan_pipeline(seed=1).save_pretrained(root / "b")
    convert_pipeline(root / "a", root / "store", progress=False)
    return root


def test_the_store_records_its_source_and_refuses_other_weights(two_pipelines):
    from tritoff.store import StoreError, check_source, read_index

    root = two_pipelines
    files = read_index(root / "store")["source"]["files"]
    assert set(files) == {
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    }
    check_source(root / "store", root / "a")
    # same architecture, so same sizes and headers: only the content hash tells them apart
    other = root / "b" / "transformer" / "diffusion_pytorch_model.safetensors"
    assert files["transformer/diffusion_pytorch_model.safetensors"]["size"] == other.stat().st_size
    with pytest.raises(StoreError, match="was made from other weights: .*differs in content"):
        check_source(root / "store", root / "b")


def test_a_missing_or_extra_weight_file_is_refused(two_pipelines, tmp_path):
    import shutil

    from tritoff.store import StoreError, check_source

    model = tmp_path / "a"
    shutil.copytree(two_pipelines / "a", model)
    (model / "vae" / "extra.safetensors").write_bytes(b"")
    with pytest.raises(StoreError, match="a file it does not know"):
        check_source(two_pipelines / "store", model)
    (model / "vae" / "extra.safetensors").unlink()
    (model / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(StoreError, match="vae/diffusion_pytorch_model.safetensors, which .* lacks"):
        check_source(two_pipelines / "store", model)


def test_source_records_sample_large_files(tmp_path):
    """A file larger than the sampled windows: the header is hashed whole, and a change in any window is seen."""
    import random
    import struct

    from tritoff.store import SAMPLE_BYTES, SAMPLE_WINDOWS, _source_record

    header = b'{"__metadata__":{}}'
    path = tmp_path / "big.safetensors"
    path.write_bytes(
        struct.pack("<Q", len(header)) + header + random.Random(0).randbytes(8 * SAMPLE_WINDOWS * SAMPLE_BYTES)
    )
    size = path.stat().st_size
    records = [_source_record(path)]
    for window in (SAMPLE_WINDOWS // 2, SAMPLE_WINDOWS - 1):  # a middle window, and the last one (the file's end)
        offset = window * (size - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1) + SAMPLE_BYTES - 1
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x80]))
        records.append(_source_record(path))
    assert len({(r["size"], r["header"]) for r in records}) == 1
    assert len({r["sample"] for r in records}) == 3


def test_convert_refuses_a_non_empty_target_and_the_model_directory(two_pipelines, tmp_path):
    from tritoff.store import StoreError

    with pytest.raises(StoreError, match="inside the model directory"):
        convert_pipeline(two_pipelines / "a", two_pipelines / "a" / "store", progress=False)
    with pytest.raises(StoreError, match="already holds a store"):
        convert_pipeline(two_pipelines / "a", two_pipelines / "store", progress=False)


def test_a_disk_that_cannot_hold_the_packs_is_refused_before_packing(two_pipelines, tmp_path, monkeypatch):
    import shutil

    from tritoff import packer

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100_000))  # the packs take ~190 kB
    monkeypatch.setattr(packer, "write_pack", lambda *args: pytest.fail("packing started"))
    with pytest.raises(ValueError, match=r"converting needs .* of free disk in .* which has 97.66 KiB: write the"):
        convert_pipeline(two_pipelines / "a", tmp_path / "store", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_checkpoint_is_a_one_line_error(two_pipelines, tmp_path):
    import shutil

    model = tmp_path / "a"
    shutil.copytree(two_pipelines / "a", model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"cannot read .*diffusion_pytorch_model.safetensors: .*checkpoint complete"):
        convert_pipeline(model, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_a_model_class_the_library_lacks_is_a_one_line_error(two_pipelines, tmp_path, component):
    import shutil

    model = tmp_path / "a"
    shutil.copytree(two_pipelines / "a", model)
    index = json.loads((model / "model_index.json").read_text())
    index[component] = [index[component][0], "NoSuchModel"]
    (model / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"NoSuchModel"):
        convert_pipeline(model, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()


def _store_files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_packs_are_written_where_they_stay(two_pipelines, tmp_path, monkeypatch):
    """Each pack goes straight into its component's file of the store being written: nothing is copied, and the
    store is the one an engine holding every pack in memory saves, byte for byte."""
    from tritoff import store

    written = []
    original = store._write_hashed
    monkeypatch.setattr(
        store, "_write_hashed", lambda path, chunks: written.append(path.name) or original(path, chunks)
    )
    packed = convert_pipeline(two_pipelines / "a", tmp_path / "store", progress=False)
    assert written == [store.INDEX]  # the component files got their headers, not a copy
    for name, model in packed.items():  # the packs now live in the store's files
        assert {p.file.path for p in model.packs} == {str(tmp_path / "store" / f"{name}.safetensors")}
    store.verify_store(tmp_path / "store", full=True)
    assert _store_files(tmp_path / "store") == _store_files(two_pipelines / "store")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_converting_needs_the_packs_once_on_disk(two_pipelines, tmp_path, monkeypatch):
    import shutil

    packs = sum(p.stat().st_size for p in (two_pipelines / "store").glob("*.safetensors"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=int(1.05 * packs)))
    convert_pipeline(two_pipelines / "a", tmp_path / "store", progress=False)
    assert _store_files(tmp_path / "store") == _store_files(two_pipelines / "store")


def test_an_interrupted_conversion_leaves_no_file(two_pipelines, tmp_path, monkeypatch):
    from tritoff import packer

    calls = []
    original = packer.write_pack

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(packer, "write_pack", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_pipeline(two_pipelines / "a", tmp_path / "store", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_what_a_killed_conversion_left_is_removed_by_the_next(two_pipelines, tmp_path):
    """A conversion killed outright (the out-of-memory killer) cannot clean up: the next write of the same store
    removes its partial directory, whose lock nobody holds, and leaves alone one whose writer holds it (in a container
    with the same host name, process ids would not tell), one without a lock file, and other stores' ones."""
    import fcntl
    import os

    def partial(name):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "transformer.safetensors").write_bytes(b"x" * 1000)
        (directory / ".writing").touch()
        return directory

    left = partial(".store.abcd_123.partial")
    live = partial(".store.efgh_456.partial")
    legacy = partial(".store.ijkl_789.partial")
    (legacy / ".writing").unlink()
    others = [partial(".other.abcd_123.partial"), partial(".store.abcd_1234.partial"), partial(".store.x.y.partial")]
    held = os.open(live / ".writing", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # as its writer would
    try:
        convert_pipeline(two_pipelines / "a", tmp_path / "store", progress=False)
    finally:
        os.close(held)
    kept = sorted(p.name for p in [live, legacy, *others])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "store"])
    assert not left.exists() and not (tmp_path / "store" / ".writing").exists()


def test_convert_overwrites_a_store_it_is_asked_to(two_pipelines, tmp_path):
    import shutil

    from tritoff.store import read_index, verify_store

    shutil.copytree(two_pipelines / "store", tmp_path / "store")
    (tmp_path / "link").symlink_to(tmp_path / "store")
    convert_pipeline(two_pipelines / "b", tmp_path / "link", progress=False, storage="fp8_e5m2", overwrite=True)
    assert (tmp_path / "link").is_symlink() and read_index(tmp_path / "store")["storage"] == "fp8_e5m2"
    verify_store(tmp_path / "store", full=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "store"]


def test_the_disk_check_counts_the_headers_too(two_pipelines, tmp_path, monkeypatch):
    import shutil

    files = sum(p.stat().st_size for p in (two_pipelines / "store").glob("*.safetensors"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=files - 1))
    with pytest.raises(ValueError, match="converting needs .* for the store, which has"):
        convert_pipeline(two_pipelines / "a", tmp_path / "store", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_fetching_a_hub_id_passes_the_machines_own_errors_on(monkeypatch):
    import errno

    from diffusers import DiffusionPipeline

    from tritoff.convert import fetch_pipeline

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiffusionPipeline, "download", full_disk)
    with pytest.raises(OSError, match="No space left on device") as info:
        fetch_pipeline("org/name")
    assert info.value.errno == errno.ENOSPC  # the command's exit 1 (the machine), not 2 (the user's input)


def test_a_download_cut_short_is_told_from_a_complete_pipeline(tmp_path):
    import json
    import os
    import shutil

    from tritoff.convert import missing_component

    wan().save_pretrained(tmp_path / "pipe")
    assert missing_component(tmp_path / "pipe") is None

    def variant(name, change):
        copy = tmp_path / name
        shutil.copytree(tmp_path / "pipe", copy)
        change(copy)
        return missing_component(copy)

    weights = "transformer/diffusion_pytorch_model.safetensors"

    def shard(copy):  # an index naming two shards, one of them never downloaded
        (copy / weights).rename(copy / "transformer/diffusion_pytorch_model-00001-of-00002.safetensors")
        shards = {"a": "diffusion_pytorch_model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (copy / f"{weights}.index.json").write_text(json.dumps({"weight_map": shards}))

    def dangling(copy):  # the cache's layout: a link to a blob that is not there
        (copy / "vae/config.json").unlink()
        os.symlink(copy / "blobs-missing", copy / "vae/config.json")

    def custom(copy):  # a custom pipeline's class, and a component folder with a config but no weights to load
        index = json.loads((copy / "model_index.json").read_text())
        index["_class_name"] = ["my_pipeline", "MyPipeline"]
        (copy / "tokenizer/config.json").write_text("{}")
        (copy / "model_index.json").write_text(json.dumps(index))

    assert variant("no-weights", lambda copy: (copy / weights).unlink()) == "transformer"
    assert variant("shard", shard) == "transformer"
    assert variant("dangling", dangling) == "vae"
    assert variant("empty", lambda copy: shutil.rmtree(copy / "text_encoder") or (copy / "text_encoder").mkdir()) == (
        "text_encoder"
    )
    assert variant("custom", custom) is None

    def other_format_index(copy):  # an index of .bin shards never fetched beside complete safetensors (--exclude *.bin)
        shards = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
        (copy / "text_encoder/pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": shards}))
        os.symlink(copy / "blobs-missing", copy / "text_encoder/README.md")  # a link loading never reads

    assert variant("other-format", other_format_index) is None

    def beside_a_complete_one(copy):  # one index's shards cut short, though the single file is whole
        shard(copy)
        shutil.copy(tmp_path / "pipe" / weights, copy / weights)

    assert variant("beside", beside_a_complete_one) == "transformer"
    assert variant("tokenizer-link", lambda copy: os.symlink(copy / "nowhere", copy / "tokenizer/spiece.model")) == (
        "tokenizer"
    )


@pytest.mark.parametrize("dtype", ["pipeline dtype", "stored dtypes"])
def test_a_component_built_from_its_config_keeps_its_saved_buffers(tmp_path, dtype):
    # `tritoff run --store` builds diffusers components empty: a learned positional embedding (a persistent buffer,
    # CogVideoX-5B I2V's) kept its sinusoidal initial values instead of the checkpoint's
    import torch
    from diffusers import CogVideoXTransformer3DModel

    from tritoff.convert import empty_diffusers_component
    from tritoff.tiny import COGVIDEOX_TINY

    learned = dict(use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True)
    model = CogVideoXTransformer3DModel(**COGVIDEOX_TINY, **learned)
    with torch.no_grad():
        model.patch_embed.pos_embedding.normal_()
    model.save_pretrained(tmp_path)
    (tmp_path / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"")  # a variant beside it is read after
    if dtype == "pipeline dtype":
        built = empty_diffusers_component(tmp_path, "CogVideoXTransformer3DModel", torch.bfloat16)
    else:
        stored = {name: p.dtype for name, p in model.named_parameters()}
        built = empty_diffusers_component(tmp_path, "CogVideoXTransformer3DModel", torch.bfloat16, stored=stored)
    saved, got = model.patch_embed.pos_embedding, built.patch_embed.pos_embedding
    assert torch.equal(got, saved.to(got.dtype)) and not torch.equal(saved, torch.zeros_like(saved))


def test_a_config_is_blamed_only_when_the_model_cannot_be_built_from_it(two_pipelines, tmp_path):
    # the text encoder's class reads its config as from_pretrained does: a config without model_type (which
    # AutoConfig would need) builds, so a failure elsewhere is not blamed on it
    import shutil

    from tritoff.convert import config_fault, load_error

    model = tmp_path / "a"
    shutil.copytree(two_pipelines / "a", model)
    config = model / "text_encoder" / "config.json"
    values = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in values.items() if k != "model_type"}))
    assert config_fault(model) is None
    failure = RuntimeError("blocks.0.ffn.net.0.proj.bias expected shape [64], got [32]")
    assert str(load_error(model, failure, model)) == f"cannot load {model}: {failure}"
    # a value the config class refuses (transformers raises its own exception type): named, whatever was raised
    config.write_text(json.dumps({**values, "num_heads": "x"}))
    said = str(load_error(model, Exception("Validation error for field 'num_heads'"), model))
    assert said.startswith(f"cannot build a model from {config}: ") and said.endswith("fix the config"), said
    assert load_error(model, MemoryError(), model) is None  # the machine's: as it is


def test_a_config_that_does_not_describe_its_weights_is_named_before_anything_is_read(tmp_path):
    # a learned positional embedding is a buffer copied from the checkpoint when the component is built empty: a
    # config of other sizes failed there, naming no file
    import torch
    from diffusers import CogVideoXTransformer3DModel

    from tritoff.checkpoint import ConfigError
    from tritoff.convert import empty_diffusers_component
    from tritoff.tiny import COGVIDEOX_TINY

    learned = dict(use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True)
    CogVideoXTransformer3DModel(**COGVIDEOX_TINY, **learned).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    wider = config["num_attention_heads"] * 2
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": wider}))
    with pytest.raises(ConfigError, match=r"config.json does not describe the weights beside it: patch_embed\.pos_emb"):
        empty_diffusers_component(tmp_path, "CogVideoXTransformer3DModel", torch.bfloat16)


def test_checkpoint_tensors_the_model_has_no_place_for_are_warned_of(two_pipelines, tmp_path):
    import shutil

    from tritoff.warn import TritoffWarning

    model = tmp_path / "a"
    shutil.copytree(two_pipelines / "a", model)
    config = model / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": 1}))
    unused = r"transformer: \d+ tensors of its checkpoint \(blocks\.\d\..*\) have no place"
    with pytest.warns(TritoffWarning, match=unused):
        packed = convert_pipeline(model, tmp_path / "store", progress=False)
    names = {entry.name for pack in packed["transformer"].packs for entry in pack.layout.entries}
    assert "blocks.0.ffn.net.0.proj.weight" in names and not any(name.startswith("blocks.1.") for name in names)


ENCODERS = [  # (tiny pipeline, component): each transformers model class the tiny families load
    ("tiny_wan_pipeline", "text_encoder"),  # UMT5: its embeddings shared by two modules
    ("tiny_cogvideox_pipeline", "text_encoder"),  # T5: the same, and its `wo` kept in fp32 under fp16
    ("tiny_flux_pipeline", "text_encoder"),  # CLIP text: its position ids a non-persistent buffer
    ("tiny_hunyuan_video_pipeline", "text_encoder"),  # Llama: its rotary frequencies a buffer computed at init
    ("tiny_wan_i2v_pipeline", "image_encoder"),  # CLIP vision
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("factory", "name"), ENCODERS)
def test_a_stored_encoder_is_built_without_its_weights_as_from_pretrained_loads_it(tmp_path, factory, name, dtype):
    # `tritoff run --store` builds transformers components from their configs (UMT5-XXL: 11 GB it no longer reads),
    # then the store's packs fill them: the same model as loaded, ties, buffers and outputs
    _built_and_loaded_compute_alike(tmp_path, factory, name, dtype)


def test_a_stored_encoder_built_without_its_weights_looks_its_large_table_up_on_the_host(tmp_path, monkeypatch):
    from tritoff import groups

    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 8 * 1024)  # the tiny UMT5's 16 KiB table counts as large
    engine = _built_and_loaded_compute_alike(tmp_path, "tiny_wan_pipeline", "text_encoder", "bfloat16")
    assert engine.stats["components"]["model"]["host_lookup_bytes"] == 256 * 32 * 2  # the table, read where it lies


def _built_and_loaded_compute_alike(tmp_path, factory, name, dtype):
    import torch

    import tritoff
    from tritoff import tiny
    from tritoff.convert import empty_transformers_component
    from tritoff.fingerprint import fingerprint

    dtype = getattr(torch, dtype)
    saved = getattr(getattr(tiny, factory)(), name)
    saved.save_pretrained(tmp_path / name)
    cls = type(saved)
    loaded = cls.from_pretrained(tmp_path / name, torch_dtype=dtype)
    stored = {n: p.dtype for n, p in loaded.named_parameters()}
    built = empty_transformers_component(tmp_path / name, cls.__name__, dtype, stored)
    assert fingerprint(built) == fingerprint(loaded)  # the store's check: class, config, names, shapes, dtypes
    assert all(p.is_meta for p in built.parameters()) and not built.training

    def aliases(model):
        found = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            found.setdefault(id(p), []).append(n)
        return sorted(found.values())

    assert aliases(built) == aliases(loaded)
    buffers = dict(loaded.named_buffers())
    assert {n: (b.dtype, b.shape) for n, b in built.named_buffers()} == {
        n: (b.dtype, b.shape) for n, b in buffers.items()
    }
    assert all(torch.equal(b, buffers[n]) for n, b in built.named_buffers())
    assert built.config._attn_implementation == loaded.config._attn_implementation

    # from a store the loaded model's engine wrote, the built one computes exactly what the loaded one does
    tritoff.enable(loaded, budget="64MB", progress=False, kernels="reference").save(tmp_path / "store")
    tritoff.disable(loaded)
    if name == "image_encoder":
        inputs = dict(pixel_values=torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(dtype))
    else:
        inputs = dict(input_ids=torch.arange(2, 10).reshape(1, 8))
    outputs, engines = [], []
    for model in (built, cls.from_pretrained(tmp_path / name, torch_dtype=dtype)):
        engines.append(
            tritoff.enable(model, budget="64MB", store=tmp_path / "store", progress=False, kernels="reference")
        )
        with torch.no_grad():
            outputs.append(model(**inputs).last_hidden_state)
    assert torch.equal(*outputs) and outputs[0].abs().sum() > 0
    return engines[0]


def test_an_encoder_with_a_persistent_buffer_its_checkpoint_lacks_is_not_built_empty(tmp_path, monkeypatch):
    # from_pretrained would give such a buffer a value from the file (maybe under another name) or initialize it;
    # built from the config it would keep its initial value unseen: `run --store` loads such an encoder whole instead
    import torch
    from transformers import UMT5EncoderModel

    from tritoff.convert import empty_transformers_component
    from tritoff.tiny import tiny_umt5

    tiny_umt5().save_pretrained(tmp_path)
    stored = {n: p.dtype for n, p in UMT5EncoderModel.from_pretrained(tmp_path).named_parameters()}
    assert all(
        p.is_meta
        for p in empty_transformers_component(tmp_path, "UMT5EncoderModel", torch.bfloat16, stored).parameters()
    )
    init = UMT5EncoderModel.__init__

    def with_buffer(self, config):
        init(self, config)
        self.register_buffer("scale", torch.ones(4))  # persistent, and not in the checkpoint saved before

    monkeypatch.setattr(UMT5EncoderModel, "__init__", with_buffer)
    with pytest.raises(ValueError, match="no saved value under the model's name for buffer scale"):
        empty_transformers_component(tmp_path, "UMT5EncoderModel", torch.bfloat16, stored)


def test_a_failed_download_says_why_in_a_few_words():
    import socket

    from tritoff.convert import _fetch_cause

    # diffusers wraps the network's error in a paragraph about the cache: the network's is said
    wrapped = OSError("Cannot load model org/x: the model is not fully cached locally (" + "no snapshot " * 20)
    try:
        try:
            raise socket.gaierror(-2, "Name or service not known")
        except socket.gaierror as network:
            raise wrapped from network
    except OSError as err:
        assert _fetch_cause(err) == "the hub could not be reached: [Errno -2] Name or service not known"
    # otherwise its first line, cut at a word
    cut = _fetch_cause(OSError("word " * 100 + "\nsecond line"))
    assert cut == ("word " * 40).rstrip() + " ..." and len(cut) <= 204
    assert _fetch_cause(OSError("Repository not found\nmore")) == "Repository not found"

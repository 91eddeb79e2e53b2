"""Per-component storage: VAEs keep their own dtype by default, ``storage`` takes ``{component: format}``, stores
record each component's storage (format 3) and still read format 2."""

import json

import pytest
import torch

import tritoff
from tritoff.pack import KIND_FP8
from tritoff.storage import describe_storage, parse_storage, resolve_storage
from tritoff.store import INDEX, _index_hash, read_index

from .helpers import WAN_CALL, dequantized_pipeline, run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, progress=False, kernels="reference", **kwargs)


def _fp8_entries(engine, component) -> int:
    return sum(e.kind == KIND_FP8 for p in engine.packed[component].packs for e in p.layout.entries)


def test_the_vae_keeps_its_own_dtype_by_default():
    pipe = wan()
    dtypes = {n: p.dtype for n, p in pipe.vae.named_parameters()}
    engine = _enable(pipe, storage="fp8_e5m2", mode="group", budget="4MB")
    assert engine.options.storage == {"text_encoder": "fp8_e5m2", "transformer": "fp8_e5m2", "vae": "bf16"}
    assert _fp8_entries(engine, "vae") == 0 and _fp8_entries(engine, "transformer") > 0
    assert {e.name: e.dtype for p in engine.packed["vae"].packs for e in p.layout.entries} == dtypes  # fp32 here
    assert "storage fp8_e5m2 (vae: own dtype)" in engine.report()
    assert not any(name.startswith("vae.") for name in engine.snr)  # nothing of the VAE was quantized
    assert torch.equal(run(pipe), run(dequantized_pipeline(wan, "fp8_e5m2")))


def test_a_dict_names_components_and_the_others_get_the_defaults():
    storage = {"vae": "fp8_e4m3", "transformer": "fp8_e5m2"}
    pipe = wan()
    engine = _enable(pipe, storage=storage, mode="group", budget="4MB")
    assert engine.options.storage == {"text_encoder": "fp8_e4m3", "transformer": "fp8_e5m2", "vae": "fp8_e4m3"}
    assert _fp8_entries(engine, "vae") > 0
    assert torch.equal(run(pipe), run(dequantized_pipeline(wan, storage)))


def test_a_storage_naming_no_component_is_refused_and_changes_nothing():
    pipe = wan()
    before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ValueError, match="storage names 'unet', which is not a component; the components are") as info:
        _enable(pipe, storage={"unet": "fp8_e4m3"}, mode="group", budget="4MB")
    assert "\n" not in str(info.value) and not hasattr(pipe, "_tritoff_engine")
    assert all(torch.equal(p, before[n]) for n, p in pipe.transformer.named_parameters())
    with pytest.raises(ValueError, match="unknown storage 'int4'"):
        _enable(pipe, storage={"vae": "int4"}, mode="group", budget="4MB")
    with pytest.raises(ValueError, match="^storage names 'x', 1, which are not components"):  # keys of two types
        _enable(pipe, storage={1: "bf16", "x": "fp16"}, mode="group", budget="4MB")


def test_resolve_and_parse():
    names = dict.fromkeys(["text_encoder", "transformer", "vae", "audio_vae"])
    assert resolve_storage(None, names) == {
        "text_encoder": "fp8_e4m3",
        "transformer": "fp8_e4m3",
        "vae": "bf16",
        "audio_vae": "bf16",
    }
    assert set(resolve_storage("bf16", names).values()) == {"bf16"}  # pure offload everywhere
    assert parse_storage("FP8-E5M2") == "fp8_e5m2"
    assert parse_storage("vae=fp8_e4m3, transformer=fp8_e5m2") == {"vae": "fp8_e4m3", "transformer": "fp8_e5m2"}
    with pytest.raises(ValueError, match="component=format pairs"):
        parse_storage("vae=")


def test_a_store_records_each_components_storage(tmp_path):
    storage = {"transformer": "fp8_e5m2"}
    engine = _enable(wan(), storage=storage, mode="group", budget="4MB")
    engine.save(tmp_path / "store")
    index = read_index(tmp_path / "store")
    assert index["store_version"] == 4 and index["storage"] == "mixed"
    assert {n: c["storage"] for n, c in index["components"].items()} == {
        "text_encoder": "fp8_e4m3",
        "transformer": "fp8_e5m2",
        "vae": "bf16",
    }
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB", store=tmp_path / "store")
    assert engine.options.storage == {"text_encoder": "fp8_e4m3", "transformer": "fp8_e5m2", "vae": "bf16"}
    assert torch.equal(run(pipe), run(dequantized_pipeline(wan, storage)))
    with pytest.raises(ValueError, match="storage for transformer is fp8_e4m3 but the store .* holds fp8_e5m2"):
        _enable(wan(), storage="fp8_e4m3", mode="group", budget="4MB", store=tmp_path / "store")


def test_a_format_2_store_is_read_with_its_one_storage(tmp_path):
    """Format 2 recorded one storage for every component: such a store (every component in fp8_e4m3, the VAE too)
    is read as it was written."""
    storage = {"vae": "fp8_e4m3"}
    engine = _enable(wan(), storage=storage, mode="group", budget="4MB")
    engine.save(tmp_path / "store")
    path = tmp_path / "store" / INDEX
    index = json.loads(path.read_text())
    index["store_version"] = 2
    for component in index["components"].values():
        del component["storage"]
    index["index_hash"] = _index_hash(index)
    path.write_text(json.dumps(index))
    pipe = wan()
    engine = _enable(pipe, mode="group", budget="4MB", store=tmp_path / "store")
    assert set(engine.options.storage.values()) == {"fp8_e4m3"}
    assert torch.equal(run(pipe, WAN_CALL), run(dequantized_pipeline(wan, storage), WAN_CALL))


def test_the_reports_storage_names_the_majority_or_says_mixed():
    assert describe_storage({"text_encoder": "fp8_e4m3", "transformer": "fp8_e4m3", "vae": "bf16"}) == (
        "fp8_e4m3 (vae: own dtype)"
    )
    # bf16 and fp16 keep each tensor's own dtype: "fp16" on a bf16 model would name a cast that never happens
    assert describe_storage({"text_encoder": "bf16", "transformer": "bf16"}) == "own dtype"
    assert describe_storage({"text_encoder": "fp16", "transformer": "fp16", "vae": "bf16"}) == "own dtype"
    # one component each: none of them is the pipeline's storage
    # each component named in the order of their names, whatever the pipeline's order
    assert describe_storage({"vae": "fp8_e5m2", "text_encoder": "fp8_e4m3", "transformer": "bf16"}) == (
        "mixed (text_encoder: fp8_e4m3, transformer: own dtype, vae: fp8_e5m2)"
    )
    assert describe_storage(
        {"vae": "bf16", "transformer": "bf16", "text_encoder": "fp8_e4m3", "a": "fp8_e4m3", "b": "fp8_e4m3"}
    ) == ("fp8_e4m3 (transformer: own dtype, vae: own dtype)")


def test_a_vae_is_told_by_its_class_methods_not_by_submodules_named_encode_and_decode():
    import torch.nn as nn

    class Codec(nn.Module):  # an autoencoder-like module whose halves are submodules: not a VAE kept in its dtype
        def __init__(self):
            super().__init__()
            self.encode, self.decode = nn.Linear(4, 2), nn.Linear(2, 4)

    class Vae(nn.Module):
        def encode(self, x):
            return x

        def decode(self, z):
            return z

    assert resolve_storage(None, {"model": Codec()}) == {"model": "fp8_e4m3"}
    assert resolve_storage(None, {"model": Vae()}) == {"model": "bf16"}

"""tritoff/loading.py: a pipeline loaded for its store, its stored components built without their weights."""

import json
import shutil

import pytest
import torch

import tritoff
from tritoff.convert import convert_pipeline, from_pretrained
from tritoff.store import StoreError

from .helpers import run

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny Wan pipeline and its store, and another of the same architecture with other weights."""
    from tritoff.tiny import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("loading")
    tiny_wan_pipeline(seed=0).save_pretrained(root / "pipe")
    tiny_wan_pipeline(seed=1).save_pretrained(root / "other")
    convert_pipeline(root / "pipe", root / "store", progress=False)
    return root


def test_the_stored_components_are_built_without_weights_and_compute_as_loaded_ones(saved, monkeypatch):
    from safetensors import torch as safetensors_torch

    read = []
    load_file = safetensors_torch.load_file
    monkeypatch.setattr(safetensors_torch, "load_file", lambda *a, **k: read.append(a[0]) or load_file(*a, **k))
    pipe = tritoff.load_pipeline(saved / "pipe", store=saved / "store")
    assert read == []  # diffusers read no weight file (transformers' reads would leave no meta parameter below)
    for name in ("text_encoder", "transformer", "vae"):
        assert {p.device.type for p in getattr(pipe, name).parameters()} == {"meta"}, name
    assert pipe.tokenizer is not None and pipe.scheduler is not None
    engine = tritoff.enable(pipe, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    loaded = from_pretrained(saved / "pipe", torch.bfloat16)
    tritoff.enable(loaded, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    frames = run(pipe)
    assert torch.equal(frames, run(loaded)) and frames.abs().sum() > 0
    assert engine.stats["components"]["text_encoder"]["calls"] > 0


def test_a_store_of_other_weights_or_dtype_or_components_is_refused_before_anything_loads(saved, tmp_path):
    store = saved / "store"
    with pytest.raises(StoreError, match="was made from other weights"):
        tritoff.load_pipeline(saved / "other", store=store)
    with pytest.raises(StoreError, match="converted in bfloat16 and the pipeline would load in float16: pass dtype="):
        tritoff.load_pipeline(saved / "pipe", store=store, dtype=torch.float16)
    # a second expert the store lacks
    shutil.copytree(saved / "pipe", tmp_path / "two")
    shutil.copytree(saved / "pipe" / "transformer", tmp_path / "two" / "transformer_2")
    index = json.loads((tmp_path / "two" / "model_index.json").read_text())
    (tmp_path / "two" / "model_index.json").write_text(json.dumps({**index, "transformer_2": index["transformer"]}))
    with pytest.raises(StoreError, match=r"holds components \['text_encoder', 'transformer', 'vae'\] but"):
        tritoff.load_pipeline(tmp_path / "two", store=store)
    (tmp_path / "two" / "model_index.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read .*model_index.json"):
        tritoff.load_pipeline(tmp_path / "two", store=store)


def test_a_lora_loaded_before_enable_onto_a_component_built_without_weights_is_refused(saved):
    # its weights are made on the meta device beside the base layer's: they have no values, and the store no packs
    from .helpers import lora_state_dict

    lora = lora_state_dict(from_pretrained(saved / "pipe", torch.bfloat16).transformer)
    pipe = tritoff.load_pipeline(saved / "pipe", store=saved / "store")
    pipe.load_lora_weights(lora, adapter_name="a")
    with pytest.raises(ValueError, match=r"transformer\..*lora_A.* \(an adapter's weight\) is on the meta device: "):
        tritoff.enable(pipe, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    assert all(p.is_meta for p in pipe.transformer.parameters())  # as it was
    # loaded after enable, the same LoRA works
    pipe = tritoff.load_pipeline(saved / "pipe", store=saved / "store")
    tritoff.enable(pipe, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    pipe.load_lora_weights(lora, adapter_name="a")
    loaded = from_pretrained(saved / "pipe", torch.bfloat16)
    tritoff.enable(loaded, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    loaded.load_lora_weights(lora, adapter_name="a")
    assert torch.equal(run(pipe), run(loaded))


def test_a_store_that_records_no_source_loads_the_pipeline_whole_for_its_weights_to_be_compared(saved, tmp_path):
    # engine.save knows no weight files: only the values, compared at enable, tell another pipeline's weights
    pipe = from_pretrained(saved / "pipe", torch.bfloat16)
    tritoff.enable(pipe, budget="64MB", progress=False, kernels="reference").save(tmp_path / "saved")
    pipe = tritoff.load_pipeline(saved / "pipe", store=tmp_path / "saved")
    assert not any(p.is_meta for p in pipe.components["transformer"].parameters())
    other = tritoff.load_pipeline(saved / "other", store=tmp_path / "saved")
    with pytest.raises(StoreError, match="was made from other weights than this pipeline's "):
        tritoff.enable(other, budget="64MB", store=tmp_path / "saved", progress=False, kernels="reference")

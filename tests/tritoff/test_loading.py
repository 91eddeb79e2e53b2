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
    convert_pipeline(root / "other", root / "other-store", progress=False)
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
    # run before enable: refused in one line at the first component called (torch would fail on the meta device)
    with pytest.raises(RuntimeError, match=r"^text_encoder was built without its weights \(tritoff.load_pipeline\): "):
        run(pipe)
    with pytest.raises(RuntimeError, match="^transformer was built without its weights"):
        pipe.transformer()  # refused before its arguments are looked at
    engine = tritoff.enable(pipe, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    loaded = from_pretrained(saved / "pipe", torch.bfloat16)
    tritoff.enable(loaded, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    frames = run(pipe)
    assert torch.equal(frames, run(loaded)) and frames.abs().sum() > 0
    assert engine.stats["components"]["text_encoder"]["calls"] > 0
    # the check left with its first call after enable
    for module in (pipe.text_encoder, pipe.transformer):
        assert module._tritoff_until_filled.id not in module._forward_pre_hooks


def test_a_store_of_other_weights_or_dtype_or_components_is_refused_before_anything_loads(saved, tmp_path):
    store = saved / "store"
    with pytest.raises(StoreError, match="was made from other weights"):
        tritoff.load_pipeline(saved / "other", store=store)
    with pytest.raises(StoreError, match="converted in bfloat16 and the pipeline would load in float16: pass dtype="):
        tritoff.load_pipeline(saved / "pipe", store=store, dtype=torch.float16)
    with pytest.raises(TypeError, match="dtype must be a torch dtype such as torch.bfloat16, got 'bf16'"):
        tritoff.load_pipeline(saved / "pipe", store=store, dtype="bf16")
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
    with pytest.warns(
        UserWarning, match=r"records no weight files \(Engine.save wrote it\): the pipeline is loaded whole"
    ):
        pipe = tritoff.load_pipeline(saved / "pipe", store=tmp_path / "saved")
    assert not any(p.is_meta for p in pipe.components["transformer"].parameters())
    with pytest.warns(UserWarning, match="records no weight files"):
        other = tritoff.load_pipeline(saved / "other", store=tmp_path / "saved")
    with pytest.raises(StoreError, match="was made from other weights than this pipeline's "):
        tritoff.enable(other, budget="64MB", store=tmp_path / "saved", progress=False, kernels="reference")


@pytest.mark.parametrize(
    "component, library, dtype",
    [
        ("vae", "diffusers.AutoencoderKLWan", torch.float32),  # as Wan's examples load it
        ("text_encoder", "transformers.UMT5EncoderModel", torch.float16),  # another 16-bit dtype than the rest
    ],
)
def test_a_component_saved_in_its_own_dtype_loads_in_it_for_its_store(saved, tmp_path, component, library, dtype):
    # load_pipeline loaded every component in the pipeline's dtype, which the store refused for this one
    import importlib

    module, name = library.split(".")
    cls = getattr(importlib.import_module(module), name)
    own = cls.from_pretrained(saved / "pipe" / component, torch_dtype=dtype)
    source = from_pretrained(saved / "pipe", torch.bfloat16, **{component: own})
    tritoff.enable(source, budget="64MB", progress=False, kernels="reference").save(tmp_path / "saved")
    expected = run(source)
    with pytest.warns(UserWarning, match="records no weight files"):
        pipe = tritoff.load_pipeline(saved / "pipe", store=tmp_path / "saved")
    assert getattr(pipe, component).dtype == dtype and pipe.transformer.dtype == torch.bfloat16
    tritoff.enable(pipe, budget="64MB", store=tmp_path / "saved", progress=False, kernels="reference")
    assert torch.equal(run(pipe), expected)
    # the pipeline loaded in one dtype: the store says which component, in which dtype
    whole = from_pretrained(saved / "pipe", torch.bfloat16)
    kind = str(dtype).removeprefix("torch.")
    with pytest.raises(StoreError, match=rf"component {component} holds (\d+ of its \d+ weights in )?bfloat16 "):
        tritoff.enable(whole, budget="64MB", store=tmp_path / "saved", progress=False, kernels="reference")
    assert not hasattr(whole, "_tritoff_engine")
    if component == "vae":  # every weight in one other dtype: the advice names it
        with pytest.raises(
            StoreError,
            match=rf"where the store holds {kind}: load it in {kind} \(tritoff.load_pipeline\(model, store\) loads "
            r"each component as its store holds it\)$",
        ):
            tritoff.enable(whole, budget="64MB", store=tmp_path / "saved", progress=False, kernels="reference")


def test_a_pipeline_loaded_for_one_store_is_refused_with_another(saved):
    # its components have no weights to compare with the other store's packs: only the mark load_pipeline left tells
    pipe = tritoff.load_pipeline(saved / "pipe", store=saved / "store")
    with pytest.raises(StoreError, match="was built without its weights for another store"):
        tritoff.enable(pipe, budget="64MB", store=saved / "other-store", progress=False, kernels="reference")
    assert all(p.is_meta for p in pipe.transformer.parameters())


def test_an_encoder_config_with_a_key_of_a_later_release_is_still_built_without_weights(saved, tmp_path):
    # the store's fingerprint was hashed without the key, whose value the store's recorded config shows no conflict
    # with: the encoder is the store's model (it was loaded whole, with a warning, before stores recorded configs)
    import warnings

    pipe_dir = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", pipe_dir)
    config = pipe_dir / "text_encoder" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "argument_of_a_later_release": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = tritoff.load_pipeline(pipe_dir, store=saved / "store")
    assert pipe.text_encoder.config.argument_of_a_later_release == 1
    assert all(p.is_meta for p in pipe.text_encoder.parameters())
    tritoff.enable(pipe, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    loaded = from_pretrained(saved / "pipe", torch.bfloat16)
    tritoff.enable(loaded, budget="64MB", store=saved / "store", progress=False, kernels="reference")
    assert torch.equal(run(pipe), run(loaded))


def test_an_encoder_config_with_another_value_is_refused_before_the_encoder_loads(saved, tmp_path, monkeypatch):
    # the loaded encoder would have that config too, which enable refuses: not worth reading its weights first
    from transformers import PreTrainedModel

    pipe_dir = tmp_path / "pipe"
    shutil.copytree(saved / "pipe", pipe_dir)
    config = pipe_dir / "text_encoder" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "layer_norm_epsilon": 0.5}))
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", None)  # a whole load would fail on calling it
    with pytest.raises(
        StoreError,
        match=r"component text_encoder has another config than the store's "
        r"\(layer_norm_epsilon \(1e-06 in the store, 0\.5 here\)\): load the pipeline the store",
    ):
        tritoff.load_pipeline(pipe_dir, store=saved / "store")


def test_bad_arguments_are_refused_in_one_line(saved, tmp_path):
    store = saved / "store"
    for pipeline in ("WanPipelin", "DiffusionPipeline", 3):
        with pytest.raises(ValueError, match=f"pipeline={pipeline!r} names no diffusers pipeline class: give one"):
            tritoff.load_pipeline(saved / "pipe", store=store, pipeline=pipeline)
    with pytest.raises(TypeError, match="model must be a pipeline directory or a hub id, got None"):
        tritoff.load_pipeline(None, store=store)
    with pytest.raises(ValueError, match="does not exist: give a pipeline directory or a hub id"):
        tritoff.load_pipeline(tmp_path / "nowhere", store=store)
    with pytest.raises(ValueError, match="is not a diffusers pipeline directory"):
        tritoff.load_pipeline(saved / "pipe" / "transformer", store=store)


def test_a_pipeline_without_one_of_the_stored_components_uses_the_others(tmp_path):
    # Wan 2.2 with its second expert left out (model_index.json names none, its directory gone)
    from tritoff.tiny import tiny_wan_pipeline

    tiny_wan_pipeline(two_experts=True).save_pretrained(tmp_path / "pipe")
    convert_pipeline(tmp_path / "pipe", tmp_path / "store", progress=False)
    shutil.rmtree(tmp_path / "pipe" / "transformer_2")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({**index, "transformer_2": [None, None]}))
    pipe = tritoff.load_pipeline(tmp_path / "pipe", store=tmp_path / "store")
    assert pipe.transformer_2 is None and all(p.is_meta for p in pipe.transformer.parameters())
    tritoff.enable(pipe, budget="64MB", store=tmp_path / "store", progress=False, kernels="reference")
    assert run(pipe, num_inference_steps=1).abs().sum() > 0


def test_buffers_are_made_as_from_pretrained_makes_them_and_other_files_load_whole(tmp_path):
    # CogVideoX I2V's learned positional embedding, a buffer: saved in the checkpoint, cast to the pipeline's dtype
    from tritoff.tiny import tiny_cogvideox_i2v_pipeline

    tiny_cogvideox_i2v_pipeline().save_pretrained(tmp_path / "pipe")
    tiny_cogvideox_i2v_pipeline(seed=1).save_pretrained(tmp_path / "bin", safe_serialization=False)
    for name in ("pipe", "bin"):
        convert_pipeline(tmp_path / name, tmp_path / f"{name}-store", progress=False)
        pipe = tritoff.load_pipeline(tmp_path / name, store=tmp_path / f"{name}-store")
        loaded = from_pretrained(tmp_path / name, torch.bfloat16)
        for component in ("transformer", "vae"):
            built, expected = getattr(pipe, component), getattr(loaded, component)
            # safetensors: built without weights; .bin files (buffers not read from them): loaded whole
            assert all(p.is_meta == (name == "pipe") for p in built.parameters()), (name, component)
            buffers = dict(expected.named_buffers())
            assert {n: b.dtype for n, b in built.named_buffers()} == {n: b.dtype for n, b in buffers.items()}
            assert all(torch.equal(b, buffers[n]) for n, b in built.named_buffers()), (name, component)
    assert pipe.transformer.patch_embed.pos_embedding.abs().sum() > 0

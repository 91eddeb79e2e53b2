"""tritoff/checkpoint.py: a component's checkpoint read as from_pretrained reads it, and a config that does not describe
it named in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritoff.checkpoint import (
    CheckpointReader,
    ConfigError,
    checkpoint_fault,
    index_fault,
    unused_tensors,
)

from .helpers import wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Wan pipeline saved as from_pretrained reads it."""
    root = tmp_path_factory.mktemp("saved")
    wan().save_pretrained(root / "pipe")
    return root / "pipe"


def _copy(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "pipe")
    return tmp_path / "pipe"


def _built(directory, library="diffusers", **changes):
    """The component saved in ``directory`` built (on the meta device) from its config with ``changes``."""
    from tritoff.convert import build_from_config

    config = directory / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))
    cls = {"diffusers": "WanTransformer3DModel", "transformers": "UMT5EncoderModel"}[library]
    return build_from_config(directory, library, getattr(__import__(library), cls))


def test_reader_reads_only_what_it_is_asked(saved):
    reader = CheckpointReader(saved / "transformer")
    got = reader.read([("blocks.0.attn1.to_q.weight", torch.bfloat16)])
    assert list(got) == ["blocks.0.attn1.to_q.weight"] and got["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    with pytest.raises(KeyError, match="not in the checkpoint"):
        reader.read([("nope.weight", torch.bfloat16)])
    dtype, shape = reader.headers()["blocks.0.attn1.to_q.weight"]
    assert shape == tuple(
        load_file(next((saved / "transformer").glob("*.safetensors")))["blocks.0.attn1.to_q.weight"].shape
    ) and dtype in ("BF16", "F32")


def test_the_file_from_pretrained_reads_is_read_and_others_are_named(saved, tmp_path):
    # from_pretrained without a variant reads its library's file name: a variant, an EMA copy, the other library's
    # file name or another index beside it made the reader refuse, or read the wrong tensors
    pipe = _copy(saved, tmp_path)
    directory = pipe / "transformer"
    (plain,) = directory.glob("*.safetensors")
    for other in ("diffusion_pytorch_model.fp16.safetensors", "ema.safetensors", "model.safetensors"):
        save_file({"other": torch.ones(2)}, directory / other)
    (directory / "old.safetensors.index.json").write_text('{"weight_map": {"other": "ema.safetensors"}}')
    assert CheckpointReader(directory, "diffusers").files == dict.fromkeys(load_file(plain), plain)
    plain.rename(directory / "weights.safetensors")  # none of the library's name: diffusers loads nothing either
    with pytest.raises(FileNotFoundError, match=r"no diffusion_pytorch_model.safetensors or .*, which diffusers reads"):
        CheckpointReader(directory, "diffusers")
    (directory / "old.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"found 3 \(ema.safetensors, model.safetensors, weights.safetensors\)"):
        CheckpointReader(directory)  # no library: the one checkpoint there, which cannot be told


@pytest.mark.parametrize(
    "index, said",
    [
        ('{"weight_map": []}', "its weight_map does not map tensor names to file names"),
        ('{"weight_map": {"a.weight": 5}}', "its weight_map does not map tensor names to file names"),
        ('{"metadata": {}}', "it has no weight_map"),
        ("[1]", "it has no weight_map"),
        ('{"weight_map": ', "Expecting value"),
    ],
)
def test_a_shard_index_that_is_not_one_is_named(saved, tmp_path, index, said):
    # diffusers fails inside such an index with a KeyError, AttributeError or TypeError, naming no file
    pipe = _copy(saved, tmp_path)
    path = pipe / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    path.write_text(index)
    with pytest.raises(ValueError, match=f"cannot read {path}: {said}"):
        CheckpointReader(pipe / "transformer")
    assert str(index_fault(pipe)).startswith(f"cannot read {path}: {said}")
    assert index_fault(saved) is None
    # a folder the pipeline's index does not name is none of its business
    path.rename(tmp_path / "index.json")
    (pipe / "old_transformer").mkdir()
    (tmp_path / "index.json").rename(pipe / "old_transformer" / path.name)
    assert index_fault(pipe) is None


def test_a_tensor_of_another_shape_names_the_config(saved, tmp_path):
    pipe = _copy(saved, tmp_path)
    directory = pipe / "transformer"
    assert checkpoint_fault(directory, _built(directory)) is None
    ffn = json.loads((directory / "config.json").read_text())["ffn_dim"]
    fault = checkpoint_fault(directory, _built(directory, ffn_dim=ffn // 2))
    assert isinstance(fault, ConfigError), fault
    assert str(fault).startswith(f"{directory / 'config.json'} does not describe the weights beside it: ")
    assert f"blocks.0.ffn.net.0.proj.weight has shape ({ffn}, " in str(fault) and "fix the config" in str(fault)
    # tensors stored as integers (packed or quantized weights) and names the model lacks are not compared
    model = _built(directory, ffn_dim=ffn)
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(file)
    tensors["blocks.0.ffn.net.0.proj.weight"] = torch.zeros(7, dtype=torch.uint8)
    tensors["extra.weight"] = torch.ones(3)
    save_file(tensors, file)
    assert checkpoint_fault(directory, model) is None
    assert unused_tensors(directory, model, CheckpointReader(directory)) == ["extra.weight"]
    file.write_bytes(file.read_bytes()[:100])  # unreadable: the load names the file, not this check
    assert checkpoint_fault(directory, model) is None


@pytest.mark.parametrize("first", ["transformer", "text_model"])
def test_a_text_encoder_saved_under_other_names_is_matched_as_transformers_loads_it(saved, tmp_path, first):
    # saved from a task model (its base_model_prefix first, "transformer" for UMT5) or under a first part transformers
    # renames ("text_model." of CLIP text encoders): the tensors were compared with none
    pipe = _copy(saved, tmp_path)
    directory = pipe / "text_encoder"
    (file,) = directory.glob("*.safetensors")
    save_file({f"{first}.{name}": t for name, t in load_file(file).items()}, file, metadata={"format": "pt"})
    d_ff = json.loads((directory / "config.json").read_text())["d_ff"]
    fault = checkpoint_fault(directory, _built(directory, "transformers", d_ff=2 * d_ff))
    assert isinstance(fault, ConfigError) and f"has shape ({d_ff}, " in str(fault), fault


def test_parameters_the_checkpoint_lacks_are_named_when_asked(saved, tmp_path):
    # diffusers leaves them on the meta device, which tritoff refuses to pack naming no file
    pipe = _copy(saved, tmp_path)
    directory = pipe / "transformer"
    layers = json.loads((directory / "config.json").read_text())["num_layers"]
    model = _built(directory, num_layers=layers + 1)
    assert checkpoint_fault(directory, model) is None  # no tensor of another shape
    fault = checkpoint_fault(directory, model, missing=True)
    assert isinstance(fault, ConfigError)
    assert f"the model it builds has blocks.{layers}." in str(fault) and "which the checkpoint lacks" in str(fault)
    # a parameter tied under two names is there when either name is
    model = _built(directory, num_layers=layers)
    model.register_parameter("tied", model.blocks[0].norm2.weight)
    assert checkpoint_fault(directory, model, missing=True) is None


def test_unused_tensors_leave_out_those_the_class_ignores(saved, tmp_path):
    pipe = _copy(saved, tmp_path)
    directory = pipe / "transformer"
    model = _built(directory, num_layers=1)
    unused = unused_tensors(directory, model, CheckpointReader(directory))
    assert unused and all(name.startswith("blocks.") and not name.startswith("blocks.0.") for name in unused)
    model._keys_to_ignore_on_load_unexpected = [r"^blocks\.[1-9]"]
    assert unused_tensors(directory, model, CheckpointReader(directory)) == []


def test_a_whole_clip_checkpoint_read_by_one_tower_is_not_compared_with_the_other(tmp_path):
    # a CLIP image encoder pointed at a whole CLIP checkpoint: text_model.* and vision_model.* both lose their first
    # part into the vision model's names, and the text tower's were compared with it (a correct config was named)
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8)  # fmt: skip
    model = CLIPVisionModel(config)
    model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    vision = {
        name.partition(".")[2] if name.startswith("vision_model.") else name: t for name, t in load_file(file).items()
    }
    tower = {f"vision_model.{name}": t for name, t in vision.items()}
    tower |= {f"text_model.{name}": torch.zeros(3, 5) for name in vision}  # the other tower: other shapes
    save_file(tower, file, metadata={"format": "pt"})
    with torch.device("meta"):
        built = CLIPVisionModel(config)
    assert checkpoint_fault(tmp_path, built) is None


# the names diffusers gave a VAE's attention layers before it renamed them, by their names now
OLD_ATTENTION = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}


def _old_name(name: str) -> str:
    """``name`` as a VAE saved before the rename held it."""
    if "attentions" in name:
        for new, was in OLD_ATTENTION.items():
            name = name.replace(new, was)
    return name


def test_a_vae_saved_with_the_old_attention_names_is_read_as_diffusers_loads_it(tmp_path):
    # diffusers renames query/key/value/proj_attn of a one-file checkpoint on load; convert read them by the model's
    # names and failed, then named a correct config
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    vae.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    renamed = {_old_name(name): tensor for name, tensor in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, file, metadata={"format": "pt"})
    with torch.device("meta"):
        built = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    reader = CheckpointReader(tmp_path)
    assert checkpoint_fault(tmp_path, built, reader, missing=True) is None
    got = reader.read([(name, tensor.dtype) for name, tensor in tensors.items()])
    assert all(torch.equal(got[name], tensor) for name, tensor in tensors.items())
    assert unused_tensors(tmp_path, built, reader) == []


def test_a_sharded_vae_with_the_old_attention_names_is_told_from_a_wrong_config(tmp_path):
    # diffusers renames old attention names in a checkpoint of one file only: a sharded one loads with those layers
    # on the meta device, and its correct config was blamed
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    vae.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    for file in set(index["weight_map"].values()):
        renamed = {_old_name(name): tensor for name, tensor in load_file(tmp_path / file).items()}
        save_file(renamed, tmp_path / file, metadata={"format": "pt"})
    index["weight_map"] = {_old_name(name): file for name, file in index["weight_map"].items()}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    with torch.device("meta"):
        built = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    fault = checkpoint_fault(tmp_path, built, missing=True)
    assert isinstance(fault, ConfigError) and "holds attention weights under their old names" in str(fault), fault
    assert "config.json" not in str(fault)

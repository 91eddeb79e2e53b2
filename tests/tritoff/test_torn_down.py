"""tritoff/torn_down.py: after engine.teardown(), nothing runs on (or fuses into) placeholders until disable or
enable, whichever way the modules are reached."""

import copy
import pickle

import pytest
import torch

import tritoff
import tritoff.engine as engine_module

from .helpers import WAN_CALL, dequantized_pipeline, lora_state_dict, run, stack, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")

REFUSED = r"holds no weights: its tritoff engine was torn down \(engine.teardown\(\)\); call tritoff.disable"
LATENTS = dict(WAN_CALL, num_inference_steps=2, output_type="latent")


def _enable(target, **kwargs):
    return tritoff.enable(target, progress=False, kernels="reference", **kwargs)


def test_every_way_into_a_torn_down_pipeline_is_refused_until_disable(tmp_path):
    expected = run(dequantized_pipeline(wan), LATENTS)
    pipe = wan()
    pipe.load_lora_weights(lora_state_dict(pipe.transformer), adapter_name="style")
    pipe.set_adapters("style", 0.0)  # loaded but weighted zero: the output is the plain pipeline's
    engine = _enable(pipe, mode="group", budget="4MB")
    latents = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(1, 4, pipe.transformer.config.num_attention_heads * 32)
    engine.teardown()
    with pytest.raises(RuntimeError, match="text_encoder " + REFUSED):
        run(pipe, LATENTS)
    with pytest.raises(RuntimeError, match="vae " + REFUSED):  # diffusers' decode never calls forward
        pipe.vae.decode(latents)
    with pytest.raises(RuntimeError, match="transformer " + REFUSED):  # a block called on its own
        pipe.transformer.blocks[0](hidden)  # the refusal comes before the block reads its arguments
    with pytest.raises(RuntimeError, match=r"fuse_lora\(\): the pipeline " + REFUSED):
        pipe.fuse_lora(components=["transformer"])
    # what an enabled pipeline refuses stays refused: each would write, build or copy NaN weights at full size
    refused = [
        lambda: pipe.transformer.save_pretrained(tmp_path / "nan"),
        lambda: pipe.transformer.fuse_qkv_projections(),
        lambda: pipe.to(torch.float32),
        lambda: pipe.transformer.to(torch.float32),
        lambda: copy.deepcopy(pipe.transformer),
        lambda: pickle.dumps(pipe.vae),
        lambda: pipe.enable_model_cpu_offload(),
        lambda: pipe.remove_all_hooks(),
    ]
    for call in refused:
        with pytest.raises(RuntimeError, match="tritoff.disable|before tritoff.enable"):
            call()
    assert not (tmp_path / "nan").exists()
    tritoff.disable(pipe)
    assert torch.equal(run(pipe, LATENTS), expected)
    assert not any(
        m._forward_pre_hooks or hasattr(m, "_hf_hook")
        for _, c in pipe.components.items()
        if isinstance(c, torch.nn.Module)
        for m in c.modules()
    )


def test_the_blocks_of_a_module_list_are_refused_though_the_list_is_never_called():
    blocks = stack().blocks
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    engine = _enable(blocks, mode="group", budget=10**6, reserve=1000)
    with torch.no_grad():
        expected = [block(x) for block in blocks]
    engine.teardown()
    for block in blocks:
        with pytest.raises(RuntimeError, match="model " + REFUSED):
            block(x)
    _enable(blocks, mode="group", budget=10**6, reserve=1000)
    with torch.no_grad():
        assert all(torch.equal(block(x), e) for block, e in zip(blocks, expected, strict=True))


def test_a_failed_disable_leaves_a_torn_down_engine_torn_down(monkeypatch):
    model = stack()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        engine = _enable(model, mode="group", budget=10**6, reserve=1000)
        expected = model(x)
    engine.teardown()

    def no_room(pack, device):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(engine_module, "_dequantized", no_room)
    with pytest.raises(torch.OutOfMemoryError, match="do not fit on cpu: tritoff stays torn down"):
        tritoff.disable(model)
    assert engine._torn_down and engine.manager is None  # not hooked back to life
    with pytest.raises(RuntimeError, match=REFUSED):
        model(x)
    monkeypatch.undo()
    tritoff.disable(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_teardown_waits_for_a_forward_running_on_another_thread():
    import threading

    model = stack()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    engine = _enable(model, mode="group", budget=10**6, reserve=1000)
    with torch.no_grad():
        expected = model(x)
    inside, release, results = threading.Event(), threading.Event(), {}

    def hold(*_):  # the forward stays inside block 1 until released
        inside.set()
        release.wait(10)

    model.blocks[1].register_forward_hook(hold)

    def forward():
        try:
            with torch.no_grad():
                results["output"] = model(x)
        except BaseException as err:  # what tearing down under a running forward did
            results["error"] = err

    running = threading.Thread(target=forward)
    running.start()
    assert inside.wait(10)
    tearing = threading.Thread(target=engine.teardown)
    tearing.start()
    tearing.join(0.3)
    assert tearing.is_alive()  # waiting for the forward
    release.set()
    running.join(10)
    tearing.join(10)
    assert "error" not in results and torch.equal(results["output"], expected)
    with pytest.raises(RuntimeError, match=REFUSED):
        model(x)

"""torch.compile after tritoff.enable: whole-model and regional compilation repeat exactly, never recompile after the
first call, and never trace tritoff's own code (its hooks stay outside the compiled regions).

CPU, ``aot_eager`` backend (the graphs run as eager ATen ops, so the outputs stay bit-exact); every block streams.
"""

import copy
import functools
import pickle

import pytest
import torch
from torch._dynamo.utils import counters

import tritoff
from tritoff.warn import TritoffWarning

from .helpers import dequantized_pipeline
from .test_families import FAMILIES, _minimum, _run

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


class Recorder:
    """A backend that keeps every graph dynamo hands it (a recompilation hands it one more) and runs it eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def traced_tritoff(self) -> list[str]:
        """Stack traces of graph nodes that come from tritoff's source."""
        traces = [n.meta.get("stack_trace") or "" for g in self.graphs for n in g.graph.nodes]
        return [t for t in traces if "/tritoff/" in t]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _streaming(family, how=None):
    """The family's pipeline with every block streaming, and the latents of its dequantized twin (compiled ``how``
    when given: then also the number of graphs that took, without tritoff)."""
    factory, call = FAMILIES[family]
    reference = dequantized_pipeline(factory)
    reference.set_progress_bar_config(disable=True)
    plain = Recorder()
    if how is not None:
        _compile(reference, how, plain)
    _, expected = _run(reference, call, "latent")
    torch._dynamo.reset()
    pipe = factory()
    pipe.set_progress_bar_config(disable=True)
    tritoff.enable(
        pipe, mode="group", budget=_minimum(pipe, "group"), reserve=1000, progress=False, kernels="reference"
    )
    return pipe, call, expected, len(plain.graphs)


def _compile(pipe, how, backend):
    if how == "whole":
        pipe.transformer = torch.compile(pipe.transformer, backend=backend)
    elif how == "regional":
        pipe.transformer.compile_repeated_blocks(backend=backend, fullgraph=True)
    else:  # no _repeated_blocks in this model: each block by hand
        for block in pipe.transformer.transformer_blocks:
            block.compile(backend=backend, fullgraph=True)


@pytest.mark.parametrize(
    "how,family",
    [
        ("whole", "wan21-i2v"),
        ("whole", "flux"),
        ("regional", "hunyuan-video"),
        ("regional", "wan-vace"),
        ("blocks", "cogvideox"),
    ],
)
def test_compiled_runs_repeat_exactly_without_recompiling(how, family):
    pipe, call, expected, plain = _streaming(family, how if how != "whole" else None)
    recorder = Recorder()
    _compile(pipe, how, recorder)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    compiled = len(recorder.graphs)
    assert compiled > 0
    unique = counters["stats"]["unique_graphs"]
    for _ in range(2):
        assert torch.equal(_run(pipe, call, "latent")[1], expected)
    # no recompilation after the first call: no graph reached the backend, dynamo's counters agree
    assert len(recorder.graphs) == compiled and counters["stats"]["unique_graphs"] == unique
    assert recorder.traced_tritoff() == []
    if how != "whole":  # the graphs of the same compilation without tritoff: streaming adds none
        assert compiled == plain


def test_compile_then_replan_then_disable():
    pipe, call, expected, _ = _streaming("wan21-t2v")
    recorder = Recorder()
    _compile(pipe, "regional", recorder)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    # another budget: some blocks now resident, others still streamed; the compiled blocks stay compiled
    engine = tritoff.enable(pipe, mode="group", budget="1MB", reserve=1000, progress=False, kernels="reference")
    assert engine.plan.tier_counts("transformer")["stream"] < len(pipe.transformer.blocks)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    compiled = len(recorder.graphs)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    assert len(recorder.graphs) == compiled
    # whole components on the GPU: the blocks are hooked no more, and compile as torch compiles a module again
    tritoff.enable(pipe, mode="model", budget="64MB", progress=False, kernels="reference")
    assert all("forward" not in vars(b) and b._compiled_call_impl is not None for b in pipe.transformer.blocks)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    tritoff.disable(pipe)  # ordinary modules holding the dequantized weights, blocks still compiled
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    assert recorder.traced_tritoff() == []
    # compiled as torch compiles a module, not through a closure over the block: copies compute with their own
    # weights, and the transformer pickles
    blocks = pipe.transformer.blocks
    assert all("forward" not in vars(b) and b._compiled_call_impl is not None for b in blocks)
    pickle.dumps(pipe.transformer)
    original = pipe.transformer
    pipe.transformer = copy.deepcopy(original)
    with torch.no_grad():
        for block in pipe.transformer.blocks:
            block.ffn.net[2].weight.mul_(2)
    assert not torch.equal(_run(pipe, call, "latent")[1], expected)
    pipe.transformer = original
    assert torch.equal(_run(pipe, call, "latent")[1], expected)


def test_blocks_compiled_before_enable_compile_inside_the_hooks_and_again_after_disable():
    factory, call = FAMILIES["wan21-t2v"]
    reference = dequantized_pipeline(factory)
    reference.set_progress_bar_config(disable=True)
    _, expected = _run(reference, call, "latent")
    pipe = factory()
    pipe.set_progress_bar_config(disable=True)
    recorder = Recorder()
    _compile(pipe, "regional", recorder)  # fullgraph=True, right after loading (as diffusers advises)
    blocks = pipe.transformer.blocks
    budget = _minimum(pipe, "group")
    for _ in range(2):  # and after disable, which compiles each block again as block.compile(...) does
        tritoff.enable(pipe, mode="group", budget=budget, reserve=1000, progress=False, kernels="reference")
        assert all("_compiled_call_impl" not in vars(b) for b in blocks)  # its forward is, inside the hooks
        assert all(b._old_forward._tritoff_compile[1].fullgraph for b in blocks)
        assert torch.equal(_run(pipe, call, "latent")[1], expected)
        assert recorder.graphs and recorder.traced_tritoff() == []  # with the backend it was given
        pipe.transformer.compile_repeated_blocks(backend=recorder, fullgraph=True)  # again: replaces the first
        assert torch.equal(_run(pipe, call, "latent")[1], expected)
        tritoff.disable(pipe)
        assert all("forward" not in vars(b) and b._compiled_call_impl is not None for b in blocks)
        assert torch.equal(_run(pipe, call, "latent")[1], expected)
        pickle.dumps(pipe.transformer)  # no closure over the blocks left behind


def test_what_cannot_compile_inside_the_hooks_is_refused_before_enable_changes_anything_or_said():
    factory, call = FAMILIES["wan21-t2v"]
    options = dict(mode="group", budget="1MB", reserve=1000, progress=False, kernels="reference")
    pipe = factory()
    pipe.transformer.compile(fullgraph=True, backend="aot_eager")
    compiled = pipe.transformer._compiled_call_impl
    with pytest.raises(ValueError, match=r"^transformer is compiled with fullgraph=True, and tritoff") as info:
        tritoff.enable(pipe, **options)
    assert "compile_repeated_blocks(fullgraph=True)" in str(info.value) and "\n" not in str(info.value)
    assert not hasattr(pipe, "_tritoff_engine") and pipe.transformer._compiled_call_impl is compiled
    pipe = factory()  # the wrapper's form, torch.compile(module, fullgraph=True): refused too
    wrapper = pipe.transformer = torch.compile(pipe.transformer, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"^transformer is torch.compile\(..., fullgraph=True\): tritoff's hooks"):
        tritoff.enable(pipe, **options)
    assert not hasattr(pipe, "_tritoff_engine") and pipe.transformer is wrapper
    assert not hasattr(pipe.transformer, "_hf_hook") and pipe.transformer.blocks[0].ffn.net[2].weight.numel() > 0
    # compiled in a way tritoff cannot read (an older torch's): left around the hooks, as it was, and said
    pipe = factory()
    block = pipe.transformer.blocks[1]
    hidden = block._compiled_call_impl = functools.partial(block._call_impl)  # calls through, as a graph break would
    with pytest.warns(TritoffWarning, match=r"transformer.blocks.1 compiled before tritoff.enable in a way tritoff"):
        tritoff.enable(pipe, **options)
    assert block._compiled_call_impl is hidden
    reference = dequantized_pipeline(factory)
    assert torch.equal(_run(pipe, call, "latent")[1], _run(reference, call, "latent")[1])


def test_a_re_enable_that_would_put_hooks_inside_a_fullgraph_compile_is_refused_and_changes_nothing():
    factory, call = FAMILIES["wan21-t2v"]
    reference = dequantized_pipeline(factory)
    reference.set_progress_bar_config(disable=True)
    _, expected = _run(reference, call, "latent")
    options = dict(reserve=1000, progress=False, kernels="reference")
    # blocks compiled inside the hooks, then leaf mode: its hooks would go on the layers inside each compiled block
    pipe = factory()
    pipe.set_progress_bar_config(disable=True)
    engine = tritoff.enable(pipe, mode="group", budget=_minimum(pipe, "group"), **options)
    pipe.transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"^transformer.blocks.0 is compiled with fullgraph=True, and tritoff's hooks"):
        tritoff.enable(pipe, mode="leaf", budget="1MB", **options)
    assert pipe._tritoff_engine is engine and torch.equal(_run(pipe, call, "latent")[1], expected)
    # the transformer compiled whole before enable moves whole (nothing hooked inside it); split later: refused
    pipe = factory()
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.compile(backend="aot_eager", fullgraph=True)
    engine = tritoff.enable(pipe, mode="model", **options)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    with pytest.raises(ValueError, match=r"^transformer is compiled with fullgraph=True, and tritoff's hooks"):
        tritoff.enable(pipe, mode="group", budget="1MB", **options)
    assert pipe._tritoff_engine is engine and torch.equal(_run(pipe, call, "latent")[1], expected)


def test_fullgraph_over_hooked_blocks_is_refused_in_one_line():
    pipe, _, _, _ = _streaming("wan21-t2v")
    with pytest.raises(RuntimeError, match=r"compile_repeated_blocks\(fullgraph=True\)") as info:
        pipe.transformer.compile(fullgraph=True)
    assert "\n" not in str(info.value)
    assert pipe.transformer._compiled_call_impl is None  # nothing was compiled


def test_fullgraph_over_hooked_layers_in_leaf_mode_is_refused_in_one_line():
    # each block holds hooked layers: compiled whole with fullgraph=True it would fail at every call (graph breaks)
    from .helpers import wan

    pipe = wan()
    tritoff.enable(pipe, mode="leaf", budget="2MB", kernels="reference", progress=False)
    with pytest.raises(
        RuntimeError, match=r"^transformer\.blocks\.0\.compile\(fullgraph=True\): .*mode='group'"
    ) as info:
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    assert "\n" not in str(info.value)
    assert all(block._compiled_call_impl is None for block in pipe.transformer.blocks)  # nothing was compiled
    pipe.transformer.compile_repeated_blocks(backend="eager")  # without fullgraph: graph breaks at the hooks
    tritoff.disable(pipe)
    assert not any("compile" in vars(m) for m in pipe.transformer.modules())


def test_lora_on_a_transformer_compiled_whole():
    """diffusers' pipe.fuse_lora skips a component compiled whole without a word (it is no ModelMixin): refused in
    one line, and the way it names works."""
    from .helpers import dequantize_in_place, lora_state_dict

    factory, call = FAMILIES["wan21-t2v"]
    lora = lora_state_dict(factory().transformer)
    reference = dequantized_pipeline(factory)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(lora, adapter_name="style")
    _, expected = _run(reference, call, "latent")
    reference.fuse_lora(components=["transformer"])
    dequantize_in_place(reference.transformer)
    _, expected_fused = _run(reference, call, "latent")
    pipe, call, _, _ = _streaming("wan21-t2v")
    recorder = Recorder()
    _compile(pipe, "whole", recorder)
    pipe.load_lora_weights(lora, adapter_name="style")
    assert torch.equal(_run(pipe, call, "latent")[1], expected)
    with pytest.raises(ValueError, match=r"call pipe.transformer._orig_mod.fuse_lora\(...\)") as info:
        pipe.fuse_lora(components=["transformer"])
    assert "\n" not in str(info.value)
    assert torch.equal(_run(pipe, call, "latent")[1], expected)  # nothing changed
    pipe.transformer._orig_mod.fuse_lora()
    assert torch.equal(_run(pipe, call, "latent")[1], expected_fused)
    assert recorder.traced_tritoff() == []

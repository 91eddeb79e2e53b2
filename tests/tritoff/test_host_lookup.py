"""Large embedding tables stay in host memory: only the rows a prompt reads move, and the output is exact."""

import pytest
import torch
import torch.nn as nn

import tritoff
from tritoff import groups
from tritoff.groups import HOST, REST, block_groups, host_embeddings, leaf_groups

from .helpers import dequantized_pipeline, run, wan

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


@pytest.fixture
def small_threshold(monkeypatch):
    """Tables above 8 KiB count as large: the tiny UMT5's 256 x 32 bf16 table (16 KiB) stays on the host."""
    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 8 * 1024)


class Encoder(nn.Module):
    def __init__(self, tied_head: bool = False):
        super().__init__()
        self.shared = nn.Embedding(512, 16)
        self.embed_tokens = self.shared  # a second name for the same table, as T5 has
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 512, bias=False)
        if tied_head:
            self.head.weight = self.shared.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_a_large_table_read_only_by_lookups_gets_its_own_host_group(small_threshold):
    model = Encoder()
    assert [name for name, _ in host_embeddings(model)] == ["shared"]  # its second name is the same table
    for split in (block_groups, leaf_groups):
        names = [g.name for g in split(model)]
        assert f"{HOST}shared" in names and names[-1] == REST
        rest = next(g for g in split(model) if g.name == REST)
        assert "shared.weight" not in [n for n, _ in rest.params]


def test_a_table_tied_to_an_output_head_moves_with_the_model(small_threshold):
    assert host_embeddings(Encoder(tied_head=True)) == []  # the head multiplies the whole table


def test_a_small_table_is_not_kept_on_the_host():
    assert host_embeddings(Encoder()) == []  # 512 x 16 fp32 = 32 KiB, below the 16 MiB default


def test_the_pipeline_with_a_host_table_equals_the_dequantized_pipeline(small_threshold, monkeypatch):
    expected = run(dequantized_pipeline(wan))
    pipe = wan()
    table = pipe.text_encoder.shared.weight
    engine = tritoff.enable(pipe, mode="group", progress=False, kernels="reference")
    arena = engine.packed["text_encoder"].arena.buffer
    # the table is a view of the host arena, not a copy
    start = arena.data_ptr()
    assert start <= table.data_ptr() < start + arena.numel()
    assert torch.equal(run(pipe), expected)
    stats = engine.stats["components"]["text_encoder"]
    assert stats["host_lookup_bytes"] == table.numel() * table.element_size() == 256 * 32 * 2
    assert "looked up in host memory" in engine.report()
    # the table's bytes are in no phase's device plan
    with_table = tritoff.enable(wan(), mode="model", budget="1GB", progress=False, kernels="reference")
    tritoff.disable(pipe)
    assert torch.equal(pipe.text_encoder.shared.weight, dequantized_pipeline(wan).text_encoder.shared.weight)
    monkeypatch.setattr(groups, "HOST_EMBEDDING_BYTES", 2**40)  # the same pipeline, its table moving to the device
    without = tritoff.enable(wan(), mode="model", budget="1GB", progress=False, kernels="reference")
    grew = without.plan.phases["text_encoder"].pool_bytes - with_table.plan.phases["text_encoder"].pool_bytes
    assert grew == 256 * 32 * 2


def test_every_module_holding_a_host_table_looks_it_up_on_the_host(small_threshold, monkeypatch):
    # UMT5's ``shared`` and its encoder's ``embed_tokens`` are two modules holding one table, and the encoder looks up
    # through the second: on a GPU, a lookup left unhooked reads a host table with ids on the device and fails
    from tritoff.host_lookup import HostLookupHook

    pipe = wan()
    encoder = pipe.text_encoder
    assert (
        encoder.shared is not encoder.encoder.embed_tokens
        and encoder.shared.weight is encoder.encoder.embed_tokens.weight
    )
    looked_up, pre_forward = [], HostLookupHook.pre_forward
    monkeypatch.setattr(
        HostLookupHook,
        "pre_forward",
        lambda self, module, *a, **k: looked_up.append(module) or pre_forward(self, module, *a, **k),
    )
    tritoff.enable(pipe, mode="group", progress=False, kernels="reference")
    run(pipe)
    assert any(m is encoder.encoder.embed_tokens for m in looked_up)
    tritoff.disable(pipe)
    assert not hasattr(encoder.encoder.embed_tokens, "_hf_hook") and not hasattr(encoder.shared, "_hf_hook")


def test_an_adapted_table_is_looked_up_on_the_host_by_its_base_layer_under_every_name(small_threshold, monkeypatch):
    # LoRA wraps the layer under one of its two names: the hook sits on the base layer, which both names reach, and
    # not around the adapter, whose own table lives on the compute device
    from peft import LoraConfig, inject_adapter_in_model

    from tritoff.host_lookup import HostLookupHook

    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(512, 16)
            self.encoder = nn.Module()
            self.encoder.embed_tokens = self.shared  # one layer, two names (as older T5 had)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

        def forward(self, ids):
            x = self.encoder.embed_tokens(ids)
            for block in self.blocks:
                x = block(x)
            return x

    model = Aliased().to(torch.bfloat16).eval()
    base = model.shared
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["shared"]), model)
    assert model.shared is not base and model.encoder.embed_tokens is base
    looked_up, pre_forward = [], HostLookupHook.pre_forward
    monkeypatch.setattr(
        HostLookupHook, "pre_forward", lambda self, m, *a, **k: looked_up.append(m) or pre_forward(self, m, *a, **k)
    )
    tritoff.enable(model, mode="group", progress=False, kernels="reference")
    assert isinstance(base._hf_hook, HostLookupHook) and not hasattr(model.shared, "_hf_hook")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert looked_up == [base]


def test_a_replaced_tied_table_is_named_where_it_was_replaced(small_threshold):
    pipe = wan()
    tritoff.enable(pipe, mode="group", progress=False, kernels="reference")
    encoder = pipe.text_encoder
    encoder.encoder.embed_tokens.weight = nn.Parameter(torch.zeros_like(encoder.shared.weight), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"^text_encoder\.encoder\.embed_tokens\.weight was replaced or deleted"):
        run(pipe)


@pytest.mark.parametrize("when", ["before enable", "wrapper before enable", "after enable"])
def test_a_fullgraph_compile_around_a_host_lookup_is_refused_in_one_line(small_threshold, when):
    # the lookup is a graph break: without the refusal, dynamo's own error at the first call
    pipe = wan()
    encoder = pipe.text_encoder.encoder
    if when == "before enable":
        encoder.compile(fullgraph=True, backend="eager")
    elif when == "wrapper before enable":
        encoder.embed_tokens = torch.compile(encoder.embed_tokens, fullgraph=True, backend="eager")
    if when != "after enable":
        with pytest.raises(ValueError, match=r"compiled with fullgraph=True.*embedding tables kept in host memory"):
            tritoff.enable(pipe, mode="model", progress=False, kernels="reference")
        assert not hasattr(pipe, "_tritoff_engine")
        return
    tritoff.enable(pipe, mode="model", progress=False, kernels="reference")
    with pytest.raises(
        RuntimeError, match=r"^text_encoder\.encoder\.compile\(fullgraph=True\): an embedding table"
    ) as info:
        encoder.compile(fullgraph=True, backend="eager")
    assert "\n" not in str(info.value)
    encoder.compile(backend="eager")  # without fullgraph the lookup runs between graphs
    assert torch.equal(run(pipe), run(dequantized_pipeline(wan)))


@pytest.mark.parametrize("when", ["enable", "re-plan"])
@pytest.mark.filterwarnings("ignore::tritoff.TritoffWarning")
def test_a_failed_enable_gives_a_host_table_its_own_weights_back(small_threshold, monkeypatch, when):
    # the table viewed the packs' host bytes, which the failure frees: left so, it would read freed memory (on a GPU,
    # beside weights restored to the device, with its hooks gone)
    from tritoff import operations

    expected = run(dequantized_pipeline(wan))
    pipe = wan()
    table = pipe.text_encoder.shared.weight
    original = table.detach().clone()
    if when == "re-plan":  # the packs are reused: the table views them already
        tritoff.enable(pipe, mode="group", progress=False, kernels="reference")

    def fail(*args, **kwargs):
        raise RuntimeError("stopped while installing")

    monkeypatch.setattr(operations, "install", fail)
    with pytest.raises(RuntimeError, match="stopped while installing"):
        tritoff.enable(pipe, mode="model", budget="1GB", progress=False, kernels="reference")
    assert table.untyped_storage().nbytes() == table.numel() * table.element_size()  # its own, not the arena's
    assert torch.equal(table, original)  # kept in its own dtype: exact
    assert not hasattr(pipe.text_encoder.encoder.embed_tokens, "_hf_hook")
    assert torch.equal(run(pipe), expected)


def test_a_move_leaves_a_host_table_in_host_memory_and_a_cast_of_it_is_refused():
    # pipe.to("cuda") after enable: the table stays on the host, where its lookups run (checked on a GPU in test_gpu)
    from tritoff.operations import _check

    table = nn.Embedding(512, 16)
    host = {id(table.weight)}
    move, cast = (lambda t: t.to("meta")), (lambda t: t.to(torch.float16))
    with pytest.raises(RuntimeError, match="^moving or casting text_encoder to meta"):
        _check(table, "text_encoder", move, torch.device("cpu"))
    _check(table, "text_encoder", move, torch.device("cpu"), host)
    with pytest.raises(RuntimeError, match="^moving or casting text_encoder to torch.float16"):
        _check(table, "text_encoder", cast, torch.device("cpu"), host)


def test_a_host_table_survives_a_store_round_trip(small_threshold, tmp_path):
    pipe = wan()
    engine = tritoff.enable(pipe, mode="group", progress=False, kernels="reference")
    expected = run(pipe)
    engine.save(tmp_path / "store")
    again = wan()
    tritoff.enable(again, mode="group", store=tmp_path / "store", progress=False, kernels="reference")
    assert torch.equal(run(again), expected)


def test_the_lookup_runs_where_the_table_is_and_returns_on_the_compute_device(small_threshold):
    from tritoff.host_lookup import HostLookupHook

    table = nn.Embedding(512, 16)
    hook = HostLookupHook(torch.device("cpu"))
    ids = torch.tensor([[3, 511, 0]])
    args, kwargs = hook.pre_forward(table, ids)
    assert args[0].device == table.weight.device and kwargs == {}
    out = hook.post_forward(table, table(*args))
    assert torch.equal(out, table.weight[ids]) and out.device == torch.device("cpu")


@pytest.mark.parametrize("how", ["data", "in place", "replaced"])
def test_a_host_table_changed_after_enable_is_refused(small_threshold, how):
    # the lookups read the module's table: a new one would be used while the packs keep the old
    expected = run(dequantized_pipeline(wan))
    pipe = wan()
    tritoff.enable(pipe, mode="group", progress=False, kernels="reference")
    assert pipe._tritoff_engine.manager.components["text_encoder"].host
    run(pipe)
    table = pipe.text_encoder.shared.weight
    if how == "data":
        table.data = torch.zeros_like(table)
    elif how == "in place":
        with torch.no_grad():
            table.add_(1)
    else:
        pipe.text_encoder.shared.weight = nn.Parameter(torch.zeros_like(table), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"^text_encoder\.shared\.weight was (given new|written|replaced)") as info:
        run(pipe)
    assert "\n" not in str(info.value) and "tritoff.disable" in str(info.value)
    if how == "replaced":
        pipe.text_encoder.shared.weight = table
        assert torch.equal(run(pipe), expected)
    if how == "in place":  # the table is a view of its pack: the pack holds the write, and disable keeps it
        assert "which now holds the write (tritoff.disable keeps it)" in str(info.value)
        written = table.detach().clone()
        tritoff.disable(pipe)
        assert torch.equal(pipe.text_encoder.shared.weight, written)


def test_a_host_table_written_during_a_call_is_refused_before_the_call_returns(small_threshold):
    pipe = wan()
    tritoff.enable(pipe, mode="group", progress=False, kernels="reference")
    run(pipe)
    table = pipe.text_encoder.shared.weight

    def write(module, args):
        with torch.no_grad():
            table.add_(1)

    handle = pipe.text_encoder.encoder.block[0].register_forward_pre_hook(write)
    with pytest.raises(RuntimeError, match=r"^text_encoder\.shared\.weight was written in place"), torch.no_grad():
        pipe.text_encoder(torch.tensor([[1, 2, 3]]))  # one call: refused at its exit, not at the next call's entry
    handle.remove()

"""tritoff/groups.py: blocks of the ModuleLists, then the rest, every parameter in exactly one group."""

from tritoff.groups import REST, Group, block_groups, group_label
from tritoff.tiny import tiny_cogvideox_transformer, tiny_umt5, tiny_wan_transformer


def _check_partition(model, groups):
    owned = [id(p) for g in groups for _, p in g.params]
    assert len(owned) == len(set(owned))
    assert set(owned) == {id(p) for p in model.parameters()}


def test_wan_blocks_and_rest():
    model = tiny_wan_transformer()
    groups = block_groups(model)
    assert [g.name for g in groups] == ["blocks.0", "blocks.1", REST]
    _check_partition(model, groups)
    assert {n for n, _ in groups[-1].params} >= {"scale_shift_table", "proj_out.weight", "patch_embedding.weight"}


def test_cogvideox_blocks_and_rest():
    model = tiny_cogvideox_transformer()
    groups = block_groups(model)
    assert [g.name for g in groups] == ["transformer_blocks.0", "transformer_blocks.1", REST]
    _check_partition(model, groups)


def test_nested_lists_and_tied_weights():
    model = tiny_umt5()  # encoder.block is nested; shared and encoder.embed_tokens are one tensor
    groups = block_groups(model)
    assert [g.name for g in groups] == ["encoder.block.0", "encoder.block.1", REST]
    _check_partition(model, groups)


def test_weights_tied_across_groups_join_the_rest():
    import torch.nn as nn

    from tritoff.groups import leaf_groups

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(4))
            self.blocks[3][0].weight = self.blocks[1][0].weight  # tied across two blocks
            self.extra = nn.Linear(4, 4)
            self.extra.weight = self.blocks[0][1].weight  # tied between a block and the rest
            self.blocks[2] = self.blocks[3]  # one block registered twice: still one group

    model = Tied()
    for groups in (block_groups(model), leaf_groups(model)):
        _check_partition(model, groups)
        rest = {id(p) for _, p in groups[-1].params}
        assert groups[-1].name == REST
        assert id(model.blocks[1][0].weight) in rest and id(model.extra.weight) in rest
    assert [g.name for g in block_groups(model)] == ["blocks.0", "blocks.1", "blocks.2", REST]


def test_a_list_of_lists_is_no_block_list_its_elements_are_never_called():
    import torch.nn as nn

    class Layers(nn.Module):  # for attn, ff in self.layers: the inner lists hold the layers, never called themselves
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)]) for _ in range(3))
            self.sequential = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))  # called: blocks

    model = Layers()
    groups = block_groups(model)
    assert [g.name for g in groups] == ["sequential.0", "sequential.1", REST]
    _check_partition(model, groups)


def test_messages_name_a_block_by_its_path_and_the_rest_as_outside_the_blocks():
    assert group_label("transformer", Group("blocks.3")) == "transformer.blocks.3"
    assert group_label("transformer", Group(REST)) == "transformer outside its blocks"


def test_a_multihead_attentions_out_proj_joins_the_rest_in_leaf_mode():
    # nn.MultiheadAttention reads out_proj's weight without calling it: a hook on out_proj would never run
    import torch.nn as nn

    from tritoff.groups import leaf_groups

    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    groups = leaf_groups(model)
    assert [g.name for g in groups] == ["0", "2", REST]
    assert {n for n, _ in groups[-1].params} == {"1.in_proj_weight", "1.in_proj_bias", "1.out_proj.weight",
                                                 "1.out_proj.bias"}  # fmt: skip
    _check_partition(model, groups)

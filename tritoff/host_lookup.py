"""Embedding lookups that run where the table is: in host memory.

A text encoder's embedding table can be the largest tensor of a pipeline (UMT5-XXL's 256k x 4096, 2 GiB in bf16)
while a prompt reads only a few hundred of its rows. Tables larger than ``groups.HOST_EMBEDDING_BYTES`` keep their
pack in the host arena, unquantized, and never reach the GPU: the token ids move to the host, the lookup gathers the
rows there (an exact copy, as ``nn.Embedding`` on the GPU would make) and only its output moves to the device, e.g.
512 x 4096 x 2 bytes = 4 MiB for a Wan prompt.
"""

from __future__ import annotations

import torch
from accelerate.hooks import ModelHook

from tritoff.onload import given_new_data, replaced_or_deleted


class HostTable:
    """A lookup table kept in host memory: its group, its parameters (pointed at views of its pack) and where the
    modules hold them, with what tritoff gave them, to refuse a table replaced, written in place or given new data
    after enable (the lookups would read it, the packs would not hold it)."""

    def __init__(self, component: str, group, params: list[torch.nn.Parameter], homes: list[list[tuple[dict, str]]]):
        self.component = component
        self.group = group
        self.params = params
        self.names = [name for name, _ in group.params]
        self.homes = [(owner, key, p) for p, places in zip(params, homes, strict=True) for owner, key in places]
        self.home_names = {id(module._parameters): name for name, module in group.modules}  # the layers' own names
        self.pointers = [p.data_ptr() for p in params]
        self.versions = [p._version for p in params]

    def param_name(self, index: int) -> str:
        """The qualified name of parameter ``index`` (``text_encoder.shared.weight``)."""
        return f"{self.component}.{self.names[index]}"

    def check(self) -> None:
        """Refuse, in one line, a table changed since enable."""
        for owner, key, param in self.homes:
            if owner.get(key) is not param:  # named where it changed: a tied table has several names
                raise replaced_or_deleted(f"{self.component}.{self.home_names[id(owner)]}.{key}")
        for name, param, pointer, version in zip(self.names, self.params, self.pointers, self.versions, strict=True):
            if param.data_ptr() != pointer:
                raise given_new_data(f"{self.component}.{name}", "after tritoff.enable")
            if param._version != version:  # the table is a view of its pack: the write changed the pack too
                raise RuntimeError(
                    f"{self.component}.{name} was written in place after tritoff.enable; it is kept in host memory as "
                    "its own pack, which now holds the write (tritoff.disable keeps it): call tritoff.disable, then "
                    "enable again to run with it"
                )


class HostLookupHook(ModelHook):
    """Runs an ``nn.Embedding`` whose weight lives in host memory: ids in, rows out on ``device``."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def pre_forward(self, module, *args, **kwargs):
        """Move the ids to the table's device."""
        where = module.weight.device
        args = tuple(a.to(where) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def post_forward(self, module, output):
        """Move the gathered rows to the compute device."""
        return output.to(self.device)


def host_views(pack) -> list[torch.Tensor]:
    """The tensors of an unquantized pack as views of its host bytes, in entry order."""
    from tritoff.kernels.upcast import KIND_COPY

    # a table served from disk is mapped: a lookup reads the pages of the rows it gathers, nothing more
    data = pack.file.map(pack) if pack.on_disk else pack.data
    views = []
    for e in pack.layout.entries:
        if e.kind != KIND_COPY:
            raise ValueError(f"{e.name} is quantized: a host lookup table must be stored in its own dtype")
        views.append(data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape))
    return views

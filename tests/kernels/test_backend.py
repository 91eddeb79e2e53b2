"""kernels/backend.py: TRITON_INTERPRET read as Triton reads it, and the eager launch path only for plain tensors."""

import pytest
import torch

from tritoff.kernels.backend import eager, interpreting


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "Yes", "y", "0", "false", "off", "2", " 1", ""])
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    from triton._C.libtriton import getenv_bool

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == getenv_bool("TRITON_INTERPRET", False)


def test_eager_only_when_every_tensor_is_plain_and_no_mode_is_active():
    from torch._subclasses.fake_tensor import FakeTensorMode

    plain = torch.zeros(4)

    class Marked(torch.Tensor):
        pass

    assert eager(plain, plain, plain)
    assert not eager(plain, plain.as_subclass(Marked))  # any one of them, not only the destination
    seen = []

    def inside(batched):
        seen.append(eager(plain, batched))
        return batched

    torch.vmap(inside)(torch.zeros(2, 4))
    assert seen == [False]
    with FakeTensorMode():
        assert not eager(plain)

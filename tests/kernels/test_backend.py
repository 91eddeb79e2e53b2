"""kernels/backend.py: TRITON_INTERPRET read as Triton reads it, and the eager launch path only for plain tensors."""

import os
import subprocess
import sys

import pytest
import torch

from tritoff.kernels.backend import eager, interpreting


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "Yes", "y", "0", "false", "off", "2", " 1", ""])
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    import triton
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.delitem(sys.modules, "tritoff.kernels.upcast")  # as before the kernels are imported

    def kernel(x):
        pass

    # what Triton makes of a kernel decorated now: an interpreted function, or one it compiles
    assert interpreting() == (not isinstance(triton.jit(kernel), JITFunction))


@pytest.mark.parametrize("at_import,later", [("1", None), (None, "1")])
def test_once_the_kernels_are_imported_the_variable_changed_later_does_not_count(at_import, later):
    """Triton decided when it decorated the kernels: asking the variable again would pick kernels that cannot run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if at_import is not None:
        env["TRITON_INTERPRET"] = at_import
    change = "os.environ.pop('TRITON_INTERPRET')" if later is None else f"os.environ['TRITON_INTERPRET'] = {later!r}"
    script = (
        f"import os, tritoff.kernels as k; {change}; "
        f"assert k.interpreting() is {at_import is not None} and k.triton_runs_on('cpu') is {at_import is not None}"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


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


def test_interpreted_launches_from_several_threads_take_turns(monkeypatch):
    # Triton's interpreter patches triton.language for the length of a launch and keeps the program id in a global:
    # two launches at once would undo each other's patches or read each other's program ids
    import time

    from triton.runtime import interpreter

    from tests.tritoff.helpers import in_threads
    from tritoff.formats import get_format
    from tritoff.kernels import quantize, upcast_pack
    from tritoff.kernels.upcast import BLOCK
    from tritoff.pack import PackLayout, TensorSpec, write_pack

    assert interpreting()
    running, most = [0], [0]
    original = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.02)  # hands the GIL to the other threads in the middle of the launch
        try:
            return original(self, *args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    fmt = get_format("fp8_e4m3")
    layout = PackLayout.plan([TensorSpec("w", (8, 300), torch.bfloat16, True)], fmt)
    pack = torch.zeros(layout.nbytes, dtype=torch.uint8)
    weights = {"w": torch.randn(8, 300).to(torch.bfloat16)}
    write_pack(layout, pack, weights, lambda w, f, granularity: quantize(w, f, granularity))
    results = []

    def work():
        out = torch.zeros(layout.out_nbytes, dtype=torch.uint8)
        upcast_pack(pack.clone(), out, layout.table(BLOCK), layout.n_programs(BLOCK), layout.out_dtype, fmt)
        results.append(out)

    assert not in_threads(work, 4) and len(results) == 4 and most[0] == 1
    assert all(torch.equal(out, results[0]) for out in results)


def test_the_kernels_checks_leave_fake_tensors_to_be_traced():
    # the size, address and NaN checks read values: under fake tensors (torch.compile, torch.export) they wait for
    # real ones, and the calls trace as before
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tritoff.formats import get_format
    from tritoff.kernels import quantize, upcast_pack
    from tritoff.kernels.backend import holds_values
    from tritoff.pack import PackLayout, TensorSpec

    layout = PackLayout.plan([TensorSpec("w", (32, 64), torch.bfloat16, True)], get_format("fp8_e4m3"))
    table = layout.table()
    assert holds_values(torch.zeros(1), table) and not holds_values(torch.zeros(1, device="meta"))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor
        codes, scales = quantize(fake(torch.randn(32, 64, dtype=torch.bfloat16)), get_format("fp8_e4m3"))
        assert codes.shape == (32, 64) and scales.shape == (32,)
        src = fake(torch.zeros(layout.nbytes, dtype=torch.uint8))
        dst = fake(torch.zeros(layout.out_nbytes, dtype=torch.uint8))
        assert not holds_values(src)
        out = upcast_pack(src, dst, fake(table), layout.n_programs(), layout.out_dtype, get_format("fp8_e4m3"))
        assert out is dst


def test_the_variable_set_after_triton_was_imported_leaves_the_reference_on_the_cpu():
    """Triton made its own jit functions (tl.sum's) compiled when it was imported: kernels interpreted over them failed
    at their first launch ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = "\n".join(
        [
            "import os, torch, triton, pytest, tritoff",
            "os.environ['TRITON_INTERPRET'] = '1'",
            "import tritoff.kernels as k",
            "from tests.tritoff.helpers import stack",
            "assert not k.interpreting() and not k.triton_runs_on('cpu')",
            "x = torch.randn(4, 16, dtype=torch.bfloat16)",
            "reference, model = stack(), stack()",
            "tritoff.enable(reference, mode='leaf', device='cpu', kernels='reference', progress=False)",
            "engine = tritoff.enable(model, mode='leaf', device='cpu', progress=False)",
            "assert not engine._use_triton()",
            "assert torch.equal(model(x), reference(x))",
            "with pytest.raises(ValueError, match='set TRITON_INTERPRET=1 before triton is first imported'):",
            "    tritoff.enable(stack(), kernels='triton', device='cpu', progress=False)",
        ]
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

"""tritoff/arena.py: one allocation, host memory close to the packed bytes, page-locked and zero-copy on CUDA."""

import os

import pytest
import torch

from tritoff.arena import HostArena
from tritoff.report import host_rss


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_host_memory_tracks_the_packed_bytes():
    nbytes = 96 * 2**20 + 12345
    before = host_rss()
    arena = HostArena(nbytes, register=False)
    arena.buffer.fill_(0x5A)  # writing faults every page in, as packing does
    grown = host_rss() - before
    # no power-of-two rounding: 96 MiB stays 96 MiB (a caching pinned allocator would take 128 MiB)
    assert nbytes <= grown <= 1.05 * nbytes, grown / nbytes
    assert arena.view(nbytes - 10, 10).tolist() == [0x5A] * 10


def test_views_are_bounds_checked():
    arena = HostArena(1000, register=False)
    with pytest.raises(IndexError, match="outside the arena"):
        arena.view(990, 20)
    with pytest.raises(RuntimeError, match="page-locked"):
        arena.device_view(0, 10)


@pytest.mark.gpu
def test_registered_arena_is_page_locked_and_zero_copy_readable():
    from tritoff.formats import get_format
    from tritoff.kernels.quantize import quantize_reference
    from tritoff.kernels.upcast import BLOCK_ZERO_COPY, upcast_pack_reference, upcast_pack_zero_copy
    from tritoff.pack import PackLayout, TensorSpec, write_pack

    fmt = get_format("fp8_e4m3")
    specs = [TensorSpec("w", (512, 1000), torch.bfloat16, True), TensorSpec("b", (511,), torch.float32, False)]
    layout = PackLayout.plan(specs, fmt)
    arena = HostArena(layout.nbytes + 4096)
    assert arena.registered
    data = arena.view(4096, layout.nbytes)
    write_pack(layout, data, {"w": torch.randn(512, 1000).bfloat16() * 0.02, "b": torch.randn(511)}, quantize_reference)
    out = torch.full((layout.out_nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
    table = layout.table(BLOCK_ZERO_COPY, "cuda")
    upcast_pack_zero_copy(
        arena.device_view(4096, layout.nbytes), out, table, layout.n_programs(BLOCK_ZERO_COPY), layout.out_dtype, fmt
    )
    expected = upcast_pack_reference(
        data, torch.empty(layout.out_nbytes, dtype=torch.uint8), layout.table(), layout.out_dtype, fmt
    )
    got = layout.views(out.cpu())
    for name, ref in layout.views(expected).items():
        torch.testing.assert_close(got[name], ref, rtol=0, atol=0, msg=name)
    # a copy-engine transfer from the registered arena is asynchronous (pageable memory would block the host)
    staged = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    staged.copy_(data, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(staged.cpu(), data)
    arena.close()


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")], ids=["cuda", "cuda:0", "torch.device"])
def test_device_view_takes_any_spelling_of_the_device(device):
    arena = HostArena(8192)
    assert arena.registered
    arena.buffer.copy_(torch.arange(8192) % 251)
    view = arena.device_view(4096, 4096, device)
    assert view.device == torch.device("cuda", torch.cuda.current_device())
    # an elementwise kernel reading host memory over PCIe (a clone would be a device-to-device memcpy instead)
    assert torch.equal((view + 0).cpu(), arena.view(4096, 4096))
    arena.close()


@pytest.mark.gpu
def test_a_failed_registration_leaves_no_cuda_error_behind():
    from tritoff import cuda_host

    arena = HostArena(1 << 20)
    assert arena.registered
    # registering the same range twice fails (already registered); with the runtime API the error would stay
    # pending and the next unrelated kernel would report it
    error = cuda_host.register(arena.buffer.data_ptr(), arena.nbytes)
    assert error is not None and "ALREADY_REGISTERED" in error
    a = torch.randn(256, 256, device="cuda")
    torch.testing.assert_close((a @ a).cpu(), a.cpu() @ a.cpu(), rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    arena.close()

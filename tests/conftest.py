"""Test setup: Triton's interpreter on CPU-only machines, GPU marker, NaN-poisoned outputs, tiny local models."""

import os

import torch

# Triton reads TRITON_INTERPRET when it is imported, so this must come before any tritoff.kernels import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernels run: the GPU when there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def poisoned(nbytes: int, device) -> torch.Tensor:
    """A uint8 buffer filled with 0xFF: NaN in bf16, fp16 and fp32, so an unwritten element fails any comparison."""
    return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

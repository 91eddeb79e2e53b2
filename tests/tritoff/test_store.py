"""tritoff/store.py: stores round-trip exactly and refuse whatever does not match."""

import json

import pytest
import torch
from helpers import run, wan

import tritoff
from tritoff.store import INDEX, StoreError

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def _enable(pipe, **kwargs):
    return tritoff.enable(pipe, mode="group", budget="4MB", progress=False, kernels="reference", **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("store")
    pipe = wan()
    _enable(pipe).save(directory)
    return directory, run(pipe)


def test_round_trip_is_exact_and_maps_the_files(saved):
    directory, expected = saved
    pipe = wan()
    engine = _enable(pipe, store=directory)
    assert torch.equal(run(pipe), expected)
    for packed in engine.packed.values():
        assert packed.arena.read_only  # a mapping of the file, not a copy
    assert engine.options.storage == "fp8_e4m3"


def test_other_config_is_refused(saved):
    directory, _ = saved
    pipe = wan(num_layers=3)
    before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(StoreError, match="transformer does not match the store"):
        _enable(pipe, store=directory)
    assert all(torch.equal(p, before[n]) for n, p in pipe.transformer.named_parameters())  # nothing changed


def test_truncated_missing_and_other_version_are_refused(saved, tmp_path):
    directory, _ = saved
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    with open(broken / "transformer.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(StoreError, match="truncated"):
        _enable(wan(), store=broken)
    (broken / "transformer.safetensors").unlink()
    with pytest.raises(StoreError, match="missing"):
        _enable(wan(), store=broken)
    index = json.loads((broken / INDEX).read_text())
    index["store_version"] = 99
    (broken / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match="store format 99"):
        _enable(wan(), store=broken)
    with pytest.raises(StoreError, match="not a tritoff store"):
        _enable(wan(), store=tmp_path)


def test_storage_other_than_the_stores_is_refused(saved):
    directory, _ = saved
    with pytest.raises(ValueError, match="holds fp8_e4m3"):
        _enable(wan(), store=directory, storage="fp8_e5m2")

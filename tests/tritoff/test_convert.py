"""tritoff/convert.py: reading the checkpoint group by group gives exactly the store of a fully loaded pipeline."""

import pytest
from helpers import wan

from tritoff.convert import CheckpointReader, convert_pipeline

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


def test_streamed_conversion_equals_the_loaded_one(tmp_path, monkeypatch):
    wan().save_pretrained(tmp_path / "pipe")
    reads = []
    original = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read", lambda self, items: reads.append(len(items)) or original(self, items))
    streamed = convert_pipeline(tmp_path / "pipe", tmp_path / "a", progress=False, stream=True)
    # one read per group of the transformer (4 blocks + rest) and of the VAE: never the whole checkpoint at once
    assert len(reads) > 5 and max(reads) < sum(reads) / 2
    convert_pipeline(tmp_path / "pipe", tmp_path / "b", progress=False, stream=False)
    assert set(streamed) == {"text_encoder", "transformer", "vae"}
    for file in sorted(p.name for p in (tmp_path / "b").iterdir()):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_reader_reads_only_what_it_is_asked(tmp_path):
    import torch

    wan().save_pretrained(tmp_path / "pipe")
    reader = CheckpointReader(tmp_path / "pipe" / "transformer")
    got = reader.read([("blocks.0.attn1.to_q.weight", torch.bfloat16)])
    assert list(got) == ["blocks.0.attn1.to_q.weight"] and got["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    with pytest.raises(KeyError, match="not in the checkpoint"):
        reader.read([("nope.weight", torch.bfloat16)])

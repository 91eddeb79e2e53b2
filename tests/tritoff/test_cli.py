"""tritoff/cli.py: every command end to end on tiny local pipelines; bad input exits 2 with one line."""

import pytest
from helpers import wan

from tritoff.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pipe")
    wan().save_pretrained(directory)
    return directory


RUN = [
    "--prompt",
    "a cat",
    "--steps",
    "2",
    "--frames",
    "5",
    "--height",
    "16",
    "--width",
    "16",
    "--budget",
    "4MB",
    "--mode",
    "group",
]


def test_demo_writes_a_video_and_the_report(tmp_path, capsys):
    out = tmp_path / "demo.gif"
    assert main(["demo", "--out", str(out), "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert out.stat().st_size > 0 and "transformer" in printed and "PSNR" in printed


def test_run_convert_and_run_from_the_store(saved_pipeline, tmp_path, capsys):
    plain, stored, store = tmp_path / "a.gif", tmp_path / "b.gif", tmp_path / "store"
    assert main(["run", str(saved_pipeline), *RUN, "--out", str(plain)]) == 0
    assert main(["convert", str(saved_pipeline), str(store)]) == 0
    assert (store / "tritoff_store.json").is_file()
    assert main(["run", str(saved_pipeline), *RUN, "--out", str(stored), "--store", str(store)]) == 0
    assert plain.read_bytes() == stored.read_bytes()  # same frames, from packs mapped instead of re-quantized
    assert "from store" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "/no/such/model", "--prompt", "x"], "not found"),
        (["run", "{pipe}", "--prompt", "x", "--budget", "abc"], "invalid budget 'abc'"),
        (["run", "{pipe}", "--prompt", "x", "--budget", "-1"], "invalid budget"),
        (["run", "{pipe}", "--prompt", "x", "--budget", "150%", "--device", "cpu"], "at most 100%"),
        (["run", "{pipe}", "--prompt", "x", "--storage", "int3"], "unknown storage"),
        (["run", "{pipe}", "--prompt", "x", "--mode", "layer"], "unknown mode"),
        (["run", "{pipe}", "--prompt", "x", "--out", "/no/such/dir/v.mp4"], "does not exist"),
        (["run", "{pipe}", "--prompt", "x", "--store", "{tmp}"], "not a tritoff store"),
        (["convert", "{pipe}", "{tmp}/s", "--storage", "int3"], "unknown storage"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, saved_pipeline, tmp_path, capsys):
    argv = [a.format(pipe=saved_pipeline, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tritoff: error")]
    assert len(errors) == 1 and message in errors[0]
    assert not list(tmp_path.glob("*.mp4")) and not list(tmp_path.glob("*.gif"))  # nothing half-written


def test_pipeline_without_a_denoiser_is_refused(tmp_path, capsys):
    pipe = wan()
    pipe.register_modules(transformer=None)
    pipe.save_pretrained(tmp_path / "no-transformer")
    assert main(["run", str(tmp_path / "no-transformer"), "--prompt", "x", "--out", str(tmp_path / "v.gif")]) == 2
    assert "has no transformer or unet" in capsys.readouterr().err


def test_info(capsys):
    assert main(["info"]) == 0
    assert "torch" in capsys.readouterr().out


def test_bench_smoke_runs(capsys):
    assert main(["bench", "quality", "--smoke"]) == 0

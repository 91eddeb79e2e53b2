"""The ``tritoff`` command line, run as users run it: the real entry point in a subprocess, on tiny local pipelines.

Every command works end to end; every bad input exits 2 with one line on stderr and no traceback, before anything
slow. The slow commands (demo, convert, a benchmark's smoke run, a run that learns the smallest budget) start together
when the module starts and the quick checks run meanwhile, so the cores stay busy; the tests that read the slow
commands' results come last.
"""

import atexit
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from tritoff import __version__
from tritoff.store import INDEX, read_index, verify_store

TRITOFF = [sys.executable, "-m", "tritoff"]
RUN = ["--prompt", "a cat", "--steps", "1", "--frames", "1", "--height", "16", "--width", "16"]
# leaf groups, one block in flight, a 1 MB activation reserve, transfers read host memory: each shows in the plan
OPTIONS = ["--mode", "leaf", "--prefetch", "1", "--reserve", "1MB", "--transport", "zero_copy"]
UMASK = 0o027


def _env():
    # the commands run side by side on two cores; a crash prints every thread's stack
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


class Job:
    """A ``tritoff`` command running in the background, its output going to files."""

    def __init__(self, directory, name, *args, umask=None):
        self.out, self.err = directory / f"{name}.out", directory / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [*TRITOFF, *map(str, args)],
                stdout=out,
                stderr=err,
                env=_env(),
                preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
            )

    def result(self, timeout=900):
        """(exit code, stdout, stderr) once it has finished."""
        code = self.proc.wait(timeout)
        return code, self.out.read_text(), self.err.read_text()


def tritoff(*args, umask=None, timeout=900):
    """Run ``tritoff ARGS``; returns (exit code, stdout, stderr)."""
    done = subprocess.run(
        [*TRITOFF, *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )
    return done.returncode, done.stdout, done.stderr


def assert_one_line_error(code, out, err, message):
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tritoff") and message in lines[0], err
    assert "Traceback" not in err and out == ""  # nothing ran: no progress bar, no report


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Two saved tiny Wan pipelines (same architecture, other random weights), and the slow commands, started."""
    from tritoff.tiny import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("cli")
    tiny_wan_pipeline(seed=0).save_pretrained(root / "pipe")
    tiny_wan_pipeline(seed=1).save_pretrained(root / "other")
    jobs = {
        "probe": Job(root, "probe", "run", root / "pipe", *RUN, *OPTIONS, "--budget", "1B", "--out", root / "p.gif"),
        "convert": Job(root, "convert", "convert", root / "pipe", root / "store", "--mode", "leaf", umask=UMASK),
        # a budget that holds every block: the streaming path is the run test's, the demo's here is the command's
        "demo": Job(
            root, "demo", "demo", "--steps", "1", "--frames", "1", "--budget", "64MB", "--out", root / "demo.mp4"
        ),
        "bench": Job(root, "bench", "bench", "quality", "--smoke"),
        "demo-budget": Job(root, "demo-budget", "demo", "--budget", "1B", "--out", root / "never.gif"),
    }
    yield root, jobs
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()


BAD = [
    (["run", "/no/such/model", "--prompt", "x"], "not found"),
    (["run", "{pipe}", "--prompt", "x", "--budget", "abc"], "invalid budget 'abc'"),
    (["run", "{pipe}", "--prompt", "x", "--budget", "-1"], "invalid budget"),
    (["run", "{pipe}", "--prompt", "x", "--budget", "150%"], "at most 100%"),
    (["run", "{pipe}", "--prompt", "x", "--reserve", "abc"], "invalid reserve 'abc'"),
    (["run", "{pipe}", "--prompt", "x", "--storage", "tokenizer=bf16"], "text_encoder, transformer, vae"),
    (
        ["run", "{pipe}", "--prompt", "x", "--reserve", "100%"],
        "--reserve 100% leaves nothing of the budget for weights",
    ),
    (
        ["run", "{pipe}", "--prompt", "x", "--reserve", "150%"],
        "--reserve 150% leaves nothing of the budget for weights: use less than 100%",
    ),
    (["run", "{pipe}", "--prompt", "x", "--storage", "int3"], "unknown storage 'int3'"),
    (["run", "{pipe}", "--prompt", "x", "--mode", "layer"], "invalid choice: 'layer'"),
    (["run", "{pipe}", "--prompt", "x", "--transport", "fast"], "invalid choice: 'fast'"),
    (["run", "{pipe}", "--prompt", "x", "--prefetch", "0"], "--prefetch: must be an integer >= 1, got '0'"),
    (["run", "{pipe}", "--prompt", "x", "--height", "-64"], "--height: must be an integer from 1 to 16384, got '-64'"),
    (["run", "{pipe}", "--prompt", "x", "--height", "20"], "--height 20 is not a multiple of 16"),
    (["run", "{pipe}", "--prompt", "x", "--width", "8"], "--width 8 is not a multiple of 16"),
    (["run", "{pipe}", "--prompt", "x", "--frames", "0"], "--frames: must be an integer from 1 to 10000"),
    (["run", "{pipe}", "--prompt", "x", "--steps", "0"], "--steps: must be an integer from 1 to 1000"),
    (["run", "{pipe}", "--prompt", "x", "--steps", "two"], "--steps: expected an integer from 1 to 1000, got 'two'"),
    (["run", "{pipe}", "--prompt", "x", "--guidance", "nan"], "--guidance: must be a finite number"),
    (["run", "{pipe}", "--prompt", "x", "--seed", "-1"], "--seed: must be an integer >= 0"),
    # beyond any model's shape: refused at once, not after loading (steps), the whole run (fps) or hours of tracing
    (["run", "{pipe}", "--prompt", "x", "--steps", "1" + "0" * 20], "--steps: must be an integer from 1 to 1000"),
    (["run", "{pipe}", "--prompt", "x", "--fps", "10" * 6], "--fps: must be an integer from 1 to 1000, got"),
    (["run", "{pipe}", "--prompt", "x", "--height", "16400"], "--height: must be an integer from 1 to 16384"),
    (["plan", "wan2.1-t2v-14b", "--frames", "400000000001"], "--frames: must be an integer from 1 to 10000"),
    (["demo", "--frames", "10005"], "--frames: must be an integer from 1 to 10000"),
    (["run", "{pipe}", "--prompt", "x", "--device", "tpu"], "unknown device 'tpu'"),
    (["run", "{pipe}", "--prompt", "x", "--device", "cuda"], "CUDA is not available"),
    (["run", "{pipe}", "--prompt", "x", "--budget", "80%", "--device", "cpu"], "is a share of GPU memory"),
    (["run", "{pipe}", "--prompt", "x", "--host-budget", "abc"], "invalid --host-budget 'abc'"),
    (["run", "{pipe}", "--prompt", "x", "--store", ""], "argument --store: expected a path, got an empty string"),
    (["convert", "", "{tmp}/store"], "argument model: expected a path, got an empty string"),
    (["run", "{pipe}", "--prompt", "x", "--host-budget=-2GB"], "invalid --host-budget"),
    (["run", "{pipe}", "--prompt", "x", "--host-budget", "-2GB"], "invalid --host-budget '-2GB'"),
    (["plan", "wan2.1-t2v-14b", "--budget", "-1GB"], "invalid budget '-1GB': give bytes"),
    (["plan", "wan2.1-t2v-14b", "--budget", "--"], "argument --budget: expected one argument"),
    (["run", "{pipe}", "--prompt", "x", "--spill-dir", "{tmp}"], "--spill-dir is used only with --host-budget"),
    (
        ["run", "{pipe}", "--prompt", "x", "--host-budget", "1GB", "--spill-dir", "{tmp}/list/tritoff_store.json"],
        "is not a directory",
    ),
    (
        ["run", "{pipe}", "--prompt", "x", "--host-budget", "1GB", "--spill-dir", "{tmp}/list/tritoff_store.json/x"],
        "is not a writable directory",
    ),
    # procfs: its modes let root write, but no file can be made there
    (
        ["run", "{pipe}", "--prompt", "x", "--host-budget", "1GB", "--spill-dir", "/proc/spill"],
        "--spill-dir /proc/spill: /proc is not a writable directory",
    ),
    (["plan", "wan2.1-t2v-14b", "--host-budget", "abc"], "invalid --host-budget 'abc'"),
    (["run", "{pipe}", "--prompt", "x", "--out", "/no/such/dir/v.mp4"], "does not exist"),
    (["run", "{pipe}", "--prompt", "x", "--out", "{tmp}/v.avi"], "name the video .mp4 or .gif"),
    (["run", "{pipe}", "--prompt", "x", "--store", "{tmp}"], "not a tritoff store"),
    (["run", "{pipe}", "--prompt", "x", "--store", "{tmp}/list"], "not a valid tritoff store index (not an object)"),
    (["run", "{pipe}", "--prompt", "x", "--store", "{tmp}/nokey"], "not a valid tritoff store index (no 'tritoff')"),
    (["run", "{pipe}"], "the following arguments are required: --prompt"),
    (["demo", "--budget", "abc"], "invalid budget 'abc'"),
    (["demo", "--budget", "0.5"], "invalid budget '0.5': a number without a unit is bytes; give a unit"),
    (["demo", "--budget", "12"], "invalid budget '12': a number without a unit is bytes; give a unit, e.g. '12GB'"),
    (["plan", "wan2.1-t2v-14b", "--link", "25GB/h"], "--link 25GB/h: give bytes per second, e.g. 25GB or 25GB/s"),
    (["demo", "--steps", "0"], "--steps: must be an integer from 1 to 1000"),
    (["demo", "--frames", "0"], "--frames: must be an integer from 1 to 10000"),
    (["demo", "--frames", "4"], "--frames 4 is not one more than a multiple of 4 (the VAE compresses time 4x after"),
    (["run", "{pipe}", "--prompt", "x", "--frames", "6"], "--frames 6 is not one more than a multiple of 4"),
    (["run", "{pipe}", "--prompt", "x", "--store", "{tmp}/nosuch"], "nosuch does not exist; create a store there"),
    (["convert", "{pipe}", "{tmp}", "--skip", "("], "--skip '(' is not a valid regular"),  # before the target's check
    (["convert", "{pipe}", "{tmp}/s", "--skip"], "argument --skip: expected at least one argument"),
    (["convert", "{pipe}", "--skip", "attn1", "{tmp}/s"], "out_dir; a --skip before it reads it as a pattern"),
    (["demo", "--device", "cuda"], "CUDA is not available"),
    (["demo", "--out", "{tmp}/demo.webm"], "name the video .mp4 or .gif"),
    (["convert", "{pipe}", "{tmp}/s", "--storage", "int3"], "unknown storage"),
    (["convert", "{pipe}", "{tmp}/s", "--storage", "vae="], "use a format, or component=format pairs"),
    (["convert", "{pipe}", "{tmp}/s", "--storage", "unet=fp8_e4m3"], "storage names 'unet', which is not a component"),
    (["run", "{pipe}", "--prompt", "x", "--storage", "vae=int3"], "unknown storage 'int3'"),
    (["convert", "{pipe}", "{pipe}/store"], "inside the model directory"),
    (["convert", "{pipe}", "{tmp}"], "is not empty and holds no tritoff store"),
    (["convert", "no-such-dir", "{tmp}/s"], "not found"),
    (["convert", "{pipe}", "{tmp}/s", "--skip", "("], "--skip '(' is not a valid regular expression"),
    (["convert", "{pipe}", "/proc/s"], "cannot write a store in /proc (it takes no new files): choose a directory"),
    (["run", "{pipe}/model_index.json", "--prompt", "x"], "model_index.json is a file: give the diffusers pipeline"),
    (["convert", "{pipe}/model_index.json", "{tmp}/s"], "model_index.json is a file: give the diffusers pipeline"),
    (["convert", "{pipe}", "{tmp}/s", "--storage", "vae=bf16,vae=fp8_e4m3"], "names vae twice"),
    (["plan", "wan2.1-t2v-14b", "--height", "481"], "height 481 is not a multiple of 16 (the VAE's"),
    # plan takes no percentage: its syntax errors suggest none
    (["plan", "wan2.1-t2v-14b", "--budget", "-1GB"], "invalid budget '-1GB': give bytes, e.g. '12GB' or '12GiB'"),
    (["plan", "wan2.1-t2v-14b", "--budget", "80%"], "--budget: give bytes (e.g. 12GB), not a percentage"),
    ([], "the following arguments are required: command"),
    (["bench"], "the following arguments are required: which ("),  # not the script's arguments: they are optional
    (["demo", "--storage", "foo=bf16"], "--storage foo=bf16: storage names 'foo', which is not a component"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_exit_2(argv, message, work, tmp_path):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / INDEX).write_text("[1, 2, 3]")
    (tmp_path / "nokey").mkdir()
    (tmp_path / "nokey" / INDEX).write_text(json.dumps({"store_version": 2}))
    argv = [a.format(pipe=work[0] / "pipe", tmp=tmp_path) for a in argv]
    assert_one_line_error(*tritoff(*argv), message)
    assert not list(tmp_path.glob("*.mp4")) and not list(tmp_path.glob("*.gif"))  # nothing half-written


def test_values_starting_with_a_dash_are_read_as_values_and_options_stay_options():
    # argparse alone reads "--negative-prompt '-blurry'" as an option without its value
    from tritoff import cli

    parser = cli.build_parser()
    args = parser.parse_args(
        cli.attach_dash_values(["run", "m", "--prompt", "-x", "--negative-prompt", "-blurry, dark", "--steps", "3"])
    )
    assert (args.prompt, args.negative_prompt, args.steps) == ("-x", "-blurry, dark", 3)
    assert cli.attach_dash_values(["plan", "m", "--budget", "-1GB"]) == ["plan", "m", "--budget=-1GB"]
    # a path starting with a dash
    args = parser.parse_args(
        cli.attach_dash_values(["run", "m", "--prompt", "x", "--image", "-a.png", "--out", "-v.gif"])
    )
    assert (args.image, args.out) == ("-a.png", "-v.gif")
    # abbreviated as argparse allows: the one option of the command starting so
    args = parser.parse_args(cli.attach_dash_values(["run", "m", "--prom", "-x", "--neg", "-blurry"], parser))
    assert (args.prompt, args.negative_prompt) == ("-x", "-blurry")
    ambiguous = ["run", "m", "--prompt", "x", "--s", "-1"]  # --seed, --steps, --storage, ...
    assert cli.attach_dash_values(ambiguous) == ambiguous
    kept = ["run", "m", "--prompt", "--steps", "3", "--negative-prompt", "-h", "--budget=-1GB", "--seed", "-1"]
    assert cli.attach_dash_values(kept) == kept
    # "--" is no value (argparse would read "--budget=--" as an empty list), and ends the options; a benchmark's
    # arguments are its script's
    for kept in (
        ["plan", "m", "--budget", "--"],
        ["run", "m", "--", "--prompt", "-x"],
        ["bench", "e2e", "--link", "-1"],
    ):
        assert cli.attach_dash_values(kept) == kept


def test_plan_of_a_pipeline_whose_index_names_no_denoiser_says_so_in_one_line(work, tmp_path):
    import shutil

    shutil.copytree(work[0] / "pipe", tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({**index, "transformer": []}))
    assert_one_line_error(*tritoff("plan", tmp_path / "pipe"), "transformer is [], not [library, class]")


def test_mp4_without_its_writer_is_an_error_not_a_gif(work, tmp_path):
    blocked = "import sys; sys.modules['imageio_ffmpeg'] = None; from tritoff.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", blocked, "run", work[0] / "pipe", "--prompt", "x", "--out", tmp_path / "v.mp4"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert_one_line_error(done.returncode, done.stdout, done.stderr, "writing .mp4 needs imageio-ffmpeg (a dependency")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (["no-such-model"], "no-such-model is neither a local pipeline directory nor a preset (wan2.1-t2v-1.3b, wan2"),
        (["wan2.1-t2v-14b", "--frames", "6"], "--frames 6 is not one more than a multiple of 4"),
        (["cogvideox-5b", "--height", "470"], "--height 470 is not a multiple of 16"),
        (["wan2.2-ti2v-5b", "--height", "720"], "--height 720 is not a multiple of 32 (the VAE's downscale"),
        (["{pipe}", "--width", "15"], "--width 15 is not a multiple of"),
        (["{tmp}"], "has no model_index.json: give a diffusers pipeline directory or a preset name"),
        (["{pipe}/model_index.json"], "model_index.json is a file: give the diffusers pipeline directory that holds"),
    ],
    ids=["unknown", "preset-frames", "preset-height", "ti2v-height", "dir-width", "not-a-pipeline", "its-index"],
)
def test_plan_refuses_a_model_or_shape_before_importing_torch(work, tmp_path, argv, message):
    # a plan builds its model on the meta device (seconds): what configs alone can refuse is refused first
    blocked = "import sys; sys.modules['torch'] = None; from tritoff.cli import main; sys.exit(main())"
    argv = [a.format(pipe=work[0] / "pipe", tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-c", blocked, "plan", *argv], capture_output=True, text=True, env=_env())
    assert_one_line_error(done.returncode, done.stdout, done.stderr, message)


def test_version_is_printed_without_importing_torch():
    blocked = "import sys; sys.modules['torch'] = None; from tritoff.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", blocked, "--version"], capture_output=True, text=True, env=_env())
    assert (done.returncode, done.stdout, done.stderr) == (0, f"tritoff {__version__}\n", "")


def test_help_shows_defaults_and_the_run_options():
    code, out, err = tritoff("run", "--help")
    assert code == 0
    for expected in ("--steps STEPS", "(default: 30)", "--prefetch", "(default: 2)", "--reserve", "--transport"):
        assert expected in out
    code, out, err = tritoff("convert", "--help")
    assert code == 0 and "--overwrite" in out and "(default: fp8_e4m3)" in out


def test_info_shows_the_transport():
    code, out, err = tritoff("info")
    assert code == 0 and "torch" in out
    assert [line for line in out.splitlines() if line.split()[:1] == ["transport"]]


def test_the_command_turns_on_expandable_segments_before_torch_starts_cuda(monkeypatch):
    import tritoff.cli as cli
    from tritoff import allocator

    seen = {}

    def main():
        seen["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        return 0

    def exit_now(code):  # the console script ends the process this way; here, the test goes on
        raise SystemExit(code)

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: None)  # pytest's own exit handlers run when pytest exits
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(allocator, "set_by_command", False)
    for name in allocator.ENV_NAMES:
        monkeypatch.setenv(name, "restored by monkeypatch")
        monkeypatch.delenv(name)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as done:
            cli.entry()
        assert done.value.code == 0 and seen["conf"] == "expandable_segments:True" and allocator.set_by_command
        seen.clear()
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # the user's own setting is kept
        with pytest.raises(SystemExit):
            cli.entry()
        assert seen["conf"] == "max_split_size_mb:64"
    finally:
        for sig, handler in previous.items():  # entry installs its own, for the process's last moments
            signal.signal(sig, handler)


def test_a_reader_gone_from_stdout_or_stderr_costs_nothing():
    """``tritoff ... | head -1``, ``2>&1 | head -1``: the output the reader no longer takes is dropped, the command
    ends as it would."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tritoff", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    child.stdout.close()
    err = child.stderr.read()
    assert child.wait() == 0 and err == ""
    child = subprocess.Popen(  # an error printed to a closed stderr: still exit 2, and no traceback printed anywhere
        [sys.executable, "-m", "tritoff", "plan", "no-such-model"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    child.stderr.close()
    out = child.stdout.read()
    assert child.wait() == 2 and out == b""
    child = subprocess.Popen(  # started with stderr closed (2>&-): Python's sys.stderr is None
        [sys.executable, "-m", "tritoff", "info"], stdout=subprocess.PIPE, preexec_fn=lambda: os.close(2)
    )
    out = child.stdout.read()
    assert child.wait() == 0 and b"torch" in out


def test_an_error_no_check_foresaw_is_one_line_unless_its_traceback_is_asked_for(monkeypatch, capsys):
    from tritoff import cli

    def failing(args):
        raise RuntimeError("The size of tensor a (234) must match\nthe size of tensor b (24)")

    monkeypatch.setattr(cli, "_cmd_info", failing)
    monkeypatch.delenv("TRITOFF_TRACEBACK", raising=False)
    assert cli.main(["info"]) == 1
    assert capsys.readouterr().err == (
        "tritoff: error: RuntimeError: The size of tensor a (234) must match the size of tensor b (24) (unexpected; "
        "set TRITOFF_TRACEBACK=1 for where it came from)\n"
    )
    monkeypatch.setenv("TRITOFF_TRACEBACK", "0")  # off, as unset
    assert cli.main(["info"]) == 1 and "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("TRITOFF_TRACEBACK", "1")  # the traceback is printed; the exit code stays
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in failing" in err, err
    assert err.endswith(
        "tritoff: error: RuntimeError: The size of tensor a (234) must match the size of tensor b (24) "
        "(unexpected: its traceback is above)\n"
    )
    # a library's ValueError (bad input to it) too, with its exit code; tritoff's own one-line errors stay one line
    monkeypatch.setattr(cli, "_cmd_info", lambda args: (_ for _ in ()).throw(ValueError("`mu` must be passed")))
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("\ntritoff: error: `mu` must be passed\n"), err
    monkeypatch.setattr(cli, "_cmd_info", lambda args: (_ for _ in ()).throw(cli.CliError("--steps is wrong")))
    assert cli.main(["info"]) == 2 and capsys.readouterr().err == "tritoff: error: --steps is wrong\n"
    # a ValueError raised by one of tritoff's own checks (not a CliError) stays one line, with its exit code
    assert cli.main(["plan", "wan2.1-t2v-14b", "--frames", "10"]) == 2
    assert capsys.readouterr().err.startswith("tritoff: error: --frames 10 is not one more than a multiple of 4")

    def wrapped(args):  # a library's error that a one-line CliError stands for (a pipeline that cannot load)
        try:
            int("two")
        except ValueError as err:
            raise cli.CliError(f"cannot load x: {err}") from None

    monkeypatch.setattr(cli, "_cmd_info", wrapped)
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert 'int("two")' in err and "During handling of the above exception" in err, err  # the library's, shown
    assert err.endswith("\ntritoff: error: cannot load x: invalid literal for int() with base 10: 'two'\n"), err


def test_the_demos_first_line_names_the_storage_asked_for():
    import torch

    from tritoff import cli
    from tritoff.demo import demo_pipeline

    # the components --storage may name, checked before the pipeline is built, are the demo pipeline's models
    built = demo_pipeline().components
    assert cli.DEMO_MODELS == tuple(sorted(n for n, m in built.items() if isinstance(m, torch.nn.Module)))

    assert cli._packs_of("fp8_e4m3", "fp8_e4m3") == "weights in fp8_e4m3 packs"
    assert cli._packs_of("bf16", "bf16") == cli._packs_of("fp16", "fp16") == "weights in their own dtype"
    assert cli._packs_of({"vae": "fp8_e5m2"}, "vae=fp8_e5m2") == "weights in packs (vae=fp8_e5m2)"


@pytest.mark.parametrize("command", ["run", "convert"])
@pytest.mark.parametrize("broken", ["model_index.json", "transformer/config.json"])
def test_a_config_that_cannot_be_read_is_named(work, tmp_path, command, broken):
    import shutil

    shutil.copytree(work[0] / "pipe", tmp_path / "pipe")
    (tmp_path / "pipe" / broken).write_text('{"a":')
    argv = ["run", str(tmp_path / "pipe"), "--prompt", "x"] if command == "run" else ["convert", str(tmp_path / "pipe")]
    if command == "convert":
        argv.append(str(tmp_path / "store"))
    assert_one_line_error(*tritoff(*argv), f"cannot read {tmp_path / 'pipe' / broken}: Expecting value")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("command", ["run", "convert", "plan"])
@pytest.mark.parametrize(
    "config, key, value, said",
    [
        ("transformer/config.json", "num_layers", "two", "'str' object cannot be interpreted as an integer"),
        ("vae/config.json", "z_dim", -3, "negative dimension"),
        # transformers' config classes raise an exception type of their own (not a ValueError) on a bad value
        ("text_encoder/config.json", "num_heads", "x", "num_heads"),
    ],
)
def test_a_config_whose_values_build_no_model_is_a_bad_input_in_one_line(
    work, tmp_path, command, config, key, value, said
):
    # parsed, but the model's constructor fails on the values: the input's fault, not an unexpected error
    import shutil

    shutil.copytree(work[0] / "pipe", tmp_path / "pipe")
    path = tmp_path / "pipe" / config
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    argv = {
        "run": ["run", tmp_path / "pipe", *RUN],
        "convert": ["convert", tmp_path / "pipe", tmp_path / "store"],
        "plan": ["plan", tmp_path / "pipe", "--budget", "1GB"],
    }[command]
    code, out, err = tritoff(*argv)
    # loaded by diffusers (its progress bars first), which names no file, the command finds it: every component in
    # run, the transformers ones in convert; the rest is built from the config, before anything loads
    if command == "run" or (command == "convert" and config.startswith("text_encoder")):
        last = err.replace("\r", "\n").strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in err and out == "", err
        assert last.startswith(f"tritoff: error: cannot build a model from {path}: ") and said in last, err
        assert last.endswith("fix the config"), err
    else:
        assert_one_line_error(code, out, err, f"cannot build a model from {path}: ")
        assert said in err and err.rstrip().endswith("fix the config")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    "command, config, key, value, tensor",
    [
        # transformers prints a report of every mismatched tensor, then fails naming no file
        ("run", "text_encoder/config.json", "num_heads", 0, "SelfAttention.q.weight has shape (32, 32)"),
        # the streamed component: found before anything is read, where packing failed naming no file
        ("convert", "transformer/config.json", "ffn_dim", 16, "blocks.0.ffn.net.0.proj.weight has shape (32, 24)"),
        # a block the checkpoint lacks: diffusers left it on the meta device, which enable refused naming no file
        ("run", "transformer/config.json", "num_layers", 3, "the model it builds has blocks.2."),
    ],
)
def test_a_config_that_does_not_describe_its_weights_is_named_in_one_line(
    work, tmp_path, command, config, key, value, tensor
):
    import shutil

    shutil.copytree(work[0] / "pipe", tmp_path / "pipe")
    path = tmp_path / "pipe" / config
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    argv = ["run", tmp_path / "pipe", *RUN] if command == "run" else ["convert", tmp_path / "pipe", tmp_path / "store"]
    code, out, err = tritoff(*argv)
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert code == 2 and out == "" and "Traceback" not in err and "REPORT" not in err, err
    assert last.startswith(f"tritoff: error: {path} does not describe the weights beside it: ") and tensor in last
    assert "fix the config" in last and not (tmp_path / "store").exists()


@pytest.mark.parametrize("command", ["run", "convert"])
@pytest.mark.parametrize(
    "name, said",
    [
        (None, "has no _class_name"),
        (5, "has _class_name 5, which names no class"),
        (["WanPipeline"], "has _class_name ['WanPipeline'], which names"),
    ],
)
def test_an_index_naming_no_pipeline_class_is_refused_in_one_line(work, tmp_path, command, name, said):
    # diffusers' own loading fails on these with a KeyError or deep in its resolution of custom pipelines
    import shutil

    shutil.copytree(work[0] / "pipe", tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    index.pop("_class_name")
    if name is not None:
        index["_class_name"] = name
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(index))
    argv = ["run", tmp_path / "pipe", "--prompt", "x"] if command == "run" else ["convert", tmp_path / "pipe"]
    if command == "convert":
        argv.append(tmp_path / "store")
    assert_one_line_error(*tritoff(*argv), f"{tmp_path / 'pipe' / 'model_index.json'} {said}")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("missing", ["directory", "config"])
@pytest.mark.parametrize("command", ["run", "convert"])
def test_a_component_directory_or_config_missing_is_named_before_anything_loads(work, tmp_path, command, missing):
    # diffusers said "no file named config.json found in directory" of the pipeline's own directory; transformers,
    # for a text encoder's config, printed its report of every weight it could not place
    import shutil

    shutil.copytree(work[0] / "pipe", tmp_path / "pipe")
    if missing == "directory":
        shutil.rmtree(tmp_path / "pipe" / "vae")
        said = f"{tmp_path / 'pipe' / 'vae'} is missing: model_index.json lists vae (diffusers AutoencoderKLWan)"
    else:
        (tmp_path / "pipe" / "text_encoder" / "config.json").unlink()
        said = f"{tmp_path / 'pipe' / 'text_encoder' / 'config.json'} is missing: text_encoder's weights ("
    argv = ["run", tmp_path / "pipe", "--prompt", "x"] if command == "run" else ["convert", tmp_path / "pipe"]
    if command == "convert":
        argv.append(tmp_path / "store")
    assert_one_line_error(*tritoff(*argv), said)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("when", ["placing", "generating"])
def test_running_out_of_gpu_memory_says_what_to_change(work, monkeypatch, capsys, tmp_path, when):
    import diffusers
    import torch

    import tritoff
    from tritoff import cli

    root, _ = work

    @functools.wraps(diffusers.WanPipeline.__call__)  # its signature: run checks that it takes a prompt and frames
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if when == "placing":
        monkeypatch.setattr(tritoff, "enable", out_of_memory)
    else:
        monkeypatch.setattr(diffusers.WanPipeline, "__call__", out_of_memory)
    out = tmp_path / "never.gif"
    code = cli.main(["run", str(root / "pipe"), *RUN, "--device", "cpu", "--out", str(out)])
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("tritoff")]
    expected = "ran out of memory while tritoff placed the weights" if when == "placing" else "while generating"
    assert code == 2 and expected in lines[-1] and "pass a smaller --budget" in lines[-1] and not out.exists()


def test_a_pipeline_that_cannot_load_keeps_the_reasons_its_library_lists(work, tmp_path):
    import torch

    from tritoff import cli

    root, _ = work
    shutil.copytree(root / "pipe", tmp_path / "pipe")
    for file in (tmp_path / "pipe" / "tokenizer").iterdir():  # the directory stays: its files are what is missing
        file.unlink()
    with pytest.raises(cli.CliError) as info:  # transformers gives its reasons on the lines below the first
        cli._load_pipeline(str(tmp_path / "pipe"), torch.bfloat16, None)
    message = str(info.value)
    assert message.startswith(f"cannot load {tmp_path / 'pipe'}: Couldn't instantiate the backend tokenizer from one")
    assert "(1) a `tokenizers` library serialization file" in message and "\n" not in message


def test_a_truncated_weight_file_is_named_with_its_reason(work, tmp_path):
    import torch

    from tritoff import cli

    root, _ = work
    shutil.copytree(root / "pipe", tmp_path / "pipe")
    weights = tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a download cut short
    with pytest.raises(cli.CliError) as info:  # diffusers names the file twice and keeps safetensors' reason below
        cli._load_pipeline(str(tmp_path / "pipe"), torch.bfloat16, None)
    assert str(info.value) == (
        f"cannot load {tmp_path / 'pipe'}: cannot read {weights}: Error while deserializing header: incomplete "
        "metadata, file not fully covered; is the checkpoint complete?"
    )


@pytest.mark.parametrize(
    "mode,prefetch,advice",
    [
        (
            "group",
            3,
            "pass --budget 1.3MB or more, --prefetch 1 (with --budget 1.1MB or more), or --mode leaf "
            "(with this budget)",
        ),
        ("auto", 3, "pass --budget 1.3MB or more, or --mode leaf (with this budget)"),  # no prefetch lowers it
        ("model", 1, "pass --budget 1.3MB or more"),
        (None, None, "pass --budget 1.3MB or more"),  # the demo: no --mode, no --prefetch
    ],
)
def test_budget_advice_names_what_the_engine_planned(mode, prefetch, advice):
    from tritoff.cli import _budget_error
    from tritoff.planner import BudgetError

    alternatives = {"prefetch": (1, 1_100_000), "mode": ("leaf", 900_000)}
    if mode == "auto":  # the engine named no prefetch
        del alternatives["prefetch"]
    elif mode == "model":
        alternatives = {}
    # the planner's facts hold a "; " of their own (the largest group kept resident): kept whole
    facts = "budget 1 MB is too small: the smallest that works is 1.2 MiB (the largest group resident, 9 KiB; 3 slots)"
    message = f"{facts}; prefetch=1 needs only 1.05 MiB"
    err = _budget_error(BudgetError(message, 1_258_292, alternatives, 1_000_000, facts), mode, prefetch)
    assert str(err).startswith(f"{facts}; pass ")
    assert str(err).endswith(advice) and "needs only" not in str(err)
    close = BudgetError(message, 1_258_292, {"mode": ("leaf", 1_250_000)}, 1_000_000, facts)
    assert str(_budget_error(close, "group", 2)).endswith("pass --budget 1.3MB or more")  # the same flag: not named
    both = BudgetError(message, 1_258_292, {**alternatives, "together": (("leaf", 1), 800_000)}, 1_000_000, facts)
    hint = "--mode leaf --prefetch 1 (with this budget)"
    assert str(_budget_error(both, mode, prefetch)).endswith(hint) == (mode is not None and prefetch is not None)


def test_the_cli_knows_the_engines_transports_and_storages():
    from tritoff.cli import STORAGES, TRANSPORTS
    from tritoff.formats import FORMATS
    from tritoff.options import TRANSPORTS as ENGINE_TRANSPORTS

    assert TRANSPORTS == ENGINE_TRANSPORTS and STORAGES == tuple(FORMATS)


def test_run_with_options_and_from_the_store(work):
    root, jobs = work
    # a budget of 1 byte: refused once the plan is known, with advice for this mode and prefetch (already leaf and 1)
    code, out, err = jobs["probe"].result()
    assert code == 2 and "Traceback" not in err, err
    error = err.strip().splitlines()[-1]
    assert error.startswith("tritoff: error: budget 1 B is too small") and "976.56 KiB" in error  # the reserve
    assert "--prefetch" not in error and "--mode" not in error
    budget = error.split("pass --budget ")[1].split()[0]

    code, out, err = jobs["convert"].result()
    assert code == 0, err
    assert all(f"packing {name}" in err for name in ("text_encoder", "transformer", "vae"))  # labelled bars
    store = root / "store"
    assert stat.S_IMODE(store.stat().st_mode) == 0o777 & ~UMASK
    assert {stat.S_IMODE(p.stat().st_mode) for p in store.iterdir()} == {0o666 & ~UMASK}
    assert not [p for p in root.iterdir() if p.name.startswith(".store")]  # no temporary directory left

    plain = Job(root, "plain", "run", root / "pipe", *RUN, *OPTIONS, "--budget", budget, "--out", root / "a.gif")
    assert OPTIONS[:2] == ["--mode", "leaf"]  # left out with the store: leaf, as it was converted
    stored = Job(
        root, "stored", "run", root / "pipe", *RUN, *OPTIONS[2:], "--budget", budget, "--store", store,
        "--out", root / "b.gif", umask=UMASK,
    )  # fmt: skip
    for job in (plain, stored):
        code, out, err = job.result()
        assert code == 0, err
        # the options reached tritoff.enable: prefetch 1, zero-copy, the reserve of every phase
        assert "transport zero_copy, prefetch 1" in out and out.count(" 976.56 KiB ") >= 3, out
        assert [line.split()[1] for line in out.splitlines() if line.startswith("  transformer ")][-1] == "leaf"
    assert "from store" in out and "verifying" in err
    assert (root / "a.gif").read_bytes() == (root / "b.gif").read_bytes()  # same frames, packs read from the store
    assert stat.S_IMODE((root / "b.gif").stat().st_mode) == 0o666 & ~UMASK


def test_a_store_is_refused_for_other_weights_corruption_and_mismatched_options(work, tmp_path):
    root, jobs = work
    assert jobs["convert"].result()[0] == 0
    store = root / "store"
    for model, args, message in [
        ("other", ["--store", store], "was made from other weights"),  # other random weights, same architecture
        ("pipe", ["--store", store, "--mode", "group"], "made with leaf groups; pass --mode leaf"),
        ("pipe", ["--store", store, "--storage", "fp8_e5m2"], "holds fp8_e4m3 for text_encoder; drop --storage"),
        ("pipe", ["--store", store, "--dtype", "fp16"], "converted in bf16 and the pipeline would load in fp16: pass"),
    ]:
        code, out, err = tritoff("run", root / model, *RUN, "--mode", "leaf", *args, "--out", tmp_path / "v.gif")
        assert_one_line_error(code, out, err, message)
    # a directory with a component the store lacks (a second expert): refused from the files, before loading
    shutil.copytree(root / "pipe", tmp_path / "two")
    shutil.copytree(root / "pipe" / "transformer", tmp_path / "two" / "transformer_2")
    index = json.loads((tmp_path / "two" / "model_index.json").read_text())
    index["transformer_2"] = index["transformer"]
    (tmp_path / "two" / "model_index.json").write_text(json.dumps(index))
    code, out, err = tritoff(
        "run", tmp_path / "two", *RUN, "--mode", "leaf", "--store", store, "--out", tmp_path / "v.gif"
    )
    said = f"but {tmp_path / 'two'} has ['text_encoder', 'transformer', 'transformer_2', 'vae']: run the pipeline the"
    assert_one_line_error(code, out, err, said)
    broken = tmp_path / "broken"
    shutil.copytree(store, broken)
    with open(broken / "transformer.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x01]))
    code, out, err = tritoff(
        "run", root / "pipe", *RUN, "--mode", "leaf", "--store", broken, "--out", tmp_path / "v.gif"
    )
    error = err.replace("\r", "\n").strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and "Loading pipeline" not in err  # refused before loading
    assert error == (
        f"tritoff: error: {broken / 'transformer.safetensors'} is corrupt or from another conversion (its xxh3_128 "
        "differs from the index's); recreate the store with `tritoff convert`"
    )
    assert not list(tmp_path.glob("*.gif"))
    (broken / "vae.safetensors").unlink()
    code, out, err = tritoff(
        "run", root / "pipe", *RUN, "--mode", "leaf", "--store", broken, "--out", tmp_path / "v.gif"
    )
    assert_one_line_error(code, out, err, f"{broken / 'vae.safetensors'} is missing; recreate the store with `tritoff")
    code, out, err = tritoff("convert", root / "pipe", store)
    assert_one_line_error(code, out, err, "already holds a store: pass --overwrite")


def test_an_interrupted_convert_leaves_the_store_as_it_was(work):
    root, jobs = work
    assert jobs["convert"].result()[0] == 0
    before = {p.name: p.read_bytes() for p in (root / "store").iterdir()}
    job = Job(root, "overwrite", "convert", root / "pipe", root / "store", "--overwrite", "--storage", "fp8_e5m2")
    deadline = time.monotonic() + 300
    while "packing" not in job.err.read_text() and job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.proc.send_signal(signal.SIGTERM)
    code, out, err = job.result()
    assert code == 130 and err.strip().splitlines()[-1] == "tritoff: interrupted" and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in (root / "store").iterdir()} == before
    verify_store(root / "store")
    assert read_index(root / "store")["storage"] == "fp8_e4m3"
    assert not [p for p in root.iterdir() if p.name.startswith(".store")]


def test_convert_removes_what_a_killed_conversion_left(work, tmp_path):
    root, jobs = work
    assert jobs["convert"].result()[0] == 0
    left = tmp_path / ".store.abcd_123.partial"
    left.mkdir()
    (left / "transformer.safetensors").write_bytes(b"x" * 1000)
    (left / ".writing").touch()  # its writer's lock file, nobody holding it: killed
    # a conversion killed while replacing a store, between moving the old one aside and the new one in: the old one
    # is the only store there, kept, and named as such
    aside = tmp_path / ".store.abcd_456.old"
    shutil.copytree(root / "store", aside)
    code, out, err = tritoff("convert", root / "pipe", tmp_path / "store")
    assert code == 0, err
    assert f"tritoff: removing {left}, left by an interrupted conversion" in err
    assert (
        f"{aside} is from another conversion of this store; it holds the store a conversion was replacing: if none "
        f"runs, move it back to {tmp_path / 'store'}" in err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name, "store"]
    verify_store(tmp_path / "store")
    verify_store(aside)


def test_a_hub_id_is_read_from_its_snapshot_in_the_hugging_face_cache(work, tmp_path, monkeypatch):
    root, jobs = work
    # the layout huggingface_hub gives a downloaded repository; offline, so nothing is asked of the network
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(root / "pipe", repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = tritoff("convert", "org/tiny", tmp_path / "store", "--mode", "leaf")
    assert code == 0, err
    assert jobs["convert"].result()[0] == 0
    for name in ("text_encoder", "transformer", "vae"):  # the packs the local directory's conversion wrote
        made = (tmp_path / "store" / f"{name}.safetensors").read_bytes()
        assert made == (root / "store" / f"{name}.safetensors").read_bytes(), name
    # run from the store: the hub id's files are checked against those the store was made from, then loaded
    runs = [
        Job(tmp_path, name, "run", model, *RUN, "--mode", "leaf", "--budget", "64MB", "--store", tmp_path / "store",
            "--out", tmp_path / f"{name}.gif")
        for name, model in (("hub", "org/tiny"), ("local", root / "pipe"))
    ]  # fmt: skip
    for job in runs:
        code, out, err = job.result()
        assert code == 0, err
    assert (tmp_path / "hub.gif").read_bytes() == (tmp_path / "local.gif").read_bytes()
    for command in (
        ["run", "org/missing", *RUN, "--out", tmp_path / "v.gif"],
        ["convert", "org/missing", tmp_path / "s"],
    ):
        code, out, err = tritoff(*command)
        assert_one_line_error(code, out, err, "cannot fetch org/missing from the Hugging Face hub: ")
    # a download cut short: the cache's copy lacks the transformer's weights, and is not taken as the pipeline
    partial = tmp_path / "hub" / "models--org--partial"
    shutil.copytree(repo, partial)
    (partial / "snapshots" / ("0" * 40) / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    code, out, err = tritoff("convert", "org/partial", tmp_path / "s")
    assert_one_line_error(code, out, err, "it is not all in the local cache (its transformer files are incomplete in")
    code, out, err = tritoff("convert", "org/a b", tmp_path / "s")
    assert_one_line_error(code, out, err, "org/a b is not a valid hub id (")


def test_run_from_a_store_builds_the_stored_components_without_their_weights(work, monkeypatch):
    from tritoff import TritoffWarning, convert
    from tritoff.cli import _load_pipeline

    root, jobs = work
    assert jobs["convert"].result()[0] == 0
    pipe = _load_pipeline(str(root / "pipe"), torch.bfloat16, str(root / "store"))
    for name in ("text_encoder", "transformer", "vae"):
        assert {p.device.type for p in getattr(pipe, name).parameters()} == {"meta"}, name
    # a text encoder built otherwise than the store's (here one weight in another dtype, as another transformers
    # version may keep it) is loaded whole instead, for the store's own checks
    build = convert.empty_transformers_component

    def other(*args):
        built = build(*args)
        built.shared.weight.data = built.shared.weight.data.float()
        return built

    monkeypatch.setattr(convert, "empty_transformers_component", other)
    with pytest.warns(TritoffWarning, match="text_encoder is loaded whole, then its packs replace it: built without"):
        pipe = _load_pipeline(str(root / "pipe"), torch.bfloat16, str(root / "store"))
    assert {p.device.type for p in pipe.text_encoder.parameters()} == {"cpu"}
    assert {p.device.type for p in pipe.transformer.parameters()} == {"meta"}


def test_run_from_a_saved_store_loads_a_float32_vae_in_float32(work, tmp_path):
    # an engine saved from a pipeline with its VAE in float32 (as Wan's examples load it): --store loaded the VAE in
    # --dtype, which its store refused
    from diffusers import AutoencoderKLWan

    from tritoff import enable
    from tritoff.cli import _load_pipeline
    from tritoff.convert import from_pretrained

    root, _ = work
    vae = AutoencoderKLWan.from_pretrained(root / "pipe" / "vae", torch_dtype=torch.float32)
    source = from_pretrained(root / "pipe", torch.bfloat16, vae=vae)
    enable(source, budget="64MB", progress=False, kernels="reference").save(tmp_path / "saved")
    with pytest.warns(UserWarning, match="records no weight files"):
        pipe = _load_pipeline(str(root / "pipe"), torch.bfloat16, str(tmp_path / "saved"))
    assert pipe.vae.dtype == torch.float32 and pipe.transformer.dtype == torch.bfloat16
    enable(pipe, budget="64MB", store=str(tmp_path / "saved"), progress=False, kernels="reference")


def test_demo_writes_an_mp4_and_labels_its_runs(work):
    root, jobs = work
    code, out, err = jobs["demo"].result()
    assert code == 0, err
    assert (root / "demo.mp4").read_bytes()[4:8] == b"ftyp"  # an mp4, not a renamed GIF
    assert "reference run (plain bf16, no tritoff)" in err and "tritoff run (fp8_e4m3 packs)" in err
    assert "transformer" in out and "PSNR" in out


def test_demo_refuses_a_small_budget_before_the_reference_run(work):
    root, jobs = work
    code, out, err = jobs["demo-budget"].result()
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err and "reference run" not in err, err
    assert lines[-1].startswith("tritoff: error: budget 1 B is too small") and "pass --budget" in lines[-1]
    assert "--mode" not in lines[-1] and "--prefetch" not in lines[-1]  # the demo has neither option
    assert not (root / "never.gif").exists()


def test_bench_smoke_runs(work):
    code, out, err = work[1]["bench"].result()
    assert code == 0, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line():
    done = subprocess.run([sys.executable, "-m", "tritoff", "bench", "kernels"], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "bench/kernels.py measures a GPU's transfers and kernels, and no CUDA device is here: run it on a GPU, or "
        "with --smoke for tiny packs on the CPU (Triton's interpreter)"
    ]


def test_bad_benchmark_input_is_one_line_before_anything_is_measured(tmp_path):
    # each was a traceback (--out to a file: after the first measurement), or ran the models, then failed
    (tmp_path / "file").write_text("")
    cases = [
        (["e2e", "--smoke", "--budget", "abc"], "e2e.py: error: argument --budget: invalid budget 'abc': give bytes"),
        (["e2e", "--smoke", "--tag", "a/b"], "e2e.py: error: argument --tag: expected letters, digits"),
        (["e2e", "--smoke", "--pipeline", "--steps", "0"], "e2e.py: error: argument --steps: must be an integer >= 1"),
        (["kernels", "--smoke", "--out", str(tmp_path / "file")], f"argument --out: {tmp_path / 'file'} is a file"),
        (["e2e", "--smoke", "--configs", "video@1e400"], "e2e.py: error: --configs: invalid budget '1e400'"),
        # an --out to be made is made at the first write, so a refused run leaves none
        (["e2e", "--smoke", "--out", str(tmp_path / "new"), "--rows", "none"], "e2e.py: error: --rows: unknown row"),
    ]
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "tritoff", "bench", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for argv, _ in cases
    ]
    for child, (argv, message) in zip(started, cases, strict=True):
        out, err = child.communicate(timeout=300)
        assert child.returncode == 2 and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
        assert not out.strip()  # nothing ran
    assert not list(tmp_path.glob("*.json*")) and not (tmp_path / "new").exists()


def _entry_with(tmp_path, command: str):
    """Run the console script's ``entry`` in a child whose command (``main``) is ``command``; (code, out, err)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import atexit, os, signal, sys\n"
        "from tritoff import cli, console\n"
        f"atexit.register(lambda: open({str(tmp_path / 'exited')!r}, 'w').close())\n"
        f"def main(argv=None):\n    {command}\n"
        "cli.main = main\n"
        "cli.entry()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_the_console_script_exits_with_the_commands_code_its_output_flushed_and_exit_handlers_run(tmp_path):
    code, out, err = _entry_with(tmp_path, "sys.stdout.write('no newline, still buffered'); return 3")
    assert (code, out, err) == (3, "no newline, still buffered", "")
    assert (tmp_path / "exited").exists()


def test_an_interrupt_once_the_command_has_ended_exits_130_in_one_line(tmp_path):
    """A Ctrl-C in the moments after a command's last line (Python used to spend ~2 s tearing down torch, with signals
    no longer handled) exits 130 with one line, not a traceback or a death by the signal."""
    code, out, err = _entry_with(tmp_path, "print('video: v.mp4'); os.kill(os.getpid(), signal.SIGINT); return 0")
    assert (code, out, err) == (130, "video: v.mp4\n", "tritoff: interrupted\n")
    # interrupted inside the command: said once, by the command
    code, out, err = _entry_with(
        tmp_path,
        "console._interrupted = True; print('tritoff: interrupted', file=sys.stderr); "
        "os.kill(os.getpid(), signal.SIGINT)",
    )
    assert (code, err) == (130, "tritoff: interrupted\n")


def test_the_demos_frame_check_reads_the_demos_vae():
    from tritoff import cli
    from tritoff.tiny import WAN_VAE_TINY

    assert cli.DEMO_VAE["temperal_downsample"] == WAN_VAE_TINY["temperal_downsample"]


def test_an_image_to_video_pipeline_runs_from_the_image_given(tmp_path):
    # --image is the first frame of a WanImageToVideoPipeline; without it, or given to a text-to-video pipeline, the
    # command stops in one line before anything is loaded
    from PIL import Image

    from tritoff.tiny import tiny_wan_i2v_pipeline, tiny_wan_pipeline

    tiny_wan_i2v_pipeline().save_pretrained(tmp_path / "i2v")
    tiny_wan_pipeline().save_pretrained(tmp_path / "t2v")
    Image.new("RGB", (24, 24), (200, 60, 30)).save(tmp_path / "first.png")
    (tmp_path / "text.png").write_text("not an image")
    video = ["--frames", "5", "--height", "16", "--width", "16", "--steps", "1", "--device", "cpu"]
    code, out, err = tritoff(
        "run", tmp_path / "i2v", "--prompt", "a fox", "--image", tmp_path / "first.png", *video,
        "--out", tmp_path / "v.gif",
    )  # fmt: skip
    assert code == 0 and (tmp_path / "v.gif").stat().st_size > 0, err
    assert "image_encoder" in out  # its own phase, in the report
    bad = {
        ("i2v", None): "WanImageToVideoPipeline makes a video from an image: give --image PATH",
        ("t2v", "first.png"): "WanPipeline takes no image: leave --image out",
        ("i2v", "text.png"): f"--image {tmp_path / 'text.png'}: cannot read it as an image (",
        ("i2v", "nothing.png"): f"--image {tmp_path / 'nothing.png'}: cannot read it as an image (",
    }
    for (pipe, image), message in bad.items():
        given = ["--image", tmp_path / image] if image else []
        argv = ["run", tmp_path / pipe, "--prompt", "x", *given, *video, "--out", tmp_path / "w.gif"]
        assert_one_line_error(*tritoff(*argv), message)
    assert not (tmp_path / "w.gif").exists()


def test_a_wan22_ti2v_directory_makes_video_from_an_image(tmp_path):
    # Wan 2.2 TI2V-5B is published as a WanPipeline (a timestep per token): given --image, it loads as diffusers'
    # WanImageToVideoPipeline, whose VAE encodes the first frame (the VAE's two calls: encode, then decode)
    import re

    from diffusers import WanPipeline
    from PIL import Image

    from tritoff.tiny import tiny_wan22_ti2v_pipeline

    parts = tiny_wan22_ti2v_pipeline().components
    keep = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    WanPipeline(**{k: parts[k] for k in keep}, expand_timesteps=True).save_pretrained(tmp_path / "ti2v")
    assert json.loads((tmp_path / "ti2v" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    Image.new("RGB", (24, 24), (200, 60, 30)).save(tmp_path / "first.png")
    video = ["--frames", "5", "--height", "32", "--width", "32", "--steps", "1", "--device", "cpu"]
    code, out, err = tritoff(
        "run", tmp_path / "ti2v", "--prompt", "a fox", "--image", tmp_path / "first.png", *video,
        "--out", tmp_path / "v.gif",
    )  # fmt: skip
    assert code == 0 and (tmp_path / "v.gif").stat().st_size > 0, err
    assert re.search(r"^\s+vae\s+resident\s+2\s", out, re.MULTILINE), out


def test_a_cogvideox_pipeline_runs_with_the_prompt_length_its_transformer_takes(tmp_path):
    # the tiny transformer's position table takes 16 prompt tokens, not the pipeline's default 226 (as plan traces
    # it); and its packs upcast through the Triton interpreter, chosen before anything imports triton
    from tritoff.tiny import tiny_cogvideox_pipeline

    tiny_cogvideox_pipeline().save_pretrained(tmp_path / "cog")
    video = ["--frames", "9", "--height", "16", "--width", "16", "--steps", "1", "--device", "cpu"]
    code, out, err = tritoff("run", tmp_path / "cog", "--prompt", "a fox", *video, "--out", tmp_path / "v.gif")
    assert code == 0 and (tmp_path / "v.gif").stat().st_size > 0, err


def test_an_image_is_read_as_it_is_displayed(tmp_path):
    # a photo's EXIF orientation turns it (a portrait taken sideways), 16-bit pixels are scaled to 8 bits, not clipped
    # to white, and what cannot be read (a decompression bomb, a text) is one line
    import numpy as np
    from PIL import Image

    from tritoff import cli

    wide = Image.new("RGB", (64, 32), (10, 200, 30))
    exif = wide.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    wide.save(tmp_path / "turned.jpg", exif=exif)
    assert cli._read_image(str(tmp_path / "turned.jpg")).size == (32, 64)
    ramp = (np.arange(256 * 8, dtype=np.uint32).reshape(8, 256) * 32).astype(np.uint16)  # 0 .. 65504
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    read = np.asarray(cli._read_image(str(tmp_path / "deep.png")))[..., 0].astype(int)
    assert read.min() == 0 and read.max() == 255 and np.abs(read - np.round(ramp / 65535 * 255)).max() <= 1
    Image.new("L", (4, 4)).save(tmp_path / "small.png")
    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = 4  # 16 pixels: more than twice the limit, a bomb
        with pytest.raises(cli.CliError, match=r"^--image .*small\.png: cannot read it as an image \("):
            cli._read_image(str(tmp_path / "small.png"))
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def test_a_vae_config_without_its_class_is_checked_as_the_index_names_it(tmp_path):
    # diffusers loads a VAE by the class model_index.json names: a config.json without _class_name still gets the
    # CogVideoX frame rule (13 frames would make 16); entries that name no component ([null, null], numbers) are none
    from tritoff import cli
    from tritoff.shapes import check_dimensions

    index = {"_class_name": "CogVideoXPipeline", "vae": ["diffusers", "AutoencoderKLCogVideoX"], "some": [0.5, 0.5]}
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "transformer_2": [None, None]}))
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"temporal_compression_ratio": 4}))
    vae, _ = cli._local_configs(tmp_path)
    with pytest.raises(ValueError, match="frames 13 makes 4 latent frames"):
        check_dimensions(vae, {}, frames=13)
    assert cli._check_model(str(tmp_path)) == tmp_path  # no directory asked for "some" or "transformer_2"
    custom = {**index, "_class_name": ["my_pipeline", "MyPipeline"]}  # a pipeline defined in the directory
    (tmp_path / "model_index.json").write_text(json.dumps(custom))
    assert cli._check_model(str(tmp_path)) == tmp_path


def test_a_pipeline_class_that_is_no_class_is_left_to_loading(tmp_path):
    import argparse

    from tritoff import cli

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "logging"}))  # a diffusers module
    cli._check_image(argparse.Namespace(image="x.png"), tmp_path)  # no AttributeError: loading says what is wrong


@pytest.mark.parametrize(
    "pipeline, message",
    [
        ("FluxPipeline", "FluxPipeline's call takes no num_frames: tritoff run runs prompted video pipelines"),
        ("StableVideoDiffusionPipeline", "StableVideoDiffusionPipeline's call takes no prompt: tritoff run runs"),
    ],
)
def test_a_pipeline_that_makes_no_video_or_takes_no_prompt_is_refused_before_loading(tmp_path, pipeline, message):
    # Flux ran its whole denoising loop before failing on its output's missing .frames; SVD failed on prompt=
    import argparse

    from tritoff import cli

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    with pytest.raises(cli.CliError, match=f"^{message}.*call tritoff.enable\\(pipe\\) in Python$"):
        cli._check_image(argparse.Namespace(image="x.png"), tmp_path)
    for video in ("WanPipeline", "CogVideoXPipeline", "WanImageToVideoPipeline", "AnimateDiffPipeline"):
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": video}))
        image = "x.png" if "ImageToVideo" in video else None
        assert cli._check_image(argparse.Namespace(image=image), tmp_path) == video
    # an image-to-video pipeline whose image defaults to None (refused by its call, after the load)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "LTXImageToVideoPipeline"}))
    with pytest.raises(cli.CliError, match="^LTXImageToVideoPipeline makes a video from an image: give --image PATH"):
        cli._check_image(argparse.Namespace(image=None), tmp_path)
    # a pipeline defined in the directory (diffusers' [module, class] form)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": ["pipeline", "MyPipeline"]}))
    with pytest.raises(cli.CliError, match=r"names a custom pipeline \(\['pipeline', 'MyPipeline'\]\): tritoff run"):
        cli._check_image(argparse.Namespace(image=None), tmp_path)

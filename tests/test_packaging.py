"""Regular and editable installs in a clean venv both provide tritoff.kernels, and no top-level kernels."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = (
    "import importlib.util as u, pathlib;"
    "s = u.find_spec('tritoff.kernels');"
    "assert s is not None, 'tritoff.kernels missing';"
    "print(pathlib.Path(s.origin).parent.name, sorted(p.name for p in pathlib.Path(s.origin).parent.glob('*.py')));"
    "assert u.find_spec('kernels') is None, 'a top-level kernels module would shadow Hugging Face kernels'"
)


def _clean_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    return path / "bin" / "python"


def _pip(python: Path, *args: str, cwd: Path) -> None:
    # --no-deps: only tritoff's own files matter here; the build backend (setuptools) comes from the package index
    run = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_install_provides_tritoff_kernels(tmp_path, editable):
    python = _clean_venv(tmp_path / "env")
    if editable:
        _pip(python, "-e", str(ROOT), cwd=tmp_path)
    else:
        wheels = tmp_path / "wheels"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(wheels),
                str(ROOT),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        _pip(python, str(next(wheels.glob("tritoff-*.whl"))), cwd=tmp_path)
    probe = subprocess.run([str(python), "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert "upcast.py" in probe.stdout and "quantize.py" in probe.stdout


@pytest.mark.parametrize("where", ["elsewhere", "tests", "tests/tritoff"])
def test_the_suite_runs_from_any_directory(tmp_path, where):
    # tests/tritoff mirrors the package's name; as a test package it can never shadow the real tritoff
    cwd = tmp_path if where == "elsewhere" else ROOT / where
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/tritoff/test_groups.py")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def _gpu_suite():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_suite


@pytest.mark.parametrize("cwd", ["repository", "elsewhere"])
def test_the_gpu_suites_fallback_without_a_build_backend_provides_tritoff_kernels(tmp_path, cwd):
    # bench/gpu_suite.py falls back to this when `pip install -e .` fails on the GPU machine; run from the repository
    # (as pytest's rootdir puts it first on the path), tritoff/ is found there and must still get kernels/
    make_checkout_importable = _gpu_suite().make_checkout_importable
    site = tmp_path / "not-yet" / "site"  # made by the fallback when no wheel was installed there
    make_checkout_importable(site)
    venv.EnvBuilder(with_pip=False).create(tmp_path / "env")  # no tritoff installed in it
    # from the repository, its own kernels/ is on the path as the current directory, as with any install
    probe = subprocess.run(
        [str(tmp_path / "env" / "bin" / "python"), "-c", PROBE.rpartition(";")[0] if cwd == "repository" else PROBE],
        cwd=ROOT if cwd == "repository" else tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("kernels") and "upcast.py" in probe.stdout


def test_the_fallback_finder_wins_over_another_tritoff_and_keeps_a_shadowed_sitecustomize(tmp_path):
    make_checkout_importable = _gpu_suite().make_checkout_importable
    site, other = tmp_path / "site", tmp_path / "other"
    make_checkout_importable(site)
    (other / "tritoff").mkdir(parents=True)  # an old install of tritoff, after the suite's site on the path
    (other / "tritoff" / "__init__.py").write_text("raise ImportError('the other tritoff')\n")
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE = True\n")
    venv.EnvBuilder(with_pip=False).create(tmp_path / "env")
    probe = subprocess.run(
        [
            str(tmp_path / "env" / "bin" / "python"),
            "-c",
            PROBE + ";import builtins; print(builtins.OTHER_SITECUSTOMIZE)",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{site}:{other}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("kernels") and probe.stdout.split()[-1] == "True"


def test_two_suite_sites_on_the_path_chain_once_and_the_first_wins(tmp_path):
    # two checkouts' sites (or one linked twice): each used to chain to the other until the recursion limit
    gpu_suite = _gpu_suite()
    first, second = tmp_path / "first", tmp_path / "second"
    gpu_suite.make_checkout_importable(first)
    (second).mkdir()
    (second / "sitecustomize.py").write_text(
        gpu_suite.SITECUSTOMIZE.format(where={"tritoff": str(tmp_path / "elsewhere")}), encoding="utf-8"
    )
    (tmp_path / "linked").symlink_to(first)
    venv.EnvBuilder(with_pip=False).create(tmp_path / "env")
    probe = subprocess.run(
        [str(tmp_path / "env" / "bin" / "python"), "-c", PROBE],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{first}:{tmp_path / 'linked'}:{second}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0 and not probe.stderr, probe.stderr
    assert probe.stdout.startswith("kernels")


def test_a_short_part_1_runs_the_gpu_tests_then_the_hooks_and_only_then_the_rest(tmp_path, monkeypatch):
    # a 15-minute session's first call (--budget 210): the installs, then steps taking what they took on the H100
    # (tests 130 s: more than on 2026-11-25, with more GPU tests); the hooks must run whole, the rest in what is left
    gpu_suite = _gpu_suite()
    clock = [1000.0]
    monkeypatch.setattr(gpu_suite.time, "time", lambda: clock[0])
    suite = gpu_suite.Suite(gpu_suite.parse_args(["1", "--budget", "210", "--out", str(tmp_path)]))
    clock[0] += 30  # the installs
    takes = {"pytest gpu": 130, "hooks": 26, "kernels": 60, "pytest opcheck": 34, "pytest rest": 29}
    ran = []

    def step(name, cmd, until, quiet=False):
        until = min(until, suite.deadline)
        if until - clock[0] < gpu_suite.MIN_STEP_S:  # the watchdog's rule, as Suite.step applies it
            ran.append((name, None))
            return {"step": name, "rc": None}
        clock[0] += min(takes[name], until + gpu_suite.GRACE_S - clock[0])
        ran.append((name, until))
        return {"step": name, "rc": 0}

    monkeypatch.setattr(suite, "step", step)
    suite.part1()
    suite.log.close()
    names = [name for name, _ in ran]
    assert names == ["pytest gpu", "hooks", "kernels", "pytest opcheck", "pytest rest"]
    until = dict(ran)
    assert until["pytest gpu"] <= suite.deadline - gpu_suite.HOOKS_S  # the tests leave the hooks their minute
    assert until["hooks"] - (1000 + 30 + 130) >= takes["hooks"]  # which it finished in
    assert until["kernels"] == suite.deadline  # cut at the budget, keeping what it measured
    assert until["pytest opcheck"] is None and until["pytest rest"] is None  # no time left: named as not run


def test_collect_only_runs_no_test_and_fails_a_step_whose_selection_is_empty(tmp_path):
    # CI's part-1 rehearsal: its test steps collect what the test command already ran, and still fail on a selection
    # that a change of markers or paths left empty
    gpu_suite = _gpu_suite()
    suite = gpu_suite.Suite(gpu_suite.parse_args(["1", "--smoke", "--collect-only", "--out", str(tmp_path)]))
    tests = tmp_path / "test_two.py"
    tests.write_text("def test_one():\n    assert False\n\n\ndef test_two():\n    assert False\n")
    suite.pytest("two", [str(tests)], suite.deadline)
    suite.pytest("none", ["-m", "gpu", str(tests)], suite.deadline)
    assert suite.finish() == 1
    record = json.loads((tmp_path / "suite-part1-smoke.json").read_text())
    assert [s["rc"] for s in record["steps"]] == [0, 5]
    assert record["tests"] == {
        "two": {"note": "collected, none run (--collect-only)"},
        "none": {"note": "not collected (see the log)"},
    }
    assert not list(tmp_path.glob("tests-*.xml"))  # no junit report: no test ran (both would fail)
    assert "test_two.py: 2" in (tmp_path / "suite-part1-smoke.log").read_text()  # the per-file counts

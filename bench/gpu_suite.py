"""The GPU suite: one command that a bare GPU machine runs, part by part, each part ending well inside 9 minutes.

It installs what the machine lacks (the wheels pinned in bench/gpu_wheels.txt, from a wheel directory, with
``pip --no-index`` into a target directory put on PYTHONPATH; tritoff itself with
``pip install --no-deps --no-build-isolation -e .``), runs the part's steps as child processes, writes JSON into the
output directory and prints a summary table with the issue's targets last (the run tool returns the output's tail).

Parts (issue 8):
  1  most needed first: every GPU-marked test (junit XML, summarized in suite-part1.json), bench/hooks.py
     (hooks-cuda.json: host time in the block hooks), bench/kernels.py (kernels.json: 1 MB .. 1 GB packs, staged and
     zero-copy, beside the H2D memcpy and device-to-device rooflines), opcheck of the custom ops on CUDA, then the
     other tests that take the device fixture (the kernels against their references) on CUDA
  2  bench/e2e.py, Wan-14B transformer: 480x832x81 and 1 frame under a 12 GB cap, 480x832x81 under 8 GB
  3  bench/e2e.py, CogVideoX-5B transformer at 480x720x49, and the whole Wan pipeline at 12 GB
  4  bench/e2e.py --compile, Wan-14B at 480x832x81 under 12 GB: regional compile, all-resident and tritoff
  setup  the installs alone, for running one benchmark by hand in the same command

A session lent 15 minutes of device time runs two parts, or re-runs some rows of one (``--rows``) and then a part:
docs/benchmarks.md, "A 15-minute session", says which.

Watchdog: the part has a time budget (--budget, default 480 s from the start of the command). Each step gets a
deadline inside it and is told so (--deadline): the benchmarks start no measurement that would end after it and
rewrite their JSON after every measurement. A step still running at its deadline (plus a short grace) is stopped
(SIGTERM, then SIGKILL), keeping what it wrote.

Usage: bench/gpu_suite.sh PART [--smoke] [--collect-only] [--out DIR] [--wheels DIR] [--budget SECONDS] [--rows KINDS]
  --smoke: tiny shapes on the CPU (Triton's interpreter): the rehearsal. --collect-only: part 1's test steps collect
  their tests and run none (CI, whose test command runs them in the same environment). --out: default $OUT when set,
  else out/gpu-suite. --wheels: default .whl when it exists. --rows: parts 2-4 measure only these row kinds
  (bench/rows.py), to re-run rows without the others (name resident too: the others are compared with it).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import COMPILE_ROWS, PIPELINE_ROWS, TRANSFORMER_ROWS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
# where carried wheels are installed: one directory per interpreter (a wheel built for another Python must never
# shadow this one's packages); a warm machine keeps it between calls
SITE = Path(
    os.environ.get("TRITOFF_SUITE_SITE")
    or f"/tmp/tritoff-suite-site-py{sys.version_info[0]}{sys.version_info[1]}-"
    + hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
)
GRACE_S = 15  # after a step's deadline, before it is stopped: time to finish writing
MIN_STEP_S = 10  # a step with less time than this before its deadline is not started, and is named as not run
HOOKS_S = 60  # part 1's hooks step (26 s on the H100, 2026-11-25)
# What each part is expected to take on an H100 (estimates from FLOP counts and transfer sizes; see
# docs/benchmarks.md): printed first, and the measured time is printed beside it at the end.
ESTIMATES = {
    "1": "~4 min: GPU tests ~2 min (Triton compiles), hooks ~30 s, kernels 1-2 min (packs built on the GPU), opcheck "
    "~30 s, then the other tests that take the device fixture (kernels against their references) on CUDA",
    "2": "~6.5 min: Wan-14B forward ~4-6 s at 480x832x81, a warm-up and 3 timed per row; 3 tables x 7 rows, one build "
    "per row kind (~1 s on the GPU), two tritoff packs (~15 s), diffusers offload setups ~20 s each; last, the "
    "host-budget row (writes ~10 GB of spill, reads ~10 GB per forward from disk), which the budget may cut",
    "3": "~6 min: CogVideoX-5B table ~1.5 min; Wan pipeline 5 rows x (build ~3 s, setup <= 30 s, 2 CFG steps "
    "~20 s, tiled VAE decode)",
    "4": "~4 min: two regional compiles (~1 min each; dynamo reset before each) and four rows at 480x832x81",
    "setup": "~15 s: the installs alone (then run any benchmark with PYTHONPATH=$TRITOFF_SUITE_SITE)",
}


def parse_args(argv=None):
    """The command line: the part, ``--smoke``, ``--collect-only``, ``--out``, ``--wheels`` and ``--budget``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=sorted(ESTIMATES))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: rehearse the part")
    parser.add_argument(
        "--collect-only", action="store_true", help="part 1's test steps collect their tests and run none (CI)"
    )
    parser.add_argument("--out", default=None, help="output directory (default $OUT, else out/gpu-suite)")
    parser.add_argument("--wheels", default=None, help="wheel directory (default .whl when it exists)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole part (default 480)")
    parser.add_argument(
        "--rows",
        default=None,
        help="parts 2-4: only these row kinds (comma-separated), each table taking those it has; name resident too, "
        "the row the others are compared with",
    )
    args = parser.parse_args(argv)
    if args.rows is not None:
        args.rows = [kind.strip() for kind in args.rows.split(",") if kind.strip()]
        known = dict.fromkeys(TRANSFORMER_ROWS + COMPILE_ROWS + PIPELINE_ROWS)
        unknown = [kind for kind in args.rows if kind not in known]
        if not args.rows:
            parser.error(f"--rows: name at least one row kind: {', '.join(known)}")
        if unknown:
            parser.error(f"--rows: unknown row kind {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
        if args.part not in ("2", "3", "4"):
            parser.error(f"--rows: part {args.part} measures no e2e rows; it is for parts 2, 3 and 4")
    return args


class Suite:
    """One part's run: setup, steps under a watchdog, JSON and a summary."""

    def __init__(self, args):
        self.args = args
        self.start = time.time()
        self.deadline = self.start + args.budget
        default_out = os.environ.get("OUT") or str(REPO / "out" / "gpu-suite")
        self.out = Path(args.out or default_out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        suffix = "-smoke" if args.smoke else ""
        self.name = f"suite-part{args.part}{suffix}"
        self.log = open(self.out / f"{self.name}.log", "w")  # closed in finish()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.record: dict = {"part": args.part, "smoke": args.smoke, "estimate": ESTIMATES[args.part], "steps": []}
        self.smoke = args.smoke
        self.suffix = suffix

    # output -------------------------------------------------------------------------------------------------------
    def say(self, text: str = "") -> None:
        """Print ``text`` and append it to the part's log."""
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def left(self) -> float:
        """Seconds left before the part's deadline."""
        return self.deadline - time.time()

    # setup --------------------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Wheels whose pinned version is missing, then tritoff (editable) unless this checkout is importable."""
        started = time.time()
        pins = {}
        for line in (BENCH / "gpu_wheels.txt").read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[name] = version
        if SITE.is_dir():  # a warm machine keeps what an earlier call installed
            sys.path.insert(0, str(SITE))
            importlib.invalidate_caches()
            self.put_site_on_path()
        other = {n: v for n, v in pins.items() if _installed(n) != v}
        self.record["wheels_pinned"] = pins
        wheels_dir = Path(self.args.wheels) if self.args.wheels else REPO / ".whl"
        wheels, missing = [], {}
        for name, version in other.items():
            stem = re.sub(r"[-_.]+", "_", name).lower()
            found = [w for w in wheels_dir.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
            if found:
                wheels.append(str(found[0]))
                missing[name] = version
            elif _installed(name):  # another version is there and none was carried: use it (CI, a dev venv)
                self.say(f"{name} {_installed(name)} is installed (pinned: {version}, no wheel in {wheels_dir})")
            else:
                raise SystemExit(
                    f"{name}=={version} is not installed and no wheel for it is in {wheels_dir}: "
                    "run bench/fetch_wheels.sh where PyPI is reachable and carry .whl"
                )
        if missing:
            self.say(f"installing {', '.join(f'{n}=={v}' for n, v in missing.items())} into {SITE}")
            self.run_quiet(
                [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
                + ["--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels]
            )
            self.put_site_on_path()
        self.record["wheels_installed"] = missing
        if not self.imports_this_checkout():  # tritoff.kernels maps to kernels/ only through an install
            self.say("installing tritoff from this checkout (pip install --no-deps --no-build-isolation -e .)")
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO)]
            installed = self.run_quiet(cmd, fatal=False)
            if not installed or not self.imports_this_checkout():
                # a build backend that cannot make editable installs (setuptools < 64, no wheel), or a finder another
                # checkout left in the site directory, must not cost the part: a finder for this one
                why = "failed (see the log)" if not installed else "is shadowed"
                self.say(f"the editable install {why}: a finder in {SITE} maps tritoff to this checkout")
                make_checkout_importable(SITE)
                self.put_site_on_path()
            if not self.imports_this_checkout():
                raise SystemExit(f"tritoff still imports from elsewhere than {REPO}: the part would test other code")
        self.record["install_s"] = time.time() - started
        versions = subprocess.run(
            [sys.executable, "-c", f"import sys, json; sys.path.insert(0, {str(BENCH)!r}); "
             "from common import environment; print(json.dumps(environment()))"],
            env=self.env, capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        if versions.returncode:
            self.say(versions.stderr[-2000:])
            raise SystemExit("the environment does not import (see above)")
        self.record["environment"] = env = json.loads(versions.stdout.strip().splitlines()[-1])
        keys = ("device", "driver", "python", "torch", "triton", "transformers", "diffusers", "accelerate")
        self.say(" | ".join(f"{k} {env.get(k)}" for k in keys) + f" | setup {self.record['install_s']:.0f} s")

    def put_site_on_path(self) -> None:
        """Put the site directory (carried wheels, the fallback finder) first on the steps' PYTHONPATH, once."""
        if str(SITE) not in self.env.get("PYTHONPATH", ""):
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), self.env.get("PYTHONPATH")]))

    def imports_this_checkout(self) -> bool:
        """Whether the steps' Python imports tritoff and tritoff.kernels from this checkout."""
        probe = "import json, tritoff, tritoff.kernels; print(json.dumps([tritoff.__file__, tritoff.kernels.__file__]))"
        # run away from the checkout: there, the working directory's tritoff/ would be imported whatever the install
        with tempfile.TemporaryDirectory(prefix="tritoff-suite-") as away:
            out = subprocess.run(
                [sys.executable, "-c", probe], env=self.env, capture_output=True, text=True, cwd=away
            ).stdout.splitlines()
        try:  # the last line: a sitecustomize may print before it
            where = json.loads(out[-1]) if out else []
        except json.JSONDecodeError:
            return False
        return [Path(w).resolve().parent for w in where] == [REPO / "tritoff", REPO / "kernels"]

    def run_quiet(self, cmd: list[str], fatal: bool = True) -> bool:
        """Run ``cmd``, its output to the log; on failure end the part (``fatal``) or return False."""
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, cwd=REPO)
        self.log.write(done.stdout + done.stderr)
        if done.returncode and fatal:
            self.say(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"failed: {' '.join(cmd)}")
        return done.returncode == 0

    # steps --------------------------------------------------------------------------------------------------------
    def step(self, name: str, cmd: list[str], until: float, quiet: bool = False) -> dict:
        """Run ``cmd`` until ``until`` (epoch seconds, within the part's deadline) plus a grace; log its output."""
        until = min(until, self.deadline)
        entry = {"step": name, "command": " ".join(cmd), "budget_s": round(until - time.time())}
        if until - time.time() < MIN_STEP_S:
            entry.update(rc=None, wall_s=0.0, note="not run: the part's time budget ran out")
            self.say(f"\n== {name}: not run, the part's time budget ran out")
            self.record["steps"].append(entry)
            return entry
        self.say(f"\n== {name} (budget {entry['budget_s']} s): {' '.join(cmd)}")
        started = time.time()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        tail = ""
        timed_out = False
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)  # progress bars print no newline: read what is there, never wait for a line
        while True:
            if time.time() > until + GRACE_S and proc.poll() is None and not timed_out:
                timed_out = True
                self.say(f"== {name}: past its deadline, stopping it")
                _stop(proc)
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                if timed_out and proc.poll() is not None:
                    break  # stopped, yet something outside its group holds the pipe open: no end of output comes
                continue
            chunk = os.read(fd, 1 << 16).decode(errors="replace")
            if not chunk:  # end of output
                try:
                    proc.wait(timeout=max(1.0, until + GRACE_S - time.time()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _stop(proc)
                break
            self.log.write(chunk)
            if quiet:
                tail = (tail + chunk)[-4000:]
            else:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        proc.wait()
        self.log.flush()
        if quiet:
            print("\n".join(tail.splitlines()[-15:]), flush=True)
        entry.update(rc=proc.returncode, wall_s=time.time() - started, timed_out=timed_out)
        self.say(f"== {name}: exit {proc.returncode}{' (stopped)' if timed_out else ''} in {entry['wall_s']:.0f} s")
        self.record["steps"].append(entry)
        return entry

    def pytest(self, name: str, args: list[str], until: float, quiet: bool = False) -> None:
        """Run pytest with ``args`` as step ``name``, its junit XML summarised into the record."""
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
        if self.args.collect_only:  # a file per line; pytest exits 5 where the selection is empty
            entry = self.step(f"pytest {name}", [*cmd, "-qq", "--collect-only", *args], until)
            done = "collected, none run (--collect-only)" if entry["rc"] == 0 else "not collected (see the log)"
            self.record.setdefault("tests", {})[name] = {"note": entry.get("note") or done}
            return
        xml = self.out / f"tests-{name}{self.suffix}.xml"
        cmd += ["-v", "-rfE", f"--junitxml={xml}", *args]
        entry = self.step(f"pytest {name}", cmd, until, quiet)
        self.record.setdefault("tests", {})[name] = _junit(xml) if xml.exists() else {"note": entry.get("note")}

    def e2e(self, name: str, args: list[str], until: float, kinds=TRANSFORMER_ROWS) -> None:
        """Run bench/e2e.py as step ``name`` over the row kinds of ``--rows`` it has among ``kinds`` (all of them
        without ``--rows``); a table with none of them is named as not run."""
        if self.args.rows is not None:
            rows = [kind for kind in kinds if kind in self.args.rows]
            if not rows:
                self.say(f"== {name}: not run, --rows names none of its rows ({', '.join(kinds)})")
                note = "not run: --rows names none of its rows"
                self.record["steps"].append({"step": name, "rc": None, "wall_s": 0.0, "note": note})
                return
            args = [*args, "--rows", ",".join(rows)]
        self.python(name, "e2e.py", [*(["--smoke"] if self.smoke else []), *args], until)

    def python(self, name: str, script: str, args: list[str], until: float) -> dict:
        """Run ``bench/<script>`` as step ``name``, told to start nothing after ``until`` (and the part's deadline)."""
        deadline = min(until, self.deadline) - 5
        return self.step(name, [sys.executable, str(BENCH / script), *args, "--deadline", f"{deadline:.0f}"], until)

    # parts --------------------------------------------------------------------------------------------------------
    def part1(self) -> None:
        """GPU tests, hook and kernel benchmarks, opcheck, then the kernels against their references: most needed first,
        so a short ``--budget`` (a 15-minute session's first call) still runs the tests and the hooks."""
        timeout = ["--timeout=300"] if _has("pytest_timeout") else []
        # the tests leave the hooks their time: the two figures a short part must not lose
        self.pytest("gpu", ["-m", "gpu", *timeout, "tests"], min(time.time() + 150, self.deadline - HOOKS_S))
        smoke = ["--smoke"] if self.smoke else []
        self.python("hooks", "hooks.py", [*smoke, "--out", str(self.out)], time.time() + HOOKS_S)
        self.python("kernels", "kernels.py", [*smoke, "--out", str(self.out)], time.time() + 200)
        self.pytest("opcheck", [*timeout, "tests/kernels/test_custom_ops.py"], time.time() + 90)
        # the other tests that run on the GPU when there is one (the kernels against their references); the rest
        # compare with references computed on the CPU, which CUDA's matmuls do not reproduce bit for bit
        per_test = ["--timeout=120"] if timeout else []
        rest = ["-m", "on_device and not gpu", "--ignore", "tests/kernels/test_custom_ops.py", *per_test, "tests"]
        self.pytest("rest", rest, self.deadline - 10, quiet=True)

    def part2(self) -> None:
        """Wan-14B transformer tables: video and 1 frame at 12 GB, video at 8 GB."""
        configs = "video@5MB,image@5MB,video@4.5MB" if self.smoke else "video@12GB,image@12GB,video@8GB"
        # 3 timed forwards: the median of two is their mean, and 2% is the verdict's margin
        args = ["--model", "wan", "--configs", configs, "--reps", "3", "--out", str(self.out)]
        self.e2e("e2e wan", args, self.deadline)

    def part3(self) -> None:
        """CogVideoX-5B transformer table, then the whole Wan pipeline at 12 GB."""
        cog = ["--model", "cogvideox", "--configs", "video@5MB" if self.smoke else "video@12GB", "--reps", "3"]
        self.e2e("e2e cogvideox", [*cog, "--out", str(self.out)], time.time() + 0.35 * self.left())
        pipe = ["--pipeline", "--model", "wan", "--budget", "4.6MB" if self.smoke else "12GB", "--steps", "2"]
        self.e2e("e2e wan pipeline", [*pipe, "--out", str(self.out)], self.deadline, PIPELINE_ROWS)

    def part4(self) -> None:
        """Wan-14B video at 12 GB with and without regional compile."""
        kinds = ("resident", "resident-compile", "tritoff-group", "tritoff-group-compile")
        args = ["--model", "wan", "--configs", "video@5MB" if self.smoke else "video@12GB"]
        args += ["--tag", "compile", "--reps", "3", "--out", str(self.out)]
        if self.args.rows is None:
            args += ["--rows", ",".join(kinds)]
        self.e2e("e2e wan compile", args, self.deadline, kinds)

    # summary ------------------------------------------------------------------------------------------------------
    def finish(self) -> int:
        """Write the part's JSON and print its summary; the exit status."""
        self.record["wall_s"] = time.time() - self.start
        lines = summary_lines(self.record, self.out, self.suffix)
        self.record["summary"] = lines
        path = self.out / f"{self.name}.json"
        path.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        self.say("\n" + "\n".join(lines))
        self.say(f"\nestimated: {ESTIMATES[self.args.part]}")
        self.say(f"part {self.args.part} took {self.record['wall_s']:.0f} s; JSON and log in {self.out}")
        self.log.close()
        bad = [s for s in self.record["steps"] if s.get("rc") not in (0, None) or s.get("timed_out")]
        failed_tests = [n for t in self.record.get("tests", {}).values() for n in t.get("failed", [])]
        return 1 if bad or failed_tests else 0


SITECUSTOMIZE = """\
import importlib.machinery
import importlib.util
import os
import sys

WHERE = {where!r}


class TritoffCheckout:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in WHERE:
            init = os.path.join(WHERE[name], "__init__.py")
            return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[WHERE[name]])


if not getattr(sys, "_tritoff_checkout_finder", False):  # the first on the path wins; a chained one stands aside
    sys._tritoff_checkout_finder = True
    # the sitecustomize this one shadows (a distribution's) still runs: the next one on the path after this directory
    _here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    _real = [os.path.realpath(p or os.curdir) for p in sys.path]
    _i = _real.index(_here) + 1 if _here in _real else len(_real)
    _after = [p for p, r in zip(sys.path[_i:], _real[_i:]) if r != _here]
    _next = importlib.machinery.PathFinder.find_spec("sitecustomize", _after)
    if _next is not None and _next.loader is not None:
        _next.loader.exec_module(importlib.util.module_from_spec(_next))
    sys.meta_path.insert(0, TritoffCheckout)  # before any installed tritoff
"""


def make_checkout_importable(site: Path) -> None:
    """Make this checkout importable without a build backend, as an editable install does: a ``sitecustomize`` in
    ``site`` (imported at the start of every Python with ``site`` on PYTHONPATH) puts first a finder that maps
    ``tritoff`` to tritoff/ and ``tritoff.kernels`` to kernels/, and puts no top-level ``kernels`` on the path."""
    where = {"tritoff": str(REPO / "tritoff"), "tritoff.kernels": str(REPO / "kernels")}
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(where=where), encoding="utf-8")


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, then SIGKILL what is left after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _junit(path: Path) -> dict:
    """Counts, and the names and first message lines of failed tests, from a junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, skipped, passed = [], [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failed.append(f"{name}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
        elif case.find("skipped") is not None:
            skipped.append(f"{name}: {(case.find('skipped').get('message') or '')[:120]}")
        else:
            passed.append(name)
    counts["passed"] = len(passed)
    return {**counts, "failed": failed, "skipped_tests": skipped, "passed_tests": passed}


def _load(out: Path, name: str, suffix: str, since: float) -> dict | None:
    path = out / f"{name}{suffix}.json"
    return json.loads(path.read_text()) if path.exists() and path.stat().st_mtime >= since else None


def _fresh(out: Path, pattern: str, suffix: str, since: float) -> list[Path]:
    """This part's JSON files named ``pattern``: smoke results only in a smoke run, none older than the part."""
    paths = sorted(out.glob(f"{pattern}{suffix}.json"))
    return [p for p in paths if not (suffix == "" and p.stem.endswith("-smoke")) and p.stat().st_mtime >= since]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def summary_lines(record: dict, out: Path, suffix: str) -> list[str]:
    """The part's summary: step outcomes, test counts, and each measured figure beside its target."""
    lines = ["## summary", "", "| step | exit | s | note |", "|---|---|---|---|"]
    for s in record["steps"]:
        note = s.get("note") or ("stopped at its deadline" if s.get("timed_out") else "")
        lines.append(f"| {s['step']} | {s.get('rc')} | {s.get('wall_s', 0):.0f} | {note} |")
    for name, t in record.get("tests", {}).items():
        if "tests" in t:
            lines.append(
                f"\ntests {name}: {t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
            )
            lines += [f"  FAILED {f}" for f in t["failed"]]
        else:
            lines.append(f"\ntests {name}: {t.get('note') or 'no report (stopped)'}")
    since = record.get("_start", 0)  # the output directory may hold an earlier part's files
    kernels = _load(out, "kernels", suffix, since)
    if kernels:
        lines += [
            "",
            "| pack MiB | H2D fp8 GB/s | staged % | staged, streamed % | zero-copy % | HBM upcast % of D2D | exact "
            "| targets |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in kernels["sizes"]:
            roof = r["a_h2d_fp8"]["wire_GBps"]
            staged = 100 * r["c_staged"]["wire_GBps"] / roof
            streamed = 100 * r["c2_staged_streamed"]["wire_GBps"] / roof if "c2_staged_streamed" in r else None
            zc = 100 * r["d_zero_copy"]["wire_GBps"] / roof if "d_zero_copy" in r else None
            d2d = r.get("hbm_d2d", {}).get("GBps_read_plus_write")
            up = 100 * r["f_hbm_upcast"]["GBps_read_plus_write"] / d2d if d2d else None
            big = r["pack_bytes"] >= 32 * 2**20
            onload = _verdict(staged >= 95 and (zc is None or zc >= 95)) if big else "-"
            onload_streamed = _verdict(None if streamed is None else streamed >= 95) if big else "-"
            lines.append(
                f"| {r['pack_bytes'] / 2**20:.0f} | {roof:.1f} | {staged:.0f} | {_percent(streamed)} | {_percent(zc)} "
                f"| {_percent(up)} | {r['exact']} | onload >= 95%: {onload} (streamed: {onload_streamed}); "
                f"upcast >= 80%: {_verdict(None if up is None else up >= 80)} |"
            )
        swept = [r for r in kernels["sizes"] if r.get("f_hbm_upcast_GBps_by_config") and r.get("hbm_d2d")]
        if swept:  # the largest pack: HBM upcast % of D2D by elements x warps per program
            r = swept[-1]
            cells = ", ".join(
                f"{config}: {100 * rate / r['hbm_d2d']['GBps_read_plus_write']:.0f}%"
                for config, rate in r["f_hbm_upcast_GBps_by_config"].items()
            )
            size = f"{r['pack_bytes'] / 2**20:.0f} MiB"
            lines.append(f"HBM upcast % of D2D by elements x warps per program, {size} pack: {cells}")
            if "f_hbm_upcast_wide_code_loads_GBps" in r:  # the A/B of kernels.upcast.CODE_LOAD_BYTES
                wide = 100 * r["f_hbm_upcast_wide_code_loads_GBps"] / r["hbm_d2d"]["GBps_read_plus_write"]
                lines.append(f"HBM upcast with 16-byte code loads (through shared memory), {size}: {wide:.0f}% of D2D")
            if "hbm_cast_torch" in r:  # the upcast's mix of one byte read to two written, in a plain elementwise kernel
                cast = r["hbm_cast_torch"]["GBps_read_plus_write"]
                lines.append(
                    f"PyTorch's fp8->bf16 cast, {size}: {100 * cast / r['hbm_d2d']['GBps_read_plus_write']:.0f}% of "
                    f"D2D; the upcast reaches {100 * r['f_hbm_upcast']['GBps_read_plus_write'] / cast:.0f}% of it"
                )
        if "overlap_351MB" in kernels:
            ov = kernels["overlap_351MB"]
            lines.append(
                f"matmul slowdown while onloading 351 MB packs: staged {ov['slowdown_staged_pct']:.1f}%, "
                f"zero-copy {ov['slowdown_zero_copy_pct']:.1f}%"
            )
        beside = kernels.get("upcast_beside_compute", {})
        if beside.get("grids"):  # programs x elements x warps: the grid for kernels.upcast.UPCAST_PROGRAMS
            lines.append(
                f"a block's matmuls at 1 frame, {1e3 * beside['compute_alone_s_per_block']:.2f} ms alone, with the "
                "next pack's HBM upcast beside them, by grid (programs x elements x warps; 0: one per chunk): "
                + ", ".join(
                    f"{name} {r['slowdown_pct']:+.1f}% (upcast alone {r['upcast_alone_GBps']:.0f} GB/s"
                    + ("" if r["exact"] else ", NOT EXACT")
                    + ")"
                    for name, r in beside["grids"].items()
                )
            )
        elif beside.get("error"):
            lines.append(f"upcast beside compute failed: {beside['error']}")
        by_row_length = kernels.get("upcast_by_row_length", {}).get("rows", {})
        if by_row_length:  # how a program finds its rows' scales: a gather per element, or scalars
            lines.append(
                "HBM upcast of one weight by row length (scales): "
                + ", ".join(
                    f"{row_len} ({r['path']}) {r['GBps_read_plus_write']:.0f} GB/s"
                    + (f", {r['pct_of_d2d']:.0f}% of D2D" if "pct_of_d2d" in r else "")
                    + ("" if r["exact"] else ", NOT EXACT")
                    for row_len, r in by_row_length.items()
                )
            )
        elif kernels.get("upcast_by_row_length_error"):
            lines.append(f"HBM upcast by row length failed: {kernels['upcast_by_row_length_error']}")
    for path in _fresh(out, "hooks-*", suffix, since):
        hooks = json.loads(path.read_text())
        issue, added = hooks.get("issue_us_per_group"), hooks.get("added_us_per_group")
        lines.append(
            f"\nhost time in block hooks ({hooks['config']['device']}): {hooks['hook_us_per_group']:.1f} us per group, "
            + ("" if added is None else f"{added:.1f} us added to a forward per group (wrappers included), ")
            + f"param swaps alone {hooks['swap_us_per_group']:.1f} us"
            + ("" if issue is None else f", issuing one transfer alone {issue:.1f} us")
            + f"; <= 20 us: {_verdict(hooks['met'])}"
        )
        if hooks.get("issue_steps_us"):
            lines.append(
                "issuing one chunk, step by step (us): "
                + ", ".join(
                    f"{name} {us:.1f}" if isinstance(us, float) else f"{name}: {us}"
                    for name, us in hooks["issue_steps_us"].items()
                )
            )
        profile = hooks.get("profile") or {}
        if profile.get("error"):
            lines.append(f"profile in place failed: {profile['error']}")
        elif profile.get("top"):
            lines.append(
                "in place under cProfile, own us per group: "
                + ", ".join(f"{row['function']} {row['self_us']:.1f}" for row in profile["top"][:10])
            )
    for path in _fresh(out, "e2e-*", suffix, since):
        lines += ["", *e2e_lines(path.stem, json.loads(path.read_text()))]
    env = record.get("environment", {})
    lines.append(
        f"\ndevice {env.get('device')}, driver {env.get('driver')}, torch {env.get('torch')}, "
        f"triton {env.get('triton')}, diffusers {env.get('diffusers')}, transformers {env.get('transformers')}"
    )
    return lines


def e2e_lines(name: str, data: dict) -> list[str]:
    """One e2e table with its targets: time against resident, peak against the cap, host RSS against the packs."""
    budget = data["budget_bytes"]
    image = data.get("shape_name") == "image" or data["shape"][0] == 1
    pipeline = name.startswith("e2e-pipeline")
    lines = [
        f"{name}: {data['model']} {'x'.join(map(str, data['shape']))}, cap {budget / 1e9:.3g} GB"
        + (f", H2D {data['h2d_GBps']:.1f} GB/s" if data.get("h2d_GBps") else ""),
        "| row | s | x resident | rel err | peak GiB | <= budget | RSS +GiB | build s | setup s | hook us | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        secs = r.get("denoise_s_per_step" if pipeline else "seconds_per_forward")
        ratio = r.get("step_ratio_to_resident" if pipeline else "ratio_to_resident")
        rss = r["host_rss_bytes"] - r["host_rss_baseline_bytes"] if "host_rss_baseline_bytes" in r else None
        target = ""
        if r["kind"] == "tritoff-disk" and secs is not None:
            # packs beyond the host budget read from disk: memory held against the budget, the cost against RAM
            checks = [f"{r.get('disk_bytes_per_forward', 0) / 2**20:.1f} MiB/fwd from disk"]
            if r.get("slowdown_vs_all_packs_in_ram"):
                checks.append(f"x{r['slowdown_vs_all_packs_in_ram']:.3f} vs all packs in RAM")
            if rss is not None and r.get("host_held_bytes") is not None:
                checks.append(f"RSS <= 1.1x held + ring: {_verdict(rss <= 1.1 * r['host_held_bytes'])}")
            target = "; ".join(checks)
        elif r["kind"].startswith("tritoff") and secs is not None:
            checks = []
            if image and r.get("ratio_to_transfer_bound"):
                checks.append(f"<= 1.1x transfer bound: {_verdict(r['ratio_to_transfer_bound'] <= 1.1)}")
            elif ratio and not pipeline and data["budget_bytes"] >= 12e9:
                checks.append(f"<= 1.02x resident: {_verdict(ratio <= 1.02)}")
            if r.get("packed_bytes") and rss is not None:
                checks.append(f"RSS <= 1.1x packs: {_verdict(rss <= 1.1 * r['packed_bytes'])}")
            if r.get("hook_us_per_group"):
                checks.append(f"hooks <= 20 us: {_verdict(r['hook_us_per_group'] <= 20)}")
            target = "; ".join(checks)
        cells = [
            r["row"],
            f"{secs:.3f}" if secs is not None else (r.get("note") or "-")[:90],
            f"{ratio:.3f}" if ratio else "-",
            f"{r['rel_err_vs_resident']:.1e}" if "rel_err_vs_resident" in r else "-",
            f"{r['peak_vram_bytes'] / 2**30:.2f}" if r.get("peak_vram_bytes") else "-",
            _verdict(r.get("peak_within_budget")),
            f"{rss / 2**30:.2f}" if rss is not None else "-",
            f"{r['build_s']:.1f}" if "build_s" in r else "-",
            f"{r['setup_s']:.1f}" if "setup_s" in r else "-",
            f"{r['hook_us_per_group']:.1f}" if r.get("hook_us_per_group") else "-",
            target,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    """Run one part of the suite; its exit status."""
    args = parse_args(argv)
    suite = Suite(args)
    suite.record["_start"] = suite.start
    suite.say(f"tritoff GPU suite, part {args.part}{' (smoke)' if args.smoke else ''}: budget {args.budget:.0f} s")
    suite.say(f"estimated on an H100: {ESTIMATES[args.part]}")
    suite.install()
    if args.part == "setup":
        print(f"installed; run benchmarks with PYTHONPATH={SITE} (set TRITOFF_SUITE_SITE to choose the directory)")
        return 0
    getattr(suite, f"part{args.part}")()
    return suite.finish()


if __name__ == "__main__":
    sys.exit(main())

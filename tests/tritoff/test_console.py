"""A command as a process (tritoff.console): warnings and errors in one line, on a line of their own after a progress
bar, interrupts that stop the command wherever they land, and the caller's streams and hooks given back."""

import io
import signal
import sys
import time
import warnings

import pytest

from tritoff import console
from tritoff.warn import TritoffWarning, warn


def test_a_warning_made_an_error_is_one_line(capsys):
    """``python -W error``: a warning tritoff raises ends the command in one line, not a traceback."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert console.run_command(lambda args: warn("spilling to a tmpfs saves no memory") or 0, None) == 1
    expected = "tritoff: error: spilling to a tmpfs saves no memory (a warning, made an error by -W error)\n"
    assert capsys.readouterr().err == expected


@pytest.mark.parametrize("end", ["interrupted", "error"])
def test_a_message_after_a_progress_bar_starts_a_line_of_its_own(capsys, end):
    # a bar redraws its line after a carriage return and ends it only when closed: interrupted before it is (a
    # signal landing between the bar's first draw and the block that closes it), the one-line message went on from
    # the bar's text ("packing vae:   0%|          | 0/9 [00:00<?, ?it/s]tritoff: interrupted")
    def packing(args):
        sys.stderr.write("\rpacking vae:   0%|          | 0/9 [00:00<?, ?it/s]")  # what a bar draws
        if end == "interrupted":
            raise KeyboardInterrupt
        raise console.CliError("the disk is full")

    code = console.run_command(packing, None)
    lines = capsys.readouterr().err.split("\n")
    assert len(lines) == 3 and "packing vae" in lines[0] and lines[-1] == ""
    assert lines[1] == ("tritoff: interrupted" if end == "interrupted" else "tritoff: error: the disk is full")
    assert code == (console.EXIT_INTERRUPTED if end == "interrupted" else 2)


def test_a_warning_during_a_progress_bar_starts_a_line_of_its_own(monkeypatch):
    format_warning = console._format_warning
    monkeypatch.setattr(sys, "stderr", console.Output(io.StringIO()))
    assert format_warning("a", TritoffWarning, "x.py", 3) == "tritoff: warning: a\n"
    sys.stderr.write("\rpacking vae:  11%|#1        | 1/9")
    assert format_warning("a", TritoffWarning, "x.py", 3) == "\ntritoff: warning: a\n"
    assert format_warning("c", UserWarning, "x.py", 3, "") == "\nx.py:3: UserWarning: c\n"
    sys.stderr.write("\r" + " " * 40 + "\r")  # a bar closed with leave=False clears its line: no blank line after it
    assert format_warning("a", TritoffWarning, "x.py", 3) == "tritoff: warning: a\n"


def test_tritoffs_warnings_print_in_one_line_and_others_as_python_prints_them(capsys):
    assert console._format_warning("a\nb", TritoffWarning, "x.py", 3) == "tritoff: warning: a b\n"
    assert console._format_warning("c", UserWarning, "x.py", 3, "") == "x.py:3: UserWarning: c\n"

    seen = {}

    def command(args):
        seen["format"] = warnings.formatwarning
        print("done")
        return 0

    before, stdout, stderr, hook = warnings.formatwarning, sys.stdout, sys.stderr, sys.unraisablehook
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert console.run_command(command, None) == 0
    assert capsys.readouterr().out == "done\n" and seen["format"] is console._format_warning
    # a command leaves the streams, the warnings' format, the unraisable hook and the signal handlers as it found them
    assert (warnings.formatwarning, sys.stdout, sys.stderr, sys.unraisablehook) == (before, stdout, stderr, hook)
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_an_interrupt_landing_in_a_finalizer_stops_the_command(capsys, tmp_path):
    """A KeyboardInterrupt that the signal handler raises inside a ``__del__`` is dropped there by Python: it is raised
    again in the code that runs next, so the command stops before publishing anything, with no traceback."""

    class Finalized:
        def __del__(self):
            console._terminate(signal.SIGINT, None)  # as if the signal arrived while this ran

    published = tmp_path / "published"

    def interrupted_in_a_finalizer(args):
        Finalized()
        for _ in range(100):  # the rest of the command's work
            time.sleep(0.01)
        published.write_text("the command ran to its end")
        return 0

    assert console.run_command(interrupted_in_a_finalizer, None) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["tritoff: interrupted"] and not published.exists()
    # in the command's last step: the interrupt raised again arrives before run_command returns, once, as a flag
    for _ in range(20):
        assert console.run_command(lambda args: Finalized() and 0, None) == 130
        time.sleep(0.01)  # the caller's code: nothing arrives here
    assert capsys.readouterr().err.strip().splitlines() == ["tritoff: interrupted"] * 20


def test_one_line_joins_a_messages_lines_and_names_a_bare_error():
    assert console.one_line(ValueError("a\n  b\n\nc ")) == "a b c"
    assert console.one_line(KeyError()) == "KeyError"

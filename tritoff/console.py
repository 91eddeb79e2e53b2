"""How a ``tritoff`` command runs as a process: its output streams, its signals, and every error in one line.

:func:`run_command` runs one command: Ctrl-C and SIGTERM unwind it (its temporary files go) and it exits 130 saying
so once; a reader gone from stdout or stderr (``| head -1``) costs nothing; tritoff's warnings print in one line, and
start a line of their own after a progress bar; an error is one line, with exit code 2 for the input's fault and 1
for the machine's or an unexpected one (``TRITOFF_TRACEBACK=1`` adds its traceback).
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from tritoff.arguments import EXIT_USAGE

EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


# set when SIGTERM or Ctrl-C arrived: the KeyboardInterrupt it raises can be swallowed by C code that was running
# (torch turns it into an error of its own while building a tensor), and the run is still an interrupted one
_interrupted = False
_running = False  # a command is running: an interrupt unwinds it (after it, the exit code says it was interrupted)
_in_flight: list[threading.Event] = []  # interrupts raised again from another thread, each set once it is raised


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (its type's name when it has none)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def say(line: str) -> None:
    """Print ``line`` to stderr on a line of its own: a progress bar interrupted or failing mid-line leaves the cursor
    after its text, and the one-line message would run on from it."""
    print(_new_line() + line, file=sys.stderr)


def _new_line() -> str:
    """A newline when stderr's last write left a line unfinished (a progress bar redraws its line with ``\r``)."""
    return "" if getattr(sys.stderr, "at_line_start", True) else "\n"


def run_command(command: Callable[[object], int], args) -> int:
    """Run ``command(args)`` as the process's command and return its exit code, with the streams, signal handlers,
    warning format and unraisable hook of a command in place while it runs (the caller's come back after)."""
    global _interrupted, _running
    _interrupted = False
    stdout, stderr, format_warning, previous = sys.stdout, sys.stderr, warnings.formatwarning, {}
    unraisable = sys.unraisablehook
    try:
        sys.stdout, sys.stderr, warnings.formatwarning = Output(stdout), Output(stderr), _format_warning
        sys.unraisablehook = _interrupt_again(unraisable)
        previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGINT)}
        _running = True
        try:
            code = command(args)
        finally:
            _running = False
            _settle()
        # an interrupt swallowed where even raising it again could not reach (C code that turned it into an error of
        # its own, and carried on) still ends the command as interrupted
        return _interrupted_exit() if _interrupted else code
    except KeyboardInterrupt:
        return _interrupted_exit()
    except Warning as err:  # a warning made an error (python -W error)
        say(f"tritoff: error: {one_line(err)} (a warning, made an error by -W error)")
        return 1
    except (CliError, ValueError, OSError) as err:
        if _interrupted:
            return _interrupted_exit()
        if _traceback_asked() and not _own_check(err):
            err.__suppress_context__ = False  # the library's error a one-line message stood for, shown too
            _print_traceback(err)
        say(f"tritoff: error: {one_line(err)}")
        # an OSError a library raised about the input (diffusers: a model directory without its weights) carries no
        # errno; the machine's errors (a full disk, an I/O error) do
        usage = (CliError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
        return EXIT_USAGE if isinstance(err, usage) or err.errno is None else 1
    except Exception as err:  # what no check foresaw (a library's error on these inputs, a bug): still one line
        if _interrupted:
            return _interrupted_exit()
        if _traceback_asked():
            _print_traceback(err)
            say(f"tritoff: error: {type(err).__name__}: {one_line(err)} (unexpected: its traceback is above)")
            return 1
        say(
            f"tritoff: error: {type(err).__name__}: {one_line(err)} (unexpected; set TRITOFF_TRACEBACK=1 for where "
            "it came from)"
        )
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = unraisable
        for output in (sys.stdout, sys.stderr):
            if isinstance(output, Output):  # through the wrappers: a reader gone leaves nothing for the exit's flush
                output.close()
        sys.stdout, sys.stderr, warnings.formatwarning = stdout, stderr, format_warning


def exit_after(code: int) -> None:
    """End the process with ``code`` once a command has ended, with its files closed and complete, without Python's
    teardown of the modules it loaded: that of torch's and diffusers' (~2 s) would only delay the exit, and it stops
    handling signals first (a Ctrl-C then ended the process by the signal, with no word). The exit handlers still run
    (inductor's worker pools, weakref finalizers)."""
    import atexit

    atexit._run_exitfuncs()
    _flush_outputs()
    os._exit(code)


def exit_on_interrupt() -> None:
    """Until a command runs (and again after it): Ctrl-C or SIGTERM exits 130 at once with one line, where Python
    would print a traceback."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_interrupted)


def _terminate(signum, frame):
    global _interrupted
    _interrupted = True
    if _running:
        raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: temporary files and directories are removed


def _interrupt_again(hook):
    """``sys.unraisablehook`` for a command: the KeyboardInterrupt of a signal that landed in a finalizer (``__del__``,
    a weakref callback) is dropped there by Python, and the command would run on to its end (publishing what it
    makes); it is raised again, by the same signal, in the code that runs next, and not printed."""

    def unraisable(info):
        if _interrupted and info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            # from another thread: the handler then runs in the main thread's code once this hook has returned (made
            # from here, it would run in the hook itself, and be dropped again); a finalizer again: the same again
            raised = threading.Event()
            _in_flight.append(raised)

            def again():
                if _running:
                    _thread.interrupt_main(signal.SIGINT)
                raised.set()

            _thread.start_new_thread(again, ())  # (threading's start would wait for the thread here)
            return
        hook(info)

    return unraisable


def _settle() -> None:
    """Once the command has ended: let interrupts raised again from other threads arrive (as a flag only: the command
    is over), before the caller's handlers are back."""
    for raised in _in_flight:
        raised.wait(5)
    _in_flight.clear()
    _checkpoint()  # the handler of one that arrived runs at the main thread's next check: a call is one


def _checkpoint() -> None:
    pass


def _interrupted_exit() -> int:
    say("tritoff: interrupted")
    return EXIT_INTERRUPTED


class Output:
    """``sys.stdout`` or ``sys.stderr`` during a command: once its reader is gone (``tritoff run ... | head -1``,
    ``2>&1 | head -1``), the rest of what goes there is dropped and the command goes on, since what it writes to disk
    is its result."""

    def __init__(self, stream):
        # a stream Python left as None (the process started with it closed: 2>&-) writes to /dev/null
        self.owned = stream is None
        self.stream = open(os.devnull, "w") if stream is None else stream  # noqa: SIM115 (closed by close())
        self.at_line_start = True  # what was written last ended a line (see say)

    def write(self, text: str) -> int:
        if text:  # a bar's redraw ("\r" and its text) leaves the line unfinished; a bar cleared ends with "\r"
            self.at_line_start = text.endswith(("\n", "\r"))
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def close(self) -> None:
        """Flush, and close the /dev/null this wrapper opened in place of a missing stream."""
        self.flush()
        if self.owned:
            self.stream.close()

    def _drop(self) -> None:
        # the descriptor itself goes to /dev/null: the interpreter's own flush at exit would fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """tritoff's own warnings in one line, as its errors are; other libraries' as Python formats them."""
    from tritoff.warn import TritoffWarning

    if issubclass(category, TritoffWarning):
        return f"{_new_line()}tritoff: warning: {one_line(message)}\n"
    return _new_line() + _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def _traceback_asked() -> bool:
    """Whether ``TRITOFF_TRACEBACK`` asks for tracebacks (set, and not to ``0``)."""
    return os.environ.get("TRITOFF_TRACEBACK", "").strip() not in ("", "0")


def _print_traceback(err: BaseException) -> None:
    """``err``'s traceback (and those it was raised from) on stderr, for ``TRITOFF_TRACEBACK=1``: printed, not
    raised, so the command still ends with its one-line error and its exit code."""
    import traceback

    sys.stderr.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    sys.stderr.flush()


def _own_check(err: BaseException) -> bool:
    """Whether ``err`` is one of tritoff's own checks: a CliError or an error raised in tritoff's code, standing for
    no error a library raised (a library's error put in one line is not)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = str(Path(__file__).resolve().parent)
    raised_here = tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(package + os.sep)
    inner = err.__cause__ or err.__context__
    return (isinstance(err, CliError) or raised_here) and (inner is None or _own_check(inner))


def _flush_outputs() -> None:
    for output in (sys.stdout, sys.stderr):
        if output is None:  # started with the stream closed (2>&-)
            continue
        try:
            output.flush()
        except (OSError, ValueError, RuntimeError):  # a reader gone, a closed stream, a flush a signal interrupted
            pass


def _exit_interrupted(signum, frame) -> None:
    """Ctrl-C or SIGTERM outside a command (Python starting, or the exit handlers after it): exit 130 at once, saying
    so once. Left to Python, the interrupt would print a traceback."""
    if not _interrupted:  # a command that was interrupted has said so already
        _flush_outputs()
        try:
            os.write(2, b"tritoff: interrupted\n")
        except OSError:
            pass
    os._exit(EXIT_INTERRUPTED)

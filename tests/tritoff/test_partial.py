"""tritoff/partial.py: a store being written is locked by its writer; only one nobody holds counts as left behind."""

import subprocess
import sys
import textwrap

from tritoff.partial import LOCK, finished, left_behind, partial_store


def test_a_partial_store_is_locked_until_finished(tmp_path):
    target = tmp_path / "store"
    partial = partial_store(target)
    assert partial.parent == tmp_path and partial.name.startswith(".store.") and (partial / LOCK).is_file()
    assert left_behind(target) == []  # this process holds it
    finished(partial)
    assert not (partial / LOCK).exists()
    assert left_behind(target) == []  # no lock file: being renamed into place, never taken for a leftover
    (partial / LOCK).touch()
    assert left_behind(target) == [partial]  # a lock file nobody holds: its writer is gone
    again = partial_store(target)
    assert not partial.exists() and again.exists()
    finished(again)


def test_a_writer_that_was_killed_leaves_a_directory_the_next_one_removes(tmp_path):
    """The lock dies with its process, however it ends (here SIGKILL)."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from tritoff.partial import partial_store
        print(partial_store({str(tmp_path / "store")!r}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    partial = tmp_path / done.stdout.strip().rsplit("/", 1)[-1]
    assert done.returncode == -9 and partial.is_dir() and (partial / LOCK).is_file()
    assert left_behind(tmp_path / "store") == [partial]
    finished(partial_store(tmp_path / "store"))
    assert not partial.exists()

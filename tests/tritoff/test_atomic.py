"""tritoff/atomic.py: a file appears complete or not at all, with the mode a plain ``open`` gives new files; whether a
directory can hold new files is found by making one."""

import os
import signal
import stat

import pytest

from tritoff import atomic
from tritoff.atomic import atomic_path, can_create_in, interrupts_held, umask


@pytest.fixture
def set_umask():
    """Set the process umask for one test; the previous one is put back after it."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o037], ids=oct)
def test_umask_reads_the_process_umask_without_changing_it(set_umask, mask):
    set_umask(mask)
    assert umask() == mask
    assert umask() == mask  # reading it twice: the first read did not reset it
    assert os.umask(mask) == mask


def test_the_temporary_file_sits_beside_the_target_and_is_renamed_onto_it(tmp_path):
    target = tmp_path / "frames.mp4"
    with atomic_path(target, suffix=".mp4") as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)  # same directory: the rename cannot cross filesystems
        name = os.path.basename(tmp)
        assert name.startswith(".frames.mp4.") and name.endswith(".mp4")  # hidden, and the suffix writers look at
        assert not target.exists()  # nothing appears under the final name while writing
        with open(tmp, "wb") as f:
            f.write(b"complete")
    assert target.read_bytes() == b"complete"
    assert os.listdir(tmp_path) == ["frames.mp4"]  # the temporary name is gone


def test_an_existing_file_is_replaced_only_when_the_writer_succeeds(tmp_path):
    target = tmp_path / "video.gif"
    target.write_bytes(b"old video")
    with pytest.raises(RuntimeError, match="encoder died"):
        with atomic_path(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half a vid")
            raise RuntimeError("encoder died")
    assert target.read_bytes() == b"old video"  # untouched
    assert os.listdir(tmp_path) == ["video.gif"]  # and the half-written temporary file is removed

    with atomic_path(target) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"new video")
    assert target.read_bytes() == b"new video"
    assert os.listdir(tmp_path) == ["video.gif"]


def test_a_failed_first_write_leaves_no_file_at_all(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"partial")
            raise KeyboardInterrupt  # not an Exception: the temporary file must go all the same
    assert os.listdir(tmp_path) == []


def test_a_writer_that_writes_nothing_still_replaces_the_target_with_an_empty_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with atomic_path(target):
        pass  # the temporary file exists from the start (created empty)
    assert target.read_bytes() == b""


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077, 0o002], ids=oct)
def test_the_file_gets_the_mode_a_plain_open_gives_it_not_mkstemps_0600(tmp_path, set_umask, mask):
    set_umask(mask)
    target = tmp_path / "atomic.bin"
    with atomic_path(target) as tmp:
        assert _mode(tmp) == 0o666 & ~mask  # already while it is being written
        with open(tmp, "wb") as f:
            f.write(b"x")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"x")
    assert _mode(target) == _mode(plain) == 0o666 & ~mask


def test_a_missing_directory_fails_before_the_writer_runs(tmp_path):
    ran = []
    with pytest.raises(FileNotFoundError):
        with atomic_path(tmp_path / "missing" / "out.bin"):
            ran.append(True)
    assert ran == [] and not (tmp_path / "missing").exists()


def test_a_directory_that_can_hold_files_is_told_and_the_probe_is_gone(tmp_path):
    assert can_create_in(tmp_path) and os.listdir(tmp_path) == []
    assert not can_create_in(tmp_path / "missing")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")
def test_procfs_holds_no_new_file_whatever_its_modes_say():
    assert not can_create_in("/proc")  # root may write by its modes; procfs refuses to create


def test_an_interrupt_while_the_temporary_file_is_made_still_removes_it(tmp_path, monkeypatch, ctrl_c_raises):
    def interrupted():  # Ctrl-C between making the file and handing out its name
        signal.raise_signal(signal.SIGINT)
        return 0o022

    monkeypatch.setattr(atomic, "umask", interrupted)
    with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "out.bin"):
        raise AssertionError("the block ran: the interrupt was not delivered where the file was made")
    assert os.listdir(tmp_path) == []


def test_held_interrupts_reach_their_own_handlers_once_the_block_ends_and_the_handlers_are_back(ctrl_c_raises):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with interrupts_held():
            signal.raise_signal(signal.SIGTERM)
            assert seen == []  # held
        assert seen == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt), interrupts_held():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_nearest_existing_is_where_making_a_path_would_start(tmp_path, monkeypatch):
    from tritoff.atomic import nearest_existing

    (tmp_path / "a").mkdir()
    assert nearest_existing(tmp_path / "a") == tmp_path / "a"
    assert nearest_existing(tmp_path / "a" / "b" / "c") == tmp_path / "a"
    monkeypatch.chdir(tmp_path)
    assert nearest_existing("a/b").resolve() == tmp_path / "a"  # relative: from the working directory

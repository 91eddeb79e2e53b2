"""tritoff/video.py: frames converted to uint8 exactly, videos written complete or not at all, unwritable targets
refused early in one line."""

import errno
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image

from tritoff import video
from tritoff.video import check_writable, to_uint8_frames, write_video


def _gif_frames(path) -> tuple[np.ndarray, list[int]]:
    """The RGB frames of a GIF and each frame's duration in ms."""
    with Image.open(path) as im:
        frames, durations = [], []
        for i in range(im.n_frames):
            im.seek(i)
            frames.append(np.asarray(im.convert("RGB")))
            durations.append(im.info["duration"])
    return np.stack(frames), durations


# -- to_uint8_frames ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        pytest.param(0.0, 0, id="zero"),
        pytest.param(1.0, 255, id="one"),
        pytest.param(0.5, 128, id="half-rounds-to-128"),
        pytest.param(1 / 255, 1, id="one-step"),
        pytest.param(0.002, 1, id="0.51-rounds-up"),
        pytest.param(0.998, 254, id="254.49-rounds-down"),
        pytest.param(-0.3, 0, id="below-zero-clips"),
        pytest.param(1.7, 255, id="above-one-clips"),
        pytest.param(-1e9, 0, id="far-below"),
        pytest.param(1e9, 255, id="far-above-no-wraparound"),
    ],
)
def test_values_in_0_1_map_to_0_255_rounded_and_out_of_range_values_clip(value, expected):
    frames = torch.full((2, 3, 4, 6), value)
    out = to_uint8_frames(frames)
    assert out.dtype == np.uint8
    assert out.shape == (2, 4, 6, 3)
    assert (out == expected).all()


def test_channels_first_tensors_are_moved_to_channels_last():
    frames = torch.rand(3, 3, 5, 7)  # (F, C, H, W)
    out = to_uint8_frames(frames)
    assert out.shape == (3, 5, 7, 3)
    expected = (frames.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
    np.testing.assert_array_equal(out, expected)
    assert out[2, 4, 1, 0] == round(frames[2, 0, 4, 1].item() * 255)  # (f, c, h, w) -> (f, h, w, c)


def test_channels_last_tensors_keep_their_layout_and_a_batch_dimension_is_dropped():
    frames = torch.rand(3, 5, 7, 3)  # (F, H, W, C)
    expected = (frames * 255).round().to(torch.uint8).numpy()
    np.testing.assert_array_equal(to_uint8_frames(frames), expected)
    np.testing.assert_array_equal(to_uint8_frames(frames[None]), expected)  # (1, F, H, W, C): the first video
    batch = torch.rand(1, 3, 3, 5, 7)  # a pipeline's (B, F, C, H, W) output
    assert to_uint8_frames(batch).shape == (3, 5, 7, 3)


def test_bf16_and_grad_tracking_tensors_are_converted():
    frames = torch.rand(2, 3, 4, 4, requires_grad=True)
    np.testing.assert_array_equal(to_uint8_frames(frames), to_uint8_frames(frames.detach()))
    half = torch.full((1, 3, 2, 2), 0.5, dtype=torch.bfloat16)
    assert (to_uint8_frames(half) == 128).all()


def test_lists_of_pil_images_and_uint8_arrays_are_kept_exactly():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(3)]
    np.testing.assert_array_equal(to_uint8_frames(arrays), np.stack(arrays))
    np.testing.assert_array_equal(to_uint8_frames([Image.fromarray(a) for a in arrays]), np.stack(arrays))


def test_lists_of_float_arrays_are_scaled_like_tensors():
    rng = np.random.default_rng(0)
    arrays = [rng.random((4, 6, 3), dtype=np.float32) for _ in range(2)]  # diffusers' output_type="np"
    np.testing.assert_array_equal(to_uint8_frames(arrays), to_uint8_frames(torch.from_numpy(np.stack(arrays))))


def test_single_channel_frames_become_the_documented_rgb_frames():
    frames = torch.rand(2, 1, 4, 6)  # (F, 1, H, W): a grey video, which the layout check recognizes
    out = to_uint8_frames(frames)
    assert out.shape == (2, 4, 6, 3)  # the docstring promises (F, H, W, 3)
    grey = (frames[:, 0] * 255).round().to(torch.uint8).numpy()
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], grey)


def test_greyscale_pil_images_become_rgb_frames():
    gen = np.random.default_rng(0)
    pixels = gen.integers(0, 256, size=(3, 4, 6), dtype=np.uint8)
    out = to_uint8_frames([Image.fromarray(p, mode="L") for p in pixels])
    assert out.shape == (3, 4, 6, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], pixels)


def test_uint8_tensors_are_kept_as_they_are_not_read_as_0_1():
    frames = torch.randint(0, 256, (2, 3, 4, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(to_uint8_frames(frames), frames.permute(0, 2, 3, 1).numpy())


# -- check_writable -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".mp4", ".gif", ".MP4", ".Gif"])
def test_writable_targets_are_returned_as_paths(tmp_path, suffix):
    target = tmp_path / f"out{suffix}"
    assert check_writable(str(target)) == target
    assert not target.exists()  # checking writes nothing


@pytest.mark.parametrize(
    "name,error,message",
    [
        pytest.param("", ValueError, "no video path given: name the video .mp4 or .gif", id="empty"),
        pytest.param("   ", ValueError, "no video path given: name the video .mp4 or .gif", id="blank"),
        pytest.param("out.avi", ValueError, "cannot write {dir}/out.avi: name the video .mp4 or .gif", id="avi"),
        pytest.param("out", ValueError, "cannot write {dir}/out: name the video .mp4 or .gif", id="no-suffix"),
        pytest.param(
            "missing/out.mp4",
            FileNotFoundError,
            "cannot write {dir}/missing/out.mp4: directory {dir}/missing does not exist",
            id="missing-directory",
        ),
        pytest.param(
            "a-file/out.gif",
            NotADirectoryError,
            "cannot write {dir}/a-file/out.gif: {dir}/a-file is a file, not a directory",
            id="a-file-as-its-directory",
        ),
        pytest.param(
            "taken.gif",
            IsADirectoryError,
            "cannot write {dir}/taken.gif: it is a directory; give a file name ending in .mp4 or .gif",
            id="a-directory-in-its-place",
        ),
    ],
)
def test_unwritable_targets_are_refused_in_one_line(tmp_path, name, error, message):
    (tmp_path / "taken.gif").mkdir()
    (tmp_path / "a-file").write_bytes(b"")
    path = f"{tmp_path}/{name}" if name.strip() else name
    with pytest.raises(error) as info:
        check_writable(path)
    assert str(info.value) == message.format(dir=tmp_path)
    assert "\n" not in str(info.value)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write to: a 0555 directory, or for root (whom modes do not stop) /proc/sys."""
    directory = tmp_path / "ro"
    directory.mkdir()
    os.chmod(directory, 0o555)
    if os.access(directory, os.W_OK):
        directory = Path("/proc/sys")
        if not directory.is_dir() or os.access(directory, os.W_OK):
            pytest.skip("no directory this process cannot write to")
    yield directory
    os.chmod(tmp_path / "ro", 0o755)


def test_a_read_only_directory_is_refused_in_one_line(read_only_dir):
    with pytest.raises(PermissionError) as info:
        check_writable(read_only_dir / "out.gif")
    assert str(info.value) == f"cannot write {read_only_dir}/out.gif: directory {read_only_dir} is not writable"


def test_a_directory_no_file_can_be_created_in_is_refused_before_the_run():
    """``/sys``: its modes let root write, but sysfs creates no file there; only writing the video would have told."""
    if not Path("/sys").is_dir():
        pytest.skip("no /sys")
    with pytest.raises(PermissionError, match=r"^cannot write /sys/out\.gif: directory /sys is not writable$"):
        check_writable("/sys/out.gif")


def test_a_bare_file_name_is_checked_against_the_current_directory(tmp_path, read_only_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_writable("clip.gif") == Path("clip.gif")
    monkeypatch.chdir(read_only_dir)
    with pytest.raises(PermissionError, match=r"^cannot write clip.gif: directory \. is not writable$"):
        check_writable("clip.gif")


def test_mp4_without_imageio_ffmpeg_is_refused_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import fails as if it were not installed
    with pytest.raises(
        ValueError, match=r"^writing \.mp4 needs imageio-ffmpeg .*: pip install imageio-ffmpeg, or write a \.gif$"
    ):
        check_writable(tmp_path / "out.mp4")
    assert check_writable(tmp_path / "out.gif") == tmp_path / "out.gif"  # a GIF needs only Pillow


# -- write_video --------------------------------------------------------------------------------------------------


def test_a_gif_reads_back_with_every_frame_exactly_at_the_frame_rate(tmp_path):
    frames = torch.rand(5, 3, 8, 12)  # 96 pixels a frame: the GIF palette holds them all, so no colour is lost
    path = write_video(frames, tmp_path / "clip.gif", fps=10)
    assert path == tmp_path / "clip.gif"
    back, durations = _gif_frames(path)
    assert back.shape == (5, 8, 12, 3)
    np.testing.assert_array_equal(back, to_uint8_frames(frames))
    assert durations == [100] * 5  # 1000 // 10 ms
    with Image.open(path) as im:
        assert im.info["loop"] == 0  # loops forever


def test_a_gif_plays_at_the_frame_rate_asked_in_hundredths_of_a_second(tmp_path):
    # 16 fps is 6.25 hundredths a frame: 60 and 70 ms alternate so 81 frames play 5.06 s, not 4.86 s (60 ms each)
    frames = torch.rand(81, 3, 4, 4)
    _, durations = _gif_frames(write_video(frames, tmp_path / "clip.gif", fps=16))
    assert len(durations) == 81 and set(durations) == {60, 70}
    assert abs(sum(durations) - 81 * 1000 / 16) <= 10
    assert sum(video.gif_durations(24, 24)) == 1000 and set(video.gif_durations(24, 24)) == {40, 50}
    assert video.gif_durations(3, 60) == video.gif_durations(3, 1000) == [20] * 3  # 50 fps at most: browsers


def test_an_mp4_reads_back_with_the_frame_count_size_rate_and_levels(tmp_path):
    levels = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 0.6])
    frames = levels[:, None, None, None].expand(6, 3, 16, 24).contiguous()  # one grey level a frame
    path = write_video(frames, tmp_path / "clip.mp4", fps=12)
    back = iio.imread(path)
    assert back.shape == (6, 16, 24, 3)
    assert iio.immeta(path)["fps"] == 12.0
    expected = (levels * 255).round().numpy()
    assert np.abs(back.reshape(6, -1).astype(float) - expected[:, None]).max() <= 2  # h264's YUV round trip


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_a_written_video_gets_the_mode_the_umask_gives_new_files(tmp_path, suffix):
    previous = os.umask(0o027)
    try:
        path = write_video(torch.rand(2, 3, 16, 16), tmp_path / f"clip{suffix}")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert os.listdir(tmp_path) == [f"clip{suffix}"]


def _fake_ffmpeg(tmp_path, monkeypatch, script: str) -> Path:
    """Stand in for imageio-ffmpeg's ffmpeg with a shell ``script`` (its output file is the last argument, ``$out``)."""
    exe = tmp_path / "bin" / "ffmpeg"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nfor out; do :; done\n{script}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(exe))
    return exe


def test_a_full_disk_while_encoding_is_said_of_the_video_and_the_previous_one_stays(tmp_path, monkeypatch):
    # what ffmpeg does when the disk fills at the end: a partial file, the reason on its stderr, an exit code of its own
    full = """cat > /dev/null
printf '\\000\\000\\000\\030ftypisom' > "$out"
echo '[out#0/mp4 @ 0x55] Error writing trailer: No space left on device' >&2
echo '[out#0/mp4 @ 0x55] Error closing file: No space left on device' >&2
exit 228"""
    _fake_ffmpeg(tmp_path, monkeypatch, full)
    target = tmp_path / "clip.mp4"
    target.write_bytes(b"the previous video")
    with pytest.raises(OSError, match=rf"cannot write {re.escape(str(target))}: No space left on device$") as info:
        write_video(torch.rand(2, 3, 16, 16), target)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"the previous video"
    assert sorted(os.listdir(tmp_path)) == ["bin", "clip.mp4"]


@pytest.mark.parametrize(
    "script, said",
    [
        ("cat > /dev/null; echo '[libx264 @ 0x1] width not divisible by 2' >&2; exit 1", "(width not divisible by 2)"),
        ("cat > /dev/null; exit 0", "(it wrote nothing)"),  # an empty file and a zero exit status
        ("exit 3", "(exit status 3)"),  # gone before reading every frame, saying nothing
    ],
    ids=["says-why", "writes-nothing", "says-nothing"],
)
def test_an_encoder_failing_is_one_line_naming_why_and_the_previous_video_stays(tmp_path, monkeypatch, script, said):
    _fake_ffmpeg(tmp_path, monkeypatch, script)
    target = tmp_path / "clip.mp4"
    target.write_bytes(b"the previous video")
    message = f"^ffmpeg could not write {re.escape(str(target))} {re.escape(said)}: write a .gif"
    with pytest.raises(RuntimeError, match=message):
        write_video(torch.rand(2, 3, 16, 16), target)
    assert target.read_bytes() == b"the previous video"
    assert sorted(os.listdir(tmp_path)) == ["bin", "clip.mp4"]


def test_an_interrupt_while_encoding_stops_ffmpeg_before_its_file_is_removed(tmp_path, monkeypatch):
    # an ffmpeg still encoding when the interrupt comes: left running, it would write its file after tritoff removed it
    _fake_ffmpeg(tmp_path, monkeypatch, f"touch {tmp_path}/started; exec sleep 30")
    started = []

    class Interrupted(subprocess.Popen):
        def communicate(self, *args, **kwargs):
            started.append(self)
            while not (tmp_path / "started").exists():
                time.sleep(0.01)
            raise KeyboardInterrupt

    monkeypatch.setattr(video.subprocess, "Popen", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_video(torch.rand(2, 3, 16, 16), tmp_path / "clip.mp4")
    assert started[0].returncode is not None  # ended (killed) before write_video gave up
    assert sorted(os.listdir(tmp_path)) == ["bin", "started"]


def test_an_unwritable_target_is_refused_before_any_frame_is_converted(tmp_path):
    class Frames:
        def __iter__(self):
            raise AssertionError("frames were read before the path was checked")

    with pytest.raises(FileNotFoundError, match=re.escape(f"directory {tmp_path}/nope does not exist")):
        write_video(Frames(), tmp_path / "nope" / "clip.gif")


def test_an_mp4_of_odd_size_gets_its_last_row_repeated_to_the_even_size_h264_needs(tmp_path):
    """libx264 refuses odd sizes with yuv420p (and wrote an empty file): the last row or column is repeated."""
    target = tmp_path / "clip.mp4"
    grey = torch.full((4, 3, 15, 17), 0.5)
    write_video(grey, target)
    back = iio.imread(target)
    assert back.shape == (4, 16, 18, 3)
    assert abs(int(back[:, -1].astype(int).mean()) - 128) <= 2  # the repeated edge, not black padding


def test_diffusers_np_output_a_batch_of_channels_last_arrays_is_read_as_such():
    rng = np.random.default_rng(1)
    videos = rng.random((1, 2, 8, 3, 3), dtype=np.float32)  # (B, F, H, W, C), width 3: channels still last
    np.testing.assert_array_equal(to_uint8_frames(videos), (videos[0] * 255).round().astype(np.uint8))


@pytest.mark.parametrize(
    "shape, channels_last_shape",
    [
        pytest.param((2, 3, 8, 3), (2, 8, 3, 3), id="width-3-rgb"),
        pytest.param((2, 3, 1, 1), (2, 1, 1, 3), id="1x1-rgb"),
        pytest.param((2, 4, 6, 5), (2, 6, 5, 4), id="rgba"),
    ],
)
def test_a_channels_first_tensor_whose_width_could_be_channels_is_still_channels_first(shape, channels_last_shape):
    frames = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    expected = (frames.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
    out = to_uint8_frames(frames)
    assert out.shape == channels_last_shape
    np.testing.assert_array_equal(out, expected)


def test_integer_and_bool_frames_are_read_as_0_255_and_as_off_on():
    levels = torch.tensor([-5, 0, 7, 255, 300]).view(1, 1, 5, 1).expand(2, 4, 5, 3)  # (F, H, W, C)
    assert to_uint8_frames(levels.long())[0, 0, :, 0].tolist() == [0, 0, 7, 255, 255]
    mask = torch.tensor([True, False]).view(1, 1, 1, 2).expand(2, 3, 4, 2)  # (F, C, H, W)
    assert to_uint8_frames(mask)[0, 0, :, 0].tolist() == [255, 0]


@pytest.mark.parametrize("frames", [[], torch.empty(0, 3, 4, 4)], ids=["empty-list", "no-frames-tensor"])
def test_no_frames_is_refused_in_one_line(frames):
    with pytest.raises(ValueError, match="^no frames to write$"):
        to_uint8_frames(frames)


def test_a_full_disk_is_said_of_the_video_it_stopped_and_leaves_no_file(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", no_space)
    out = tmp_path / "out.gif"
    with pytest.raises(OSError, match=rf"cannot write {re.escape(str(out))}: No space left on device") as info:
        write_video(torch.rand(2, 3, 8, 8), out)
    assert info.value.errno == 28 and list(tmp_path.iterdir()) == []


def test_an_mp4_in_a_directory_named_like_a_protocol_is_written_there(tmp_path, monkeypatch):
    # ffmpeg reads a relative "rtmp:x/v.mp4" as a stream to open on host x, not as a file
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rtmp:x").mkdir()
    write_video(torch.rand(2, 3, 16, 16), "rtmp:x/v.mp4")
    assert iio.imread(tmp_path / "rtmp:x" / "v.mp4").shape == (2, 16, 16, 3)
    assert os.listdir(tmp_path / "rtmp:x") == ["v.mp4"]


def test_a_file_size_limit_is_said_as_the_file_being_too_large(tmp_path, monkeypatch):
    _fake_ffmpeg(tmp_path, monkeypatch, 'printf x > "$out"; kill -XFSZ $$')  # what writing past `ulimit -f` does
    target = tmp_path / "clip.mp4"
    with pytest.raises(OSError, match=rf"cannot write {re.escape(str(target))}: File too large$") as info:
        write_video(torch.rand(2, 3, 16, 16), target)
    assert info.value.errno == errno.EFBIG and sorted(os.listdir(tmp_path)) == ["bin"]


def test_an_interrupt_while_ffmpeg_starts_still_stops_it_and_removes_its_file(tmp_path, monkeypatch, ctrl_c_raises):
    # Ctrl-C landing inside Popen, once ffmpeg runs but before its handle is returned, is held until the handle is kept
    _fake_ffmpeg(tmp_path, monkeypatch, "exec sleep 30")
    started = []

    class InterruptedWhileStarting(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(video.subprocess, "Popen", InterruptedWhileStarting)
    with pytest.raises(KeyboardInterrupt):
        write_video(torch.rand(2, 3, 16, 16), tmp_path / "clip.mp4")
    assert started[0].returncode is not None  # stopped, not left running
    assert sorted(os.listdir(tmp_path)) == ["bin"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


@pytest.mark.parametrize("exe", ["/no/such/ffmpeg", "{tmp}/not-executable"])
def test_an_ffmpeg_that_is_not_there_is_refused_before_the_run(tmp_path, monkeypatch, exe):
    (tmp_path / "not-executable").write_text("")
    exe = exe.format(tmp=tmp_path)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", exe)
    said = f"{exe} (imageio-ffmpeg's, or IMAGEIO_FFMPEG_EXE's) is not an executable file: fix that, or write a .gif"
    with pytest.raises(ValueError, match=f"^writing .mp4 needs ffmpeg, and {re.escape(said)}$"):
        check_writable(tmp_path / "clip.mp4")


def test_an_ffmpeg_that_cannot_run_is_said_of_ffmpeg_not_of_the_video(tmp_path, monkeypatch):
    exe = tmp_path / "ffmpeg"
    exe.write_bytes(b"\x7fELF not really")  # executable by its mode, not by its contents
    exe.chmod(0o755)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(exe))
    with pytest.raises(ValueError, match=rf"^cannot run ffmpeg {re.escape(str(exe))}: Exec format error; fix it"):
        write_video(torch.rand(2, 3, 16, 16), tmp_path / "clip.mp4")
    assert os.listdir(tmp_path) == ["ffmpeg"]


def test_a_name_too_long_for_the_file_system_is_refused_before_the_run_and_a_long_one_is_written(tmp_path):
    with pytest.raises(ValueError, match="its name is longer than 255 bytes; give a shorter one"):
        check_writable(tmp_path / ("é" * 126 + ".gif"))  # 256 bytes in UTF-8
    for target in (tmp_path / ("v" * 251 + ".gif"), tmp_path / ("é" * 125 + ".gif")):  # 255 and 254 bytes
        write_video(torch.rand(2, 3, 8, 8), target)  # its temporary name is made shorter
        assert target.name in os.listdir(tmp_path)
    assert len(os.listdir(tmp_path)) == 2

"""Writing generated frames as mp4 (the ffmpeg imageio-ffmpeg carries) or an animated GIF; never half-written."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np

from tritoff.atomic import atomic_path, can_create_in, interrupts_held

# channel counts a frame may have: grey, RGB, RGBA
CHANNELS = (1, 3, 4)


def to_uint8_frames(frames) -> np.ndarray:
    """(F, H, W, C) uint8 frames, C being 3 (or 4 with alpha), from a pipeline's output: a tensor or array of
    (F, C, H, W) or (F, H, W, C) frames (of a batch of videos, the first), in [0, 1] when floating point and 0-255
    when integer, or a list of PIL images or arrays. Single-channel frames become grey RGB. Where both dimensions
    could hold the channels, the one holding 3 does; else a tensor is read channels-first (diffusers' ``"pt"``
    output) and an array channels-last (its ``"np"`` output)."""
    import torch

    channels_first = isinstance(frames, torch.Tensor)
    if channels_first:
        frames = frames.detach().cpu()
        frames = (frames.float() if frames.dtype in (torch.float16, torch.bfloat16) else frames).numpy()
    elif not isinstance(frames, np.ndarray):  # PIL images or arrays, one per frame
        images = [np.asarray(f) for f in frames]
        if not images:
            raise ValueError("no frames to write")
        frames = np.stack(images)
    array = frames[0] if frames.ndim == 5 else frames
    if array.ndim == 3:  # greyscale frames: (F, H, W)
        array = array[..., None]
    first, last = array.shape[1] in CHANNELS, array.shape[-1] in CHANNELS
    if array.ndim != 4 or not (first or last):
        raise ValueError(f"frames of shape {tuple(frames.shape)}: give (F, C, H, W) or (F, H, W, C) frames")
    if first and last and (array.shape[1] == 3) != (array.shape[-1] == 3):
        channels_first = array.shape[1] == 3  # RGB where the other could only be grey or RGBA
    elif first != last:
        channels_first = first
    if channels_first:
        array = array.transpose(0, 2, 3, 1)
    if array.size == 0:
        raise ValueError("no frames to write")
    if array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    elif np.issubdtype(array.dtype, np.integer):
        array = np.clip(array, 0, 255).astype(np.uint8)
    else:
        array = (np.clip(array, 0, 1) * 255).round().astype(np.uint8)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return array


VIDEO_SUFFIXES = (".mp4", ".gif")
NAME_MAX = 255  # bytes in a file name (Linux, macOS)


def check_writable(path: str | Path) -> Path:
    """Fail early, in one line, if ``path`` cannot be written as a video: a missing or read-only directory, a
    directory in its place, a suffix other than .mp4 or .gif, or .mp4 without imageio-ffmpeg."""
    if not str(path).strip():
        raise ValueError("no video path given: name the video .mp4 or .gif")
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise ValueError(f"cannot write {path}: name the video .mp4 or .gif")
    if len(os.fsencode(path.name)) > NAME_MAX:
        raise ValueError(f"cannot write {path}: its name is longer than {NAME_MAX} bytes; give a shorter one")
    if parent.exists() and not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a directory; give a file name ending in .mp4 or .gif")
    if not can_create_in(parent):  # (a mode check would pass root where no file can be made)
        raise PermissionError(f"cannot write {path}: directory {parent} is not writable")
    if path.suffix.lower() == ".mp4":
        _ffmpeg()
    return path


def _ffmpeg() -> str:
    """The ffmpeg that encodes .mp4: imageio-ffmpeg's own, or the one ``IMAGEIO_FFMPEG_EXE`` names; else a one-line
    error saying what to install or fix."""
    try:
        import imageio_ffmpeg
    except ImportError:
        raise ValueError(
            "writing .mp4 needs imageio-ffmpeg (a dependency of tritoff): pip install imageio-ffmpeg, or write a .gif"
        ) from None
    try:
        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as err:  # no ffmpeg found
        raise ValueError(f"writing .mp4 needs ffmpeg: {err}; or write a .gif") from None
    if shutil.which(exe) is None:
        raise ValueError(
            f"writing .mp4 needs ffmpeg, and {exe} (imageio-ffmpeg's, or IMAGEIO_FFMPEG_EXE's) is not an executable "
            "file: fix that, or write a .gif"
        )
    return exe


# the machine's errors ffmpeg may end with, told by their message (it exits with a code of its own)
FFMPEG_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES)


def _encode_mp4(array: np.ndarray, tmp: str, fps: int, path: Path) -> None:
    """Encode ``array`` (F, H, W, 3 or 4, uint8) as H.264 into ``tmp`` with imageio-ffmpeg's ffmpeg, the frames
    streamed to its stdin. ffmpeg's exit status is checked (a full disk shows only there and on its stderr), and
    ffmpeg has ended before this returns or raises, so nothing writes ``tmp`` once its caller removes it (an
    interrupt kills it)."""
    _, height, width, channels = array.shape
    exe = _ffmpeg()
    command = [
        exe, "-y", "-v", "error", "-f", "rawvideo", "-vcodec", "rawvideo",
        "-s", f"{width}x{height}", "-pix_fmt", "rgba" if channels == 4 else "rgb24", "-r", str(fps), "-i", "-",
        "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p", os.path.abspath(tmp),  # never read as "proto:..."
    ]  # fmt: skip
    process = None
    try:
        # held: an interrupt inside Popen, once ffmpeg runs, would leave it running with no handle to stop it. Its own
        # session: a Ctrl-C at the terminal reaches tritoff, which stops it, rather than ffmpeg finishing the file
        with interrupts_held():
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        _, stderr = process.communicate(memoryview(np.ascontiguousarray(array)).cast("B"))
    except OSError as err:
        if process is None:  # ffmpeg did not start: not the video's fault
            raise ValueError(f"cannot run ffmpeg {exe}: {err.strerror or err}; fix it, or write a .gif") from None
        raise
    finally:
        if process is not None and process.returncode is None:  # interrupted
            with interrupts_held():
                process.kill()
                process.wait()
    if process.returncode == 0 and os.path.getsize(tmp) > 0:
        return
    if process.returncode == -signal.SIGXFSZ:  # a file size limit (ulimit -f): ffmpeg killed for writing past it
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    said = stderr.decode(errors="replace").strip().splitlines()
    if said:  # its last line, less the "[out#0/mp4 @ 0x...] " that names the muxer
        last = said[-1].split("] ", 1)[-1]
    else:
        last = "it wrote nothing" if process.returncode == 0 else f"exit status {process.returncode}"
    code = next((c for c in FFMPEG_ERRNOS if os.strerror(c) in "\n".join(said)), None)
    if code is not None:
        raise OSError(code, os.strerror(code))
    raise RuntimeError(f"ffmpeg could not write {path} ({last}): write a .gif, or check the frames' size")


# a GIF frame shorter than this plays for 100 ms in browsers: GIFs go no faster than 50 fps
GIF_MIN_MS = 20


def gif_durations(frames: int, fps: int) -> list[int]:
    """Each frame's duration in ms for a GIF at ``fps``: a GIF counts time in hundredths of a second, so 16 fps (6.25)
    alternates 60 and 70 ms, as the rounded running time says, rather than playing every frame for 60 (16.7 fps).
    Above 50 fps every frame gets ``GIF_MIN_MS``."""
    step = max(100 / fps, GIF_MIN_MS / 10)
    ends = [round(i * step) for i in range(frames + 1)]
    return [10 * (ends[i + 1] - ends[i]) for i in range(frames)]


def write_video(frames, path: str | Path, fps: int = 16) -> Path:
    """Write ``frames`` to ``path`` (.mp4 or .gif); returns the path. The file appears complete or not at all
    (written to a temporary file, then renamed) and gets the mode the umask gives new files."""
    path = check_writable(path)
    array = to_uint8_frames(frames)
    try:
        with atomic_path(path, suffix=path.suffix) as tmp:  # the suffix tells the writers which format to use
            if path.suffix.lower() == ".mp4":
                # H.264 in yuv420p needs an even width and height: an odd one gets its last row or column repeated
                pad = ((0, 0), (0, array.shape[1] % 2), (0, array.shape[2] % 2), (0, 0))
                _encode_mp4(np.pad(array, pad, mode="edge"), tmp, fps, path)
            else:
                from PIL import Image

                images = [Image.fromarray(f) for f in array]
                durations = gif_durations(len(images), fps)
                images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=durations, loop=0)
    except OSError as err:  # a full disk, a quota: the machine's error, said of the file it stopped
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
    return path

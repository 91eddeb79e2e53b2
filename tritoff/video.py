"""Writing generated frames: mp4 through imageio-ffmpeg when installed, else an animated GIF; never half-written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tritoff.atomic import atomic_path


def to_uint8_frames(frames) -> np.ndarray:
    """(F, H, W, 3) uint8 from a pipeline's frames: a tensor (F, C, H, W) or (F, H, W, C) in [0, 1], or a list of PIL
    images or arrays."""
    if isinstance(frames, torch.Tensor):
        array = frames.detach().float().cpu()
        if array.dim() == 5:
            array = array[0]
        if array.shape[1] in (1, 3) and array.shape[-1] not in (1, 3):
            array = array.permute(0, 2, 3, 1)
        array = array.numpy()
    else:
        array = np.stack([np.asarray(f) for f in frames])
    if array.dtype != np.uint8:
        array = (np.clip(array, 0, 1) * 255).round().astype(np.uint8)
    return array


def check_writable(path: str | Path) -> Path:
    """Fail early, in one line, if ``path`` cannot be written."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise FileNotFoundError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {path}: directory {parent} is not writable")
    return path


def write_video(frames, path: str | Path, fps: int = 16) -> Path:
    """Write ``frames`` to ``path`` (.mp4 needs imageio-ffmpeg; otherwise a .gif is written beside it); returns the
    path written. The file appears complete or not at all (written to a temporary file, then renamed)."""
    path = check_writable(path)
    array = to_uint8_frames(frames)
    if path.suffix.lower() == ".mp4":
        try:
            import imageio.v3 as iio
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            path = path.with_suffix(".gif")
    with atomic_path(path, suffix=path.suffix) as tmp:  # the suffix tells the writers which format to use
        if path.suffix.lower() == ".mp4":
            iio.imwrite(tmp, array, fps=fps, codec="libx264", macro_block_size=1)
        else:
            from PIL import Image

            images = [Image.fromarray(f) for f in array]
            images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=1000 // fps, loop=0)
    return path

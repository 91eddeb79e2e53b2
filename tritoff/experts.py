"""Wan 2.2's two experts: which of a run's steps each takes, as the pipeline picks them.

The pipeline calls its first expert (``transformer``, the high-noise one) at the steps whose timestep is at least
``boundary_ratio`` of the scheduler's train timesteps, and the second (``transformer_2``) at the others. How many
steps that gives each depends on the scheduler's shift as much as on the ratio: under the Wan team's defaults for
T2V-A14B (0.875, flow shift 12) the first expert takes 32 of 50 steps, under those for I2V-A14B (0.9, shift 5) 18 of
50. ``tritoff plan`` counts each expert's calls with it; the host budget holds the packs of the expert called most
first.
"""

from __future__ import annotations

import copy

# the steps a share is computed at, where the run's own are not known yet (enable): the pipelines' default
NOMINAL_STEPS = 50


def expert_steps(steps: int, boundary_ratio: float | None, scheduler=None) -> tuple[int, int]:
    """(the first expert's, the second's) denoiser calls in a run of ``steps`` steps: one per timestep of the scheduler
    (two per step for a second-order one), the first's those at least ``boundary_ratio`` of its train timesteps (all
    without a boundary: the pipeline then never calls the second). ``scheduler``: the pipeline's, left as it was;
    flow matching without shift where it is None or cannot set its timesteps alone (a dynamic shift needs the
    image's size)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    timesteps = None
    if scheduler is not None:
        scheduler = copy.deepcopy(scheduler)  # set_timesteps changes its state: the pipeline's own is not touched
        try:
            scheduler.set_timesteps(steps, device="cpu")
            timesteps = scheduler.timesteps
        except Exception:  # a dynamic shift needs the image's size; a scheduler's own argument checks
            pass
    if timesteps is None:
        scheduler = FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(steps, device="cpu")
        timesteps = scheduler.timesteps
    if boundary_ratio is None:
        return len(timesteps), 0
    first = int((timesteps >= boundary_ratio * scheduler.config.num_train_timesteps).sum())
    return first, len(timesteps) - first


def expert_shares(pipe) -> dict[str, float] | None:
    """{expert: the share of a run's steps it takes} of a pipeline with two experts (Wan 2.2), as its scheduler places
    the default 50 steps by its boundary (without one, the pipeline calls the first expert alone); None for any other
    target, or where its scheduler cannot say."""
    config = getattr(pipe, "config", None)
    boundary = getattr(config, "get", lambda key: None)("boundary_ratio")
    experts = [getattr(pipe, name, None) for name in ("transformer", "transformer_2")]
    if any(e is None for e in experts):
        return None
    if boundary is None:
        return {"transformer": 1.0, "transformer_2": 0.0}
    if not isinstance(boundary, (int, float)):
        return None
    try:
        first, second = expert_steps(NOMINAL_STEPS, float(boundary), getattr(pipe, "scheduler", None))
    except Exception:  # what no scheduler should do: the packs then keep the pipeline order
        return None
    return {"transformer": first / (first + second), "transformer_2": second / (first + second)}

"""tritoff/experts.py: Wan 2.2's steps are placed on its two experts as its pipeline places them."""

import math

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler, UniPCMultistepScheduler

from tritoff.experts import expert_shares, expert_steps
from tritoff.tiny import tiny_wan_pipeline

from .helpers import denoiser_calls


def _flow(shift: float):
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)


def _calls(pipe, steps: int) -> tuple[int, int]:
    """The timesteps at which the pipeline calls each expert in a run of ``steps`` steps."""
    counts = denoiser_calls(pipe, steps)
    return counts["transformer"] // 2, counts["transformer_2"] // 2  # CFG: two calls per timestep


def test_the_wan_teams_defaults_place_the_steps_by_the_shift_not_the_ratio_alone():
    # T2V-A14B: boundary 0.875 under a shift of 12; I2V-A14B: 0.9 under 5 (15 of 40 steps: the timesteps >= 900)
    assert expert_steps(50, 0.875, _flow(12.0)) == (32, 18) and expert_steps(40, 0.9, _flow(5.0)) == (15, 25)
    assert expert_steps(50, 0.875, _flow(1.0))[0] < expert_steps(50, 0.875, _flow(12.0))[0]
    scheduler = _flow(5.0)
    scheduler.set_timesteps(40)
    assert expert_steps(40, 0.9, scheduler)[0] == int((scheduler.timesteps >= 900).sum())


def test_without_a_boundary_the_first_expert_takes_every_step():
    assert expert_steps(50, None) == (50, 0) and expert_steps(50, None, _flow(5.0)) == (50, 0)
    assert expert_steps(10, 0.5) == expert_steps(10, 0.5, FlowMatchEulerDiscreteScheduler())  # default: no shift


def test_every_boundary_the_pipeline_takes_places_the_steps_as_it_does():
    # a boundary no timestep reaches (1.5, NaN) puts every step on the second expert, 1.0 all but the first; a
    # second-order scheduler calls the denoiser twice per step but the last (Heun: 2n - 1 calls)
    for boundary in (0.5, 1.0, 1.5, math.nan, 0.0):
        pipe = tiny_wan_pipeline(two_experts=True)
        pipe.register_to_config(boundary_ratio=boundary)
        assert expert_steps(4, boundary, pipe.scheduler) == _calls(pipe, 4), boundary
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.scheduler = FlowMatchHeunDiscreteScheduler(shift=7.0)
    first, second = expert_steps(4, 0.5, pipe.scheduler)
    assert (first, second) == _calls(pipe, 4) and first + second == 2 * 4 - 1


def test_a_scheduler_that_cannot_set_its_timesteps_alone_is_taken_as_plain_flow_matching():
    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)  # needs the image's `mu`
    assert expert_steps(10, 0.5, dynamic) == expert_steps(10, 0.5)
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.scheduler = dynamic
    first, second = expert_steps(50, 0.5)
    assert expert_shares(pipe) == {"transformer": first / 50, "transformer_2": second / 50}


def test_shares_leave_the_pipelines_scheduler_as_it_was():
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.scheduler.set_timesteps(3)
    before = pipe.scheduler.timesteps.clone()
    shares = expert_shares(pipe)
    assert torch.equal(pipe.scheduler.timesteps, before)
    assert shares["transformer"] == expert_steps(50, 0.5, pipe.scheduler)[0] / 50
    assert abs(sum(shares.values()) - 1) < 1e-9 and 0 < shares["transformer_2"] < shares["transformer"]


def test_only_a_pipeline_with_two_experts_has_shares():
    assert expert_shares(tiny_wan_pipeline()) is None  # one transformer
    pipe = tiny_wan_pipeline(two_experts=True)
    assert expert_shares(pipe.transformer) is None  # a module
    pipe.register_to_config(boundary_ratio=None)  # the pipeline then calls the first expert alone
    assert expert_shares(pipe) == {"transformer": 1.0, "transformer_2": 0.0}
    pipe.register_to_config(boundary_ratio="0.5")  # not a number: the pipeline itself cannot run
    assert expert_shares(pipe) is None

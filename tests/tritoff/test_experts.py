"""tritoff/experts.py: Wan 2.2's steps are placed on its two experts as its pipeline places them."""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from tritoff.experts import expert_shares, expert_steps
from tritoff.tiny import tiny_wan_pipeline


def _flow(shift: float):
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)


def test_the_wan_teams_defaults_place_the_steps_by_the_shift_not_the_ratio_alone():
    # T2V-A14B: boundary 0.875 under a shift of 12; I2V-A14B: 0.9 under 5 (15 of 40 steps: the timesteps >= 900)
    assert expert_steps(50, 0.875, _flow(12.0)) == 32 and expert_steps(40, 0.9, _flow(5.0)) == 15
    assert expert_steps(50, 0.875, _flow(1.0)) < expert_steps(50, 0.875, _flow(12.0))
    scheduler = _flow(5.0)
    scheduler.set_timesteps(40)
    assert expert_steps(40, 0.9, scheduler) == int((scheduler.timesteps >= 900).sum())


def test_without_a_boundary_the_first_expert_takes_every_step():
    assert expert_steps(50, None) == 50 and expert_steps(50, None, _flow(5.0)) == 50
    assert expert_steps(10, 0.5) == expert_steps(10, 0.5, FlowMatchEulerDiscreteScheduler())  # default: no shift


def test_shares_leave_the_pipelines_scheduler_as_it_was():
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.scheduler.set_timesteps(3)
    before = pipe.scheduler.timesteps.clone()
    shares = expert_shares(pipe)
    assert torch.equal(pipe.scheduler.timesteps, before)
    assert shares["transformer"] == expert_steps(50, 0.5, pipe.scheduler) / 50
    assert abs(sum(shares.values()) - 1) < 1e-9 and 0 < shares["transformer_2"] < shares["transformer"]


def test_only_a_pipeline_with_two_experts_and_a_boundary_has_shares():
    assert expert_shares(tiny_wan_pipeline()) is None  # one transformer
    pipe = tiny_wan_pipeline(two_experts=True)
    assert expert_shares(pipe.transformer) is None  # a module
    pipe.register_to_config(boundary_ratio=None)
    assert expert_shares(pipe) is None

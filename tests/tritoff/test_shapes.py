"""tritoff/shapes.py: the multiple a pipeline's height and width must be, from its configs."""

import pytest

from tritoff.shapes import check_dimensions, spatial_multiple, temporal_multiple

WAN_VAE = {"temperal_downsample": [False, True, True]}  # three 2x spatial stages
WAN_DIT = {"patch_size": [1, 2, 2]}


def test_the_multiple_is_the_vae_downscale_times_the_patch_size():
    assert spatial_multiple(WAN_VAE, WAN_DIT) == 16
    assert spatial_multiple({"block_out_channels": [128, 256, 512, 512]}, {"patch_size": 2}) == 16  # CogVideoX
    assert spatial_multiple({}, WAN_DIT) is None  # an unknown VAE: nothing is refused


def test_a_shape_off_the_multiple_names_the_two_nearest_that_work():
    check_dimensions(WAN_VAE, WAN_DIT, height=480, width=832)
    with pytest.raises(ValueError, match=r"^--width 830 is not a multiple of 16 .*; use 816 or 832$"):
        check_dimensions(WAN_VAE, WAN_DIT, "--", height=480, width=830)
    with pytest.raises(ValueError, match="height 8 is not a multiple of 16 .*; use 16 or 32"):
        check_dimensions(WAN_VAE, WAN_DIT, height=8)


def test_cogvideox_takes_frame_counts_whose_latent_frames_are_odd():
    # its VAE decodes the latent frames in pairs after an odd first batch: an even count comes out longer than asked,
    # and the pipeline returns every frame (5 frames asked, 8 made)
    import torch
    from diffusers import AutoencoderKLCogVideoX

    from tritoff.tiny import COGVIDEOX_VAE_TINY

    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(**COGVIDEOX_VAE_TINY).eval()
    channels = COGVIDEOX_VAE_TINY["latent_channels"]
    with torch.no_grad():
        made = {n: vae.decode(torch.randn(1, channels, n, 2, 2)).sample.shape[2] for n in (1, 2, 3, 4)}
    assert made == {1: 1, 2: 8, 3: 9, 4: 16}
    config = {**vae.config, "_class_name": "AutoencoderKLCogVideoX"}  # as saved
    for frames in (1, 9, 17, 49):
        check_dimensions(config, {}, frames=frames)
    message = r"^--frames 13 makes 4 latent frames, an even count, which AutoencoderKLCogVideoX decodes to 16 frames; "
    with pytest.raises(ValueError, match=message + "use 9 or 17$"):
        check_dimensions(config, {}, "--", frames=13)
    check_dimensions({"temporal_compression_ratio": 4}, {}, frames=13)  # another VAE of that key (HunyuanVideo's)


def test_a_frame_count_the_vae_would_round_names_the_two_nearest_that_work():
    assert temporal_multiple(WAN_VAE) == 4 and temporal_multiple({"temporal_compression_ratio": 4}) == 4  # CogVideoX
    assert temporal_multiple({"temperal_downsample": [False, False, False]}) == 1 and temporal_multiple({}) is None
    for frames in (1, 5, 81):
        check_dimensions(WAN_VAE, WAN_DIT, frames=frames)
    with pytest.raises(ValueError, match=r"^--frames 80 is not one more than a multiple of 4 .*; use 77 or 81$"):
        check_dimensions(WAN_VAE, WAN_DIT, "--", frames=80)
    with pytest.raises(ValueError, match="frames 50 .* use 49 or 53"):
        check_dimensions({"temporal_compression_ratio": 4}, {}, frames=50)
    check_dimensions({}, WAN_DIT, frames=80)  # an unknown VAE: nothing is refused


def test_a_wan_vae_that_states_its_scale_factors_is_read_as_its_pipeline_reads_it():
    # Wan 2.2 TI2V's VAE downscales 16x in space (WanPipeline: vae.config.scale_factor_spatial x patch size = 32)
    ti2v = {**WAN_VAE, "scale_factor_spatial": 16, "scale_factor_temporal": 4}
    assert spatial_multiple(ti2v, WAN_DIT) == 32 and temporal_multiple(ti2v) == 4
    with pytest.raises(ValueError, match="height 48 is not a multiple of 32 .*; use 32 or 64"):
        check_dimensions(ti2v, WAN_DIT, height=48)
    assert spatial_multiple({**WAN_VAE, "scale_factor_spatial": 8}, WAN_DIT) == 16  # Wan 2.1: as from its stages


def test_learned_positional_embeddings_take_their_sample_size_only():
    # CogVideoX-5B I2V: a table of 60x90 latents, 480x720 pixels through the VAE's 8x; the pipeline refuses any other
    # size at its first step, after loading and packing: refused before
    vae = dict(block_out_channels=(128, 256, 256, 512), temporal_compression_ratio=4)
    learned = dict(patch_size=2, use_learned_positional_embeddings=True, sample_height=60, sample_width=90)
    check_dimensions(vae, learned, "--", frames=49, height=480, width=720)
    check_dimensions(vae, learned, "--", frames=49, height=None, width=None)  # the pipeline's defaults
    with pytest.raises(ValueError, match=r"^--width 736: .* take one size of video, 480x720; use --width 720$"):
        check_dimensions(vae, learned, "--", frames=49, height=480, width=736)
    check_dimensions(vae, {**learned, "use_learned_positional_embeddings": False}, height=496, width=736)

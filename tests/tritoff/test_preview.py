"""``tritoff.plan``: a pipeline's per-phase plan from its configs alone, for a budget and a video shape."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

import tritoff
from tritoff.budget import parse_size

from .helpers import COG_CALL, denoiser_calls, wan

GiB = 2**30


@pytest.fixture(scope="module")
def wan14b_8gb():
    """Wan 2.1 T2V-14B (UMT5-XXL, the 14B transformer, the Wan VAE; meta, nothing read) at 8 GB, 480x832x81, loaded
    in bf16 as ``tritoff run`` loads it (decoding in fp32 needs tiles at 8 GB: docs/usage.md)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tritoff.plan("wan2.1-t2v-14b", "8GB", frames=81, height=480, width=832)


def test_wan_14b_fits_8gb_at_480p(wan14b_8gb):
    p = wan14b_8gb
    assert p.feasible and p.minimum_budget <= p.budget == parse_size("8GB")
    phases = {ph.components[0]: ph for ph in p.phases}
    assert set(phases) == {"text_encoder", "transformer", "vae"}
    assert all(0 < ph.gpu_peak_bytes <= p.budget for ph in phases.values())
    denoiser = phases["transformer"]
    assert denoiser.mode == "group" and denoiser.calls_per_run == 100  # 50 steps, CFG as two calls
    assert sum(denoiser.tiers.values()) == 40 and denoiser.tiers["stream"] > 0 and denoiser.streamed_bytes_per_call > 0
    # UMT5's 256k x 4096 table stays on the host: the text encoder's phase holds no 2 GiB unit
    assert phases["text_encoder"].gpu_peak_bytes < 8 * GiB


def test_the_activation_estimate_is_what_one_block_must_hold(wan14b_8gb):
    """The denoiser's peak is at least one feed-forward: its input, its 13824-wide hidden layer and the GELU of it,
    for 21 x 30 x 52 latent tokens in bf16; attention and the residual stream come on top, within a few x of it."""
    tokens = 21 * (480 // 16) * (832 // 16)
    feed_forward = tokens * (5120 + 2 * 13824) * 2
    estimate = next(ph for ph in wan14b_8gb.phases if ph.components == ["transformer"]).activation_bytes
    assert feed_forward < estimate < 2.5 * feed_forward


def test_720p_does_not_fit_8gb_and_the_minimum_it_names_does():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        too_small = tritoff.plan("wan2.1-t2v-14b", "8GB", frames=81, height=720, width=1280)
        assert not too_small.feasible and "transformer needs" in too_small.reason
        enough = tritoff.plan("wan2.1-t2v-14b", too_small.minimum_budget, frames=81, height=720, width=1280)
    assert enough.feasible and enough.minimum_budget == too_small.minimum_budget


def test_a_directory_plans_from_its_configs_as_enable_packs(tmp_path):
    from diffusers import WanPipeline

    wan().save_pretrained(tmp_path / "pipe")
    preview = tritoff.plan(tmp_path / "pipe", "1GB", frames=5, height=16, width=16, steps=2)
    pipe = WanPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.bfloat16)  # as `tritoff run` loads it
    engine = tritoff.enable(pipe, budget="1GB", progress=False, kernels="reference")
    assert preview.feasible and preview.host_bytes == sum(p.arena.nbytes for p in engine.packed.values())
    assert [ph.components[0] for ph in preview.phases] == ["text_encoder", "transformer", "vae"]


@pytest.mark.parametrize("mode", ["auto", "group", "leaf"])
def test_the_bytes_each_phase_uploads_when_entered_are_what_enable_uploads(tmp_path, mode):
    from diffusers import WanPipeline

    from tritoff.activations import CUDA_SLACK

    wan().save_pretrained(tmp_path / "pipe")
    budget = 19_000_000  # no two phases fit together: each is uploaded when entered, resident ones too
    call = dict(frames=5, height=16, width=16, steps=2, mode=mode)
    preview = tritoff.plan(tmp_path / "pipe", budget + CUDA_SLACK, **call)
    pipe = WanPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.bfloat16)
    engine = tritoff.enable(pipe, budget=budget, mode=mode, progress=False, kernels="reference")
    pipe(prompt="a cat", num_frames=5, height=16, width=16, num_inference_steps=2, max_sequence_length=16)
    stats = engine.stats["components"]
    entered = {p.components[0]: (p.mode, p.entry_bytes) for p in preview.phases}
    assert entered == {name: (stats[name]["mode"], stats[name]["entry_bytes"]) for name in entered}
    assert all(bytes_ > 0 for _, bytes_ in entered.values())
    assert ("layers bf16/fp8/stream" in preview.text()) == (mode == "leaf")  # leaf mode streams layers, not blocks


def test_a_directory_missing_a_models_config_or_with_a_broken_index_is_refused(tmp_path):
    """Not planned without the component (which would understate memory and say it fits)."""
    wan().save_pretrained(tmp_path / "pipe")
    (tmp_path / "pipe" / "transformer" / "config.json").unlink()
    with pytest.raises(ValueError, match=r"transformer/config\.json is missing: the plan needs every model's config"):
        tritoff.plan(tmp_path / "pipe", "1GB", frames=5, height=16, width=16)
    done = subprocess.run(
        [sys.executable, "-m", "tritoff", "plan", str(tmp_path / "pipe"), "--frames", "5", "--height", "16"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and "config.json is missing" in done.stderr
    assert done.stdout == ""
    with pytest.raises(ValueError, match=r"model_index\.json is a file: give the diffusers pipeline directory"):
        tritoff.plan(tmp_path / "pipe" / "model_index.json", "1GB")
    for broken in ("{not json", "[1, 2]"):
        (tmp_path / "pipe" / "model_index.json").write_text(broken)
        with pytest.raises(ValueError, match=r"model_index\.json (cannot be read|is not a pipeline index)"):
            tritoff.plan(tmp_path / "pipe", "1GB")
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModelX"]}
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"transformer is a diffusers\.WanTransformer3DModelX, which diffusers .* does"
    ):
        tritoff.plan(tmp_path / "pipe", "1GB")  # a class of a newer diffusers: not planned without it
    for spec, message in [
        (["diffusers", None], r"transformer is \['diffusers', None\], not \[library, class\]"),
        (["diffusers", "WanTransformer3DModel", "x"], r"transformer is \['diffusers', .*, 'x'\], not \[library, cl"),
        (["Diffusers", "WanTransformer3DModel"], r"transformer comes from Diffusers; tritoff plan builds diffusers"),
    ]:
        (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({**index, "transformer": spec}))
        with pytest.raises(ValueError, match=message):
            tritoff.plan(tmp_path / "pipe", "1GB")


def test_a_host_budget_smaller_than_the_packs_holds_what_enable_holds_and_reads_the_rest(tmp_path):
    from diffusers import WanPipeline

    wan().save_pretrained(tmp_path / "pipe")
    preview = tritoff.plan(tmp_path / "pipe", "1GB", host_budget="1MB", frames=5, height=16, width=16, steps=2)
    assert preview.feasible and preview.host_held_bytes <= 10**6 < preview.host_bytes
    pipe = WanPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.bfloat16)
    engine = tritoff.enable(pipe, budget="1GB", host_budget="1MB", spill_dir=tmp_path, progress=False)
    assert preview.host_held_bytes == engine.stats["total"]["host_arena_bytes"]
    # everything is resident at 1 GB and the phases fit together: nothing is read from disk once they are uploaded
    assert preview.as_dict()["disk_bytes_per_run"] == 0 and "read from disk" in preview.text()
    streaming = tritoff.plan("wan2.1-t2v-14b", "12GB", host_budget="8GB")
    transformer = next(p for p in streaming.phases if p.components == ["transformer"])
    assert streaming.feasible and streaming.host_held_bytes <= 8 * 10**9
    assert 0 < transformer.disk_bytes_per_call < transformer.streamed_bytes_per_call
    # a GPU budget too small for a phase: still a plan that says so, with the host budget named
    too_small = tritoff.plan("wan2.1-t2v-14b", "2GB", host_budget="8GB")
    assert not too_small.feasible and "host budget" in too_small.text() and "does not fit" in too_small.text()
    assert tritoff.plan("wan2.1-t2v-14b", "12GB", host_budget=0).host_held_bytes == 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["no-such-model"], "neither a local pipeline directory nor a preset"),
        (["cogvideox-5b", "--budget", "50%"], "--budget: give bytes"),
        (["cogvideox-5b", "--frames", "0"], "--frames: must be an integer from 1 to 10000"),
    ],
)
def test_bad_input_is_one_line(argv, message):
    done = subprocess.run([sys.executable, "-m", "tritoff", "plan", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and message in done.stderr, done.stderr


def test_the_command_exits_0_when_the_pipeline_fits(capsys):
    from tritoff import cli

    assert cli.main(["plan", "wan2.1-t2v-14b", "--budget", "12GB", "--frames", "1"]) == 0
    assert "fits; the smallest GPU budget" in capsys.readouterr().out


def test_the_command_prints_json_with_the_promised_fields():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tritoff",
            "plan",
            "cogvideox-5b",
            "--budget",
            "12GB",
            "--frames",
            "49",
            "--width",
            "720",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert "tracing activations" in done.stderr  # seconds per component at this size: the bar says what is running
    data = json.loads(done.stdout)
    # CogVideoX's VAE decodes 49 frames untiled with ~17 GiB of activations: 12 GB is too small, and it says so, in
    # the exit code too (a script asks before it downloads)
    assert data["feasible"] is False and data["minimum_budget"] > data["budget"] and "vae needs" in data["reason"]
    assert done.returncode == 1, done.stderr
    assert data["host_bytes"] > 4 * GiB
    for phase in data["phases"]:
        assert {"components", "gpu_peak_bytes", "activation_bytes", "streamed_bytes_per_call"} <= set(phase)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(prefetch=0), r"prefetch must be an integer >= 1, got 0"),
        (dict(prefetch=2.5), r"prefetch must be an integer >= 1, got 2\.5"),
        (dict(frames=True), r"frames must be an integer from 1 to 10000, got True"),
        # past them a plan would trace the VAE's decode for hours, frame by frame
        (dict(frames=400_000_000_001), r"frames must be an integer from 1 to 10000, got 400000000001"),
        (dict(steps=10**20), r"steps must be an integer from 1 to 1000"),
        (dict(vae_dtype="fp32"), r"vae_dtype must be a torch dtype such as torch\.float32, got 'fp32'"),
    ],
)
def test_options_enable_would_refuse_are_refused_by_the_plan_too(options, message):
    # a plan that accepted them would call budgets feasible that no engine could run
    with pytest.raises(ValueError, match=message):
        tritoff.plan("wan2.1-t2v-14b", **options)


def test_a_module_given_as_the_target_is_refused_in_one_line():
    with pytest.raises(ValueError, match="target must be a preset name or a pipeline directory, got Linear"):
        tritoff.plan(torch.nn.Linear(2, 2))


def test_experts_of_one_architecture_are_traced_once(tmp_path, monkeypatch):
    from tritoff import preview
    from tritoff.tiny import tiny_wan_pipeline

    tiny_wan_pipeline(two_experts=True).save_pretrained(tmp_path / "pipe")
    traced = []
    real = preview.reserve_bytes
    monkeypatch.setattr(preview, "reserve_bytes", lambda twin, *a, **k: traced.append(twin) or real(twin, *a, **k))
    p = tritoff.plan(str(tmp_path / "pipe"), "64MB", frames=5, height=32, width=32, progress=False)
    experts = [ph for ph in p.phases if ph.components[0].startswith("transformer")]
    assert len(experts) == 2 and len(traced) == 3  # text encoder, one expert, VAE
    assert experts[0].activation_bytes == experts[1].activation_bytes > 0


def _ti2v(expand_timesteps: bool = True):
    """Wan 2.2 TI2V-5B as its text-to-video WanPipeline: 48 latent channels, a 16x spatial VAE, a timestep per
    token."""
    from diffusers import WanPipeline

    from tritoff.tiny import tiny_wan22_ti2v_pipeline

    parts = tiny_wan22_ti2v_pipeline().components
    parts = {k: parts[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")}
    return WanPipeline(**parts, expand_timesteps=expand_timesteps)


@pytest.mark.parametrize("pipeline", ["wan22-ti2v", "cogvideox", "cogvideox-1.5"])
def test_latents_are_shaped_from_the_vae_and_denoiser_configs(tmp_path, pipeline):
    # Wan 2.2 TI2V-5B; the tiny CogVideoX: 4 channels and a 16-token prompt; CogVideoX 1.5: 3 latent frames, which
    # its pipeline pads to its frame patch of 2. Every call is traced, so what the plan reserves does not depend on
    # the budget
    from tritoff.tiny import tiny_cogvideox_pipeline

    if pipeline == "cogvideox":
        pipe = tiny_cogvideox_pipeline()
    elif pipeline == "cogvideox-1.5":
        pipe = tiny_cogvideox_pipeline(
            attention_head_dim=16,
            patch_size_t=2,
            use_rotary_positional_embeddings=True,
            use_learned_positional_embeddings=False,
        )
    else:
        pipe = _ti2v()
    pipe.save_pretrained(tmp_path / "pipe")
    shape = dict(frames=9, height=32, width=32, progress=False)
    small, large = (tritoff.plan(str(tmp_path / "pipe"), budget, **shape) for budget in ("1GB", "4GB"))
    assert small.untraced == {} and small.feasible, small.text()
    assert [p.activation_bytes for p in small.phases] == [p.activation_bytes for p in large.phases]
    assert small.minimum_budget == large.minimum_budget < parse_size("1GB")


def test_a_timestep_per_token_is_traced_as_the_pipeline_passes_it(tmp_path):
    # Wan 2.2 TI2V's pipeline (expand_timesteps) embeds a timestep per token: its denoiser holds more activations
    from tritoff import preview
    from tritoff.activations import meta_twin, reserve_bytes

    shape = dict(frames=9, height=64, width=64, progress=False)
    reserves = {}
    for expand in (False, True):
        _ti2v(expand).save_pretrained(tmp_path / str(expand))
        plan = tritoff.plan(str(tmp_path / str(expand)), "1GB", **shape)
        reserves[expand] = next(p.activation_bytes for p in plan.phases if p.components == ["transformer"])
    transformer = _ti2v().transformer
    calls = preview.PipelineCalls(expand_timesteps=True)
    geometry = preview._geometry("wan", {"transformer": transformer, "vae": _ti2v().vae}, calls)
    [(method, args, kwargs)], _, _ = preview._calls("wan", geometry, "transformer", transformer, 9, 64, 64)
    assert tuple(kwargs["timestep"].shape) == (1, 3 * 2 * 2)  # 3 latent frames of 4x4, in 2x2 patches
    assert reserves[True] == reserve_bytes(meta_twin(transformer), args, kwargs, method) > reserves[False]


@pytest.mark.parametrize("patch_size_t", [None, 2], ids=["cogvideox-1.0", "cogvideox-1.5"])
def test_the_denoiser_is_traced_with_the_rotary_table_the_pipeline_passes(tmp_path, patch_size_t):
    # CogVideoX's pipeline passes (cos, sin) per video token; rotating q and k makes fp32 temporaries of their size
    # (187 MiB more peak for CogVideoX-5B at 49x480x720). The plan traces the call the pipeline makes, as the engine
    # traces it when it runs (17 frames: 5 latent frames, which CogVideoX 1.5 pads to 6 for its time patches)
    from tritoff import preview
    from tritoff.activations import meta_twin, reserve_bytes
    from tritoff.tiny import tiny_cogvideox_pipeline

    rotary = dict(attention_head_dim=16, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False)
    pipe = tiny_cogvideox_pipeline(patch_size_t=patch_size_t, **rotary)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    pipe(**{**COG_CALL, "num_frames": 17, "height": 32, "width": 48, "num_inference_steps": 1})
    args, kwargs = calls[0]
    geometry = preview._geometry("cogvideox", {"transformer": pipe.transformer, "vae": pipe.vae})
    [call], _, _ = preview._calls("cogvideox", geometry, "transformer", pipe.transformer, 17, 32, 48)
    planned = call.kwargs["image_rotary_emb"]
    assert [(t.shape, t.dtype) for t in planned] == [(t.shape, t.dtype) for t in kwargs["image_rotary_emb"]]
    pipe.save_pretrained(tmp_path / "pipe")
    plan = tritoff.plan(str(tmp_path / "pipe"), "1GB", frames=17, height=32, width=48, progress=False)
    reserved = next(p.activation_bytes for p in plan.phases if p.components == ["transformer"])
    assert reserved == reserve_bytes(meta_twin(pipe.transformer), args, kwargs)


def test_a_call_that_cannot_be_traced_is_named_and_the_plan_does_not_say_it_fits(tmp_path):
    # the tiny Wan's rotary table holds 32 positions a side: a video 64 patches wide is more than the model can run
    wan().save_pretrained(tmp_path / "pipe")
    shape = dict(frames=5, height=32, width=1024, progress=False)
    preview = tritoff.plan(str(tmp_path / "pipe"), "4GB", **shape)
    assert list(preview.untraced) == ["transformer"] and not preview.feasible
    assert preview.reason.startswith("transformer's call could not be traced on the meta device at this shape (")
    row = next(line for line in preview.text().splitlines() if line.lstrip().startswith("transformer"))
    assert "unknown" in row and preview.text().endswith("plus the activations of transformer")
    data = json.loads(preview.json())
    assert data["untraced"] == preview.untraced
    assert [p["activation_bytes"] is None for p in data["phases"]] == [False, True, False]
    # its activations are left out, not guessed from the budget
    assert tritoff.plan(str(tmp_path / "pipe"), "1GB", **shape).minimum_budget == preview.minimum_budget
    assert tritoff.plan(str(tmp_path / "pipe"), "4GB", **{**shape, "width": 512}).feasible
    # a patch size of two entries (height and width) is read as one frame by those
    config = json.loads((tmp_path / "pipe" / "transformer" / "config.json").read_text())
    (tmp_path / "pipe" / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": [2, 2]}))
    odd = tritoff.plan(str(tmp_path / "pipe"), "4GB", **{**shape, "width": 512})
    assert odd.feasible or list(odd.untraced) == ["transformer"]


def test_a_plan_that_does_not_fit_names_what_lowers_its_minimum_and_that_works(tmp_path):
    wan().save_pretrained(tmp_path / "pipe")
    # blocks large enough for their ring to be most of the transformer's phase (a plan reads configs, not weights)
    config = json.loads((tmp_path / "pipe" / "transformer" / "config.json").read_text())
    config.update(num_attention_heads=16, attention_head_dim=64, ffn_dim=4096, num_layers=6)
    (tmp_path / "pipe" / "transformer" / "config.json").write_text(json.dumps(config))
    shape = dict(frames=5, height=32, width=32, progress=False)
    too_small = tritoff.plan(str(tmp_path / "pipe"), "1MB", prefetch=3, **shape)
    alternatives = too_small.alternatives
    assert not too_small.feasible and set(alternatives) == {"prefetch", "mode", "together"}, too_small.text()
    assert json.loads(too_small.json())["alternatives"] == json.loads(json.dumps(alternatives))
    assert f"prefetch={alternatives['prefetch'][0]} needs only" in too_small.text().splitlines()[-1]
    # as the command line spells its options (tritoff plan)
    verdict = too_small.text(flags=True).splitlines()[-1]
    assert f"--prefetch {alternatives['prefetch'][0]} needs only" in verdict and "prefetch=" not in verdict
    for option, (value, minimum) in alternatives.items():
        assert minimum < too_small.minimum_budget
        together = option == "together"
        options = dict(mode=value[0], prefetch=value[1]) if together else {"prefetch": 3, option: value}
        assert tritoff.plan(str(tmp_path / "pipe"), minimum, **options, **shape).feasible
        assert not tritoff.plan(str(tmp_path / "pipe"), minimum - 1, **options, **shape).feasible
    fits = tritoff.plan(str(tmp_path / "pipe"), too_small.minimum_budget, prefetch=3, **shape)
    assert fits.feasible and fits.alternatives == {}


def _recorded_calls(pipe, names):
    """Run ``pipe``'s components named in ``names`` with their calls recorded: {name: [(method, args, kwargs)]}."""
    calls = {name: [] for name in names}
    for name in names:
        module = getattr(pipe, name)
        if name.startswith("vae"):
            for method in ("encode", "decode"):
                original = getattr(module, method)

                def record(*args, _name=name, _method=method, _original=original, **kwargs):
                    calls[_name].append((_method, args, kwargs))
                    return _original(*args, **kwargs)

                setattr(module, method, record)
        else:
            module.register_forward_pre_hook(
                lambda m, args, kwargs, _name=name: calls[_name].append(("forward", args, kwargs)), with_kwargs=True
            )
    return calls


def _tensor_shapes(args, kwargs):
    """The shape of each tensor of a call, and its dtype but for the timestep's (a scheduler's float, planned as an
    integer: its embedding casts it either way)."""
    shapes = [(i, tuple(a.shape), a.dtype) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for key, value in sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            shapes.append((key, tuple(value.shape), None if key == "timestep" else value.dtype))
    return shapes


@pytest.mark.parametrize("pipeline", ["wan21-i2v", "wan22-ti2v", "cogvideox-i2v"])
def test_an_image_to_video_pipeline_is_planned_with_the_calls_it_makes(tmp_path, pipeline):
    # the image encoder's call (Wan 2.1), the VAE's encode of the image (as the first frame of a video of zeros for
    # Wan 2.1, one frame for Wan 2.2 TI2V and CogVideoX) beside its decode, the denoiser with the image latents
    # concatenated and the image's hidden states: each as the pipeline calls it, and the plan reserves the largest
    # of a component's calls
    from PIL import Image

    from tritoff import preview
    from tritoff.activations import meta_twin, reserve_bytes
    from tritoff.tiny import tiny_cogvideox_i2v_pipeline, tiny_wan22_ti2v_pipeline, tiny_wan_i2v_pipeline

    factory, frames, size = {
        "wan21-i2v": (tiny_wan_i2v_pipeline, 5, 16),
        "wan22-ti2v": (tiny_wan22_ti2v_pipeline, 5, 32),
        "cogvideox-i2v": (tiny_cogvideox_i2v_pipeline, 9, 64),
    }[pipeline]
    from diffusers import DiffusionPipeline

    factory().save_pretrained(tmp_path / "pipe")
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.bfloat16)  # as `tritoff run` loads
    names = [n for n in ("image_encoder", "transformer", "vae") if getattr(pipe, n, None) is not None]
    recorded = _recorded_calls(pipe, names)
    image = Image.new("RGB", (size, size), (90, 140, 200))
    pipe(
        prompt="a cat",
        negative_prompt="blurry",
        image=image,
        num_frames=frames,
        height=size,
        width=size,
        num_inference_steps=1,
        # the prompt's tokens the plan takes: Wan's 512, the CogVideoX transformer's own
        max_sequence_length=pipe.transformer.config.get("max_text_seq_length", 512),
        output_type="pt",
    )
    family, components, _, calls = preview._load_directory(tmp_path / "pipe")
    assert calls.image_to_video
    plan = tritoff.plan(str(tmp_path / "pipe"), "1GB", frames=frames, height=size, width=size, progress=False)
    assert plan.feasible and plan.untraced == {}, plan.text()
    reserved = {p.components[0]: p.activation_bytes for p in plan.phases}
    assert set(names) < set(reserved)
    geometry = preview._geometry(family, components, calls)
    for name in names:
        planned, _, _ = preview._calls(family, geometry, name, components[name], frames, size, size)
        made = recorded[name][: len(planned)]  # the denoiser's first call: the others repeat it
        assert [(c.method, _tensor_shapes(c.args, c.kwargs)) for c in planned] == [
            (method, _tensor_shapes(args, kwargs)) for method, args, kwargs in made
        ], name
        module = getattr(pipe, name)
        largest = max(reserve_bytes(meta_twin(module), args, kwargs, method) for method, args, kwargs in made)
        assert reserved[name] == largest > 0, name
    if pipeline == "wan21-i2v":  # the whole video of the first frame and zeros: more than the one frame
        encode, decode = recorded["vae"][0], recorded["vae"][-1]
        assert encode[0] == "encode" and encode[1][0].shape[2] == frames and decode[0] == "decode"


@pytest.mark.parametrize("steps", [1, 4, 7])
def test_wan22s_steps_are_placed_on_its_experts_as_the_pipeline_places_them(tmp_path, steps):
    # the tiny Wan 2.2's boundary (0.5 of the train timesteps) under its scheduler's shift of 7: the high-noise expert
    # takes more than half of the steps, as the real pipeline's does
    from tritoff.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=True)
    counts = denoiser_calls(pipe, steps)
    pipe.save_pretrained(tmp_path / "pipe")
    plan = tritoff.plan(str(tmp_path / "pipe"), "1GB", frames=5, height=16, width=16, steps=steps, progress=False)
    planned = {p.components[0]: p.calls_per_run for p in plan.phases if p.components[0] in counts}
    assert planned == counts and sum(counts.values()) == 2 * steps
    if steps == 7:
        assert counts["transformer"] > counts["transformer_2"] > 0


def test_the_wan22_i2v_preset_places_its_steps_by_the_wan_teams_shift_and_boundary():
    # I2V-A14B: boundary 0.9 under a flow shift of 5, 15 of 40 steps on the first expert
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = tritoff.plan("wan2.2-i2v-a14b", "12GB", frames=81, height=480, width=832, steps=40)
    calls = {p.components[0]: p.calls_per_run for p in plan.phases}
    assert calls["transformer"] == 2 * 15 and calls["transformer_2"] == 2 * 25


def test_the_ti2v_preset_is_planned_with_a_timestep_per_token_and_its_vaes_16x_downscale(monkeypatch):
    # Wan 2.2 TI2V-5B: 704x1280 makes 44x80 latents (16x) and 22x40 patches, so 5 frames (2 latent frames) make 1760
    # tokens; each gets its own timestep embedding, which the transformer's reserve holds on top of the same preset
    # planned with one timestep per call
    from tritoff import presets

    shape = dict(frames=5, height=704, width=1280, steps=2)
    reserves = {}
    for expand in (True, False):
        ti2v = presets.PRESETS["wan2.2-ti2v-5b"]._replace(expand_timesteps=expand)
        monkeypatch.setitem(presets.PRESETS, "wan2.2-ti2v-5b", ti2v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = tritoff.plan("wan2.2-ti2v-5b", "12GB", **shape)
        reserves[expand] = next(p.activation_bytes for p in plan.phases if p.components == ["transformer"])
    # per token at least the six modulation projections of 3072 values, in fp32 (the time embedder stays fp32)
    assert reserves[True] - reserves[False] >= 1760 * 6 * 3072 * 4
    with pytest.raises(ValueError, match="height 720 is not a multiple of 32"):
        tritoff.plan("wan2.2-ti2v-5b", "12GB", frames=5, height=720, width=1280)


def test_a_scheduler_the_plan_cannot_build_leaves_the_split_to_plain_flow_matching(tmp_path):
    # a scheduler class this diffusers lacks, or one needing the image's `mu`: the experts' split is an estimate
    # (flow matching without shift), the plan itself goes on
    from tritoff.experts import expert_steps
    from tritoff.tiny import tiny_wan_pipeline

    tiny_wan_pipeline(two_experts=True).save_pretrained(tmp_path / "pipe")
    index_file = tmp_path / "pipe" / "model_index.json"
    index = json.loads(index_file.read_text())
    shape = dict(frames=5, height=16, width=16, steps=10, progress=False)
    first, second = expert_steps(10, 0.5)
    cases = ((["diffusers", "NoSuchScheduler"], None), (index["scheduler"], {"use_dynamic_shifting": True}))
    for spec, config in cases:
        index_file.write_text(json.dumps({**index, "scheduler": spec}))
        if config is not None:
            path = tmp_path / "pipe" / "scheduler" / "scheduler_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        plan = tritoff.plan(str(tmp_path / "pipe"), "1GB", **shape)
        calls = {p.components[0]: p.calls_per_run for p in plan.phases}
        assert plan.feasible and (calls["transformer"], calls["transformer_2"]) == (2 * first, 2 * second)


def test_a_boundary_that_is_not_a_number_is_refused_in_one_line(tmp_path):
    from tritoff.tiny import tiny_wan_pipeline

    tiny_wan_pipeline(two_experts=True).save_pretrained(tmp_path / "pipe")
    index_file = tmp_path / "pipe" / "model_index.json"
    index = json.loads(index_file.read_text())
    for boundary in ("0.5", [0.5]):
        index_file.write_text(json.dumps({**index, "boundary_ratio": boundary}))
        with pytest.raises(ValueError, match=r"boundary_ratio is .*, not a number: the pipeline cannot run with it$"):
            tritoff.plan(str(tmp_path / "pipe"), "1GB", frames=5, height=16, width=16, progress=False)


def test_an_image_encoder_the_denoiser_takes_nothing_from_is_never_called(tmp_path):
    # Wan 2.2 I2V's transformer has no image embedding: its pipeline calls an image encoder left in it never
    from diffusers import WanImageToVideoPipeline

    from tritoff.tiny import tiny_wan_i2v_pipeline, tiny_wan_transformer

    parts = tiny_wan_i2v_pipeline().components
    parts["transformer"] = tiny_wan_transformer(in_channels=36).eval()
    WanImageToVideoPipeline(**parts).save_pretrained(tmp_path / "pipe")
    plan = tritoff.plan(str(tmp_path / "pipe"), "1GB", frames=5, height=16, width=16, progress=False)
    phase = next(p for p in plan.phases if p.components == ["image_encoder"])
    assert plan.feasible and phase.calls_per_run == 0 and phase.activation_bytes == 0


def test_a_second_order_scheduler_calls_the_denoiser_at_each_of_its_timesteps(tmp_path):
    # Heun: two calls per step but the last (2n - 1), each with CFG's two
    from diffusers import FlowMatchHeunDiscreteScheduler

    from tritoff.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    pipe.scheduler = FlowMatchHeunDiscreteScheduler(shift=7.0)
    made = denoiser_calls(pipe, 3)["transformer"]
    pipe.save_pretrained(tmp_path / "pipe")
    plan = tritoff.plan(str(tmp_path / "pipe"), "1GB", frames=5, height=16, width=16, steps=3, progress=False)
    planned = next(p.calls_per_run for p in plan.phases if p.components == ["transformer"])
    assert planned == made == 2 * (2 * 3 - 1)

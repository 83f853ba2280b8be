"""End-to-end parity of the Wan image-to-video runners with diffusers' `WanImageToVideoPipeline`.

Three request paths, each run by both libraries on the same weights and compared on the decoded
video: Wan2.1 i2v (CLIP tokens + `y`), Wan2.2 MoE i2v (two experts, `y` only, a CFG scale per
expert) and Wan2.1 flf2v (first and last frame). A wrong stitch between the pieces (mask order or
channels of `y`, the conditioning clip, CLIP tokens on one CFG branch only, the expert or scale of
a step, the initial noise) fails here; test_transformer_i2v.py and test_conditioning.py check the
pieces one at a time.

Setup, as _pipeline_parity.py (the t2v parity test): tiny architectures of
configs/wan/*_tiny.json, float32, CPU; one synthetic diffusers-layout checkpoint written by
runnerkit's own writer, read by runnerkit's loader on one side and by diffusers/transformers
classes on the other; runnerkit runs with `scheduler_spacing` "diffusers"; the initial noise is
drawn here from the scheduler contract (one float32 CPU `randn` seeded with the request seed) and
handed to diffusers as `latents=`.

Images: the conditioning images are PNGs already at the video size (48 x 80 for the 48 x 80 area:
`wan_resize_shape` keeps it), so Wan's bicubic resize and diffusers' PIL resize both leave the
pixels as read. CLIP: diffusers crops through `CLIPImageProcessor`, Wan squashes the whole frame
(`clip_preprocess`), so diffusers gets runnerkit's CLIP tokens through `encode_image` (diffusers
0.42 refuses `image` together with `image_embeds`, and it needs `image` for `y`); runnerkit's
tokens are checked separately against transformers' `CLIPVisionModel` on Wan-preprocessed pixels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.images import read_image, write_image
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import write_synthetic
from runnerkit.models.wan.clip import clip_preprocess
from runnerkit.models.wan.i2v import wan_resize_shape
from runnerkit.models.wan.moe import WanMoERunner
from runnerkit.models.wan.moe_checkpoint import write_synthetic_moe
from runnerkit.registry import get_runner_cls
from test_cases._reference import require_reference
from test_cases.models.wan._pipeline_parity import _diffusers_model

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")
from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CONFIGS = {name: json.loads((REPO / "configs" / "wan" / f"{file}.json").read_text())
           for name, file in (("i2v", "wan_i2v_tiny"), ("moe_i2v", "wan22_moe_i2v_tiny"), ("flf2v", "wan_flf2v_tiny"))}

# Non-square (catches a height/width swap); 9 frames = 3 latent frames, so flf2v has a middle frame.
HEIGHT, WIDTH, FRAMES = 48, 80, 9
STEPS = 4  # >= 3: UniPC reaches its second-order predictor and corrector
SEED = 7
PROMPT = "a red fox running through fresh snow"
NEGATIVE_PROMPT = "blurry, low quality"  # explicit on both sides (runnerkit's default is Wan's Chinese one)
MOE_GUIDANCE = (4.0, 3.0)  # [high-noise, low-noise]: distinct, so a swapped or shared scale fails
MOE_BOUNDARY = 0.9  # Wan2.2 i2v A14B; 4 steps, shift 5 (diffusers spacing): timesteps 999 937 | 833 625
VIDEO_TOL = 1e-4  # max abs difference of the videos in [-1, 1]
INPUT_TOL = 1e-5  # max abs difference of y and of the CLIP tokens


def arch_of(name: str) -> WanArch:
    model = CONFIGS[name]["model"]
    if name == "moe_i2v":  # Wan2.2 i2v experts take no CLIP tokens (what the MoE runner's parse_arch adds)
        return WanMoERunner.parse_arch(model)
    return WanArch.model_validate(model)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny architecture's random weights in the diffusers layout, float32."""
    root = tmp_path_factory.mktemp("i2v_parity")
    return {
        "i2v": write_synthetic(arch_of("i2v"), root / "i2v", seed=0, dtype=torch.float32, layout="diffusers"),
        "flf2v": write_synthetic(arch_of("flf2v"), root / "flf2v", seed=0, dtype=torch.float32, layout="diffusers"),
        "moe_i2v": write_synthetic_moe(arch_of("moe_i2v"), root / "moe_i2v", seed=0, dtype=torch.float32,
                                       layout="diffusers", boundary=MOE_BOUNDARY),
    }


def make_image(path: Path, seed: int) -> Path:
    """A varied RGB PNG at the video size: smooth gradients plus noise (8-bit, so both readers agree)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.linspace(-1, 1, HEIGHT)[:, None].expand(HEIGHT, WIDTH)
    x = torch.linspace(-1, 1, WIDTH)[None, :].expand(HEIGHT, WIDTH)
    base = torch.stack([x * y, torch.sin(3 * x + seed), torch.cos(4 * y - seed)])  # [3, H, W]
    write_image(path, (0.7 * base + 0.3 * torch.rand(3, HEIGHT, WIDTH, generator=gen) * 2 - 0.3).clamp(-1, 1))
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("i2v_images")
    return {"first": make_image(root / "first.png", 1), "last": make_image(root / "last.png", 2)}


def initial_noise(z_dim: int) -> torch.Tensor:
    """The request's noise, per the scheduler contract: one float32 CPU draw of [1, z, f, h, w]."""
    shape = (1, z_dim, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(SEED), dtype=torch.float32)


def run_runnerkit(name: str, ckpt: Path, images: dict[str, Path], out: Path, mocker: Any,
                  **overrides: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The runner's video [3, F, H, W] in [-1, 1] through its public API, and the image inputs its
    stages produced (`clip_context` when the transformer takes CLIP tokens, `y`)."""
    data = {**CONFIGS[name], "model_path": str(ckpt), "device": "cpu", "scheduler_spacing": "diffusers",
            "infer_steps": STEPS, **overrides}
    data.pop("synthetic_checkpoint")
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    # Spies before init_modules: the pipeline's stages bind the image conditioning's methods when it is described.
    spies = {key: mocker.spy(runner.images, method) for key, method in
             (("clip_context", "run_image_encoder"), ("y", "run_vae_encoder"))}
    runner.init_modules()
    runner.run_pipeline(RequestConfig(
        prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, seed=SEED, target_height=HEIGHT, target_width=WIDTH,
        target_video_length=FRAMES, image_path=str(images["first"]),
        last_frame_path=str(images["last"]) if name == "flf2v" else None, save_tensor_path=str(out)), 0)
    captured = {key: getattr(spy.spy_return, key).clone() for key, spy in spies.items() if spy.call_count}
    assert spies["y"].call_count == 1
    return load_file(str(out))["video"], captured


def reference_scheduler(shift: float) -> Any:
    """As the Wan-AI/Wan2.1-I2V-*-Diffusers and Wan2.2-I2V-A14B-Diffusers folders ship it, with `shift`."""
    return diffusers.UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
        solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero")


def open_rgb(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def run_diffusers(name: str, ckpt: Path, images: dict[str, Path], clip_context: torch.Tensor | None, mocker: Any,
                  **call: Any) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """WanImageToVideoPipeline's video [3, F, H, W] in [-1, 1], its condition `y` and the images its
    `encode_image` was asked to encode (answered with runnerkit's `clip_context`)."""
    arch = arch_of(name)
    text_encoder = transformers.UMT5EncoderModel.from_pretrained(ckpt / "text_encoder", dtype=torch.float32).eval()
    experts = {"transformer": _diffusers_model(diffusers.WanTransformer3DModel, ckpt / "transformer")}
    if name == "moe_i2v":
        experts["transformer_2"] = _diffusers_model(diffusers.WanTransformer3DModel, ckpt / "transformer_2")
    pipe = diffusers.WanImageToVideoPipeline(
        tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt / "tokenizer"), text_encoder=text_encoder,
        vae=_diffusers_model(diffusers.AutoencoderKLWan, ckpt / "vae"),
        scheduler=reference_scheduler(float(CONFIGS[name]["sample_shift"])), image_encoder=None, image_processor=None,
        boundary_ratio=MOE_BOUNDARY if name == "moe_i2v" else None, **experts)
    pipe.set_progress_bar_config(disable=True)
    # diffusers 0.42's i2v `basic_clean` calls ftfy unguarded (not a dependency here); WanPipeline's own
    # `basic_clean` (ftfy only when installed) is what the t2v parity test runs. ASCII prompts: no change.
    mocker.patch.object(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)

    encoded: list[Any] = []

    def encode_image(image: Any, device: Any = None) -> torch.Tensor:
        encoded.append(image)
        assert clip_context is not None, "a transformer without CLIP tokens asked for image embeddings"
        return clip_context.view(-1, 257, clip_context.shape[-1])  # [n_frames, 257, 1280]: diffusers' batch of images

    pipe.encode_image = encode_image
    conditions: list[torch.Tensor] = []
    prepare_latents = pipe.prepare_latents

    def prepare_and_record(*args: Any, **kwargs: Any) -> Any:
        latents, condition = prepare_latents(*args, **kwargs)
        conditions.append(condition.clone())
        return latents, condition

    pipe.prepare_latents = prepare_and_record
    first = open_rgb(images["first"])
    last = open_rgb(images["last"]) if name == "flf2v" else None
    with torch.inference_mode():
        frames = pipe(image=first, last_image=last, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=HEIGHT,
                      width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS, latents=initial_noise(arch.vae.z_dim),
                      output_type="pt", max_sequence_length=arch.text_encoder.text_len, **call).frames
    assert tuple(frames.shape) == (1, FRAMES, 3, HEIGHT, WIDTH), frames.shape
    assert len(conditions) == 1
    video = frames[0].permute(1, 0, 2, 3).float() * 2 - 1  # [1, F, 3, H, W] in [0, 1] -> [3, F, H, W] in [-1, 1]
    return video, conditions[0], encoded


def hf_clip_tokens(ckpt: Path, image_paths: list[Path]) -> torch.Tensor:
    """transformers CLIPVisionModel's penultimate hidden states of Wan-preprocessed frames -> [1, 257 n, 1280]."""
    model, info = transformers.CLIPVisionModel.from_pretrained(ckpt / "image_encoder", dtype=torch.float32,
                                                               output_loading_info=True)
    # runnerkit's file holds the blocks Wan runs: all but the last, which (like the final norm) is
    # past hidden_states[-2]; transformers leaves those randomly initialised, unused here.
    unused = (f"encoder.layers.{model.config.num_hidden_layers - 1}.", "post_layernorm.")
    assert info["missing_keys"] and all(k.removeprefix("vision_model.").startswith(unused) for k in info["missing_keys"])
    assert not any(info[k] for k in ("unexpected_keys", "mismatched_keys")), info
    size = model.config.image_size
    pixels = clip_preprocess(torch.stack([read_image(p, "image") for p in image_paths]), size)  # [n, 3, s, s]
    with torch.inference_mode():
        hidden = model.eval()(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]  # [n, 257, 1280]
    return hidden.reshape(1, -1, hidden.shape[-1])


def assert_meaningful(video: torch.Tensor) -> None:
    """A varied video, mostly inside the clamp range, so the comparison says something."""
    assert video.std().item() > 0.2
    assert (video.abs() >= 1).float().mean().item() < 0.2


def assert_y(ours: torch.Tensor, expected: torch.Tensor, last_frame: bool) -> None:
    """Both sides' `y`: [1, 4 + 16, F_lat, h, w], the temporal mask then the normalised VAE mean."""
    assert tuple(ours.shape) == tuple(expected.shape) == (1, 20, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    given = torch.zeros(4, (FRAMES - 1) // 4 + 1)  # the mask by (channel, latent frame)
    given[:, 0] = 1
    if last_frame:
        given[3, -1] = 1  # pixel frame F - 1 is the last channel of the last latent frame
    assert torch.equal(ours[0, :4, :, 0, 0], given), ours[0, :4, :, 0, 0]
    diff = (ours - expected).abs().max().item()
    assert diff <= INPUT_TOL, f"y: max abs difference {diff:.3g}"


def assert_videos_match(ours: torch.Tensor, expected: torch.Tensor, label: str) -> float:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (3, FRAMES, HEIGHT, WIDTH)
    assert_meaningful(expected)
    diff = (ours - expected).abs().max().item()
    assert diff <= VIDEO_TOL, f"{label}: max abs difference {diff:.3g} > {VIDEO_TOL}"
    return diff


def test_images_at_the_video_size_keep_their_size() -> None:
    assert wan_resize_shape(HEIGHT, WIDTH, HEIGHT * WIDTH) == (HEIGHT, WIDTH)
    assert {c["target_height"] * c["target_width"] for c in CONFIGS.values()} == {HEIGHT * WIDTH}


def test_wan21_i2v_runner_matches_diffusers_wan_image_to_video_pipeline(
        ckpts: dict[str, Path], images: dict[str, Path], tmp_path: Path, mocker: Any) -> None:
    ours, inputs = run_runnerkit("i2v", ckpts["i2v"], images, tmp_path / "video.safetensors", mocker)
    expected, y, encoded = run_diffusers("i2v", ckpts["i2v"], images, inputs["clip_context"], mocker,
                                         guidance_scale=float(CONFIGS["i2v"]["sample_guide_scale"]))

    clip = hf_clip_tokens(ckpts["i2v"], [images["first"]])
    assert tuple(inputs["clip_context"].shape) == (1, 257, 1280)
    clip_diff = (inputs["clip_context"] - clip).abs().max().item()
    assert clip_diff <= INPUT_TOL, f"clip_context vs CLIPVisionModel hidden_states[-2]: {clip_diff:.3g}"
    assert len(encoded) == 1 and isinstance(encoded[0], Image.Image)
    assert_y(inputs["y"], y, last_frame=False)
    assert_videos_match(ours, expected, "i2v")


def test_wan22_moe_i2v_runner_matches_diffusers_pipeline_with_transformer_2(
        ckpts: dict[str, Path], images: dict[str, Path], tmp_path: Path, mocker: Any) -> None:
    """Experts `transformer` (high-noise, t >= 900) and `transformer_2`, guidance 4.0 and 3.0, no CLIP."""
    ours, inputs = run_runnerkit("moe_i2v", ckpts["moe_i2v"], images, tmp_path / "video.safetensors", mocker,
                                 sample_guide_scale=list(MOE_GUIDANCE), boundary=MOE_BOUNDARY)
    timesteps: list[float] = []
    expected, y, encoded = run_diffusers(
        "moe_i2v", ckpts["moe_i2v"], images, None, mocker, guidance_scale=MOE_GUIDANCE[0], guidance_scale_2=MOE_GUIDANCE[1],
        callback_on_step_end=lambda pipe, i, t, kw: timesteps.append(float(t)) or {})

    assert "clip_context" not in inputs and encoded == []
    assert timesteps == [999, 937, 833, 625], "2 high-noise steps (t >= 900), then 2 low-noise steps"
    assert_y(inputs["y"], y, last_frame=False)
    assert_videos_match(ours, expected, "moe i2v")


def test_wan21_flf2v_runner_matches_diffusers_pipeline_with_last_image(
        ckpts: dict[str, Path], images: dict[str, Path], tmp_path: Path, mocker: Any) -> None:
    ours, inputs = run_runnerkit("flf2v", ckpts["flf2v"], images, tmp_path / "video.safetensors", mocker)
    expected, y, encoded = run_diffusers("flf2v", ckpts["flf2v"], images, inputs["clip_context"], mocker,
                                         guidance_scale=float(CONFIGS["flf2v"]["sample_guide_scale"]))

    clip = hf_clip_tokens(ckpts["flf2v"], [images["first"], images["last"]])
    assert tuple(inputs["clip_context"].shape) == (1, 514, 1280)  # the first frame's 257 tokens, then the last's
    clip_diff = (inputs["clip_context"] - clip).abs().max().item()
    assert clip_diff <= INPUT_TOL, f"clip_context vs CLIPVisionModel hidden_states[-2]: {clip_diff:.3g}"
    assert len(encoded) == 1 and len(encoded[0]) == 2, "diffusers encodes [image, last_image]"
    assert_y(inputs["y"], y, last_frame=True)
    assert_videos_match(ours, expected, "flf2v")

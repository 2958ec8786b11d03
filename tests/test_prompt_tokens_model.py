"""The preflight's prompt-token count against the tiny model's own processor: the request's
mm_processor_kwargs reach it, and a video counts the frames vLLM's loader keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures import media
from fixtures.tiny_model import ensure_tiny_model
from harness.environment import cache_dir
from harness.errors import BadInput
from harness.preflight.tokens import estimate_prompt_tokens
from harness.run.scenarios import MATRIX
from harness.spec.prompts import (
    PromptSpec,
    TextPart,
    VideoFramesPart,
    VideoPart,
    render_request,
)

pytestmark = pytest.mark.model

KWARG_PROMPTS = ("m-kwargs-image-plain", "m-kwargs-image-16-tokens", "m-kwargs-image-36-tokens")


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_tiny_model(cache_dir() / "models")


def scenario_prompt(name: str) -> PromptSpec:
    return next(p for s in MATRIX for p in s.prompts if p.name == name)


def count(model: Path, *prompts: PromptSpec) -> dict[str, int]:
    return estimate_prompt_tokens(model, {p.name: render_request(p, "m") for p in prompts})


# transformers 5.19 deprecates max_pixels in a processor call; vLLM 0.32 still passes it so.
@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_the_requests_mm_processor_kwargs_reach_the_processor(model: Path) -> None:
    """The processor was called without the request's mm_processor_kwargs: the image capped
    to 16 and to 36 tokens (scenario ec-same-image-across-kwargs) counted as the plain one's
    187, where vLLM 0.32 reported 139 and 159. Each count must differ from the plain one by
    exactly what the image processor itself gives under those kwargs."""
    from transformers import AutoProcessor

    prompts = [scenario_prompt(name) for name in KWARG_PROMPTS]
    counted = count(model, *prompts)
    processor = AutoProcessor.from_pretrained(str(model))
    merge = processor.image_processor.merge_size

    def image_tokens(prompt: PromptSpec) -> int:
        image = media.make_image(prompt.parts[0].seed, prompt.parts[0].size)
        kwargs = dict(prompt.extra).get("mm_processor_kwargs") or {}
        grid = processor.image_processor(images=[image], **kwargs)["image_grid_thw"]
        return int(grid.prod()) // merge**2

    plain, *capped = prompts
    assert len(set(counted.values())) == 3, counted
    for prompt in capped:
        assert counted[prompt.name] - counted[plain.name] == image_tokens(prompt) - image_tokens(
            plain
        ), (prompt.name, counted)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_pixel": 28 * 28 * 16}, "'max_pixel'"),  # a typo of max_pixels
        ({"images_kwargs": {"max_pixel": 28 * 28 * 16}}, "'images_kwargs.max_pixel'"),
    ],
)
def test_a_kwarg_the_processor_does_not_take_is_refused_by_name(
    model: Path, kwargs: dict, named: str
) -> None:
    """transformers drops a keyword its processor does not know with a log line, and vLLM
    serves the request without it: the count would silently be the plain request's."""
    prompt = PromptSpec(
        "p-typo",
        scenario_prompt("m-kwargs-image-plain").parts,
        extra=(("mm_processor_kwargs", kwargs),),
    )
    with pytest.raises(BadInput) as caught:
        count(model, prompt)
    message = str(caught.value)
    assert "'p-typo'" in message and named in message and "\n" not in message, message
    assert "max_pixels" in message, "the refusal lists what the processor takes"


def test_an_mp4_counts_the_frames_vllm_samples_it_to(model: Path) -> None:
    """vLLM's Qwen2-VL loader samples an mp4 to 2 fps before the processor sees it (16 frames
    at 4 fps: 8 frames); the count decoded every frame, 635 tokens where vLLM 0.32 reported
    379 for scenario m-video-fps4, and refused prompts that fit. media_io_kwargs' fps moves
    the sampling; mm_processor_kwargs' fps does not (the processor does not sample: vLLM 0.32
    reported 379 for m-video-fps-kwarg as for m-video-mp4)."""
    text = TextPart("Describe it.")
    fast = PromptSpec("fast", (VideoPart(seed=23, num_frames=16, fps=4.0), text))
    plain = PromptSpec("plain", (VideoPart(seed=23, num_frames=8, fps=2.0), text))
    slow_io = PromptSpec(
        "slow-io", plain.parts, extra=(("media_io_kwargs", {"video": {"fps": 1.0}}),)
    )
    short = PromptSpec("short", (VideoPart(seed=23, num_frames=4, fps=2.0), text))
    fps_kwarg = PromptSpec("fps-kwarg", plain.parts, extra=(("mm_processor_kwargs", {"fps": 1.0}),))
    counted = count(model, fast, plain, slow_io, short, fps_kwarg)
    assert counted["fast"] == counted["plain"], counted
    assert counted["slow-io"] == counted["short"] < counted["plain"], counted
    assert counted["fps-kwarg"] == counted["plain"], counted


def test_a_jpeg_frame_list_counts_its_first_32_frames(model: Path) -> None:
    """VideoMediaIO reads the first num_frames (32) frames of a `data:video/jpeg` list; the
    count took all of them and refused a 40-frame list every server serves as 32 frames."""
    text = TextPart("Describe it.")
    forty = PromptSpec("forty", (VideoFramesPart(seed=22, num_frames=40), text))
    thirty_two = PromptSpec("thirty-two", (VideoFramesPart(seed=22, num_frames=32), text))
    every = PromptSpec(
        "every", forty.parts, extra=(("media_io_kwargs", {"video": {"num_frames": -1}}),)
    )
    counted = count(model, forty, thirty_two, every)
    assert counted["forty"] == counted["thirty-two"] < counted["every"], counted


def test_an_mp4_whose_sampling_step_overshoots_counts_the_extra_frame_vllm_keeps(
    model: Path,
) -> None:
    """A 75-frame 10 fps mp4: vLLM's Qwen2-VL loader keeps 15 frames (its float32 arange step
    yields one index past 14, clamped onto the last frame), and the processor pads 15 to 16:
    8 temporal steps, as a 16-frame 2 fps clip takes. The count kept 14 (7 steps, as a
    14-frame clip) and let through requests one step longer than it said (found in review)."""
    text = TextPart("Describe it.")
    overshoot = PromptSpec("overshoot", (VideoPart(seed=23, num_frames=75, fps=10.0), text))
    sixteen = PromptSpec("sixteen", (VideoPart(seed=23, num_frames=16, fps=2.0), text))
    fourteen = PromptSpec("fourteen", (VideoPart(seed=23, num_frames=14, fps=2.0), text))
    counted = count(model, overshoot, sixteen, fourteen)
    assert counted["overshoot"] == counted["sixteen"] > counted["fourteen"], counted


def test_a_count_cached_under_the_earlier_sampling_rule_is_not_reused(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts are cached under their count format: a count the earlier rule stored (472 for
    the 75-frame clip, one step short) must not answer for the rule that counts 536."""
    from harness.preflight import tokens

    prompt = PromptSpec(
        "overshoot", (VideoPart(seed=23, num_frames=75, fps=10.0), TextPart("Describe it."))
    )
    bodies = {prompt.name: render_request(prompt, "m")}
    right = estimate_prompt_tokens(model, bodies)[prompt.name]
    with monkeypatch.context() as earlier:
        earlier.setattr(tokens, "COUNT_FORMAT", 3)  # the format that counted with the old rule
        tokens._store_count(tmp_path, tokens._token_count_key(model, bodies[prompt.name]), 472)
    assert estimate_prompt_tokens(model, bodies, tmp_path)[prompt.name] == right == 536


def test_media_io_kwargs_video_backend_picks_the_loader_the_count_follows(model: Path) -> None:
    """media_io_kwargs' video.video_backend replaces the loader vLLM picks by the processor
    (`MediaConnector.fetch_video`): "opencv" samples uniformly (at most 32 frames) where the
    Qwen2-VL loader samples to 2 fps. The count ignored it and counted a 16-frame 4 fps clip
    as 8 frames where vLLM hands the processor all 16 (found in review); a loader the count
    does not know is refused by name, not counted as another."""
    text = TextPart("Describe it.")
    clip = (VideoPart(seed=23, num_frames=16, fps=4.0), text)
    uniform = PromptSpec(
        "uniform", clip, extra=(("media_io_kwargs", {"video": {"video_backend": "opencv"}}),)
    )
    qwen = PromptSpec(
        "qwen", clip, extra=(("media_io_kwargs", {"video": {"video_backend": "qwen2_vl"}}),)
    )
    sampled = PromptSpec("sampled", clip)
    every = PromptSpec("every", (VideoPart(seed=23, num_frames=16, fps=2.0), text))
    counted = count(model, uniform, qwen, sampled, every)
    assert counted["uniform"] == counted["every"] > counted["sampled"] == counted["qwen"], counted
    odd = PromptSpec(
        "odd", clip, extra=(("media_io_kwargs", {"video": {"video_backend": "decord"}}),)
    )
    with pytest.raises(BadInput) as caught:
        count(model, odd)
    message = str(caught.value)
    assert "'odd'" in message and "'decord'" in message and "\n" not in message, message

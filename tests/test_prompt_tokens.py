"""The preflight's prompt-token count (harness.preflight.tokens) without the model's processor:
what it decodes of each medium, and what its cache key covers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import files, tokens
from harness.spec.prompts import (
    PromptSpec,
    TextPart,
    VideoFramesPart,
    render_part,
    render_request,
    requested_tokens,
)

pytestmark = pytest.mark.unit


def test_a_jpeg_frame_list_video_is_counted_with_all_its_frames() -> None:
    """`data:video/jpeg;base64,<f1>,<f2>,...` (VideoFramesPart; scenario m-video-jpeg-frames
    and the fuzzer) is a list of frames to vLLM (it splits on ','). Decoded as one blob,
    OpenCV read one frame of it: the video was counted as 1 frame instead of 8 (64 merged
    tokens instead of 256 with the tiny model), so `check_prompts_fit` passed a request every
    server then rejected, and the cached count kept the wrong number."""
    url = render_part(VideoFramesPart(seed=22, num_frames=8))["video_url"]["url"]
    frames, _ = tokens._load_video(url, {}, True)
    assert frames.shape[0] == 8
    assert frames.shape[-1] == 3, "RGB frames, as vLLM's image loader converts them"


def test_a_file_media_changed_in_place_is_counted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--media-dir` requests name media by file:// URL; the key hashed the body (the URL),
    not the bytes behind it. Replace the video with a longer one and the preflight reused the
    old count: `check_prompts_fit` passed a request every server will reject (or refused one
    that fits)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    media = tmp_path / "media" / "clip.bin"
    media.parent.mkdir()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": f"file://{media}"}}],
            }
        ]
    }
    counted: list[str] = []

    def count(_model: Path, bodies: dict) -> dict[str, int]:
        counted.extend(bodies)
        return {name: 10 + media.stat().st_size for name in bodies}

    monkeypatch.setattr(tokens, "_count_with_processor", count)
    cache = tmp_path / "prompt-tokens"
    media.write_bytes(b"x" * 5)
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 15}
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 15}
    assert counted == ["p"], "the same bytes again are read from the cache"
    media.write_bytes(b"x" * 5000)
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 5010}, (
        "the count of the old file was reused"
    )


def test_a_count_cached_before_the_kwargs_reached_the_processor_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts of format 2 were taken without the request's mm_processor_kwargs, and cached
    under a key of the whole body, kwargs included: the same request again read back the
    wrong count (187 for the image capped to 139 tokens) until the format entered the key
    anew."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    body = {"messages": [], "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16}}
    cache = tmp_path / "prompt-tokens"
    with monkeypatch.context() as old:
        old.setattr(tokens, "COUNT_FORMAT", 2)
        tokens._store_count(cache, tokens._token_count_key(model, body), 187)
    monkeypatch.setattr(
        tokens, "_count_with_processor", lambda _m, bodies: dict.fromkeys(bodies, 139)
    )
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 139}


@pytest.mark.parametrize(
    "distribution", ["transformers", "tokenizers", "torch", "opencv-python-headless"]
)
def test_a_count_is_not_reused_under_another_version_of_what_counted_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, distribution: str
) -> None:
    """The key held the transformers version alone: the text is tokenized by tokenizers, a
    container's frames and fps read by OpenCV, its kept frames picked with torch, and a count
    taken under other versions of those was read back as this one's."""
    import importlib.metadata

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    real = importlib.metadata.version

    def version(name: str) -> str:
        return real(name) if name != distribution else "0.0.1-another"

    key = tokens._token_count_key(model, body)
    monkeypatch.setattr(tokens.importlib.metadata, "version", version)
    assert tokens._token_count_key(model, body) != key


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_prompt_whose_extra_fields_ask_for_more_tokens_is_held_to_them(field: str) -> None:
    """`render_request` lets a prompt's extra fields override max_tokens (and vLLM reads
    max_completion_tokens first); the fit check added the PromptSpec's own 32 instead, and let
    through a request asking for 400 tokens of a 200-token context."""
    prompt = PromptSpec("p", (TextPart("hi"),), extra=((field, 400),))
    assert render_request(prompt, "m")[field] == 400
    with pytest.raises(BadInput, match=r"'p': it has 150 prompt tokens .* \+ 400 to generate"):
        tokens.check_prompts_fit(200, [prompt], {"p": 150})
    tokens.check_prompts_fit(550, [prompt], {"p": 150})


def test_max_completion_tokens_wins_over_max_tokens_as_vllm_reads_them() -> None:
    """vLLM takes max_completion_tokens before max_tokens: a prompt setting both is held to
    the first, whichever it lists first, or a 400-token answer passed as an 8-token one."""
    for extra in (
        (("max_tokens", 8), ("max_completion_tokens", 400)),
        (("max_completion_tokens", 400), ("max_tokens", 8)),
    ):
        assert requested_tokens(PromptSpec("p", (TextPart("hi"),), extra=extra)) == 400


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_a_prompt_asking_for_no_whole_positive_number_of_tokens_is_refused(value) -> None:
    """0, a negative count, a bool (an int to isinstance: True would count as 1) or a
    non-integer is no number of tokens to generate."""
    prompt = PromptSpec("p", (TextPart("hi"),), extra=(("max_tokens", value),))
    with pytest.raises(BadInput, match=r"prompt 'p': max_tokens .* is not a positive number"):
        requested_tokens(prompt)


def test_a_prompt_that_leaves_room_for_its_answer_fits() -> None:
    prompt = PromptSpec("p", (TextPart("hi"),), max_tokens=32)
    tokens.check_prompts_fit(182, [prompt], {"p": 150})
    with pytest.raises(BadInput, match=r"150 prompt tokens .* \+ 32 to generate = 182"):
        tokens.check_prompts_fit(181, [prompt], {"p": 150})


def test_a_count_is_keyed_by_the_request_and_the_models_processor_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another request, or a changed chat template, must be counted again; weights need not."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("a")
    counted: list[str] = []

    def count(_model: Path, bodies: dict) -> dict[str, int]:
        counted.extend(bodies)
        return {name: 7 for name in bodies}

    monkeypatch.setattr(tokens, "_count_with_processor", count)
    cache = tmp_path / "prompt-tokens"
    short = {"messages": [{"role": "user", "content": "hi"}]}
    long = {"messages": [{"role": "user", "content": "hi " * 50}]}
    tokens.estimate_prompt_tokens(model, {"short": short}, cache)
    tokens.estimate_prompt_tokens(model, {"long": long}, cache)
    assert counted == ["short", "long"], "another body reused a count"
    (model / "model.safetensors").write_bytes(b"weights")
    tokens.estimate_prompt_tokens(model, {"short": short}, cache)
    assert counted == ["short", "long"], "weights do not change a count"
    (model / "chat_template.jinja").write_text("b")
    tokens.estimate_prompt_tokens(model, {"short": short}, cache)
    assert counted == ["short", "long", "short"], "a changed template reused a count"


@pytest.mark.parametrize(
    ("max_model_len", "refused"), [(0, True), (1, False), (32, False), (33, True)]
)
def test_max_model_len_is_refused_at_zero_and_past_the_models_limit(
    max_model_len: int, refused: bool
) -> None:
    if refused:
        with pytest.raises(BadInput, match=f"--max-model-len {max_model_len}"):
            tokens.check_model_limit(max_model_len, 32)
    else:
        tokens.check_model_limit(max_model_len, 32)


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        ({"text_config": {"max_position_embeddings": 0}, "max_position_embeddings": 4096}, 4096),
        ({"max_position_embeddings": -1}, None),
        ({"text_config": {"max_position_embeddings": 32768}, "max_position_embeddings": 8}, 32768),
    ],
)
def test_the_models_limit_is_its_first_positive_max_position_embeddings(
    tmp_path: Path, config: dict, limit: int | None
) -> None:
    """A 0 or negative value (a config that leaves the field unset that way) is no limit: taken
    for one, every --max-model-len was refused as past the model's limit of 0."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert files.max_position_tokens(tmp_path) == limit

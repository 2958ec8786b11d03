"""Where a request's media sit in its prompt, relative to KV blocks and to D's recomputed tail.

Two views of the same thing:

* `PromptLayout` is exact: read from the prompt ids the baseline answered with (each media
  item is a run of its placeholder id). It says where the last placeholder run ends, which
  block boundary that is near, and which part of the prompt D computes itself under a
  block-aligned connector (ExampleConnector): D loads `align_down(n - 1, block)` tokens of an
  n-token prompt and computes the rest, so a placeholder there needs embeddings D never got;
  except at n = k * block + 1, where P's and D's keys differ and D loads none of P's KV
  (`harness.run.fuzz.consumer`: what D holds then depends on the requests before).
  Reports, known-failure triggers and shrinking all read this view.
* `LayoutEstimator` is a cheap prediction made before anything is sent, so the strategies can
  aim a request at a boundary (`harness.run.fuzz.strategies`). It only has to be close: what
  an example really hit is read back from the exact view and reported.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.run.fuzz.consumer import looked_up_tokens, stored_tokens
from harness.spec.prompts import ImagePart, PromptSpec, TextPart, VideoFramesPart, VideoPart
from harness.spec.video_sampling import QWEN2VL_VIDEO_PROCESSOR, container_frames, jpeg_sampling


@dataclass(frozen=True)
class PlaceholderIds:
    """The model's placeholder token ids (config.json: image_token_id, video_token_id)."""

    image: int
    video: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PlaceholderIds | None:
        """None when the model's config does not name them (layout facts are then unknown)."""
        try:
            config = json.loads((model_dir / "config.json").read_text())
            return cls(int(config["image_token_id"]), int(config["video_token_id"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class PromptLayout:
    """The exact layout of one prompt (from its ids) under a KV block size."""

    prompt_tokens: int
    runs: tuple[tuple[str, int, int], ...]  # (image|video, start, end exclusive), in order
    block_size: int
    # Tokens D already holds before this request's transfer (its prefix cache, or an earlier
    # request's KV files under D's lookup key): `ConsumerState.holds`, set by the engine.
    consumer_holds: int = 0
    # P's own lookup finds a folder whose longer key it then loads holds no KV, and P dies
    # before D is asked (`ConsumerState.prefill_loads_missing`), set by the engine.
    prefill_loads_missing: bool = False
    # P's prefix cache covered the lookup, so it wrote nothing, and D, its own cache covering
    # less, loads that unwritten folder and dies (`ConsumerState.decode_loads_missing`).
    decode_loads_missing: bool = False
    # D gets the request's media itself (no encoder: the proxy hands it the raw parts), so a
    # placeholder D computes needs no embedding it lacks; set by the engine from the topology.
    decode_has_media: bool = False

    @property
    def loads_missing(self) -> bool:
        """An instance's connector loads a folder nobody wrote: that instance dies, unless D
        dies of its media first (`decode_dies_of_media`)."""
        return self.prefill_loads_missing or self.decode_loads_missing

    @property
    def decode_dies_of_media(self) -> bool:
        """D computes a placeholder it has no embedding for (in its recomputed tail, or past
        what it holds): its engine dies gathering the embeddings, before its connector loads
        anything, so a folder it would load unwritten does not matter (real vLLM 0.32: a
        revived D, sent a follow-up whose lookup P's cache covered, died so)."""
        return not self.decode_has_media and (self.media_in_decode_tail or self.media_past_kv_miss)

    @property
    def kv_prefix(self) -> int:
        """Tokens a block-aligned transfer moves, P stores, and the kv_transfer guard
        expects D to have: align_down(n - 1, block)."""
        return stored_tokens(self.prompt_tokens, self.block_size)

    @property
    def kv_keys_agree(self) -> bool:
        """ExampleConnector's D looks up what P stored: false at n = k * block + 1."""
        return looked_up_tokens(self.prompt_tokens, self.block_size) == self.kv_prefix

    @property
    def consumer_computes_from(self) -> int:
        """Where D's own computation of the prompt starts under ExampleConnector."""
        return self.kv_prefix if self.kv_keys_agree else self.consumer_holds

    @property
    def last_media_end(self) -> int | None:
        return self.runs[-1][2] if self.runs else None

    @property
    def media_in_decode_tail(self) -> bool:
        """A placeholder lies in the partial block D recomputes after loading P's KV."""
        return (
            self.kv_keys_agree
            and not self.prefill_loads_missing  # P dies first: D is asked nothing
            and any(end > self.kv_prefix for _, _, end in self.runs)
        )

    @property
    def media_past_kv_miss(self) -> bool:
        """D finds none of P's KV (the keys differ) and a placeholder lies past what it
        holds: it computes media it has no embeddings for."""
        return (
            not self.kv_keys_agree
            and not self.prefill_loads_missing
            and any(end > self.consumer_holds for _, _, end in self.runs)
        )

    @property
    def kv_short_of_transfer(self) -> bool:
        """D ends up holding less than a block-aligned transfer would give it (the keys
        differ and nothing it held already covers the gap)."""
        return (
            not self.kv_keys_agree
            and not self.loads_missing
            and self.consumer_holds < self.kv_prefix
        )

    @property
    def run_starts(self) -> tuple[int, ...]:
        return tuple(start for _, start, _ in self.runs)

    @property
    def boundary_offset(self) -> int | None:
        """Where the last run ends relative to the nearest block boundary: -1 just before
        it, 0 on it, +1 just after it (any value in [-block/2, block/2))."""
        end = self.last_media_end
        if end is None:
            return None
        offset = end % self.block_size
        return offset - self.block_size if offset >= self.block_size // 2 else offset

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "runs": [list(r) for r in self.runs],
            "block_size": self.block_size,
            "kv_prefix": self.kv_prefix,
            "kv_keys_agree": self.kv_keys_agree,
            "consumer_holds": self.consumer_holds,
            "consumer_computes_from": self.consumer_computes_from,
            "last_media_end": self.last_media_end,
            "boundary_offset": self.boundary_offset,
            "media_in_decode_tail": self.media_in_decode_tail,
            "media_past_kv_miss": self.media_past_kv_miss,
            "prefill_loads_missing": self.prefill_loads_missing,
            "decode_loads_missing": self.decode_loads_missing,
            "decode_has_media": self.decode_has_media,
        }


def layout_from_ids(
    prompt_ids: list[int] | tuple[int, ...], ids: PlaceholderIds, block_size: int
) -> PromptLayout:
    """Runs of placeholder ids in `prompt_ids`; two adjacent items of one kind would merge
    into one run, which the chat template never produces (vision start/end tokens wrap each)."""
    runs: list[tuple[str, int, int]] = []
    kinds = {ids.image: "image", ids.video: "video"}
    start: int | None = None
    kind: str | None = None
    for index, token in enumerate([*prompt_ids, None]):
        token_kind = kinds.get(token) if token is not None else None
        if token_kind != kind:
            if kind is not None and start is not None:
                runs.append((kind, start, index))
            start, kind = (index, token_kind) if token_kind else (None, None)
    return PromptLayout(len(prompt_ids), tuple(runs), block_size)


class LayoutEstimator(Protocol):
    """A prediction of prompt positions, for aiming requests before they are sent."""

    def text_tokens(self, text: str) -> int: ...

    def media_tokens(self, part: ImagePart | VideoPart | VideoFramesPart, spec: PromptSpec) -> int:
        """Placeholder tokens of one media item (the run, without the wrapping tokens)."""
        ...

    @property
    def head_tokens(self) -> int:
        """Tokens before the user content (system turn, user header)."""
        ...

    @property
    def tail_tokens(self) -> int:
        """Tokens after the user content (end of turn, assistant header)."""
        ...

    @property
    def wrap_tokens(self) -> int:
        """Tokens around each media run (vision start and end)."""
        ...


def estimate_positions(spec: PromptSpec, estimator: LayoutEstimator) -> tuple[int | None, int]:
    """(end of the last placeholder run, prompt tokens), as the estimator predicts them."""
    position = estimator.head_tokens
    last_end = None
    half_wrap = estimator.wrap_tokens // 2
    for part in spec.parts:
        if isinstance(part, TextPart):
            position += estimator.text_tokens(part.text)
        else:
            position += half_wrap
            position += estimator.media_tokens(part, spec)
            last_end = position
            position += estimator.wrap_tokens - half_wrap
    return last_end, position + estimator.tail_tokens


@dataclass(frozen=True)
class VisionGrid:
    """A Qwen2-VL style processor's resize rule (preprocessor_config.json), and the video
    processor's class, by whose name vLLM picks the loader that samples a video's frames."""

    patch: int = 14
    merge: int = 2
    temporal: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_max_pixels: int = 28 * 28 * 768
    video_processor: str = QWEN2VL_VIDEO_PROCESSOR

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def resized(self, width: int, height: int, max_pixels: int | None = None) -> tuple[int, int]:
        """(width, height) after smart_resize: multiples of the factor, area within bounds."""
        factor = self.factor
        cap = max_pixels or self.max_pixels
        h_bar = max(factor, round(height / factor) * factor)
        w_bar = max(factor, round(width / factor) * factor)
        if h_bar * w_bar > cap:
            beta = math.sqrt(height * width / cap)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return w_bar, h_bar

    def image_tokens(self, width: int, height: int, max_pixels: int | None = None) -> int:
        w, h = self.resized(width, height, max_pixels)
        return (w // self.factor) * (h // self.factor)

    def video_tokens(self, frames: int, width: int, height: int) -> int:
        """Tokens of `frames` frames as the processor receives them (it pads the last
        temporal step with a copy of the last frame)."""
        w, h = self.resized(width, height, self.video_max_pixels)
        steps = max(1, math.ceil(frames / self.temporal))
        return steps * (w // self.factor) * (h // self.factor)

    def kept_frames(self, part: VideoPart | VideoFramesPart, spec: PromptSpec) -> int:
        """Frames of one video the processor receives: vLLM's loaders' rule, under the
        request's media_io_kwargs (harness/spec/video_sampling.py, which the preflight's
        count uses too). Rounding the sent frames here instead counted a 40-frame JPEG list
        whole (vLLM reads 32) and an odd mp4's last frame as a temporal step."""
        if isinstance(part, VideoFramesPart):
            return jpeg_sampling(part.num_frames, spec.video_io)[0]
        qwen2vl = self.video_processor == QWEN2VL_VIDEO_PROCESSOR
        return container_frames(part.num_frames, part.fps, spec.video_io, qwen2vl)

    def media_tokens(self, part: ImagePart | VideoPart | VideoFramesPart, spec: PromptSpec) -> int:
        """Placeholder tokens of one media item of `spec`, its mm_processor_kwargs applied."""
        width, height = part.size
        if isinstance(part, ImagePart):
            kwargs = dict(spec.extra).get("mm_processor_kwargs") or {}
            return self.image_tokens(width, height, kwargs.get("max_pixels"))
        return self.video_tokens(self.kept_frames(part, spec), width, height)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TokenizerEstimator:
    """A `LayoutEstimator` from a local Qwen2-VL style checkpoint: text counted with its own
    tokenizer (the `tokenizers` library, no transformers import), media with its resize rule,
    and the chat frame measured once by tokenizing it."""

    HEAD = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    TAIL = "<|im_end|>\n<|im_start|>assistant\n"

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.grid = _grid_from(model_dir)
        self._cache: dict[str, int] = {}
        self._head = self.text_tokens(self.HEAD)
        self._tail = self.text_tokens(self.TAIL)

    def text_tokens(self, text: str) -> int:
        if text not in self._cache:
            encoded = self._tokenizer.encode(text, add_special_tokens=False)
            self._cache[text] = len(encoded.ids)
        return self._cache[text]

    def media_tokens(self, part: ImagePart | VideoPart | VideoFramesPart, spec: PromptSpec) -> int:
        return self.grid.media_tokens(part, spec)

    @property
    def head_tokens(self) -> int:
        return self._head

    @property
    def tail_tokens(self) -> int:
        return self._tail

    @property
    def wrap_tokens(self) -> int:
        return 2


def _grid_from(model_dir: Path) -> VisionGrid:
    def read(name: str) -> dict[str, Any]:
        try:
            return json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            return {}

    image = read("preprocessor_config.json")
    video = read("video_preprocessor_config.json")
    defaults = VisionGrid()
    size = image.get("size") or {}
    video_size = video.get("size") or {}
    return VisionGrid(
        patch=int(image.get("patch_size", defaults.patch)),
        merge=int(image.get("merge_size", defaults.merge)),
        temporal=int(image.get("temporal_patch_size", defaults.temporal)),
        min_pixels=int(size.get("shortest_edge", image.get("min_pixels", defaults.min_pixels))),
        max_pixels=int(size.get("longest_edge", image.get("max_pixels", defaults.max_pixels))),
        video_max_pixels=int(video_size.get("longest_edge", defaults.video_max_pixels)),
        video_processor=str(video.get("video_processor_type", defaults.video_processor)),
    )

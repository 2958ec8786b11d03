"""One media part of a request as the fake's engine sees it: the item vLLM 0.32 keys by its
mm_hash, with the grid its processor makes (the placeholder tokens it takes in the prompt), where
its video steps sit, and its "embedding": computed from raw media, or loaded from the EC storage
for a metadata-only `*_embeds` part, so a consumer holds the encoder's rows only when the encoder
really wrote them (the package's docstring says why).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

if __package__:  # imported, by the tests of its pure functions
    from harness.spec import video_sampling
    from harness.testing.fake_vllm_server.failures import EmbeddingsMissing, RequestFailed
    from harness.testing.fake_vllm_server.tensors import EC_FILE, ROW_BYTES, read_tensor, rows_from
    from harness.testing.fake_vllm_server.video_timing import video_sampling_of
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    import video_sampling  # type: ignore[no-redef]
    from failures import EmbeddingsMissing, RequestFailed  # type: ignore[no-redef]
    from tensors import EC_FILE, ROW_BYTES, read_tensor, rows_from  # type: ignore[no-redef]
    from video_timing import video_sampling_of  # type: ignore[no-redef]

MERGE = 4  # Qwen2.5-VL merges 2x2 patches into one placeholder token
GRIDS = {"image": [1, 8, 8], "video": [2, 8, 8]}  # what the fake's encoder reports
TOKENS_PER_SECOND = 2  # Qwen2.5-VL's vision_config.tokens_per_second (the tiny model's too)
CONSUMER_SECONDS_PER_STEP = 1.0  # what a consumer without second_per_grid_ts assumes
GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}
AUDIO_TOKENS = 8


def media_kwargs(body: dict) -> str:
    """The request fields that change what media turn into (and their cache key)."""
    kwargs = {k: body[k] for k in ("mm_processor_kwargs", "media_io_kwargs") if body.get(k)}
    return json.dumps(kwargs, sort_keys=True) if kwargs else ""


# The media keys vLLM 0.31 reads a part without `type` by, in its order
# (chat_utils `_parse_chat_message_content_mm_part`): `{"audio_url": "file://..."}`.
TYPELESS_MEDIA_KEYS = (
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)


def part_type(part: dict) -> str:
    """A content part's type: its own, or for a typeless part the media key vLLM reads it by
    (the fake died of such a part, KeyError 'None': found in review)."""
    if part.get("type") is not None:
        return str(part["type"])
    return next((key for key in TYPELESS_MEDIA_KEYS if key in part), "None")


def modality(part_type: str) -> str:
    """A content part's modality (image, video, audio) from its type, raw or `*_embeds`."""
    return part_type.split("_")[0] if not part_type.startswith("input_audio") else "audio"


def source_of(part: dict) -> str:
    """What a raw media part's content is known by (its URL, else the whole part)."""
    value = part.get(part_type(part))
    url = value.get("url") if isinstance(value, dict) else value if isinstance(value, str) else None
    return url or json.dumps({k: v for k, v in part.items() if k != "uuid"}, sort_keys=True)


def mm_hash(part: dict, kwargs: str) -> str:
    """vLLM 0.32's item identifier: the uuid itself, hashed with the media kwargs if any; an
    item without uuid is keyed by its content."""
    uuid = part.get("uuid")
    if uuid and not kwargs:
        return str(uuid)
    keyed = f"{uuid or source_of(part)}|{kwargs}"
    return hashlib.sha256(keyed.encode()).hexdigest()[:32]


def float32(value: float) -> float:
    """`value` as the float32 tensor vLLM holds second_per_grid_ts in reads it back."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def placeholder_count(kind: str, grid: list | None) -> int:
    """How many placeholder tokens an item takes in the prompt: its grid's patches merged 2x2
    (the reported grid when none is given), or an audio clip's fixed count."""
    if kind == "audio":
        return AUDIO_TOKENS
    size = 1
    for value in grid or GRIDS[kind]:
        size *= int(value)
    return max(size // MERGE, 1)


class MediaItem:
    """One media part of a request as the engine sees it: raw (embedding computed here) or a
    metadata-only `*_embeds` part (embedding loaded from the EC storage when needed)."""

    def __init__(self, part: dict, kwargs: str, video_io: dict):
        self.part = part
        self.kind = modality(part_type(part))
        self.embeds = part_type(part).endswith("_embeds")
        self.kwargs = kwargs
        self.hash = mm_hash(part, kwargs)
        metadata = part.get(part_type(part)) if self.embeds else None
        grid = metadata.get(GRID_KEYS.get(self.kind, "")) if isinstance(metadata, dict) else None
        raw_video = self.kind == "video" and not self.embeds
        self.sampling = video_sampling_of(part, video_io) if raw_video else None
        self.grid = grid or self.processed_grid()
        self.tokens = placeholder_count(self.kind, self.grid)
        self.seconds_per_step = self.processed_seconds_per_step()
        self._rows: bytes | None = None

    def processed_grid(self) -> list[int] | None:
        """The grid the processor makes of raw media (None: audio, which has none): a video's
        has one temporal step per two frames kept (an odd count padded)."""
        if self.kind not in GRIDS:
            return None
        if self.sampling is None:
            return list(GRIDS[self.kind])
        frames, _ = self.sampling
        return [-(-frames // video_sampling.TEMPORAL_PATCH), *GRIDS["video"][1:]]

    def processed_seconds_per_step(self) -> float:
        """A video's second_per_grid_ts: the processor's from raw media, the consumer's
        assumption for a metadata-only part (the encoder does not publish it)."""
        if self.sampling is None:
            return CONSUMER_SECONDS_PER_STEP
        _, fps = self.sampling
        return float32(video_sampling.TEMPORAL_PATCH / fps)

    def temporal_position(self, row: int) -> int:
        """Where the temporal step of placeholder `row` sits (iter_mm_grid_thw's t_factor)."""
        per_step = max(self.tokens // int(self.grid[0]), 1) if self.grid else self.tokens
        return int(row // per_step * self.seconds_per_step * TOKENS_PER_SECOND)

    def computed(self) -> bytes:
        """The embedding a model computes from the raw media (an encoder, or a consumer that
        got raw media)."""
        return rows_from(f"{source_of(self.part)}|{self.kwargs}".encode(), self.tokens)

    def rows(self, ec_storage: str | None, zeros_if_missing: bool = False) -> bytes:
        """The item's embedding, found once per request: loaded for a `*_embeds` part (zeros
        where it is missing and the mode serves anything), computed for raw media."""
        if self._rows is None:
            self._rows = (
                self._load(ec_storage, zeros_if_missing) if self.embeds else self.computed()
            )
        return self._rows

    def _load(self, ec_storage: str | None, zeros_if_missing: bool) -> bytes:
        """The encoder's rows from ECExampleConnector's file, as a consumer loads them; none
        there is the engine core's death (`EmbeddingsMissing`), a wrong size a failed request."""
        path = os.path.join(ec_storage or "", self.hash, EC_FILE)
        if zeros_if_missing and not (ec_storage and os.path.isfile(path)):
            return bytes(self.tokens * ROW_BYTES)
        if not ec_storage:
            raise EmbeddingsMissing(
                f"no embeddings for {self.kind} item {self.hash}: a metadata-only part, and "
                "this instance has no EC storage to load them from"
            )
        if not os.path.isfile(path):
            raise EmbeddingsMissing(f"no EC cache for mm_hash {self.hash}: {path} does not exist")
        data = read_tensor(path, "ec_cache")
        if len(data) != self.tokens * ROW_BYTES:
            raise RequestFailed(
                f"EC cache {path} holds {len(data) // ROW_BYTES} rows for "
                f"{self.tokens} placeholder tokens"
            )
        return data

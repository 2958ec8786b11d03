"""Faults in what the proxy relays, with every file left as it is: the encoders' metadata
dropped (the consumer gets raw media), a stream chunk relayed twice, a video grid of the right
size but the wrong shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.run.faults.encoded import encoded_items
from harness.run.faults.planted import PlantedFault
from harness.run.faults.video_grid import grid_like, video_grid

# Why a flag fault cannot act on one request alone (`first_request_only`).
FLAG_OF_EVERY_REQUEST = (
    "a proxy flag fault has no hook to narrow: the proxy reads the flag on every request, so "
    "it would act on every request in flight"
)


def drop_encoder_metadata() -> PlantedFault:
    """The proxy ignores what the encoders returned, so the consumer gets raw media.

    This is the silent raw-media fallback (failure mode 8): the consumer encodes locally and
    the tokens still match; only the transfer guards can turn it red.
    """
    return PlantedFault(drop_encoder_metadata=True, not_one_request=FLAG_OF_EVERY_REQUEST)


def duplicate_stream_chunk() -> PlantedFault:
    """The proxy relays the first chunk of D's stream that carries generated tokens twice, as a
    proxy that relays P's first token and then D's whole stream does: the client reads one
    token twice, and the final usage counts one fewer than the stream carried."""
    return PlantedFault(duplicate_first_token_chunk=True, not_one_request=FLAG_OF_EVERY_REQUEST)


def ec_video_grid(ec_storage: Path | None = None) -> PlantedFault:
    """A position error: the consumer is told video grid [2t, h/2, w] instead of [t, h, w].

    The size (t*h*w, hence the placeholder count, the prompt ids and the EC rows) is unchanged,
    so the consumer loads the right embeddings into the right number of placeholders, but its
    M-RoPE positions (temporal index, row, column of every video token) are computed for the
    wrong shape.

    Why not `second_per_grid_ts` itself: vLLM 0.32's consumer cannot be told it. The encoder
    publishes only `video_grid_thw` (`Qwen2VLMultiModalDataParser.embedding_fields`), and the
    field config a `video_embeds` part is parsed with (`_create_qwen2vl_field_factory`) has no
    `second_per_grid_ts`, so `MultiModalKwargsItems.from_hf_inputs` drops such a key silently
    and `Qwen2_5_VLForConditionalGeneration.iter_mm_grid_thw` falls back to 1.0. Changing
    fps / mm_processor_kwargs in the consumer's request instead changes the item's mm_hash
    (vLLM hashes the uuid with the kwargs): the consumer misses the EC file (an ERROR).

    The metadata is rewritten in place in the encoders' answer, which the proxy then copies into
    the consumer's `video_embeds` parts (and its request trace).
    """
    del ec_storage  # the files stay as they are; only what the consumer is told changes
    fault = PlantedFault()

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        items = encoded_items(ec_transfer_params)
        videos = {h: e for h, e in items.items() if video_grid(e)}
        if not videos:
            fault.problems.append(
                f"{request_id}: no video among the encoded items ({len(items)} item(s))"
            )
        for mm_hash, entry in videos.items():
            t, h, w = video_grid(entry) or (0, 0, 0)
            if h % 4:
                fault.problems.append(
                    f"{request_id}: {mm_hash}: grid height {h} is not a "
                    "multiple of 4; cannot halve it keeping the merge size"
                )
                continue
            wrong = [2 * t, h // 2, w]
            entry["metadata"]["video_grid_thw"] = grid_like(
                entry["metadata"]["video_grid_thw"], wrong
            )
            fault.effects.append(f"{mm_hash}: video_grid_thw [{t}, {h}, {w}] -> {wrong}")
            fault.touched.append(Path(mm_hash))

    fault.after_encode = after_encode
    return fault

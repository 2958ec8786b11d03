"""The media items an encoders' answer (`ec_transfer_params`) reports, by mm_hash, in either
shape a served release answers: `{mm_hash: {"metadata": {...}, ...}}` (0.30 on), or 0.28 /
0.29's `{"ec_items": [{"mm_hash": h, <metadata fields>}, ...]}`. Read as the latter's keys, the
EC faults looked for a file under `ec_items/` and acted on nothing (found in review)."""

from __future__ import annotations

from typing import Any


def encoded_items(ec_transfer_params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mm_hash -> its entry, `{"metadata": {...}}` at least. The metadata is the answer's own
    object (an `ec_items` item is its own metadata, its `mm_hash` beside the fields), so a fault
    that rewrites it in place (`ec_video_grid`) changes what the consumer is told."""
    items = ec_transfer_params.get("ec_items")
    if isinstance(items, list):
        return {
            str(item["mm_hash"]): {"metadata": item}
            for item in items
            if isinstance(item, dict) and item.get("mm_hash")
        }
    return dict(ec_transfer_params)

"""A video's grid (t, h, w) as the encoders publish it in `ec_transfer_params`, read and
written back in the same nesting: what `ec_zero_frame` splits rows by and `ec_video_grid`
changes."""

from __future__ import annotations

from typing import Any


def video_grid(entry: dict[str, Any]) -> tuple[int, int, int] | None:
    """(t, h, w) from an encoder's `ec_transfer_params` entry, None if it is not a video."""
    grid = (entry.get("metadata") or {}).get("video_grid_thw")
    if grid is None:
        return None
    flat = [int(v) for v in _flatten(grid)]
    return (flat[0], flat[1], flat[2]) if len(flat) == 3 else None


def grid_like(original: Any, values: list[int]) -> Any:
    """`values` nested like `original` ([t, h, w] or [[t, h, w]])."""
    if isinstance(original, list) and original and isinstance(original[0], list):
        return [values]
    return values


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]

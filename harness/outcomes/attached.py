"""What one request to an attached deployment left that can be seen from outside it.

An attached deployment (`--proxy attach`) has no taps: its guards read EC files that appeared
in a storage the harness can see, and the instances' /metrics (`harness.judge.guards`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AttachedEvidence:
    """What one request left that can be seen from outside the deployment."""

    media_items: int  # distinct media items in the request: one EC file each
    ec_storage: str | None = None  # None: not reachable from here
    ec_files_before: int = 0  # EC files in the storage when the request started
    ec_files_written: list[str] = field(default_factory=list)  # <mm_hash>es new or rewritten
    encoder_requests: float | None = None  # finished on the encoders (None: /metrics unread)
    # Another request was in flight during this one (a load): the files and the count above
    # are then partly its, and show nothing of this request's own.
    shared: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

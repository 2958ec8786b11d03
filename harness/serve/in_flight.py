"""Which requests to one deployment were in flight together. What a request reads around
itself of counters every request moves (D's p2p counter under NIXL, the encoders' finished
requests, the EC files a storage gained) is its own only when no other request was in flight
at any moment of its window; a load sends concurrently, so each window says whether it was."""

from __future__ import annotations

import threading


class InFlightWindows:
    """Requests in flight -> whether another was in flight at any moment of its window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, bool] = {}

    def begin(self, request_id: str) -> None:
        """A request's window opens: it and every request in flight share it."""
        with self._lock:
            others = bool(self._in_flight)
            for other in self._in_flight:
                self._in_flight[other] = True
            self._in_flight[request_id] = others

    def end(self, request_id: str) -> bool:
        """The window closes: whether another request was in flight at any moment of it."""
        with self._lock:
            return self._in_flight.pop(request_id)

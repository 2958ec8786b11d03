"""A launched session's requests in flight together (a load): what one request's window of
D's counters can show of it (no process, no socket: the session's proxy and instances are
stand-ins)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from harness.judge.guards import transfer_guards
from harness.outcomes.outcome import Outcome
from harness.serve.client import ChatReply
from harness.serve.kv_metrics import KvCounters
from harness.serve.session import TopologySession
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.builders import cached_answer

pytestmark = pytest.mark.unit


class Alive:
    def check_alive(self) -> None:
        pass


class Entry(Alive):
    """The session's way in: answers every request, the first only once the second was."""

    def __init__(self, p2p: dict[str, float]) -> None:
        self.p2p = p2p
        self.first_in_flight, self.second_done = threading.Event(), threading.Event()
        self.client = self

    def send(self, body: dict[str, Any], request_id: str) -> ChatReply:
        if "-first-" in request_id:  # its KV never reaches D; it waits on the second
            self.first_in_flight.set()
            assert self.second_done.wait(10)
        else:
            self.p2p["tokens"] += 96
        return ChatReply(cached_answer(89, 0))

    def take_trace(self, request_id: str) -> None:
        return None


def test_a_nixl_request_in_flight_with_another_holds_no_kv_guard_on_its_p2p_tokens(
    tmp_path: Path,
) -> None:
    """NIXL's KV evidence is D's p2p counter, which counts every request's transfers: the
    first request here moved nothing to D, the second (sent while the first was in flight)
    its whole prompt. Found in review: on a launched topology (the attach path already said
    so) the first held `kv_transfer` on the second's tokens; a load's round account
    (`harness.run.load.kv_account`) judges the round's counter as a whole."""
    serving = ServingConfig(model=str(tmp_path / "m"), kv_connector="NixlConnector")
    session = TopologySession(TOPOLOGIES["1P+1D"], RunSettings(serving=serving, run_dir=tmp_path))
    p2p = {"tokens": 0.0}
    entry = Entry(p2p)
    session._entry, session._group = entry, Alive()  # type: ignore[assignment]
    session.decode_counters = lambda: KvCounters({"p2p_cached_tokens": p2p["tokens"]})  # type: ignore[method-assign]
    outcomes: dict[str, Outcome] = {}
    first = threading.Thread(target=lambda: outcomes.update(first=session.send("first", {})))
    first.start()
    assert entry.first_in_flight.wait(10)
    outcomes["second"] = session.send("second", {})
    entry.second_done.set()
    first.join(10)
    guard = {g.name: g for g in transfer_guards(session.served, outcomes["first"])}
    assert not guard["kv_transfer"].ok, guard["kv_transfer"]
    assert not guard["kv_transfer"].checkable
    assert "other requests were in flight" in guard["kv_transfer"].evidence
    alone = {g.name: g for g in transfer_guards(session.served, session.send("alone", {}))}
    assert alone["kv_transfer"].ok  # alone, the counter's growth is its own


def test_a_request_begun_while_another_is_in_flight_shares_its_window() -> None:
    """Each of two overlapping requests was in flight with the other, the later one too: the
    counters it reads around itself moved for the earlier one as well. A request alone
    throughout was not. Found in review: a mutant that opened a window as alone whatever was
    in flight (only a later request could mark it) survived every test."""
    from harness.serve.in_flight import InFlightWindows

    windows = InFlightWindows()
    windows.begin("first")
    windows.begin("second")
    assert windows.end("second") is True
    assert windows.end("first") is True
    windows.begin("alone")
    assert windows.end("alone") is False

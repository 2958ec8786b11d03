"""A running topology viewed through another proxy (`TopologySession.via`): what the view
shares with its session and what it refuses (harness.serve.session.ProxiedSession)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.serve.proxy import ProxyFaults
from harness.serve.session import ProxiedSession

pytestmark = pytest.mark.unit


def test_faults_are_planted_only_through_the_sessions_own_proxy() -> None:
    """Planted through another proxy, a fault would act twice (the session's proxy plants it
    too) or not at all (vLLM's proxy has no hooks): that view refuses, naming the proxy."""
    own = SimpleNamespace(key="1E+1PD/harness")
    base = SimpleNamespace(
        _entry=own, faults=ProxyFaults(), topology=SimpleNamespace(name="1E+1PD")
    )
    assert ProxiedSession(base, own, None).faults is base.faults  # type: ignore[arg-type]
    other = ProxiedSession(base, SimpleNamespace(key="1E+1PD/vllm"), None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="through 1E\\+1PD's own proxy, not 1E\\+1PD/vllm"):
        other.faults  # noqa: B018

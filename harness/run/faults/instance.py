"""The fault that needs no proxy hook: an instance dies mid-run (the judge must say ERROR at
once, not wait out a timeout)."""

from __future__ import annotations

import os
import signal

from harness.serve.launch import ManagedServer


def kill_instance(server: ManagedServer) -> None:
    """SIGKILL a running server's whole process group, as a crash or the OOM killer would.

    The group holds the API server and the EngineCore it forked, so nothing of the instance is
    left to answer. The server is not stopped or reaped here: noticing the death is the job of
    the code under test, and the session's exit still cleans up.
    """
    if server.pgid is None or not server.is_alive():
        raise RuntimeError(f"{server.name} is not running (exit code {server.exit_code})")
    os.killpg(server.pgid, signal.SIGKILL)

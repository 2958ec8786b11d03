"""How a server's exit and its surviving processes are said (harness/serve/process_groups.py):
the words of a ServerDied and a ServerStopFailed."""

from __future__ import annotations

import os

import psutil
import pytest

from harness.serve.process_groups import describe_exit, describe_process

pytestmark = pytest.mark.unit


def test_an_exit_is_said_as_a_code_or_the_signal_that_killed_it() -> None:
    """vLLM's API server exits with code 0 when its engine dies: "exit code 0", never a
    signal; a negative code is the signal's name, or its number when it has none."""
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


def test_a_survivor_is_said_with_its_name_and_state() -> None:
    """What outlived SIGKILL is named by what it runs and its state (a zombie, a D-state
    process stuck in the kernel), not by a pid alone, which says nothing once it is gone."""
    me = psutil.Process(os.getpid())
    assert describe_process(me) == f"pid {me.pid} ({me.name()}, {me.status()})"

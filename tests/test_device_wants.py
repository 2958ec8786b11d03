"""Marks of wanted devices (harness/serve/device_wants.py) between the threads of one process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from harness.serve.device_wants import marked_as_wanted, wanted_devices

pytestmark = pytest.mark.unit


def test_one_threads_wait_ending_leaves_another_threads_mark_of_the_same_device(
    tmp_path: Path,
) -> None:
    """Two pools of one process (xdist's threads) may wait for the same device: a mark per
    process alone, the first to get it (or give up) removed the other's, and the idle session
    holding the device was no longer told that someone still waits."""
    with marked_as_wanted(tmp_path, "cuda", (0,)):
        entered = threading.Event()

        def wait_and_give_up() -> None:
            with marked_as_wanted(tmp_path, "cuda", (0,)):
                entered.set()

        other = threading.Thread(target=wait_and_give_up)
        other.start()
        other.join(timeout=10)
        assert entered.is_set()
        wants = wanted_devices(tmp_path, "cuda")
        assert [(w.device, w.pid) for w in wants] == [(0, os.getpid())], wants
    assert wanted_devices(tmp_path, "cuda") == []

"""What a load samples (harness/serve/usage.py): a process tree's RSS and open files, and a
storage's files and bytes, cleaned between a soak's rounds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.serve.usage import clean_storage, storage_usage, tree_pids, tree_usage

pytestmark = pytest.mark.process

CHILD_OF_CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


def test_a_tree_is_summed_and_a_killed_unreaped_root_is_not_alive() -> None:
    parent = subprocess.Popen([sys.executable, "-c", CHILD_OF_CHILD])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while len(tree_pids(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        usage = tree_usage(parent.pid)
        assert usage.alive and usage.processes == 2 and usage.rss_bytes > 0 and usage.open_fds > 0
        pids = tree_pids(parent.pid)
        parent.kill()
        deadline = time.monotonic() + 10
        while tree_usage(parent.pid).alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tree_usage(parent.pid).alive  # a zombie until reaped: not alive
    finally:
        parent.kill()
        parent.wait()
        for pid in pids[1:]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
    assert not tree_usage(None).alive


def test_storage_is_counted_and_cleaned_keeping_the_directory(tmp_path: Path) -> None:
    (tmp_path / "h1").mkdir()
    (tmp_path / "h1" / "layer.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "loose").write_bytes(b"y" * 10)
    assert storage_usage(tmp_path) == storage_usage(tmp_path).__class__(2, 110)
    removed = clean_storage(tmp_path)
    assert (removed.files, removed.bytes) == (2, 110)
    assert tmp_path.is_dir() and not any(tmp_path.iterdir())
    assert storage_usage(tmp_path / "missing").files == 0 and storage_usage(None).bytes == 0


def test_a_link_in_the_storage_is_removed_and_what_it_points_to_is_kept(tmp_path: Path) -> None:
    """A connector's storage may hold a link to a directory elsewhere (a cache shared on
    purpose): cleaning removes the link, the storage is left empty, and the directory it
    pointed to keeps its files."""
    storage, elsewhere = tmp_path / "storage", tmp_path / "elsewhere"
    storage.mkdir()
    elsewhere.mkdir()
    (elsewhere / "kept.safetensors").write_bytes(b"z" * 5)
    (storage / "shared").symlink_to(elsewhere, target_is_directory=True)
    clean_storage(storage)
    assert not any(storage.iterdir())
    assert (elsewhere / "kept.safetensors").read_bytes() == b"z" * 5

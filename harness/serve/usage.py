"""What a running instance holds (memory, open files) and what its connectors left on disk.

A long run finds leaks only if it looks: the summed RSS and open file descriptors of each
instance's process tree (the API server, the engine core it spawned, the workers), and the
files and bytes in the connectors' storage directories.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil

from harness.outcomes.load import InstanceUsage, StorageUsage


def tree_usage(pid: int | None) -> InstanceUsage:
    """Summed RSS and open file descriptors of `pid` and its descendants (a process that
    exits while it is read is left out); `alive` False when `pid` itself is gone."""
    if pid is None:
        return InstanceUsage(alive=False)
    try:
        root = psutil.Process(pid)
        if root.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return InstanceUsage(alive=False)  # killed, not reaped yet
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return InstanceUsage(alive=False)
    rss = fds = count = 0
    for process in members:
        try:
            rss += process.memory_info().rss
            fds += process.num_fds()
            count += 1
        except psutil.Error:
            continue
    return InstanceUsage(rss_bytes=rss, open_fds=fds, processes=count, alive=True)


def tree_pids(pid: int | None) -> list[int]:
    """`pid` and its descendants now (what must be gone once the instance is stopped)."""
    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


def storage_usage(path: Path | None) -> StorageUsage:
    """Files and bytes under `path` (nothing when it is None or missing); a file removed while
    it is counted is left out."""
    if path is None or not path.is_dir():
        return StorageUsage()
    files = size = 0
    for directory, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(directory, name)).st_size
                files += 1
            except FileNotFoundError:
                continue
    return StorageUsage(files, size)


def clean_storage(path: Path | None) -> StorageUsage:
    """Remove everything under `path`, keeping the directory; returns what was removed. Call it
    only while no request is in flight: a connector may be reading or writing any file."""
    removed = storage_usage(path)
    if path is None or not path.is_dir():
        return removed
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return removed

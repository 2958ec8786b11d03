"""Marks of the devices a process waits for, so that their holder can let go at its next step.

A device lock (`harness.serve.ports.lease_devices`) tells a waiter only that a device is held,
and its holder nothing: on a multi-worker GPU night one xdist worker's pool keeps a session up
after its items (another item may want it) until it needs the room itself or its session ends,
while the worker goes on serving other topologies on other devices. Another worker waiting for
that idle session's device sat idle all that time. So a waiter writes a mark beside each lock
it waits on, `<kind>-device-<N>.wanted.<pid>.<thread>` holding its pid, and removes it when it
gets the devices or gives up; a pool reads the marks at each step (`TopologyPool.open`,
`private`) and stops its idle sessions on a wanted device.

A mark is only a hint, never a lock: a waiter killed by SIGKILL leaves its mark, so a mark
whose pid is no longer alive is ignored. Marks of this very process (another thread's pool, an
item's own lease) count like any other: the pool reading them is not the one waiting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.files import write_text_atomic


@dataclass(frozen=True)
class DeviceWant:
    """A live process waiting for `device` of `kind` (cuda, xpu); `waiter` tells its waits
    apart (one per thread), as a lease wants all its devices or none."""

    kind: str
    device: int
    pid: int
    waiter: str


def mark_path(lock_dir: Path, kind: str, device: int) -> Path:
    """This waiter's mark for `device`: one per process and thread, so two waiters for the
    same device (or one process's two pools) never overwrite or remove each other's."""
    return lock_dir / f"{kind}-device-{device}.wanted.{os.getpid()}.{threading.get_ident()}"


@contextlib.contextmanager
def marked_as_wanted(lock_dir: Path, kind: str, devices: tuple[int, ...]) -> Iterator[None]:
    """Mark `devices` as wanted by this process while the block runs (its wait); the marks are
    removed however it ends: the devices leased, an error, an interruption."""
    paths = [mark_path(lock_dir, kind, device) for device in devices]
    try:
        for path in paths:
            write_text_atomic(path, f"{os.getpid()}\n")
        yield
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def wanted_devices(lock_dir: Path, kind: str) -> list[DeviceWant]:
    """The devices of `kind` some live process waits for now, by the marks under `lock_dir`.
    A mark that cannot be read or names a dead process is ignored."""
    wants = []
    for path in sorted(lock_dir.glob(f"{kind}-device-*.wanted.*")):
        device, _, waiter = path.name.removeprefix(f"{kind}-device-").partition(".wanted.")
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):  # removed as it was read, or not a mark of ours
            continue
        if device.isdigit() and _alive(pid):
            wants.append(DeviceWant(kind, int(device), pid, waiter))
    return wants


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True

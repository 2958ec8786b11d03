"""Lock files in a shared directory another user made first (flock(1)'s /tmp/epd-vllm.lock, the
port lock directory): the harness waits on them instead of failing to open them.

As root no file mode refuses an open, so the other user is simulated: `os.open` (and the
`open` a module calls) refuses what the kernel refuses a user on a 0644 file owned by someone
else in a sticky /tmp, namely write access and, under fs.protected_regular, O_CREAT."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from harness.cli.versions import wait_for_lock
from harness.preflight import upstream_proxy
from harness.serve import ports

pytestmark = pytest.mark.unit

WRITE_OR_CREATE = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@pytest.fixture
def others_files(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Files made by another user: opening one for writing or with O_CREAT is refused."""
    others: list[Path] = []
    real_open = os.open

    def as_another_user(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path) in others and flags & WRITE_OR_CREATE:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    def builtin_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if Path(path) in others and any(c in mode for c in "wax+"):
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", as_another_user)
    monkeypatch.setattr(upstream_proxy, "open", builtin_open, raising=False)
    return others


def made_by_another_user(path: Path, others: list[Path]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    path.chmod(0o444)
    others.append(path)
    return path


def test_versions_lock_file_of_another_user_is_waited_on(
    tmp_path: Path, others_files: list[Path]
) -> None:
    lock = made_by_another_user(tmp_path / "epd-vllm.lock", others_files)
    fd, _ = wait_for_lock(str(lock))
    try:
        with open(lock) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_port_and_device_locks_of_another_user_are_taken(
    tmp_path: Path, others_files: list[Path]
) -> None:
    made_by_another_user(tmp_path / "port-20000.lock", others_files)
    fd = ports._lock_port(tmp_path / "port-20000.lock")
    assert fd is not None
    os.close(fd)
    made_by_another_user(tmp_path / "gpu-device-0.lock", others_files)
    [lease] = ports.lease_devices("gpu", (0,), tmp_path)
    assert not ports.devices_free("gpu", {0}, tmp_path)
    lease.release()
    ports._wait_until_free(tmp_path / "gpu-device-0.lock")


def test_sdist_cache_lock_of_another_user_is_taken(
    tmp_path: Path, others_files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    made_by_another_user(tmp_path / "vllm-proxy" / ".0.33.0.lock", others_files)
    monkeypatch.setattr(upstream_proxy, "_cached", lambda directory: None)
    monkeypatch.setattr(upstream_proxy, "_fetch", lambda *args: "fetched")
    assert upstream_proxy.cached_or_fetched("0.33.0", tmp_path) == "fetched"


def test_a_missing_lock_file_is_created(tmp_path: Path) -> None:
    fd, _ = wait_for_lock(str(tmp_path / "new.lock"))
    os.close(fd)
    assert (tmp_path / "new.lock").is_file()

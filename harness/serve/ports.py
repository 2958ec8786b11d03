"""Hold the ports you pick: a port is reserved from the moment it is chosen until it is released.

"Find a free port, close it, hand the number to a server" races twice: a parallel harness
process (a pytest-xdist worker, a second CI job on the same host) can pick the same number, and
any process can bind it before the server does. The first race costs a confusing startup failure
at best, and at worst a health check answered by *another* run's server. So a `PortLease` holds
two things:

* an exclusive `flock` on `<lock_dir>/port-<N>.lock`, for the lease's whole life (that is, while
  the server runs). Every harness process honours it, so no two of them ever share a port. The
  kernel drops the lock when the holder dies, even by SIGKILL, so a crash leaves nothing stale.
* a socket bound to 127.0.0.1:N, kept bound until `hand_over()`, right before the server is
  spawned. That proves the port is bindable now and keeps other programs off it for all but the
  instant between `hand_over()` and the server's own bind. It binds with SO_REUSEADDR, as
  servers do (uvicorn included): then connections left in TIME_WAIT by an earlier server on the
  port, which would not stop the new server, do not make the port look busy either, while a
  listening socket still does.

Ports come from 20000-29999, below Linux's ephemeral range (32768-60999 by default), so outgoing
connections of unrelated programs do not land on them; the scan starts at a random port so
parallel workers do not all contend for the same first few.

Lock files are never deleted: unlinking a lock file while another process opens it would let
two processes "hold" locks on two different files of the same name. They are empty, one per
port ever used. The lock directory must be writable by everyone who shares it; users who cannot
share one should set `EPD_HARNESS_PORT_DIR` (then only the bind check keeps them apart).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
from collections.abc import Callable
from pathlib import Path

from harness.environment import LOOPBACK_HOST, port_lock_dir
from harness.environment import port_range as configured_port_range
from harness.errors import HarnessError
from harness.files import open_lock_file
from harness.serve.device_wants import marked_as_wanted


class NoFreePortError(HarnessError):
    """Not enough ports in the range were both unlocked and bindable."""


class PortLease:
    """One reserved TCP port on 127.0.0.1, held from choice until `release()`.

    Made by `reserve_ports`. While the lease is held, no other harness process can reserve the
    port; until `hand_over()`, no other program can bind it (without SO_REUSEADDR) either.
    """

    def __init__(
        self, port: int, lock_path: Path, lock_fd: int, probe: socket.socket | None
    ) -> None:
        self._port = port
        self._lock_path = lock_path
        self._lock_fd: int | None = lock_fd
        self._probe: socket.socket | None = probe

    @property
    def port(self) -> int:
        return self._port

    @property
    def lock_path(self) -> Path:
        return self._lock_path

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def hand_over(self) -> int:
        """Unbind the probe socket so the server can bind the port; keep the lock. Returns the port.

        Call it right before spawning the server. Calling it again is harmless; calling it on a
        released lease is a bug (the port is no longer protected), so that raises.
        """
        if self._lock_fd is None:
            raise RuntimeError(f"port {self._port}: cannot hand over a released lease")
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        return self._port

    def release(self) -> None:
        """Unbind the probe (if still bound) and drop the lock. Idempotent."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the only descriptor drops the flock
            self._lock_fd = None

    def __enter__(self) -> PortLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._lock_fd is None else "probing" if self._probe else "handed over"
        return f"PortLease(port={self._port}, {state})"


def reserve_ports(
    count: int,
    *,
    start: int | None = None,
    lock_dir: Path | None = None,
    port_range: range | None = None,
    host: str = LOOPBACK_HOST,
) -> list[PortLease]:
    """Reserve `count` distinct ports of `port_range`, scanning up from `start` and wrapping around.

    `host` is the address the servers will bind (loopback by default; a node's address when
    a Ray launcher reserves them on that node): the bind probe holds the port there.

    `start` defaults to a random port of the range, drawn from the OS's entropy rather than the
    `random` module's state, which test plugins commonly seed identically in every worker.
    Ports locked by another lease (of this or another process) or bound by any process are
    skipped. Raises `NoFreePortError` naming the range and why ports were refused; on failure,
    the leases taken so far are released.
    """
    port_range = port_range if port_range is not None else configured_port_range()
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if len(port_range) == 0:
        raise ValueError(f"empty port range {port_range!r}")
    if start is None:
        start = random.SystemRandom().choice(port_range)
    elif start not in port_range:
        raise ValueError(f"start port {start} is outside {_describe(port_range)}")
    lock_dir = lock_dir if lock_dir is not None else port_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)

    offset = start - port_range.start
    candidates = [*port_range[offset:], *port_range[:offset]]
    leases: list[PortLease] = []
    locked = busy = 0
    try:
        for port in candidates:
            lock_path = lock_dir / f"port-{port}.lock"
            lock_fd = _lock_port(lock_path)
            if lock_fd is None:
                locked += 1
                continue
            try:
                probe = _bind_probe(port, host)
            except BaseException:
                os.close(lock_fd)
                raise
            if probe is None:
                os.close(lock_fd)
                busy += 1
                continue
            leases.append(PortLease(port, lock_path, lock_fd, probe))
            if len(leases) == count:
                return leases
    except BaseException:  # interrupted, or a host that cannot be bound: nothing stays held
        for lease in leases:
            lease.release()
        raise
    for lease in leases:
        lease.release()
    raise NoFreePortError(
        f"found only {len(leases)} of {count} free ports on {host} in "
        f"{_describe(port_range)} (scanned from {start}): {locked} locked by other harness "
        f"leases under {lock_dir}, {busy} bound by other processes"
    )


def _describe(port_range: range) -> str:
    return f"ports {port_range.start}-{port_range.stop - 1}"


def _lock_port(lock_path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on `lock_path`, or None if someone holds it.

    flock locks belong to the open file description, so a second lease on the same port within
    this process is refused just like one from another process. The descriptor is close-on-exec
    (Python's default), so spawned servers do not inherit the lock and keep it past the harness.
    """
    fd = open_lock_file(lock_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bind_probe(port: int, host: str = LOOPBACK_HOST) -> socket.socket | None:
    """A socket bound to `host`:`port`, or None if the port is in use."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))
    except OSError as exc:
        probe.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise OSError(exc.errno, f"cannot probe {host}:{port}: {exc.strerror}") from exc
    return probe


def lease_devices(
    kind: str,
    devices: tuple[int, ...],
    lock_dir: Path | None = None,
    before_wait: Callable[[], None] | None = None,
) -> list[PortLease]:
    """Exclusive locks on GPU / XPU `devices` (`<lock_dir>/<kind>-device-<N>.lock`), waiting for
    a holder to let go: parallel workers that reach a later wave early queue for its devices
    instead of sharing them. The leases have no socket; `release()` drops the lock.

    All of them or none: while one device is busy the lease holds none of the others, and waits
    for that one alone before it tries them all again. Taken one by one, a lease held device 0
    while it waited for device 1, whose holder (a worker keeping its 1E+1PD session up) waited
    for device 0, the baseline's: the GPU night, rehearsed with the fake vLLM on eight devices,
    hung there with every worker waiting.

    `before_wait` is called once, holding none of these, before the first wait: the caller lets
    go of what else it holds (a pool's other sessions), so nothing it keeps can be what the
    holder it waits for waits for in turn.

    While it waits it marks every device it asked for as wanted (`device_wants`): a pool of
    another worker that keeps an idle session on one of them stops it at its next step, instead
    of at its session's end. The marks go when the lease returns or is given up."""
    lock_dir = lock_dir if lock_dir is not None else port_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    paths = [(device, lock_dir / f"{kind}-device-{device}.lock") for device in sorted(devices)]
    waited = False
    with contextlib.ExitStack() as marks:
        while True:
            leases: list[PortLease] = []
            busy: Path | None = None
            try:
                for device, lock_path in paths:
                    fd = _lock_port(lock_path)
                    if fd is None:
                        busy = lock_path
                        break
                    leases.append(PortLease(device, lock_path, fd, None))
            except BaseException:
                for lease in leases:
                    lease.release()
                raise
            if busy is None:
                return leases
            for lease in leases:
                lease.release()
            if not waited:
                if before_wait is not None:
                    before_wait()
                marks.enter_context(marked_as_wanted(lock_dir, kind, tuple(sorted(devices))))
                waited = True
            _wait_until_free(busy)


def devices_free(kind: str, devices: set[int], lock_dir: Path | None = None) -> bool:
    """Whether nobody holds any of `devices` now (each lock taken and let go at once): a
    pool asks before it lets go of a session for a waiter, which gets its devices all or
    none."""
    lock_dir = lock_dir if lock_dir is not None else port_lock_dir()
    for device in sorted(devices):
        fd = _lock_port(lock_dir / f"{kind}-device-{device}.lock")
        if fd is None:
            return False
        os.close(fd)
    return True


def _wait_until_free(lock_path: Path) -> None:
    """Block until nobody holds `lock_path`'s lock (taking it, then letting it go at once)."""
    fd = open_lock_file(lock_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)

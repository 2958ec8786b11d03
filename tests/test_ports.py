"""Port leases against real sockets, real flocks and real competing processes."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.environment import (
    DEFAULT_PORT_RANGE,
    PORT_LOCK_DIR_ENV,
    PORT_RANGE_ENV,
    port_lock_dir,
)
from harness.serve.ports import NoFreePortError, PortLease, reserve_ports
from harness.testing.processes import child_env

pytestmark = pytest.mark.process

SUBPROCESS_TIMEOUT_S = 20

# Run in a separate process: report whether the lease's lock file and port are free to it.
CONTENDER = r"""
import fcntl, json, os, sys
from pathlib import Path
from harness.serve.ports import NoFreePortError, reserve_ports
lock_path, port = Path(sys.argv[1]), int(sys.argv[2])
fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    flock = "acquired"
    fcntl.flock(fd, fcntl.LOCK_UN)
except BlockingIOError:
    flock = "blocked"
os.close(fd)
try:
    leases = reserve_ports(1, lock_dir=lock_path.parent, port_range=range(port, port + 1))
    reserve = "reserved"
    leases[0].release()
except NoFreePortError as exc:
    reserve = str(exc)
print(json.dumps({"flock": flock, "reserve": reserve}))
"""

# Run in several processes at once: reserve ports, print them, hold them until stdin closes.
HOLDER = r"""
import json, sys
from pathlib import Path
from harness.serve.ports import reserve_ports
lock_dir, start, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
leases = reserve_ports(count, start=start, lock_dir=lock_dir)
print(json.dumps([lease.port for lease in leases]), flush=True)
sys.stdin.read()
"""


def run_python(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=child_env(),
        check=False,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr}"
    return result.stdout


def contend(lease: PortLease) -> dict[str, str]:
    return json.loads(run_python(CONTENDER, str(lease.lock_path), str(lease.port)))


def bind_listener(port: int) -> socket.socket:
    """Bind and listen the way an ordinary server would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def a_free_port(port_locks: Path) -> int:
    (lease,) = reserve_ports(1, lock_dir=port_locks)
    lease.release()
    return lease.port


def test_leases_of_one_call_are_distinct_and_in_range(port_locks: Path) -> None:
    leases = reserve_ports(20, lock_dir=port_locks)
    try:
        ports = [lease.port for lease in leases]
        assert len(set(ports)) == 20
        assert all(port in DEFAULT_PORT_RANGE for port in ports)
        assert all(lease.lock_path == port_locks / f"port-{lease.port}.lock" for lease in leases)
    finally:
        for lease in leases:
            lease.release()


def test_two_calls_from_the_same_start_do_not_share_a_port(port_locks: Path) -> None:
    start = a_free_port(port_locks)
    first = reserve_ports(3, start=start, lock_dir=port_locks)
    second = reserve_ports(3, start=start, lock_dir=port_locks)
    try:
        assert first[0].port == start
        assert not {lease.port for lease in first} & {lease.port for lease in second}
    finally:
        for lease in first + second:
            lease.release()


def test_parallel_processes_never_share_a_port(port_locks: Path) -> None:
    start = a_free_port(port_locks)  # all three scan from the same port: maximal contention
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(port_locks), str(start), "25"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for _ in range(3)
    ]
    try:
        # Every holder prints only once it holds all its leases, and holds them until stdin
        # closes, so all three sets are held at the same time when compared.
        port_sets = []
        for holder in holders:
            line = holder.stdout.readline()
            assert line, f"holder failed: {holder.stderr.read()}"
            port_sets.append(set(json.loads(line)))
        assert all(len(ports) == 25 for ports in port_sets)
        assert len(set.union(*port_sets)) == 75, port_sets
    finally:
        for holder in holders:
            holder.stdin.close()
            holder.wait(timeout=SUBPROCESS_TIMEOUT_S)
            holder.stdout.close()
            holder.stderr.close()


def test_lease_is_locked_against_other_processes_until_released(port_locks: Path) -> None:
    (lease,) = reserve_ports(1, lock_dir=port_locks)
    try:
        while_probing = contend(lease)
        assert while_probing["flock"] == "blocked"
        assert "1 locked by other harness leases" in while_probing["reserve"]

        lease.hand_over()  # the server now binds the port; the lock must stay
        after_hand_over = contend(lease)
        assert after_hand_over["flock"] == "blocked"
        assert f"ports {lease.port}-{lease.port}" in after_hand_over["reserve"]
    finally:
        lease.release()
    assert contend(lease) == {"flock": "acquired", "reserve": "reserved"}


def test_probe_keeps_the_port_bound_until_hand_over(port_locks: Path) -> None:
    (lease,) = reserve_ports(1, lock_dir=port_locks)
    with lease:
        plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with plain, pytest.raises(OSError) as refused:
            plain.bind(("127.0.0.1", lease.port))
        assert refused.value.errno == errno.EADDRINUSE

        assert lease.hand_over() == lease.port
        # Unbound, not only bindable with SO_REUSEADDR: a server that binds without it (or
        # checks the port that way first) must find it free too.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as strict:
            strict.bind(("127.0.0.1", lease.port))
        bind_listener(lease.port).close()


def test_released_port_can_be_bound(port_locks: Path) -> None:
    (lease,) = reserve_ports(1, lock_dir=port_locks)
    lease.release()
    bind_listener(lease.port).close()


def test_release_is_idempotent_and_ends_the_lease(port_locks: Path) -> None:
    with reserve_ports(1, lock_dir=port_locks)[0] as lease:
        assert lease.held
    assert not lease.held
    lease.release()
    with pytest.raises(RuntimeError, match=f"port {lease.port}: cannot hand over a released"):
        lease.hand_over()


def test_exhausted_range_raises_naming_the_range(port_locks: Path) -> None:
    (lease,) = reserve_ports(1, lock_dir=port_locks)
    port = lease.port
    try:
        with pytest.raises(NoFreePortError) as exhausted:
            reserve_ports(1, lock_dir=port_locks, port_range=range(port, port + 1))
        message = str(exhausted.value)
        assert f"ports {port}-{port}" in message
        assert "1 locked by other harness leases" in message
        assert str(port_locks) in message
    finally:
        lease.release()


def test_busy_port_is_skipped(port_locks: Path) -> None:
    listener = bind_listener(a_free_port(port_locks))
    port = listener.getsockname()[1]
    with listener, pytest.raises(NoFreePortError, match="1 bound by other processes"):
        reserve_ports(1, lock_dir=port_locks, port_range=range(port, port + 1))
    # The refused port's lock was dropped: once the listener is gone, the port is reservable.
    reserve_ports(1, lock_dir=port_locks, port_range=range(port, port + 1))[0].release()


def test_failed_reservation_releases_what_it_took(port_locks: Path) -> None:
    port = a_free_port(port_locks)
    with pytest.raises(NoFreePortError, match="found only 1 of 2"):
        reserve_ports(2, lock_dir=port_locks, port_range=range(port, port + 1))
    reserve_ports(1, lock_dir=port_locks, port_range=range(port, port + 1))[0].release()


def test_time_wait_does_not_make_a_port_look_busy(port_locks: Path) -> None:
    port = a_free_port(port_locks)
    # Leave a connection in TIME_WAIT on the port: the server side closes first.
    with bind_listener(port) as listener:
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()
        client.recv(1)
        client.close()
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with plain, pytest.raises(OSError) as in_time_wait:
        plain.bind(("127.0.0.1", port))
    assert in_time_wait.value.errno == errno.EADDRINUSE, "precondition: TIME_WAIT on the port"

    (lease,) = reserve_ports(1, lock_dir=port_locks, port_range=range(port, port + 1))
    lease.release()


def test_lock_dir_defaults_to_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PORT_LOCK_DIR_ENV, str(tmp_path / "from-env"))
    assert port_lock_dir() == tmp_path / "from-env"
    (lease,) = reserve_ports(1)
    with lease:
        assert lease.lock_path.parent == tmp_path / "from-env"
        with open(lease.lock_path) as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_arguments_are_checked(port_locks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)  # an xdist worker's slice: the default
    with pytest.raises(ValueError, match="count must be at least 1, got 0"):
        reserve_ports(0, lock_dir=port_locks)
    with pytest.raises(ValueError, match="start port 80 is outside ports 20000-29999"):
        reserve_ports(1, start=80, lock_dir=port_locks)


@pytest.mark.parametrize(
    "cut_in", [KeyboardInterrupt(), OSError(errno.EADDRNOTAVAIL, "cannot assign address")]
)
def test_a_reservation_cut_short_holds_no_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut_in: BaseException
) -> None:
    """A Ctrl-C between two ports, or a host the probe cannot bind (a wrong node address),
    gives back what was taken so far, the port being probed too (found in review: only a
    range without free ports did)."""
    import harness.serve.ports as ports
    from harness.testing.processes import lease_is_held

    probe, probed = ports._bind_probe, []

    def cut_at_the_second(port: int, host: str = "127.0.0.1"):
        probed.append(port)
        if len(probed) == 2:
            raise cut_in
        return probe(port, host)

    monkeypatch.setattr(ports, "_bind_probe", cut_at_the_second)
    with pytest.raises(type(cut_in)):
        reserve_ports(3, lock_dir=tmp_path)
    assert len(probed) == 2
    held = [port for port in probed if lease_is_held(tmp_path / f"port-{port}.lock")]
    assert held == [], f"still locked after the reservation was cut short: {held}"


def test_a_lease_still_taken_is_seen_held_and_one_given_back_is_not(tmp_path: Path) -> None:
    """`lease_is_held` is what the process tests ask to prove that a run gave its ports back:
    it must say yes while a lease is taken, or every such check passes whatever was left."""
    from harness.testing.processes import lease_is_held

    [lease] = reserve_ports(1, lock_dir=tmp_path)
    lock = tmp_path / f"port-{lease.port}.lock"
    assert lease_is_held(lock)
    lease.release()
    assert not lease_is_held(lock)
    assert not lease_is_held(tmp_path / "port-1.lock")  # never taken


# --- device leases ---------------------------------------------------------------------------


def test_a_device_lease_holds_none_of_its_devices_while_it_waits_for_another(
    tmp_path: Path,
) -> None:
    """Found by the GPU night rehearsed with the fake vLLM on eight devices: it hung, every
    worker waiting on a device lock. One worker's lease of every device held device 0 while it
    waited for device 1; the worker holding device 1 (its 1E+1PD session) waited for device 0,
    the baseline's. A lease waiting for a device must hold none of the others it asked for."""
    from harness.serve.ports import lease_devices

    elsewhere = lease_devices("cuda", (1,), tmp_path)  # a neighbour's session on device 1
    leased: list[list[PortLease]] = []
    waiting = threading.Thread(
        target=lambda: leased.append(lease_devices("cuda", (0, 1), tmp_path)), daemon=True
    )
    waiting.start()
    baseline: list[list[PortLease]] = []
    neighbour = threading.Thread(
        target=lambda: baseline.append(lease_devices("cuda", (0,), tmp_path)), daemon=True
    )
    try:
        time.sleep(0.5)  # the wide lease is waiting for device 1 by now
        assert waiting.is_alive() and not leased
        neighbour.start()  # device 1's holder asks for the baseline's device
        neighbour.join(timeout=5)
        assert baseline, "device 0 stayed held by a lease that waits for device 1: a deadlock"
        assert waiting.is_alive(), "the wide lease cannot have device 1 yet"
    finally:
        for lease in elsewhere:
            lease.release()
        for leases in baseline:
            for lease in leases:
                lease.release()
        waiting.join(timeout=5)
        neighbour.join(timeout=5)
        for leases in (*leased, *baseline):
            for lease in leases:
                lease.release()
    assert [lease.port for lease in leased[0]] == [0, 1], "it gets both once both are free"
    assert not waiting.is_alive()


# --- marks of the devices a lease waits for ---------------------------------------------------


def test_a_waiting_device_lease_marks_every_device_it_asked_for_until_it_gets_them(
    tmp_path: Path,
) -> None:
    """A pool of another worker reads the marks at its next step and stops an idle session on
    a wanted device (`device_wants`): a lease that waits must leave them while it waits, after
    its `before_wait` (the caller's own let-go sees none of its own), and none once it has its
    devices."""
    from harness.serve.device_wants import DeviceWant, wanted_devices
    from harness.serve.ports import lease_devices

    elsewhere = lease_devices("cuda", (1,), tmp_path)
    seen_before_wait: list[list[DeviceWant]] = []
    leased: list[list[PortLease]] = []
    waiting = threading.Thread(
        target=lambda: leased.append(
            lease_devices(
                "cuda",
                (0, 1),
                tmp_path,
                before_wait=lambda: seen_before_wait.append(wanted_devices(tmp_path, "cuda")),
            )
        ),
        daemon=True,
    )
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while len(wanted_devices(tmp_path, "cuda")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        wants = wanted_devices(tmp_path, "cuda")
        assert [(want.device, want.pid) for want in wants] == [(0, os.getpid()), (1, os.getpid())]
        assert len({want.waiter for want in wants}) == 1, "one wait, all or none of its devices"
        assert wanted_devices(tmp_path, "xpu") == []
        assert seen_before_wait == [[]]
    finally:
        for lease in elsewhere:
            lease.release()
        waiting.join(timeout=10)
    assert [lease.port for lease in leased[0]] == [0, 1]
    assert list(tmp_path.glob("*.wanted*")) == [], "a mark outlived the wait"
    for lease in leased[0]:
        lease.release()


def test_a_device_lease_interrupted_while_it_waits_leaves_no_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the wait (or a pytest timeout): the mark goes with the lease, or a pool
    would stop sessions for a waiter that gave up, as long as its process lives."""
    from harness.serve import ports
    from harness.serve.device_wants import wanted_devices

    elsewhere = ports.lease_devices("cuda", (0,), tmp_path)
    marked_while_waiting: list[int] = []

    def interrupted(lock_path: Path) -> None:
        marked_while_waiting.extend(want.device for want in wanted_devices(tmp_path, "cuda"))
        raise KeyboardInterrupt

    monkeypatch.setattr(ports, "_wait_until_free", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            ports.lease_devices("cuda", (0, 2), tmp_path)
    finally:
        for lease in elsewhere:
            lease.release()
    assert marked_while_waiting == [0, 2]
    assert list(tmp_path.glob("*.wanted*")) == []


def test_a_mark_of_a_process_that_is_gone_is_ignored(tmp_path: Path) -> None:
    """A waiter killed by SIGKILL leaves its mark behind: nobody waits for the device, and no
    pool should stop a session for it. Marks that are not a pid are ignored too."""
    from harness.serve.device_wants import marked_as_wanted, wanted_devices

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    (tmp_path / "cuda-device-3.wanted.1.1").write_text(gone.stdout)
    (tmp_path / "cuda-device-4.wanted.1.1").write_text("not a pid\n")
    assert wanted_devices(tmp_path, "cuda") == []
    with marked_as_wanted(tmp_path, "cuda", (5,)):
        assert [(want.device, want.pid) for want in wanted_devices(tmp_path, "cuda")] == [
            (5, os.getpid())
        ]
    assert wanted_devices(tmp_path, "cuda") == []


def test_a_scan_from_near_the_ranges_end_wraps_around_to_its_start(port_locks: Path) -> None:
    """A random start near the range's end must not leave a reservation a port or two: the
    scan goes on from the range's first port. Found in review: a mutant that scanned from the
    start to the range's end only survived every test."""
    last = DEFAULT_PORT_RANGE[-1]
    leases = reserve_ports(3, start=last, lock_dir=port_locks, port_range=DEFAULT_PORT_RANGE)
    try:
        ports = [lease.port for lease in leases]
        assert len(set(ports)) == 3 and all(port in DEFAULT_PORT_RANGE for port in ports)
        assert sum(port < last for port in ports) >= 2, ports
    finally:
        for lease in leases:
            lease.release()


def test_a_host_that_cannot_be_bound_is_an_error_not_a_busy_port(port_locks: Path) -> None:
    """Only a port in use (EADDRINUSE) is skipped as busy; an address this host does not have
    (a Ray node's, mistyped) is an error naming it, not 'N bound by other processes' after a
    scan of the whole range. Found in review: a mutant that took every bind error for a busy
    port survived every test."""
    port = a_free_port(port_locks)
    with pytest.raises(OSError, match="cannot probe 192.0.2.1") as failed:
        reserve_ports(1, lock_dir=port_locks, port_range=range(port, port + 1), host="192.0.2.1")
    assert not isinstance(failed.value, NoFreePortError)


def test_asking_whether_devices_are_free_leaves_them_free(tmp_path: Path) -> None:
    """A pool asks `devices_free` before it lets go of a session for a waiter: each lock is
    taken and given back at once. One kept would hold the device from every other worker,
    and from this process's own next lease of it (a flock is of its open file)."""
    from harness.serve.ports import devices_free
    from harness.testing.processes import lease_is_held

    assert devices_free("gpu", {0, 1}, tmp_path)
    held = [d for d in (0, 1) if lease_is_held(tmp_path / f"gpu-device-{d}.lock")]
    assert held == [], f"devices still locked after the check: {held}"

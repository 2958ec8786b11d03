"""A process that stops the harness's servers when the harness cannot: after it was SIGKILLed.

Why: the parent-death signal (PR_SET_PDEATHSIG, see `harness.serve.launch`) only asks a server's
leader process to stop, and only the leader; vLLM 0.32's API server does not act on that
SIGTERM while its engine starts (reported in issue 8: both instances of a run still alive 60 s
after the harness was SIGKILLed 12-22 s into start-up; on this project's machine the servers went
down by themselves in 13 of 13 trials, some only after 5 s). On a GPU such orphans hold device
memory and fail the next job. So stopping must not depend on the servers' cooperation: a small
process outlives the harness and, once the harness is gone, stops every process group it had not
finished stopping: SIGTERM, a bounded wait, SIGKILL (group and recorded descendants).

The harness (`WatchdogClient`, used by `harness.serve.launch.ManagedServer`) starts it once, lazily
at the first server start, as `[sys.executable, "-m", "harness.serve.watchdog"]` in a session of its
own (a signal to the harness's process group does not reach it) with SIGINT, SIGTERM and SIGHUP
ignored. Protocol: one JSON object per line on the watchdog's stdin:

    {"event": "start", "pgid": 1234, "create_time": 1717.52, "name": "1P+1D/decode0",
     "log": "/run/1P-1D/1P-1D__decode0.log",
     "scratch": "/tmp/epdray-2ce98e-1"}           a server's group exists (pgid = leader pid)
    {"event": "done", "pgid": 1234}               the harness emptied that group itself

(create_time: when the leader was created, in seconds after boot. scratch, optional: a
directory the harness made for that server alone, `ServerCommand.scratch_dir`.)

End of file on stdin means the harness is gone, however it ended (the kernel closes the pipe of
a SIGKILLed process too). With no group left, the watchdog exits at once; otherwise it acts and
appends one line per action to `watchdog.log` beside the server's log (stderr if no log given).

Scratch directories: a Ray rehearsal node's temp dir (/tmp/epdray-*, tens of files, sockets)
is removed by the harness after it stopped the node, so a SIGKILLed harness left one per node
per run. The watchdog removes a group's scratch directory, but only once that group is gone
(nothing may still write into it, and a server must not lose its files while it runs), only
for a group it stopped (one the harness reported "done" is its owner's to remove), never
through a symbolic link, and only a path given in a "start" line, which the harness sends only
for directories it made itself.

Pid reuse: a process is its pid and its creation time in seconds after boot (`boot_seconds`;
not an epoch time, which a step of the wall clock would change). While the harness lives, each
leader is its unreaped child, so its pid (the group id) cannot be reused, and the watchdog samples
the group's members and the leader's descendants (pid + create time) every SAMPLE_INTERVAL_S. After
the harness died the leaders are reparented and may be reaped; then group G is signalled only while
a recorded process (same pid and create time; a zombie counts, it still pins the id) is in it, and a
descendant that left the group only while its pid still has the recorded create time. A member
forked less than a sample interval before the harness died, in a group whose recorded processes are
all gone, is missed.

The harness never needs an answer, so a watchdog that died is not waited on; the client starts a
new one and re-registers the live groups at the next event. Setting EPD_HARNESS_WATCHDOG=off (or 0)
disables it (for experiments showing what it prevents; the parent-death signal remains).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from harness.environment import watchdog_enabled
from harness.serve.process_groups import is_live_process

LOG_NAME = "watchdog.log"
SAMPLE_INTERVAL_S = 0.5
# The harness is gone, so no request is in flight: a short grace. The leaders already got the
# parent-death SIGTERM when the harness died.
GRACE_S = 5.0
KILL_WAIT_S = 5.0
POLL_S = 0.05
CREATE_TIME_TOLERANCE_S = 0.005  # create times are in clock ticks (10 ms): same tick = same


# -- the harness side --------------------------------------------------------------------------


class WatchdogClient:
    """The harness's handle on its watchdog: started on first use, told of every group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._popen: subprocess.Popen[bytes] | None = None
        self._groups: dict[int, bytes] = {}  # pgid -> its "start" line, to replay to a new one
        self._atexit_registered = False
        self.owner_pid = os.getpid()

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @staticmethod
    def enabled() -> bool:
        return watchdog_enabled()

    def ensure_running(self) -> None:
        """Start the watchdog now if there is none (before a server spawn, so none goes
        unwatched); a no-op when disabled."""
        if not self.enabled():
            return
        with self._lock:
            if self._popen is None or self._popen.poll() is not None:
                self._spawn()

    def started(
        self, pgid: int, name: str, log_path: Path | None, scratch_dir: Path | None = None
    ) -> None:
        """Record a group whose leader `pgid` the harness just spawned (and has not reaped),
        and the scratch directory the harness made for it, if any."""
        if not self.enabled():
            return
        try:
            create_time = boot_seconds(pgid)
        except psutil.NoSuchProcess:  # cannot happen for an unreaped child; be safe anyway
            return
        line = _encode(
            event="start",
            pgid=pgid,
            create_time=create_time,
            name=name,
            log=str(log_path) if log_path else "",
            scratch=str(scratch_dir) if scratch_dir else "",
        )
        with self._lock:
            self._groups[pgid] = line
            self._send(line)

    def done(self, pgid: int) -> None:
        """The harness emptied group `pgid` (and is about to reap its leader): forget it."""
        with self._lock:
            if self._groups.pop(pgid, None) is not None:
                self._send(_encode(event="done", pgid=pgid))

    def close(self, wait_s: float = 2.0) -> None:
        """Close the pipe (the watchdog's EOF); reap it if it had nothing left to do."""
        with self._lock:
            popen, self._popen = self._popen, None
            pending = bool(self._groups)
        if popen is None:
            return
        try:
            popen.stdin.close()
        except OSError:
            pass
        if not pending:
            try:
                popen.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass

    def _send(self, line: bytes) -> None:
        """Write one line (callers hold the lock). If there is no live watchdog, start one and
        give it every recorded group instead (that includes `line` if it is a "start")."""
        if self._popen is not None and self._popen.poll() is None:
            try:
                os.write(self._popen.stdin.fileno(), line)
                return
            except OSError:  # it died (EPIPE): a new one takes over below
                pass
        self._spawn()

    def _spawn(self) -> None:
        # The directory holding the `harness` package (this file is harness/serve/watchdog.py).
        package_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "harness.serve.watchdog"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=None,  # the harness's: a crash of the watchdog shows there
            env={**os.environ, "PYTHONPATH": pythonpath},
            start_new_session=True,
            close_fds=True,
        )
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        for replay in self._groups.values():  # a replacement takes over what is recorded
            os.write(self._popen.stdin.fileno(), replay)


_CLIENT: WatchdogClient | None = None
_CLIENT_LOCK = threading.Lock()


def client() -> WatchdogClient:
    """This process's watchdog client; a forked copy of the harness gets its own."""
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None or _CLIENT.owner_pid != os.getpid():
            _CLIENT = WatchdogClient()
        return _CLIENT


def _encode(**fields: object) -> bytes:
    return (json.dumps(fields, separators=(",", ":")) + "\n").encode()


# -- the watchdog process ----------------------------------------------------------------------


@dataclass
class Group:
    pgid: int
    create_time: float
    name: str
    log: str
    scratch: str = ""  # a directory the harness made for this server, removed once it is gone
    # pid -> creation (seconds after boot) of every process seen in the group or under its leader
    members: dict[int, float] = field(default_factory=dict)


def boot_seconds(pid: int) -> float:
    """When process `pid` was created, in seconds after boot: with the pid, its identity.

    Not psutil's create_time() alone: that is the boot time plus this, and the boot time moves
    with the wall clock (an NTP step, a VM resumed), so the harness recording a group and the
    watchdog checking it a clock step later disagreed, and every group looked like a reused
    pid. The boot time is read first and the process afresh: older psutil reuse the boot time
    read last, and a psutil.Process caches its create_time()."""
    boot_time = psutil.boot_time()
    return psutil.Process(pid).create_time() - boot_time


def same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` if it is still the one created at `create_time` (seconds after boot,
    `boot_seconds`; zombies included)."""
    try:
        proc = psutil.Process(pid)
        if abs(boot_seconds(pid) - create_time) <= CREATE_TIME_TOLERANCE_S:
            return proc
    except psutil.NoSuchProcess:
        pass
    return None


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def sample(groups: dict[int, Group]) -> None:
    """Record the members of each group and its leader's descendants (harness still alive: the
    unreaped leader pins the group id, so everything in group `pgid` is the harness's)."""
    # Only groups whose leader is the recorded process (alive or an unreaped zombie).
    leaders = {pgid: same_process(pgid, g.create_time) for pgid, g in groups.items()}
    ours = {pgid: groups[pgid] for pgid, leader in leaders.items() if leader is not None}
    if not ours:
        return
    for proc in psutil.process_iter():
        pgid = pgid_of(proc.pid)
        if pgid in ours:
            _record(ours[pgid], proc)
    for pgid, group in ours.items():
        leader = leaders[pgid]
        try:
            descendants = leader.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for proc in descendants:
            _record(group, proc)


def _record(group: Group, proc: psutil.Process) -> None:
    try:
        group.members.setdefault(proc.pid, boot_seconds(proc.pid))
    except psutil.NoSuchProcess:
        pass


def group_is_ours(group: Group) -> bool:
    """A recorded process (leader or member, zombie or not) is still in group `pgid`."""
    recorded = {group.pgid: group.create_time, **group.members}
    for pid, create_time in recorded.items():
        if pgid_of(pid) == group.pgid and same_process(pid, create_time) is not None:
            return True
    return False


def live_processes(group: Group) -> list[psutil.Process]:
    """Live processes of the group (while it is ours) and recorded members that left it."""
    found: list[psutil.Process] = []
    if group_is_ours(group):
        for proc in psutil.process_iter():
            if pgid_of(proc.pid) == group.pgid and is_live_process(proc):
                found.append(proc)
    for pid, create_time in group.members.items():
        proc = same_process(pid, create_time)
        if proc is not None and is_live_process(proc) and all(p.pid != pid for p in found):
            found.append(proc)
    return found


def signal_group(group: Group, sig: signal.Signals) -> None:
    if group_is_ours(group):
        try:
            os.killpg(group.pgid, sig)
        except ProcessLookupError:
            pass
    for pid, create_time in group.members.items():
        proc = same_process(pid, create_time)
        if proc is not None and pgid_of(pid) != group.pgid:
            try:
                proc.send_signal(sig)  # psutil re-checks the identity before signalling
            except psutil.NoSuchProcess:
                pass


class Log:
    """One line per action, into watchdog.log beside each server's log (or stderr)."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, group: Group | None, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        name = f" {group.name} (group {group.pgid})" if group else ""
        line = f"{stamp} epd-harness watchdog pid {os.getpid()}:{name} {message}\n"
        target = Path(group.log).with_name(LOG_NAME) if group and group.log else None
        try:
            if target is not None:
                with open(target, "a") as out:
                    out.write(line)
                return
        except OSError:
            pass
        _write_stderr(sys.stderr, line)


def _write_stderr(stream: TextIO, line: str) -> None:
    try:
        stream.write(line)
        stream.flush()
    except (OSError, ValueError):  # the harness's stderr may be a pipe nobody reads any more
        pass


def stop_groups(groups: list[Group], log: Log) -> None:
    """SIGTERM every group, wait up to GRACE_S, SIGKILL what is left, wait KILL_WAIT_S."""
    start = time.monotonic()
    pending = [g for g in groups if live_processes(g)]
    for group in groups:
        if group not in pending:
            log(group, "harness gone; nothing of this group left running")
            remove_scratch(group, log)
    for group in pending:
        alive = live_processes(group)
        log(
            group,
            f"harness gone; SIGTERM to {len(alive)} process(es): "
            + ", ".join(str(p.pid) for p in alive),
        )
        signal_group(group, signal.SIGTERM)
    if wait_until_gone(pending, GRACE_S, start, log):
        return
    for group in pending:
        alive = live_processes(group)
        log(
            group,
            f"still running after {GRACE_S:.0f} s; SIGKILL to "
            + ", ".join(str(p.pid) for p in alive),
        )
        signal_group(group, signal.SIGKILL)
    if wait_until_gone(pending, KILL_WAIT_S, start, log):
        return
    for group in pending:
        alive = live_processes(group)
        log(group, "SURVIVED SIGKILL: " + ", ".join(psutil_describe(p) for p in alive))


def wait_until_gone(pending: list[Group], wait_s: float, start: float, log: Log) -> bool:
    """Drop groups from `pending` as they empty; True once all have, False after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        for group in list(pending):
            if not live_processes(group):
                pending.remove(group)
                log(group, f"gone {time.monotonic() - start:.1f} s after the harness's end")
                remove_scratch(group, log)
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def remove_scratch(group: Group, log: Log) -> None:
    """Remove the scratch directory of `group`, which is gone (the callers' check): an absolute
    path, not followed if it is a symbolic link (rmtree refuses those)."""
    path = Path(group.scratch)
    if not group.scratch or not path.is_absolute() or not path.exists():
        return
    try:
        shutil.rmtree(path)
    except OSError as exc:
        log(group, f"could not remove its scratch directory {path}: {exc}")
        return
    log(group, f"removed its scratch directory {path}")


def psutil_describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({proc.name()}, {proc.status()})"
    except psutil.NoSuchProcess:
        return f"{proc.pid} (gone)"


def handle(groups: dict[int, Group], line: bytes, log: Log) -> None:
    try:
        message = json.loads(line)
        event, pgid = message["event"], int(message["pgid"])
        if event == "start":
            groups[pgid] = Group(
                pgid,
                float(message["create_time"]),
                str(message["name"]),
                str(message.get("log") or ""),
                str(message.get("scratch") or ""),
            )
        elif event == "done":
            groups.pop(pgid, None)
        else:
            raise ValueError(f"unknown event {event!r}")
    except (ValueError, KeyError, TypeError) as exc:
        log(None, f"ignoring a malformed line {line[:200]!r}: {exc}")


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    log = Log()
    groups: dict[int, Group] = {}
    stdin = sys.stdin.fileno()
    buffered = b""
    next_sample = time.monotonic()
    while True:
        timeout = max(0.0, next_sample - time.monotonic()) if groups else None
        readable, _, _ = select.select([stdin], [], [], timeout)
        if readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                if line.strip():
                    handle(groups, line, log)
        if groups and time.monotonic() >= next_sample:
            try:
                sample(groups)
            except Exception as exc:  # noqa: BLE001 - a failed sample must not end the watch
                log(None, f"sampling failed: {exc!r}")
            next_sample = time.monotonic() + SAMPLE_INTERVAL_S
    if groups:
        stop_groups(list(groups.values()), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())

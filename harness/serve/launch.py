"""Process lifecycle for servers: start, wait until healthy, notice death at once, stop completely.

A correctness run that leaves a vLLM server behind poisons the next one (a held port, a busy
core, gigabytes of RAM), and one that waits out a 10-minute startup timeout for a server that
crashed in its first second wastes the CI budget. So:

* every server runs in its own session (its pid is its process group id), so one `killpg`
  reaches the workers it forks; descendants that leave the group are tracked through psutil;
* the child asks the kernel for SIGTERM when the harness dies (PR_SET_PDEATHSIG), so even a
  SIGKILLed harness does not leave the server itself running (the server is expected to take its
  own children down on SIGTERM, as vLLM does);
* that needs the server's cooperation, which vLLM does not give while its engine starts, so a
  watchdog process (`harness.watchdog`) that outlives the harness stops every group the harness
  had not finished stopping when it dies, SIGKILL included;
* readiness polling checks on every poll that the process is still alive, and a death is
  reported with the exit code and the tail of the server's log: the evidence, not "timed out";
* the server's exit is observed without reaping it (waitid WNOWAIT) until `stop()` has emptied
  its group. An unreaped leader keeps its pid, and so the group id, from being reused; with
  pid_max often 32768, a reaped pid can come back as an unrelated process that `killpg` would
  then hit;
* nothing is ever killed by name, only by the pid, group and psutil handles recorded here.

SIGTERM to the harness itself (CI cancelling, `timeout`) ends it without unwinding `with`
blocks unless `install_signal_handlers()` was called; then it unwinds like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

import psutil

from harness.redact import redact_env
from harness.serve import watchdog
from harness.serve.ports import PortLease

HEALTH_POLL_INTERVAL_S = 0.5
# A health request that hangs delays death detection by this much; vLLM's /health answers in
# milliseconds, and a server that is not listening yet refuses at once.
HEALTH_REQUEST_TIMEOUT_S = 1.0
STOP_GRACE_S = 15.0
# A server that never became ready has no request to finish, and vLLM 0.32 can ignore SIGTERM
# for good during its engine start-up (measured: no exit within 40 s when signalled 0.3-3 s
# after parsing its arguments). Such a server gets this much grace, not STOP_GRACE_S, so a
# sibling's death or a Ctrl-C during start-up does not cost 15 s per instance.
STARTUP_STOP_GRACE_S = 3.0
KILL_WAIT_S = 5.0
STOP_POLL_INTERVAL_S = 0.05
LOG_TAIL_LINES = 40
LOG_TAIL_MAX_BYTES = 256 * 1024

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

ServerState = Literal["starting", "ready", "died", "stopped"]
# on_event(server name, state, seconds since the group's start_all)
EventCallback = Callable[[str, ServerState, float], None]

# Health checks go to 127.0.0.1 directly: a CI runner's HTTP(S)_PROXY must not relay them.
_DIRECT_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Resolved once, in the parent: the child must not dlopen/dlsym between fork and exec, where a
# loader lock held by another parent thread at fork time would deadlock it.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


class ServerDied(RuntimeError):
    """A server process exited while the harness still needed it."""

    def __init__(self, message: str, name: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.exit_code = exit_code


class StartupTimeout(RuntimeError):
    """Servers were alive but not healthy when the readiness timeout ran out."""

    def __init__(self, message: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.names = names


class ServerStopFailed(RuntimeError):
    """Processes of a server outlived SIGKILL (e.g. stuck in uninterruptible sleep)."""


@dataclass(frozen=True)
class ServerCommand:
    """How to run one server: what `ManagedServer` spawns and where it writes its log."""

    name: str  # unique within a run, e.g. "1E+1P+1D/encoder0"
    argv: tuple[str, ...]  # a list is accepted and stored as a tuple; never a shell string
    health_url: str  # answers 2xx once the server can take requests
    log_path: Path  # stdout and stderr together; truncated at start
    env: Mapping[str, str] = field(default_factory=dict)  # merged over os.environ
    # The CPUs the server and everything it starts may run on (inherited by its children);
    # empty: wherever the harness itself may run.
    cpu_affinity: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        argv = tuple(self.argv)
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise ValueError(f"{self.name}: argv must be a non-empty list of str, got {argv!r}")
        object.__setattr__(self, "argv", argv)
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "cpu_affinity", tuple(self.cpu_affinity))


def log_path_for(log_dir: Path, name: str) -> Path:
    """A log file for server `name` in `log_dir`: "1E+1P+1D/encoder0" -> 1E-1P-1D__encoder0.log.

    '/' would make a subdirectory and '+' is awkward in shells; other unsafe characters become
    '_'. The two meaningful separators get distinct replacements so names stay distinguishable.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("/", "__").replace("+", "-"))
    return log_dir / f"{safe}.log"


def log_header(command: ServerCommand) -> str:
    """The lines a server's log starts with: its command line, its environment additions (a
    credential redacted: the log is an artifact) and its CPU affinity, whoever spawns it."""
    lines = [f"# epd-harness: {command.name}: {shlex.join(command.argv)}"]
    if command.env:
        redacted = redact_env(command.env)
        additions = " ".join(f"{k}={v}" for k, v in sorted(redacted.items()))
        lines.append(f"# epd-harness: environment additions: {additions}")
    if command.cpu_affinity:
        lines.append(f"# epd-harness: CPU affinity: {','.join(map(str, command.cpu_affinity))}")
    return "".join(f"{line}\n" for line in lines)


def keep_earlier_log(path: Path) -> Path | None:
    """Move the log of an earlier start of the same server out of the way, to <name>.<n>.log
    (n counting up from 1), and return where it went (None: there was none).

    A pool starts a topology again under the same names after an instance died or a start
    timed out; the new start must not overwrite the log that shows why it was needed."""
    if not path.exists():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)
    return kept


class ManagedServer:
    """One server process: spawned in its own session, watched for death, stopped completely.

    One lifecycle per object: `start()` once, `stop()` any number of times. A `PortLease` given
    here is handed over right before the spawn and released once the process group is gone.
    """

    def __init__(self, command: ServerCommand, *, port_lease: PortLease | None = None) -> None:
        self.command = command
        self._port_lease = port_lease
        self._popen: subprocess.Popen[bytes] | None = None
        self._spawned_at: float | None = None
        self._spawned_wall_s: float | None = None
        self._startup_seconds: float | None = None
        self._peak_rss_bytes = 0
        # CPU seconds (user + system) of each process of the tree, the latest sample of each pid.
        self._cpu_by_pid: dict[int, tuple[str, float]] = {}
        # Every descendant ever sampled, so that stop() also finds those that left the group
        # (setsid, daemonizing helpers), even after the server itself died and they were orphaned.
        self._seen_descendants: dict[int, psutil.Process] = {}
        self._stopped = False

    @property
    def name(self) -> str:
        return self.command.name

    @property
    def port_lease(self) -> PortLease | None:
        return self._port_lease

    def detach_port_lease(self) -> PortLease | None:
        """Hand this server's port lease to a successor (a dead server started again on the
        same port, `TopologySession.revive_dead`): its `stop()` then keeps the port held."""
        lease, self._port_lease = self._port_lease, None
        return lease

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def pgid(self) -> int | None:
        """The process group id: the pid, since the child calls setsid() before exec."""
        return self.pid

    @property
    def spawned_wall_s(self) -> float | None:
        """Wall-clock time of the spawn (epoch seconds): what vLLM's log stamps are read
        against (harness.outcomes.startup)."""
        return self._spawned_wall_s

    @property
    def startup_seconds(self) -> float | None:
        """Seconds from spawn to the first healthy answer; None until ready."""
        return self._startup_seconds

    @property
    def exit_code(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while running/unstarted."""
        if self._popen is None:
            return None
        if self._popen.returncode is not None:
            return self._popen.returncode
        info = os.waitid(os.P_PID, self._popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def is_alive(self) -> bool:
        return self._popen is not None and self.exit_code is None

    def start(self) -> None:
        """Spawn the server and return at once (readiness is `wait_until_ready`'s job).

        A spawn failure (say, the executable is missing) propagates with the server name and
        command line attached as a note.
        """
        if self._popen is not None or self._stopped:
            state = "stopped" if self._stopped else f"started (pid {self.pid})"
            raise RuntimeError(f"{self.name}: a ManagedServer starts once; it is already {state}")
        command = self.command
        # Refused before anything is touched: a start that cannot happen moves no earlier log.
        unusable = set(command.cpu_affinity) - os.sched_getaffinity(0)
        if unusable:
            raise ValueError(
                f"{command.name}: CPU affinity {','.join(map(str, command.cpu_affinity))} names "
                f"CPUs this process may not use: {','.join(map(str, sorted(unusable)))}"
            )
        command.log_path.parent.mkdir(parents=True, exist_ok=True)
        keep_earlier_log(command.log_path)
        with open(command.log_path, "wb") as log:
            log.write(log_header(command).encode())
            log.flush()
            if self._port_lease is not None:
                self._port_lease.hand_over()
            watchdog.client().ensure_running()
            with _signals_deferred():
                try:
                    self._popen = subprocess.Popen(
                        command.argv,
                        env={**os.environ, **command.env},
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=_in_child(os.getpid(), command.cpu_affinity),
                    )
                except Exception as exc:
                    exc.add_note(f"while starting {command.name}: {shlex.join(command.argv)}")
                    raise
                self._spawned_at = time.monotonic()
                self._spawned_wall_s = time.time()
                watchdog.client().started(self._popen.pid, command.name, command.log_path)

    def probe_health(self) -> bool:
        """One GET of the health URL: True on a 2xx answer, False on any error or timeout."""
        return self.health_probe_failure() is None

    def health_probe_failure(self) -> str | None:
        """One GET of the health URL: None on a 2xx answer, else what went wrong."""
        return health_probe_failure(self.command.health_url)

    def owns_health_port(self) -> bool:
        """Its own process tree listens on the health URL's port. A port is leased from the
        harness's lock directory, which a program outside it (a test's fake server with a
        lock directory of its own, anything else) does not see: while vLLM loads, tens of
        seconds before it binds, such a program can take the port and answer /health. That
        answer is not this server's readiness."""
        port = urllib.parse.urlsplit(self.command.health_url).port
        if port is None or self._popen is None:
            return True
        try:
            root = psutil.Process(self._popen.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for proc in tree:
            try:
                listing = getattr(proc, "net_connections", None) or proc.connections
                if any(
                    c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                    for c in listing(kind="tcp")
                ):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

    def wait_until_ready(self, timeout_s: float) -> None:
        """Poll until healthy. Raises ServerDied (within ~a second of a death) or StartupTimeout."""
        await_ready([self], timeout_s, on_ready=lambda server: None)

    def check_alive(self) -> None:
        """Raise ServerDied (exit code, log tail) if the process exited; else sample its tree."""
        if self._popen is None:
            raise RuntimeError(f"{self.name}: not started")
        code = self.exit_code
        if code is None:
            self._sample_tree()
            return
        phase = "while serving" if self._startup_seconds is not None else "during startup"
        raise ServerDied(
            f"{self.name} (pid {self.pid}) died {phase}: {describe_exit(code)}, noticed "
            f"{self._age_s():.1f} s after start\n{self._log_evidence()}",
            name=self.name,
            exit_code=code,
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's log ("" if there is no log yet).

        Reads at most the last 256 KiB: vLLM logs grow large, and progress bars' carriage
        returns count as line breaks here, so a tail is never one giant line.
        """
        return read_log_tail(self.command.log_path, lines)

    def log_size(self) -> int:
        """Bytes in the log so far (0 before there is one): an offset for `read_log_from`."""
        return log_size(self.command.log_path)

    def read_log_from(self, offset: int) -> str:
        """What the server logged after byte `offset`."""
        return read_log_from(self.command.log_path, offset)

    def peak_rss_bytes(self) -> int:
        """Largest summed RSS of the server's process tree seen so far, for reports.

        Sampled at every readiness poll, every `check_alive()`, at `stop()` and here, so a peak
        between samples is missed. Pages shared between forked processes count once per process:
        read it as an upper bound. 0 if the server was never sampled while alive.
        """
        self._sample_tree()
        return self._peak_rss_bytes

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) the server's processes have used so far, summed per kind
        of process: `server` for the process it started (vLLM's API server), every other by its
        name without vLLM's `VLLM::` prefix (`EngineCore`, `Worker`). On CPU a vLLM start is
        interpreters importing torch and vLLM one after another; this says what each cost.
        Sampled with the peak RSS (a process that ended between samples keeps its last sample);
        empty if the server was never sampled while alive."""
        return self.sampled_usage()[1]

    def sampled_usage(self) -> tuple[int, dict[str, float]]:
        """`peak_rss_bytes()` and `cpu_seconds()` from one sample of the tree (a Ray agent's
        poll wants both)."""
        self._sample_tree()
        totals: dict[str, float] = {}
        for kind, seconds in self._cpu_by_pid.values():
            totals[kind] = round(totals.get(kind, 0.0) + seconds, 2)
        return self._peak_rss_bytes, totals

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL; return once nothing is left.

        A server that never became ready waits at most STARTUP_STOP_GRACE_S. Descendants seen
        by any sample (each readiness poll, `check_alive()`, and one right before the first
        signal) are signalled too, in case they left the group. Raises ServerStopFailed,
        listing the survivors, if anything outlives SIGKILL by KILL_WAIT_S; calling stop()
        again retries. Idempotent once it has succeeded; releases the port lease at the end.
        """
        if self._stopped:
            return
        if self._popen is not None:
            self._sample_tree()
            pgid = self._popen.pid
            tracked = list(self._seen_descendants.values())
            _signal_group(pgid, signal.SIGTERM)
            for proc in tracked:
                if _pgid_of(proc) not in (None, pgid):
                    _signal_process(proc, signal.SIGTERM)
            if self._startup_seconds is None:
                grace_s = min(grace_s, STARTUP_STOP_GRACE_S)
            if not self._wait_gone(tracked, grace_s):
                _signal_group(pgid, signal.SIGKILL)
                for proc in tracked:
                    _signal_process(proc, signal.SIGKILL)
                if not self._wait_gone(tracked, KILL_WAIT_S):
                    survivors = _live_group_members(pgid) + [
                        p for p in tracked if is_live_process(p)
                    ]
                    raise ServerStopFailed(
                        f"{self.name}: processes survived SIGKILL for {KILL_WAIT_S} s: "
                        + ", ".join(describe_process(p) for p in survivors)
                    )
            watchdog.client().done(pgid)
            self._popen.wait()  # reap only now: the group is empty, so its id may be reused
        if self._port_lease is not None:
            self._port_lease.release()
        self._stopped = True

    def _mark_ready(self) -> None:
        self._startup_seconds = self._age_s()

    def _age_s(self) -> float:
        return 0.0 if self._spawned_at is None else time.monotonic() - self._spawned_at

    def _log_evidence(self) -> str:
        return f"--- last {LOG_TAIL_LINES} lines of {self.command.log_path} ---\n{self.log_tail()}"

    def _sample_tree(self) -> None:
        """Record the current descendants and update the peak RSS of the whole tree."""
        if not self.is_alive():
            return
        try:
            root = psutil.Process(self._popen.pid)
            descendants = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        self._seen_descendants.update((proc.pid, proc) for proc in descendants)
        total = 0
        for proc in [root, *descendants]:
            try:
                total += proc.memory_info().rss
                times = proc.cpu_times()
                kind = "server" if proc is root else process_kind(proc.name())
            except psutil.NoSuchProcess:
                continue
            self._cpu_by_pid[proc.pid] = (kind, times.user + times.system)
        self._peak_rss_bytes = max(self._peak_rss_bytes, total)

    def _wait_gone(self, tracked: list[psutil.Process], timeout_s: float) -> bool:
        """Wait until the leader has exited and no live process of the group or `tracked` is left.

        Returns False if `timeout_s` passes first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if (
                self.exit_code is not None
                and not _live_group_members(self._popen.pid)
                and not any(is_live_process(p) for p in tracked)
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(STOP_POLL_INTERVAL_S)


class ServerGroup:
    """Several servers that live and die together, e.g. the instances of one topology.

        with ServerGroup(servers, on_event=print) as group:
            group.start_all()
            group.wait_all_ready(timeout_s=600)
            ...  # send requests, calling group.check_alive() between them

    Leaving the block stops every server, last started first, whatever ended it (an exception,
    Ctrl-C, or SIGTERM once `install_signal_handlers()` is in place).
    """

    def __init__(
        self,
        servers: Iterable[ManagedServer],
        *,
        on_event: EventCallback | None = None,
        start_after: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        """`start_after`: server name -> the names of the servers that must be healthy before
        it is spawned (absent: spawned by `start_all`, with the others). Instances sharing a
        GPU start one after another this way (`harness.spec.placement.start_after`)."""
        self.servers = tuple(servers)
        names = [server.name for server in self.servers]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"server names must be unique; repeated: {duplicates}")
        self.start_after = {
            name: tuple(before) for name, before in (start_after or {}).items() if before
        }
        _check_start_order(names, self.start_after)
        self._on_event = on_event
        self._started_at = time.monotonic()
        self._reported_dead: set[str] = set()
        # Servers this group has spawned, in spawn order (stop_all goes backwards through it).
        self._spawned: list[ManagedServer] = []

    def start_all(self) -> None:
        """Spawn every server that waits for no other without waiting, so they boot
        concurrently; one that must start after others (`start_after`) is spawned by
        `wait_all_ready` as soon as they are healthy."""
        self._started_at = time.monotonic()
        self._start_due()

    def wait_all_ready(self, timeout_s: float) -> None:
        """Wait until all are healthy, spawning each waiting server once those it starts after
        are; the first death fails the group at once with its log tail. `timeout_s` is for the
        whole group, the waiting servers' starts included."""

        def ready(server: ManagedServer) -> None:
            self._emit(server, "ready")
            self._start_due()

        try:
            self._start_due()
            await_ready(self.servers, timeout_s, on_ready=ready, waits_for=self.waits_for)
        except ServerDied as exc:
            self._report_death(exc)
            raise

    def waits_for(self, server: ManagedServer) -> tuple[str, ...]:
        """The servers `server` still waits for before it can be spawned (none once spawned,
        or when it starts after nothing, or after servers that are all healthy)."""
        if self.is_spawned(server):
            return ()
        by_name = {s.name: s for s in self.servers}
        before = self.start_after.get(server.name, ())
        return tuple(name for name in before if by_name[name].startup_seconds is None)

    def is_spawned(self, server: ManagedServer) -> bool:
        return any(server is spawned for spawned in self._spawned)

    def revive(self, dead: ManagedServer, fresh: ManagedServer) -> None:
        """Put `fresh` in `dead`'s place and spawn it (a server that died is started again as
        a new object, with a log of its own), unless it starts after a server that is not
        healthy (one revived with it): then `wait_all_ready` spawns it, and waits for it."""
        index = self.servers.index(dead)
        self.servers = (*self.servers[:index], fresh, *self.servers[index + 1 :])
        self._reported_dead.discard(dead.name)
        self._start_due()

    def check_alive(self) -> None:
        """Raise ServerDied for the first server that has exited (call it between requests);
        a server not spawned yet (`start_after`) has nothing to check."""
        try:
            for server in self.servers:
                if self.is_spawned(server):
                    server.check_alive()
        except ServerDied as exc:
            self._report_death(exc)
            raise

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every server in reverse spawn order (one never spawned only gives its port
        back); a failing stop does not skip the others,
        nor does an interrupt: a Ctrl-C that lands in a stop (without the handlers of
        `install_signal_handlers`, or the first one, during a cleanup something else began)
        ends that server at once (SIGKILL, no more grace) and the others are still stopped;
        the interrupt is raised at the end."""
        failures: list[BaseException] = []
        spawned = [s for s in reversed(self._spawned) if s in self.servers]
        unspawned = [s for s in reversed(self.servers) if not self.is_spawned(s)]
        for server in [*spawned, *unspawned]:
            was_started = server.pid is not None
            try:
                _stop_through_interrupts(server, grace_s, failures)
            except Exception as exc:
                failures.append(exc)
                continue
            if was_started:
                self._emit(server, "stopped")
        if failures:
            first = next((f for f in failures if not isinstance(f, Exception)), failures[0])
            for other in failures:
                if other is not first and isinstance(other, Exception):
                    first.add_note(f"also failed to stop: {other}")
            raise first

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def _report_death(self, exc: ServerDied) -> None:
        if exc.name not in self._reported_dead:
            self._reported_dead.add(exc.name)
            server = next(s for s in self.servers if s.name == exc.name)
            self._emit(server, "died")

    def _start_due(self) -> None:
        """Spawn every server not spawned yet whose `start_after` servers are all healthy."""
        for server in self.servers:
            if not self.is_spawned(server) and not self.waits_for(server):
                self._spawned.append(server)
                self._emit(server, "starting")
                server.start()

    def _emit(self, server: ManagedServer, state: ServerState) -> None:
        if self._on_event is not None:
            self._on_event(server.name, state, time.monotonic() - self._started_at)


STOP_RETRIES_AFTER_INTERRUPT = 3


def _stop_through_interrupts(
    server: ManagedServer, grace_s: float, interrupts: list[BaseException]
) -> None:
    """`server.stop(grace_s)`; an interrupt in it is recorded in `interrupts` and the stop
    retried without grace (straight to SIGKILL), a few times: a user who presses Ctrl-C again
    is in a hurry, not asking to leave servers behind."""
    for attempt in range(STOP_RETRIES_AFTER_INTERRUPT + 1):
        try:
            server.stop(grace_s if attempt == 0 else 0.0)
            return
        except (KeyboardInterrupt, SystemExit) as exc:
            interrupts.append(exc)
            if attempt == STOP_RETRIES_AFTER_INTERRUPT:
                return


def install_signal_handlers(
    signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
) -> dict[signal.Signals, Any]:
    """Make SIGINT / SIGTERM / SIGHUP raise KeyboardInterrupt in the main thread, so cleanup
    runs, and only the first of them.

    By default SIGTERM ends Python at once: no `finally`, no `__exit__`, so servers get only the
    parent-death signal and their grandchildren may linger. KeyboardInterrupt rather than
    SystemExit because pytest treats it as "abort the session" (and still tears fixtures
    down), while SystemExit would only fail the current test and go on to start more servers.
    A repeated signal during cleanup is swallowed so the stop is not cut short (SIGKILL still
    ends everything, and the parent-death signal then reaches the servers): a second Ctrl-C,
    pressed while a server that ignores SIGTERM is given its grace, would otherwise leave the
    servers not yet stopped running. The swallowing handler is a Python function, not SIG_IGN,
    because an ignored disposition would be inherited by servers spawned later. Must be called
    from the main thread.
    """

    def swallow(signum: int, frame: FrameType | None) -> None:
        """Ignore a repeated signal while the first one's cleanup runs."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        for sig in previous:
            signal.signal(sig, swallow)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # as Python's own Ctrl-C: nothing more to say
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    # A signal ignored on entry stays ignored: SIGHUP under nohup, SIGINT for a command a
    # script started in the background (the shell's convention: a Ctrl-C is the foreground's).
    previous = {sig: signal.getsignal(sig) for sig in signals}
    previous = {sig: handler for sig, handler in previous.items() if handler != signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, interrupt)
    return previous


def restore_signal_handlers(previous: Mapping[signal.Signals, Any]) -> None:
    """Put back what `install_signal_handlers` replaced: a CLI run inside another program (a
    test's, in-process) must not leave that process swallowing its Ctrl-C."""
    for sig, handler in previous.items():
        if handler is not None:
            signal.signal(sig, handler)


def _check_start_order(names: Sequence[str], start_after: Mapping[str, Sequence[str]]) -> None:
    """Refuse a `start_after` that names a server not in the group, or that no order satisfies
    (a server after itself, a cycle): its servers would never be spawned, and the group would
    wait its whole startup timeout for them."""
    known = set(names)
    for name, before in start_after.items():
        unknown = sorted({name, *before} - known)
        if unknown:
            raise ValueError(f"start_after names servers not in the group: {unknown}")
    done: set[str] = set()
    left = dict(start_after)
    while left:
        free = [name for name, before in left.items() if set(before) <= done | (known - set(left))]
        if not free:
            raise ValueError(f"start_after has no order: {sorted(left)} wait for each other")
        for name in free:
            done.add(name)
            del left[name]


def await_ready(
    servers: Sequence[ManagedServer],
    timeout_s: float,
    on_ready: Callable[[ManagedServer], None],
    waits_for: Callable[[ManagedServer], Sequence[str]] = lambda server: (),
) -> None:
    """Poll until every server answers its health URL, checking all of them for death each poll.

    A death is noticed within one poll interval plus the probes of that round (milliseconds
    while servers refuse connections; at most HEALTH_REQUEST_TIMEOUT_S per hung server).
    A server for which `waits_for` names servers is not spawned yet (`ServerGroup`'s
    `start_after`): it is neither probed nor checked until `on_ready` of those spawned it.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    pending = [server for server in servers if server.startup_seconds is None]
    last_probe: dict[str, str] = {}  # what the last probe of a pending server met
    while True:
        for server in servers:
            if not waits_for(server):
                server.check_alive()
        for server in list(pending):
            if waits_for(server):
                continue
            failure = server.health_probe_failure()
            if failure is None and server.owns_health_port():
                server._mark_ready()
                pending.remove(server)
                on_ready(server)
            else:
                last_probe[server.name] = failure or (
                    "a 2xx answer, but the server's own processes do not listen on the port"
                )
        if not pending:
            return
        now = time.monotonic()
        if now >= deadline:
            waiting = [server for server in pending if waits_for(server)]
            names = tuple(server.name for server in pending if server not in waiting)
            evidence = "\n".join(
                f"--- {server.command.health_url}, last probe: {last_probe.get(server.name)}\n"
                + server._log_evidence()
                for server in pending
                if server not in waiting
            )
            unspawned = "".join(
                f"\n--- {server.name} was never started: it starts once "
                f"{' and '.join(waits_for(server))} {'is' if len(waits_for(server)) == 1 else 'are'}"
                " healthy"
                for server in waiting
            )
            raise StartupTimeout(
                f"not ready after {now - started:.1f} s (timeout {timeout_s} s): "
                f"{', '.join(names)}\n{evidence}{unspawned}",
                names=names,
            )
        time.sleep(min(HEALTH_POLL_INTERVAL_S, deadline - now))


def health_probe_failure(url: str) -> str | None:
    """One GET of `url`, straight to it: None on a 2xx answer, else what went wrong, in words
    ("connection refused", "no answer within 1.0 s", "HTTP 503"), for a start that times out
    to say whether nothing listened, something listened and did not answer, or it said no."""
    try:
        with _DIRECT_OPENER.open(url, timeout=HEALTH_REQUEST_TIMEOUT_S) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, http.client.HTTPException, ValueError) as exc:  # refused, reset, no URL
        # urllib wraps what the socket met (a refusal, a timeout) in a URLError's reason.
        cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(cause, TimeoutError):
            return f"no answer within {HEALTH_REQUEST_TIMEOUT_S} s"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        return f"{type(cause).__name__}: {cause}"


def log_size(path: Path) -> int:
    """Bytes in the log at `path` (0 before there is one)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def read_log_from(path: Path, offset: int) -> str:
    """What the log at `path` holds after byte `offset` ("" before there is one)."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the log at `path` ("" if there is none), reading at most its
    last LOG_TAIL_MAX_BYTES."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - LOG_TAIL_MAX_BYTES))
            data = log.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C (and SIGTERM, SIGHUP) back from the spawn of a server until it is recorded.

    `Popen` forks, then waits for the child's exec; an interrupt raised in that wait leaves a
    child nothing holds (no `_popen`, unknown to the watchdog), which `stop()` cannot reach and
    which ignores the parent-death SIGTERM if it is vLLM starting its engine. Python runs
    signal handlers in the main thread only, so only there can one cut in; a signal that came
    meanwhile is handled as it would have been once the server is recorded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in DEFERRED_SIGNALS}
    held = [sig for sig, handler in previous.items() if handler is not None]
    came: list[int] = []
    for sig in held:
        signal.signal(sig, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        for sig in held:
            signal.signal(sig, previous[sig])
        if came:
            handler = previous[signal.Signals(came[0])]
            if callable(handler):
                handler(came[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), came[0])


def _in_child(parent_pid: int, cpu_affinity: tuple[int, ...]) -> Callable[[], None] | None:
    """A preexec_fn: the child's CPU affinity, and a SIGTERM from the kernel when the harness
    dies (None when there is nothing to do).

    The kernel sends that signal when the *thread* that forked the child exits, so servers must
    be started from a thread that lives as long as they should (the main thread, normally). If
    the harness died before prctl ran, the child would never get the signal: it exits instead.
    The affinity is set before exec, so every process the server starts inherits it.
    """
    if not _PRCTL and not cpu_affinity:
        return None

    def preexec() -> None:
        if cpu_affinity:
            os.sched_setaffinity(0, cpu_affinity)
        if not _PRCTL:
            return
        if _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            errno_ = ctypes.get_errno()
            raise OSError(errno_, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno_)}")
        if os.getppid() != parent_pid:
            os._exit(128 + signal.SIGTERM)

    return preexec


def process_kind(name: str) -> str:
    """What a server's descendant is, by its process name: vLLM names its engine core and
    workers `VLLM::EngineCore` and `VLLM::Worker` (the kernel keeps 15 bytes of a name, so
    `VLLM::EngineCor` too)."""
    kind = name.removeprefix("VLLM::")
    return "EngineCore" if kind.startswith("EngineCor") else kind


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _signal_process(proc: psutil.Process, sig: signal.Signals) -> None:
    """Signal a recorded process; psutil refuses if its pid now belongs to another process."""
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _pgid_of(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except ProcessLookupError:
        return None


def is_live_process(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent's wait() is missing)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _live_group_members(pgid: int) -> list[psutil.Process]:
    """Non-zombie processes of group `pgid`; killpg(pgid, 0) alone counts zombies as members."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    members = []
    for proc in psutil.process_iter():
        if _pgid_of(proc) == pgid and is_live_process(proc):
            members.append(proc)
    return members


def describe_process(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ({proc.name()}, {proc.status()})"
    except psutil.NoSuchProcess:
        return f"pid {proc.pid} (gone)"

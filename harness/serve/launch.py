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
  watchdog process (`harness.serve.watchdog`) that outlives the harness stops every group the
  harness had not finished stopping when it dies, SIGKILL included;
* readiness polling checks on every poll that the process is still alive, and a death is
  reported with the exit code and the tail of the server's log: the evidence, not "timed out";
* the server's exit is observed without reaping it (waitid WNOWAIT) until `stop()` has emptied
  its group. An unreaped leader keeps its pid, and so the group id, from being reused; with
  pid_max often 32768, a reaped pid can come back as an unrelated process that `killpg` would
  then hit;
* nothing is ever killed by name, only by the pid, group and psutil handles recorded here.

Here: one server's lifecycle (`ManagedServer`) and readiness (`await_ready`). What it runs is
`server_command`, its log `server_log`, its processes and their group `process_groups`, the
harness's own signals `signal_handlers`; several servers together are `server_group`.
"""

from __future__ import annotations

import http.client
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

import psutil

from harness.serve import watchdog
from harness.serve.cpu_account import ProcessCpu, TreeCpuAccount
from harness.serve.http_direct import DIRECT_OPENER
from harness.serve.ports import PortLease
from harness.serve.process_groups import (
    describe_exit,
    describe_process,
    in_child,
    is_live_process,
    live_group_members,
    pgid_of,
    process_kind,
    signal_group,
    signal_process,
)
from harness.serve.server_command import ServerCommand
from harness.serve.server_log import (
    LOG_TAIL_LINES,
    keep_earlier_log,
    log_header,
    log_size,
    read_log_from,
    read_log_tail,
)
from harness.serve.signal_handlers import signals_deferred

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
# How old a sample of a server's process tree may be when a check or a peak read wants one.
# Listing a process's descendants reads every process's /proc/<pid>/stat on the host, and a
# session checked each server alive and read its peak RSS around every request: 26 CPU-s of
# a 251 s fake GPU night went there. Half the readiness poll, so every poll still samples;
# stop() and cpu_seconds() always sample afresh.
TREE_SAMPLE_INTERVAL_S = 0.25


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
        # CPU seconds of every process of the tree ever sampled (harness.serve.cpu_account).
        self._cpu = TreeCpuAccount()
        # Every descendant ever sampled, so that stop() also finds those that left the group
        # (setsid, daemonizing helpers), even after the server itself died and they were orphaned.
        self._seen_descendants: dict[int, psutil.Process] = {}
        self._sampled_at: float | None = None  # monotonic time of the latest sample of the tree
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

    @property
    def lost(self) -> str | None:
        """Why the server is gone without an exit status to show (a Ray instance's agent
        lost with its node); a local server's exit is always seen."""
        return None

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
            with signals_deferred():
                try:
                    self._popen = subprocess.Popen(
                        command.argv,
                        env={**os.environ, **command.env},
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=in_child(os.getpid(), command.cpu_affinity),
                    )
                except Exception as exc:
                    exc.add_note(f"while starting {command.name}: {shlex.join(command.argv)}")
                    raise
                self._spawned_at = time.monotonic()
                self._spawned_wall_s = time.time()
                watchdog.client().started(
                    self._popen.pid, command.name, command.log_path, command.scratch_dir
                )

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

        Sampled at every readiness poll, at `check_alive()` and here (each reusing a sample
        younger than TREE_SAMPLE_INTERVAL_S), and at `stop()`, so a peak between samples is
        missed. Pages shared between forked processes count once per process:
        read it as an upper bound. 0 if the server was never sampled while alive.
        """
        self._sample_tree()
        return self._peak_rss_bytes

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) the server's processes have used so far, summed per kind
        of process: `server` for the process it started (vLLM's API server), every other by its
        name without vLLM's `VLLM::` prefix (`EngineCore`, `Worker`). On CPU a vLLM start is
        interpreters importing torch and vLLM one after another; this says what each cost.
        Sampled with the peak RSS (a process that ended between samples keeps its last sample,
        one no sample saw counts under the parent that waited for it); empty if the server was
        never sampled while alive. Sampled afresh."""
        self._sample_tree(max_age_s=0.0)
        return self.sampled_usage()[1]

    def sampled_usage(self) -> tuple[int, dict[str, float]]:
        """`peak_rss_bytes()` and `cpu_seconds()` from one sample of the tree (a Ray agent's
        poll wants both)."""
        self._sample_tree()
        return self._peak_rss_bytes, self._cpu.by_kind()

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
        # Reaped (a stop cut short after its wait(), then retried): the group was emptied, and
        # its id may belong to another process now, so nothing is signalled again.
        if self._popen is not None and self._popen.returncode is None:
            self._sample_tree(max_age_s=0.0)
            pgid = self._popen.pid
            tracked = list(self._seen_descendants.values())
            signal_group(pgid, signal.SIGTERM)
            for proc in tracked:
                if pgid_of(proc) not in (None, pgid):
                    signal_process(proc, signal.SIGTERM)
            if self._startup_seconds is None:
                grace_s = min(grace_s, STARTUP_STOP_GRACE_S)
            if not self._wait_gone(tracked, grace_s):
                signal_group(pgid, signal.SIGKILL)
                for proc in tracked:
                    signal_process(proc, signal.SIGKILL)
                if not self._wait_gone(tracked, KILL_WAIT_S):
                    survivors = live_group_members(pgid) + [
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

    def mark_ready(self) -> None:
        """Record that the server is ready now. `await_ready` does it for a health URL; a
        server whose readiness is something else (a ready file, a line in its log) is marked by
        its caller, who saw it. Until then `stop()` gives it only STARTUP_STOP_GRACE_S, too
        little for a ready server with work to wind down (the netns rehearsal's `up` stops its
        nodes and namespaces on SIGTERM). The first call counts."""
        if self._startup_seconds is None:
            self._startup_seconds = self._age_s()

    def _age_s(self) -> float:
        return 0.0 if self._spawned_at is None else time.monotonic() - self._spawned_at

    def _log_evidence(self) -> str:
        return f"--- last {LOG_TAIL_LINES} lines of {self.command.log_path} ---\n{self.log_tail()}"

    def _sample_tree(self, max_age_s: float = TREE_SAMPLE_INTERVAL_S) -> None:
        """Record the current descendants and update the peak RSS of the whole tree, unless
        the latest sample is younger than `max_age_s`."""
        now = time.monotonic()
        if self._sampled_at is not None and now - self._sampled_at < max_age_s:
            return
        if not self.is_alive():
            return
        self._sampled_at = now
        try:
            root = psutil.Process(self._popen.pid)
            descendants = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        self._seen_descendants.update((proc.pid, proc) for proc in descendants)
        total = 0
        # pid -> (ppid, create_time, kind, own CPU, reaped children's CPU), this sample's
        listed: dict[int, tuple[int, float, str, float, float]] = {}
        for proc in [root, *descendants]:
            try:
                with proc.oneshot():
                    total += proc.memory_info().rss
                    times = proc.cpu_times()
                    kind = "server" if proc is root else process_kind(proc.name())
                    listed[proc.pid] = (
                        proc.ppid(),
                        proc.create_time(),
                        kind,
                        times.user + times.system,
                        times.children_user + times.children_system,
                    )
            except psutil.NoSuchProcess:
                continue
        sample = []
        for pid, (ppid, started, kind, own_s, reaped_s) in listed.items():
            parent = (ppid, listed[ppid][1]) if pid != root.pid and ppid in listed else None
            sample.append(ProcessCpu((pid, started), parent, kind, own_s, reaped_s))
        self._cpu.record(sample)
        self._peak_rss_bytes = max(self._peak_rss_bytes, total)

    def _wait_gone(self, tracked: list[psutil.Process], timeout_s: float) -> bool:
        """Wait until the leader has exited and no live process of the group or `tracked` is left.

        Returns False if `timeout_s` passes first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if (
                self.exit_code is not None
                and not live_group_members(self._popen.pid)
                and not any(is_live_process(p) for p in tracked)
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(STOP_POLL_INTERVAL_S)


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

    def check_spawned_alive() -> None:
        for server in servers:
            if not waits_for(server):
                server.check_alive()

    while True:
        check_spawned_alive()
        for server in list(pending):
            if waits_for(server):
                continue
            failure = server.health_probe_failure()
            if failure is None and server.owns_health_port():
                server.mark_ready()
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
            check_spawned_alive()  # one that exited during this round's probes died
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
        with DIRECT_OPENER.open(url, timeout=HEALTH_REQUEST_TIMEOUT_S) as response:
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

"""The harness's side of one instance on a Ray node (`RayServer`), apart from the agent it
drives there (`harness.serve.ray_agent`) and the launcher that placed it
(`harness.serve.ray_launcher`).

Evidence does not rely on one host: the harness polls each agent (is the server alive, its
newest log bytes, the RSS of its tree), mirrors the log into the bundle at the path the local
launcher would have written it, and reads `/health`, `/metrics` and the taps' upstreams at the
instances' node URLs. Streamed worker logs are off (`log_to_driver=False`): Ray merges them and
can attribute lines to the wrong actor.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from harness.serve import server_log
from harness.serve.launch import (
    KILL_WAIT_S,
    STARTUP_STOP_GRACE_S,
    STOP_GRACE_S,
    ServerDied,
    ServerStopFailed,
    await_ready,
    health_probe_failure,
)
from harness.serve.launcher import NodeInfo
from harness.serve.process_groups import describe_exit
from harness.serve.ray_agent import LOG_CHUNK_BYTES
from harness.serve.ray_calls import CALL_TIMEOUT_S, get_or_refuse, lost_reason
from harness.serve.server_command import ServerCommand


class RayServer:
    """One instance run by an agent: the interface of `ManagedServer`, so `ServerGroup` and the
    session drive it unchanged. Its log is mirrored into the bundle as it grows."""

    def __init__(
        self, agent: Any, command: ServerCommand, node: NodeInfo, agent_pid: int | None = None
    ) -> None:
        self.command = command
        self.node = node
        self.agent_pid = agent_pid  # the agent's process on the node (chaos tests kill it)
        self._agent = agent
        self._pid: int | None = None
        self._exit: int | None = None
        self._lost: str | None = None  # why the agent is gone, once it is
        self._offset = 0
        self._rss = 0
        self._cpu: dict[str, float] = {}
        self._spawned_at: float | None = None
        self._spawned_wall_s: float | None = None
        self._startup_seconds: float | None = None
        self._stopped = False
        # A load's threads poll at once (each request checks the instances alive and reads
        # their log sizes): one poll at a time, or two from the same offset mirror it twice.
        self._polling = threading.Lock()

    @property
    def name(self) -> str:
        return self.command.name

    @property
    def pid(self) -> int | None:
        """The server's pid on its node."""
        return self._pid

    @property
    def pgid(self) -> int | None:
        return self._pid

    @property
    def port_lease(self) -> None:
        return None  # held by the agent, on the node

    @property
    def startup_seconds(self) -> float | None:
        return self._startup_seconds

    @property
    def spawned_wall_s(self) -> float | None:
        """The spawn's wall-clock time on the node (its clock stamps the log the start-up
        timeline reads)."""
        return self._spawned_wall_s

    @property
    def exit_code(self) -> int | None:
        return self._exit

    @property
    def lost(self) -> str | None:
        """Why its agent is gone (then no exit code can be read), once it is."""
        return (
            None
            if self._lost is None
            else f"its agent on Ray node {self.node.address} is gone ({self._lost})"
        )

    def start(self) -> None:
        command = self.command
        command.log_path.parent.mkdir(parents=True, exist_ok=True)
        node = self.node
        server_log.keep_earlier_log(command.log_path)
        with open(command.log_path, "wb") as mirror:
            mirror.write(
                f"{server_log.log_header(command)}"
                f"# epd-harness: on Ray node {node.address} (node id {node.node_id}, host "
                f"{node.hostname}); the lines below are its log, fetched through its agent\n".encode()
            )
        try:
            started = get_or_refuse(
                self._agent.start.remote(
                    command.name,
                    list(command.argv),
                    dict(command.env),
                    command.health_url,
                    command.cpu_affinity,
                ),
                f"starting {command.name} on node {node.address}",
            )
        except Exception as exc:
            exc.add_note(f"while starting {command.name} on Ray node {node.address}")
            raise
        self._pid = started["pid"]
        self._spawned_at = time.monotonic()
        self._spawned_wall_s = started.get("spawned_wall_s")

    def health_probe_failure(self) -> str | None:
        return health_probe_failure(self.command.health_url)

    def owns_health_port(self) -> bool:
        """Asked on the node: an answer from another program on the port is no readiness."""
        try:
            return bool(ray.get(self._agent.owns_health_port.remote(), timeout=CALL_TIMEOUT_S))
        except (RayActorError, GetTimeoutError):
            return False  # check_alive() says what happened to the agent

    def wait_until_ready(self, timeout_s: float) -> None:
        await_ready([self], timeout_s, on_ready=lambda server: None)

    def is_alive(self) -> bool:
        self._poll()
        return self._pid is not None and self._exit is None and self._lost is None

    def check_alive(self) -> None:
        if self._pid is None:
            raise RuntimeError(f"{self.name}: not started")
        self._poll()
        phase = "while serving" if self._startup_seconds is not None else "during startup"
        where = f"{self.name} (pid {self._pid} on Ray node {self.node.address})"
        if self._lost is not None:
            raise ServerDied(
                f"{where}: its agent is gone {phase} ({self._lost}), noticed "
                f"{self._age_s():.1f} s after start\n{self._log_evidence()}",
                name=self.name,
            )
        if self._exit is not None:
            raise ServerDied(
                f"{where} died {phase}: {describe_exit(self._exit)}, noticed "
                f"{self._age_s():.1f} s after start\n{self._log_evidence()}",
                name=self.name,
                exit_code=self._exit,
            )

    def log_tail(self, lines: int = server_log.LOG_TAIL_LINES) -> str:
        self._poll()
        return server_log.read_log_tail(self.command.log_path, lines)

    def log_size(self) -> int:
        self._poll()
        return server_log.log_size(self.command.log_path)

    def read_log_from(self, offset: int) -> str:
        self._poll()
        return server_log.read_log_from(self.command.log_path, offset)

    def peak_rss_bytes(self) -> int:
        self._poll()
        return self._rss

    def cpu_seconds(self) -> dict[str, float]:
        self._poll()
        return dict(self._cpu)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """The agent stops the server as the local launcher does (SIGTERM, grace, SIGKILL, its
        group and recorded descendants); the rest of the log is fetched; the agent ends."""
        if self._stopped:
            return
        if self._pid is not None and self._lost is None:
            ready = self._startup_seconds is not None
            grace = grace_s if ready else min(grace_s, STARTUP_STOP_GRACE_S)
            self._poll()
            wait_s = grace + KILL_WAIT_S + 30
            try:
                ray.get(self._agent.stop.remote(grace, ready), timeout=wait_s)
            except GetTimeoutError:
                ray.kill(self._agent)  # its watchdog ends the server with the agent
                raise ServerStopFailed(
                    f"{self.name}: its agent on Ray node {self.node.address} did not confirm "
                    f"the stop in {wait_s:g} s; the agent was killed, which ends the server"
                ) from None
            except RayActorError as exc:
                self._lost = lost_reason(exc)  # the agent's end stopped its server (its watchdog)
            except RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            self._poll()  # the server's last lines (its shutdown)
            if self._lost is None:
                get_or_refuse(self._agent.discard.remote(), f"cleaning up after {self.name}")
        self._stopped = True
        ray.kill(self._agent)

    def mark_ready(self) -> None:
        """Record that the server is ready now (`await_ready`; `ManagedServer.mark_ready`)."""
        if self._startup_seconds is None:
            self._startup_seconds = self._age_s()

    def _age_s(self) -> float:
        return 0.0 if self._spawned_at is None else time.monotonic() - self._spawned_at

    def _log_evidence(self) -> str:
        tail = server_log.read_log_tail(self.command.log_path, server_log.LOG_TAIL_LINES)
        return (
            f"--- last {server_log.LOG_TAIL_LINES} lines of {self.command.log_path} (from node "
            f"{self.node.address}) ---\n{tail}"
        )

    def _poll(self) -> None:
        """Bring the server's state and newest log lines over from its agent."""
        with self._polling:
            self._poll_unlocked()

    def _poll_unlocked(self) -> None:
        if self._pid is None or self._lost is not None or self._stopped:
            return
        while True:
            try:
                state = ray.get(self._agent.poll.remote(self._offset), timeout=CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as exc:
                self._lost = lost_reason(exc)
                return
            data: bytes = state["data"]
            if data:
                with open(self.command.log_path, "ab") as mirror:
                    mirror.write(data)
                self._offset += len(data)
            self._exit = state["exit"]
            self._rss = max(self._rss, state["rss"])
            self._cpu = state["cpu"] or self._cpu
            if len(data) < LOG_CHUNK_BYTES:
                return

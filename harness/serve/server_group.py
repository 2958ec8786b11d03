"""`ServerGroup`: the servers of one topology started, watched and stopped as one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from harness.serve.launch import (
    STOP_GRACE_S,
    ManagedServer,
    ServerDied,
    ServerStopFailed,
    await_ready,
)

ServerState = Literal["starting", "ready", "died", "stopped"]
# on_event(server name, state, seconds since the group's start_all)
EventCallback = Callable[[str, ServerState, float], None]


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

    def replace(self, dead: ManagedServer, fresh: ManagedServer) -> None:
        """Put `fresh` in `dead`'s place (a server that died is started again as a new object,
        with a log of its own); the next `wait_all_ready` spawns it once the servers it starts
        after are healthy. Not spawned here: with two replaced, the first could start after the
        second's dead object, healthy once, and so beside the second's revival."""
        index = self.servers.index(dead)
        self.servers = (*self.servers[:index], fresh, *self.servers[index + 1 :])
        self._reported_dead.discard(dead.name)

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
                stopped = stop_through_interrupts(server, grace_s, failures)
            except Exception as exc:
                failures.append(exc)
                continue
            if not stopped:
                failures.append(
                    ServerStopFailed(
                        f"server {server.name} (pid {server.pid}) may still run: each of its "
                        f"{STOP_RETRIES_AFTER_INTERRUPT + 1} stops was interrupted"
                    )
                )
            elif was_started:
                try:  # the callback failing (or a Ctrl-C in it) must not skip the others
                    self._emit(server, "stopped")
                except BaseException as exc:
                    failures.append(exc)
        if failures:
            first = next((f for f in failures if not isinstance(f, Exception)), failures[0])
            for other in failures:
                if other is not first and isinstance(other, Exception):
                    first.add_note(f"also failed to stop: {other}")
            raise first

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
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


def stop_through_interrupts(
    server: ManagedServer, grace_s: float, interrupts: list[BaseException]
) -> bool:
    """`server.stop(grace_s)`; an interrupt in it is recorded in `interrupts` and the stop
    retried without grace (straight to SIGKILL), a few times: a user who presses Ctrl-C again
    is in a hurry, not asking to leave servers behind. False when every try was interrupted:
    the server may still run, and must not be reported stopped."""
    for attempt in range(STOP_RETRIES_AFTER_INTERRUPT + 1):
        try:
            server.stop(grace_s if attempt == 0 else 0.0)
            return True
        except (KeyboardInterrupt, SystemExit) as exc:
            interrupts.append(exc)
    return False


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

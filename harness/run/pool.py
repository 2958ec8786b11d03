"""Every topology a run serves, each started once and shared by everything that needs it.

A start is the whole cost of a run on CPU (tens of seconds per topology; requests take well under
a second), so a topology is started the first time something asks for it and then kept: the
sweep's cases, the matrix, the self-test and detection scenarios and fuzzing all ask the pool,
and a pytest session orders its e2e tests by topology (`harness.testing.collection`) so each one
starts once per session. A session is keyed by what makes its instances what they are: the
topology, the serving flags (connectors included) and the proxy under test; its storage is its
own, never another topology's, because both example connectors key what they store by content
and a consumer could otherwise load what another topology's producer left (and a transfer guard
would hold for a transfer that did not happen).

It stops a session only when told (`release`), when memory or devices are needed for another
(least recently used first), when another process waits for its devices (at the pool's next
step: `_let_go_of_wanted`), or at the end. A session whose instance died (a case that kills D,
the self-test's kill) is started again on its next use, and the restart is counted with its
cause: `starts` is the account `epd-harness` and pytest print at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.environment import port_lock_dir
from harness.files import write_json_atomic, write_text_atomic
from harness.outcomes.outcome import InstanceStats
from harness.outcomes.startup import describe_instance_start
from harness.serve.device_wants import wanted_devices
from harness.serve.entry import proxy_key
from harness.serve.ports import devices_free
from harness.serve.server_group import EventCallback
from harness.serve.server_log import keep_earlier_log
from harness.serve.session import DeadInstance, ProxiedSession, TopologySession, safe_name
from harness.spec.placement import CPU_INSTANCE_BYTES, CPU_MEMORY_HEADROOM, available_memory_bytes
from harness.spec.settings import LauncherChoice, RunSettings
from harness.spec.topology import Role, ServingConfig, Topology

STARTS_FILE = "topology-starts.json"
# One line per instance started (`describe_instance_start`): what pytest prints at the end.
INSTANCE_STARTS_FILE = "instance-starts.txt"
log = logging.getLogger(__name__)
RoleEnv = Mapping[Role, Mapping[str, str]]


@dataclass(frozen=True)
class SessionKey:
    """What makes a running topology's instances what they are: two requests with equal keys
    share them (through whichever proxy each asks for)."""

    topology: str
    serving: ServingConfig
    # Environment added to the instances of a role (a self-test's plugin in D), as sorted
    # (role, ((name, value), ...)) pairs: other environment, other instances.
    role_env: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # Where the instances run (this host, or a Ray cluster's nodes): other nodes, other
    # instances, even under the same flags.
    launcher: LauncherChoice = LauncherChoice()

    @classmethod
    def of(
        cls, topology: Topology, settings: RunSettings, role_env: RoleEnv | None = None
    ) -> SessionKey:
        frozen = tuple(
            sorted(
                (role.value, tuple(sorted(env.items()))) for role, env in (role_env or {}).items()
            )
        )
        return cls(topology.name, settings.serving, frozen, settings.launcher)

    def describe(
        self, base: ServingConfig | None = None, base_launcher: LauncherChoice | None = None
    ) -> str:
        """The topology, with what differs from the run's own serving flags, environment and
        launcher."""
        parts = [self.topology]
        if base is not None:
            for name, value in dataclasses.asdict(self.serving).items():
                if getattr(base, name) != value:
                    parts.append(f"{name}={value}")
        if base_launcher is not None and self.launcher != base_launcher:
            parts.append(f"launcher={self.launcher.kind}")
        for role, env in self.role_env:
            parts.append(f"{role}+env({','.join(name for name, _ in env)})")
        return " ".join(parts)


@dataclass(frozen=True)
class StartRecord:
    """One start of one topology, and why it was needed."""

    key: SessionKey
    reason: str  # "first use", "restart: <cause>", "private: <why>"
    seconds: float | None  # until every instance was ready; None when it did not come up


@dataclass(frozen=True)
class StartCause:
    """Why a topology is about to start, as known before its start: the start's reason is
    written once the start has kept the earlier logs (`TopologySession.earlier_logs`), so that
    it names where the evidence is now."""

    started_before: bool
    last_start_failed: bool  # the latest start of the same key did not come up
    dead: DeadInstance | None = None  # a running instance of it exited
    # Where the dead instance's log was kept when the new start writes another directory (a
    # sweep with another run directory): that start's own keeping never sees it.
    dead_log_kept: Path | None = None
    # Why the pool stopped its last session of the key, when it stopped it for another
    # process waiting for its devices (`TopologyPool._let_go_of_wanted`).
    stopped_for: str | None = None

    def reason(self, earlier_logs: Mapping[Path, Path]) -> str:
        """The start's reason: first use, or the restart's cause, naming the kept log of what
        it replaces. A dead instance's log is named by both its path (the one its report gave,
        which a start in the same directory writes again) and the name it is kept under beside
        it."""
        if self.dead is not None:
            dead = self.dead
            where = f"its log {dead.log_path}"
            kept = earlier_logs.get(dead.log_path) or self.dead_log_kept
            if kept is not None:
                where += f" is kept as {kept.name}"
            return f"restart: instance {dead.name} {dead.ended()}; {where}"
        if not self.started_before:
            return "first use"
        if self.last_start_failed:
            # Found in review: labelled "stopped earlier", as if the pool had chosen to stop it.
            kept = ", ".join(path.name for path in earlier_logs.values())
            return "restart: the last start did not come up" + (
                f" (its logs kept as {kept})" if kept else ""
            )
        if self.stopped_for is not None:
            return (
                f"restart: stopped for another process waiting for its devices ({self.stopped_for})"
            )
        return "restart: stopped earlier"


@dataclass(frozen=True)
class SessionRequest:
    """A topology wanted now, with the settings it runs under and its devices (its slot)."""

    topology: Topology
    settings: RunSettings
    devices: tuple[int, ...] | None = None
    role_env: RoleEnv | None = None

    @property
    def key(self) -> SessionKey:
        return SessionKey.of(self.topology, self.settings, self.role_env)


@dataclass
class _Live:
    session: TopologySession
    used: float  # monotonic time of the last use: least recently used is stopped first
    devices: tuple[int, ...] = field(default_factory=tuple)


class TopologyPool:
    """The running topologies of one run (one CLI run, or one pytest process)."""

    def __init__(self, settings: RunSettings, on_event: EventCallback | None = None):
        self.settings = settings  # the run's own: artifacts land under its run_dir
        self.on_event = on_event
        self.starts: list[StartRecord] = []
        self.instances: list[InstanceStats] = []
        # Other proxies put in front of a running topology (its instances not started again).
        self.entries: list[str] = []
        self._live: dict[SessionKey, _Live] = {}
        self._before_stop: list[Callable[[TopologySession], None]] = []
        # Each topology's devices in the run's schedule (`place`).
        self._slots: dict[str, tuple[int, ...]] = {}
        # Sessions stopped for another process waiting for their devices, and for whom: the
        # reason their next start gives.
        self._stopped_for: dict[SessionKey, str] = {}
        # The sessions the item running now has asked for (`item_begins`): in use, never let
        # go of for a waiter. None: no items (a CLI run), only those asked at a step are.
        self._in_use: set[SessionKey] | None = None
        self._needed_later: set[str] = set()  # topology names (`item_begins`)

    # -- asking for sessions ------------------------------------------------------------------

    def item_begins(self, needed_later: Collection[str] = ()) -> None:
        """A pytest item begins: the sessions it asks for are in use until the next one
        begins, and those of the topologies `needed_later` (by it and the items after it on
        this worker) are its worker's to come back to: the pool lets go of none of them for
        another process waiting for their devices. Let go of, each started again for its
        next item (seen with the fake vLLM on 4 devices, 2 workers: the load's calibration
        asked for the baseline before its 1E+1P+1D, which 2E+1PD waited for)."""
        self._in_use = set()
        self._needed_later = set(needed_later)

    def place(self, slots: Mapping[str, tuple[int, ...]]) -> None:
        """The devices each topology gets when a caller asks for it without any: the sweep
        gives its schedule here, so a matrix, live or load scenario starts its topology where
        the plan put it. On GPUs a session given no devices would lease every device of the
        run, stopping everything else of this pool and waiting for every other xdist worker's
        devices. A topology's first placement stands (a later sweep on the pool, a load's,
        does not move it)."""
        for name, devices in slots.items():
            self._slots.setdefault(name, devices)

    def session(
        self,
        topology: Topology,
        settings: RunSettings | None = None,
        devices: tuple[int, ...] | None = None,
        role_env: RoleEnv | None = None,
        beside: Sequence[SessionRequest] = (),
    ) -> TopologySession | ProxiedSession:
        """The running session of `topology` under `settings` (default: the run's), started
        now if it is not running, reached through the proxy `settings` names (the instances
        are shared whatever the proxy); raises what stopped it from starting. `beside`: the
        sessions the caller uses with it, asked for together (`open`): kept up, or started
        too, never stopped to make room for it."""
        request = SessionRequest(topology, settings or self.settings, devices, role_env)
        outcome = self.open([*beside, request])[request.key]
        if isinstance(outcome, BaseException):
            raise outcome
        return self.through(outcome, request.settings)

    def revive(
        self,
        topology: Topology,
        settings: RunSettings | None = None,
        devices: tuple[int, ...] | None = None,
        beside: Sequence[SessionRequest] = (),
    ) -> TopologySession | ProxiedSession:
        """`session(topology)`, except that a running session whose instance died gets only
        that instance started again, in place (`TopologySession.revive_dead`: its siblings,
        storage and proxy kept), where `session` would start the whole topology afresh. For
        callers that send request after request that kill one instance (fuzzing): on CPU one
        instance starts in about half the time three do. Counted among the starts with its
        cause; a revival that fails falls back to a full restart, on `devices` (its slot),
        with the sessions `beside` it kept (`session`)."""
        settings = settings or self.settings
        key = SessionKey.of(topology, settings)
        live = self._live.get(key)
        died = live.session.dead_instance() if live is not None else None
        if live is None or died is None:
            return self.session(topology, settings, devices, beside=beside)
        cause = died.headline()
        started = time.monotonic()
        try:
            revived = live.session.revive_dead()
        except Exception as exc:  # noqa: BLE001 - the restart below says what it costs
            log.warning("reviving %s failed (%s); restarting it", topology.name, exc)
            self.starts.append(StartRecord(key, f"revive: {cause}", None))
            # Unusable (`revive_dead`), though a revived instance still starting is alive:
            # left in place, `session()` would hand it back as serving. Nothing is served on
            # it first (`before_stop`): it is stopped as it is.
            self._live.pop(key, None)
            live.session.close()
            return self.session(topology, settings, devices, beside=beside)
        names = ", ".join(s.name.rsplit("/", 1)[-1] for s in revived)
        seconds = round(time.monotonic() - started, 1)
        self.starts.append(StartRecord(key, f"revive {names}: {cause}", seconds))
        self.instances.extend(revived)
        live.used = time.monotonic()
        return self.through(live.session, settings)

    def through(
        self, session: TopologySession, settings: RunSettings
    ) -> TopologySession | ProxiedSession:
        """`session` reached through the proxy `settings` names: itself when that is its own."""
        own = proxy_key(session.topology, session.settings.proxy)
        if proxy_key(session.topology, settings.proxy) == own:
            return session
        view = session.via(settings.proxy)
        entry = f"{SessionKey.of(session.topology, settings).describe(self.settings.serving)} "
        entry += f"through {view.entry.key}"
        if entry not in self.entries:
            self.entries.append(entry)
        return view

    def open(
        self, requests: Sequence[SessionRequest]
    ) -> dict[SessionKey, TopologySession | BaseException]:
        """Sessions for every request; those not running start together (a wave) and are
        waited for together, in the order of `requests`. A request that cannot start maps to
        its exception; an interruption stops whatever this call started and propagates."""
        found: dict[SessionKey, TopologySession | BaseException] = {}
        starting: list[tuple[SessionKey, TopologySession, StartCause]] = []
        for request in requests:
            key = request.key
            live = self._live.get(key)
            dead = None
            if live is not None:
                dead = live.session.dead_instance()
                if dead is None:
                    live.used = time.monotonic()
                    found[key] = live.session
                    continue
                self._stop(key)
            session = self._new_session(request)
            starting.append((key, session, self._start_cause(key, dead, session.dir)))
        asked = {request.key for request in requests}
        if self._in_use is not None:
            self._in_use |= asked
        self._let_go_of_wanted(keep=asked | (self._in_use or set()))
        for _, session, _ in starting:
            session.before_device_wait = lambda: self._let_go(keep=asked)
        # Those asked for that are running now stay: asked for together, they are used
        # together (a fuzz's baseline beside its topology on one Ray cluster).
        self._make_room([(key, s.topology, s.devices) for key, s, _ in starting], keep=asked)
        with contextlib.ExitStack() as undo:
            for _, session, _ in starting:
                undo.callback(session.close)  # cleared below for those that come up
            started = time.monotonic()
            for key, session, _ in starting:
                try:
                    session.start_servers()
                except Exception as exc:  # noqa: BLE001 - a topology that cannot start fails its cases
                    found[key] = exc
            for key, session, cause in starting:
                reason = cause.reason(session.earlier_logs)
                if key in found:
                    self.starts.append(StartRecord(key, reason, None))
                    continue
                try:
                    session.wait_until_serving()
                except Exception as exc:  # noqa: BLE001
                    _close_noting(session, exc)  # a dead sibling must not hold memory
                    found[key] = exc
                    self.starts.append(StartRecord(key, reason, None))
                    continue
                seconds = round(time.monotonic() - started, 1)
                self.starts.append(StartRecord(key, reason, seconds))
                self._live[key] = _Live(session, time.monotonic(), session.devices)
                self.instances.extend(session.stats.values())
                found[key] = session
            undo.pop_all()
        for key, session, _ in starting:
            if isinstance(found[key], BaseException):
                _close_noting(session, found[key])
        # In the order asked, which callers read by position (a wave's slots, the fuzzer's
        # `baseline, topology`): those running were found first (found in review).
        return {request.key: found[request.key] for request in requests}

    @contextlib.contextmanager
    def private(
        self,
        topology: Topology,
        why: str,
        label: str,
        settings: RunSettings | None = None,
        reuse_storage: Path | None = None,
        devices: tuple[int, ...] | None = None,
    ) -> Iterator[TopologySession]:
        """A session nobody else shares, for a scenario that must start one of its own (a
        rerun on the storage an earlier session left), on `devices` (default: its place, else
        every device of the run); counted among the starts with `why`. Room is made for its
        devices as for a shared session's: on GPUs a session leases its devices, and a lease
        this process holds through another session is waited for like any other holder's,
        for ever."""
        settings = settings or self.settings
        key = SessionKey.of(topology, settings)
        session = TopologySession(
            topology,
            settings,
            on_event=self.on_event,
            label=label,
            reuse_storage=reuse_storage,
            devices=self._placed(topology, devices),
        )
        # Nothing running is this session, not even a shared one of the same key: the attach
        # scenario's deployment beside the pool's own 1E+1PD waited for ever on the devices
        # that one held (seen with the fake vLLM on eight devices).
        session.before_device_wait = lambda: self._let_go(keep=set())
        self._let_go_of_wanted(keep=set(self._in_use or ()))
        self._make_room([(key, topology, session.devices)], shared=False)
        started = time.monotonic()
        try:
            session.__enter__()
        except BaseException:
            self.starts.append(StartRecord(key, f"private: {why}", None))
            raise
        self.starts.append(
            StartRecord(key, f"private: {why}", round(time.monotonic() - started, 1))
        )
        self.instances.extend(session.stats.values())
        try:
            yield session
        finally:
            session.close()

    # -- stopping ----------------------------------------------------------------------------

    def release(self, topology: str | None = None, launcher: LauncherChoice | None = None) -> None:
        """Stop the sessions of `topology` (every session when None), of those the ones
        `launcher` runs (any when None); a later request starts it again, counted as a
        restart. Every one is stopped even when one fails to (the first failure is raised at
        the end): one session's tap that does not stop must not leave the others running."""
        keys = [
            k
            for k in self._live
            if (topology is None or k.topology == topology)
            and (launcher is None or k.launcher == launcher)
        ]
        self._stop_each(keys)

    def release_variants(self) -> None:
        """Stop every session whose instances run with environment added to a role (a
        scenario's own variant: the KV-noise plugin in D under NIXL). Nothing but the items
        that asked for it can use one, so the plugin calls this where their class ends; kept
        until its topology's group ended, each spun NIXL's progress threads beside the next
        variant and the plain topology (three NIXL topologies on 2 cores, D's reads of 0.2 MB
        taking minutes: the NIXL night line, 2026-12-04)."""
        self._stop_each([k for k in self._live if k.role_env])

    def _stop_each(self, keys: Sequence[SessionKey]) -> None:
        """Stop every one of `keys`, in order, even when one fails to (the first failure is
        raised at the end)."""
        with contextlib.ExitStack() as stops:  # run last registered first: register reversed
            for key in reversed(keys):
                stops.callback(self._stop, key)

    def close(self) -> None:
        self.release()

    def before_stop(self, callback: Callable[[TopologySession], None]) -> None:
        """Call `callback` with every session about to be stopped (released, or stopped to
        make room): a sweep sharing the pool serves the prompts it will need as an exact
        reference while the topology still runs, instead of starting it again later."""
        self._before_stop.append(callback)

    def running(self) -> list[SessionKey]:
        return list(self._live)

    # -- the account -------------------------------------------------------------------------

    def distinct(self) -> list[SessionKey]:
        return list(dict.fromkeys(s.key for s in self.starts))

    def summary(self) -> str:
        """How many topologies were started, how many distinct ones that is, and why each
        extra start happened."""
        base, launcher = self.settings.serving, self.settings.launcher
        extra = [s for s in self.starts if s.reason != "first use"]
        lines = [
            f"topology starts: {len(self.starts)} for {len(self.distinct())} distinct "
            f"(topology, connectors)"
            + (f"; {len(extra)} more than once, each with its reason:" if extra else "")
        ]
        for start in self.starts:
            took = "did not come up" if start.seconds is None else f"{start.seconds:.1f}s"
            lines.append(f"  {start.key.describe(base, launcher)}: {start.reason} ({took})")
        lines += [f"  {entry} (no start: another proxy in front)" for entry in self.entries]
        return "\n".join(lines)

    def starts_json(self) -> list[dict[str, object]]:
        base, launcher = self.settings.serving, self.settings.launcher
        return [
            {"topology": s.key.describe(base, launcher), "reason": s.reason, "seconds": s.seconds}
            for s in self.starts
        ]

    def write_starts(self, run_dir: Path) -> None:
        """`topology-starts.json` and `instance-starts.txt`: what a pytest session sums over
        every pool of its run (every xdist worker's)."""
        if self.starts:
            write_json_atomic(run_dir / STARTS_FILE, self.starts_json())
        if self.instances:
            lines = [describe_instance_start(stats) for stats in self.instances]
            write_text_atomic(run_dir / INSTANCE_STARTS_FILE, "\n".join(lines) + "\n")

    # -- internals ---------------------------------------------------------------------------

    def _start_cause(self, key: SessionKey, dead: DeadInstance | None, new_dir: Path) -> StartCause:
        """Why `key` starts now. A dead instance's log outside the new start's directory (the
        sweep asking runs in another run directory) is kept here, as the start keeps those in
        its own (`prepare_session_dir`): left under its own name, a later start in that
        directory would move it, and the reason would name a log that is not there."""
        earlier = [s for s in self.starts if s.key == key]
        kept = None
        if dead is not None and dead.log_path.parent != new_dir:
            kept = keep_earlier_log(dead.log_path)
        return StartCause(
            bool(earlier),
            bool(earlier) and earlier[-1].seconds is None,
            dead,
            dead_log_kept=kept,
            stopped_for=self._stopped_for.pop(key, None),
        )

    def _placed(
        self, topology: Topology, devices: tuple[int, ...] | None
    ) -> tuple[int, ...] | None:
        """The devices asked for, else the topology's place (`place`); None: every device."""
        return devices or self._slots.get(topology.name)

    def _new_session(self, request: SessionRequest) -> TopologySession:
        label = safe_name(
            request.key.describe(self.settings.serving, self.settings.launcher).replace(" ", "_")
        )
        return TopologySession(
            request.topology,
            request.settings,
            on_event=self.on_event,
            label=label,
            devices=self._placed(request.topology, request.devices),
            role_env=request.role_env,
        )

    def _stop(self, key: SessionKey) -> None:
        live = self._live.pop(key, None)
        if live is None:
            return
        try:
            if not key.role_env and live.session.dead_instance_report() is None:
                # By index: a callback may add callbacks (sweeps it makes now), and they run
                # too, for this very stop. A variant with added environment is nobody's
                # reference: its answers came from instances the plain topology does not run.
                for callback in self._before_stop:
                    callback(live.session)
        finally:
            live.session.close()

    def _let_go(self, keep: set[SessionKey]) -> None:
        """Stop every running session but those in `keep` (asked for with the one that is
        about to wait): called before a start waits for a device another xdist worker holds.
        Kept, one of them could hold what that worker waits for in turn: a worker holding the
        baseline's device while it waited for 1P+1D's, whose holder waited for the baseline's
        device to calibrate a load, would wait for ever."""
        for key in [k for k in self._live if k not in keep]:
            self._stop(key)

    def _let_go_of_wanted(self, keep: set[SessionKey]) -> None:
        """Stop the sessions but those in `keep` (asked for now, or in use) that stand between
        another process and the devices it waits for (its marks, `device_wants`): called at
        each step of the pool. An idle session is otherwise kept until this pool needs its
        room or ends, and on a multi-worker GPU night the worker waiting for its device sat
        idle all that time while this worker served other topologies on other devices.

        Only where letting go gives the waiter every device it waits for: it leases them all
        or none, so where another holder (or a session kept here) has one of them, a stop
        now would only cost a restart later. On the fake 8-GPU night 2E+1PD waited for two
        workers' devices (1-2 and 3), each let go in turn, and each restarted its session
        while 2E+1PD still waited."""
        if not self.settings.platform.exclusive_devices:
            return
        kind, lock_dir = self.settings.platform.name, port_lock_dir()
        waiters: dict[tuple[int, str], set[int]] = {}
        for want in wanted_devices(lock_dir, kind):
            waiters.setdefault((want.pid, want.waiter), set()).add(want.device)
        for (pid, _), devices in waiters.items():
            # Read again for each waiter: a stop's callback (a sweep serving its references)
            # may have opened or stopped sessions.
            local = {k: v for k, v in self._live.items() if k.launcher.is_local}
            held_here = {d for live in local.values() for d in live.devices}
            kept = {
                d
                for k, live in local.items()
                if k in keep or k.topology in self._needed_later
                for d in live.devices
            }
            idle = [
                k
                for k, live in local.items()
                if k not in keep
                and k.topology not in self._needed_later
                and devices & set(live.devices)
            ]
            if not idle or devices & kept or not devices_free(kind, devices - held_here, lock_dir):
                continue
            plural = "s" if len(devices) > 1 else ""
            wanted = f"{kind} device{plural} {', '.join(map(str, sorted(devices)))}"
            for key in idle:
                if key in self._live:
                    self._stopped_for[key] = f"{wanted} wanted by pid {pid}"
                    self._stop(key)

    def _make_room(
        self,
        coming: Sequence[tuple[SessionKey, Topology, tuple[int, ...]]],
        shared: bool = True,
        keep: Collection[SessionKey] = (),
    ) -> None:
        """Stop least recently used sessions until the coming ones fit: on GPUs no two
        sessions hold the same device; on CPU the instances fit in the memory available now
        (`CPU_INSTANCE_BYTES` each, `CPU_MEMORY_HEADROOM` of it). A session coming on a Ray
        cluster first stops the others on that cluster: its placement takes one node's bundle
        per instance (a rehearsal cluster has three nodes: one topology at a time), and a group
        Ray cannot place would only wait and be refused. `shared`: the coming sessions are the
        pool's own, so a running one of the same key is not in their way; a private one is
        another start, beside whatever runs under its key. `keep`: running sessions asked for
        with the coming ones, never stopped for them."""
        keys = {key for key, _, _ in coming}
        keep = (keys if shared else set()) | set(keep)
        clusters = {k.launcher.ray_address for k in keys if not k.launcher.is_local}
        for key in [k for k in self._live if k not in keep and not k.launcher.is_local]:
            if key.launcher.ray_address in clusters:
                self._stop(key)
        others = sorted(
            ((k, v) for k, v in self._live.items() if k not in keep), key=lambda kv: kv[1].used
        )
        if self.settings.platform.exclusive_devices:
            wanted = {d for _, _, devices in coming for d in devices}
            for key, live in others:
                if wanted & set(live.devices):
                    self._stop(key)
            return
        needed = sum(len(topology.roles) for _, topology, _ in coming)
        for key, _ in others:
            if cpu_instances_that_fit() >= needed:
                break
            self._stop(key)


def cpu_instances_that_fit() -> int:
    """How many more CPU instances the memory available now holds."""
    return int(available_memory_bytes() * CPU_MEMORY_HEADROOM) // CPU_INSTANCE_BYTES


def _close_noting(session: TopologySession, cause: BaseException) -> None:
    """Close a session that failed to start; a close that fails too (processes that survived
    SIGKILL) is a note on `cause`, which stays its topology's error: raised, it replaced the
    death and its log tail and failed the whole wave (found in review)."""
    try:
        session.close()
    except Exception as close_error:  # noqa: BLE001 - reported on the cause
        cause.add_note(f"closing {session.topology.name} failed too: {close_error!r}")

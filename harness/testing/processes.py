"""Watching what a test started: processes, their groups, their ports and their logs.

For tests of the `process` and `e2e` tiers, whose claim is that nothing a run started outlives
it. A zombie counts as gone: this machine's init does not reap orphans, and a zombie holds
neither memory nor a port. Clean-up goes by recorded handle or process group, never by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil

from harness.testing.fake_vllm import observers

REPO_ROOT = Path(__file__).resolve().parents[2]
GONE_TIMEOUT_S = 5.0
POLL_S = 0.02

Proc = psutil.Process | int  # a handle, or a pid


def child_env(**extra: str) -> dict[str, str]:
    """This environment, with the repository importable (no install needed) and `extra`."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), **extra}


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float = 20.0) -> object:
    """Poll `predicate` until it returns something truthy (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(POLL_S)
    return value


def read(path: Path) -> str:
    """A log's text so far ("" before it exists)."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def files_under(directory: Path) -> set[str]:
    """Every file below `directory`, as paths relative to it."""
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def _handle(proc: Proc) -> psutil.Process | None:
    try:
        return proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
    except psutil.NoSuchProcess:
        return None


def is_live(proc: Proc) -> bool:
    """Running, and not a zombie."""
    handle = _handle(proc)
    try:
        return (
            handle is not None and handle.is_running() and handle.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False


def survivors(procs: Iterable[Proc], timeout_s: float = GONE_TIMEOUT_S) -> list[Proc]:
    """The processes of `procs` still live after waiting up to `timeout_s` for them to go."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if is_live(p)]) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return alive


def seconds_until_gone(procs: Iterable[Proc], timeout_s: float = GONE_TIMEOUT_S) -> float | None:
    """How long until every process of `procs` was gone; None if some outlived `timeout_s`."""
    start = time.monotonic()
    if survivors(procs, timeout_s):
        return None
    return time.monotonic() - start


def live_members_of_group(pgid: int) -> list[int]:
    """The pids of the live processes in process group `pgid`."""
    pids = []
    for proc in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
    return pids


def describe(procs: Iterable[Proc]) -> str:
    """One clause per process: pid, group, state and command line (for a failure message)."""
    parts = []
    for proc in procs:
        handle = _handle(proc)
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError, AttributeError):
            cmdline = " ".join(handle.cmdline())[:120]
            parts.append(
                f"pid {handle.pid} pgid {os.getpgid(handle.pid)} {handle.status()}: {cmdline}"
            )
    return "; ".join(parts)


def kill_all(procs: Iterable[Proc]) -> None:
    """Last-resort clean-up after a failed check: SIGKILL by recorded handle."""
    for proc in procs:
        handle = _handle(proc)
        with contextlib.suppress(psutil.NoSuchProcess, AttributeError):
            handle.kill()


# psutil dates a process from the kernel's boot time, which /proc/stat gives in whole seconds:
# a process may be dated up to a second before it was born. Judged "born before the run", it
# would slip out of the check.
CREATE_TIME_SLACK_S = 1.0


def held_ports(
    ports: Iterable[int],
    lock_dir: Path | None,
    born_before: float | None = None,
    born_after: float | None = None,
    always: Iterable[int] = (),
) -> list[str]:
    """Ports something still holds: a harness lease (its flock in `lock_dir`) or a live socket
    of any process, each with who holds it.

    A connection in TIME_WAIT belongs to the kernel, not to a leftover process; it expires by
    itself and does not stop a server (they bind with SO_REUSEADDR) from taking the port. With
    `born_before` / `born_after` (epoch seconds: when the run ended / began), a socket of a
    process created outside that span is not counted: it took a port the run had given back
    (another test under xdist, leasing from another lock directory: a new process, or an old
    one such as the other worker's pytest opening a tap), it was not left by the run. A pid in
    `always` counts whatever its age: the test's own process, born long before the run, runs
    the harness in-process and could be what leaked the socket. Without `lock_dir`, leases are
    not looked at (a test holding them still, an export's ports, asks about sockets alone).
    """
    ports = list(ports)
    always = set(always)
    sockets = {}
    for conn in psutil.net_connections(kind="tcp"):
        if not conn.laddr or conn.laddr.port not in ports or conn.status == psutil.CONN_TIME_WAIT:
            continue
        born = _created_at(conn.pid)
        outside = born is not None and (
            (born_before is not None and born > born_before)
            or (born_after is not None and born < born_after - CREATE_TIME_SLACK_S)
        )
        if outside and conn.pid not in always:
            continue
        sockets.setdefault(conn.laddr.port, f"{conn.status} pid {conn.pid}")
    held = []
    for port in ports:
        if port in sockets:
            held.append(f"{port} ({sockets[port]})")
        elif lock_dir is not None and lease_is_held(lock_dir / f"port-{port}.lock"):
            held.append(f"{port} (lease still locked)")
    return held


def _created_at(pid: int | None) -> float | None:
    """When process `pid` was created (epoch seconds; None when that cannot be told)."""
    if pid is None:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def lease_is_held(lock_path: Path) -> bool:
    """Whether a process holds the port lease whose lock file is `lock_path`."""
    if not lock_path.exists():
        return False
    with open(lock_path, "rb") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


@contextlib.contextmanager
def nothing_left_behind(procs: list, ports: list[int], lock_dir: Path) -> Iterator[None]:
    """Fill `procs` and `ports` inside the block; afterwards all must be gone and free.

    Survivors are killed before any failure propagates, so one broken case does not leak
    servers into the rest of the session. A port counts as held by a process born during the
    block or by this test's own process (`held_ports`): an older process, such as the other
    xdist worker's pytest, may take a port given back, and that is not this block's leftover.
    """
    began = time.time()
    try:
        yield
    finally:
        alive = survivors(procs)
        kill_all(alive)
    assert not alive, f"processes left behind: {describe(alive)}"
    held = held_ports(ports, lock_dir, born_after=began, always=[os.getpid()])
    assert not held, f"ports left held: {held}"


def alive_or_fail(harness: subprocess.Popen[str]) -> None:
    """Fail at once, with its output, if the harness process ended while the test waits on it."""
    if harness.poll() is not None:
        out, err = harness.communicate()
        raise AssertionError(f"the harness ended early (exit {harness.returncode}):\n{out}\n{err}")


def session_ports(session) -> list[int]:
    """The ports a running `TopologySession` holds: its instances' and its proxy's."""
    ports = [spec.port for spec in session.instances]
    if session.proxy is not None:
        ports.append(int(session.entry_url.rsplit(":", 1)[1]))
    return ports


@contextlib.contextmanager
def pythons_own_ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt at every Ctrl-C) for a test that sends
    itself one: whatever an earlier in-process harness run, or the test runner, installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sigint_as_at_a_terminal() -> None:
    """A child's preexec_fn: SIGINT back to its default disposition before exec.

    A process started in the background by a non-interactive shell (`cmd &` in a script, a
    CI step that backgrounds its job, `.ci/run` itself) inherits SIGINT *ignored*, and a shell
    or Python then leaves it ignored: the program under test would not see the Ctrl-C a test
    sends (measured: a run of the suite started that way failed the SIGINT tests; the export's
    double Ctrl-C test once the harness stopped leaving its own handler behind). What is
    tested is a program whose SIGINT is a Ctrl-C, whatever started pytest.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def sigint_ignored_as_in_a_backgrounded_run() -> Iterator[None]:
    """SIGINT ignored in this process meanwhile, as in a pytest a script started with `cmd &`
    (the fresh-clone CI run): what a test starts inside inherits it ignored unless it is
    started with `sigint_as_at_a_terminal`. A Ctrl-C test starts its program inside this, so
    it shows the reset, however pytest itself was started (found by a fresh-clone CI run:
    `run.sh reference` was started without the reset, ignored the Ctrl-C, and served on; it
    passed whenever pytest was a terminal's foreground job). Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def ignores_sigint(pid: int) -> bool | None:
    """Whether process `pid` ignores SIGINT (the kernel's SigIgn mask); None when unreadable."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return None


def ctrl_c(pid: int) -> None:
    """A terminal's Ctrl-C to the foreground job `pid` leads (SIGINT to its process group).
    A leader that ignores SIGINT would not see it and the test would only time out, with no
    word why: that is refused at once, naming the cause."""
    assert not ignores_sigint(pid), (
        f"process {pid} ignores SIGINT, so a Ctrl-C cannot reach it: start it with "
        "preexec_fn=sigint_as_at_a_terminal (a pytest started in the background passes "
        "SIGINT on ignored)"
    )
    os.killpg(pid, signal.SIGINT)


EXPORT_SCRIPT_TIMEOUT_S = 240.0
CONDITION_POLL_S = 0.1  # how often `run_export_script` asks whether its timeout counts yet


def export_ports_left(out: Path, ports: Iterable[int]) -> list[str]:
    """The ports of an export's servers (`<export>/work/state/*.pid`) that a process of that
    run still holds. A socket of a process born before the first server or after this call
    is another's: under xdist, a test leasing from a lock directory of its own may bind a port
    the export gave back, in the moment before the check (a fresh-clone CI run failed so,
    `Address already in use`, on a bind check that could not tell whose the listener was)."""
    pid_files = list((out / "work/state").glob("*.pid"))
    began = min((path.stat().st_mtime for path in pid_files), default=0.0)
    return held_ports(ports, None, born_after=began, born_before=time.time())


def export_port_variables(serve_sh: str) -> list[str]:
    """The port variables at the top of an export's serve.sh (`DECODE0_PORT=${...}`): what a
    test sets to ports it leased, so no two exports, nor an export and a pool, meet on one."""
    return [line.split("=", 1)[0] for line in serve_sh.splitlines() if "_PORT=${" in line]


# The Hugging Face Hub's cache and credentials: an export's serve.sh fetches a hub model by name
# (`harness.run.export.files.model_line`), as a user reproducing it would, and a test builds
# the script's environment from scratch. Without them the GPU night's exports fetched the model
# again into ~/.cache on a runner whose HF_HOME put the nightly's copy elsewhere, and a gated
# model (the workflow's `model` input; the workflows pass HF_TOKEN to every step) failed there
# only, for the harness's own reasons (found walking the GPU night).
HUB_ACCESS_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT")


def hub_access(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The variables of HUB_ACCESS_VARIABLES that `environ` sets."""
    return {name: environ[name] for name in HUB_ACCESS_VARIABLES if environ.get(name)}


def run_export_script(
    out: Path,
    argv: list[str],
    env: dict[str, str],
    timeout: float = EXPORT_SCRIPT_TIMEOUT_S,
    counted_from: Callable[[], bool] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`bash <export>/<argv...>` to its end, its output captured. On a timeout or Ctrl-C
    (any exception while it runs) its own group and every server it recorded
    (`<export>/work/state/*.pid`, each a group of its own) are killed before this returns:
    subprocess.run's timeout kills bash alone, and the servers serve.sh started outlived it,
    on devices a test's lease then let go (found twice: a red run of the DEVICES test left
    four fake servers; the e2e export scenario ran run.sh so on GPUs). A timeout fails the
    test (AssertionError with the output); anything else is raised as it was.

    The Hugging Face Hub's cache and token this process has (`hub_access`) are added to `env`,
    where an export's serve.sh fetches a model by name. The fake vLLM's observation variables
    this process has (`observers`) are added to `env`,
    which a test builds from scratch: without them the fake servers an export started were
    neither logged nor held their devices, so the fake GPU night's check that no device is
    held by two live instances could not see an export's servers. Test plumbing only: the
    export's files are unchanged, and a session on real vLLM sets none of them.

    `counted_from`: the timeout counts from when this first holds (polled; the default
    timeout bounds the wait for it), so a test of the timeout waits past the point it proves
    (the servers serving, say) and no longer: a timeout from the start had to cover a start
    on a loaded host too, and spent all of it every time."""
    script = subprocess.Popen(
        ["bash", str(out / argv[0]), *argv[1:]],
        cwd=out,
        env={**observers(os.environ), **hub_access(os.environ), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its group is its own; a terminal's Ctrl-C reaches us only
    )
    waited = f"{timeout} s"
    try:
        if counted_from is not None:
            waited = f"{EXPORT_SCRIPT_TIMEOUT_S} s, before its timeout began (counted_from)"
            ended = reached(script, counted_from, EXPORT_SCRIPT_TIMEOUT_S)
            if ended is not None:
                return ended
            waited = f"{timeout} s"
        stdout, stderr = script.communicate(timeout=timeout)
    except BaseException as exc:
        groups = [script.pid]
        for pid in (out / "work/state").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                groups.append(int(pid.read_text()))
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        stdout, stderr = script.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise AssertionError(
                f"{argv[0]} still ran after {waited}:\n{stdout}\n{stderr}"
            ) from None
        raise
    return subprocess.CompletedProcess(script.args, script.returncode, stdout, stderr)


def reached(
    script: subprocess.Popen[str], condition: Callable[[], bool], timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """Waits until `condition` holds (None) or `script` ends first (what it did); still
    running after `timeout` s, subprocess.TimeoutExpired. Read through `communicate`, which
    keeps what the script printed for a later call and keeps its pipes from filling."""
    deadline = time.monotonic() + timeout
    while not condition():
        try:
            stdout, stderr = script.communicate(timeout=CONDITION_POLL_S)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise
            continue
        return subprocess.CompletedProcess(script.args, script.returncode, stdout, stderr)
    return None

"""A server's processes as the kernel sees them: the child's set-up before exec (the
parent-death signal, the CPU affinity), its group and recorded descendants signalled, what is
still alive of them, and how a process or an exit is described.

Nothing here kills by name: only by a process group id or a psutil handle that re-checks a
pid's identity (`harness.serve.launch` says why each step is there).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

import psutil

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

# Resolved once, in the parent: the child must not dlopen/dlsym between fork and exec, where a
# loader lock held by another parent thread at fork time would deadlock it.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def in_child(parent_pid: int, cpu_affinity: tuple[int, ...]) -> Callable[[], None] | None:
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


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def signal_process(proc: psutil.Process, sig: signal.Signals) -> None:
    """Signal a recorded process; psutil refuses if its pid now belongs to another process."""
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def pgid_of(proc: psutil.Process) -> int | None:
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


def live_group_members(pgid: int) -> list[psutil.Process]:
    """Non-zombie processes of group `pgid`; killpg(pgid, 0) alone counts zombies as members."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    members = []
    for proc in psutil.process_iter():
        if pgid_of(proc) == pgid and is_live_process(proc):
            members.append(proc)
    return members


def describe_process(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ({proc.name()}, {proc.status()})"
    except psutil.NoSuchProcess:
        return f"pid {proc.pid} (gone)"

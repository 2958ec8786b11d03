"""What SIGINT, SIGTERM and SIGHUP do to a harness that has servers running.

SIGTERM to the harness itself (CI cancelling, `timeout`) ends it without unwinding `with`
blocks unless `install_signal_handlers()` was called; then it unwinds like Ctrl-C, and a
repeated signal does not cut that cleanup short. `signals_deferred` keeps any of them from
landing between a server's fork and its being recorded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any


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


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
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
        # The first that does something: one ignored (SIGHUP under nohup) does not stand in
        # for a SIGTERM that came after it.
        signum = next((s for s in came if previous[signal.Signals(s)] != signal.SIG_IGN), None)
        if signum is not None:
            handler = previous[signal.Signals(signum)]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)

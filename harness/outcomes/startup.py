"""Where one vLLM instance's start-up went, read from its own log: the start-up timeline.

A start is the whole cost of a run on CPU, and on CPU it is mostly imports: the API server,
then the engine core each import torch and vLLM before the model loads (a fraction of a second
for the tiny model) and the KV cache is allocated. The worker runs inside the engine core, as
on a one-device GPU (`harness.spec.platforms`), so the worker phase is missing there; with
vLLM's `mp` executor (its CPU default, or several devices) a worker process imports them a third
time and shows as that phase. On GPUs compile/graph capture shows between the model and the KV
cache.
vLLM stamps its lines to the second, so every phase is good to about a second.

Phases, each the seconds from spawn to its first sign in the log (None when the log never
shows it): api_server (the API server's first line: its imports are done), engine_core, worker,
model_loaded, kv_cache (profile + KV cache + warm-up done), serving (the server announced its
port). `ready_s` (the harness's first healthy /health) closes the timeline.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from harness.outcomes.outcome import InstanceStats

PHASES = ("api_server", "engine_core", "worker", "model_loaded", "kv_cache", "serving")
# A vLLM log line: "(EngineCore pid=9090) INFO 12-01 15:30:36 [core.py:402] ...".
_STAMPED = re.compile(
    r"^\((?P<process>[A-Za-z_-]+)(?:-\d+)? pid=\d+\) \w+ (?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d) "
)
# The first line that shows each phase is over (beyond the process prefix).
_PHASE_SIGNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model_loaded", re.compile(r"Loading weights took|Model loading took")),
    ("kv_cache", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
    ("serving", re.compile(r"Starting vLLM (API )?server on")),
)
_PROCESS_PHASES = {
    "APIServer": "api_server",
    "EngineCore": "engine_core",
    "Worker": "worker",
    "VllmWorker": "worker",
}


def startup_timeline(
    log_path: Path, spawned_wall_s: float, ready_s: float | None
) -> dict[str, float | None]:
    """{phase: seconds since spawn} read from `log_path`; `spawned_wall_s` is the spawn's
    wall-clock time (epoch seconds), `ready_s` the harness's measured seconds to ready."""
    timeline: dict[str, float | None] = dict.fromkeys(PHASES)
    spawned = datetime.datetime.fromtimestamp(spawned_wall_s)
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        match = _STAMPED.match(line)
        if match is None:
            continue
        at = _seconds_since(spawned, match["stamp"])
        process_phase = _PROCESS_PHASES.get(match["process"])
        if process_phase and timeline[process_phase] is None:
            timeline[process_phase] = at
        for phase, sign in _PHASE_SIGNS:
            if timeline[phase] is None and sign.search(line):
                timeline[phase] = at
    timeline["ready"] = None if ready_s is None else round(ready_s, 1)
    return timeline


def _seconds_since(spawned: datetime.datetime, stamp: str) -> float:
    """`MM-DD HH:MM:SS` (local time, no year) as seconds after `spawned` (never below 0: the
    stamps are whole seconds)."""
    moment = datetime.datetime.strptime(f"{spawned.year}-{stamp}", "%Y-%m-%d %H:%M:%S")
    if moment < spawned - datetime.timedelta(days=180):  # the log crossed New Year
        moment = moment.replace(year=spawned.year + 1)
    return max(0.0, round((moment - spawned).total_seconds(), 1))


def describe_timeline(timeline: dict[str, float | None]) -> str:
    """`api_server 3s, engine_core 28s, ...`: the phases the log showed, in order."""
    shown = [f"{phase} {at:g}s" for phase, at in timeline.items() if at is not None]
    return ", ".join(shown) or "no phases in the log"


def describe_startup_cpu(cpu_s: dict[str, float]) -> str:
    """`CPU 29.8 s (server 9.9, EngineCore 9.1, Worker 10.8)`: what the instance's processes
    used until it was ready; on a host with few cores this, not the wall time, is what the
    other instances and tests starting beside it wait for."""
    if not cpu_s:
        return "CPU not sampled"
    # Helpers that came and went (multiprocessing's resource tracker, a `uname`) count in the
    # sum: under their own name when a sample saw them (shown from 0.05 s), else under the
    # process that waited for them (harness.serve.cpu_account).
    parts = ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in cpu_s.items() if seconds >= 0.05)
    return f"CPU {sum(cpu_s.values()):.1f} s ({parts})"


def describe_instance_start(stats: InstanceStats) -> str:
    """One line per instance: when it was ready, where the time went, what its processes used
    and the most memory its tree held."""
    phases = {phase: at for phase, at in stats.timeline.items() if phase != "ready"}
    # One that shared a GPU was spawned only once those before it were ready: its time counts
    # from its own spawn, not from its topology's start.
    after = stats.started_after
    spawned = f" from its spawn once {' and '.join(after)} was ready" if after else ""
    return (
        f"{stats.name}: ready in {stats.startup_s or 0:.1f}s{spawned} "
        f"({describe_timeline(phases)}); "
        f"{describe_startup_cpu(stats.startup_cpu_s)}; "
        f"peak RSS {stats.peak_rss_bytes / 2**30:.2f} GiB"
    )

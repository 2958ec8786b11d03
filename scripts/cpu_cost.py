#!/usr/bin/env python
"""What a command costs the host in CPU, besides its wall time, and so the least wall time that
work could take on a number of cores.

CI's pytest time on a 2-core host is bounded below by the CPU its tests need, however they are
spread over xdist workers: a start of real vLLM on CPU is two interpreters importing torch and
vLLM, and most of the e2e selection's CPU is spent inside vLLM's own processes. This measures
that bound instead of guessing it. The count is the whole host's busy time (/proc/stat), so it
includes what the command's processes leave behind or what Ray starts outside its tree, and
also anything else running: measure on a quiet machine.

    .venv/bin/python scripts/cpu_cost.py [--cores N] -- .venv/bin/python -m pytest ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest guest_nice.
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (guests are in user)


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the host has spent busy since boot."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    return sum(int(fields[index]) for index in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="default: this host's")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    busy_before, started = busy_cpu_seconds(), time.monotonic()
    try:
        code = subprocess.call(command)
    except OSError as exc:
        parser.error(f"cannot run {command[0]}: {exc}")
    wall_s = time.monotonic() - started
    busy_s = busy_cpu_seconds() - busy_before
    print(
        f"cpu_cost: exit {code}; wall {wall_s:.1f} s; host busy {busy_s:.1f} CPU-s "
        f"({busy_s / wall_s:.2f} of {os.cpu_count()} cores on average); this work needs "
        f">= {busy_s / args.cores:.1f} s on {args.cores} cores, perfectly packed",
        file=sys.stderr,
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())

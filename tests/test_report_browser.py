"""The HTML report rendered by a real headless Chromium: what a person opening it would see."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
APT_TIMEOUT_S = 1200.0


def ensure_chromium() -> Path:
    """Debian's Chromium, installed with apt-get the first time a test needs it.

    It fails rather than skips when Chromium cannot be had: a skipped browser check reads as
    green in CI, and a report nobody rendered is a report nobody checked.
    """
    if CHROMIUM.exists():
        return CHROMIUM
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.fail(f"{CHROMIUM} is missing and apt-get is not available to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    started = time.monotonic()
    for argv in ([apt, "update"], [apt, "install", "-y", "chromium"]):
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{' '.join(argv)}` took over {APT_TIMEOUT_S:.0f}s; install chromium")
        if proc.returncode != 0:
            pytest.fail(
                f"cannot install Chromium: `{' '.join(argv)}` exited {proc.returncode} "
                f"(root needed; or run `apt-get install -y chromium` yourself):\n"
                f"{proc.stderr[-2000:]}"
            )
    if not CHROMIUM.exists():
        pytest.fail(f"apt-get installed chromium but {CHROMIUM} does not exist")
    print(f"installed Chromium in {time.monotonic() - started:.0f}s")
    return CHROMIUM

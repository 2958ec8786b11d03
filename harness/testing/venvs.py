"""Throwaway virtualenvs for process tests of what `scripts/cpu` installs into the served venv:
the AMX start-up hook, the `vllm` alias. No pip in them (nothing is downloaded); a test writes
the site-packages it needs by hand, or points a real `pip --python` at it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def bare_venv_site(root: Path) -> tuple[Path, Path]:
    """A virtualenv without pip at `root`: its interpreter and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return python, Path(site)

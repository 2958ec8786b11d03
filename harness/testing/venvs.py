"""Throwaway virtualenvs for process tests of what `scripts/cpu` installs into the served venv:
the AMX start-up hook, the `vllm` alias. No pip in them (nothing is downloaded); a test writes
the site-packages it needs by hand, or points a real `pip --python` at it. And the site-packages
alone of a served interpreter, for the stand-in pythons of the GPU jobs' tests that run the real
harness/cli/torch_hold.py on it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection, Mapping
from pathlib import Path

import packaging


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


def stand_in_site(
    site: Path, installed: Mapping[str, str], from_files: Collection[str] = ()
) -> dict[str, str]:
    """A served interpreter's site-packages as torch_hold.py reads it: a dist-info per installed
    distribution (name: version), those named in `from_files` with the direct_url.json a wheel
    file's install writes (what makes `pip freeze` print `torch @ file:///...whl`), and
    `packaging`, which torch_hold.py imports (vLLM's install brings it). The environment a
    stand-in python runs the real script with: `PYTHONPATH=$FAKE_SITE "$REAL_PYTHON" -S ...`.
    `-S` because PYTHONPATH alone puts these before the test interpreter's own site-packages,
    not instead of them: a torchvision or torch the test did not install would be read there.
    """
    site.mkdir(parents=True)
    for name, version in installed.items():
        folder = dist_info(site, name, version)
        if name in from_files:
            quoted = version.replace("+", "%2B")
            wheel = f"file:///wheels/{name}-{quoted}-cp312-cp312-linux_x86_64.whl"
            direct_url = {"url": wheel, "archive_info": {}}
            (folder / "direct_url.json").write_text(json.dumps(direct_url))
    (site / "packaging").symlink_to(Path(packaging.__file__).parent)
    return {"FAKE_SITE": str(site), "REAL_PYTHON": sys.executable}


def dist_info(site: Path, name: str, version: str, *requires: str) -> Path:
    """An installed distribution as importlib.metadata reads it: its dist-info folder with a
    METADATA naming it, its version and its Requires-Dist lines."""
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
    lines += [f"Requires-Dist: {line}" for line in requires]
    (folder / "METADATA").write_text("\n".join(lines) + "\n")
    return folder


# A bash function for the stand-in uv of the GPU jobs' tests: what `uv pip install` and
# `uv pip uninstall` (its arguments, `pip` first) do to NIXL's distributions in $FAKE_SITE (a
# `stand_in_site`). Installing `nixl==V` writes nixl's dist-info and a `nixl-cuN` one for each N
# of $FAKE_NIXL_BRINGS, as nixl>=1.1 brings its CUDA variants (none: an older nixl, its
# libraries in its one wheel); `nixl-cuN==V` is installed for an N of $FAKE_NIXL_PUBLISHED and
# fails, as uv does, for any other; uninstalling `nixl-cuN` removes its dist-info. Anything else
# is left alone.
FAKE_UV_NIXL = r"""
fake_site_installed() {
  rm -rf "$FAKE_SITE/${1//-/_}"-*.dist-info
  mkdir -p "$FAKE_SITE/${1//-/_}-$2.dist-info"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$1" "$2" \
    > "$FAKE_SITE/${1//-/_}-$2.dist-info/METADATA"
}
fake_uv_nixl() {
  local arg name
  for arg in "$@"; do
    case "$2 $arg" in
      "uninstall nixl-cu"*) rm -rf "$FAKE_SITE/${arg//-/_}"-*.dist-info ;;
      "install nixl-cu"*==*)
        name=${arg%%==*}
        if [[ " $FAKE_NIXL_PUBLISHED " != *" ${name#nixl-cu} "* ]]; then
          echo "error: no version of $name satisfies $arg" >&2
          return 1
        fi
        fake_site_installed "$name" "${arg#*==}" ;;
      "install nixl=="*)
        fake_site_installed nixl "${arg#*==}"
        for major in $FAKE_NIXL_BRINGS; do fake_site_installed "nixl-cu$major" "${arg#*==}"; done ;;
    esac
  done
}
"""

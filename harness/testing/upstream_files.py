"""vLLM's upstream files as the harness finds them, for tests: a release's in the harness cache
as a fetch of its sdist leaves them, or a source tree; stand-ins for the proxies, and the
files a test needs (requirements/ files declaring a made-up NIXL)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.preflight import upstream_proxy


def write_tree(directory: Path, files: dict[str, str]) -> Path:
    """The proxies a release's files always have (stand-ins), and `files`."""
    stand_ins = {name: "# stand-in\n" for name in upstream_proxy.PROXY_FILES}
    for name, text in {**stand_ins, **files}.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return directory


def cached_release(cache: Path, release: str, files: dict[str, str]) -> Path:
    """A release's files in the harness cache as a fetch of its sdist leaves them."""
    directory = write_tree(cache / "vllm-proxy" / release, files)
    listed = [*upstream_proxy.PROXY_FILES, *files]
    record = {
        "origin": f"https://index.invalid/vllm-{release}.tar.gz sha256=0",
        "release": release,
        "files": listed,
        "sought": list(upstream_proxy.SOUGHT),
    }
    (directory / upstream_proxy.ORIGIN_FILE).write_text(json.dumps(record))
    return directory

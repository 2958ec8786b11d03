"""The exports of the vLLM bugs the harness found (docs/found-in-vllm.md) reproduce them with
vLLM alone.

One harness run through vLLM's own proxy records three matrix scenarios: the media in D's
recomputed tail (ERROR: D dies), JPEG-frame video at the default fps (MISMATCH) and the same
frames at 2 fps (MATCH: the control, without which an export that always fails would look
right). Each case is exported, copied to a scratch directory and run there by its own
`run.sh`, with a `PYTHONPATH` whose `harness` raises on import (so no process of the export can
use the harness) and check.py's exit code and evidence asserted; so is the unknown-uuid probe
(one request to D kills it). Afterwards nothing the export started may be running.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.cli.main import main

# Its run and the exports start topologies of their own, with the CLI's (cpu) defaults.
pytestmark = [pytest.mark.e2e, pytest.mark.own_instances]

SCENARIOS = (
    "epd-media-in-decode-tail",
    "ec-video-jpeg-frames-default-fps",
    "ec-video-jpeg-frames-at-2-fps",
)
RUN_TIMEOUT_S = 1800
MISSING_EMBEDDINGS = "Expected number of multimodal embeddings to match number of input items"


@dataclass(frozen=True)
class Repro:
    case: str
    probe: str | None
    exit_code: int
    evidence: tuple[str, ...]


REPROS = (
    Repro(
        "1E+1P+1D:m-image-short-text",
        None,
        2,
        (
            "ERROR: decode0 died during the request",
            MISSING_EMBEDDINGS,
            "recorded ERROR: reproduced",
        ),
    ),
    Repro(
        "1E+1P+1D:m-image-short-text",
        "unknown-uuid",
        2,
        ("ERROR: decode0 died during the request", MISSING_EMBEDDINGS, "HTTP 500"),
    ),
    Repro(
        "1E+1PD:m-video-jpeg-frames",
        None,
        1,
        ("MISMATCH: generated token ids differ at position", "recorded MISMATCH: reproduced"),
    ),
    Repro("1E+1PD:m-video-jpeg-frames-2fps", None, 0, ("MATCH: the 32 generated",)),
)


@pytest.fixture(scope="module")
def recorded_run(epd_run_dir: Path, epd_settings) -> Path:
    """The harness's run of the three scenarios through vLLM's proxy, each as declared."""
    bundle = epd_run_dir / "export-sources"
    code = main(
        [
            "run",
            "--scenario",
            ",".join(SCENARIOS),
            "--proxy",
            "vllm",
            "--vllm",
            epd_settings.vllm.executable,
            "--run-dir",
            str(bundle),
        ]
    )
    summary = json.loads((bundle / "summary.json").read_text())
    verdicts = {f"{c['topology']}:{c['prompt']}": c["verdict"] for c in summary["cases"]}
    assert code == 0, f"the scenarios did not behave as declared: {verdicts}"
    return bundle


def poisoned_pythonpath(root: Path) -> Path:
    package = root / "harness"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("raise ImportError('the export imported the harness')\n")
    return root


def port_variables(serve_sh: str) -> list[str]:
    return [line.split("=", 1)[0] for line in serve_sh.splitlines() if "_PORT=${" in line]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and proc.name != str(os.getpid()):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.parametrize(
    "repro", REPROS, ids=lambda r: f"{r.case}{'-' + r.probe if r.probe else ''}"
)
def test_the_export_reproduces_with_vllm_alone(
    recorded_run: Path, epd_settings, tmp_path: Path, repro: Repro, leased_ports
) -> None:
    made = tmp_path / "made"
    argv = ["export", str(recorded_run), "--case", repro.case, "--out", str(made)]
    assert main([*argv, *(["--probe", repro.probe] if repro.probe else [])]) == 0
    scratch = tmp_path / "scratch" / "export"
    shutil.copytree(made, scratch)
    shutil.rmtree(made)  # the scratch copy is all there is
    serve_sh = (scratch / "serve.sh").read_text()
    variables = port_variables(serve_sh)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "VLLM": epd_settings.vllm.executable,
        "PYTHONPATH": str(poisoned_pythonpath(tmp_path / "poison")),
        **dict(zip(variables, map(str, leased_ports(len(variables))))),
    }
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "run.sh"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    print(
        f"\n[export] {repro.case} {repro.probe or ''}: exit {done.returncode} in "
        f"{time.monotonic() - started:.0f}s\n{done.stdout[-4000:]}"
    )
    assert done.returncode == repro.exit_code, output[-6000:]
    for text in repro.evidence:
        assert text in done.stdout, f"{text!r} missing:\n{output[-6000:]}"
    assert "imported the harness" not in output
    time.sleep(1)
    assert processes_mentioning(str(scratch)) == [], "the export left processes running"
    for variable in variables:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", int(env[variable])))
            sock.listen()

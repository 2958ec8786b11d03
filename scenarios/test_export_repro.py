"""The exports of the vLLM bugs the harness found (docs/found-in-vllm.md) reproduce them with
vLLM alone.

Harness runs through vLLM's own proxy record three matrix scenarios: the media in D's
recomputed tail (ERROR: D dies; under ExampleConnector only, as NIXL hands D the whole prompt),
JPEG-frame video at the default fps (MISMATCH) and the same frames at 2 fps (MATCH: the
control, without which an export that always fails would look right). One run per topology's
xdist group (1E+1P+1D, 1E+1PD), on the session's options and the devices its plan gives that
group; on GPUs run.sh gets those devices as DEVICES, leased as the pool leases them. Each case is
exported, copied to a scratch directory and run there by its own `run.sh`, with a `PYTHONPATH` whose
`harness` raises on import (so no process of the export can use the harness) and check.py's exit
code and evidence asserted; so is the unknown-uuid probe (one request to D kills it). A clean
1E+1P+1D case judged against 1P+1D is exported too, and its `run.sh reference` serves 1P+1D there
first and judges the case against that answer. Afterwards nothing an export started may be running.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.testing.processes import (
    export_port_variables,
    export_ports_left,
    run_export_script,
)

# Its runs and the exports start topologies of their own (epd_own_instances).
pytestmark = [pytest.mark.e2e, pytest.mark.own_instances("run", "export")]

# The scenarios each recorded run holds, by the topology they run on.
SCENARIOS = {
    "1E+1P+1D": ("epd-media-in-decode-tail",),
    "1E+1PD": ("ec-video-jpeg-frames-default-fps", "ec-video-jpeg-frames-at-2-fps"),
}
RUN_TIMEOUT_S = 1800
MISSING_EMBEDDINGS = "Expected number of multimodal embeddings to match number of input items"
# The decode-tail case is red under ExampleConnector only: NIXL hands D the whole prompt's KV
# (its scenario's `expect_by_kv_connector`), so there is no failing case to export.
EXAMPLE_ONLY = ("example",)


@dataclass(frozen=True)
class Repro:
    case: str
    probe: str | None
    exit_code: int
    evidence: tuple[str, ...]
    kv_connectors: tuple[str, ...] = ()  # those it applies to (empty: every one)

    @property
    def topology(self) -> str:
        return self.case.split(":", 1)[0]

    def param(self):
        marks = [pytest.mark.epd_topology(self.topology)]
        if self.kv_connectors:
            marks.append(pytest.mark.kv_connector(*self.kv_connectors))
        return pytest.param(
            self, marks=marks, id=f"{self.case}{'-' + self.probe if self.probe else ''}"
        )


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
        EXAMPLE_ONLY,
    ),
    Repro(
        "1E+1P+1D:m-image-short-text",
        "unknown-uuid",
        2,
        ("ERROR: decode0 died during the request", MISSING_EMBEDDINGS, "HTTP 500"),
        EXAMPLE_ONLY,
    ),
    Repro(
        "1E+1PD:m-video-jpeg-frames",
        None,
        1,
        ("MISMATCH: generated token ids differ at position", "recorded MISMATCH: reproduced"),
    ),
    Repro("1E+1PD:m-video-jpeg-frames-2fps", None, 0, ("MATCH: the 32 generated",)),
)


RECORDED: dict[str, Path] = {}  # topology -> its recorded run, once per session


def recorded_run(topology: str, epd_run_dir: Path, epd_settings, own) -> Path:
    """The harness's run of `topology`'s scenarios through vLLM's proxy, each as declared."""
    if topology in RECORDED:
        return RECORDED[topology]
    bundle = epd_run_dir / f"export-sources-{topology}"
    code = main(
        [
            "run",
            "--scenario",
            ",".join(SCENARIOS[topology]),
            "--vllm",
            epd_settings.vllm.executable,
            "--run-dir",
            str(bundle),
            *own.args("run", proxy="vllm", topologies=(topology,)),
        ]
    )
    summary = json.loads((bundle / "summary.json").read_text())
    verdicts = {f"{c['topology']}:{c['prompt']}": c["verdict"] for c in summary["cases"]}
    assert code == 0, f"the scenarios did not behave as declared: {verdicts}"
    RECORDED[topology] = bundle
    return bundle


def poisoned_pythonpath(root: Path) -> Path:
    package = root / "harness"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("raise ImportError('the export imported the harness')\n")
    return root


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


@pytest.mark.parametrize("repro", [r.param() for r in REPROS])
def test_the_export_reproduces_with_vllm_alone(
    epd_run_dir: Path,
    epd_settings,
    epd_own_instances,
    tmp_path: Path,
    repro: Repro,
    leased_ports,
) -> None:
    recorded = recorded_run(repro.topology, epd_run_dir, epd_settings, epd_own_instances)
    made = tmp_path / "made"
    argv = ["export", str(recorded), "--case", repro.case, "--out", str(made)]
    argv += ["--probe", repro.probe] if repro.probe else []
    assert main([*argv, *epd_own_instances.args("export")]) == 0
    done = run_exported(made, (), tmp_path, epd_settings, epd_own_instances, leased_ports)
    print(f"[export] {repro.case} {repro.probe or ''}: exit {done.returncode}")
    output = done.stdout + done.stderr
    assert done.returncode == repro.exit_code, output[-6000:]
    for text in repro.evidence:
        assert text in done.stdout, f"{text!r} missing:\n{output[-6000:]}"


@pytest.mark.epd_topology("1E+1P+1D")
def test_run_sh_reference_serves_1p1d_there_and_judges_the_case_against_its_answer(
    epd_run_dir: Path,
    epd_settings,
    epd_own_instances,
    tmp_path: Path,
    leased_ports,
) -> None:
    """A case judged against 1P+1D (upstream's reference for 1E+1P+1D): `run.sh reference`
    serves 1P+1D with vLLM alone, keeps its answer, then serves the case and judges it against
    that answer and the recorded ids. A clean case, so every judgment here is a MATCH."""
    bundle = epd_run_dir / "export-reference-source"
    code = main(
        [
            "run",
            "--topology",
            "1P+1D,1E+1P+1D",
            "--prompt",
            "image",
            "--vllm",
            epd_settings.vllm.executable,
            "--run-dir",
            str(bundle),
            *epd_own_instances.args("run", topologies=("1P+1D", "1E+1P+1D")),
        ]
    )
    assert code == 0, (bundle / "verdicts.txt").read_text()
    made = tmp_path / "made"
    argv = ["export", str(bundle), "--case", "1E+1P+1D:image@1P+1D", "--out", str(made)]
    assert main([*argv, *epd_own_instances.args("export")]) == 0
    done = run_exported(
        made, ("reference",), tmp_path, epd_settings, epd_own_instances, leased_ports
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for text in (
        "the expected ids hold on this machine's 1P+1D",
        "against 1P+1D's answer produced here: MATCH",
        "against the recorded ids of 1P+1D: MATCH",
    ):
        assert text in done.stdout, f"{text!r} missing:\n{output[-6000:]}"


def run_exported(
    made: Path, mode: tuple[str, ...], tmp_path: Path, epd_settings, own, leased_ports
) -> subprocess.CompletedProcess[str]:
    """`run.sh` of the export in `made`, run from a scratch copy (the copy is all there is)
    with vLLM alone (a PYTHONPATH whose harness raises on import), its ports leased; afterwards
    nothing it started may run and every port is free again."""
    scratch = tmp_path / "scratch" / "export"
    shutil.copytree(made, scratch)
    shutil.rmtree(made)
    variables = export_port_variables((scratch / "serve.sh").read_text())
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "VLLM": epd_settings.vllm.executable,
        "PYTHONPATH": str(poisoned_pythonpath(tmp_path / "poison")),
        **dict(zip(variables, map(str, leased_ports(len(variables))))),
    }
    started = time.monotonic()
    with own.held_devices() as devices:
        if devices is not None:
            env["DEVICES"] = devices  # serve.sh's devices, by position: this group's
        # To its end; on a timeout or Ctrl-C every server it started is killed before the
        # devices are let go (subprocess.run's timeout killed bash alone).
        done = run_export_script(scratch, ["run.sh", *mode], env, RUN_TIMEOUT_S)
    print(f"\n[run.sh {' '.join(mode)}] {time.monotonic() - started:.0f}s\n{done.stdout[-4000:]}")
    assert "imported the harness" not in done.stdout + done.stderr
    time.sleep(1)
    assert processes_mentioning(str(scratch)) == [], "the export left processes running"
    ports = [int(env[variable]) for variable in variables]
    assert export_ports_left(scratch, ports) == [], "the export left ports held"
    return done

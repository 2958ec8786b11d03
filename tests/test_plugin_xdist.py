"""The pytest plugin under xdist (harness/testing/collection.py): a refusal made while a worker
collects (pytest.UsageError) is the session's, shown as one line, and what the workers deselect
is listed, as without xdist; a worker that replaces a crashed one picks its ports from the
crashed one's slice (harness/testing/worker_ports.py).

Real xdist sessions over the repository's scenarios, collected only (nothing starts), and one
over a test that crashes its worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testing.fake_nvidia_smi import T4, install_fake_nvidia_smi

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent


def pytest_in_repo(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`pytest -q ARGS` in the repository, as a user runs it (no cache written)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


@pytest.mark.parametrize("workers", [(), ("-n", "2")])
def test_a_refusal_made_while_workers_collect_is_the_sessions_usage_error(
    workers: tuple[str, ...],
) -> None:
    """Found with `--epd-topology 9Z -n 2`: each worker's collection raised the refusal, each
    worker ended, and the controller stopped on an INTERNALERROR ("Unexpectedly no active
    workers available", or an assertion of its scheduler), the cause shown nowhere."""
    done = pytest_in_repo(*workers, "-m", "e2e", "scenarios/test_matrix.py", "--epd-topology", "9Z")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-3000:]
    assert "INTERNALERROR" not in done.stdout + done.stderr, done.stdout[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ERROR: --epd-topology: unknown topology '9Z'"), lines


@pytest.mark.parametrize("workers", [(), ("-n", "2")])
@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("--epd-platform", "tpu", "unknown platform 'tpu'"),
        ("--epd-reference-policy", "sideways", "--epd-reference-policy sideways"),
        ("--epd-devices", "0,x", "--epd-devices"),
        ("--epd-model", "", "--epd-model '' is empty: give a value, or leave --epd-model out"),
        # vLLM's own "auto" picks per platform: refused, as `run --dtype` has no such choice.
        ("--epd-dtype", "auto", "--epd-dtype auto lets vLLM choose each instance's dtype"),
    ],
)
def test_a_bad_session_option_is_one_usage_error_naming_it(
    workers: tuple[str, ...], option: str, value: str, named: str
) -> None:
    """Found in review: a bad `--epd-*` value failed every e2e item, each with the same error,
    which named the CLI's flag (`--platform`), not the pytest option the user gave; and an
    empty one was read as unset (`--epd-model ""` served the default model)."""
    done = pytest_in_repo(
        "--collect-only",
        *workers,
        "-m",
        "e2e",
        "scenarios/test_epd_matches_baseline.py",
        option,
        value,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ERROR: epd-harness: {named}"), lines


@pytest.mark.parametrize("workers", [(), ("-n", "2")])
def test_a_session_its_preflight_refuses_stops_at_its_first_e2e_item(
    workers: tuple[str, ...],
) -> None:
    """What needs files (here a model directory that does not exist) is found by the first
    e2e item's preflight: it fails that item and stops the session (one per worker), rather
    than failing every e2e item with the same error."""
    done = pytest_in_repo(
        *workers,
        *("-m", "e2e", "scenarios/test_epd_matches_baseline.py"),
        *("--epd-model", "/nonexistent/epd-model"),
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith(("ERROR ", "FAILED "))]
    one_per_worker = int(workers[1]) if workers else 1
    assert 1 <= len(failed) <= one_per_worker, failed
    assert "Interrupted: epd-harness: model directory /nonexistent/epd-model" in out, out[-3000:]


@pytest.mark.parametrize(
    ("given", "asked"),
    [
        ((), "--epd-dtype bfloat16 (the default)"),
        (("--epd-dtype", "bfloat16"), "--epd-dtype bfloat16"),
    ],
    ids=["not-given", "given"],
)
def test_a_session_on_t4s_names_its_dtype_as_given(
    given: tuple[str, ...], asked: str, tmp_path: Path
) -> None:
    """A cuda session on a T4 box (a fake nvidia-smi) is refused by its first e2e item's
    preflight, which called a typed `--epd-dtype bfloat16` "the default" (found walking a T4
    box): --epd-dtype's default is now no dtype, served as bfloat16, as run's --dtype."""
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [T4, T4])
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tools}{os.pathsep}{env['PATH']}"
    done = pytest_in_repo(
        *("-m", "e2e", "scenarios/test_epd_matches_baseline.py", "--epd-platform", "cuda"),
        *("--epd-devices", "0,1", "--epd-topology", "1P+1D", *given),
        env=env,
    )
    assert done.returncode != 0, done.stdout[-3000:]
    assert (
        f"Interrupted: epd-harness: {asked} needs compute capability 8.0 or more" in done.stdout
    ), done.stdout[-3000:]
    assert "pass --epd-dtype float16" in done.stdout


CRASHING_WORKER_CONFTEST = """
import os
from pathlib import Path

pytest_plugins = ["harness.testing.worker_ports"]

def pytest_sessionstart(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # every worker, the one that replaces a crashed worker too
        with Path(os.environ["SLICES_OUT"]).open("a") as out:
            out.write(f"{worker} {os.environ['EPD_HARNESS_PORT_RANGE']}\\n")
"""

CRASHING_WORKER_TESTS = """
import os
from pathlib import Path

def test_crashes_its_worker():
    with Path(os.environ["SLICES_OUT"]).open("a") as out:
        out.write(f"crashed {os.environ['PYTEST_XDIST_WORKER']}\\n")
    os._exit(1)
"""


def test_a_worker_replacing_a_crashed_one_takes_its_slice(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xdist replaces a crashed worker with one of a new id (gw2 of 2 workers): its slice was
    the third of two, 30000-34999 past the job's 20000-29999 (another job's ports), and past
    65535 after a few crashes. It takes the lowest slice no live worker holds: the crashed
    one's, or the other's if that one had finished meanwhile (seen in a fresh-clone CI run:
    gw0, with nothing to run, was down before gw2 started), always one of the job's slices."""
    from harness.environment import PORT_RANGE_ENV, parse_port_range

    out = pytester.path / "slices.txt"
    monkeypatch.setenv("SLICES_OUT", str(out))
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-29999")
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "EPD_HARNESS_PORT_SLICE_OF"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest(CRASHING_WORKER_CONFTEST)
    pytester.makepyfile(test_crash=CRASHING_WORKER_TESTS)
    pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    lines = [line.split() for line in out.read_text().splitlines()]
    [crashed] = [worker for word, worker in lines if word == "crashed"]
    slices = {word: parse_port_range(value) for word, value in lines if word != "crashed"}
    assert set(slices) == {"gw0", "gw1", "gw2"}, lines  # gw2 replaced the crashed one
    [alive] = {"gw0", "gw1"} - {crashed}
    for worker, ports in slices.items():
        assert ports.start >= 20000 and ports.stop <= 30000, (worker, ports)
    assert slices["gw2"] in (slices[crashed], slices[alive]), slices


SHARED_ROOT_CONFTEST = """
import os
from pathlib import Path

from harness.testing.session_account import RUN_ROOT_KEY

pytest_plugins = ["harness.testing.plugin"]

def pytest_addoption(parser):
    parser.addoption("--epd-platform", default="cpu")
    parser.addoption("--epd-run-dir", default=None)

def pytest_sessionstart(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        (Path(session.config.stash[RUN_ROOT_KEY]) / f"{worker}.txt").write_text(worker)
"""


def test_every_worker_writes_under_the_run_root_the_controller_made(
    pytester: pytest.Pytester,
) -> None:
    """The controller makes the session's runs/pytest-<time> and hands it to its workers: a
    worker that made a root of its own wrote its bundle where the summary, reading the
    controller's root, never looked (and each worker cleared its own of earlier accounts)."""
    pytester.makeconftest(SHARED_ROOT_CONFTEST)
    pytester.makepyfile(test_pass="def test_pass():\n    pass\n")
    pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    [root] = (pytester.path / "runs").iterdir()
    assert sorted(p.name for p in root.iterdir()) == ["gw0.txt", "gw1.txt"]


DESELECTING_CONFTEST = """
pytest_plugins = ["harness.testing.plugin"]

def pytest_addoption(parser):
    parser.addoption("--epd-platform", default="cpu")
    parser.addoption("--epd-kv-connector", default=None)
"""

NIXL_ONLY_TESTS = """
import pytest

@pytest.mark.e2e
@pytest.mark.kv_connector("nixl")
def test_nixl_only():
    pass

def test_pure_logic():
    pass
"""


@pytest.mark.parametrize("workers", [(), ("-n", "2")])
def test_a_deselection_is_listed_under_xdist_too(
    pytester: pytest.Pytester, workers: tuple[str, ...]
) -> None:
    """Found in review: the workers collect and deselect under xdist, and the controller, which
    prints the session's lines, collects nothing: an item of another KV connector was gone
    without a line ("1 passed", not even "1 deselected"). The controller lists what its
    workers deselected."""
    pytester.makeconftest(DESELECTING_CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_nixl=NIXL_ONLY_TESTS)
    done = pytester.runpytest_subprocess(*workers, "-p", "no:cacheprovider")
    done.assert_outcomes(passed=1)
    out = done.stdout.str()
    assert out.count("epd-harness: 1 test(s) deselected: they apply to another KV connector") == 1
    assert out.count("  test_nixl.py::test_nixl_only (needs nixl)") == 1, out

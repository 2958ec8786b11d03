"""`versions` and `bisect` through their real child runs: each release's `epd-harness run` is
started as the commands start it, on the fake vLLM standing in for a release venv's (no venv
is built, no real vLLM starts). tests/test_versions.py fakes the child run itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.process


@pytest.fixture
def fake_releases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every release's venv is one holding the fake vLLM (this environment's version, so the
    releases share a baseline cache key). The harness cache is the test's own (bisect passes
    no --baseline-cache: the fake's answers would go into the user's baseline cache and
    goldens), with the user's tiny model in it."""
    from harness.cli import versions
    from harness.cli.releases import ReleaseEnv
    from harness.environment import CACHE_ENV, cache_dir
    from harness.testing.fake_vllm import install_fake_vllm

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_dir() / "models")
    monkeypatch.setenv(CACHE_ENV, str(cache))

    def release(version: str) -> tuple[ReleaseEnv, float]:
        env = ReleaseEnv(version, tmp_path / "venvs" / version)
        if not env.vllm.exists():
            install_fake_vllm(env.vllm.parent)
        return env, 0.0

    monkeypatch.setattr(versions, "ensure_release", release)
    monkeypatch.setattr(versions, "check_disk_for", lambda _versions: None)


@pytest.mark.usefixtures("served_vllm_parser", "fake_releases")  # the child runs' lines judged
def test_each_releases_run_serves_the_dtype_asked_its_baseline_too(
    epd_cli, tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    from harness.testing.fake_vllm import logged_starts

    def started() -> list[tuple[str, str]]:
        """(role, dtype) of every instance started so far."""
        return [
            (start["role"], start["launch"][start["launch"].index("--dtype") + 1])
            for start in logged_starts(fake_vllm_start_log)
        ]

    run_dir = tmp_path / "v"
    case = ("--topology", "1P+1D", "--prompt", "text")
    code, out, err = epd_cli(
        "versions", "0.32.0", *case, "--dtype", "float32", "--run-dir", run_dir
    )
    assert code == 0, out + err
    assert sorted(started()) == [
        ("baseline", "float32"),
        ("decode", "float32"),
        ("prefill", "float32"),
    ]
    run = json.loads((run_dir / "0.32.0" / "run.json").read_text())
    assert run["serving"]["dtype"] == "float32"
    assert "| 1P+1D / text | MATCH |" in out and "| dtype | float32 |" in out, out
    # A float16 bisect of that case in the same --run-dir: the float32 sweep answers neither
    # end, nor does the float32 baseline in the cache; each end runs in float16 apart from it.
    code, out, err = epd_cli(
        "bisect", "1P+1D:text", "--good", "0.32.0", "--bad", "0.31.0", "--dtype", "float16",
        "--run-dir", run_dir,
    )  # fmt: skip
    assert code == 1, out + err  # both ends MATCH
    assert "bisect: 1P+1D:text in float16: 0.32.0 and 0.31.0 agree (MATCH)" in out, out
    for version in ("0.32.0", "0.31.0"):
        own = run_dir / "bisect-1P-1D-text-float16" / version / "run.json"
        assert json.loads(own.read_text())["serving"]["dtype"] == "float16"
    # One float16 baseline: the second end (the same fake version) takes it from the cache.
    assert sorted(started()[3:]) == [
        ("baseline", "float16"),
        ("decode", "float16"),
        ("decode", "float16"),
        ("prefill", "float16"),
        ("prefill", "float16"),
    ]


@pytest.mark.usefixtures("served_vllm_parser", "fake_releases")
def test_an_interrupted_versions_lets_its_releases_run_stop_its_servers(
    epd_cli, tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """SIGTERM to `versions` (CI cancelling it) while a release's run serves: the run is told
    and stops its servers itself before `versions` exits 130. subprocess.run SIGKILLed it a
    quarter of a second after the interrupt, so the run never stopped a server (its console
    said nothing) and they were left to the parent-death signal (found in review)."""
    import os
    import signal
    import threading

    import psutil

    from harness.testing.fake_vllm import logged_starts
    from harness.testing.processes import survivors, wait_for

    def interrupt_once_serving() -> None:
        wait_for(lambda: logged_starts(fake_vllm_start_log), "the release's baseline to start", 60)
        os.kill(os.getpid(), signal.SIGTERM)

    interrupter = threading.Thread(target=interrupt_once_serving, daemon=True)
    interrupter.start()
    run_dir = tmp_path / "v"
    code, out, err = epd_cli(
        "versions", "0.32.0", "--topology", "1P+1D", "--prompt", "text", "--run-dir", run_dir
    )
    interrupter.join()
    assert code == 130, out + err
    console = (run_dir / "0.32.0.console.log").read_text()
    assert "epd-harness: interrupted (received SIGTERM)" in console, console
    assert "every server was stopped" in console, console
    # Its own line says which run it cut short and where that run said what it stopped (real
    # vLLM: "interrupted (received SIGTERM) before any server was running", the release's
    # baseline ready at the time).
    assert (
        f"epd-harness: interrupted (received SIGTERM) during vLLM 0.32.0's run, which "
        f"stopped its own servers (its console: {run_dir / '0.32.0.console.log'})" in err
    ), err
    assert f"artifacts in {run_dir}" in err, err
    ours = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or ())
    ]
    assert survivors(ours, timeout_s=5) == []

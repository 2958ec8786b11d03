"""An export's run.sh / serve.sh / check.py as processes, on fake servers
(harness/testing/fake_vllm.py and a stand-in proxy): what each exit code means, a death named,
nothing left running, and the harness never imported. Whether the exports reproduce vLLM's failures
is e2e (scenarios/test_export_repro.py): a fake only shows that the scripts handle processes right.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from export_bundle import BASELINE_IDS, PROMPT, PROMPT_IDS, REPAIR, plan_for, write, write_bundle

from harness.run.export.files import write_export
from harness.run.export.issue import render_issue
from harness.run.export.plan import plan_export
from harness.run.export.probe import UNKNOWN_UUID_PROBE
from harness.run.export.proxy import UpstreamProxy
from harness.run.repro import Bundle
from harness.testing.fake_vllm import MODE_ENV, install_fake_vllm
from harness.testing.processes import (
    ctrl_c,
    export_ports_left,
    ignores_sigint,
    run_export_script,
    sigint_as_at_a_terminal,
    sigint_ignored_as_in_a_backgrounded_run,
)

pytestmark = pytest.mark.process
TakePorts = Callable[[int], list[int]]  # the leased_ports fixture (harness_test_fixtures.py)
RUN_TIMEOUT_S = 120


def poisoned_harness(root: Path) -> Path:
    """A PYTHONPATH entry whose `harness` raises on import: any process of the export that
    imported the harness would fail loudly."""
    package = root / "poison" / "harness"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the export imported the harness')\n")
    return package.parent


def export_case(tmp_path: Path, verdict: str = "ERROR", probe: str | None = None) -> Path:
    bundle = Bundle.load(write_bundle(tmp_path / "run", verdict=verdict))
    upstream = UpstreamProxy(Path(bundle.run["proxy"]["files_dir"]), "a stand-in proxy")
    plan = plan_export(bundle, f"1E+1P+1D:{PROMPT}", lambda: upstream, probe)
    out = tmp_path / "scratch" / plan.name
    write_export(plan, out, {"cpu_repair.py": "print('no repairs needed here')\n"})
    return out


def environment(leased_ports: TakePorts, tmp_path: Path, modes: str = "") -> dict[str, str]:
    fake = install_fake_vllm(tmp_path / "bin")
    # The NIXL side channels too: left at the export's defaults, two workers' GPU exports
    # clashed on 18202 ("something already answers on 127.0.0.1:18202").
    ports = leased_ports(6)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "VLLM": str(fake),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(poisoned_harness(tmp_path)),
        "CPU_REPAIR": "no",
        "STOP_TIMEOUT": "3",
        "STARTUP_TIMEOUT": "60",
        "PROXY_PORT": str(ports[0]),
        "ENCODER0_PORT": str(ports[1]),
        "PREFILL0_PORT": str(ports[2]),
        "DECODE0_PORT": str(ports[3]),
        "PREFILL0_NIXL_PORT": str(ports[4]),
        "DECODE0_NIXL_PORT": str(ports[5]),
        MODE_ENV: modes,
    }


def run_script(
    out: Path, argv: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """`bash <export>/<argv...>` to its end; on a timeout nothing it started is left
    (`run_export_script`)."""
    return run_export_script(out, argv, env, timeout)


def run_sh(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_script(out, ["run.sh"], env)


def assert_nothing_left(out: Path, env: dict[str, str]) -> None:
    """Every server serve.sh started (its pid files) is gone, and every port is free again."""
    pids = [int(p.read_text()) for p in (out / "work/state").glob("*.pid")]
    assert pids, "serve.sh recorded no process"
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if pid_alive(pid)]
        time.sleep(0.1)
    assert alive == [], f"left running: {alive}"
    names = ("PROXY_PORT", "ENCODER0_PORT", "PREFILL0_PORT", "DECODE0_PORT")
    assert export_ports_left(out, [int(env[name]) for name in names]) == []


def pid_alive(pid: int) -> bool:
    """Running (a zombie left for a parent or PID 1 to reap counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_matching_answer_exits_0(tmp_path: Path, leased_ports: TakePorts) -> None:
    out = export_case(tmp_path, verdict="MATCH")
    env = environment(leased_ports, tmp_path)
    done = run_sh(out, env)
    assert done.returncode == 0, done.stdout + done.stderr
    matched = f"the 4 generated and {len(PROMPT_IDS)} prompt token ids equal the expected ones"
    assert f"MATCH: {matched}" in done.stdout
    assert "the harness (run run) recorded MATCH: reproduced" in done.stdout
    assert "imported the harness" not in done.stdout + done.stderr
    assert_nothing_left(out, env)


def test_run_sh_past_its_timeout_leaves_no_server_running(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The e2e export scenario ran run.sh with subprocess.run(timeout=...), which kills bash
    alone: serve.sh and every server (each in a session of its own) kept serving, and on GPUs
    the test then let go of the devices they held (found in review). The shared runner kills
    every group run.sh started before it fails the test."""
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "decode:hang")  # the answer never comes
    log = out / "work/logs/decode0.log"

    def serving() -> bool:  # D has the request, which it never answers
        return log.is_file() and "REQUEST" in log.read_text()

    # The timeout counts from there: a fixed 20 s covered a start on a loaded host and was
    # spent whole every time.
    with pytest.raises(AssertionError, match="run.sh still ran after 1 s"):
        run_export_script(out, ["run.sh"], env, timeout=1, counted_from=serving)
    assert "REQUEST" in log.read_text(), "the servers never served: the timeout proves nothing"
    servers = [int(p.read_text()) for p in (out / "work/state").glob("*.pid")]
    assert len(servers) == 4, servers
    deadline = time.monotonic() + 5
    while (alive := [p for p in servers if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == [], f"left serving after run.sh's timeout: {alive}"


def test_a_death_during_the_request_exits_2_naming_the_instance(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "decode:die-request")
    done = run_sh(out, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ERROR: decode0 died during the request" in done.stdout
    assert "fake engine core died on a request (chaos-9e2a)" in done.stdout
    assert "recorded ERROR: reproduced" in done.stdout
    assert "decode0 exited with code 0" in done.stdout + done.stderr  # serve.sh noticed too
    # serve.sh's own tail of D's log shows the assertion, not only nanobind's leak report at
    # exit (real vLLM: 20 lines of it were all serve.sh showed of D's death).
    assert "chaos-9e2a" in done.stderr and "leaked function" not in done.stderr, done.stderr
    assert "lines of nanobind's leak report at exit left out]" in done.stderr, done.stderr
    assert_nothing_left(out, env)


def test_different_ids_exit_1_with_the_first_divergence(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = export_case(tmp_path, verdict="MISMATCH")
    path = out / "expected.json"
    expected = json.loads(path.read_text())
    expected["token_ids"][1] = 80  # the fake answers BASELINE_IDS
    path.write_text(json.dumps(expected))
    env = environment(leased_ports, tmp_path)
    done = run_sh(out, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISMATCH: generated token ids differ at position 1" in done.stdout
    assert f"expected 80, got {BASELINE_IDS[1]}" in done.stdout
    assert_nothing_left(out, env)


def test_another_instance_dying_is_not_the_recorded_error_reproduced(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The bundle recorded prefill0's death; here decode0 dies. `epd-harness repro` calls that
    another failure (`another_failure`); check.py said "recorded ERROR: reproduced" on the
    verdict alone (found in review). Its exit code still says what happened here: an error."""
    bundle_dir = write_bundle(tmp_path / "run")
    for name in ("summary.json", "responses.json"):
        path = bundle_dir / name
        path.write_text(path.read_text().replace("1E+1P+1D/decode0", "1E+1P+1D/prefill0"))
    bundle = Bundle.load(bundle_dir)
    upstream = UpstreamProxy(Path(bundle.run["proxy"]["files_dir"]), "a stand-in proxy")
    plan = plan_export(bundle, f"1E+1P+1D:{PROMPT}", lambda: upstream)
    out = tmp_path / "scratch" / plan.name
    write_export(plan, out, {"cpu_repair.py": "print('no repairs needed here')\n"})
    env = environment(leased_ports, tmp_path, "decode:die-request")
    done = run_sh(out, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ERROR: decode0 died during the request" in done.stdout
    assert (
        "recorded ERROR: NOT reproduced (decode0 died now, prefill0 in the recording)"
        in done.stdout
    ), done.stdout
    assert_nothing_left(out, env)


def test_prompt_ids_parting_where_generated_ids_did_is_not_reproduced(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The bundle recorded generated ids parting; here the prompt ids do (a processor that
    sizes the placeholders otherwise): another failure, as `epd-harness repro` says, where
    check.py said "recorded MISMATCH: reproduced" (found in review)."""
    out = export_case(tmp_path, verdict="MISMATCH")
    path = out / "expected.json"
    expected = json.loads(path.read_text())
    expected["prompt_token_ids"] = [*expected["prompt_token_ids"], 5]
    path.write_text(json.dumps(expected))
    env = environment(leased_ports, tmp_path)
    done = run_sh(out, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISMATCH: prompt token ids differ" in done.stdout
    assert (
        "recorded MISMATCH: NOT reproduced (prompt ids, another count now, generated ids "
        "in the recording)" in done.stdout
    ), done.stdout
    assert_nothing_left(out, env)


def test_an_instance_that_dies_while_starting_fails_the_start(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "prefill:die-start")
    done = run_sh(out, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "prefill0 exited while starting" in done.stdout
    assert "chaos-7c1d" in done.stderr  # its log tail
    assert "serve.sh could not start everything" in done.stderr
    assert_nothing_left(out, env)


def test_the_probe_goes_to_the_consumer_alone(tmp_path: Path, leased_ports: TakePorts) -> None:
    out = export_case(tmp_path, probe=UNKNOWN_UUID_PROBE)
    env = environment(leased_ports, tmp_path, "decode:serve-anything")
    done = run_sh(out, env)
    # Told to, the fake answers with 200 what it cannot serve (embeddings it never got).
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISMATCH: decode0 answered a request it cannot serve" in done.stdout
    assert [p.name for p in (out / "work/state").glob("*.pid")] == ["decode0.pid"]
    assert_nothing_left(out, env)


def test_run_sh_baseline_checks_the_expected_ids_on_a_monolithic_server(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = export_case(tmp_path, verdict="MISMATCH")
    env = {
        **environment(leased_ports, tmp_path, "decode:die-request"),
        "BASELINE0_PORT": str(leased_ports(1)[0]),
    }
    done = run_script(out, ["run.sh", "baseline"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the expected ids hold on this machine's monolithic vLLM" in done.stdout
    assert [p.name for p in (out / "work/state").glob("*.pid")] == ["baseline0.pid"]
    assert_nothing_left(out, env)


def start_script(
    out: Path, script: str, env: dict[str, str], **popen: Any
) -> subprocess.Popen[str]:
    """The export's `script` (serve.sh, run.sh) under bash in a session of its own, its
    output captured."""
    return subprocess.Popen(
        ["bash", str(out / script)],
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def serving(out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """serve.sh in a session of its own, as from a terminal, once everything it starts
    answers."""
    with sigint_ignored_as_in_a_backgrounded_run():  # shows the reset, however pytest started
        serve = start_script(out, "serve.sh", env, preexec_fn=sigint_as_at_a_terminal)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (out / "work/state/ready").exists():
        if serve.poll() is not None or time.monotonic() > deadline:
            if serve.poll() is None:
                os.killpg(serve.pid, signal.SIGKILL)
            raise AssertionError(f"serve.sh did not get ready: {serve.communicate()[0]}")
        time.sleep(0.2)
    return serve


def test_serve_sh_stops_every_group_on_sigterm_even_a_server_that_ignores_it(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "encoder:fork-child;decode:ignore-term")
    serve = serving(out, env)
    try:
        log = (out / "work/logs/encoder0.log").read_text()
        child = int(log.split("CHILD ")[1].split()[0])
        assert pid_alive(child)
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        output = serve.communicate(timeout=30)[0]
        assert serve.returncode == 143, output
        assert "decode0 did not stop within 3s of SIGTERM: killed" in output
        assert time.monotonic() - started < 10
        assert not pid_alive(child), "the engine-core stand-in outlived its group"
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_serve_sh_stop_signals_no_server_it_already_saw_exit(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """A server that exited while serving was reaped and reported (its `.exit`), yet the stop
    sent SIGTERM and SIGKILL to its pid and group all the same: by then the kernel may have
    given that pid to an unrelated process (found in review). Every `kill` serve.sh runs is
    logged (a `kill` function read from BASH_ENV); a probe (`kill -0`) signals nothing."""
    kills = tmp_path / "kills.log"
    wrapper = tmp_path / "log-kills.sh"
    wrapper.write_text(
        'kill() { [[ " $* " == *" -0 "* ]] || printf \'%s\\n\' "$*" >>"$KILL_LOG"; '
        'builtin kill "$@"; }\n'
    )
    out = export_case(tmp_path)
    env = {**environment(leased_ports, tmp_path), "BASH_ENV": str(wrapper), "KILL_LOG": str(kills)}
    serve = serving(out, env)
    try:
        decode = int((out / "work/state/decode0.pid").read_text())
        os.killpg(decode, signal.SIGKILL)  # D dies while serving: serve.sh reports its exit
        deadline = time.monotonic() + 30
        while not (out / "work/state/decode0.exit").exists():
            assert serve.poll() is None and time.monotonic() < deadline, "D's exit unreported"
            time.sleep(0.1)
        serve.send_signal(signal.SIGTERM)
        output = serve.communicate(timeout=30)[0]
        assert serve.returncode == 143, output
        targets = {str(decode), f"-{decode}"}
        signalled = [line for line in kills.read_text().splitlines() if targets & {*line.split()}]
        assert signalled == [], f"the stop signalled D's reaped pid {decode}: {signalled}"
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_what_is_left_of_a_server_that_exited_is_killed_when_its_exit_is_seen(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The stop no longer signals a server seen exit (its pid may be another's by then), so
    what its group left (vLLM's engine core, on a GPU) is killed when the exit is seen."""
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "encoder:fork-child")
    serve = serving(out, env)
    try:
        child = int((out / "work/logs/encoder0.log").read_text().split("CHILD ")[1].split()[0])
        os.kill(int((out / "work/state/encoder0.pid").read_text()), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (out / "work/state/encoder0.exit").exists():
            assert serve.poll() is None and time.monotonic() < deadline, "E's exit unreported"
            time.sleep(0.1)
        deadline = time.monotonic() + 5  # SIGKILL was sent; its delivery takes a moment
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the engine-core stand-in outlived its server's exit"
        serve.send_signal(signal.SIGTERM)
        output = serve.communicate(timeout=30)[0]
        assert "killed what was left of encoder0's process group" in output
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_check_after_serve_sh_stopped_says_nothing_serves_not_that_the_case_reproduced(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """`bash serve.sh` in one terminal, `python3 check.py` in another (ISSUE.md): once serve.sh
    was stopped, its endpoints.tsv named servers it had stopped itself. check.py sent the
    request to them, waited for each to exit, called every instance "died during the request"
    and a recorded ERROR "reproduced" (found in review). It says nothing serves, at once."""
    out = export_case(tmp_path)  # recorded ERROR
    env = environment(leased_ports, tmp_path)
    serve = serving(out, env)
    try:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 143
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-I", str(out / "check.py"), "--state", str(out / "work/state")],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert "reproduced" not in done.stdout and "died" not in done.stdout, done.stdout
        assert "is serve.sh serving?" in done.stderr
        assert time.monotonic() - started < 5
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_a_ctrl_c_reaches_only_a_script_started_as_at_a_terminal() -> None:
    """Under a pytest started in the background (the fresh-clone CI run: `.ci/run` from a
    script's `cmd &`) every child inherits SIGINT ignored, and bash cannot trap a signal
    ignored on entry: `run.sh reference` served on after the Ctrl-C test's SIGINT, and the test
    only timed out, twice, with no word why (it passed whenever pytest was a terminal's
    foreground job). The Ctrl-C tests start their scripts inside that condition, reset by
    sigint_as_at_a_terminal; a script that still ignores SIGINT is refused at once, by name."""
    sleeper = ["sleep", "30"]
    before = signal.getsignal(signal.SIGINT)
    with sigint_ignored_as_in_a_backgrounded_run():
        plain = subprocess.Popen(sleeper, start_new_session=True)
        reset = subprocess.Popen(
            sleeper, start_new_session=True, preexec_fn=sigint_as_at_a_terminal
        )
    try:
        assert signal.getsignal(signal.SIGINT) == before  # put back
        assert (ignores_sigint(plain.pid), ignores_sigint(reset.pid)) == (True, False)
        with pytest.raises(AssertionError, match=f"process {plain.pid} ignores SIGINT"):
            ctrl_c(plain.pid)
        ctrl_c(reset.pid)
        assert reset.wait(timeout=10) == -signal.SIGINT
    finally:
        for child in (plain, reset):
            child.kill()
            child.wait()


def test_a_second_ctrl_c_while_serve_sh_stops_still_kills_what_ignores_sigterm(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """Ctrl-C at the terminal (the whole foreground group); D ignores SIGTERM, as vLLM does
    while its engine starts, nothing seems to happen, so Ctrl-C again within STOP_TIMEOUT.
    Found in review: serve.sh dropped its traps first, the second SIGINT ended it before its
    SIGKILL, and D, in a session of its own, kept running."""
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "decode:ignore-term")
    serve = serving(out, env)  # its group stands for the terminal's foreground job
    try:
        ctrl_c(serve.pid)
        time.sleep(1)  # within STOP_TIMEOUT (3 s): serve.sh waits for D
        os.killpg(serve.pid, signal.SIGINT)
        output = serve.communicate(timeout=30)[0]
        assert serve.returncode == 130, output
        assert "decode0 did not stop within 3s of SIGTERM: killed" in output
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        for pid_file in (out / "work/state").glob("*.pid"):  # what a failure here left
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)


class Stranger(http.server.BaseHTTPRequestHandler):
    """Another server on an instance's port: healthy, and answers chat with other ids."""

    def do_GET(self) -> None:
        self.reply({})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply({"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": [99]}]})

    def reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_a_port_another_server_answers_on_fails_the_start_not_the_case(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """serve.sh calls an instance ready when its URL answers; vLLM binds its port only after
    seconds of imports, so a server already on that port would answer for it and be judged.
    Found in review: a stranger on D's port gave "MISMATCH ... NOT reproduced"."""
    out = export_case(tmp_path, verdict="MATCH")
    env = environment(leased_ports, tmp_path, "decode:slow-start=30")
    stranger = http.server.ThreadingHTTPServer(("127.0.0.1", int(env["DECODE0_PORT"])), Stranger)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        done = run_sh(out, env)
    finally:
        stranger.shutdown()
        stranger.server_close()
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "MISMATCH" not in output
    assert f"decode0: something already answers on http://127.0.0.1:{env['DECODE0_PORT']}" in (
        output
    )
    assert_nothing_left(out, env)


def test_a_work_directory_with_a_quote_or_backslash_still_configures_the_connectors(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The connectors' storage path is `$WORK` inside a JSON argument: a `"` or `\\` in it
    (an export unpacked under `bug "epd"/`) was pasted into the JSON as is, and every
    instance with a connector died at start on a JSONDecodeError (found in review)."""
    out = export_case(tmp_path, verdict="MATCH")
    env = environment(leased_ports, tmp_path)
    env["WORK"] = str(tmp_path / 'bug "epd" \\ work')
    done = run_sh(out, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MATCH: the 4 generated" in done.stdout


def test_a_vllm_reached_through_a_symlink_runs_the_proxy_with_its_own_python(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """`uv tool install vllm` and pipx put a symlink to the venv's `vllm` on PATH: the scripts
    looked for `python` beside the symlink, found none, and ran vLLM's proxy and the checks
    with the system's python3, which lacks vLLM's packages (found in review)."""
    out = export_case(tmp_path, verdict="MATCH")
    env = environment(leased_ports, tmp_path)
    on_path = tmp_path / "local-bin"
    on_path.mkdir()
    (on_path / "vllm").symlink_to(env.pop("VLLM"))
    env.pop("PYTHON")
    bare = tmp_path / "system-bin"
    bare.mkdir()
    python3 = bare / "python3"
    python3.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'fastapi'\" >&2\nexit 1\n"
    )
    python3.chmod(0o755)
    env["PATH"] = f"{on_path}:{bare}:{env['PATH']}"
    done = run_sh(out, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MATCH: the 4 generated" in done.stdout


# -- moved from test_export.py: they run bash or python --------------------------------


def test_the_shell_scripts_parse(tmp_path: Path) -> None:
    out = write(tmp_path)
    for script in ("serve.sh", "run.sh"):
        checked = subprocess.run(["bash", "-n", str(out / script)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{script}: {checked.stderr}"


@pytest.mark.parametrize(
    "version, refused", [((3, 2), True), ((4, 3), True), ((4, 4), False), ((5, 2), False)]
)
def test_serve_sh_refuses_a_bash_older_than_4_4_in_one_line(
    tmp_path: Path, version: tuple[int, int], refused: bool
) -> None:
    """macOS's bash 3.2 has no associative arrays, and bash before 4.4 calls an empty array
    unbound under `set -u`: either would stop serve.sh half-way. BASH_VERSINFO is read-only,
    so the guard runs with the version in another array."""
    serve = (write(tmp_path) / "serve.sh").read_text()
    start = serve.index("if ((BASH_VERSINFO")
    guard = serve[start : serve.index("\nfi\n", start) + 3].replace("BASH_VERSINFO", "V")
    script = f"V=({version[0]} {version[1]})\nBASH_VERSION={version[0]}.{version[1]}\n{guard}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.returncode == (2 if refused else 0), done.stderr
    expected = f"serve.sh: needs bash 4.4 or newer; this is bash {version[0]}.{version[1]}\n"
    assert done.stderr == (expected if refused else "")


def test_a_small_model_is_copied_a_hub_snapshot_is_named(tmp_path: Path) -> None:
    out = write(tmp_path)
    assert (out / "model/model.safetensors").stat().st_size == 1024
    assert not (out / "model/.complete").exists()
    snapshot = "/hub/models--Qwen--Qwen2.5-VL-3B-Instruct/snapshots/0123abcd"
    plan = plan_for(write_bundle(tmp_path / "hub", model=snapshot))
    assert (plan.model.hub_name, plan.model.hub_revision) == (
        "Qwen/Qwen2.5-VL-3B-Instruct",
        "0123abcd",
    )
    assert "hf download Qwen/Qwen2.5-VL-3B-Instruct --revision 0123abcd" in (render_issue(plan))
    hub_out = tmp_path / "hub-export"
    write_export(plan, hub_out, REPAIR)
    assert not (hub_out / "model").exists()
    serve = (hub_out / "serve.sh").read_text()
    assert (
        "snapshot_download(sys.argv[1], revision=sys.argv[2]))' Qwen/Qwen2.5-VL-3B-Instruct 0123abcd"
        in serve
    )
    parsed = subprocess.run(
        ["bash", "-n", str(hub_out / "serve.sh")], capture_output=True, text=True
    )
    assert parsed.returncode == 0, parsed.stderr


def test_check_without_serve_state_is_an_error_in_one_line(tmp_path: Path, capsys) -> None:
    out = write(tmp_path)
    done = subprocess.run(
        [sys.executable, "-I", str(out / "check.py"), "--state", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "is serve.sh serving?" in done.stderr


def test_an_answer_cut_off_mid_body_is_an_error_naming_the_death_not_a_difference(
    tmp_path: Path,
) -> None:
    """A server that dies while it sends its answer (headers out, the body cut short) made
    urllib raise http.client.IncompleteRead, no OSError: check.py ended in a traceback with
    exit 1, which run.sh reads as "a difference", and the death went unnamed (found in
    review). It is no answer: exit 2, the instance that died named."""
    out = write(tmp_path)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def answer_half_and_die() -> None:
        connection, _ = listener.accept()
        connection.recv(1 << 20)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"prompt_token_ids": ['
        )
        connection.close()
        listener.close()  # its /health no longer answers

    server = threading.Thread(target=answer_half_and_die, daemon=True)
    server.start()
    state = tmp_path / "state"
    state.mkdir()
    log = tmp_path / "decode0.log"
    log.write_text("AssertionError: the engine core died mid-answer\n")
    (state / "endpoints.tsv").write_text(
        f"mode\tcase\nentry\t{url}\ninstance\tdecode0\tdecode\t{url}\t\t{log}\n"
    )
    (state / "decode0.exit").write_text("1\n")  # as serve.sh notes an exit
    done = subprocess.run(
        [sys.executable, "-I", str(out / "check.py"), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    server.join(timeout=5)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "ERROR: decode0 died during the request" in done.stdout
    assert "IncompleteRead" in done.stdout and "the engine core died mid-answer" in done.stdout


def test_a_port_that_answers_no_http_is_no_health(tmp_path: Path) -> None:
    """An instance's port, once it died, answered by something that speaks no HTTP (another
    process's socket): urllib raised http.client.BadStatusLine, no OSError, out of check.py's
    health check while it named the dead, a traceback and exit 1 read as "a difference"
    (found in review). It is no health."""
    from harness.run.export import standalone_check as check

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer_garbage() -> None:
        connection, _ = listener.accept()
        connection.recv(1 << 16)
        connection.sendall(b"\x00\x01ZMTP\r\n\r\n")
        connection.close()

    server = threading.Thread(target=answer_garbage, daemon=True)
    server.start()
    try:
        assert check.healthy(f"http://127.0.0.1:{listener.getsockname()[1]}") is False
    finally:
        server.join(timeout=5)
        listener.close()


def test_the_shipped_repairs_import_nothing_of_the_harness(tmp_path: Path) -> None:
    """cpu_repair.py (harness/cli/cpu_env.py) imports the AMX hook: the export ships it beside
    it, so it imports where the harness is not installed (here: where importing it raises)."""
    from harness.cli.export import cpu_repair_files

    out = tmp_path / "export"
    write_export(plan_for(write_bundle(tmp_path / "run")), out, cpu_repair_files())
    code = "import cpu_repair; print(cpu_repair.amx.HOOK_PTH)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=out,
        env={**os.environ, "PYTHONPATH": f"{out}:{poisoned_harness(tmp_path)}"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "epd-harness-amx.pth"


def test_a_server_stopped_before_it_made_its_session_is_stopped_all_the_same(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """setsid runs in the child after the fork: a stop right after a start found no group to
    signal, and serve.sh then waited for ever on that child (found by a fresh-clone CI run,
    where D's refused port stopped everything a moment after P started). A slow setsid makes
    the moment long enough to hit every time."""
    slow = tmp_path / "slow-setsid"
    slow.mkdir()
    (slow / "setsid").write_text(f'#!/bin/bash\nsleep 2\nexec {shutil.which("setsid")} "$@"\n')
    (slow / "setsid").chmod(0o755)
    out = export_case(tmp_path, verdict="MATCH")
    env = environment(leased_ports, tmp_path)
    env["PATH"] = f"{slow}:{env['PATH']}"
    with socket.socket() as taken:  # D's port: the start is refused at D, P just started
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", int(env["DECODE0_PORT"])))
        taken.listen()
        started = time.monotonic()
        done = run_sh(out, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    assert "decode0: something already answers" in done.stdout + done.stderr
    assert_nothing_left(out, env)


SLOW_TICK_S = 20  # what a polling `sleep 1` lasts under slow_ticks: far beyond any stop
# Under STOP_TIMEOUT (3 s): a stop that waited for its deadline timer, not the servers, fails
# too (0.2 s measured, from SIGTERM to exit, 0.04 s for run.sh during the start).
PROMPT_STOP_S = 2


def slow_ticks(root: Path, gate: Path | None = None) -> str:
    """A PATH entry whose `sleep 1` (the scripts' polling tick) lasts SLOW_TICK_S, once `gate`
    exists (always without one); any other sleep is the real one. A stop that waits out a tick
    instead of the servers then shows as seconds, every time, where the real tick costs up to
    1 s."""
    root.mkdir()
    opened = f'-e "{gate}"' if gate is not None else "-n x"
    (root / "sleep").write_text(
        "#!/bin/bash\n"
        f"if [[ $* == 1 && {opened} ]]; then exec {shutil.which('sleep')} {SLOW_TICK_S}; fi\n"
        f'exec {shutil.which("sleep")} "$@"\n'
    )
    (root / "sleep").chmod(0o755)
    return f"{root}:{os.environ['PATH']}"


def test_serve_sh_stops_when_its_servers_are_gone_not_at_its_next_tick(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """Serving, serve.sh polls its servers in `sleep 1` ticks; SIGTERM ended the tick's wait,
    but stop_all's last `wait` (every child) then waited out the tick too: up to a second
    after the servers were gone, on every stop."""
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path)
    env["PATH"] = slow_ticks(tmp_path / "slow-tick", gate=out / "work/state/ready")
    serve = serving(out, env)
    try:
        time.sleep(1)  # into the first tick after ready
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        output = serve.communicate(timeout=SLOW_TICK_S + 30)[0]
        took = time.monotonic() - started
        assert serve.returncode == 143, output
        assert "stopped everything" in output
        assert took < PROMPT_STOP_S, (
            f"serve.sh took {took:.1f} s to stop servers that stop on SIGTERM"
        )
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_serve_sh_stops_at_once_during_a_health_check_that_hangs(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """serve.sh ran each health check in the foreground, and bash runs a trap only once the
    foreground command ends: a SIGTERM during a check of a server that accepts the connection
    and never answers was acted on only at the check's 5 s timeout."""
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "decode:hang-health")
    serve = start_script(out, "serve.sh", env)
    try:
        decode_log = out / "work/logs/decode0.log"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (decode_log.exists() and "HEALTH CHECK HANGS" in decode_log.read_text()):
            assert serve.poll() is None and time.monotonic() < deadline, "no check reached D"
            time.sleep(0.1)
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        output = serve.communicate(timeout=RUN_TIMEOUT_S)[0]
        took = time.monotonic() - started
        assert serve.returncode == 143, output
        assert "stopped everything" in output
        assert took < PROMPT_STOP_S, f"serve.sh took {took:.1f} s to stop during a health check"
        with pytest.raises(ProcessLookupError):  # the check itself ended too, none orphaned
            os.killpg(serve.pid, 0)
        assert_nothing_left(out, env)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_run_sh_stops_at_once_while_it_waits_for_the_start(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """While serve.sh starts, run.sh polled for ready with a `sleep 1` in the foreground, and
    bash runs a trap only once the foreground command ends: a SIGTERM (a CI job's timeout, a
    `kill`) was acted on only at the tick's end."""
    out = export_case(tmp_path)
    env = environment(leased_ports, tmp_path, "*:slow-start=60")
    env["PATH"] = slow_ticks(tmp_path / "slow-tick")
    run = start_script(out, "run.sh", env)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # E, P and D started, none ready for a minute (slow-start): the proxy is not started yet
        while len(list((out / "work/state").glob("*.pid"))) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "serve.sh never started"
            time.sleep(0.2)
        time.sleep(1)  # into the ticks of run.sh and serve.sh
        assert not (out / "work/state/ready").exists()
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=SLOW_TICK_S * 2 + 30)[0]
        took = time.monotonic() - started
        assert run.returncode == 143, output
        assert took < PROMPT_STOP_S, f"run.sh took {took:.1f} s to stop a start it could cut short"
        assert_nothing_left(out, env)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        for pid_file in (out / "work/state").glob("*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def test_an_export_script_run_by_a_test_reaches_the_hub_as_the_session_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test runs an export's scripts in an environment built from scratch; their serve.sh
    fetches a hub model by name. The session's Hugging Face cache and token reach them: without
    them the GPU night's exports fetched the model again into ~/.cache where HF_HOME put the
    night's copy elsewhere, and a gated model failed there alone."""
    from harness.testing.processes import run_export_script

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    out = tmp_path / "export"
    out.mkdir()
    (out / "run.sh").write_text('echo "home=${HF_HOME-unset} token=${HF_TOKEN-unset}"\n')
    done = run_export_script(out, ["run.sh"], {"PATH": os.environ["PATH"]}, 30)
    assert done.stdout == f"home={tmp_path / 'hf'} token=hf_test_token\n", done


def serve_sh_refused(
    run: Path, tmp_path: Path, leased_ports: TakePorts
) -> tuple[Path, dict[str, str], subprocess.CompletedProcess[str]]:
    """`run`'s 1E+1P+1D case exported, and its serve.sh run once without the value it needs:
    the export, its environment and serve.sh's refusal (exit 2)."""
    bundle = Bundle.load(run)
    upstream = UpstreamProxy(Path(bundle.run["proxy"]["files_dir"]), "a stand-in proxy")
    plan = plan_export(bundle, f"1E+1P+1D:{PROMPT}", lambda: upstream, None)
    out = tmp_path / "scratch" / plan.name
    write_export(plan, out, {"cpu_repair.py": "print('no repairs needed here')\n"})
    env = environment(leased_ports, tmp_path)
    refused = run_script(out, ["serve.sh"], env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    return out, env, refused


def test_a_recorded_api_key_is_the_users_own_and_serve_sh_refuses_without_it(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """A run whose servers had `--api-key=KEY` (and `--api-key KEY`): serve.sh started vLLM
    with the key "[redacted]" (found in review). Unset, $API_KEY is refused before any server
    starts; set, each server is given it."""
    from test_export import with_api_keys

    run = with_api_keys(write_bundle(tmp_path / "run", verdict="MATCH"))
    out, env, refused = serve_sh_refused(run, tmp_path, leased_ports)
    assert "serve.sh: set API_KEY" in refused.stderr
    assert not list((out / "work").glob("state/*.pid")), "a server started without its key"
    argv_dir = tmp_path / "argvs"
    argv_dir.mkdir()
    recording = tmp_path / "bin" / "vllm-recording"
    recording.write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >"{argv_dir}/$$"\nexec "{env["VLLM"]}" "$@"\n'
    )
    recording.chmod(0o755)
    done = run_sh(out, {**env, "VLLM": str(recording), "API_KEY": "the-users-key"})
    assert done.returncode == 0, done.stdout + done.stderr
    argvs = [path.read_text().splitlines() for path in argv_dir.iterdir()]
    given = sorted(
        arg for argv in argvs for arg in argv if "the-users-key" in arg or "redacted" in arg
    )
    assert given == ["--api-key=the-users-key", "the-users-key"], given


def test_a_redacted_inherited_variable_is_refused_before_any_server_starts(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """An inherited numerics variable whose name the secret rule matches (`TOKEN` in
    VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE) is recorded redacted and written into serve.sh as
    `"${K}"`: unset, serve.sh died of "unbound variable" at the decode's start line, the
    encoder and prefill already started (found in review). It is refused as a recorded
    --api-key is, before anything starts; set, every instance is given it."""
    name = "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE"
    run = write_bundle(tmp_path / "run", verdict="MATCH")
    for path in sorted(run.glob("*/*.cmd.json")):
        command = json.loads(path.read_text())
        if "vllm-proxy" not in path.name:
            command["inherited_env"] = {name: "[redacted]"}
            path.write_text(json.dumps(command))
    out, env, refused = serve_sh_refused(run, tmp_path, leased_ports)
    assert f"serve.sh: set {name}" in refused.stderr, refused.stderr
    assert not list((out / "work").glob("state/*.pid")), "a server started without it"
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    recording = tmp_path / "bin" / "vllm-recording"
    recording.write_text(
        f'#!/usr/bin/env bash\nprintf "%s" "${{{name}-unset}}" >"{seen_dir}/$$"\n'
        f'exec "{env["VLLM"]}" "$@"\n'
    )
    recording.chmod(0o755)
    done = run_sh(out, {**env, "VLLM": str(recording), name: "4096"})
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(path.read_text() for path in seen_dir.iterdir())
    assert seen == ["4096"] * 3, seen

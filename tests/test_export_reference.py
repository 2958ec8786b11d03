"""`run.sh reference`: an export serves its case's reference itself (1P+1D for a case judged
against it, or the monolithic baseline), sends it the same request, keeps its answer, then
judges the case against that answer, under the run's policy and noise floor, as well as
against the ids recorded on another host (found in review: a reference of 1P+1D could only be
compared with what was recorded, so on another GPU a developer could not tell the machine's
noise from the bug). Scripts on the fake vLLM and stand-in proxies, as in
test_export_process.py: they show the process handling and the judging, not vLLM's answers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from export_bundle import (
    BASELINE_IDS,
    PD_IDS,
    PROMPT,
    PROMPT_IDS,
    REPAIR,
    plan_for,
    write,
    write_exact_reference_bundle,
)
from test_export_gpu import FLIPPED, Answering, answering, chat_answer, near_tie_export
from test_export_process import environment, pid_alive, run_script

from harness.run.export.files import render_serve_sh, write_export
from harness.run.export.issue import render_issue, title
from harness.run.export.standalone_check import request_digest
from harness.testing.processes import (
    ctrl_c,
    export_ports_left,
    sigint_as_at_a_terminal,
    sigint_ignored_as_in_a_backgrounded_run,
)

pytestmark = pytest.mark.process
TakePorts = Callable[[int], list[int]]
__all__ = ["answering"]  # the fixture, imported for this module's tests
REFERENCE_PORTS = ("REF_PROXY_PORT", "REF_PREFILL0_PORT", "REF_DECODE0_PORT")
SIDE_CHANNELS = ("REF_PREFILL0_NIXL_PORT", "REF_DECODE0_NIXL_PORT")  # the case's: environment


def exact_export(tmp_path: Path, record_reference: bool = True) -> Path:
    plan = plan_for(
        write_exact_reference_bundle(tmp_path / "run", record_reference=record_reference),
        f"1E+1P+1D:{PROMPT}",
    )
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    return out


def reference_environment(leased_ports: TakePorts, tmp_path: Path, modes: str = "") -> dict:
    """The case's ports and side channels (test_export_process.environment), the reference's
    and its side channels, each leased."""
    env = environment(leased_ports, tmp_path, modes)
    names = REFERENCE_PORTS + SIDE_CHANNELS
    return {**env, **dict(zip(names, map(str, leased_ports(len(names)))))}


def pids_in(output: str) -> dict[str, int]:
    """serve.sh's `started NAME (pid N)` lines: every server of both phases."""
    return {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", output)}


def assert_all_stopped(out: Path, pids: dict[str, int], env: dict[str, str]) -> None:
    assert pids, "serve.sh started nothing"
    deadline = time.monotonic() + 5
    alive = dict(pids)
    while alive and time.monotonic() < deadline:
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        time.sleep(0.1)
    assert alive == {}, f"left running: {alive}"
    ports = [int(value) for name, value in env.items() if name.endswith("_PORT")]
    assert export_ports_left(out, ports) == []


# -- what the export holds -------------------------------------------------------------------------


@pytest.mark.parametrize("record_reference", [True, False])
def test_an_export_judged_against_1p1d_can_serve_1p1d_itself(
    tmp_path: Path, record_reference: bool
) -> None:
    """1P+1D's instances with its KV connector (NIXL here: side channels of its own, checked
    free), behind vLLM's toy proxy, shipped and checked beside the EPD proxy; as the run
    recorded them, else as the harness renders them for the run's flags."""
    out = exact_export(tmp_path, record_reference)
    plan = plan_for(tmp_path / "run", f"1E+1P+1D:{PROMPT}")
    reference = plan.reference
    assert reference is not None and reference.name == "1P+1D"
    assert reference.source == ("recorded" if record_reference else "rendered")
    assert [(s.name, s.role) for s in reference.servers] == [
        ("ref-prefill0", "prefill"),
        ("ref-decode0", "decode"),
    ]
    assert plan.baseline is None  # `run.sh baseline` would check the monolithic ids instead
    serve = render_serve_sh(plan)
    assert "  case|reference) ;;" in serve
    block = serve.split("if [[ $MODE == reference ]]; then\n", 1)[1].split("\nelse\n", 1)[0]
    assert "side_channel_free ref-decode0 REF_DECODE0_NIXL_PORT" in block
    assert 'VLLM_NIXL_SIDE_CHANNEL_PORT="${REF_DECODE0_NIXL_PORT}"' in block
    assert '"kv_connector": "NixlConnector"' in block and '"kv_role": "kv_consumer"' in block
    assert "toy_proxy_server.py" in block and '--decoder-ports "${REF_DECODE0_PORT}"' in block
    assert "encoder" not in block
    sums = (out / "vllm-proxy/SHA256SUMS").read_text().splitlines()
    assert [line.split()[1].rsplit("/", 1)[1] for line in sums] == [
        "disagg_epd_proxy.py",
        "toy_proxy_server.py",
    ]
    issue = render_issue(plan)
    assert title(plan).endswith(("1P+1D serving (a control export)", ")")), title(plan)
    assert "1P+1D serving" in title(plan) and "monolithic" not in title(plan), title(plan)
    assert "`bash run.sh reference` serves that reference here first" in issue
    assert "# the case's reference, 1P+1D (run.sh reference)" in issue


# -- run.sh reference, as processes ----------------------------------------------------------------


def test_run_sh_reference_serves_1p1d_and_judges_the_case_against_its_answer_here(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The run recorded 1P+1D answering 7 11 12 13; here (the fake) it answers 7 8 9 10, and so
    does the case: against the recorded ids the case is a MISMATCH, against the reference
    served here a MATCH, and that judgment is run.sh's exit code. One phase at a time, each
    stopped before the next; nothing left running."""
    out = exact_export(tmp_path)
    env = reference_environment(leased_ports, tmp_path)
    done = run_script(out, ["run.sh", "reference"], env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "the expected ids do NOT hold on this machine's 1P+1D" in output
    assert "against 1P+1D's answer produced here: MATCH" in output
    assert (
        "against the recorded ids of 1P+1D: MISMATCH: generated token ids differ at position 1"
        in (output)
    )
    assert "recorded MISMATCH: NOT reproduced (against 1P+1D served here)" in output
    kept = json.loads((out / "work/reference-answer.json").read_text())
    assert (kept["reference"], kept["prompt_token_ids"]) == ("1P+1D", PROMPT_IDS)
    assert kept["token_ids"] == BASELINE_IDS != PD_IDS
    pids = pids_in(done.stdout)
    assert set(pids) == {
        "ref-prefill0",
        "ref-decode0",
        "ref-proxy",
        "encoder0",
        "prefill0",
        "decode0",
        "proxy",
    }
    ref_stopped = output.index("stopped everything")
    assert ref_stopped < output.index("started encoder0"), "the case started beside 1P+1D"
    assert "imported the harness" not in output
    assert_all_stopped(out, pids, env)


def test_run_sh_reference_with_the_monolithic_reference_too(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """A case judged against the baseline: `reference` serves the monolithic vLLM first."""
    from export_bundle import write

    out = write(tmp_path, verdict="MATCH")
    env = {
        **reference_environment(leased_ports, tmp_path),
        "BASELINE0_PORT": str(leased_ports(1)[0]),
    }
    done = run_script(out, ["run.sh", "reference"], env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "the expected ids hold on this machine's monolithic vLLM" in output
    assert "against the monolithic baseline's answer produced here: MATCH" in output
    assert list(pids_in(done.stdout))[0] == "baseline0"
    assert_all_stopped(out, pids_in(done.stdout), env)


def test_a_reference_that_cannot_start_ends_run_sh_reference_before_the_case(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = exact_export(tmp_path)
    env = reference_environment(leased_ports, tmp_path, "prefill:die-start")
    done = run_script(out, ["run.sh", "reference"], env)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "ref-prefill0 exited while starting" in output
    assert "serve.sh could not start everything (reference, exit 1)" in output
    assert "the reference gave no answer to judge the case against" in output
    assert "started encoder0" not in output
    assert_all_stopped(out, pids_in(done.stdout), env)


def test_a_reference_side_channel_in_use_is_refused(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = exact_export(tmp_path)
    env = reference_environment(leased_ports, tmp_path)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", int(env["REF_DECODE0_NIXL_PORT"])))
        held.listen()
        done = run_script(out, ["serve.sh", "reference"], env, timeout=60)
    port = env["REF_DECODE0_NIXL_PORT"]
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"ref-decode0: something already answers on 127.0.0.1:{port} (its NIXL" in done.stdout
    assert "started" not in done.stdout


def test_ctrl_c_while_the_reference_answers_leaves_nothing_running(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """Ctrl-C at the terminal (the whole foreground group) while 1P+1D's D holds the request:
    run.sh stops serve.sh, which stops every group; the case never starts. run.sh starts as a
    terminal's job would, SIGINT at its default, even from a pytest that ignores it (found
    by two fresh-clone CI runs: started without the reset, run.sh inherited SIGINT ignored,
    could not trap it, and served on until the test's timeout)."""
    out = exact_export(tmp_path)
    env = reference_environment(leased_ports, tmp_path, "decode:hang")
    with sigint_ignored_as_in_a_backgrounded_run():
        script = subprocess.Popen(
            ["bash", str(out / "run.sh"), "reference"],
            cwd=out,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its group stands for the terminal's foreground job
            preexec_fn=sigint_as_at_a_terminal,
        )
    try:
        log = out / "work/logs/ref-decode0.log"
        deadline = time.monotonic() + 60
        while not (log.is_file() and "REQUEST" in log.read_text()):
            assert script.poll() is None and time.monotonic() < deadline, script.communicate()
            time.sleep(0.2)
        ctrl_c(script.pid)
        try:
            # serve.sh gives its servers STOP_TIMEOUT (3 s here) after SIGTERM: far past it.
            output = script.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired as exc:
            pytest.fail(
                f"run.sh reference still running 60 s after Ctrl-C:\n{still_there(out, exc)}"
            )
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
        for pid_file in (out / "work/state").glob("*.pid"):  # what a failure here left
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert script.returncode == 130, output
    assert "started encoder0" not in output
    assert_all_stopped(out, pids_in(output), env)


def still_there(out: Path, exc: subprocess.TimeoutExpired) -> str:
    """What a run.sh that outlived its Ctrl-C printed, what of it still runs, and its logs'
    tails: the evidence a hang that did not come back here would need."""
    printed = exc.output.decode() if isinstance(exc.output, bytes) else str(exc.output or "")
    running = subprocess.run(
        ["ps", "-ww", "-eo", "pid,pgid,stat,etime,args"], capture_output=True, text=True
    ).stdout.splitlines()
    mine = [line for line in running if str(out) in line]
    logs = [
        f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        for log in sorted((out / "work/logs").glob("*.log"))
    ]
    return "\n".join([printed[-3000:], "still running:", *mine, *logs])


# -- check.py against the answer kept --------------------------------------------------------------


def check_against(
    out: Path, server: Answering, reference: dict[str, Any] | None, mode: str = "case"
) -> subprocess.CompletedProcess[str]:
    state = out / "work/state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "endpoints.tsv").write_text(
        f"mode\t{mode}\nentry\t{server.url}\n"
        f"instance\tdecode0\tdecode\t{server.url}\t{os.getpid()}\t{out}/none.log\n"
    )
    args = []
    if reference is not None:
        (out / "kept.json").write_text(json.dumps(reference))
        args = ["--reference", str(out / "kept.json")]
    return subprocess.run(
        [sys.executable, str(out / "check.py"), "--state", str(state), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def kept(
    name: str,
    answer: dict[str, Any],
    out: Path | None = None,
    request: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What --save-reference keeps of `answer` (the reference's), to the request of export
    `out` (or `request`)."""
    if request is None:
        assert out is not None, "the request the answer is to: an export's, or one given"
        request = json.loads((out / "request.json").read_text())
    content = answer["choices"][0]["logprobs"]["content"]
    return {
        "reference": name,
        "request_sha256": request_digest(request),
        "prompt_token_ids": answer["prompt_token_ids"],
        "token_ids": answer["choices"][0]["token_ids"],
        "top_logprobs": [
            [[int(t["token"].split(":")[1]), t["logprob"]] for t in c["top_logprobs"]]
            for c in content
        ],
        "token_logprobs": [c["logprob"] for c in content],
    }


# Here the baseline has the near tie at position 1 (8 at -0.690, 11 at -0.700), as recorded.
TIED = chat_answer(
    [7, 8, 9, 10], [[(7, -0.5)], [(8, -0.690), (11, -0.700)], [(9, -0.5)], [(10, -0.5)]]
)


def test_the_case_is_judged_against_the_kept_answer_under_the_runs_policy_and_floor(
    tmp_path: Path, answering
) -> None:
    """A pd-drift run's 1E+1P+1D vs the monolithic baseline (a P->D topology: DRIFT within the
    run's 0.05-nat floor passes). The reference served here has the near tie; the case flips
    it: DRIFT, passed, exit 0. Without a floor the same answer is a MISMATCH, exit 1."""
    out = near_tie_export(tmp_path, "MISMATCH")
    done = check_against(out, answering(FLIPPED), kept("baseline", TIED, out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "against the monolithic baseline's answer produced here: DRIFT" in done.stdout
    assert "pd-drift policy passes it here" in done.stdout
    path = out / "expected.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "noise_floor_nats": 0.0}))
    done = check_against(out, answering(FLIPPED), kept("baseline", TIED, out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "produced here: MISMATCH" in done.stdout


def test_an_exact_reference_passes_no_drift_and_another_references_answer_is_refused(
    tmp_path: Path, answering
) -> None:
    out = exact_export(tmp_path)
    expected = json.loads((out / "expected.json").read_text())
    assert (expected["reference"], expected["drift_passes"]) == ("1P+1D", False)
    path = out / "expected.json"
    path.write_text(json.dumps({**expected, "noise_floor_nats": 0.05}))
    done = check_against(out, answering(FLIPPED), kept("1P+1D", TIED, out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "produced here: DRIFT" in done.stdout and "exact policy does not pass it" in done.stdout
    done = check_against(out, answering(FLIPPED), kept("baseline", TIED, out))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "is 'baseline''s answer, the case's reference is '1P+1D'" in done.stderr
    done = check_against(out, answering(FLIPPED), kept("1P+1D", TIED, out), mode="reference")
    assert done.returncode == 2 and "serve.sh serves the reference, not the case" in done.stderr


def test_the_reference_served_alone_is_not_held_to_the_cases_kv_guard(
    tmp_path: Path, answering
) -> None:
    """A VACUOUS case's export carries the KV guard (D's cached_tokens); the monolithic
    reference served alone moves no KV, so its answer (cached_tokens none) is judged on its
    ids: the expected ids hold, exit 0. The case served, the same answer is the VACUOUS it
    was (a mutant that held the reference to the guard too survived)."""
    out = write(
        tmp_path,
        verdict="VACUOUS",
        guards={"kv_transfer": {"ok": False, "evidence": "D cached_tokens=0 (taps)"}},
        block_size=8,
    )
    assert json.loads((out / "expected.json").read_text())["kv_transfer"]
    answer = chat_answer(BASELINE_IDS, [[(t, -0.5)] for t in BASELINE_IDS])
    done = check_against(out, answering(answer), None, mode="reference")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the expected ids hold on this machine's monolithic vLLM" in done.stdout
    assert "KV guard" not in done.stdout
    done = check_against(out, answering(answer), None)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VACUOUS: tokens equal but the KV guard failed" in done.stdout


def test_an_answer_kept_for_another_request_is_refused_not_judged(
    tmp_path: Path, answering
) -> None:
    """`--reference FILE` from another export (another case's prompt, or the same case's
    request with other sampling) names the same reference, so the name alone let it through:
    the case was judged against an answer to another request and reported as a MISMATCH,
    exit 1, the bug 'reproduced' (found in review). The kept answer says which request it
    answers; another one is refused, exit 2, on one line naming the cause."""
    out = exact_export(tmp_path)
    other = {**json.loads((out / "request.json").read_text()), "max_tokens": 5}
    done = check_against(out, answering(FLIPPED), kept("1P+1D", TIED, request=other))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "answers another request than this export's request.json" in done.stderr
    assert "MISMATCH" not in done.stdout
    done = check_against(out, answering(FLIPPED), kept("1P+1D", TIED, out=out))
    assert done.returncode == 1, done.stdout + done.stderr  # judged, as before
    assert "against 1P+1D's answer produced here: MISMATCH" in done.stdout


@pytest.mark.parametrize("floor", ["Infinity", "NaN", "-0.25", '"0.05"', "true", "null"])
def test_an_expected_json_whose_noise_floor_is_no_measurement_is_refused_not_judged(
    tmp_path: Path, answering, floor: str
) -> None:
    """The floor is the tolerance of the drift rule: an Infinity (Python's json writes and
    reads it) made check.py call every near tie DRIFT, exit 0, a bug 'not reproduced'; a
    string crashed it. As the harness's baseline cache refuses such a floor, check.py exits 2
    on one line naming the field and the file, and judges nothing."""
    out = near_tie_export(tmp_path, "MISMATCH")
    path = out / "expected.json"
    text = path.read_text()
    assert '"noise_floor_nats": 0.05' in text
    path.write_text(text.replace('"noise_floor_nats": 0.05', f'"noise_floor_nats": {floor}'))
    done = check_against(out, answering(FLIPPED), None)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "noise_floor_nats" in done.stderr and str(path) in done.stderr
    assert "DRIFT" not in done.stdout and "MISMATCH" not in done.stdout


def test_a_reference_answer_that_is_an_error_is_not_kept(tmp_path: Path, answering) -> None:
    """An answer ended by an engine error (finish_reason "error": a KV load that failed) is an
    ERROR, exit 2, and `--save-reference` kept it all the same, for `--reference` to judge the
    case against a reference that never finished (found in review)."""
    out = exact_export(tmp_path)
    broken = {
        **TIED,
        "choices": [{**TIED["choices"][0], "finish_reason": "error"}],
    }
    state = out / "work/state"
    state.mkdir(parents=True, exist_ok=True)
    server = answering(broken)
    (state / "endpoints.tsv").write_text(
        f"mode\treference\nentry\t{server.url}\n"
        f"instance\tprefill0\tprefill\t{server.url}\t{os.getpid()}\t{out}/none.log\n"
    )
    keep = out / "kept.json"
    done = subprocess.run(
        [
            sys.executable,
            str(out / "check.py"),
            "--state",
            str(state),
            "--save-reference",
            str(keep),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ERROR" in done.stdout, done.stdout
    assert not keep.exists(), f"an ERROR kept as the reference's answer: {keep.read_text()}"
    assert "its answer is an ERROR, nothing kept" in done.stderr, done.stderr

"""Attach mode on real vLLM: a deployment the harness did not start in this run is judged like a
launched one, and a dead instance of it is an ERROR naming it.

The harness keeps a 1E+1PD topology serving (as `epd-harness repro --keep-up` does, and with
the attach file it writes), then judges it with a second, separate `epd-harness run --attach
FILE` that launches nothing: no server command file in its run directory, no instance in its
summary, and no new `vllm serve` process while it ran (sampled every 0.2 s). Its verdicts must
equal those of a normal run of the same prompts, with the encoder guard checked from the EC
files and the consumer guard reported as not checkable. Judged a second time, the EC storage
has seen the media and the encoder guard turns not checkable too (never held, never failed).
Then one instance's process group is SIGKILLed, and the next attach run must end within
seconds, every case an ERROR whose detail names that instance, its role and its URL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from harness.cli.main import EXIT_FAILED, EXIT_OK
from harness.report.text import format_failure
from harness.serve.attached import write_attach_file
from harness.spec.attach import ATTACH_FILE_NAME
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.topology import TOPOLOGIES, Role

pytestmark = [pytest.mark.e2e, pytest.mark.epd_topology("1E+1PD")]

TOPOLOGY = "1E+1PD"
PROMPTS = ("text", "image", "video")
DEAD_RUN_MAX_S = 30.0  # preflight (cached token counts) + one health check; no request is sent


@pytest.fixture(scope="session")
def normal_sweep(epd_config, epd_pool):
    """The normal run: the harness launches 1E+1PD (the session's running one) and judges it,
    as `epd-harness run` does."""
    from harness.run.baseline_cache import BaselineCache
    from harness.run.sweep import Sweep, SweepSpec

    settings = epd_config.settings
    run_dir = settings.run_dir / "attach"
    # The attach runs must find the baseline this run computes: without the shared cache
    # (--epd-baseline-cache off) a cache of this module's own stands in.
    cache = epd_config.baseline_cache or BaselineCache(run_dir / "baseline-cache")
    spec = SweepSpec(
        topologies=(TOPOLOGIES[TOPOLOGY],),
        prompts=tuple(p for p in SKELETON_PROMPTS if p.name in PROMPTS),
    )
    normal = dataclasses.replace(settings, run_dir=run_dir / "normal")
    return Sweep(spec, normal, baseline_cache=cache, pool=epd_pool)


def vllm_servers() -> dict[int, str]:
    """pid -> command line of every `vllm serve` process this test process has started
    (servers run in their own sessions, but stay its descendants)."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        if "serve" in cmdline and any(part.endswith("vllm") for part in cmdline[:2]):
            found[proc.pid] = " ".join(cmdline)
    return found


def port_of(command_line: str) -> str:
    """The `--port` of a `vllm serve` command line."""
    words = command_line.split()
    return words[words.index("--port") + 1]


@contextmanager
def new_vllm_servers() -> Iterator[dict[int, str]]:
    """Every `vllm serve` process that appears while the block runs (sampled every 0.2 s)."""
    before = set(vllm_servers())
    appeared: dict[int, str] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            appeared.update({p: c for p, c in vllm_servers().items() if p not in before})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield appeared
    finally:
        done.set()
        sampler.join()


def attach_run(
    epd_cli, config, attach_file: Path, run_dir: Path, cache: Path
) -> tuple[int, str, dict, float]:
    """`epd-harness run --attach FILE` in-process: (exit code, stdout, summary.json, seconds)."""
    settings = config.settings
    # The baseline the attach run may start is the session's: same platform, devices and
    # numerics flags, so its answers are the cached ones (a GPU session's too). Not a
    # colocated session's --colocate: the baseline is one instance, which it cannot change,
    # and `run --attach` refuses it.
    baseline_flags = ["--platform", settings.platform.name]
    baseline_flags += ["--devices", ",".join(map(str, settings.devices))]
    if not settings.serving.enforce_eager:
        baseline_flags.append("--no-enforce-eager")
    baseline_flags += ["--dtype", settings.serving.dtype]  # a T4 session's float16
    started = time.monotonic()
    code, out, _ = epd_cli(
        "run", "--attach", attach_file, "--prompt", ",".join(PROMPTS),
        "--model", settings.serving.model, "--vllm", settings.vllm.executable,
        "--baseline-cache", cache, "--run-dir", run_dir, *baseline_flags,
    )  # fmt: skip
    took = time.monotonic() - started
    return code, out, json.loads((run_dir / "summary.json").read_text()), took


@pytest.mark.epd_ends_session
@pytest.mark.reads_instance_processes  # SIGKILLs PD's process group by its pid, on this host
def test_attach_judges_a_kept_up_topology_like_a_normal_run(
    normal_sweep, epd_config, epd_pool, epd_cli, capsys
) -> None:
    normal = [record for prompt in PROMPTS for record in normal_sweep.judge(TOPOLOGY, prompt)]
    failures = [r for r in normal if not r.policy_passed]
    assert not failures, "\n\n".join(format_failure(r) for r in failures)
    expected = [(r.prompt, r.reference, r.verdict.value) for r in normal]
    run_dir = normal_sweep.settings.run_dir.parent
    cache = normal_sweep.baseline.cache.directory

    # A deployment of its own, with an EC storage no request has seen: the first attach run
    # must find every EC file written during its requests.
    kept_up = epd_pool.private(
        TOPOLOGIES[TOPOLOGY],
        "the deployment the attach runs judge, with fresh storage",
        label="kept-up",
        settings=normal_sweep.settings,
    )
    with kept_up as session:
        attach_file = run_dir / ATTACH_FILE_NAME
        spec = write_attach_file(session, attach_file)
        pd = spec.with_role(Role.PREFILL_DECODE)[0]
        # The sampler does see vLLM servers: the kept-up topology's own two (the pool's shared
        # topologies, the normal run's among them, may be running beside them).
        ports = {url.rsplit(":", 1)[1] for url in (i.url for i in spec.instances)}
        kept_up_servers = [c for c in vllm_servers().values() if port_of(c) in ports]
        assert len(kept_up_servers) == len(spec.instances), vllm_servers()

        with new_vllm_servers() as launched:
            code, out, summary, took = attach_run(
                epd_cli, epd_config, attach_file, run_dir / "attached", cache
            )
        with capsys.disabled():
            print(f"\n[attach] attach run: exit {code} in {took:.1f}s")
        assert code == EXIT_OK, out[-4000:]
        assert launched == {}, f"the attach run started vLLM servers: {launched}"
        assert not list((run_dir / "attached").rglob("*.cmd.json"))
        assert summary["run"]["instances"] == [], summary["run"]["instances"]
        cases = summary["cases"]
        assert [(c["prompt"], c["reference"], c["verdict"]) for c in cases] == expected, out
        for case in cases:
            if case["prompt"] == "text":
                assert case["guards"] == {}, case["guards"]
                continue
            encoder = case["guards"]["encoder_output"]
            assert encoder["ok"] and "EC file(s) written under" in encoder["evidence"], encoder
            assert case["guards"]["consumer_embeds"]["not_checkable"], case["guards"]
        assert "guards NOT CHECKED" in out, out[-2000:]

        # Judged again: the EC storage has seen these media, so the encoder loads them rather
        # than encoding again, and which stored file is which item's cannot be told from here.
        code, out, summary, took = attach_run(
            epd_cli, epd_config, attach_file, run_dir / "again", cache
        )
        with capsys.disabled():
            print(f"[attach] second attach run: exit {code} in {took:.1f}s")
        assert code == EXIT_OK, out[-4000:]
        cases = summary["cases"]
        assert [(c["prompt"], c["reference"], c["verdict"]) for c in cases] == expected, out
        for case in cases:
            if case["prompt"] != "text":
                encoder = case["guards"]["encoder_output"]
                assert encoder.get("not_checkable"), encoder
                assert "not encoded again" in encoder["evidence"], encoder

        pgid = session.server(Role.PREFILL_DECODE).pgid
        assert pgid is not None
        os.killpg(pgid, signal.SIGKILL)
        code, out, summary, took = attach_run(
            epd_cli, epd_config, attach_file, run_dir / "attached-dead", cache
        )
        with capsys.disabled():
            print(f"[attach] attach run with {pd.name} killed: exit {code} in {took:.1f}s")
    assert code == EXIT_FAILED, out[-4000:]
    named = f"request failed: {pd.name} (pd, {pd.url}) is not serving"
    for case in summary["cases"]:
        assert case["verdict"] == "ERROR" and case["detail"].startswith(named), case
    assert len(summary["cases"]) == len(PROMPTS), summary["cases"]
    assert took < DEAD_RUN_MAX_S, f"the dead instance took {took:.1f} s to report"

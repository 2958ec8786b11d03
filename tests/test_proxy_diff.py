"""Comparing two runs of the same cases (harness/report/proxy_diff.py, `epd-harness compare`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.report.proxy_diff import diff_runs, format_diff, unpaired_cases

pytestmark = pytest.mark.unit


def tap(instance: str, parts: list[str], meta: list[bool], status: int | None = 200) -> dict:
    return {
        "instance": f"1E+1P+1D/{instance}",
        "part_types": parts,
        "metadata_only": meta,
        "sent_ec_transfer_params": {"h": {}} if any(meta) else None,
        "sent_kv_transfer_params": None,
        "status": status,
        "request_id": "differs-by-design",
        "uuids": ["also-differs"],
    }


def outcome(tokens: list[int] | None, taps: list[dict]) -> dict[str, Any]:
    return {"result": {"token_ids": tokens} if tokens is not None else None, "taps": taps}


ENCODE = tap("encoder0", ["image_url"], [False])
DECODE = tap("decode0", ["image_embeds"], [True])


def test_same_tokens_and_calls_are_the_same_case_whatever_the_ids() -> None:
    first = {"baseline": {}, "1E+1P+1D": {"image": outcome([1, 2, 3], [ENCODE, DECODE])}}
    second = {"1E+1P+1D": {"image": outcome([1, 2, 3], [DECODE, dict(ENCODE, uuids=["x"])])}}
    (diff,) = diff_runs(first, second)
    assert diff.same, diff


def test_a_retry_shows_as_calls_only_one_proxy_made() -> None:
    failed = dict(DECODE, status=500)
    first = {"t": {"p": outcome(None, [ENCODE, failed])}}
    second = {"t": {"p": outcome(None, [ENCODE, failed, ENCODE, dict(DECODE, status=None)])}}
    (diff,) = diff_runs(first, second)
    assert not diff.same
    assert diff.only_first == ()
    assert [c.describe() for c in diff.only_second] == [
        "decode0[image_embeds(meta) ec]->no answer",
        "encoder0[image_url]->200",
    ]
    assert "no tokens on the first and second run" in diff.tokens


def test_tokens_that_differ_say_where() -> None:
    first = {"t": {"p": outcome([1, 2, 3], [])}}
    second = {"t": {"p": outcome([1, 9, 3], [])}}
    (diff,) = diff_runs(first, second)
    assert diff.tokens == "differ at 1" and not diff.same
    table = format_diff([diff], "harness", "vllm")
    assert "| t / p | differ at 1 | - | - |" in table
    assert "0/1 cases" in table


def test_prompt_ids_that_differ_are_a_difference_whatever_was_generated() -> None:
    """Found in review: only the generated ids were compared, so a proxy that sent another
    prompt (as many tokens, so the taps' counts agree) compared "equal", exit 0, where the
    judge calls the same answers a MISMATCH."""
    first = {"t": {"p": {"result": {"token_ids": [1, 2, 3], "prompt_token_ids": [7, 8, 9]}}}}
    second = {"t": {"p": {"result": {"token_ids": [1, 2, 3], "prompt_token_ids": [7, 5, 9]}}}}
    (diff,) = diff_runs(first, second)
    assert diff.tokens == "prompt ids differ at 1" and not diff.same


def test_cases_only_one_run_holds_are_named() -> None:
    first = {"t": {"p": outcome([1], []), "q": outcome([1], [])}}
    second = {"t": {"p": outcome([1], [])}, "u": {"r": outcome([1], [])}}
    assert unpaired_cases(first, second) == [
        "t / q: only in the first run",
        "u / r: only in the second run",
    ]


def write_run(
    path: Path,
    responses: dict,
    proxy: str,
    vllm: str | None = None,
    serving: dict | None = None,
    launcher: str | None = None,
) -> str:
    path.mkdir()
    (path / "responses.json").write_text(json.dumps(responses))
    run: dict[str, Any] = {"proxy": {"kind": proxy}}
    if launcher is not None:
        run["launcher"] = {"kind": launcher}
    if vllm is not None:
        run["served_vllm"] = {"version": vllm}
    if serving is not None:
        run["serving"] = serving
    (path / "run.json").write_text(json.dumps(run))
    return str(path)


def test_the_command_exits_1_on_a_difference_and_0_without(tmp_path: Path, epd_cli) -> None:
    a = write_run(tmp_path / "a", {"t": {"p": outcome([1], [ENCODE])}}, "harness")
    b = write_run(tmp_path / "b", {"t": {"p": outcome([1], [ENCODE])}}, "vllm")
    c = write_run(tmp_path / "c", {"t": {"p": outcome([2], [ENCODE])}}, "vllm")
    same = epd_cli("compare", a, b)
    assert same.code == 0
    assert "calls only with harness (a)" in same.out
    assert epd_cli("compare", a, c).code == 1
    missing = epd_cli("compare", a, tmp_path / "missing")
    assert missing.code == 2
    assert "not a run directory" in missing.err


@pytest.mark.parametrize(
    ("responses", "cause"),
    [
        ([], "expected a JSON object of {group: {prompt: outcome}}"),
        ({"t": [1]}, "'t' is not a mapping of prompts to outcomes"),
        ({"t": {"p": 5}}, "'t' / 'p' is not an outcome (a JSON object)"),
    ],
)
def test_responses_of_another_shape_are_one_line(
    responses: Any, cause: str, tmp_path: Path, epd_cli
) -> None:
    """A list compared as "no case in common" and an outcome that is not a mapping was a
    traceback, exit 1, as was a run.json that is not a mapping (found in review)."""
    a = write_run(tmp_path / "a", {"t": {"p": outcome([1], [ENCODE])}}, "harness")
    b = write_run(tmp_path / "b", {}, "vllm")
    (Path(b) / "responses.json").write_text(json.dumps(responses))
    refused = epd_cli("compare", a, b)
    assert (refused.code, refused.err) == (
        2,
        f"epd-harness: error: {b}/responses.json: {cause}\n",
    )
    (Path(a) / "run.json").write_text("[1]")
    labelled = epd_cli("compare", a, a)
    assert labelled.code == 0 and "calls only with a " in labelled.out, labelled.err


def test_runs_of_two_vllm_versions_name_each_version_in_the_headers(
    tmp_path: Path, epd_cli
) -> None:
    """Asked by a release manager (comparing releases is what compare is used for): the
    columns named only the proxy and the directory, not the vLLM each run served."""
    responses = {"t": {"p": outcome([1], [ENCODE])}}
    old = write_run(tmp_path / "old", responses, "vllm", vllm="0.30.0")
    new = write_run(tmp_path / "new", responses, "vllm", vllm="0.31.0")
    same = write_run(tmp_path / "same", responses, "harness", vllm="0.31.0")
    unrecorded = write_run(tmp_path / "unrecorded", responses, "vllm")
    across = epd_cli("compare", old, new)
    assert across.code == 0, across.err
    header = across.out.splitlines()[0]
    assert "calls only with vllm (old, vLLM 0.30.0)" in header, header
    assert "calls only with vllm (new, vLLM 0.31.0)" in header, header
    within = epd_cli("compare", new, same)
    assert "calls only with vllm (new) | calls only with harness (same) |" in within.out
    assert "vLLM 0.31.0" not in within.out
    older = epd_cli("compare", unrecorded, new)
    assert "vllm (unrecorded, vLLM not recorded)" in older.out.splitlines()[0], older.out


def test_a_ray_run_and_a_local_one_name_where_each_ran_in_the_headers(
    tmp_path: Path, epd_cli
) -> None:
    """Real vLLM: a local run and a `--launcher ray` run of the same cases were headed
    "harness (A)" and "harness (B)". Each column names its launcher when they differ; a run
    recorded without one ran locally."""
    responses = {"t": {"p": outcome([1], [ENCODE])}}
    local = write_run(tmp_path / "local", responses, "harness")
    ray = write_run(tmp_path / "ray", responses, "harness", launcher="ray")
    header = epd_cli("compare", local, ray).out.splitlines()[0]
    assert "calls only with harness (local, local launcher) |" in header, header
    assert "calls only with harness (ray, ray launcher) |" in header, header
    alike = epd_cli("compare", ray, ray)
    assert "launcher" not in alike.out, alike.out


def test_runs_served_with_other_flags_name_each_flag_that_differs(tmp_path: Path, epd_cli) -> None:
    """A float32 run's tokens differed from a bfloat16 run's and compare said only where, as if
    one were wrong (found checking --dtype on real vLLM): each serving flag that differs is
    named, a run's own media directory is not."""
    serving = {"dtype": "bfloat16", "block_size": 32, "allowed_local_media_path": "/a"}
    bf16 = write_run(
        tmp_path / "bf16", {"t": {"p": outcome([1], [ENCODE])}}, "harness", serving=serving
    )
    fp32 = write_run(
        tmp_path / "fp32",
        {"t": {"p": outcome([2], [ENCODE])}},
        "harness",
        serving={**serving, "dtype": "float32", "allowed_local_media_path": "/b"},
    )
    across = epd_cli("compare", bf16, fp32)
    assert across.code == 1
    noted = [line for line in across.out.splitlines() if line.startswith("served differently")]
    assert noted == [
        "served differently (tokens may differ for this alone): dtype: 'bfloat16' vs 'float32'"
    ], across.out
    alike = epd_cli("compare", bf16, bf16)
    assert "served differently" not in alike.out


def test_one_case_that_differs_fails_the_comparison_whatever_the_others(
    tmp_path: Path, epd_cli
) -> None:
    """Exit 0 says every case in common is the same: one differing among equal ones is exit 1."""
    same = outcome([1], [ENCODE])
    a = write_run(tmp_path / "a", {"t": {"p": same, "q": same}}, "harness")
    b = write_run(tmp_path / "b", {"t": {"p": same, "q": outcome([2], [ENCODE])}}, "vllm")
    assert epd_cli("compare", a, b).code == 1
    assert epd_cli("compare", a, a).code == 0


def test_runs_with_no_case_in_common_are_refused_not_passed(tmp_path: Path, epd_cli) -> None:
    """Nothing compared is nothing proven: exit 2, one line, never exit 0 on an empty table."""
    a = write_run(tmp_path / "a", {"t": {"p": outcome([1], [ENCODE])}}, "harness")
    b = write_run(tmp_path / "b", {"t": {"other": outcome([1], [ENCODE])}}, "vllm")
    refused = epd_cli("compare", a, b)
    assert (refused.code, refused.err) == (
        2,
        f"epd-harness: error: {a} and {b} hold no case in common\n",
    )


def test_a_run_without_serving_flags_is_compared_without_naming_any(
    tmp_path: Path, epd_cli
) -> None:
    """A run.json without `serving` (an older run's) beside one with it: the tokens are
    compared, no flag is said to differ, and nothing fails on the missing record."""
    responses = {"t": {"p": outcome([1], [ENCODE])}}
    older = write_run(tmp_path / "older", responses, "harness")
    newer = write_run(tmp_path / "newer", responses, "vllm", serving={"dtype": "bfloat16"})
    compared = epd_cli("compare", older, newer)
    assert compared.code == 0, compared.err
    assert "served differently" not in compared.out


def test_every_call_field_and_framing_part_that_differs_is_a_difference() -> None:
    """Each field of a call the taps record (KV params sent, EC entries answered, prompt
    tokens), and each part of a stream's framing (media type, [DONE], usage against the ids,
    problems), makes a case differ when only it differs; the baseline group is no case."""
    base = dict(ENCODE, usage={"prompt_tokens": 9}, ec_transfer_params={"h": {}})
    calls = [
        dict(base, sent_kv_transfer_params={"remote_block_ids": [1]}),
        dict(base, ec_transfer_params={}),
        dict(base, usage={"prompt_tokens": 8}),
    ]
    stream = {
        "content_type": "text/event-stream; charset=utf-8",
        "role_chunks": 1,
        "done_last": True,
        "usage_completion_tokens": 3,
        "ids_counted": 3,
        "problems": [],
    }
    streams = [
        dict(stream, content_type="application/json"),
        dict(stream, done_last=False),
        dict(stream, usage_completion_tokens=4),
        dict(stream, problems=["a chunk after [DONE]"]),
    ]
    same = {**outcome([1, 2], [base]), "stream": stream}
    for other in [
        *({**same, "taps": [call]} for call in calls),
        *({**same, "stream": framing} for framing in streams),
    ]:
        (diff,) = diff_runs({"t": {"p": same}}, {"t": {"p": other}})
        assert not diff.same, other
    charset = dict(stream, content_type="text/event-stream")
    (alike,) = diff_runs({"t": {"p": same}}, {"t": {"p": {**same, "stream": charset}}})
    assert alike.same, alike
    baseline = {"baseline": {"p": outcome([1], [])}}
    other_baseline = {"baseline": {"p": outcome([2], []), "q": outcome([1], [])}}
    assert diff_runs(baseline, other_baseline) == []
    assert unpaired_cases(baseline, other_baseline) == []


def test_tokens_are_said_where_they_part_and_which_run_has_none() -> None:
    """An answer that is the other's start parts where it ends; a run without tokens is named,
    the other's tokens not compared against nothing; the summary counts the same cases only."""
    first = {"t": {"p": outcome([1, 2], []), "q": outcome([1], []), "r": outcome([5], [])}}
    second = {"t": {"p": outcome([1, 2, 3], []), "q": outcome(None, []), "r": outcome([5], [])}}
    p, q, r = diff_runs(first, second)
    assert p.tokens == "differ at 2", p
    assert q.tokens == "no tokens on the second run", q
    assert r.same
    table = format_diff([p, q, r], "harness", "vllm")
    assert "\n1/3 cases" in table, table
    stream_only = diff_runs(
        {"t": {"p": {**outcome([1], []), "stream": {"done_last": True}}}},
        {"t": {"p": {**outcome([1], []), "stream": {"done_last": False}}}},
    )
    assert "\n0/1 cases" in format_diff(stream_only, "harness", "vllm")

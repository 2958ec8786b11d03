"""What the preflight reads of the served vLLM by running the interpreter on its `#!` line.

The served vLLM may live in another environment than the harness (`--vllm OTHER/bin/vllm`), so
its versions and its modules are read from its own interpreter, in a subprocess; the fake vLLM
(harness/testing/fake_vllm.py) stands in for such an environment.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.environment import IMPORT_CHECK_DIR_ENV
from harness.errors import BadInput
from harness.preflight import vllm as vllm_preflight
from harness.preflight.connectors import check_kv_connector
from harness.preflight.vllm import probe_served_vllm
from harness.run.baseline_cache import baseline_key
from harness.run.baseline_launch import BaselineLaunch
from harness.spec.connectors import NIXL
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.process

SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")


def test_served_version_is_read_from_the_served_interpreter(tmp_path: Path) -> None:
    """Trap 2 of issue 8 (tests/test_traps.py): the served vLLM, not the harness's own, keys
    the baseline and the record."""
    vllm = install_fake_vllm(tmp_path, vllm_version="0.28.0", torch_version="2.9.1+cpu")
    served = probe_served_vllm(str(vllm))
    assert (served.version, served.torch_version) == ("0.28.0", "2.9.1+cpu")


def test_an_interpreter_without_vllm_or_that_says_nothing_readable_is_refused(
    tmp_path: Path,
) -> None:
    """A `vllm` script whose interpreter has no vLLM (a venv rebuilt without it, a launcher
    copied between venvs) is refused naming that interpreter; one whose probe prints no
    version record, naming its last error line. Taken as served, its version was None, and
    the version gate's match of it a TypeError: a traceback, not one line."""
    interpreter = tmp_path / "python-without-vllm"
    answer = tmp_path / "answer"
    interpreter.write_text(f"#!/bin/sh\ncat {answer}\necho 'warning: no GPU' >&2\n")
    interpreter.chmod(0o755)
    executable = tmp_path / "vllm"
    executable.write_text(f"#!{interpreter}\nimport vllm\n")
    executable.chmod(0o755)
    answer.write_text(json.dumps({"vllm": None, "torch": "2.13.0"}) + "\n")
    with pytest.raises(BadInput) as refused:
        probe_served_vllm(str(executable))
    assert str(refused.value) == (
        f"vLLM is not installed for {interpreter}, the interpreter of {executable}"
    )
    answer.write_text('["vllm", "0.32.0"]\n')
    with pytest.raises(BadInput) as unread:
        probe_served_vllm(str(executable))
    assert str(unread.value) == f"cannot read the vLLM version of {executable}: warning: no GPU"


def test_nixl_refused_in_one_line_when_the_served_python_lacks_it(tmp_path: Path) -> None:
    vllm = install_fake_vllm(tmp_path, missing_modules=["nixl"])
    served = dataclasses.replace(SERVED, executable=str(vllm))
    with pytest.raises(BadInput) as caught:
        check_kv_connector(served, NIXL)
    message = str(caught.value)
    assert "\n" not in message
    assert "--kv-connector nixl needs nixl" in message
    assert "No module named 'nixl'" in message
    assert "scripts/cpu setup --nixl" in message


# --- what keys the baseline cache besides vLLM and torch ----------------------------------------

DEV = "0.33.0.dev12+gabc1234"
BODY = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}]}
SERVING = ServingConfig(model="/models/tiny")
LAUNCH = BaselineLaunch(("serve", "MODEL"), (), "cpu: test")


def editable_vllm(tmp_path: Path, tree: Path) -> Path:
    """A fake served vLLM installed with `pip install -e TREE` (its direct_url.json says so)."""
    vllm = install_fake_vllm(tmp_path / "bin", vllm_version=DEV)
    info = tmp_path / "bin" / "vllm-python" / "site" / f"vllm-{DEV}.dist-info"
    (info / "direct_url.json").write_text(
        json.dumps({"url": tree.as_uri(), "dir_info": {"editable": True}})
    )
    return vllm


def git(tree: Path, *args: str) -> None:
    identity = ("-c", "user.name=t", "-c", "user.email=t@example.invalid")
    subprocess.run(["git", "-C", str(tree), *identity, *args], check=True, capture_output=True)


def test_an_edited_editable_vllm_does_not_hit_the_baseline_of_its_code_before(
    tmp_path: Path,
) -> None:
    """A vLLM developer's `pip install -e .` (VLLM_USE_PRECOMPILED=1: Python edits take effect
    with no reinstall) reports the version written at install time, whatever the tree holds
    now. The key was that version, so after an edit to, say, the Qwen2.5-VL model file, EPD
    was served by the edited code and judged against the cached answer of the code before: a
    MISMATCH that is no EPD bug, or a change the developer meant to test, hidden (found in
    review). The key now holds the tree's git HEAD and a hash of its diff and untracked .py
    files."""
    tree = tmp_path / "vllm-src"
    model_file = tree / "vllm" / "model_executor" / "models" / "qwen2_5_vl.py"
    model_file.parent.mkdir(parents=True)
    model_file.write_text("SCALE = 1.0\n")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "the tree as installed")
    vllm = editable_vllm(tmp_path, tree)

    def key() -> str:
        served = probe_served_vllm(str(vllm))
        assert served.source_tree == str(tree) and served.cache_refusal is None, served
        return baseline_key(served, SERVING, "digest", BODY, launch=LAUNCH)

    before = key()
    assert key() == before, "the same code keys the same baseline"
    model_file.write_text("SCALE = 2.0\n")  # the developer's edit
    edited = key()
    assert edited != before, f"vLLM {DEV} (editable, {tree}) keys one baseline before and after"
    (model_file.parent / "new_model.py").write_text("A = 1\n")  # untracked, not ignored
    assert key() != edited
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "committed")
    assert key() not in (before, edited), "a new HEAD is new code"


def test_an_editable_vllm_whose_code_cannot_be_read_is_not_cached(tmp_path: Path) -> None:
    """No git checkout (or no git): the code cannot be identified, so no baseline of it is
    cached; the run says so in one line (`harness.preflight.config`) and computes it."""
    tree = tmp_path / "vllm-src"
    tree.mkdir()
    served = probe_served_vllm(str(editable_vllm(tmp_path, tree)))
    assert served.cache_refusal is not None
    assert "\n" not in served.cache_refusal and str(tree) in served.cache_refusal
    with pytest.raises(ValueError, match="editable install"):
        baseline_key(served, SERVING, "digest", BODY, launch=LAUNCH)


@pytest.mark.parametrize(
    "direct_url,tree",
    [
        ({"url": "file:///src/my%20vllm", "dir_info": {"editable": True}}, Path("/src/my vllm")),
        ({"url": "file:///src/vllm", "dir_info": {}}, None),
        ({"url": "file:///src/vllm", "dir_info": {"editable": False}}, None),
        ({"url": "https://example.org/src/vllm", "dir_info": {"editable": True}}, None),
        ({"url": "file:///wheels/vllm.whl", "archive_info": {}}, None),
    ],
)
def test_only_an_editable_install_from_a_local_tree_is_read_as_its_tree(
    direct_url: dict, tree: Path | None
) -> None:
    """`pip install /src/vllm` (not -e) copies the tree at install time: the tree's later
    edits are not what serves, so its git state must not key the baseline; read as editable,
    an edit to it, never installed, made a new key for the same served code, and a tree
    since deleted refused the cache. A URL that is no local path names no tree either."""
    assert vllm_preflight.editable_tree(direct_url) == tree


def test_the_served_transformers_version_is_in_the_key_and_recorded(tmp_path: Path) -> None:
    """vLLM preprocesses images and videos with the *served* environment's transformers (the
    HF image/video processors: resize, normalise; e.g. the slow/fast processor default that
    changed between releases), so its pixel values, embeddings and tokens follow that version.
    The probe read only vllm and torch: `pip install -U transformers` in the served venv kept
    the key, and EPD (new preprocessing) was judged against a cached baseline of the old one
    (found in review)."""
    vllm = install_fake_vllm(tmp_path / "bin", vllm_version="0.32.0+cpu", torch_version="2.13.0")
    site = tmp_path / "bin" / "vllm-python" / "site"

    def served_with(transformers: str) -> ServedVllm:
        for old in site.glob("transformers-*.dist-info"):
            shutil.rmtree(old)
        info = site / f"transformers-{transformers}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: transformers\nVersion: {transformers}\n"
        )
        return probe_served_vllm(str(vllm))

    old, new = served_with("4.57.1"), served_with("5.19.0")
    assert dict(new.libraries)["transformers"] == "5.19.0"
    assert {"tokenizers", "pillow", "opencv"} <= dict(new.libraries).keys(), new.libraries
    assert baseline_key(old, SERVING, "d", BODY, launch=LAUNCH) != baseline_key(
        new, SERVING, "d", BODY, launch=LAUNCH
    ), "a baseline preprocessed by transformers 4.57.1 answers a run served with 5.19.0"
    assert not new.source_tree and new.cache_refusal is None, "a wheel install is no tree"


def test_the_served_nixl_is_recorded_but_keys_no_baseline(tmp_path: Path) -> None:
    """The GPU workflows pin NIXL to what the served release declares; run.json says which NIXL
    (and which of its CUDA builds) served, so a night that changed it shows. The baseline, one
    monolithic instance, moves nothing through NIXL: its key stays."""
    vllm = install_fake_vllm(tmp_path / "bin", vllm_version="0.32.0", torch_version="2.13.0")
    site = tmp_path / "bin" / "vllm-python" / "site"
    without = probe_served_vllm(str(vllm))
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        info = site / f"{name.replace('-', '_')}-1.5.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.5.0\n")
    served = probe_served_vllm(str(vllm))
    assert served.transfer_libraries == (
        ("nixl", "1.5.0"),
        ("nixl-cu12", "1.5.0"),
        ("nixl-cu13", "1.5.0"),
    )
    assert "nixl" not in dict(served.libraries)
    assert baseline_key(without, SERVING, "d", BODY, launch=LAUNCH) == baseline_key(
        served, SERVING, "d", BODY, launch=LAUNCH
    )


# --- the import probe's verdicts, kept for a test session --------------------------------------


def counting_interpreter(tmp_path: Path, fails: bool = False) -> Path:
    """A `python` that appends a line to `probes` each time it runs, then imports nothing (or
    fails as a missing module does)."""
    python = tmp_path / "python"
    exit_line = "echo \"ModuleNotFoundError: No module named 'nixl'\" >&2; exit 1" if fails else ""
    python.write_text(f'#!/bin/sh\necho "$PYTHONPATH" >> {tmp_path / "probes"}\n{exit_line}\n')
    python.chmod(0o755)
    vllm = tmp_path / "vllm"
    vllm.write_text(f"#!{python}\n")
    vllm.chmod(0o755)
    return vllm


def probes(tmp_path: Path) -> list[str]:
    path = tmp_path / "probes"
    return path.read_text().splitlines() if path.exists() else []


def test_a_session_keeps_an_import_its_interpreter_passed_and_probes_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fake GPU night probed `import nixl._api` again, 3.5 CPU-s (nixl imports torch): 20
    probes in CI. With EPD_HARNESS_IMPORT_CHECK_DIR (a test session's own directory) one
    interpreter is probed once per module and search path."""
    monkeypatch.setenv(IMPORT_CHECK_DIR_ENV, str(tmp_path / "import-check"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    served = dataclasses.replace(SERVED, executable=str(counting_interpreter(tmp_path)))
    check_kv_connector(served, NIXL)
    check_kv_connector(served, NIXL)
    assert probes(tmp_path) == [""]
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")  # another search path may not import it
    check_kv_connector(served, NIXL)
    check_kv_connector(served, NIXL)
    assert probes(tmp_path) == ["", "/elsewhere"]


def test_an_import_that_failed_is_probed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(IMPORT_CHECK_DIR_ENV, str(tmp_path / "import-check"))
    served = dataclasses.replace(SERVED, executable=str(counting_interpreter(tmp_path, True)))
    for _ in range(2):
        with pytest.raises(BadInput, match="No module named 'nixl'"):
            check_kv_connector(served, NIXL)
    assert len(probes(tmp_path)) == 2


def test_without_the_directory_every_run_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's runs keep no verdict: an uninstall between two runs must be seen."""
    monkeypatch.delenv(IMPORT_CHECK_DIR_ENV, raising=False)
    served = dataclasses.replace(SERVED, executable=str(counting_interpreter(tmp_path)))
    check_kv_connector(served, NIXL)
    check_kv_connector(served, NIXL)
    assert len(probes(tmp_path)) == 2


def test_a_kept_import_answers_for_its_own_module_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept verdict is keyed by the module too: an interpreter that imported `nixl._api`
    may still lack another connector's module, which must be probed and refused."""
    monkeypatch.setenv(IMPORT_CHECK_DIR_ENV, str(tmp_path / "import-check"))
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\necho "$2" >> {tmp_path / "probes"}\n'
        'case "$2" in *other_kv*) echo "ModuleNotFoundError: No module named '
        "'other_kv'\" >&2; exit 1;; esac\n"
    )
    python.chmod(0o755)
    vllm = tmp_path / "vllm"
    vllm.write_text(f"#!{python}\n")
    vllm.chmod(0o755)
    served = dataclasses.replace(SERVED, executable=str(vllm))
    other = dataclasses.replace(NIXL, name="other", requires_module="other_kv")
    check_kv_connector(served, NIXL)
    with pytest.raises(BadInput, match="No module named 'other_kv'"):
        check_kv_connector(served, other)
    assert probes(tmp_path) == ["import nixl._api", "import other_kv"]


def test_the_oldest_generations_release_passes_the_version_gate_and_the_one_before_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate refuses what is older than the oldest generation: a patch of that generation's
    own first series (0.27.x) is one the harness speaks, and was refused as untested if the
    series itself counted as older."""
    major, minor = vllm_preflight.GENERATIONS[0].first[:2]
    served = {"version": ""}
    monkeypatch.setattr(
        vllm_preflight, "probe_served_vllm", lambda exe: ServedVllm(exe, served["version"])
    )
    served["version"] = f"{major}.{minor}.1+cpu"
    assert vllm_preflight.check_vllm("/v/vllm", False).version == served["version"]
    served["version"] = f"{major}.{minor - 1}.9+cpu"
    with pytest.raises(BadInput, match="is untested"):
        vllm_preflight.check_vllm("/v/vllm", False)


def test_a_vllm_that_is_no_python_script_has_an_unknown_version_refused_unless_allowed(
    tmp_path: Path,
) -> None:
    """An executable with no `#!` line (a compiled launcher, a wrapper binary) names no
    interpreter to read versions from: its version is "unknown", which the version gate refuses
    and only --allow-untested-vllm lets through. Read as any release, it passed the gate and
    keyed baselines with a version nobody read."""
    executable = tmp_path / "vllm"
    executable.write_bytes(b"\x7fELF\x02\x01\x01\x00not a script\n")
    executable.chmod(0o755)
    served = probe_served_vllm(str(executable))
    assert (served.version, served.known) == ("unknown", False)
    with pytest.raises(BadInput, match="cannot tell which vLLM .* runs"):
        vllm_preflight.check_vllm(str(executable), False)
    assert vllm_preflight.check_vllm(str(executable), True).version == "unknown"


def test_an_edit_staged_with_git_add_is_still_the_edited_code(tmp_path: Path) -> None:
    """`git add` changes nothing vLLM imports: staged or not, an edit is code the installed
    version does not say. Hashed from the unstaged diff alone, a staged edit read as the tree
    as committed, and its EPD answers were judged against the cached baseline of that code."""
    tree = tmp_path / "vllm-src"
    tree.mkdir()
    (tree / "model.py").write_text("SCALE = 1.0\n")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "the tree as installed")
    clean = vllm_preflight.source_state(tree)
    (tree / "model.py").write_text("SCALE = 2.0\n")
    edited = vllm_preflight.source_state(tree)
    git(tree, "add", "-A")
    assert vllm_preflight.source_state(tree) == edited != clean


def test_an_untracked_file_moved_to_another_module_is_other_code(tmp_path: Path) -> None:
    """Where an untracked .py file lies decides what imports it: the same bytes moved from a
    scratch folder into vLLM's package are a module that serves. Hashed by content alone, the
    move kept the state, and the baseline of the code without that module answered for it."""
    tree = tmp_path / "vllm-src"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "the tree as installed")
    (tree / "scratch").mkdir()
    (tree / "scratch" / "patch.py").write_text("SCALE = 2.0\n")
    scratch = vllm_preflight.source_state(tree)
    (tree / "scratch" / "patch.py").rename(tree / "vllm" / "patch.py")
    assert vllm_preflight.source_state(tree) != scratch


def test_an_interpreter_that_fails_after_its_version_record_is_refused(tmp_path: Path) -> None:
    """A served interpreter that prints the version record and then fails (a start-up hook or
    an atexit handler that crashes) is one vLLM's own start fails in too: refused with its
    last error line, not taken at the word of what it printed before failing."""
    interpreter = tmp_path / "python-that-fails"
    answer = tmp_path / "answer"
    answer.write_text(json.dumps({"vllm": "0.32.0+cpu", "torch": "2.13.0"}) + "\n")
    interpreter.write_text(f"#!/bin/sh\ncat {answer}\necho 'Segmentation fault' >&2\nexit 139\n")
    interpreter.chmod(0o755)
    executable = tmp_path / "vllm"
    executable.write_text(f"#!{interpreter}\nimport vllm\n")
    executable.chmod(0o755)
    with pytest.raises(BadInput) as refused:
        probe_served_vllm(str(executable))
    assert str(refused.value) == (
        f"cannot read the vLLM version of {executable}: Segmentation fault"
    )


@pytest.mark.parametrize("version", ["main", "dev0+gabc1234", ""])
def test_a_version_with_no_release_number_is_refused_by_the_version_gate(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """A version string that names no MAJOR.MINOR (a build from a branch that wrote its own)
    tells the gate nothing about the protocol spoken: refused as untested like an older
    release, not let through as if it were one of the harness's."""
    monkeypatch.setattr(vllm_preflight, "probe_served_vllm", lambda exe: ServedVllm(exe, version))
    with pytest.raises(BadInput, match="is untested"):
        vllm_preflight.check_vllm("/v/vllm", False)
    assert vllm_preflight.check_vllm("/v/vllm", True).version == version

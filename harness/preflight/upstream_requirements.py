"""Which version of a KV connector's library (NIXL) the served vLLM declares, for the CUDA its
torch was built for: what the GPU workflows install beside it (`epd-harness
upstream-requirement nixl --cuda-major N`).

A NIXL the served NixlConnector was not written for turns a night red for reasons of the
harness's own making, and every release declares its own: `requirements/kv_connectors.txt`,
and from 0.31 `requirements/kv_connectors_cu12.txt` for a torch built for CUDA 12. vLLM's CI
(`install-kv-connectors.sh`, in its `.buildkite`) installs the second where torch's CUDA major is
12 and the release has it, else the first; so does `kv_connectors_file`. The files are the
served release's own: its sdist's (fetched and cached by `harness.preflight.upstream_proxy`), or
the source tree a development build was built from (`--vllm-source`).

The files are pip requirements files; what is read of them: comments, line continuations,
`-r` / `--requirement` includes (relative to the including file), other option lines (which
declare nothing), and per-requirement options (`--hash`). An environment marker is kept on the
line it guards, for the installer to evaluate in the environment it installs into.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BadInput

KV_CONNECTORS_FILE = "requirements/kv_connectors.txt"
KV_CONNECTORS_CU12_FILE = "requirements/kv_connectors_cu12.txt"
# pip's comment rule: `#` at the start of a line or after whitespace (not inside a URL's `#`).
COMMENT = re.compile(r"(^|\s+)#.*$")
INCLUDE = re.compile(r"^(?:-r\s*|--requirement(?:\s*=\s*|\s+))(\S+)$")
NAME = re.compile(r"^([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")
# The options pip allows after a requirement on its line; they declare no version.
REQUIREMENT_OPTIONS = re.compile(r"\s--(?:hash|config-settings|global-option)\b.*$")
MAX_INCLUDE_DEPTH = 10


@dataclass(frozen=True)
class RequirementLine:
    name: str  # as written
    requirement: str  # the line for pip: name[extras]specifier, then ` ; marker` if any
    file: str  # the file it is in, relative to the tree
    line: int  # its (first) line number there


@dataclass(frozen=True)
class Declared:
    """What a release declares for one package, and where that was read."""

    package: str
    requirements: tuple[str, ...]  # one pip requirement per line that names the package
    file: str  # the file chosen for the CUDA major (the requirements may be in its includes)


def normalized(name: str) -> str:
    """A project name as indexes compare them (PEP 503): `NIXL`, `nixl_` and `nixl.` match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def kv_connectors_file(tree: Path, cuda_major: int) -> str:
    """The file vLLM's own CI installs the KV connectors from for a torch of `cuda_major`."""
    if cuda_major == 12 and (tree / KV_CONNECTORS_CU12_FILE).is_file():
        return KV_CONNECTORS_CU12_FILE
    return KV_CONNECTORS_FILE


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, content) with continuations joined and comments dropped, as pip
    reads them; blank lines are left out."""
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not pending:
            start = number
        if raw.endswith("\\"):
            pending.append(raw[:-1])
            continue
        joined = COMMENT.sub("", "".join([*pending, raw])).strip()
        pending = []
        if joined:
            lines.append((start, joined))
    if pending:
        joined = COMMENT.sub("", "".join(pending)).strip()
        if joined:
            lines.append((start, joined))
    return lines


def pip_requirement(text: str) -> str:
    """A requirement as written, as one pip argument: no spaces in its name and specifier
    (`nixl == 1.5.0` -> `nixl==1.5.0`), its marker kept after ` ; `."""
    text = REQUIREMENT_OPTIONS.sub("", f" {text}").strip()
    requirement, _, marker = text.partition(";")
    name, at, url = requirement.partition("@")
    if at:  # a direct reference: `name @ URL`, the URL left as written
        requirement = f"{''.join(name.split())} @ {url.strip()}"
    else:
        requirement = "".join(requirement.split())
    # a space before `;`: after a URL, PEP 508 would read it as part of the URL
    return f"{requirement} ; {marker.strip()}" if marker.strip() else requirement


def requirement_lines(tree: Path, relative: str, _depth: int = 0) -> list[RequirementLine]:
    """Every requirement `relative` (a path inside `tree`) declares, its includes' in place."""
    path = tree / relative
    if not path.is_file():
        raise FileNotFoundError(relative)
    if _depth > MAX_INCLUDE_DEPTH:
        raise BadInput(
            f"{relative}: requirements files include each other more than "
            f"{MAX_INCLUDE_DEPTH} deep (a cycle?)"
        )
    found: list[RequirementLine] = []
    for number, line in logical_lines(path.read_text(encoding="utf-8", errors="replace")):
        include = INCLUDE.match(line)
        if include is not None:
            target = (Path(relative).parent / include[1]).as_posix()
            if not (tree / target).is_file():
                raise BadInput(
                    f"{relative} line {number} includes {include[1]}, which is not in {tree}"
                )
            found += requirement_lines(tree, target, _depth + 1)
            continue
        if line.startswith("-"):
            continue  # an option (-c, --index-url, -e ...): it declares no package version
        name = NAME.match(line)
        if name is None:
            continue
        found.append(RequirementLine(name[1], pip_requirement(line), relative, number))
    return found


def declared_requirement(tree: Path, package: str, cuda_major: int, where: str) -> Declared:
    """What the release in `tree` declares for `package` with a torch of `cuda_major`; `where`
    names the release and its source in the errors. One clear error when it declares none."""
    chosen = kv_connectors_file(tree, cuda_major)
    try:
        lines = requirement_lines(tree, chosen)
    except FileNotFoundError:
        raise BadInput(
            f"{where} has no {chosen}: it declares no KV connector libraries, so no {package} "
            f"version to install for CUDA {cuda_major}"
        ) from None
    wanted = normalized(package)
    matching = tuple(line.requirement for line in lines if normalized(line.name) == wanted)
    if not matching:
        raise BadInput(
            f"{where}'s {chosen} (for CUDA {cuda_major}) declares no {package}: "
            f"no {package} version to install"
        )
    return Declared(package, matching, chosen)

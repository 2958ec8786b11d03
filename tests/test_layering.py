"""The package's import contracts (pyproject.toml, [tool.importlinter]) hold, and can fail;
and no module of the package imports itself back through others (no cycle).

Stages import only downwards: spec -> outcomes -> serve -> judge -> report -> run -> preflight
-> cli -> testing, with the leaf modules below them all. A newcomer finds a concern by its
folder, and no low stage reaches up for a dataclass or a helper. Judging opens no socket and
starts no process; the fixtures know nothing of the harness.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_the_package_keeps_its_layers() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout, result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The contract is not vacuous: a spec module importing the CLI turns it red."""
    copy_tree(tmp_path)
    topology = tmp_path / "harness" / "spec" / "topology.py"
    topology.write_text(
        topology.read_text() + "\nfrom harness.cli import main as _upward  # noqa\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "harness.spec is not allowed to import harness.cli" in result.stdout, result.stdout


def test_judging_that_reaches_for_a_socket_breaks_its_contract(tmp_path: Path) -> None:
    copy_tree(tmp_path)
    compare = tmp_path / "harness" / "judge" / "compare.py"
    compare.write_text(compare.read_text() + "\nimport socket as _socket  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "harness.judge is not allowed to import socket" in result.stdout, result.stdout


def folders_without_init(root: Path) -> list[str]:
    """Folders of the package holding modules but no `__init__.py`: import-linter does not
    read a namespace folder, so its modules would escape every contract unseen (the fuzz
    folder did, until the export split found it)."""
    return sorted(
        str(folder.relative_to(root))
        for package in ("harness", "fixtures")
        for folder in [root / package, *(root / package).rglob("*")]
        if folder.is_dir()
        and folder.name != "__pycache__"
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
    )


def test_every_folder_of_modules_is_a_package_the_contracts_read() -> None:
    assert folders_without_init(ROOT) == []


def test_a_folder_of_modules_without_init_is_found(tmp_path: Path) -> None:
    copy_tree(tmp_path)
    (tmp_path / "harness" / "run" / "fuzz" / "__init__.py").unlink()
    assert folders_without_init(tmp_path) == ["harness/run/fuzz"]


def test_no_import_cycle_in_the_package() -> None:
    """Every module-level import between the package's modules (TYPE_CHECKING ones included:
    a cycle hidden from the interpreter is still a cycle to a reader)."""
    graph = import_graph(ROOT)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    copy_tree(tmp_path)
    records = tmp_path / "harness" / "outcomes" / "outcome.py"
    records.write_text(records.read_text() + "\nfrom harness.outcomes import taps as _t  # noqa\n")
    taps = tmp_path / "harness" / "outcomes" / "taps.py"
    taps.write_text(taps.read_text() + "\nfrom harness.outcomes import outcome as _o  # noqa\n")
    cycles = find_cycles(import_graph(tmp_path))
    assert any(set(c) >= {"harness.outcomes.outcome", "harness.outcomes.taps"} for c in cycles)


def copy_tree(target: Path) -> None:
    for package in ("harness", "fixtures"):
        shutil.copytree(
            ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (`import a.b`, `from a import b`, `from a.b
    import c`: a submodule when `c` is one, else the module `a.b`)."""
    modules = {}
    for package in ("harness", "fixtures"):
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles

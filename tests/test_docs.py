"""The documentation names what the code does: every environment variable, every linked file."""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from harness import environment

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent


def variables_read_by_the_code() -> set[str]:
    names: set[str] = set()
    # conftest.py's options default to variables (EPD_VLLM_SOURCE, the nightly's), and the
    # Buildkite nightly reads its step's settings: both went undocumented (found in review).
    sources = [
        *(ROOT / "harness").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        ROOT / "scripts" / "cpu",
        ROOT / "conftest.py",
        ROOT / "ci" / "buildkite" / "nightly.sh",
    ]
    for source in sources:
        text = source.read_text(encoding="utf-8")
        names |= set(re.findall(r"""environ(?:\.get)?[(\[]\s*["']([A-Z][A-Z0-9_]+)["']""", text))
        # `CACHE_ENV = "..."`, and a module's own `ENV = "..."` (harness/testing/vllm_source.py)
        names |= set(re.findall(r"""^(?:[A-Z_]+_)?ENV = ["']([A-Z][A-Z0-9_]+)["']""", text, re.M))
        # `${NAME:-default}` in a script, `${{NAME:-...}}` in the f-strings that write the
        # export's scripts (harness/run/export/files.py): both read by what the user runs.
        names |= set(re.findall(r"\$\{\{?([A-Z][A-Z0-9_]+):-", text))
    return names


def test_every_environment_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    read = variables_read_by_the_code() | set(environment.VARIABLES)
    assert {"EPD_HARNESS_CACHE", "EPD_HARNESS_PORT_RANGE", "HF_HUB_CACHE"} <= read, read
    missing = sorted(name for name in read if f"`{name}`" not in doc)
    assert not missing, f"docs/environment.md does not name {missing}"


def test_links_in_the_readme_and_docs_point_at_files_that_exist() -> None:
    broken = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# Paths inside a vLLM sdist that the harness names (it fetches them; they are not ours).
VLLM_SDIST_PREFIXES = ("tests/v1/", "examples/")
# A repository path: starts at one of our top-level folders, not inside another word or path
# (e.g. `~/.cache/epd-harness/baseline` is no reference to a `harness/baseline`).
REPO_PATH = re.compile(
    r"(?<![\w./~-])((?:harness|scenarios|tests|docs|scripts|fixtures|\.github)/[\w./-]*\w)"
)


def test_every_repository_path_named_in_code_and_docs_exists() -> None:
    """A docstring or page pointing at a module that moved is how a newcomer gets lost."""
    sources = [
        ROOT / "README.md",
        ROOT / "conftest.py",
        ROOT / "pyproject.toml",
        ROOT / "tox.ini",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "scripts").iterdir(),
        *(
            p
            for d in ("harness", "scenarios", "tests", "fixtures")
            for p in (ROOT / d).rglob("*.py")
        ),
    ]
    missing = set()
    for source in sources:
        if not source.is_file() or source == Path(__file__):  # this file names examples
            continue
        for path in REPO_PATH.findall(source.read_text(encoding="utf-8")):
            if not path.startswith(VLLM_SDIST_PREFIXES) and not (ROOT / path).exists():
                missing.add(f"{source.relative_to(ROOT)} -> {path}")
    assert not missing, sorted(missing)


def test_every_script_the_project_names_exists() -> None:
    """`doctor` and pyproject.toml once pointed at a setup script that never existed (trap 5 of
    issue 8; tests/test_traps.py pins the others)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    sources = [
        p
        for p in tracked
        if p.endswith((".py", ".toml", ".md", ".ini", ".yml", ".yaml"))
        or p in (".ci/run", "scripts/cpu")
    ]
    named: dict[str, str] = {}
    for source in sources:
        text = (ROOT / source).read_text(encoding="utf-8")
        for match in re.finditer(r"\bscripts/([A-Za-z0-9_.-]+[A-Za-z0-9_])", text):
            named.setdefault(f"scripts/{match[1]}", source)
    missing = {script: where for script, where in named.items() if not (ROOT / script).exists()}
    assert named, "the scan found no reference at all: it would pass vacuously"
    assert not missing, f"named but missing (script: where): {missing}"


def test_every_module_the_project_tells_python_to_run_exists() -> None:
    """The export's refusal for a model directory that is gone told users to rebuild the tiny
    model with the module `harness.fixtures.tiny_model`, which never existed (fixtures/ is a
    top-level package): following the advice ended on 'No module named harness.fixtures'."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    named: dict[str, str] = {}
    for source in tracked:
        if not (
            source.endswith((".py", ".md", ".toml", ".ini", ".yml", ".yaml", ".sh"))
            or source in (".ci/run", "scripts/cpu")
        ):
            continue
        text = (ROOT / source).read_text(encoding="utf-8")
        for match in re.finditer(r"\bpython3? -m ((?:harness|fixtures)(?:\.\w+)+)", text):
            named.setdefault(match[1], source)
    missing = {
        module: where
        for module, where in named.items()
        if not (ROOT / f"{module.replace('.', '/')}.py").is_file()
        and not (ROOT / module.replace(".", "/") / "__main__.py").is_file()
    }
    assert named, "the scan found no reference at all: it would pass vacuously"
    assert not missing, f"named but missing (module: where): {missing}"


# A dotted name in inline code (`harness.outcomes.taps.records_of`, `placement.side_by_side`,
# `run.pool.TopologyPool`), not a file name (`run.json`, `engine.so`).
DOTTED = re.compile(r"(?<![\w./-])([a-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"py", "json", "jsonl", "md", "txt", "html", "sh", "so", "log", "yaml", "yml"}


def top_level_names(module: Path) -> set[str]:
    """What `module` defines at its top level, and what its `__all__` re-exports."""
    names: set[str] = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names |= set(ast.literal_eval(node.value))
    return names


def test_every_module_member_the_docs_name_is_defined_there() -> None:
    """proxies.md sent readers to `harness.serve.tap.records_of` and versions.md to
    `proxy_protocol.ec_item_entry`: both functions had moved (to `harness.outcomes.taps` and
    `harness.spec.generations`) and were only imported there. A full `harness.`/`fixtures.` name
    must be defined in its module; a short one (`placement.side_by_side`, `run.pool.TopologyPool`)
    must be defined in a module of that name, where the name is one a module of ours defines."""
    modules: dict[str, Path] = {}  # dotted name -> file
    for package in ("harness", "fixtures"):
        for file in (ROOT / package).rglob("*.py"):
            parts = file.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    places: dict[str, list[list[str]]] = defaultdict(list)  # a module's name -> its packages
    for dotted in modules:
        *package, name = dotted.split(".")
        places[name].append(package)
    names = {dotted: top_level_names(file) for dotted, file in modules.items()}
    defined_somewhere = set().union(*names.values())

    def defined(module: str, rest: list[str]) -> bool:
        return not rest or rest[0] in names[module]

    wrong, checked = [], 0
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = page.read_text(encoding="utf-8")
        for span in re.finditer(r"`([^`\n]+)`", text):
            for reference in DOTTED.findall(span[1]):
                parts = reference.split(".")
                if parts[-1] in FILE_SUFFIXES:
                    continue
                full = parts[0] in ("harness", "fixtures")
                # A short name is read under `harness.` and under every package holding a
                # module of its first part's name (`judging` is both run's and testing's).
                packages = [[]] if full else [["harness"], *places[parts[0]]]
                readings = [
                    (module, parts[length:])  # the module, and what the reference names in it
                    for package in packages
                    for length in range(len(parts), 0, -1)
                    if (module := ".".join(package + parts[:length])) in modules
                ]
                if not readings:
                    continue  # not one of our modules (`vllm.general_plugins`)
                checked += 1
                if any(defined(module, rest) for module, rest in readings):
                    continue
                # A short name whose member no module of ours defines is no reference to our
                # code (`proxy.attach` is a key of run.json, `proxy` a module too).
                if full or any(rest[0] in defined_somewhere for _, rest in readings):
                    line = text.count("\n", 0, span.start()) + 1
                    wrong.append(f"{page.relative_to(ROOT)}:{line}: {reference}")
    assert checked > 10, f"only {checked} references checked: the scan broke"
    assert not wrong, wrong


# Names of other projects' code, configuration and logs that the docs quote, each read in that
# project, not in ours: (the name, whose it is).
FOREIGN_NAMES: dict[str, str] = {
    "agent_config": "NIXL's nixl_agent_config field (connectors.md)",
    "busy_loop_s": "vLLM's SpinCondition (shm_broadcast.py)",
    "ec_buffer_device": "vLLM's Mooncake EC connector config",
    "ec_buffer_size": "vLLM's Mooncake EC connector config",
    "ec_enable_nixl": "vLLM's EC connector config",
    "ec_ip": "vLLM's Mooncake EC connector config",
    "ec_port": "vLLM's Mooncake EC connector config",
    "enable_prog_thread": "NIXL's agent config",
    "failure_policy": "vLLM's NIXL connector, in its log",
    "get_data_parser": "vLLM's Qwen2-VL processing info",
    "get_ip": "vLLM's Mooncake EC connector",
    "get_new_notifs": "NIXL's agent API",
    "handshake_setup_failed": "NIXL's transfer failure, in vLLM's log",
    "mooncake_protocol": "vLLM's Mooncake EC connector config",
    "nixl_agent_config": "NIXL's agent config, as vLLM passes it",
    "num_computed_tokens": "vLLM's scheduler",
    "num_preemptions": "vLLM's scheduler",
    "num_threads": "NIXL's agent config",
    "num_tokens_to_check": "vLLM's KV connector lookup",
    "peer_host": "vLLM's EC connector metadata",
    "peer_port": "vLLM's EC connector metadata",
    "prefill_stats": "vLLM's scheduler",
    "run_baseline": "a stage of vLLM's run_epd_correctness_test.sh",
    "sched_yield": "the Linux system call",
    "session_id": "vLLM's disagg_epd_proxy.py",
    "start_load_caches": "vLLM's EC connector",
    "use_audio_in_video": "vLLM's and Transformers' multimodal processing",
}
# A snake_case name standing alone in inline code (`judge_example`, `stage_of`), not part of a
# path, a dotted name or a flag; a pytest `-k` expression matches part of a name, so it is left
# out first.
LONE_NAME = re.compile(r"(?<![\w./:-])([a-z]+(?:_[a-z0-9]+)+)(?![\w/-])")
PYTEST_K = re.compile(r"-k\s+\S+")


def lone_names_in_the_docs() -> dict[str, list[str]]:
    """Each lone snake_case name of the README's and docs' inline code -> where it stands."""
    where: dict[str, list[str]] = defaultdict(list)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "bad-input.md":  # generated from the code's own messages
            continue
        text = page.read_text(encoding="utf-8")
        for span in re.finditer(r"(?<!`)`([^`\n]+)`", text):
            for name in LONE_NAME.findall(PYTEST_K.sub("", span[1])):
                line = text.count("\n", 0, span.start()) + 1
                where[name].append(f"{page.relative_to(ROOT)}:{line}")
    return where


def test_every_lone_name_the_docs_show_is_one_the_project_uses() -> None:
    """fuzzing.md said a revived instance's prefix cache is forgotten by `consumer_restarted`:
    renamed `ConsumerState.restarted`, it was no word of the code any more, and only dotted
    names were checked (above). A lone name must be a word of some tracked file that is not
    documentation (code, a workflow, a script, a key of a JSON file), or another project's."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    words: set[str] = set()
    for path in tracked:
        # This file names examples, and lists the foreign names.
        if not path.endswith(".md") and (ROOT / path).is_file() and ROOT / path != Path(__file__):
            words |= set(re.findall(r"\w+", (ROOT / path).read_text(encoding="utf-8")))
    shown = lone_names_in_the_docs()
    assert len(shown) > 100, f"only {len(shown)} names found: the scan broke"
    unknown = {name: at for name, at in shown.items() if name not in words | set(FOREIGN_NAMES)}
    assert not unknown, f"named in the docs, no word of the project's code: {unknown}"
    stale = sorted(set(FOREIGN_NAMES) - set(shown))
    assert not stale, f"FOREIGN_NAMES lists names no page shows any more: {stale}"
    ours = sorted(set(FOREIGN_NAMES) & words)
    assert not ours, f"FOREIGN_NAMES lists names the project's code uses: {ours}"


def test_every_module_of_the_package_is_on_its_map() -> None:
    """docs/architecture.md maps the package module by module, and a newcomer reads it to find
    where a concern lives. Eighteen modules added since it was written were on no line of it
    (`harness/cli/releases.py`, `harness/run/faults/encoded.py`, `harness/serve/cpu_account.py`
    among them: found walking the docs as a new user): the map said a folder held its listed
    modules and no other."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    modules = [
        p
        for d in ("harness", "fixtures")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p.name != "__init__.py"
    ]
    assert len(modules) > 100, "the scan found too few modules: it would pass vacuously"
    unmapped = [str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{p.stem}\b", page)]
    assert not unmapped, f"docs/architecture.md does not name {unmapped}"

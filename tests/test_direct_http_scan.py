"""No module of the harness makes an HTTP call through a client that follows the environment's
HTTP(S)_PROXY, but for the few that fetch from the internet, where a runner's proxy is the way
out; and the harness keeps one direct urllib opener (`harness.serve.http_direct`), not a copy
per module.

A scan of the source, so that a new caller is caught before a runner with a proxy meets it;
`tests/test_direct_http.py` asks a stand-in server through each caller with a dead proxy set.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.check

HARNESS = Path(__file__).resolve().parent.parent / "harness"
# The one place the direct opener is built.
DIRECT_HTTP = "serve/http_direct.py"
# Modules whose calls go to the internet: the environment's proxy is how a runner reaches it.
REMOTE = {
    "preflight/package_index.py": "asks the package index (PyPI or the pip-configured one)",
    "preflight/upstream_proxy.py": "downloads a vLLM release's files from the package index",
}
# Scripts that run without the harness, so cannot import its opener: each builds its own.
STANDALONE = {
    "run/export/standalone_check.py": "an export's check.py, on the standard library alone",
    "testing/fake_vllm_server/engine.py": "the fake vLLM, run as a script beside its modules",
}


def dotted(node: ast.expr) -> str:
    """`a.b.c` for a name or attribute chain, '' for anything else."""
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return node.id if isinstance(node, ast.Name) else ""


def keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value == value
        for k in call.keywords
    )


def proxied_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) for each call in `source` that follows the environment's proxy settings,
    and each direct opener built."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "urllib.request":
            if any(alias.name == "urlopen" for alias in node.names):
                found.append((node.lineno, "urlopen imported"))
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func).rsplit(".", 1)[-1]
        if name == "urlopen":
            found.append((node.lineno, "urlopen (follows HTTP_PROXY)"))
        elif name == "build_opener":
            found.append((node.lineno, "an opener of its own"))
        elif name in ("Client", "AsyncClient") and dotted(node.func).startswith("httpx"):
            if not keyword_is(node, "trust_env", False):
                found.append((node.lineno, f"httpx.{name} without trust_env=False"))
        elif name == "ClientSession" and keyword_is(node, "trust_env", True):
            found.append((node.lineno, "aiohttp.ClientSession(trust_env=True)"))
    return found


def test_the_scan_sees_each_kind_of_proxied_call() -> None:
    source = (
        "import urllib.request, httpx, aiohttp\n"
        "from urllib.request import urlopen\n"
        "urllib.request.urlopen('http://127.0.0.1:1')\n"
        "urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
        "httpx.Client(timeout=1)\n"
        "httpx.AsyncClient(trust_env=True)\n"
        "httpx.Client(trust_env=False)\n"
        "aiohttp.ClientSession(trust_env=True)\n"
        "aiohttp.ClientSession()\n"
    )
    assert [line for line, _ in proxied_calls(source)] == [2, 3, 4, 5, 6, 8]


def test_no_module_calls_a_server_through_the_environments_proxy() -> None:
    found = []
    for path in sorted(HARNESS.rglob("*.py")):
        name = path.relative_to(HARNESS).as_posix()
        if name in REMOTE:
            continue
        own_opener_allowed = name == DIRECT_HTTP or name in STANDALONE
        for line, what in proxied_calls(path.read_text()):
            if own_opener_allowed and what == "an opener of its own":
                continue
            found.append(f"harness/{name}:{line}: {what}")
    assert not found, "\n".join(found)


def test_the_direct_opener_is_built_once() -> None:
    built = proxied_calls((HARNESS / DIRECT_HTTP).read_text())
    assert [what for _, what in built] == ["an opener of its own"]

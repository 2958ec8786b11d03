"""The attach file (`--attach FILE`), read and checked: one BadInput line per problem.

A misread attach file would judge the wrong deployment, or judge the right one by the wrong
rule, and say so only after the baseline ran. So every field is checked before anything
starts: unknown fields and roles are refused (a misspelt `ec_storge` would otherwise turn a
checkable guard into an unchecked one without a word), the roles must make a known topology
(and the one the file names, if it names one), URLs must be http(s) URLs without a path or
credentials (they would reach run.json), none twice, and the EC storage must be a directory
this machine can read. What the file means is documented in `harness.spec.attach`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness.errors import BadInput
from harness.preflight.files import kind_of, load_json_or_yaml
from harness.spec.attach import (
    ATTACH_ROLES,
    AttachSpec,
    attached_instances,
    describe_roles,
    topology_of_roles,
)
from harness.spec.connectors import KV_CONNECTORS
from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, Role

FIELDS = ("topology", "proxy", "instances", "ec_storage", "kv_connector")
INSTANCE_FIELDS = ("role", "url")


def load_attach_file(path: str, default_kv_connector: str) -> AttachSpec:
    """The deployment the file describes; `default_kv_connector` (the platform's) applies
    when the file names none."""
    source = Path(path).expanduser().resolve()
    where = f"attach file {source}"
    data = load_json_or_yaml(source, where)
    if not isinstance(data, dict):
        raise BadInput(f"{where}: expected a mapping with proxy and instances, got {kind_of(data)}")
    unknown = sorted(set(data) - set(FIELDS), key=str)
    if unknown:
        raise BadInput(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if "proxy" not in data:
        raise BadInput(f"{where}: no 'proxy': the URL the EPD requests are sent to")
    proxy_url = _url(data["proxy"], f"{where}: 'proxy'")
    roles_and_urls = _instances(data.get("instances"), where)
    roles = [role for role, _ in roles_and_urls]
    topology = topology_of_roles(roles)
    if topology is None:
        known = "; ".join(
            f"{name} = {describe_roles(TOPOLOGIES[name].roles)}"
            for name in (*EPD_TOPOLOGY_NAMES, "2E+1PD")
        )
        raise BadInput(
            f"{where}: the roles {describe_roles(roles)} make no known topology ({known})"
        )
    named = data.get("topology")
    if named is not None and named != topology.name:
        if not isinstance(named, str) or named not in TOPOLOGIES or named == "baseline":
            raise BadInput(
                f"{where}: 'topology' {named!r} is not an EPD topology "
                f"(known: {', '.join(n for n in TOPOLOGIES if n != 'baseline')})"
            )
        raise BadInput(
            f"{where}: 'topology' is {named} ({describe_roles(TOPOLOGIES[named].roles)}), "
            f"but the instances are {describe_roles(roles)}, which make {topology.name}"
        )
    urls = [proxy_url, *(url for _, url in roles_and_urls)]
    # Host names are case-blind: http://H:2 is http://h:2 (found in review).
    same = [url.lower() for url in urls]
    repeated = next((url for url in urls if same.count(url.lower()) > 1), None)
    if repeated is not None:
        raise BadInput(f"{where}: {repeated} is listed twice: every instance has its own URL")
    return AttachSpec(
        source=source,
        topology=topology,
        proxy_url=proxy_url,
        instances=attached_instances(topology, roles_and_urls),
        ec_storage=_ec_storage(data.get("ec_storage"), topology.has_ec_transfer, where, source),
        kv_connector=_kv_connector(
            data.get("kv_connector"), default_kv_connector, topology.has_kv_transfer, where
        ),
    )


def _instances(value: Any, where: str) -> list[tuple[Role, str]]:
    if value is None:
        raise BadInput(f"{where}: no 'instances': list each instance's role and url")
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else kind_of(value)
        raise BadInput(f"{where}: 'instances' must list {{role, url}} mappings, got {got}")
    found: list[tuple[Role, str]] = []
    for number, entry in enumerate(value, start=1):
        at = f"{where}: instance {number}"
        if not isinstance(entry, dict):
            raise BadInput(f"{at}: expected a mapping with role and url, got {kind_of(entry)}")
        unknown = sorted(set(entry) - set(INSTANCE_FIELDS), key=str)
        if unknown:
            raise BadInput(f"{at}: unknown field {unknown[0]!r} (fields: role, url)")
        role_name = entry.get("role")
        if not isinstance(role_name, str | None):  # a list or mapping cannot name a role
            raise BadInput(
                f"{at}: 'role' must be one of {', '.join(ATTACH_ROLES)}, got {kind_of(role_name)}"
            )
        if role_name not in ATTACH_ROLES:
            shown = "no role" if role_name is None else f"unknown role {role_name!r}"
            raise BadInput(f"{at}: {shown} (roles: {', '.join(ATTACH_ROLES)})")
        if "url" not in entry:
            raise BadInput(f"{at}: no 'url'")
        found.append((ATTACH_ROLES[role_name], _url(entry["url"], f"{at}: 'url'")))
    return found


def _url(value: Any, at: str) -> str:
    """An http(s) URL with a host and port, and nothing after them (paths are the harness's)."""
    if not isinstance(value, str):
        raise BadInput(f"{at} must be a URL (a string), got {kind_of(value)}")
    if value != value.strip():  # urllib would strip them and httpx not (found in review)
        raise BadInput(f"{at} {value!r} has spaces around it")
    url = value.rstrip("/")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise BadInput(f"{at} {value!r} is not a URL: {exc}") from None
    if "@" in parts.netloc:  # before any message that would repeat it (found in review)
        root = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        raise BadInput(
            f"{at} has credentials in it (user:password@), which the harness would write into "
            f"run.json and its logs and cannot send with every request; give {root}"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise BadInput(f"{at} {value!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f"{at} {value!r} is not an http(s) URL such as http://10.0.0.5:8000")
    # A bare '?' or '#' (an empty query) still takes the paths the harness appends.
    if parts.path or "?" in url or "#" in url:
        raise BadInput(
            f"{at} {value!r} has a path; give the server's root, e.g. "
            f"{parts.scheme}://{parts.netloc}"
        )
    if not port:  # no port, or port 0, which no server listens on (found in review)
        raise BadInput(f"{at} {value!r} names no port")
    return url


def _ec_storage(value: Any, has_encoders: bool, where: str, source: Path) -> Path | None:
    if value is None:
        return None
    if not has_encoders:
        raise BadInput(f"{where}: 'ec_storage' is the encoders' directory, and there is no encoder")
    if not isinstance(value, str) or not value:
        raise BadInput(f"{where}: 'ec_storage' must be a directory path, got {kind_of(value)}")
    path = (source.parent / Path(value).expanduser()).resolve()
    if not path.is_dir():
        raise BadInput(
            f"{where}: 'ec_storage' {path} is not a directory on this machine (drop the "
            "field if the storage is not reachable from here: its guard is then not checkable)"
        )
    return path


def _kv_connector(value: Any, default: str, has_decode: bool, where: str) -> str:
    if value is None:
        return default
    if not has_decode:
        raise BadInput(
            f"{where}: 'kv_connector' says how P's KV reaches D, and there is no decode instance"
        )
    if not isinstance(value, str) or value not in KV_CONNECTORS:
        shown = repr(value) if isinstance(value, str) else kind_of(value)
        raise BadInput(
            f"{where}: unknown 'kv_connector' {shown} (known: {', '.join(KV_CONNECTORS)})"
        )
    return value

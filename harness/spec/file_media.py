"""The media a request reads from files: what a key of its answer must hold besides the body.

A file:// URL names media, it is not the media: the file may be replaced in place (a
--media-dir of the same names, another video), and a key made of the request body alone
would hand the old file's answer (a cached baseline, a golden, a token count) to the new one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILE_URL_PREFIX = "file://"
UNREADABLE = "unreadable"  # the run refuses it with its own clear line (preflight)


def file_urls(value: Any) -> set[str]:
    """Every file:// URL anywhere in a request body (media parts, at any depth)."""
    if isinstance(value, str):
        return {value} if value.startswith(FILE_URL_PREFIX) else set()
    if isinstance(value, Mapping):
        return {url for item in value.values() for url in file_urls(item)}
    if isinstance(value, list | tuple):
        return {url for item in value for url in file_urls(item)}
    return set()


def file_media_digests(body: Any) -> dict[str, str]:
    """Each file:// URL of `body` -> the sha256 of the file's bytes now (or "unreadable")."""
    digests = {}
    for url in sorted(file_urls(body)):
        try:
            digests[url] = hashlib.sha256(
                Path(url[len(FILE_URL_PREFIX) :]).read_bytes()
            ).hexdigest()
        except OSError:
            digests[url] = UNREADABLE
    return digests

"""``GET {basePath}/downloads/bcd/{version}/linux-{arch}``: the bcd artifact, unauthenticated.

Served from the directory given to ``better-compute serve --downloads DIR``, laid out
as ``DIR/bcd/<version>/linux-<arch>`` (what ``packaging/build_artifact.py --out DIR``
writes). The path is matched as a whole against a strict pattern before any file is
looked at (a version like ``1.2.3`` or ``1.2.3-rc.1``, an arch of amd64 or arm64), so
nothing else under DIR, and nothing outside it, can be named; anything else is 404.
The file must be a regular file; it is streamed in chunks.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from control.errors import ControlError
from control.http import Response

PREFIX = "/downloads/"
CHUNK = 256 * 1024
MAX_BYTES = 512 * 1024 * 1024
_PATH = re.compile(
    r"/downloads/bcd/([0-9]{1,6}\.[0-9]{1,6}\.[0-9]{1,6}(?:[-+][0-9A-Za-z]{1,20}(?:\.[0-9A-Za-z]{1,20}){0,4})?)"
    r"/linux-(amd64|arm64)"
)


def artifact_path(root: Path, path: str) -> Path | None:
    """The file a request path names under ``root``, or None when it names nothing allowed."""
    m = _PATH.fullmatch(path)
    if m is None:
        return None
    return root / "bcd" / m.group(1) / f"linux-{m.group(2)}"


def _servable(path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    # Opened here, when the body is sent, so an answer never sent leaves nothing open.
    fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while chunk := await trio.to_thread.run_sync(os.read, fd, CHUNK):
            yield chunk
    finally:
        os.close(fd)


async def serve_download(root: Path | None, method: str, path: str) -> Response:
    """The answer to ``method path`` (the part after the base path)."""
    target = artifact_path(root, path) if root is not None else None
    if target is None:
        raise ControlError("NOT_FOUND", "no such download")
    if method != "GET":
        raise ControlError("NOT_FOUND", "no such download")
    if not await trio.to_thread.run_sync(_servable, target):
        raise ControlError("NOT_FOUND", "no such download")
    headers = [
        ("content-type", "application/octet-stream"),
        ("content-disposition", f'attachment; filename="bcd-{target.parent.name}-{target.name}"'),
    ]
    return Response(200, headers=headers, stream=_chunks(target))

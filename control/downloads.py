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


def open_inside(root: Path, target: Path) -> int | None:
    """Open ``target`` for reading, a regular file of at most MAX_BYTES reached from
    ``root`` without following any symbolic link on the way (a link planted inside the
    downloads directory must not serve /etc/shadow); None when it is not one."""
    parts = target.relative_to(root).parts
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        found = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
    except OSError:  # ELOOP for a link, ENOENT, ENOTDIR …
        return None
    finally:
        os.close(fd)
    st = os.fstat(found)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
        os.close(found)
        return None
    return found


def _servable(root: Path, path: Path) -> bool:
    fd = open_inside(root, path)
    if fd is None:
        return False
    os.close(fd)
    return True


async def _chunks(root: Path, path: Path) -> AsyncIterator[bytes]:
    # Opened here, when the body is sent, so an answer never sent leaves nothing open.
    fd = await trio.to_thread.run_sync(open_inside, root, path)
    if fd is None:
        return
    try:
        while chunk := await trio.to_thread.run_sync(os.read, fd, CHUNK):
            yield chunk
    finally:
        os.close(fd)


async def serve_download(root: Path | None, method: str, path: str) -> Response:
    """The answer to ``method path`` (the part after the base path)."""
    target = artifact_path(root, path) if root is not None else None
    if target is None or root is None:
        raise ControlError("NOT_FOUND", "no such download")
    if method != "GET":
        raise ControlError("NOT_FOUND", "no such download")
    if not await trio.to_thread.run_sync(_servable, root, target):
        raise ControlError("NOT_FOUND", "no such download")
    headers = [
        ("content-type", "application/octet-stream"),
        ("content-disposition", f'attachment; filename="bcd-{target.parent.name}-{target.name}"'),
    ]
    return Response(200, headers=headers, stream=_chunks(root, target))

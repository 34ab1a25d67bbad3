"""The one secure-filesystem module: every writer of keys, tokens and identities uses it.

Files are written through a temporary file in the same directory, created with
``O_CREAT | O_EXCL`` and an explicit mode, fsynced, renamed into place, and the
directory is fsynced, so a crash leaves either the old file or the new one, never
half of one. Nothing here follows a symlink an attacker could have planted at the
final name: ``rename`` replaces the link itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path


class NotRegularFile(Exception):
    """Raised by :func:`read_regular_file` for a FIFO, a device, a socket and the like."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class FileTooLarge(Exception):
    """Raised by :func:`read_regular_file` for a file over its limit."""


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``a FIFO``, ``a character device``, ..."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_regular_file(
    path: Path,
    limit: int,
    *,
    follow: bool = True,
    judge: Callable[[os.stat_result], None] | None = None,
) -> bytes:
    """A regular file's content, judged before it is read and read bounded.

    Opened with ``O_NONBLOCK``, so opening a FIFO does not wait for a writer; then
    ``fstat`` decides: a directory raises ``IsADirectoryError``, anything else that is
    not a regular file (a FIFO, ``/dev/zero``, a socket) :class:`NotRegularFile`, a
    size over ``limit`` :class:`FileTooLarge`, and so does a file that grows past
    ``limit`` while it is read (at most ``limit + 1`` bytes are ever read). A symlink
    is followed (a configuration may be one) unless ``follow`` is false: then a symlink
    at ``path`` is :class:`NotRegularFile`. ``judge`` sees the opened file's ``fstat``
    (its owner and mode, with no window for a swap) before a byte is read, and may
    raise. Other errors are the ``OSError``.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise NotRegularFile("a symbolic link") from exc
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(file_kind(st.st_mode))
        if st.st_size > limit:
            raise FileTooLarge(str(path))
        if judge is not None:
            judge(st)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(65536, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileTooLarge(str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry change (a rename, a create) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path, mode: int = 0o700) -> None:
    """Create ``path`` (and parents) if needed and give it exactly ``mode``."""
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically with exactly ``mode``.

    Either the previous content or the complete new content is at ``path`` after a
    crash at any instant.
    """
    directory = path.parent
    tmp = directory / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def create_new(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a new file; raise ``FileExistsError`` if anything is at ``path``.

    The content appears complete or not at all: it is written to a temporary file and
    linked into place with ``link``, which fails if the name exists.
    """
    directory = path.parent
    tmp = directory / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.link(tmp, path)
        fsync_dir(directory)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def remove(path: Path) -> bool:
    """Remove a file if present; return whether something was removed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def remove_stale_temps(directory: Path, names: tuple[str, ...]) -> list[Path]:
    """Remove the temporary files a crash inside :func:`atomic_write` left for ``names``.

    They may hold a private key; only regular files of exactly our pattern go.
    """
    removed = []
    for name in names:
        for path in directory.glob(f".{name}.*.tmp"):
            suffix = path.name[len(name) + 2 : -len(".tmp")]
            if len(suffix) == 12 and all(c in "0123456789abcdef" for c in suffix):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    os.unlink(path)
                    removed.append(path)
    if removed:
        fsync_dir(directory)
    return removed


def writers_problem(path: Path, st: os.stat_result, holds: str, chmod: str = "go-w") -> str | None:
    """Why a file that decides what is trusted could be changed by others, or None.

    Only root or the running user may own it and nobody else may write it; ``holds``
    says what the file decides ("it holds the pins bcd trusts") and ``chmod`` the
    mode change that mends it.
    """
    if st.st_uid not in (0, os.geteuid()):
        return (
            f"{path} is owned by uid {st.st_uid}, not root or this user; {holds}: chown root {path}"
        )
    if st.st_mode & 0o022:
        return (
            f"{path} can be changed by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"{holds}: chmod {chmod} {path}"
        )
    return None

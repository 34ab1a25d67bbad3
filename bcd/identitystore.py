"""Where the identity lives: the store LoadState reads and the renewal writes.

:class:`IdentityStore` is what :mod:`bcd.loadstate` and :mod:`bcd.persist` need of a
data directory: a :class:`Snapshot` of the three files (identity.json, node.key,
node.key.next) and the few changes a load or a renewal makes. Two backends:

- :class:`DirectoryStore`, the data directory of today. Every file is read without
  following a symlink and must be private (:func:`check_private`): owned by one of
  the trusted uids (root and the user running bcd, plus the ``[helper]`` user:
  :func:`bcd.config.trusted_owners`); the directory neither readable nor writable by
  group or other (0700, or 0711), identity.json not writable by them, node.key and
  node.key.next without any group or other bit (0600 or 0400). Writes go through
  :mod:`bcd.fs` (0600, atomically).
- :class:`MemoryStore`, the same three files in a dict, for thousands of nodes in one
  process (a fleet simulator) and for tests of LoadState without a disk.

A store reports what it holds; it decides nothing (:func:`bcd.loadstate.decide` does).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bcd import fs
from bcd.errors import IdentityError
from bcd.identitydoc import (
    IDENTITY_FILE,
    MAX_IDENTITY_BYTES,
    MAX_KEY_BYTES,
    NEXT_KEY_FILE,
    NODE_KEY_FILE,
    REFUSED_NEXT_SUFFIX,
    WAY_BACK,
)

log = logging.getLogger("bcd.identity")

# --- reading the data directory ---------------------------------------------------


def _symlink_refused(path: Path) -> IdentityError:
    return IdentityError(f"{path} is a symbolic link, which bcd refuses; {WAY_BACK}")


def default_owners() -> frozenset[int]:
    """The uids trusted without a configuration: root and the user running bcd."""
    return frozenset({0, os.geteuid()})


def trusted(owners: Iterable[int] | None) -> frozenset[int]:
    return default_owners() if owners is None else frozenset(owners) | {0}


DIR_MASK = 0o066
"""The data directory: no other user may list it or create, rename or remove in it
(search permission alone, 0711, lets no one read or change anything)."""
PUBLIC_FILE_MASK = 0o022
"""identity.json holds only public values: no other user may write it."""
KEY_FILE_MASK = 0o077
"""node.key and node.key.next: no other user may read or write them (0600 or 0400)."""


def not_private(st: os.stat_result, owners: frozenset[int], mask: int) -> str | None:
    """Why a file or directory with ``st`` is not private to bcd, in short; None if it is."""
    if st.st_uid not in owners:
        return (
            f"it is owned by uid {st.st_uid}, which is not root, the user running bcd or the "
            "[helper] user"
        )
    mode = stat.S_IMODE(st.st_mode)
    bits = mode & mask
    if bits:
        verbs = [v for v, m in (("read", 0o044), ("write", 0o022), ("execute", 0o011)) if bits & m]
        return f"it is mode {mode:04o}: other users can {' and '.join(verbs)} it"
    return None


def private_problem(
    path: Path, st: os.stat_result, owners: frozenset[int], mask: int
) -> str | None:
    """Why ``path`` (its ``st``) is not private to bcd, with the way back; None when it is.

    Private: owned by one of ``owners`` and without a permission bit of ``mask`` for
    group or other (:data:`DIR_MASK`, :data:`PUBLIC_FILE_MASK`, :data:`KEY_FILE_MASK`),
    so no other user can read a private key or plant, swap or change a file.
    """
    why = not_private(st, owners, mask)
    if why is None:
        return None
    directory = stat.S_ISDIR(st.st_mode)
    what = "the data directory " if directory else ""
    if st.st_uid not in owners:
        back = f"check what is in it, then give it back: chown root {path}"
        back += f" (under [helper]: chown <helper user> {path})"
    else:
        back = f"make it its owner's alone: chmod {'0700' if directory else '0600'} {path}"
        if mask == KEY_FILE_MASK and stat.S_IMODE(st.st_mode) & 0o044:
            back += f" (another user may have read the key: {WAY_BACK})"
    return f"{what}{path} is not private ({why}), so bcd does not trust it; {back}"


def check_private(
    path: Path, st: os.stat_result, mask: int, owners: Iterable[int] | None = None
) -> None:
    """Raise IdentityError (:func:`private_problem`) unless ``path`` is private to bcd."""
    problem = private_problem(path, st, trusted(owners), mask)
    if problem is not None:
        raise IdentityError(problem)


def open_regular(path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
    """A regular file's content and stat, never through a symlink; None when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink_refused(path) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"{path} is not a regular file; {WAY_BACK}")
        if st.st_size > limit:
            raise IdentityError(f"{path} is too large; {WAY_BACK}")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise IdentityError(f"{path} is too large; {WAY_BACK}")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def read_regular(
    path: Path, limit: int, owners: frozenset[int] | None = None, mask: int = KEY_FILE_MASK
) -> bytes | None:
    """:func:`open_regular`'s content; with ``owners``, the file must be private too."""
    found = open_regular(path, limit)
    if found is None:
        return None
    raw, st = found
    if owners is not None:
        check_private(path, st, mask, owners)
    return raw


def _data_dir_stat(data_dir: Path) -> os.stat_result | None:
    try:
        st = os.lstat(data_dir)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IdentityError(f"cannot read {data_dir}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise IdentityError(f"the data directory {data_dir} is not a directory")
    return st


def data_dir_exists(data_dir: Path) -> bool:
    return _data_dir_stat(data_dir) is not None


def check_data_dir(data_dir: Path, owners: Iterable[int] | None = None) -> bool:
    """Whether the data directory exists; raise IdentityError if it is not private."""
    st = _data_dir_stat(data_dir)
    if st is None:
        return False
    check_private(data_dir, st, DIR_MASK, owners)
    return True


# --- the snapshot ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Found:
    """A key file as read: its bytes, and why it is not private (``None``: it is).

    ``not_private`` is the short reason (a node.key.next is moved aside for it);
    ``refusal`` the whole message with the way back (a node.key is refused with it).
    """

    data: bytes
    not_private: str | None = None
    refusal: str | None = None


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A key file that could not be read (a symlink, not a regular file, too large, an
    I/O error): the IdentityError text to raise when LoadState needs it."""

    message: str


KeyFile = Found | Unreadable | None
"""node.key or node.key.next as the store holds it; ``None`` when absent."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a joined store holds, read in one go, for :func:`bcd.loadstate.decide`."""

    where: Path
    identity: bytes
    node_key: KeyFile
    next_key: KeyFile


class IdentityStore(Protocol):
    """What LoadState and a renewal need of the place an identity lives.

    The changes raise OSError (the caller words it with :attr:`where`).
    """

    @property
    def where(self) -> Path:
        """The data directory (or the name a memory store goes by), for messages."""
        ...

    def snapshot(self) -> Snapshot | None:
        """The three files; ``None`` when the node has not joined (no identity.json).

        Raises IdentityError when the store or identity.json cannot be trusted or read.
        """
        ...

    def tidy(self) -> None:
        """Remove what a crash in the middle of a write left behind."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Replace ``name`` (one of the three files) with ``data``, atomically."""
        ...

    def remove(self, name: str) -> None:
        """Remove ``name`` if it is there."""
        ...

    def promote_next(self) -> None:
        """Rename node.key.next over node.key, atomically."""
        ...

    def refuse_next(self, why: str) -> str:
        """Move node.key.next aside (never over anything), log ``why``; return its new name."""
        ...


def _read_key_file(path: Path, owners: frozenset[int]) -> KeyFile:
    try:
        found = open_regular(path, MAX_KEY_BYTES)
    except IdentityError as exc:
        return Unreadable(str(exc))
    except OSError as exc:
        return Unreadable(f"cannot read {path}: {exc.strerror or exc}; {WAY_BACK}")
    if found is None:
        return None
    raw, st = found
    return Found(
        raw,
        not_private(st, owners, KEY_FILE_MASK),
        private_problem(path, st, owners, KEY_FILE_MASK),
    )


class DirectoryStore:
    """The data directory (0700) of today, read and written through :mod:`bcd.fs`."""

    def __init__(self, data_dir: Path, owners: Iterable[int] | None = None) -> None:
        self._dir = data_dir
        self._owners = trusted(owners)

    @property
    def where(self) -> Path:
        return self._dir

    def snapshot(self) -> Snapshot | None:
        if not check_data_dir(self._dir, self._owners):
            return None
        identity_path = self._dir / IDENTITY_FILE
        try:
            raw = read_regular(identity_path, MAX_IDENTITY_BYTES, self._owners, PUBLIC_FILE_MASK)
        except OSError as exc:
            raise IdentityError(f"cannot read {identity_path}: {exc.strerror or exc}") from exc
        if raw is None:
            return None
        node_key = _read_key_file(self._dir / NODE_KEY_FILE, self._owners)
        next_key = self._read_next()
        return Snapshot(self._dir, raw, node_key, next_key)

    def _read_next(self) -> KeyFile:
        path = self._dir / NEXT_KEY_FILE
        try:
            found = open_regular(path, MAX_KEY_BYTES)
        except IdentityError as exc:
            return Unreadable(str(exc))
        except OSError as exc:
            return Unreadable(f"cannot settle {path}: {exc.strerror or exc}; {WAY_BACK}")
        if found is None:
            return None
        raw, st = found
        return Found(raw, not_private(st, self._owners, KEY_FILE_MASK))

    def tidy(self) -> None:
        fs.remove_stale_temps(self._dir, (IDENTITY_FILE, NODE_KEY_FILE, NEXT_KEY_FILE))

    def write(self, name: str, data: bytes) -> None:
        fs.atomic_write(self._dir / name, data, 0o600)

    def remove(self, name: str) -> None:
        fs.remove(self._dir / name)

    def promote_next(self) -> None:
        os.rename(self._dir / NEXT_KEY_FILE, self._dir / NODE_KEY_FILE)
        fs.fsync_dir(self._dir)

    def refuse_next(self, why: str) -> str:
        base = free_name(self._dir, f"{NEXT_KEY_FILE}{REFUSED_NEXT_SUFFIX}{int(time.time())}", ())
        aside = self._dir / base
        os.rename(self._dir / NEXT_KEY_FILE, aside)
        fs.fsync_dir(self._dir)
        log.warning(
            "%s was not promoted: %s; moved aside to %s", self._dir / NEXT_KEY_FILE, why, aside
        )
        return base


StoreOrDir = IdentityStore | Path
"""A store, or a data directory (its :class:`DirectoryStore`)."""


def as_store(where: StoreOrDir) -> IdentityStore:
    """``where`` as a store: a data directory is a :class:`DirectoryStore` (default owners)."""
    return DirectoryStore(where) if isinstance(where, Path) else where


def free_name(directory: Path, base: str, suffixes: tuple[str, ...]) -> str:
    """``base``, or ``base-N``, such that neither it nor it+suffix exists."""
    candidate, n = base, 0
    while any(os.path.lexists(directory / (candidate + s)) for s in ("", *suffixes)):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


@dataclass
class MemoryStore:
    """The three files in a dict: a node's store without a disk (no file is ever private
    to anyone but this process). ``exposed`` names the files to treat as readable by
    other users, with the reason (a test of the refusals); ``clock`` names refused keys."""

    name: str = "memory"
    files: dict[str, bytes] = field(default_factory=dict)
    exposed: dict[str, str] = field(default_factory=dict)
    clock: float = 0.0

    @property
    def where(self) -> Path:
        return Path(f"/memory/{self.name}")

    def snapshot(self) -> Snapshot | None:
        raw = self.files.get(IDENTITY_FILE)
        if raw is None:
            return None
        return Snapshot(self.where, raw, self._key(NODE_KEY_FILE), self._key(NEXT_KEY_FILE))

    def _key(self, name: str) -> KeyFile:
        data = self.files.get(name)
        if data is None:
            return None
        why = self.exposed.get(name)
        refusal = None
        if why is not None:
            refusal = f"{self.where / name} is not private ({why}), so bcd does not trust it"
        return Found(data, why, refusal)

    def tidy(self) -> None:
        """Nothing to tidy: a write to a dict is whole or not done."""

    def write(self, name: str, data: bytes) -> None:
        self.files[name] = bytes(data)
        self.exposed.pop(name, None)

    def remove(self, name: str) -> None:
        self.files.pop(name, None)
        self.exposed.pop(name, None)

    def promote_next(self) -> None:
        self.files[NODE_KEY_FILE] = self.files.pop(NEXT_KEY_FILE)
        self.exposed.pop(NODE_KEY_FILE, None)
        if NEXT_KEY_FILE in self.exposed:
            self.exposed[NODE_KEY_FILE] = self.exposed.pop(NEXT_KEY_FILE)

    def refuse_next(self, why: str) -> str:
        base = f"{NEXT_KEY_FILE}{REFUSED_NEXT_SUFFIX}{int(self.clock)}"
        name, n = base, 0
        while name in self.files:
            n += 1
            name = f"{base}-{n}"
        self.files[name] = self.files.pop(NEXT_KEY_FILE)
        self.exposed.pop(NEXT_KEY_FILE, None)
        log.warning(
            "%s was not promoted: %s; moved aside to %s",
            self.where / NEXT_KEY_FILE,
            why,
            self.where / name,
        )
        return name

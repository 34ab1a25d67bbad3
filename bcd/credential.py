"""Reading the join credential: standard input or ``--token-file``, never argv.

``--token-file`` judges the file it finally names: a Kubernetes Secret mounts each
key as a symlink into ``..data/``, so a symlink is followed once, and the target
must be a regular file of at most 4 KiB, owned by the caller, mode 0600 or 0400.
Nothing here ever echoes the credential, nor a path that may be one
(:func:`may_be_secret`, :func:`shown`).
"""

from __future__ import annotations

import errno
import os
import re
import select
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from bcd.errors import CredentialError

MAX_CREDENTIAL = 4096
TOKEN_MARKERS = ("bcjt_", "bcak_")
_RANDOM_RUN = re.compile(r"[A-Za-z0-9_-]{32,}")
NOT_SHOWN = "(not shown: it may be a secret)"


def looks_like_token(text: str) -> bool:
    """Whether ``text`` holds a bearer credential's prefix (``bcjt_``, ``bcak_``)."""
    lowered = text.lower()
    return any(marker in lowered for marker in TOKEN_MARKERS)


def may_be_secret(text: str) -> bool:
    """Whether ``text`` might be a secret, so it must never be echoed.

    A bearer prefix anywhere (``bcjt_``, ``bcak_``, any case), or a run of 32 or more
    base64url characters mixing upper case, lower case and digits (a token's secret
    is 43 of them). Paths, URLs, names and ids normally pass; a pin does not (and is
    never echoed either).
    """
    if looks_like_token(text):
        return True
    for run in _RANDOM_RUN.findall(text):
        if (
            any(c.isupper() for c in run)
            and any(c.islower() for c in run)
            and any(c.isdigit() for c in run)
        ):
            return True
    return False


def shown(text: str | os.PathLike[str]) -> str:
    """``text`` as a message may show it: itself, escaped if unprintable, or
    :data:`NOT_SHOWN` when it may be a secret."""
    value = os.fspath(text)
    if may_be_secret(value):
        return NOT_SHOWN
    return value if value.isprintable() else repr(value)


def stdin_holds_data(stream: BinaryIO) -> bool:
    """Whether standard input holds something other than whitespace right now.

    Never waits: a terminal, a closed descriptor and a pipe with nothing written yet
    count as empty; a file, ``/dev/null`` or a pipe whose writer is done is read (at
    most 4 KiB + 1, which is then gone). Used to refuse a second credential source.
    """
    try:
        fd = stream.fileno()
        if os.isatty(fd):
            return False
        ready, _, _ = select.select([fd], [], [], 0)
        if not ready:
            return False
        return bool(os.read(fd, MAX_CREDENTIAL + 1).strip())
    except (OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class Credential:
    text: str = field(repr=False)
    files: tuple[Path, ...] = ()
    """The token file and, when it was a symlink, the link: removed after the join."""


def _decode(raw: bytes, where: str) -> str:
    if len(raw) > MAX_CREDENTIAL:
        raise CredentialError(f"the join credential from {where} is over 4 KiB")
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CredentialError(f"the join credential from {where} is not ASCII text") from None
    if not text:
        raise CredentialError(f"no join credential in {where}")
    return text


def read_stdin(stream: BinaryIO) -> Credential:
    if os.isatty(stream.fileno()):
        raise CredentialError(
            "bcd join reads the join token from standard input or --token-file; "
            "pipe it in: bcd join < join-token"
        )
    return Credential(_decode(stream.read(MAX_CREDENTIAL + 1), "standard input"))


def read_stdin_if_any(stream: BinaryIO) -> Credential | None:
    """The credential on standard input, or None when it is a terminal or empty.

    For ``bcd join --reset --yes``, whose first step may come without a token.
    """
    if os.isatty(stream.fileno()):
        return None
    raw = stream.read(MAX_CREDENTIAL + 1)
    if not raw.strip():
        return None
    return Credential(_decode(raw, "standard input"))


def read_token_file(path: Path, *, euid: int | None = None) -> Credential:
    euid = os.geteuid() if euid is None else euid
    target = path
    links: tuple[Path, ...] = ()
    name = shown(path)
    try:
        if path.is_symlink():
            target = path.parent / os.readlink(path)
            links = (path,)
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CredentialError(f"--token-file {name} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CredentialError(
                f"--token-file {name} is a symlink to a symlink; name the file itself"
            ) from None
        raise CredentialError(f"cannot open --token-file {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CredentialError(f"--token-file {name} is not a regular file")
        if st.st_uid != euid:
            raise CredentialError(f"--token-file {name} is not owned by the user running bcd join")
        if stat.S_IMODE(st.st_mode) not in (0o600, 0o400):
            raise CredentialError(
                f"--token-file {name} must be readable by its owner alone (mode 0600 or 0400, "
                f"it is {stat.S_IMODE(st.st_mode):04o})"
            )
        if st.st_size > MAX_CREDENTIAL:
            raise CredentialError(f"--token-file {name} is over 4 KiB")
        raw = os.read(fd, MAX_CREDENTIAL + 1)
    finally:
        os.close(fd)
    return Credential(_decode(raw, f"--token-file {name}"), (target, *links))


def remove_credential_files(cred: Credential) -> list[str]:
    """Delete the token file after the join; return warnings (read-only mounts)."""
    warnings = []
    for path in cred.files:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EBUSY):
                warnings.append(
                    f"warning: cannot remove the token file {shown(path)} ({exc.strerror}; a read-only "
                    f"mount?): the token is spent, remove it where it is stored"
                )
            else:
                raise CredentialError(
                    f"cannot remove the token file {shown(path)}: {exc.strerror}"
                ) from None
    return warnings

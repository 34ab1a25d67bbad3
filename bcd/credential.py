"""Reading the join credential: standard input or ``--token-file``, never argv.

``--token-file`` judges the file it finally names: a Kubernetes Secret mounts each
key as a symlink into ``..data/``, so a symlink is followed once, and the target
must be a regular file of at most 4 KiB, owned by the caller, mode 0600 or 0400.
Nothing here ever echoes the credential.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from bcd.errors import CredentialError

MAX_CREDENTIAL = 4096


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


def read_token_file(path: Path, *, euid: int | None = None) -> Credential:
    euid = os.geteuid() if euid is None else euid
    target = path
    links: tuple[Path, ...] = ()
    try:
        if path.is_symlink():
            target = path.parent / os.readlink(path)
            links = (path,)
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CredentialError(f"--token-file {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CredentialError(
                f"--token-file {path} is a symlink to a symlink; name the file itself"
            ) from None
        raise CredentialError(f"cannot open --token-file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CredentialError(f"--token-file {path} is not a regular file")
        if st.st_uid != euid:
            raise CredentialError(f"--token-file {path} is not owned by the user running bcd join")
        if stat.S_IMODE(st.st_mode) not in (0o600, 0o400):
            raise CredentialError(
                f"--token-file {path} must be readable by its owner alone (mode 0600 or 0400, "
                f"it is {stat.S_IMODE(st.st_mode):04o})"
            )
        if st.st_size > MAX_CREDENTIAL:
            raise CredentialError(f"--token-file {path} is over 4 KiB")
        raw = os.read(fd, MAX_CREDENTIAL + 1)
    finally:
        os.close(fd)
    return Credential(_decode(raw, f"--token-file {path}"), (target, *links))


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
                    f"warning: cannot remove the token file {path} ({exc.strerror}; a read-only "
                    f"mount?): the token is spent, remove it where it is stored"
                )
            else:
                raise CredentialError(
                    f"cannot remove the token file {path}: {exc.strerror}"
                ) from None
    return warnings

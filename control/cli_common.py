"""What the ``better-compute`` commands share: paths, the secret, the database URL,
durations, the API client and the output."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from bcd import fs
from control.errors import ControlError

DEFAULT_HOME = "/var/lib/better-compute"
DEFAULT_API = "http://127.0.0.1:8080"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"better-compute: usage: {message}\n")


def usage_error(message: str) -> NoReturn:
    """A usage error found past the parser: one line, exit 2, as argparse's own."""
    print(f"better-compute: usage: {message}", file=sys.stderr)
    raise SystemExit(2)


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get("BETTER_COMPUTE_HOME") or DEFAULT_HOME)


SECRET_CREDENTIAL = "better-compute-secret"  # noqa: S105 - a credential's name
MAX_SECRET_BYTES = 4096
SECRET_FILE_HELP = (
    "file holding the PKI secret (mode 0600 or 0400; default $CREDENTIALS_DIRECTORY/"
    f"{SECRET_CREDENTIAL} under systemd, else $BETTER_COMPUTE_SECRET)"
)


def _secret_path(args: argparse.Namespace | None) -> Path | None:
    """Where the secret comes from: --secret-file, else systemd's credential, else None
    (the environment)."""
    named = getattr(args, "secret_file", None)
    if named:
        return Path(named)
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds and (Path(creds) / SECRET_CREDENTIAL).exists():
        return Path(creds) / SECRET_CREDENTIAL
    return None


def secret_configured(args: argparse.Namespace) -> str | None:
    """What names a secret for this command (a gateway must have none), or None."""
    path = _secret_path(args)
    if path is not None:
        return f"--secret-file {path}" if getattr(args, "secret_file", None) else str(path)
    return "BETTER_COMPUTE_SECRET" if os.environ.get("BETTER_COMPUTE_SECRET") else None


def _judge_secret(path: Path, *, credential: bool = False) -> Any:
    """The secret file's judge. A systemd credential (``credential``) may also be group
    readable: ``LoadCredential=`` writes it root's 0400 and grants the service user read
    through a POSIX ACL, whose mask shows in the group bits (0440); the directory is the
    service's alone. Group write or exec, and any bit for others, are refused there too."""
    refused = 0o037 if credential else 0o077

    def judge(st: os.stat_result) -> None:
        if st.st_uid not in (0, os.geteuid()):
            raise ControlError(
                "INVALID_CONFIG",
                f"the secret file {path} is owned by uid {st.st_uid}, not root or this user: "
                f"chown $(id -u) {path}",
            )
        if st.st_mode & refused:
            raise ControlError(
                "INVALID_CONFIG",
                f"the secret file {path} can be read or changed by other users (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): chmod 0600 {path}",
            )

    return judge


def _read_secret_file(path: Path, *, credential: bool = False) -> str:
    """The secret in ``path``: a regular file (never through a symlink) of the user
    running the command (or root), readable by nobody else (a systemd ``credential``:
    by its group too), at most 4 KiB; one trailing newline is not part of it. No
    message holds a byte of the file."""
    judge = _judge_secret(path, credential=credential)
    try:
        raw = fs.read_regular_file(path, MAX_SECRET_BYTES, follow=False, judge=judge)
    except FileNotFoundError:
        raise ControlError("INVALID_CONFIG", f"the secret file {path} does not exist") from None
    except IsADirectoryError:
        raise ControlError("INVALID_CONFIG", f"the secret file {path} is a directory") from None
    except fs.NotRegularFile as exc:
        raise ControlError(
            "INVALID_CONFIG",
            f"the secret file {path} is {exc.kind}, not a regular file; name the file itself",
        ) from None
    except fs.FileTooLarge:
        raise ControlError(
            "INVALID_CONFIG", f"the secret file {path} is over {MAX_SECRET_BYTES} bytes"
        ) from None
    except OSError as exc:
        raise ControlError(
            "INVALID_CONFIG", f"cannot read the secret file {path}: {exc.strerror}"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ControlError("INVALID_CONFIG", f"the secret file {path} is not UTF-8") from None
    return text.removesuffix("\n").removesuffix("\r")


def _secret(args: argparse.Namespace | None = None) -> bytes:
    path = _secret_path(args)
    credential = not getattr(args, "secret_file", None)  # found in $CREDENTIALS_DIRECTORY
    secret = (
        _read_secret_file(path, credential=credential)
        if path is not None
        else os.environ.get("BETTER_COMPUTE_SECRET", "")
    )
    if len(secret) < 16:
        where = f"the secret in {path} is shorter than 16 characters: " if path else ""
        raise ControlError(
            "INVALID_CONFIG",
            f"{where}set the PKI secret (at least 16 characters) in a 0600 file named by "
            f"--secret-file FILE or systemd's LoadCredential={SECRET_CREDENTIAL}:FILE (or in "
            "BETTER_COMPUTE_SECRET); it encrypts the PKI's private keys",
        )
    return secret.encode("utf-8")


def _db_url(args: argparse.Namespace) -> str:
    from control.store.reach import scheme_ok

    url = args.db or os.environ.get("BETTER_COMPUTE_DB")
    if url and not scheme_ok(url):
        where = "--db" if args.db else "BETTER_COMPUTE_DB"
        # Without a known scheme nothing tells where a password is (user:pw@host/db,
        # postgresql:/u:pw@h/db): no part of the value is shown.
        usage_error(f"{where}: a URL of an unknown kind (must start sqlite:/// or postgresql://)")
    return url or f"sqlite:///{_home(args) / 'store.db'}"


def parse_ttl(text: str) -> int:
    """``90s``, ``15m``, ``1h``, ``24h`` or plain seconds: a whole number of seconds."""
    m = re.fullmatch(r"(\d{1,6})([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError("a duration like 30m, 1h or 24h")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _cert_ttl(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("a whole number of seconds") from None
    if not 10 <= value <= 86_400:
        raise argparse.ArgumentTypeError("from 10 to 86400 seconds")
    return value


def _now() -> datetime:
    return datetime.now(UTC)


# --- the API client ------------------------------------------------------------------


TENANT_HELP = "ten_… (default: the tenant of the API credential)"


def _client(args: argparse.Namespace) -> Any:
    """The API client of ``--api`` and ``--credential-file``. Without ``--tenant``,
    ``args.tenant`` becomes the credential's own tenant (``GET /v1/tenants/self``):
    call this before reading ``args.tenant``."""
    from control.client import ApiClient

    path = args.credential_file or os.environ.get("BETTER_COMPUTE_CREDENTIAL_FILE")
    if not path:
        raise ControlError(
            "UNAUTHENTICATED", "name the API credential file: --credential-file FILE"
        )
    try:
        credential = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ControlError("UNAUTHENTICATED", f"cannot read the credential file {path}") from exc
    api = args.api or os.environ.get("BETTER_COMPUTE_API") or DEFAULT_API
    client = ApiClient(api.rstrip("/") + "/api/compute", credential)
    if getattr(args, "tenant", "") is None:  # --tenant omitted: the credential's own
        args.tenant = client.call("GET", "/v1/tenants/self")["id"]
    return client


def _emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    print(json.dumps(obj, indent=2) if getattr(args, "json", False) else text)

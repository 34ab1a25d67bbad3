"""What the ``better-compute`` commands share: paths, the secret, the database URL,
durations, the API client and the output."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from control.errors import ControlError

DEFAULT_HOME = "/var/lib/better-compute"
DEFAULT_API = "http://127.0.0.1:8080"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"better-compute: usage: {message}\n")


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get("BETTER_COMPUTE_HOME") or DEFAULT_HOME)


def _secret() -> bytes:
    secret = os.environ.get("BETTER_COMPUTE_SECRET", "")
    if len(secret) < 16:
        raise ControlError(
            "INVALID_CONFIG",
            "set BETTER_COMPUTE_SECRET (at least 16 characters); it encrypts the PKI's private keys",
        )
    return secret.encode("utf-8")


def _db_url(args: argparse.Namespace) -> str:
    url = args.db or os.environ.get("BETTER_COMPUTE_DB")
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


def _client(args: argparse.Namespace) -> Any:
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
    return ApiClient(api.rstrip("/") + "/api/compute", credential)


def _emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    print(json.dumps(obj, indent=2) if getattr(args, "json", False) else text)

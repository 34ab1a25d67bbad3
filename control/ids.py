"""Identifiers: a prefix and a lowercase ULID (PROTOCOL.md), and secrets."""

from __future__ import annotations

import os
import secrets
import time
from datetime import UTC, datetime

from bcd.wire import secret_hash, secret_matches

__all__ = ["iso", "new_id", "new_secret", "secret_hash", "secret_matches", "ulid"]

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def ulid(now_ms: int | None = None) -> str:
    """A 26-character lowercase Crockford ULID: 48 bits of time, 80 random bits."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    out = []
    for _ in range(26):
        out.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_id(prefix: str) -> str:
    return f"{prefix}_{ulid()}"


def new_secret() -> str:
    """256 random bits, base64url without padding (43 characters)."""
    return secrets.token_urlsafe(32)


def iso(ms: int) -> str:
    """RFC 3339 UTC with milliseconds, the API's one time format."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"

"""The ground floor of the wire formats: :class:`WireError`, JSON in and out, field readers.

:mod:`bcd.wire` (the face both sides import) and :mod:`bcd.signed` (SignedResponses
and the typed bodies the node reads from them) build on these. Every reader takes a
parsed JSON object and returns a typed value or raises :class:`WireError` whose text
names the field, never the input.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, TypeGuard

from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki

MAX_BODY = 64 * 1024
MAX_CLAIM = 256
MAX_LIST = 64


class WireError(ValueError):
    """Raised when a message does not parse; the text never contains the input."""


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8")


def loads_object(data: bytes, limit: int = MAX_BODY) -> dict[str, Any]:
    """Parse a JSON object of at most ``limit`` bytes."""
    if len(data) > limit:
        raise WireError("body too large")
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError("body is not JSON") from exc
    if not isinstance(obj, dict):
        raise WireError("body is not a JSON object")
    return obj


_SURROGATE = re.compile("[\ud800-\udfff]")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose names and string values are all Unicode text: JSON's ``\\ud800``
    escapes make lone surrogates, which no store and no UTF-8 writer can take."""
    for name, value in pairs:
        if _SURROGATE.search(name) or _has_surrogate(value):
            raise ValueError("a string holds a lone surrogate")
    return dict(pairs)


def _has_surrogate(value: object) -> bool:
    """Inner objects were checked when they were made; strings and lists are here."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


# --- field readers -----------------------------------------------------------------


def str_field(
    obj: dict[str, Any], key: str, *, max_len: int = MAX_CLAIM, optional: bool = False
) -> str:
    """A string of at most ``max_len`` characters; ``""`` for an absent optional one."""
    value = obj.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str) or len(value) > max_len:
        raise WireError(f"{key} must be a string")
    return value


def str_list_field(obj: dict[str, Any], key: str) -> tuple[str, ...]:
    """A list of at most :data:`MAX_LIST` strings of at most :data:`MAX_CLAIM` characters."""
    value = obj.get(key, [])
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise WireError(f"{key} must be a list of strings")
    if not all(isinstance(v, str) and len(v) <= MAX_CLAIM for v in value):
        raise WireError(f"{key} must be a list of strings")
    return tuple(value)


def b64_field(obj: dict[str, Any], key: str, limit: int = 8192) -> bytes:
    """The bytes of a standard-base64 string field of at most ``limit`` characters."""
    value = obj.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise WireError(f"{key} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{key} must be a base64 string") from exc


def is_int(value: object) -> TypeGuard[int]:
    """Whether a JSON value is an integer (``true`` and ``false`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def printable(text: str) -> str:
    """``text`` with every control or non-ASCII character replaced by ``?``."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


# --- JWK --------------------------------------------------------------------------


def public_jwk_of(key: ec.EllipticCurvePublicKey) -> dict[str, str]:
    nums = key.public_numbers()
    return {
        "kty": "EC",
        "crv": "P-256",
        "x": pki.b64url(nums.x.to_bytes(32, "big")),
        "y": pki.b64url(nums.y.to_bytes(32, "big")),
    }


def public_key_of_jwk(obj: object) -> ec.EllipticCurvePublicKey:
    """Parse a public P-256 JWK (no private part accepted): each coordinate exactly 32
    octets, as RFC 7518 6.2.1.2 requires, and the point on the curve."""
    if not isinstance(obj, dict) or obj.get("kty") != "EC" or obj.get("crv") != "P-256":
        raise WireError("not a P-256 public JWK")
    if "d" in obj:
        raise WireError("the JWK holds a private key")
    try:
        xb, yb = pki.b64url_decode(obj["x"]), pki.b64url_decode(obj["y"])
        if len(xb) != 32 or len(yb) != 32:
            raise ValueError("a coordinate is not 32 octets")
        x, y = int.from_bytes(xb, "big"), int.from_bytes(yb, "big")
        return ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    except (KeyError, ValueError, TypeError) as exc:
        raise WireError("not a P-256 public JWK") from exc

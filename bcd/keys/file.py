"""The file key backend: a P-256 key in an unencrypted PKCS#8 PEM file (node.key).

Only the encoding lives here; the file is written by :mod:`bcd.identity` through
:mod:`bcd.fs` (0600, atomically).
"""

from __future__ import annotations

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd.errors import IdentityError

PEM_BEGIN = b"-----BEGIN PRIVATE KEY-----"
PEM_END = b"-----END PRIVATE KEY-----"
MAX_KEY_PEM = 16 * 1024


def generate_file_key() -> ec.EllipticCurvePrivateKey:
    """A new P-256 key."""
    return ec.generate_private_key(ec.SECP256R1())


def key_to_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """The key as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_key_pem(data: bytes) -> ec.EllipticCurvePrivateKey:
    """Parse one unencrypted PKCS#8 PEM P-256 key; raise IdentityError for anything else.

    The message never contains the input.
    """
    if not isinstance(data, bytes) or len(data) > MAX_KEY_PEM:
        raise IdentityError("the key file is not a PKCS#8 PEM key")
    body = data.strip()
    if not body.startswith(PEM_BEGIN) or not body.endswith(PEM_END):
        raise IdentityError("the key file is not a PKCS#8 PEM key")
    if body.count(b"-----BEGIN ") != 1:
        raise IdentityError("the key file holds more than one PEM block")
    try:
        key = serialization.load_pem_private_key(body, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise IdentityError("the key file is not a PKCS#8 PEM key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise IdentityError("the key file does not hold a P-256 key")
    return key

"""Opening a sealed token on ``cryptography`` alone: the one JWE the JoinService takes.

PROTOCOL.md "Sealed token": compact JWE, ``alg`` ECDH-ES+A256KW, ``enc`` A256GCM, to
the JoinService encryption key (P-256). This opens exactly that (RFC 7516 §5.2, RFC
7518 §4.6 and §5.3) and nothing else, with the same checks and answers as
:func:`bcd.wire.open_seal` (jwcrypto), at a fraction of its cost per join:

1. five base64url segments (strict alphabet, at most 8 KiB in all); the protected
   header a JSON object with ``typ`` ``bcjt+jwe``, exactly that ``alg`` and ``enc``,
   ``kid`` equal to the key's pin (:class:`~bcd.wire.WireError` "not a compact JWE",
   "wrong typ", "wrong algorithm", "wrong kid", as ``bcd.wire`` answers);
2. ``epk`` a public P-256 point on the curve (``cryptography`` checks it), ``apu`` /
   ``apv`` base64url when present; Concat KDF (SHA-256, AlgorithmID = ``alg``, 256
   bits) over the ECDH shared secret; AES key unwrap (RFC 3394, its integrity check)
   of a 256-bit content key; AES-256-GCM with a 96-bit IV and a 128-bit tag, the
   protected header's encoded segment as the additional data. Any failure is
   "the seal does not open";
3. ``iat`` an integer, ``csr`` 64 lowercase hex digits; the plaintext a join token
   (else :class:`~bcd.wire.NotAToken`).

Stricter than jwcrypto, on purpose, where no conforming sealer goes (bcd's sealer
never sets these): a ``zip`` or ``crit`` header, an IV other than 96 bits, a tag
other than 128 bits are refused. tests/test_pkiseal.py checks it against jwcrypto and
joserfc, valid seals and hostile ones alike.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap

from bcd import pki, wire

ALG = "ECDH-ES+A256KW"
ENC = "A256GCM"
MAX_SEALED = 8192
_CSR_RE = re.compile(r"[0-9a-f]{64}")
_ALG_ID = len(ALG).to_bytes(4, "big") + ALG.encode("ascii")
_KEY_BITS = (256).to_bytes(4, "big")


class SealOpener:
    """Opens seals to one P-256 private key (the JoinService encryption key)."""

    __slots__ = ("_key", "_pin")

    def __init__(self, key: ec.EllipticCurvePrivateKey, pin: str) -> None:
        if not isinstance(key.curve, ec.SECP256R1):
            raise ValueError("the join encryption key is not P-256")
        self._key = key
        self._pin = pin

    def open(self, sealed: object) -> wire.OpenedSeal:
        if not isinstance(sealed, str) or sealed.count(".") != 4 or len(sealed) > MAX_SEALED:
            raise wire.WireError("not a compact JWE")
        h64, ek64, iv64, ct64, tag64 = sealed.split(".")
        try:
            header = json.loads(pki.b64url_decode(h64))
        except (ValueError, pki.PkiError, RecursionError) as exc:
            raise wire.WireError("not a compact JWE") from exc
        if not isinstance(header, dict) or header.get("typ") != wire.SEAL_TYP:
            raise wire.WireError("wrong typ")
        if header.get("alg") != ALG or header.get("enc") != ENC:
            raise wire.WireError("wrong algorithm")
        kid = header.get("kid")
        if not isinstance(kid, str) or not pki.pins_equal(kid, self._pin):
            raise wire.WireError("wrong kid")
        try:
            plaintext = self._decrypt(header, h64, ek64, iv64, ct64, tag64)
        except (ValueError, TypeError, KeyError, InvalidTag, InvalidUnwrap, pki.PkiError) as exc:
            raise wire.WireError("the seal does not open") from exc
        iat, csr = header.get("iat"), header.get("csr")
        if not isinstance(iat, int) or isinstance(iat, bool):
            raise wire.WireError("iat missing")
        if not isinstance(csr, str) or not _CSR_RE.fullmatch(csr):
            raise wire.WireError("csr missing")
        return wire.OpenedSeal(token=wire._sealed_token(plaintext), iat=iat, csr_sha256=csr)

    def _decrypt(
        self, header: dict[str, Any], h64: str, ek64: str, iv64: str, ct64: str, tag64: str
    ) -> bytes:
        if "zip" in header or "crit" in header:
            raise ValueError("zip and crit are not part of a seal")
        epk = header.get("epk")
        if not isinstance(epk, dict):
            raise ValueError("epk missing")
        peer = wire.public_key_of_jwk({k: epk.get(k) for k in ("kty", "crv", "x", "y")})
        apu = pki.b64url_decode(header["apu"]) if "apu" in header else b""
        apv = pki.b64url_decode(header["apv"]) if "apv" in header else b""
        iv, tag = pki.b64url_decode(iv64), pki.b64url_decode(tag64)
        if len(iv) != 12 or len(tag) != 16:
            raise ValueError("A256GCM takes a 96-bit IV and a 128-bit tag")
        wrapped = pki.b64url_decode(ek64)
        ciphertext = pki.b64url_decode(ct64)
        shared = self._key.exchange(ec.ECDH(), peer)
        # Concat KDF (NIST SP 800-56A §5.8.1) with SHA-256: one block is the 256-bit KEK.
        other = (
            _ALG_ID
            + len(apu).to_bytes(4, "big")
            + apu
            + len(apv).to_bytes(4, "big")
            + apv
            + _KEY_BITS
        )
        kek = hashlib.sha256(b"\x00\x00\x00\x01" + shared + other).digest()
        cek = aes_key_unwrap(kek, wrapped)
        if len(cek) != 32:
            raise ValueError("A256GCM takes a 256-bit key")
        return AESGCM(cek).decrypt(iv, ciphertext + tag, h64.encode("ascii"))

"""control.pkiseal: the JoinService's seal opener on ``cryptography`` alone, checked
against jwcrypto (bcd.wire.open_seal, what it replaces on the server) and joserfc (an
independent JOSE library), on valid seals and on hostile ones."""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash
from cryptography.hazmat.primitives.keywrap import aes_key_wrap
from joserfc import jwe as joserfc_jwe
from joserfc.jwk import ECKey

from bcd import pki, wire
from control.pkiseal import SealOpener

KEY = ec.generate_private_key(ec.SECP256R1())
PIN = pki.spki_pin(KEY.public_key())
TOKEN = wire.JoinToken("jt_" + "a" * 26, "s" * 43)
CSR = pki.sha256_hex(b"csr")
OPENER = SealOpener(KEY, PIN)
ALGS = ["ECDH-ES+A256KW", "A256GCM"]
# joserfc checks headers it does not know by default; a seal carries iat and csr
REGISTRY = joserfc_jwe.JWERegistry(algorithms=ALGS, strict_check_header=False)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def ours(sealed: object) -> object:
    try:
        return OPENER.open(sealed)
    except wire.WireError as exc:
        return (type(exc).__name__, str(exc))


def jwcrypto(sealed: object) -> object:
    try:
        return wire.open_seal(sealed, KEY, PIN)  # type: ignore[arg-type]
    except wire.WireError as exc:
        return (type(exc).__name__, str(exc))


def joserfc(sealed: str) -> bytes | None:
    """The plaintext joserfc finds, or None when it refuses."""
    try:
        obj = joserfc_jwe.decrypt_compact(sealed, ECKey.import_key(KEY), registry=REGISTRY)
    except Exception:  # any refusal of any kind
        return None
    return obj.plaintext


def raw_seal(
    *,
    header: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    plaintext: bytes = TOKEN.bearer.encode("ascii"),
    cek: bytes | None = None,
    iv: bytes | None = None,
    tag_len: int = 16,
    apu: bytes = b"",
    apv: bytes = b"",
    eph: ec.EllipticCurvePrivateKey | None = None,
) -> str:
    """A seal made step by step with ``cryptography``, with any header or shape."""
    eph = eph or ec.generate_private_key(ec.SECP256R1())
    full: dict[str, Any] = {
        "alg": "ECDH-ES+A256KW",
        "enc": "A256GCM",
        "typ": wire.SEAL_TYP,
        "kid": PIN,
        "iat": int(time.time()),
        "csr": CSR,
        "epk": wire.public_jwk_of(eph.public_key()),
    }
    if apu:
        full["apu"] = b64(apu)
    if apv:
        full["apv"] = b64(apv)
    full.update(header or {})
    for name in drop:
        full.pop(name, None)
    alg = str(full.get("alg", ""))
    other = b"".join(len(p).to_bytes(4, "big") + p for p in (alg.encode(), apu, apv))
    kek = ConcatKDFHash(hashes.SHA256(), 32, other + (256).to_bytes(4, "big")).derive(
        eph.exchange(ec.ECDH(), KEY.public_key())
    )
    cek = cek if cek is not None else os.urandom(32)
    iv = iv if iv is not None else os.urandom(12)
    h64 = b64(json.dumps(full).encode())
    sealed = AESGCM(cek).encrypt(iv, plaintext, h64.encode("ascii"))
    ct, tag = sealed[:-16], sealed[-16:][:tag_len]
    return ".".join((h64, b64(aes_key_wrap(kek, cek)), b64(iv), b64(ct), b64(tag)))


def joserfc_seal(extra: dict[str, Any] | None = None) -> str:
    header = {
        "alg": "ECDH-ES+A256KW",
        "enc": "A256GCM",
        "typ": wire.SEAL_TYP,
        "kid": PIN,
        "iat": int(time.time()),
        "csr": CSR,
        **(extra or {}),
    }
    public = ECKey.import_key(KEY.public_key())
    return joserfc_jwe.encrypt_compact(header, TOKEN.bearer, public, registry=REGISTRY)


def valid_seals() -> list[str]:
    return [
        wire.seal_token(TOKEN, KEY.public_key(), b"csr", int(time.time())),
        joserfc_seal(),
        joserfc_seal({"apu": b64(b"alice"), "apv": b64(b"bob")}),
        raw_seal(),
        raw_seal(apu=b"node", apv=b"joinservice"),
    ]


def test_valid_seals_open_alike_in_all_three() -> None:
    for sealed in valid_seals():
        opened = OPENER.open(sealed)
        assert opened == jwcrypto(sealed)
        assert (opened.token, opened.csr_sha256) == (TOKEN, CSR)
        assert joserfc(sealed) == TOKEN.bearer.encode("ascii")


def _flip(text: str, i: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    return text[:i] + alphabet[(alphabet.index(text[i]) + 1) % 64] + text[i + 1 :]


def tampered() -> list[str]:
    """Every segment of a valid seal changed: flipped, cut, emptied, lengthened."""
    out: list[str] = []
    for sealed in valid_seals()[:2]:
        parts = sealed.split(".")
        for n, part in enumerate(parts):
            for i in sorted({0, len(part) // 2, max(0, len(part) - 2)}):
                if part:
                    out.append(".".join([*parts[:n], _flip(part, i), *parts[n + 1 :]]))
            for variant in ("", part[:-4], part + "AAAA", part + "=", part + "!"):
                out.append(".".join([*parts[:n], variant, *parts[n + 1 :]]))
        out += [sealed + ".", sealed.replace(".", "..", 1), "." * 4, sealed * 2, "x" * 9000]
    return out


OFF_CURVE = {"kty": "EC", "crv": "P-256", "x": b64(b"\x01" * 32), "y": b64(b"\x02" * 32)}


def hostile() -> list[str]:
    """Well-formed seals whose header or shape is not a seal's."""
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key().public_numbers()
    return [
        raw_seal(header={"typ": "JWE"}),
        raw_seal(drop=("typ",)),
        raw_seal(header={"alg": "ECDH-ES+A128KW"}),
        raw_seal(header={"alg": "ECDH-ES"}),
        raw_seal(header={"enc": "A128GCM"}),
        raw_seal(header={"kid": "sha256:" + "0" * 64}),
        raw_seal(header={"kid": 7}),
        raw_seal(drop=("kid",)),
        raw_seal(drop=("epk",)),
        raw_seal(header={"epk": OFF_CURVE}),
        raw_seal(header={"epk": "not a key"}),
        raw_seal(header={"epk": {"kty": "OKP", "crv": "X25519", "x": b64(b"\x09" * 32)}}),
        raw_seal(
            header={
                "epk": {
                    "kty": "EC",
                    "crv": "P-384",
                    "x": b64(p384.x.to_bytes(48, "big")),
                    "y": b64(p384.y.to_bytes(48, "big")),
                }
            }
        ),
        raw_seal(header={"apu": 5}),
        raw_seal(drop=("iat",)),
        raw_seal(header={"iat": "now"}),
        raw_seal(header={"iat": True}),
        raw_seal(drop=("csr",)),
        raw_seal(header={"csr": CSR.upper()}),
        raw_seal(cek=os.urandom(16)),
        raw_seal(tag_len=12),
        raw_seal(plaintext=b"not a token"),
        raw_seal(plaintext=b"\xff\xfe"),
        raw_seal(plaintext=b"bcjt_jt_" + b"a" * 26 + b".sha256:" + b"0" * 64),
    ]


# Stricter than jwcrypto by design (control/pkiseal.py's docstring): no conforming
# sealer sends these, so refusing them costs nothing.
STRICTER: list[Callable[[], str]] = [
    lambda: raw_seal(header={"crit": ["kid"]}),
    lambda: raw_seal(header={"crit": []}),
    lambda: raw_seal(iv=os.urandom(16)),
    lambda: raw_seal(header={"apu": "***"}),  # jwcrypto drops what is not base64
]


@pytest.mark.parametrize("sealed", tampered() + hostile())
def test_hostile_seals_get_jwcryptos_answer(sealed: str) -> None:
    mine, theirs = ours(sealed), jwcrypto(sealed)
    if isinstance(theirs, wire.OpenedSeal) and not isinstance(mine, wire.OpenedSeal):
        # jwcrypto's base64 takes padding; a compact JWE's segments carry none (RFC 7515 §2)
        assert not re.fullmatch(r"[A-Za-z0-9_.-]*", sealed)
        assert mine == ("WireError", "the seal does not open")
        return
    assert mine == theirs
    if isinstance(mine, wire.OpenedSeal):  # what opens must open for joserfc too
        assert joserfc(sealed) == mine.token.bearer.encode("ascii")


def test_refusals_never_escape_as_other_errors() -> None:
    for junk in (None, 5, b"a.b.c.d.e", "a.b.c.d.e", "...."):
        assert ours(junk) == jwcrypto(junk)
        assert isinstance(ours(junk), tuple)


@pytest.mark.parametrize("make", STRICTER)
def test_stricter_than_jwcrypto_where_no_sealer_goes(make: Callable[[], str]) -> None:
    sealed = make()
    assert ours(sealed) == ("WireError", "the seal does not open")


def test_an_epk_coordinate_shorter_than_32_octets_is_refused() -> None:
    """RFC 7518 6.2.1.2: a coordinate is the full 32 octets. A point whose x has a
    leading zero octet, its epk written with that octet dropped: jwcrypto opens it,
    ours refuses; the same seal with the full coordinate opens."""
    while True:  # one key in 256 has a leading zero octet in x
        eph = ec.generate_private_key(ec.SECP256R1())
        x = eph.public_key().public_numbers().x.to_bytes(32, "big")
        if x[0] == 0:
            break
    full = wire.public_jwk_of(eph.public_key())
    short = {**full, "x": b64(x[1:])}
    assert isinstance(ours(raw_seal(eph=eph, header={"epk": full})), wire.OpenedSeal)
    sealed = raw_seal(eph=eph, header={"epk": short})
    assert isinstance(jwcrypto(sealed), wire.OpenedSeal)
    assert ours(sealed) == ("WireError", "the seal does not open")
    with pytest.raises(wire.WireError, match="not a P-256 public JWK"):
        wire.public_key_of_jwk(short)


def test_a_compressed_seal_is_refused() -> None:
    # zip=DEF: jwcrypto would inflate it; a seal is never compressed
    import zlib

    deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    body = deflate.compress(TOKEN.bearer.encode()) + deflate.flush()
    sealed = raw_seal(header={"zip": "DEF"}, plaintext=body)
    assert isinstance(jwcrypto(sealed), wire.OpenedSeal)
    assert ours(sealed) == ("WireError", "the seal does not open")


def test_the_opener_takes_only_a_p256_key() -> None:
    with pytest.raises(ValueError, match="not P-256"):
        SealOpener(ec.generate_private_key(ec.SECP384R1()), PIN)

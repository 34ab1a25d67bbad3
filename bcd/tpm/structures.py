"""Pure parsers and builders for the TPM 2.0 structures bcd exchanges.

No TPM and no tpm2-pytss: the control plane uses these on what nodes send
(TPMT_PUBLIC public areas, TPMS_ATTEST, object names), so every parser is strict
(known algorithms only, no trailing bytes, bounded sizes) and raises only
:class:`~bcd.tpm.TpmError`. The layouts are those of TPM 2.0 Part 2
(Structures); all integers are big-endian.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec, rsa

from bcd.tpm import TpmError

# --- constants (TPM 2.0 Part 2) ----------------------------------------------------

ALG_RSA = 0x0001
ALG_SHA1 = 0x0004
ALG_AES = 0x0006
ALG_SHA256 = 0x000B
ALG_SHA384 = 0x000C
ALG_SHA512 = 0x000D
ALG_NULL = 0x0010
ALG_SM4 = 0x0013
ALG_RSASSA = 0x0014
ALG_RSAES = 0x0015
ALG_RSAPSS = 0x0016
ALG_OAEP = 0x0017
ALG_ECDSA = 0x0018
ALG_ECDH = 0x0019
ALG_ECDAA = 0x001A
ALG_SM2 = 0x001B
ALG_ECSCHNORR = 0x001C
ALG_ECMQV = 0x001D
ALG_MGF1 = 0x0007
ALG_KDF1_SP800_56A = 0x0020
ALG_KDF2 = 0x0021
ALG_KDF1_SP800_108 = 0x0022
ALG_ECC = 0x0023
ALG_CAMELLIA = 0x0026
ALG_CFB = 0x0043

ECC_NIST_P256 = 0x0003
ECC_NIST_P384 = 0x0004
ECC_NIST_P521 = 0x0005

# TPMA_OBJECT bits
FIXED_TPM = 0x00000002
ST_CLEAR = 0x00000004
FIXED_PARENT = 0x00000010
SENSITIVE_DATA_ORIGIN = 0x00000020
USER_WITH_AUTH = 0x00000040
ADMIN_WITH_POLICY = 0x00000080
NO_DA = 0x00000400
ENCRYPTED_DUPLICATION = 0x00000800
RESTRICTED = 0x00010000
DECRYPT = 0x00020000
SIGN_ENCRYPT = 0x00040000

TPM_GENERATED_VALUE = 0xFF544347
ST_ATTEST_CERTIFY = 0x8017

HASHES: dict[int, str] = {
    ALG_SHA1: "sha1",
    ALG_SHA256: "sha256",
    ALG_SHA384: "sha384",
    ALG_SHA512: "sha512",
}
HASH_SIZES: dict[int, int] = {ALG_SHA1: 20, ALG_SHA256: 32, ALG_SHA384: 48, ALG_SHA512: 64}
CURVES: dict[int, tuple[ec.EllipticCurve, int]] = {
    ECC_NIST_P256: (ec.SECP256R1(), 32),
    ECC_NIST_P384: (ec.SECP384R1(), 48),
    ECC_NIST_P521: (ec.SECP521R1(), 66),
}
_SYM_OBJECT_ALGS = {ALG_AES, ALG_SM4, ALG_CAMELLIA}
_RSA_SCHEMES_WITH_HASH = {ALG_RSASSA, ALG_RSAPSS, ALG_OAEP}
_ECC_SCHEMES_WITH_HASH = {ALG_ECDSA, ALG_ECDH, ALG_SM2, ALG_ECSCHNORR, ALG_ECMQV}
_KDF_SCHEMES = {ALG_MGF1, ALG_KDF1_SP800_56A, ALG_KDF2, ALG_KDF1_SP800_108}

MAX_PUBLIC = 1024  # a TPMT_PUBLIC of an RSA-4096 key is about 600 bytes
MAX_ATTEST = 1024
MAX_DIGEST = 64


# --- a bounded reader --------------------------------------------------------------


class Reader:
    """Reads big-endian TPM fields from bytes; any overrun raises TpmError(``what``)."""

    def __init__(self, data: bytes, what: str) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TpmError(f"{what}: not bytes")
        self._data = bytes(data)
        self._pos = 0
        self.what = what

    def fail(self, reason: str) -> TpmError:
        return TpmError(f"{self.what}: {reason}")

    def take(self, n: int) -> bytes:
        if n < 0 or self._pos + n > len(self._data):
            raise self.fail("truncated")
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        value: int = struct.unpack(">H", self.take(2))[0]
        return value

    def u32(self) -> int:
        value: int = struct.unpack(">I", self.take(4))[0]
        return value

    def u64(self) -> int:
        value: int = struct.unpack(">Q", self.take(8))[0]
        return value

    def tpm2b(self, limit: int) -> bytes:
        size = self.u16()
        if size > limit:
            raise self.fail("a field is too large")
        return self.take(size)

    def end(self) -> None:
        if self._pos != len(self._data):
            raise self.fail("trailing bytes")


def u16(value: int) -> bytes:
    return struct.pack(">H", value)


def u32(value: int) -> bytes:
    return struct.pack(">I", value)


def tpm2b(data: bytes) -> bytes:
    return u16(len(data)) + data


# --- TPMT_PUBLIC -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublicInfo:
    """A parsed TPMT_PUBLIC of an RSA or ECC object.

    ``symmetric`` is (algorithm, key bits, mode) or (ALG_NULL, 0, 0); ``scheme`` is
    (scheme, hash) with hash 0 when the scheme has none; ``curve`` is 0 for RSA.
    """

    type: int
    name_alg: int
    attributes: int
    auth_policy: bytes
    symmetric: tuple[int, int, int]
    scheme: tuple[int, int]
    curve: int
    kdf: tuple[int, int]
    rsa_bits: int
    rsa_exponent: int
    public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    name: bytes

    def has(self, bits: int) -> bool:
        return self.attributes & bits == bits

    def ec_key(self) -> ec.EllipticCurvePublicKey:
        if not isinstance(self.public_key, ec.EllipticCurvePublicKey):
            raise TpmError("the public area does not hold an ECC key")
        return self.public_key


def _hash_alg(r: Reader, value: int, *, allow_null: bool = False) -> int:
    if value == ALG_NULL and allow_null:
        return value
    if value not in HASHES:
        raise r.fail(f"unsupported hash algorithm 0x{value:04x}")
    return value


def _sym_def_object(r: Reader) -> tuple[int, int, int]:
    alg = r.u16()
    if alg == ALG_NULL:
        return (ALG_NULL, 0, 0)
    if alg not in _SYM_OBJECT_ALGS:
        raise r.fail(f"unsupported symmetric algorithm 0x{alg:04x}")
    bits = r.u16()
    mode = r.u16()
    if bits not in (128, 192, 256) or mode != ALG_CFB:
        raise r.fail("unsupported symmetric key size or mode")
    return (alg, bits, mode)


def name_of(public: bytes) -> bytes:
    """An object's name: nameAlg (2 bytes) || H_nameAlg(TPMT_PUBLIC)."""
    r = Reader(public, "the public area")
    r.u16()
    name_alg = _hash_alg(r, r.u16())
    return u16(name_alg) + hashlib.new(HASHES[name_alg], bytes(public)).digest()


def parse_name(name: bytes, what: str = "the name") -> tuple[int, bytes]:
    """Split an object name into (nameAlg, digest); raise TpmError if it is not one."""
    r = Reader(name, what)
    alg = _hash_alg(r, r.u16())
    digest = r.take(HASH_SIZES[alg])
    r.end()
    return alg, digest


def parse_public(public: bytes) -> PublicInfo:
    """Parse a TPMT_PUBLIC of an RSA or ECC object, with a valid public key."""
    if not isinstance(public, bytes) or len(public) > MAX_PUBLIC:
        raise TpmError("the public area: not a TPMT_PUBLIC")
    r = Reader(public, "the public area")
    type_ = r.u16()
    if type_ not in (ALG_RSA, ALG_ECC):
        raise r.fail(f"unsupported object type 0x{type_:04x}")
    name_alg = _hash_alg(r, r.u16())
    attributes = r.u32()
    auth_policy = r.tpm2b(MAX_DIGEST)
    symmetric = _sym_def_object(r)
    scheme_alg = r.u16()
    scheme_hash = 0
    curve = 0
    kdf = (ALG_NULL, 0)
    rsa_bits = 0
    exponent = 0
    key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    try:
        if type_ == ALG_RSA:
            if scheme_alg in _RSA_SCHEMES_WITH_HASH:
                scheme_hash = _hash_alg(r, r.u16())
            elif scheme_alg not in (ALG_NULL, ALG_RSAES):
                raise r.fail(f"unsupported RSA scheme 0x{scheme_alg:04x}")
            rsa_bits = r.u16()
            exponent = r.u32() or 65537
            modulus = r.tpm2b(512)
            if rsa_bits not in (1024, 2048, 3072, 4096) or len(modulus) != rsa_bits // 8:
                raise r.fail("the RSA key size does not match its modulus")
            if exponent < 3 or exponent % 2 == 0:
                raise r.fail("the RSA exponent is invalid")
            n = int.from_bytes(modulus, "big")
            if n.bit_length() != rsa_bits or n % 2 == 0:
                raise r.fail("the RSA modulus is invalid")
            key = rsa.RSAPublicNumbers(exponent, n).public_key()
        else:
            if scheme_alg in _ECC_SCHEMES_WITH_HASH:
                scheme_hash = _hash_alg(r, r.u16())
            elif scheme_alg == ALG_ECDAA:
                scheme_hash = _hash_alg(r, r.u16())
                r.u16()  # count
            elif scheme_alg != ALG_NULL:
                raise r.fail(f"unsupported ECC scheme 0x{scheme_alg:04x}")
            curve = r.u16()
            if curve not in CURVES:
                raise r.fail(f"unsupported curve 0x{curve:04x}")
            kdf_alg = r.u16()
            if kdf_alg == ALG_NULL:
                kdf = (ALG_NULL, 0)
            elif kdf_alg in _KDF_SCHEMES:
                kdf = (kdf_alg, _hash_alg(r, r.u16()))
            else:
                raise r.fail(f"unsupported KDF 0x{kdf_alg:04x}")
            ec_curve, size = CURVES[curve]
            x = r.tpm2b(size)
            y = r.tpm2b(size)
            if len(x) != size or len(y) != size:
                raise r.fail("the ECC point has the wrong size")
            key = ec.EllipticCurvePublicNumbers(
                int.from_bytes(x, "big"), int.from_bytes(y, "big"), ec_curve
            ).public_key()
    except ValueError as exc:  # not a point on the curve, RSA numbers refused
        raise r.fail("the public key is invalid") from exc
    r.end()
    return PublicInfo(
        type=type_,
        name_alg=name_alg,
        attributes=attributes,
        auth_policy=auth_policy,
        symmetric=symmetric,
        scheme=(scheme_alg, scheme_hash),
        curve=curve,
        kdf=kdf,
        rsa_bits=rsa_bits,
        rsa_exponent=exponent,
        public_key=key,
        name=u16(name_alg) + hashlib.new(HASHES[name_alg], public).digest(),
    )


def ecc_public(
    *,
    name_alg: int,
    attributes: int,
    scheme: int,
    scheme_hash: int,
    curve: int,
    x: bytes,
    y: bytes,
    auth_policy: bytes = b"",
    symmetric: tuple[int, int, int] = (ALG_NULL, 0, 0),
) -> bytes:
    """Marshal an ECC TPMT_PUBLIC (a template when x/y are the ``unique`` input)."""
    sym = u16(symmetric[0])
    if symmetric[0] != ALG_NULL:
        sym += u16(symmetric[1]) + u16(symmetric[2])
    sch = u16(scheme) + (u16(scheme_hash) if scheme != ALG_NULL else b"")
    return (
        u16(ALG_ECC)
        + u16(name_alg)
        + u32(attributes)
        + tpm2b(auth_policy)
        + sym
        + sch
        + u16(curve)
        + u16(ALG_NULL)  # kdf
        + tpm2b(x)
        + tpm2b(y)
    )


def p1363_from_ecdsa(r_value: bytes, s_value: bytes, size: int = 32) -> bytes:
    """r || s, each left-padded to ``size`` bytes."""
    r_value = r_value.lstrip(b"\0")
    s_value = s_value.lstrip(b"\0")
    if len(r_value) > size or len(s_value) > size:
        raise TpmError("the TPM's ECDSA signature has the wrong size")
    return r_value.rjust(size, b"\0") + s_value.rjust(size, b"\0")


def parse_signature_ecdsa(sig: bytes) -> bytes:
    """A marshalled TPMT_SIGNATURE (ECDSA with SHA-256, P-256) as 64 bytes r || s."""
    r = Reader(sig, "the TPM signature")
    if r.u16() != ALG_ECDSA or r.u16() != ALG_SHA256:
        raise r.fail("not an ECDSA/SHA-256 signature")
    r_value = r.tpm2b(66)
    s_value = r.tpm2b(66)
    r.end()
    return p1363_from_ecdsa(r_value, s_value)


# --- TPMS_ATTEST -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CertifyInfo:
    """A parsed TPMS_ATTEST of type TPM_ST_ATTEST_CERTIFY."""

    qualified_signer: bytes
    extra_data: bytes
    clock: int
    reset_count: int
    restart_count: int
    safe: bool
    firmware_version: int
    name: bytes
    qualified_name: bytes


def parse_certify_attest(attest: bytes) -> CertifyInfo:
    """Parse a TPM2_Certify TPMS_ATTEST (magic TPM_GENERATED_VALUE, type ATTEST_CERTIFY)."""
    if not isinstance(attest, bytes) or len(attest) > MAX_ATTEST:
        raise TpmError("the attestation: not a TPMS_ATTEST")
    r = Reader(attest, "the attestation")
    if r.u32() != TPM_GENERATED_VALUE:
        raise r.fail("not generated by a TPM (magic)")
    if r.u16() != ST_ATTEST_CERTIFY:
        raise r.fail("not a TPM2_Certify attestation")
    signer = r.tpm2b(2 + MAX_DIGEST)
    extra = r.tpm2b(MAX_DIGEST)
    clock = r.u64()
    reset_count = r.u32()
    restart_count = r.u32()
    safe = r.u8()
    if safe not in (0, 1):
        raise r.fail("malformed clock information")
    firmware = r.u64()
    name = r.tpm2b(2 + MAX_DIGEST)
    qualified_name = r.tpm2b(2 + MAX_DIGEST)
    r.end()
    return CertifyInfo(
        qualified_signer=signer,
        extra_data=extra,
        clock=clock,
        reset_count=reset_count,
        restart_count=restart_count,
        safe=bool(safe),
        firmware_version=firmware,
        name=name,
        qualified_name=qualified_name,
    )

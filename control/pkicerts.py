"""The PKI's pure builders and the loaded :class:`Pki` (certificates over values:
keys, names, times); :mod:`control.pki` is its face and its file layer."""

from __future__ import annotations

import base64
import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcd.pki import (
    ROLE_PREFIX,
    ROLES,
    STATEMENT_PREFIX,
    SpiffeId,
    cert_pem,
    parse_spiffe_id,
    spki_pin,
)
from bcd.wire import public_jwk_of

PKI_JSON = "pki.json"
_STEMS = ("node-root-ca", "node-ca", "serving-ca", "command-signing-root", "join-signing")
PKI_FILES = (
    *(f"{stem}.{ext}" for stem in _STEMS for ext in ("key", "crt")),
    "join-encryption.key",
    "join-encryption.pub",
    PKI_JSON,
)

# Every certificate is valid from now - skew (a peer whose clock is a little behind
# already accepts it) for exactly its lifetime, so the lifetime limits hold end to end.
# The skew is a tenth of the lifetime, at most CLOCK_SKEW, so a short-lived
# certificate (tests, ``--cert-ttl-seconds``) is still mostly in the future.
CLOCK_SKEW = timedelta(seconds=60)


def backdate(lifetime: timedelta) -> timedelta:
    return min(CLOCK_SKEW, lifetime / 10)


ROOT_LIFETIME = timedelta(days=3653)  # 10 years
NODE_CA_LIFETIME = timedelta(days=1827)  # 5 years
GATEWAY_LIFETIME = timedelta(days=90)
LEAF_MAX_TTL_S = 86_400
RAMDISK_MAX_TTL_S = 7_200

_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)
_STATEMENT = re.compile(r"^urn:bc:[\x21-\x7e]+$")


class PkiSetupError(Exception):
    """Raised for an operator error around the PKI; ``str()`` is a one-line message."""


# --- pure builders ----------------------------------------------------------------


def new_serial() -> int:
    """A random positive 128-bit serial (top bit set: 127 random bits, 17 DER octets)."""
    return (1 << 127) | secrets.randbits(127)


def _utc(now: datetime) -> datetime:
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now.astimezone(UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(*, sign: bool = False, ca: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _ski(cert: x509.Certificate) -> x509.SubjectKeyIdentifier:
    return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value


def _builder(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_ski: x509.SubjectKeyIdentifier,
    now: datetime,
    lifetime: timedelta,
) -> x509.CertificateBuilder:
    """Valid from ``now - backdate(lifetime)`` for exactly ``lifetime``, with SKI and AKI."""
    not_before = _utc(now) - backdate(lifetime)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(new_serial())
        .not_valid_before(not_before)
        .not_valid_after(not_before + lifetime)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(issuer_ski),
            critical=False,
        )
    )


def make_ca(
    common_name: str,
    key: ec.EllipticCurvePrivateKey,
    now: datetime,
    lifetime: timedelta,
    *,
    path_length: int | None,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
) -> x509.Certificate:
    """A CA certificate, self-signed when ``issuer`` (certificate, key) is None."""
    now = _utc(now)
    subject = _name(common_name)
    if issuer is None:
        issuer_name, signer = subject, key
        issuer_ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    else:
        issuer_name, issuer_ski, signer = issuer[0].subject, _ski(issuer[0]), issuer[1]
    builder = (
        _builder(subject, key.public_key(), issuer_name, issuer_ski, now, lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
    )
    return builder.sign(signer, hashes.SHA256())


def make_signing_cert(
    common_name: str, key: ec.EllipticCurvePrivateKey, now: datetime
) -> x509.Certificate:
    """A self-signed, non-CA certificate carrying a signing key (the join signing key)."""
    now = _utc(now)
    subject = _name(common_name)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        _builder(subject, key.public_key(), subject, ski, now, ROOT_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign=True), critical=True)
    )
    return builder.sign(key, hashes.SHA256())


def _require_p256(key: object) -> ec.EllipticCurvePublicKey:
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError("the key is not ECDSA P-256")
    return key


def _within_issuer(issuer: x509.Certificate, not_after: datetime, what: str) -> None:
    if not_after > issuer.not_valid_after_utc:
        raise PkiSetupError(
            f"the {what} expires at {issuer.not_valid_after_utc.isoformat()}, before this "
            "certificate would; the CA must be rotated"
        )


def normalise_san(san: str) -> x509.DNSName | x509.IPAddress:
    """A gateway name as a SAN: an IP address if it parses as one, else a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(san))
    except ValueError:
        pass
    name = san.lower().rstrip(".")
    if not _DNS_NAME.fullmatch(name):
        raise PkiSetupError(f"not a DNS name or an IP address: {san!r}")
    return x509.DNSName(name)


def _san_text(san: x509.DNSName | x509.IPAddress) -> str:
    return str(san.value)


# --- the loaded PKI ---------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    trust_domain: str
    trust_version: int
    created: datetime
    node_root_ca: x509.Certificate
    node_ca: x509.Certificate
    serving_ca: x509.Certificate
    command_signing_root: x509.Certificate
    join_signing_cert: x509.Certificate
    node_root_ca_key: ec.EllipticCurvePrivateKey = field(repr=False)
    node_ca_key: ec.EllipticCurvePrivateKey = field(repr=False)
    serving_ca_key: ec.EllipticCurvePrivateKey = field(repr=False)
    command_signing_root_key: ec.EllipticCurvePrivateKey = field(repr=False)
    join_signing_key: ec.EllipticCurvePrivateKey = field(repr=False)
    join_encryption_key: ec.EllipticCurvePrivateKey = field(repr=False)

    def certificates(self) -> tuple[x509.Certificate, ...]:
        """The five certificates, in the order of their files (``_STEMS``)."""
        return (
            self.node_root_ca, self.node_ca, self.serving_ca,
            self.command_signing_root, self.join_signing_cert,
        )  # fmt: skip

    def private_keys(self) -> tuple[ec.EllipticCurvePrivateKey, ...]:
        """The six private keys: those of :meth:`certificates`, then the encryption key."""
        return (
            self.node_root_ca_key, self.node_ca_key, self.serving_ca_key,
            self.command_signing_root_key, self.join_signing_key, self.join_encryption_key,
        )  # fmt: skip

    def pins(self) -> dict[str, str]:
        """The three pins a node's config.toml carries."""
        return {
            "serving_ca_spki_pin": spki_pin(_require_p256(self.serving_ca.public_key())),
            "join_signing_key_pin": spki_pin(self.join_signing_key.public_key()),
            "join_encryption_key_pin": spki_pin(self.join_encryption_key.public_key()),
        }

    def well_known_join(self) -> dict[str, object]:
        """The ``join`` section of ``/.well-known/better-compute``."""
        encryption = self.join_encryption_key.public_key()
        der = self.join_signing_cert.public_bytes(serialization.Encoding.DER)
        return {
            "encryptionJwk": public_jwk_of(encryption),
            "encryptionKeyPin": spki_pin(encryption),
            "signingCertificate": base64.b64encode(der).decode("ascii"),
            "signingKeyPin": spki_pin(self.join_signing_key.public_key()),
        }

    def bundle_pem(self) -> str:
        """The command-signing trust bundle sent to nodes."""
        return cert_pem(self.command_signing_root)

    def chain_tail_pem(self) -> str:
        """Node CA then node root CA: appended after a leaf to form its chain."""
        return cert_pem(self.node_ca) + cert_pem(self.node_root_ca)


def _assemble(
    trust_domain: str,
    trust_version: int,
    created: datetime,
    certs: Sequence[x509.Certificate],
    keys: Sequence[ec.EllipticCurvePrivateKey],
) -> Pki:
    """A :class:`Pki` from certificates and keys in the order of ``_STEMS``."""
    return Pki(
        trust_domain=trust_domain, trust_version=trust_version, created=created,
        node_root_ca=certs[0], node_ca=certs[1], serving_ca=certs[2],
        command_signing_root=certs[3], join_signing_cert=certs[4],
        node_root_ca_key=keys[0], node_ca_key=keys[1], serving_ca_key=keys[2],
        command_signing_root_key=keys[3], join_signing_key=keys[4], join_encryption_key=keys[5],
    )  # fmt: skip


def issue_node_leaf(
    pki: Pki,
    public_key: ec.EllipticCurvePublicKey,
    spiffe: SpiffeId,
    role: str,
    statements: Sequence[str],
    now: datetime,
    ttl_s: int,
) -> x509.Certificate:
    """A node client certificate from the node CA (PROTOCOL.md, "Certificates").

    Raises ``ValueError`` for a request JoinService should never make: a key that is
    not P-256, an unknown role, a lifetime over 24 h (2 h for ramdisk), a SPIFFE ID
    of another trust domain, or a statement that is not ``urn:bc:``.
    """
    _require_p256(public_key)
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    limit = RAMDISK_MAX_TTL_S if role == "ramdisk" else LEAF_MAX_TTL_S
    if not 0 < ttl_s <= limit:
        raise ValueError(f"a {role} certificate lives 1 to {limit} seconds, not {ttl_s}")
    if parse_spiffe_id(str(spiffe)) != spiffe or spiffe.trust_domain != pki.trust_domain:
        raise ValueError("the SPIFFE ID is not one of this trust domain")
    if isinstance(statements, str):
        raise ValueError("statements is a sequence of urn:bc: URIs")
    for statement in statements:
        if not _STATEMENT.fullmatch(statement) or not statement.startswith(STATEMENT_PREFIX):
            raise ValueError("a certificate statement must be a urn:bc: URI")
    if len(set(statements)) != len(statements):
        raise ValueError("duplicate certificate statements")
    now = _utc(now)
    lifetime = timedelta(seconds=ttl_s)
    _within_issuer(pki.node_ca, now - backdate(lifetime) + lifetime, "node CA")
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROLE_PREFIX + role)])
    uris = [x509.UniformResourceIdentifier(str(spiffe))]
    uris += [x509.UniformResourceIdentifier(s) for s in statements]
    builder = (
        _builder(subject, public_key, pki.node_ca.subject, _ski(pki.node_ca), now, lifetime)
        .add_extension(x509.SubjectAlternativeName(uris), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    return builder.sign(pki.node_ca_key, hashes.SHA256())


def make_gateway_cert(
    pki: Pki, public_key: ec.EllipticCurvePublicKey, san: str, now: datetime
) -> x509.Certificate:
    """A gateway serving certificate from the serving CA, 90 days."""
    name = normalise_san(san)
    now = _utc(now)
    _within_issuer(
        pki.serving_ca, now - backdate(GATEWAY_LIFETIME) + GATEWAY_LIFETIME, "serving CA"
    )
    builder = (
        _builder(
            _name(_san_text(name)),
            _require_p256(public_key),
            pki.serving_ca.subject,
            _ski(pki.serving_ca),
            now,
            GATEWAY_LIFETIME,
        )
        .add_extension(x509.SubjectAlternativeName([name]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    )
    return builder.sign(pki.serving_ca_key, hashes.SHA256())

"""The control plane's PKI: ``better-compute pki init``, gateway certificates, node leaves.

Pure builders over values (keys, names, times) plus a thin file layer that writes
only through :mod:`bcd.fs`. The PKI directory (0700) holds::

    node-root-ca.crt/.key          node root CA, 10 years; signs only the node CA
    node-ca.crt/.key               node CA (pathlen 0), 5 years; signs node leaves
    serving-ca.crt/.key            serving CA (pathlen 0), 10 years; signs gateway certs
    command-signing-root.crt/.key  command-signing root, 10 years (the trust bundle)
    join-signing.crt/.key          JoinService signing key, in a self-signed certificate
    join-encryption.key            JoinService encryption key (sealed join tokens)
    join-encryption.pub            its public key (PEM), so the pins need no secret
    pki.json                       {trust_domain, trust_version, created}, written last
    gateway-<san>.crt/.key         gateway serving chain and key (pki issue-gateway)

Every key is ECDSA P-256, stored as PKCS#8 PEM encrypted with the operator's
secret (BETTER_COMPUTE_SECRET), mode 0600; certificates are 0644. Certificates
start 60 seconds before ``now`` so a peer whose clock is slightly behind ours
already accepts them, and end one lifetime after that (a 24 h leaf spans exactly
24 h). Operator mistakes raise :class:`PkiSetupError` with one line
that never contains key material or the secret.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import secrets
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcd import fs
from bcd.pki import (
    ROLE_PREFIX,
    ROLES,
    STATEMENT_PREFIX,
    SpiffeId,
    cert_pem,
    generate_key,
    parse_spiffe_id,
    spki_pin,
    valid_trust_domain,
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


# --- files ------------------------------------------------------------------------


KDF_ROUNDS = 600_000
"""PBKDF2-HMAC-SHA256 iterations for each key file: OWASP's figure for that KDF (2023).
cryptography's PKCS#8 writer fixes its own (2,048); its PKCS#12 writer takes ours."""
LEGACY_PEM = b"-----BEGIN ENCRYPTED PRIVATE KEY-----"


def _key_bytes(key: ec.EllipticCurvePrivateKey, secret: bytes) -> bytes:
    """A key file: PKCS#12 (DER), the key under PBES2 with PBKDF2-HMAC-SHA256 at
    KDF_ROUNDS iterations and AES-256-CBC, and its MAC at the same cost."""
    encryption = (
        serialization.PrivateFormat.PKCS12.encryption_builder()
        .kdf_rounds(KDF_ROUNDS)
        .key_cert_algorithm(pkcs12.PBES.PBESv2SHA256AndAES256CBC)
        .hmac_hash(hashes.SHA256())
        .build(secret)
    )
    return pkcs12.serialize_key_and_certificates(b"better-compute", key, None, None, encryption)


def _public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def public_pins(directory: Path) -> dict[str, str] | None:
    """The three pins from the PKI's public files alone (no secret), or None for a PKI
    made before join-encryption.pub existed (then :func:`load_pki` gives them)."""
    pub = directory / "join-encryption.pub"
    if not pub.exists():
        return None
    try:
        encryption = serialization.load_pem_public_key(_read(pub, directory))
    except ValueError:
        raise PkiSetupError(
            f"the PKI in {directory} is damaged: {pub.name} does not parse"
        ) from None
    if not isinstance(encryption, ec.EllipticCurvePublicKey):
        raise PkiSetupError(f"the PKI in {directory} is damaged: {pub.name} is not P-256")
    serving = _load_cert(directory / "serving-ca.crt", directory)
    signing = _load_cert(directory / "join-signing.crt", directory)
    return {
        "serving_ca_spki_pin": spki_pin(_require_p256(serving.public_key())),
        "join_signing_key_pin": spki_pin(_require_p256(signing.public_key())),
        "join_encryption_key_pin": spki_pin(_require_p256(encryption)),
    }


def _decrypt_key(data: bytes, secret: bytes) -> object:
    """A key file of either form: PKCS#12 (written since issue 11) or the PKCS#8 PEM of
    earlier PKIs (PBKDF2 at 2,048 iterations), still read."""
    if data.lstrip().startswith(LEGACY_PEM):
        return serialization.load_pem_private_key(data, password=secret)
    key, _cert, _extra = pkcs12.load_key_and_certificates(data, secret)
    return key


def _check_secret(secret: bytes) -> None:
    if not secret:
        raise PkiSetupError("BETTER_COMPUTE_SECRET is empty; set it to the PKI's secret")


def build_pki(trust_domain: str, now: datetime) -> Pki:
    """Fresh keys and certificates for a new PKI, in memory (pure but for randomness)."""
    if not valid_trust_domain(trust_domain):
        raise PkiSetupError(f"not a valid trust domain: {trust_domain!r}")
    now, td = _utc(now), trust_domain
    keys = [generate_key() for _ in range(6)]
    root = make_ca(f"better-compute node root CA {td}", keys[0], now, ROOT_LIFETIME, path_length=1)
    node_ca = make_ca(
        f"better-compute node CA {td}", keys[1], now, NODE_CA_LIFETIME, path_length=0,
        issuer=(root, keys[0]),
    )  # fmt: skip
    serving = make_ca(f"better-compute serving CA {td}", keys[2], now, ROOT_LIFETIME, path_length=0)
    command = make_ca(
        f"better-compute command-signing root {td}", keys[3], now, ROOT_LIFETIME, path_length=None
    )
    signing = make_signing_cert(f"better-compute join signing {td}", keys[4], now)
    certs = [root, node_ca, serving, command, signing]
    return _assemble(td, 1, now.replace(microsecond=0), certs, keys)


def init_pki(directory: Path, trust_domain: str, secret: bytes, now: datetime) -> None:
    """``better-compute pki init``: create every CA and JoinService key in ``directory``.

    Refuses when any PKI file is already there. ``pki.json`` is written last, so an
    interrupted init leaves files without it, which both this and :func:`load_pki`
    report.
    """
    _check_secret(secret)
    if not valid_trust_domain(trust_domain):
        raise PkiSetupError(f"not a valid trust domain: {trust_domain!r}")
    if (directory / PKI_JSON).exists():
        raise PkiSetupError(f"a PKI already exists in {directory}; refusing to overwrite it")
    present = [name for name in PKI_FILES if os.path.lexists(directory / name)]
    if present:
        raise PkiSetupError(
            f"{', '.join(present)} already in {directory} (an interrupted pki init?); "
            "refusing to overwrite it: move the directory aside and run pki init again"
        )
    pki = build_pki(trust_domain, now)
    files: list[tuple[str, bytes, int]] = []
    for stem, cert, key in zip(_STEMS, pki.certificates(), pki.private_keys(), strict=False):
        files.append((f"{stem}.key", _key_bytes(key, secret), 0o600))
        files.append((f"{stem}.crt", cert_pem(cert).encode(), 0o644))
    files.append(("join-encryption.key", _key_bytes(pki.join_encryption_key, secret), 0o600))
    files.append(("join-encryption.pub", _public_pem(pki.join_encryption_key), 0o644))
    created = pki.created.strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = {"trust_domain": pki.trust_domain, "trust_version": 1, "created": created}
    files.append((PKI_JSON, (json.dumps(meta, indent=2) + "\n").encode(), 0o644))  # last
    try:
        fs.ensure_dir(directory, 0o700)
    except OSError:
        raise PkiSetupError(f"cannot create the PKI directory {directory}") from None
    name = ""
    try:
        for name, data, mode in files:
            fs.create_new(directory / name, data, mode)
    except FileExistsError:
        raise PkiSetupError(
            f"{name} appeared in {directory} during pki init; refusing to overwrite it"
        ) from None
    except OSError as exc:
        raise PkiSetupError(f"cannot write {name} in {directory}: {exc.strerror}") from exc


def _read(path: Path, directory: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PkiSetupError(
            f"the PKI in {directory} is incomplete: {path.name} is missing"
        ) from None
    except OSError as exc:
        raise PkiSetupError(f"cannot read {path}: {exc.strerror}") from exc


def _load_cert(path: Path, directory: Path) -> x509.Certificate:
    try:
        cert = x509.load_pem_x509_certificate(_read(path, directory))
    except ValueError:
        raise PkiSetupError(
            f"the PKI in {directory} is damaged: {path.name} does not parse"
        ) from None
    try:
        _require_p256(cert.public_key())
    except ValueError:
        raise PkiSetupError(
            f"the PKI in {directory} is damaged: {path.name} is not P-256"
        ) from None
    return cert


def _load_key(path: Path, directory: Path, secret: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    data = _read(path, directory)
    if b"-----BEGIN" in data and not data.lstrip().startswith(LEGACY_PEM):
        raise PkiSetupError(f"{path.name} in {directory} is not an encrypted private key")
    try:
        key = _decrypt_key(data, secret)
    except (ValueError, TypeError):
        raise PkiSetupError(
            f"BETTER_COMPUTE_SECRET does not decrypt {what} in {directory}"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PkiSetupError(f"{path.name} in {directory} is not a P-256 key")
    return key


def _pair(
    directory: Path, stem: str, secret: bytes
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = _load_cert(directory / f"{stem}.crt", directory)
    key = _load_key(directory / f"{stem}.key", directory, secret, "the PKI")
    if cert.public_key() != key.public_key():
        raise PkiSetupError(
            f"the PKI in {directory} is damaged: {stem}.key does not match {stem}.crt"
        )
    return cert, key


def load_pki(directory: Path, secret: bytes) -> Pki:
    """Load and check the PKI ``init_pki`` wrote; raise :class:`PkiSetupError` if unusable."""
    _check_secret(secret)
    meta_path = directory / PKI_JSON
    if not meta_path.exists():
        if any(os.path.lexists(directory / name) for name in PKI_FILES):
            raise PkiSetupError(
                f"the PKI in {directory} is incomplete: {PKI_JSON} is missing (an interrupted "
                "pki init?); move the directory aside and run pki init again"
            )
        raise PkiSetupError(
            f"no PKI in {directory}; run: better-compute pki init --trust-domain <domain>"
        )
    try:
        meta = json.loads(_read(meta_path, directory))
        trust_domain, trust_version = meta["trust_domain"], meta["trust_version"]
        created = datetime.fromisoformat(meta["created"])
    except (ValueError, TypeError, KeyError):
        raise PkiSetupError(
            f"the PKI in {directory} is damaged: {PKI_JSON} does not parse"
        ) from None
    if not isinstance(trust_domain, str) or not valid_trust_domain(trust_domain):
        raise PkiSetupError(f"the PKI in {directory} is damaged: bad trust_domain in {PKI_JSON}")
    if type(trust_version) is not int or trust_version < 1 or created.tzinfo is None:
        raise PkiSetupError(f"the PKI in {directory} is damaged: bad {PKI_JSON}")
    pairs = [_pair(directory, stem, secret) for stem in _STEMS]  # in Pki's field order
    encryption_key = _load_key(directory / "join-encryption.key", directory, secret, "the PKI")
    found = public_pins(directory)
    if found is not None and found["join_encryption_key_pin"] != spki_pin(
        encryption_key.public_key()
    ):
        raise PkiSetupError(
            f"the PKI in {directory} is damaged: join-encryption.pub is not join-encryption.key's"
        )
    certs, keys = [c for c, _ in pairs], [k for _, k in pairs]
    return _assemble(trust_domain, trust_version, created, certs, [*keys, encryption_key])


def rotate_join_encryption_key(directory: Path, secret: bytes, now: datetime) -> Path:
    """``better-compute pki rotate-join-key``: a new JoinService encryption key.

    The PKI must load first. The old key is kept (still encrypted) as
    ``join-encryption.key.retired-<unix time>``, then the new one replaces
    ``join-encryption.key`` atomically. ``serve`` reads it at start: until it restarts
    it keeps the old key; after, tokens sealed to the old key no longer open, so every
    install script must be generated again (it carries the key and its pin). Joined
    nodes are not affected: the key only seals join tokens. Returns the retired file.
    """
    load_pki(directory, secret)
    current = directory / "join-encryption.key"
    retired = directory / f"join-encryption.key.retired-{int(_utc(now).timestamp())}"
    try:
        fs.create_new(retired, current.read_bytes(), 0o600)
        new_key = generate_key()
        fs.atomic_write(current, _key_bytes(new_key, secret), 0o600)
        fs.atomic_write(directory / "join-encryption.pub", _public_pem(new_key), 0o644)
    except FileExistsError:
        raise PkiSetupError(f"{retired.name} exists; rotate again in a second") from None
    except OSError as exc:
        raise PkiSetupError(f"cannot rotate the join key in {directory}: {exc.strerror}") from exc
    return retired


def gateway_paths(directory: Path, san: str) -> tuple[Path, Path]:
    """(chain, key) paths of the gateway certificate for ``san`` (normalised)."""
    name = _san_text(normalise_san(san))
    return directory / f"gateway-{name}.crt", directory / f"gateway-{name}.key"


def issue_gateway(
    pki: Pki, directory: Path, san: str, secret: bytes, now: datetime
) -> tuple[Path, Path]:
    """``better-compute pki issue-gateway --san SAN``: write a fresh chain and key.

    The key is written before the chain, so a crash between them leaves a pair that
    :func:`load_gateway` reports as mismatched rather than a silently stale one.
    """
    _check_secret(secret)
    crt_path, key_path = gateway_paths(directory, san)
    key = generate_key()
    leaf = make_gateway_cert(pki, key.public_key(), san, now)
    try:
        fs.atomic_write(key_path, _key_bytes(key, secret), 0o600)
        fs.atomic_write(crt_path, (cert_pem(leaf) + cert_pem(pki.serving_ca)).encode(), 0o644)
    except OSError as exc:
        raise PkiSetupError(f"cannot write the gateway certificate: {exc.strerror}") from exc
    return crt_path, key_path


def load_gateway(
    directory: Path, san: str, secret: bytes
) -> tuple[str, ec.EllipticCurvePrivateKey]:
    """The gateway chain (PEM, leaf first) and its key, as :func:`issue_gateway` wrote them."""
    _check_secret(secret)
    crt_path, key_path = gateway_paths(directory, san)
    if not crt_path.exists() or not key_path.exists():
        raise PkiSetupError(
            f"no gateway certificate for {san} in {directory}; "
            f"run: better-compute pki issue-gateway --san {san}"
        )
    data = _read(crt_path, directory)
    try:
        leaf = x509.load_pem_x509_certificates(data)[0]
        chain = data.decode("ascii")
    except (ValueError, IndexError):
        raise PkiSetupError(f"{crt_path.name} in {directory} does not parse") from None
    key = _load_key(key_path, directory, secret, key_path.name)
    if leaf.public_key() != key.public_key():
        raise PkiSetupError(
            f"{key_path.name} does not match {crt_path.name} in {directory}; "
            f"run: better-compute pki issue-gateway --san {san}"
        )
    return chain, key


# --- TLS --------------------------------------------------------------------------


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_chain(ctx: ssl.SSLContext, chain_pem: str, key: ec.EllipticCurvePrivateKey) -> None:
    """Give ``ctx`` a certificate chain and its key through memfds, never a file."""
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    chain_fd = _memfd("bc-tls-chain", chain_pem.encode("ascii"))
    try:
        key_fd = _memfd("bc-tls-key", key_pem)
        try:
            ctx.load_cert_chain(f"/proc/self/fd/{chain_fd}", f"/proc/self/fd/{key_fd}")
        except ssl.SSLError as exc:
            raise PkiSetupError(
                f"the TLS certificate chain and key do not load: {exc.reason}"
            ) from None
        finally:
            os.close(key_fd)
    finally:
        os.close(chain_fd)


# OpenSSL's X509_V_FLAG_NO_CHECK_TIME (Python's ssl module has no name for it)
_NO_CHECK_TIME = 0x200000


def server_ssl_context(
    chain_pem: str,
    key: ec.EllipticCurvePrivateKey,
    client_ca_pem: str | None = None,
    *,
    client_time_in_app: bool = False,
) -> ssl.SSLContext:
    """A TLS 1.2+ server context; the key reaches OpenSSL through a memfd, never a file.

    No session tickets are issued (a resumed session skips certificate checks).
    With ``client_ca_pem`` the server asks for a client certificate chaining to it
    (``CERT_OPTIONAL``); the application refuses a connection without one, and checks
    revocation on every connection (OpenSSL's in-process TLS 1.2 session-ID cache
    cannot be turned off from Python).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # TLS 1.2 with forward-secret AEAD suites only (TLS 1.3's are all AEAD)
    ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.options |= ssl.OP_NO_TICKET
    ctx.num_tickets = 0
    load_chain(ctx, chain_pem, key)
    if client_ca_pem is not None:
        ctx.load_verify_locations(cadata=client_ca_pem)
        ctx.verify_mode = ssl.CERT_OPTIONAL
        if client_time_in_app:
            # The gateway: an expired node certificate completes the handshake, so the
            # application answers it UNAUTHENTICATED (it checks every certificate
            # against its node_certs row and the database's time, peer_status), and the
            # node learns its identity expired instead of seeing a broken handshake.
            ctx.verify_flags = ctx.verify_flags | _NO_CHECK_TIME
    return ctx

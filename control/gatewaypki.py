"""What a gateway-role host holds: its serving certificate and its relay credential.

``better-compute pki issue-gateway --san SAN --out DIR`` (run where the PKI and its
secret are) writes a *gateway bundle* for one gateway host::

    gateway.crt     serving chain (leaf, serving CA), 0644: what nodes see
    gateway.key     its key, PKCS#8 PEM, unencrypted, 0600
    relay.crt       relay client chain (leaf, serving CA), 0644: what API replicas see
    relay.key       its key, unencrypted, 0600
    node-ca.crt     node CA and node root CA (to verify node client certificates), 0644
    serving-ca.crt  the serving CA (to verify an API replica's relay listener), 0644
    gateway.json    {trust_domain, san, relay_name, created}, 0644, written last

Nothing else: no CA key, no JoinService key, no secret. The two keys are stored
unencrypted, like any TLS server's, because a gateway must restart unattended without
``BETTER_COMPUTE_SECRET``; the directory is 0700 and the loader refuses a key file
another user can read.

The relay certificate comes from the serving CA with extended key usage clientAuth
only and the subject ``OU=bc-role:relay``; an API replica's relay listener verifies
client certificates against the serving CA (OpenSSL's ``ssl_client`` purpose, so a
serverAuth-only gateway certificate is refused in the handshake) and then requires
that OU (:func:`is_relay_certificate`). Node leaves come from the node CA and never
verify there.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcd import fs
from bcd.pki import ROLE_PREFIX, cert_pem, generate_key
from control import pki, pkicerts
from control.pki import GATEWAY_LIFETIME, Pki, PkiSetupError

RELAY_ROLE = ROLE_PREFIX + "relay"
BUNDLE_JSON = "gateway.json"
_KEY_FILES = ("gateway.key", "relay.key")


def make_relay_cert(
    loaded: Pki, public_key: ec.EllipticCurvePublicKey, name: str, now: datetime
) -> x509.Certificate:
    """A relay client certificate from the serving CA, 90 days, clientAuth only."""
    now = pkicerts._utc(now)
    start = now - pki.backdate(GATEWAY_LIFETIME)
    pkicerts._within_issuer(loaded.serving_ca, start + GATEWAY_LIFETIME, "serving CA")
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, RELAY_ROLE),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    builder = (
        pkicerts._builder(
            subject,
            pkicerts._require_p256(public_key),
            loaded.serving_ca.subject,
            pkicerts._ski(loaded.serving_ca),
            now,
            GATEWAY_LIFETIME,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(pkicerts._key_usage(sign=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    return builder.sign(loaded.serving_ca_key, hashes.SHA256())


def is_relay_certificate(der: bytes | None) -> str | None:
    """The relay's name when ``der`` is a relay certificate (``OU=bc-role:relay``), else None.

    The TLS layer has already verified it up to the serving CA; this tells a relay
    credential from any other certificate that CA issued.
    """
    if der is None:
        return None
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        return None
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if [str(a.value) for a in ous] != [RELAY_ROLE]:
        return None
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return None
    if list(usage) != [ExtendedKeyUsageOID.CLIENT_AUTH]:
        return None
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else "relay"


def _plain(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def issue_bundle(loaded: Pki, out: Path, san: str, now: datetime) -> Path:
    """Write a gateway bundle for ``san`` into ``out`` (created 0700); return gateway.json.

    A bundle already in ``out`` is replaced file by file (keys first, gateway.json
    last), so a re-issue before the 90 days end is a rotation.
    """
    name = pkicerts._san_text(pki.normalise_san(san))
    serving_key, relay_key = generate_key(), generate_key()
    serving = pki.make_gateway_cert(loaded, serving_key.public_key(), san, now)
    relay = make_relay_cert(loaded, relay_key.public_key(), name, now)
    ca = cert_pem(loaded.serving_ca)
    meta = {
        "trust_domain": loaded.trust_domain,
        "san": name,
        "relay_name": name,
        "created": pkicerts._utc(now).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "not_after": serving.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    files: list[tuple[str, bytes, int]] = [
        ("gateway.key", _plain(serving_key), 0o600),
        ("relay.key", _plain(relay_key), 0o600),
        ("gateway.crt", (cert_pem(serving) + ca).encode(), 0o644),
        ("relay.crt", (cert_pem(relay) + ca).encode(), 0o644),
        ("node-ca.crt", loaded.chain_tail_pem().encode(), 0o644),
        ("serving-ca.crt", ca.encode(), 0o644),
        (BUNDLE_JSON, (json.dumps(meta, indent=2) + "\n").encode(), 0o644),
    ]
    try:
        fs.ensure_dir(out, 0o700)
        for file_name, data, mode in files:
            fs.atomic_write(out / file_name, data, mode)
    except OSError as exc:
        raise PkiSetupError(f"cannot write the gateway bundle in {out}: {exc.strerror}") from exc
    return out / BUNDLE_JSON


@dataclass(frozen=True)
class GatewayBundle:
    trust_domain: str
    san: str
    serving_chain_pem: str
    relay_chain_pem: str
    node_ca_pem: str
    serving_ca_pem: str
    serving_key: ec.EllipticCurvePrivateKey = field(repr=False)
    relay_key: ec.EllipticCurvePrivateKey = field(repr=False)


def _read(directory: Path, name: str) -> bytes:
    path = directory / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PkiSetupError(
            f"the gateway bundle in {directory} is incomplete: {name} is missing; "
            "run: better-compute pki issue-gateway --san SAN --out DIR"
        ) from None
    except OSError as exc:
        raise PkiSetupError(f"cannot read {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > 64 * 1024:
            raise PkiSetupError(f"{path} is not a regular file of at most 64 KiB")
        if name in _KEY_FILES and info.st_mode & 0o077:
            raise PkiSetupError(
                f"{path} can be read by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"run: chmod 600 {path}"
            )
        return f.read()


def _key(directory: Path, name: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(_read(directory, name), password=None)
    except (ValueError, TypeError):
        raise PkiSetupError(f"{name} in {directory} is not an unencrypted private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PkiSetupError(f"{name} in {directory} is not a P-256 key")
    return key


def _leaf(directory: Path, name: str) -> tuple[str, x509.Certificate]:
    data = _read(directory, name)
    try:
        certs = x509.load_pem_x509_certificates(data)
        return data.decode("ascii"), certs[0]
    except (ValueError, IndexError, UnicodeDecodeError):
        raise PkiSetupError(f"{name} in {directory} does not parse") from None


def _node_cas(directory: Path) -> str:
    """node-ca.crt's text, once it is seen to hold the node CA and the root that issued
    it: nodes present their leaf alone (``bcd.tls.presented_leaf``), so a gateway
    without the node CA would refuse every one of them at the handshake."""
    data = _read(directory, "node-ca.crt")
    try:
        certs = x509.load_pem_x509_certificates(data)
        text = data.decode("ascii")
    except (ValueError, UnicodeDecodeError):
        raise PkiSetupError(f"node-ca.crt in {directory} does not parse") from None
    roots = {c.subject for c in certs if c.subject == c.issuer}
    if not any(c.subject != c.issuer and c.issuer in roots for c in certs):
        raise PkiSetupError(
            f"node-ca.crt in {directory} must hold the node CA and the node root CA that "
            "issued it (nodes present their leaf alone)"
        )
    return text


def load_bundle(directory: Path) -> GatewayBundle:
    """Load and check a bundle :func:`issue_bundle` wrote; :class:`PkiSetupError` if unusable."""
    try:
        meta = json.loads(_read(directory, BUNDLE_JSON))
        trust_domain, san = str(meta["trust_domain"]), str(meta["san"])
    except (ValueError, TypeError, KeyError):
        raise PkiSetupError(f"{BUNDLE_JSON} in {directory} does not parse") from None
    serving_chain, serving_leaf = _leaf(directory, "gateway.crt")
    relay_chain, relay_leaf = _leaf(directory, "relay.crt")
    serving_key, relay_key = _key(directory, "gateway.key"), _key(directory, "relay.key")
    if serving_leaf.public_key() != serving_key.public_key():
        raise PkiSetupError(f"gateway.key does not match gateway.crt in {directory}")
    if relay_leaf.public_key() != relay_key.public_key():
        raise PkiSetupError(f"relay.key does not match relay.crt in {directory}")
    return GatewayBundle(
        trust_domain=trust_domain,
        san=san,
        serving_chain_pem=serving_chain,
        relay_chain_pem=relay_chain,
        node_ca_pem=_node_cas(directory),
        serving_ca_pem=_read(directory, "serving-ca.crt").decode("ascii"),
        serving_key=serving_key,
        relay_key=relay_key,
    )

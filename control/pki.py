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

import json
import os
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12

from bcd import fs
from bcd.pki import (
    cert_pem,
    generate_key,
    spki_pin,
    valid_trust_domain,
)
from control.pkicerts import (
    _STEMS,
    CLOCK_SKEW,
    GATEWAY_LIFETIME,
    LEAF_MAX_TTL_S,
    NODE_CA_LIFETIME,
    PKI_FILES,
    PKI_JSON,
    RAMDISK_MAX_TTL_S,
    ROOT_LIFETIME,
    Pki,
    PkiSetupError,
    _assemble,
    _require_p256,
    _san_text,
    _utc,
    backdate,
    issue_node_leaf,
    make_ca,
    make_gateway_cert,
    make_signing_cert,
    new_serial,
    normalise_san,
)
from control.pkitls import load_chain, server_ssl_context

__all__ = [
    "CLOCK_SKEW",
    "GATEWAY_LIFETIME",
    "KDF_ROUNDS",
    "LEAF_MAX_TTL_S",
    "LEGACY_PEM",
    "NODE_CA_LIFETIME",
    "PKI_FILES",
    "PKI_JSON",
    "RAMDISK_MAX_TTL_S",
    "ROOT_LIFETIME",
    "Pki",
    "PkiSetupError",
    "backdate",
    "build_pki",
    "gateway_paths",
    "init_pki",
    "issue_gateway",
    "issue_node_leaf",
    "load_chain",
    "load_gateway",
    "load_pki",
    "make_ca",
    "make_gateway_cert",
    "make_signing_cert",
    "new_serial",
    "normalise_san",
    "public_pins",
    "rotate_join_encryption_key",
    "server_ssl_context",
]

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
        raise PkiSetupError(f"the PKI secret does not decrypt {what} in {directory}") from None
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

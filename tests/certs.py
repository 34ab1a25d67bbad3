"""A tiny test PKI: a CA and node leaves that bcd.pki.leaf_info reads.

Usage::

    ca = make_ca()
    key = pki.generate_key()
    leaf = ca.issue_leaf(key.public_key(), node_id=new_id("node"))
    chain = chain_pem(leaf, ca)
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcd import pki
from bcd.identity import Identity, format_time, make_identity
from control import pki as control_pki

TRUST_DOMAIN = "td.example"
_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def new_id(prefix: str) -> str:
    """``<prefix>_`` and 26 random lowercase Crockford base32 characters."""
    return f"{prefix}_" + "".join(secrets.choice(_ALPHABET) for _ in range(26))


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class CertAuthority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def issue_leaf(
        self,
        public_key: ec.EllipticCurvePublicKey,
        *,
        node_id: str | None = None,
        site_id: str | None = None,
        trust_domain: str = TRUST_DOMAIN,
        role: str = "node",
        not_before: datetime | None = None,
        not_after: datetime | None = None,
        statements: tuple[str, ...] = (),
    ) -> x509.Certificate:
        """A node leaf: SPIFFE URI SAN first, then statements; subject OU=bc-role:<role>."""
        start = not_before or _now() - timedelta(minutes=5)
        end = not_after or start + timedelta(hours=24)
        spiffe = pki.SpiffeId(trust_domain, site_id or new_id("site"), node_id or new_id("node"))
        uris = [x509.UniformResourceIdentifier(str(spiffe))]
        uris += [x509.UniformResourceIdentifier(s) for s in statements]
        return (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"bc-role:{role}")])
            )
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(secrets.randbits(127) + 1)
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(uris), critical=True)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )


def make_ca(common_name: str = "bc test CA") -> CertAuthority:
    """A self-signed test CA, built by the control plane's own CA builder."""
    key = pki.generate_key()
    cert = control_pki.make_ca(
        common_name, key, _now() - timedelta(days=1), timedelta(days=3650), path_length=None
    )
    return CertAuthority(key, cert)


def chain_pem(leaf: x509.Certificate, ca: CertAuthority) -> str:
    """The chain as identity.json keeps it: leaf first, then the issuing CA."""
    return pki.cert_pem(leaf) + pki.cert_pem(ca.cert)


def node_identity(
    ca: CertAuthority | None = None,
    key: ec.EllipticCurvePrivateKey | None = None,
    **leaf_args: object,
) -> tuple[ec.EllipticCurvePrivateKey, Identity]:
    """A node key and the Identity of a leaf ``ca`` issued for it (file key)."""
    ca = ca or make_ca()
    key = key or pki.generate_key()
    leaf = ca.issue_leaf(key.public_key(), **leaf_args)  # type: ignore[arg-type]
    identity = make_identity(
        chain=chain_pem(leaf, ca),
        bundle=pki.cert_pem(ca.cert),
        trust_version=1,
        server_time=format_time(_now()),
        key="file",
        identity_generation=1,
    )
    return key, identity

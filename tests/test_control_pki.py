"""control.pki with real files and real crypto: init, load, leaves, gateway, TLS."""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import socket
import ssl
import stat
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import DNSName, IPAddress
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store

from bcd import pki as bpki
from bcd.wire import public_key_of_jwk
from control import pki as cpki

SECRET = b"correct horse battery staple"
TD = "compute.example.com"
SITE = "site_01k5w3z8q9m4n7p2r6t8v0x1y3"
NODE = "node_01k5w3z8q9m4n7p2r6t8v0x1y4"
SPIFFE = bpki.SpiffeId(TD, SITE, NODE)
AK = "urn:bc:tpm-ak:sha256:" + "ab" * 32

CA_FILES = ("node-root-ca", "node-ca", "serving-ca", "command-signing-root")


def _now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pki") / "pki"
    cpki.init_pki(directory, TD, SECRET, _now())
    return directory


@pytest.fixture(scope="module")
def pki(pki_dir: Path) -> cpki.Pki:
    return cpki.load_pki(pki_dir, SECRET)


def _ext(
    cert: x509.Certificate, cls: type[x509.ExtensionType]
) -> x509.Extension[x509.ExtensionType]:
    return cert.extensions.get_extension_for_class(cls)


def _openssl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["openssl", "verify", *map(str, args)], capture_output=True, text=True, check=False
    )


def _pem(path: Path, *certs: x509.Certificate) -> Path:
    path.write_text("".join(bpki.cert_pem(c) for c in certs))
    return path


# --- init and load ----------------------------------------------------------------


def test_init_writes_every_file_with_its_mode(pki_dir: Path) -> None:
    assert stat.S_IMODE(pki_dir.stat().st_mode) == 0o700
    names = sorted(p.name for p in pki_dir.iterdir())
    assert names == sorted(cpki.PKI_FILES)
    for name in cpki.PKI_FILES:
        mode = stat.S_IMODE((pki_dir / name).stat().st_mode)
        assert mode == (0o600 if name.endswith(".key") else 0o644), name
        if name.endswith(".key"):  # PKCS#12, PBKDF2-HMAC-SHA256 at 600,000 iterations
            data = (pki_dir / name).read_bytes()
            assert data[:1] == b"\x30"
            assert b"PRIVATE KEY" not in data
    meta = json.loads((pki_dir / "pki.json").read_text())
    assert meta["trust_domain"] == TD
    assert meta["trust_version"] == 1
    assert datetime.fromisoformat(meta["created"]).tzinfo is not None


def test_ca_certificates(pki: cpki.Pki) -> None:
    cas = [pki.node_root_ca, pki.node_ca, pki.serving_ca, pki.command_signing_root]
    assert len({c.subject for c in [*cas, pki.join_signing_cert]}) == 5
    for cert in cas:
        bc = _ext(cert, x509.BasicConstraints)
        assert bc.critical
        assert isinstance(bc.value, x509.BasicConstraints)
        assert bc.value.ca
        ku = _ext(cert, x509.KeyUsage)
        assert ku.critical
        assert isinstance(ku.value, x509.KeyUsage)
        assert ku.value.key_cert_sign
        assert ku.value.crl_sign
        assert not ku.value.digital_signature
        _ext(cert, x509.SubjectKeyIdentifier)
        _ext(cert, x509.AuthorityKeyIdentifier)
        key = cert.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey)
        assert key.curve.name == "secp256r1"
    node_ca_bc = _ext(pki.node_ca, x509.BasicConstraints).value
    assert isinstance(node_ca_bc, x509.BasicConstraints)
    assert node_ca_bc.path_length == 0
    assert pki.node_ca.issuer == pki.node_root_ca.subject
    pki.node_ca.verify_directly_issued_by(pki.node_root_ca)
    life = pki.node_root_ca.not_valid_after_utc - pki.node_root_ca.not_valid_before_utc
    assert timedelta(days=3650) < life < timedelta(days=3660)
    life = pki.node_ca.not_valid_after_utc - pki.node_ca.not_valid_before_utc
    assert timedelta(days=1824) < life < timedelta(days=1830)
    cn = pki.node_root_ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == f"better-compute node root CA {TD}"


def test_init_refuses_a_second_time(pki_dir: Path) -> None:
    before = {p.name: p.read_bytes() for p in pki_dir.iterdir()}
    with pytest.raises(
        cpki.PkiSetupError, match=r"a PKI already exists in .*refusing to overwrite"
    ):
        cpki.init_pki(pki_dir, TD, SECRET, _now())
    assert {p.name: p.read_bytes() for p in pki_dir.iterdir()} == before


def test_init_refuses_after_an_interrupted_init_naming_the_file(tmp_path: Path) -> None:
    directory = tmp_path / "pki"
    directory.mkdir()
    (directory / "node-ca.key").write_bytes(b"half")
    with pytest.raises(cpki.PkiSetupError, match=r"node-ca\.key already in .*refusing"):
        cpki.init_pki(directory, TD, SECRET, _now())
    with pytest.raises(cpki.PkiSetupError, match=r"incomplete: pki\.json is missing"):
        cpki.load_pki(directory, SECRET)


def test_init_refuses_a_bad_trust_domain_and_an_empty_secret(tmp_path: Path) -> None:
    with pytest.raises(cpki.PkiSetupError, match="not a valid trust domain"):
        cpki.init_pki(tmp_path / "a", "Bad_Domain", SECRET, _now())
    with pytest.raises(cpki.PkiSetupError, match="BETTER_COMPUTE_SECRET is empty"):
        cpki.init_pki(tmp_path / "b", TD, b"", _now())
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()


def test_load_without_a_pki(tmp_path: Path) -> None:
    with pytest.raises(cpki.PkiSetupError) as info:
        cpki.load_pki(tmp_path / "missing", SECRET)
    assert str(info.value) == (
        f"no PKI in {tmp_path / 'missing'}; run: better-compute pki init --trust-domain <domain>"
    )


def test_load_with_the_wrong_secret(pki_dir: Path) -> None:
    with pytest.raises(cpki.PkiSetupError) as info:
        cpki.load_pki(pki_dir, b"wrong secret")
    message = str(info.value)
    assert message == f"the PKI secret does not decrypt the PKI in {pki_dir}"
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__
    assert "PRIVATE KEY" not in message
    assert "wrong secret" not in message
    for name in cpki.PKI_FILES:
        if name.endswith(".key"):
            body = (pki_dir / name).read_bytes()[-32:]
            assert body.hex() not in message
            assert body.decode("latin-1") not in message


def test_load_detects_a_swapped_key(tmp_path: Path) -> None:
    directory = tmp_path / "pki"
    cpki.init_pki(directory, TD, SECRET, _now())
    (directory / "node-ca.key").unlink()
    os.link(directory / "serving-ca.key", directory / "node-ca.key")
    with pytest.raises(cpki.PkiSetupError, match=r"node-ca\.key does not match node-ca\.crt"):
        cpki.load_pki(directory, SECRET)


def test_pins_are_well_formed_and_stable(pki_dir: Path, pki: cpki.Pki) -> None:
    pins = pki.pins()
    assert set(pins) == {"serving_ca_spki_pin", "join_signing_key_pin", "join_encryption_key_pin"}
    for pin in pins.values():
        assert bpki.parse_pin(pin) == pin
    assert len(set(pins.values())) == 3
    assert cpki.load_pki(pki_dir, SECRET).pins() == pins
    assert pki.trust_domain == TD
    assert pki.trust_version == 1
    assert "PRIVATE" not in repr(pki)
    assert "_key=" not in repr(pki)


def test_well_known_join(pki: cpki.Pki) -> None:
    doc = pki.well_known_join()
    assert set(doc) == {"encryptionJwk", "encryptionKeyPin", "signingCertificate", "signingKeyPin"}
    jwk = doc["encryptionJwk"]
    assert isinstance(jwk, dict)
    assert "d" not in jwk
    assert bpki.spki_pin(public_key_of_jwk(jwk)) == doc["encryptionKeyPin"]
    assert doc["encryptionKeyPin"] == pki.pins()["join_encryption_key_pin"]
    assert isinstance(doc["signingCertificate"], str)
    signing = x509.load_der_x509_certificate(base64.b64decode(doc["signingCertificate"]))
    key = signing.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert bpki.spki_pin(key) == doc["signingKeyPin"] == pki.pins()["join_signing_key_pin"]
    assert json.loads(json.dumps(doc)) == doc


def test_bundle_and_chain_tail(pki: cpki.Pki) -> None:
    assert bpki.load_pem_chain(pki.bundle_pem()) == [pki.command_signing_root]
    assert bpki.load_pem_chain(pki.chain_tail_pem()) == [pki.node_ca, pki.node_root_ca]


# --- node leaves ------------------------------------------------------------------


def _leaf(
    pki: cpki.Pki, role: str = "node", statements: tuple[str, ...] = (), ttl_s: int = 86_400
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = bpki.generate_key()
    return cpki.issue_node_leaf(pki, key.public_key(), SPIFFE, role, statements, _now(), ttl_s), key


def test_node_leaf_properties(pki: cpki.Pki) -> None:
    now = _now()
    key = bpki.generate_key()
    leaf = cpki.issue_node_leaf(pki, key.public_key(), SPIFFE, "node", [AK], now, 86_400)
    info = bpki.leaf_info(leaf)
    assert info.spiffe == SPIFFE
    assert info.role == "node"
    assert info.statements == (AK,)
    assert info.not_before == (now - timedelta(seconds=60)).replace(microsecond=0)
    assert info.not_after - info.not_before == timedelta(seconds=86_400)
    assert info.spki_sha256 == bpki.sha256_hex(bpki.spki_der(key.public_key()))
    assert 1 << 127 <= leaf.serial_number < 1 << 128
    assert leaf.subject == x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "bc-role:node")]
    )
    assert leaf.issuer == pki.node_ca.subject
    san = _ext(leaf, x509.SubjectAlternativeName).value
    assert isinstance(san, x509.SubjectAlternativeName)
    assert [type(n) for n in san] == [x509.UniformResourceIdentifier] * 2
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [str(SPIFFE), AK]
    ku = _ext(leaf, x509.KeyUsage)
    assert ku.critical
    assert isinstance(ku.value, x509.KeyUsage)
    assert ku.value.digital_signature
    assert not ku.value.key_cert_sign
    assert not ku.value.key_encipherment
    assert not ku.value.key_agreement
    assert not ku.value.content_commitment
    assert not ku.value.crl_sign
    eku = _ext(leaf, x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]  # type: ignore[call-overload]
    bc = _ext(leaf, x509.BasicConstraints)
    assert bc.critical
    assert isinstance(bc.value, x509.BasicConstraints)
    assert not bc.value.ca
    aki = _ext(leaf, x509.AuthorityKeyIdentifier).value
    ski = _ext(pki.node_ca, x509.SubjectKeyIdentifier).value
    assert isinstance(aki, x509.AuthorityKeyIdentifier)
    assert isinstance(ski, x509.SubjectKeyIdentifier)
    assert aki.key_identifier == ski.digest
    _ext(leaf, x509.SubjectKeyIdentifier)
    oids = {e.oid.dotted_string for e in leaf.extensions}
    assert oids == {"2.5.29.14", "2.5.29.35", "2.5.29.17", "2.5.29.19", "2.5.29.15", "2.5.29.37"}
    assert TD not in leaf.subject.rfc4514_string()
    leaf.verify_directly_issued_by(pki.node_ca)


def test_node_leaf_without_statements_is_a_strict_svid(pki: cpki.Pki) -> None:
    leaf, _ = _leaf(pki, role="site")
    san = _ext(leaf, x509.SubjectAlternativeName).value
    assert isinstance(san, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [str(SPIFFE)]
    assert len(list(san)) == 1
    assert bpki.leaf_info(leaf).role == "site"


def test_node_leaf_serials_differ(pki: cpki.Pki) -> None:
    serials = {_leaf(pki)[0].serial_number for _ in range(5)}
    assert len(serials) == 5


@pytest.mark.parametrize(
    ("role", "ttl_s", "statements"),
    [
        ("node", 86_401, ()),
        ("ramdisk", 7_201, ()),
        ("node", 0, ()),
        ("tenant", 3600, ()),
        ("node", 3600, ("spiffe://other/x",)),
        ("node", 3600, ("https://example.com",)),
        ("node", 3600, ("urn:bc:with space",)),
        ("node", 3600, (AK, AK)),
    ],
)
def test_node_leaf_refusals(
    pki: cpki.Pki, role: str, ttl_s: int, statements: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        _leaf(pki, role=role, statements=statements, ttl_s=ttl_s)


def test_node_leaf_ramdisk_limit_and_other_refusals(pki: cpki.Pki) -> None:
    leaf, _ = _leaf(pki, role="ramdisk", ttl_s=7_200)
    assert bpki.leaf_info(leaf).role == "ramdisk"
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    with pytest.raises(ValueError, match="P-256"):
        cpki.issue_node_leaf(pki, p384, SPIFFE, "node", [], _now(), 3600)
    other = bpki.SpiffeId("other.example.com", SITE, NODE)
    with pytest.raises(ValueError, match="trust domain"):
        cpki.issue_node_leaf(pki, bpki.generate_key().public_key(), other, "node", [], _now(), 60)
    with pytest.raises(ValueError, match="timezone"):
        cpki.issue_node_leaf(
            pki, bpki.generate_key().public_key(), SPIFFE, "node", [], datetime.now(), 60
        )


def test_node_leaf_never_outlives_the_node_ca(pki: cpki.Pki) -> None:
    late = pki.node_ca.not_valid_after_utc - timedelta(hours=1)
    key = bpki.generate_key().public_key()
    with pytest.raises(cpki.PkiSetupError, match="node CA expires"):
        cpki.issue_node_leaf(pki, key, SPIFFE, "node", [], late, 86_400)
    leaf = cpki.issue_node_leaf(pki, key, SPIFFE, "node", [], late, 1800)
    assert leaf.not_valid_after_utc <= pki.node_ca.not_valid_after_utc


def test_node_chain_verifies_with_cryptography(pki: cpki.Pki) -> None:
    leaf, _ = _leaf(pki, statements=(AK,))
    verifier = PolicyBuilder().store(Store([pki.node_root_ca])).build_client_verifier()
    verified = verifier.verify(leaf, [pki.node_ca])
    assert verified.chain == [leaf, pki.node_ca, pki.node_root_ca]
    chain = bpki.load_pem_chain(bpki.cert_pem(leaf) + pki.chain_tail_pem())
    assert verifier.verify(chain[0], chain[1:]).chain[-1] == pki.node_root_ca


def test_node_chain_verifies_with_openssl(pki: cpki.Pki, tmp_path: Path) -> None:
    leaf, _ = _leaf(pki, statements=(AK,))
    root = _pem(tmp_path / "root.pem", pki.node_root_ca)
    node_ca = _pem(tmp_path / "nodeca.pem", pki.node_ca)
    leaf_pem = _pem(tmp_path / "leaf.pem", leaf)
    for extra in ([], ["-purpose", "sslclient"], ["-x509_strict", "-purpose", "sslclient"]):
        done = _openssl(*extra, "-CAfile", root, "-untrusted", node_ca, leaf_pem)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(": OK")
    done = _openssl("-purpose", "sslserver", "-CAfile", root, "-untrusted", node_ca, leaf_pem)
    assert done.returncode != 0
    other = _pem(tmp_path / "other.pem", pki.serving_ca)
    assert _openssl("-CAfile", other, "-untrusted", node_ca, leaf_pem).returncode != 0


# --- gateway ----------------------------------------------------------------------


def test_gateway_dns_name(pki: cpki.Pki, tmp_path: Path) -> None:
    crt, key_path = cpki.issue_gateway(pki, tmp_path, "GW.eu.example.com", SECRET, _now())
    assert crt.name == "gateway-gw.eu.example.com.crt"
    assert key_path.name == "gateway-gw.eu.example.com.key"
    assert stat.S_IMODE(crt.stat().st_mode) == 0o644
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    chain_pem, key = cpki.load_gateway(tmp_path, "gw.eu.example.com", SECRET)
    chain = bpki.load_pem_chain(chain_pem)
    assert chain[1] == pki.serving_ca
    assert len(chain) == 2
    leaf = chain[0]
    assert leaf.public_key() == key.public_key()
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == timedelta(days=90)
    eku = _ext(leaf, x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]  # type: ignore[call-overload]
    ku = _ext(leaf, x509.KeyUsage)
    assert ku.critical
    assert isinstance(ku.value, x509.KeyUsage)
    assert ku.value.digital_signature
    bc = _ext(leaf, x509.BasicConstraints)
    assert bc.critical
    assert isinstance(bc.value, x509.BasicConstraints)
    assert not bc.value.ca
    verifier = PolicyBuilder().store(Store([pki.serving_ca]))
    verifier.build_server_verifier(DNSName("gw.eu.example.com")).verify(leaf, [])
    with pytest.raises(x509.verification.VerificationError):
        verifier.build_server_verifier(DNSName("other.example.com")).verify(leaf, [])
    ca = _pem(tmp_path / "serving.pem", pki.serving_ca)
    leaf_pem = _pem(tmp_path / "gw.pem", leaf)
    done = _openssl(
        "-x509_strict", "-purpose", "sslserver", "-verify_hostname", "gw.eu.example.com",
        "-CAfile", ca, leaf_pem,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_gateway_ip_address_and_reissue(pki: cpki.Pki, tmp_path: Path) -> None:
    first, _ = cpki.issue_gateway(pki, tmp_path, "10.0.0.7", SECRET, _now())
    first_pem = first.read_text()
    crt, _ = cpki.issue_gateway(pki, tmp_path, "10.0.0.7", SECRET, _now())
    assert crt == first
    assert crt.read_text() != first_pem
    chain_pem, _ = cpki.load_gateway(tmp_path, "10.0.0.7", SECRET)
    leaf = bpki.load_pem_chain(chain_pem)[0]
    san = _ext(leaf, x509.SubjectAlternativeName).value
    assert isinstance(san, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert san.get_values_for_type(x509.DNSName) == []
    builder = PolicyBuilder().store(Store([pki.serving_ca]))
    ip = ipaddress.ip_address("10.0.0.7")
    builder.build_server_verifier(IPAddress(ip)).verify(leaf, [])
    v6, _ = cpki.issue_gateway(pki, tmp_path, "fd00::7", SECRET, _now())
    v6_leaf = bpki.load_pem_chain(v6.read_text())[0]
    builder.build_server_verifier(IPAddress(ipaddress.ip_address("fd00::7"))).verify(v6_leaf, [])
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_gateway_refusals(pki: cpki.Pki, tmp_path: Path) -> None:
    with pytest.raises(cpki.PkiSetupError, match="not a DNS name or an IP address"):
        cpki.issue_gateway(pki, tmp_path, "../evil", SECRET, _now())
    with pytest.raises(cpki.PkiSetupError, match=r"no gateway certificate for gw\.example\.com"):
        cpki.load_gateway(tmp_path, "gw.example.com", SECRET)
    cpki.issue_gateway(pki, tmp_path, "gw.example.com", SECRET, _now())
    with pytest.raises(cpki.PkiSetupError, match="the PKI secret does not decrypt"):
        cpki.load_gateway(tmp_path, "gw.example.com", b"nope")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["gateway-gw.example.com.crt", "gateway-gw.example.com.key"]


# --- TLS --------------------------------------------------------------------------


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the fd listdir itself used
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def _handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str
) -> tuple[bytes | None, bytes]:
    """One loopback TLS connection; returns (client cert the server saw, bytes received)."""
    result: dict[str, object] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5)
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(5)
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    result["peer"] = tls.getpeercert(binary_form=True)
                    tls.sendall(b"ok")
            except Exception as exc:  # reported by the main thread
                result["error"] = exc

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
            ):
                data = tls.recv(2)
        finally:
            thread.join(5)
    assert "error" not in result, result["error"]
    peer = result["peer"]
    assert peer is None or isinstance(peer, bytes)
    return peer, data


def test_server_ssl_context_handshake(pki: cpki.Pki, tmp_path: Path) -> None:
    gw_dir = tmp_path / "gw"
    gw_dir.mkdir()
    cpki.issue_gateway(pki, gw_dir, "127.0.0.1", SECRET, _now())
    chain_pem, key = cpki.load_gateway(gw_dir, "127.0.0.1", SECRET)
    before_fds, before_files = _fds(), sorted(tmp_path.rglob("*"))
    ctx = cpki.server_ssl_context(chain_pem, key, client_ca_pem=bpki.cert_pem(pki.node_root_ca))
    assert _fds() == before_fds
    assert sorted(tmp_path.rglob("*")) == before_files
    assert ctx.num_tickets == 0
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_OPTIONAL

    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cadata=bpki.cert_pem(pki.serving_ca))
    peer, data = _handshake(ctx, client, "127.0.0.1")
    assert data == b"ok"
    assert peer is None

    leaf, leaf_key = _leaf(pki)
    chain_file = tmp_path / "node-chain.pem"
    chain_file.write_text(bpki.cert_pem(leaf) + bpki.cert_pem(pki.node_ca))
    key_file = tmp_path / "node.key"
    key_file.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    client.load_cert_chain(chain_file, key_file)
    peer, data = _handshake(ctx, client, "127.0.0.1")
    assert data == b"ok"
    assert peer is not None
    assert x509.load_der_x509_certificate(peer) == leaf

    wrong_name = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    wrong_name.load_verify_locations(cadata=bpki.cert_pem(pki.serving_ca))
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake_client_only(ctx, wrong_name, "127.0.0.2")


def _handshake_client_only(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str
) -> None:
    """A connection the client refuses; the server side's failure is expected."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5)
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(5)
                with server_ctx.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                client_ctx.wrap_socket(raw, server_hostname=server_hostname).close()
        finally:
            thread.join(5)


def test_server_ssl_context_rejects_a_mismatched_key(pki: cpki.Pki) -> None:
    chain_pem = bpki.cert_pem(pki.serving_ca)
    before = _fds()
    with pytest.raises(cpki.PkiSetupError, match="do not load"):
        cpki.server_ssl_context(chain_pem, bpki.generate_key())
    assert _fds() == before


def test_a_key_file_of_an_earlier_pki_still_loads(pki_dir: Path) -> None:
    """PKIs made before issue 11 hold PKCS#8 PEM keys (PBKDF2 at 2,048 iterations)."""
    from cryptography.hazmat.primitives import serialization

    loaded = cpki.load_pki(pki_dir, SECRET)
    legacy = loaded.node_ca_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(SECRET),
    )
    (pki_dir / "node-ca.key").write_bytes(legacy)
    again = cpki.load_pki(pki_dir, SECRET)
    assert again.node_ca_key.private_numbers() == loaded.node_ca_key.private_numbers()


def test_the_pins_need_no_secret(pki_dir: Path) -> None:
    assert cpki.public_pins(pki_dir) == cpki.load_pki(pki_dir, SECRET).pins()

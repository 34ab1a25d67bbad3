"""Every TLS context that verifies the project's own PKI holds the chain to RFC 5280.

``VERIFY_X509_STRICT`` is what Python 3.13's ``create_default_context`` sets; the
project builds its contexts by hand (so ``$SSLKEYLOGFILE`` is never honoured) and
sets it itself, so they verify alike on 3.11 and 3.13: the node's pinned dial, the
relay's client, the gateway and relay listeners. Only the pinned dial takes a
partial chain (the pin is the anchor). The two contexts for a URL outside the PKI
(the bootstrap's fetch, the operator CLI's https ``--api``) use the system store and
are not strict.

The handshakes run in memory (``ssl.MemoryBIO``) between the project's own client
and server contexts: the PKI's certificates are accepted, and the same certificate
with one RFC 5280 flaw that OpenSSL's strict mode refuses (a CA's basicConstraints
not critical, a CA without a subject key identifier, a leaf without an authority key
identifier) is refused, on the client side and on the server side.
"""

from __future__ import annotations

import socket
import ssl
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import gatewayclient, pki, servingca
from bcd.errors import PeerVerificationError
from bcd.keys.file import key_to_pem
from bcd.tls import Anchor, anchor_of, connect_pinned, pinned_context
from control import client, relay
from control.errors import ControlError
from control.gatewaypki import GatewayBundle, make_relay_cert
from control.pki import Pki, issue_node_leaf, make_gateway_cert, server_ssl_context
from tests.test_serving_ca import Recorder

GATEWAY = "127.0.0.1"
RELAY_NAME = "relay-1"
NO_BC_CRITICAL = "Basic Constraints of CA cert not marked critical"
NO_SKI = "Missing Subject Key Identifier"
NO_AKI = "Missing Authority Key Identifier"


@pytest.fixture(autouse=True)
def _fresh_anchors() -> None:
    servingca.forget()


def _now() -> datetime:
    return datetime.now(UTC)


def _variant(
    cert: x509.Certificate,
    signer: ec.EllipticCurvePrivateKey,
    *,
    drop: type[x509.ExtensionType] | None = None,
    not_critical: type[x509.ExtensionType] | None = None,
) -> x509.Certificate:
    """``cert`` re-signed by ``signer`` with one extension dropped or made non-critical."""
    public_key = cert.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    builder = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(cert.issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(cert.not_valid_before_utc)
        .not_valid_after(cert.not_valid_after_utc)
    )
    for ext in cert.extensions:
        if type(ext.value) is not drop:
            critical = ext.critical and type(ext.value) is not not_critical
            builder = builder.add_extension(ext.value, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def _pem(*certs: x509.Certificate) -> str:
    return "".join(pki.cert_pem(c) for c in certs)


def _anchor(serving_ca: x509.Certificate) -> Anchor:
    public_key = serving_ca.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    return anchor_of(pki.cert_pem(serving_ca), pki.spki_pin(public_key))


def _bundle(memory_pki: Pki) -> GatewayBundle:
    serving_key, relay_key = pki.generate_key(), pki.generate_key()
    serving = make_gateway_cert(memory_pki, serving_key.public_key(), GATEWAY, _now())
    relay_cert = make_relay_cert(memory_pki, relay_key.public_key(), RELAY_NAME, _now())
    return GatewayBundle(
        trust_domain="td.example",
        san=GATEWAY,
        serving_chain_pem=_pem(serving, memory_pki.serving_ca),
        relay_chain_pem=_pem(relay_cert, memory_pki.serving_ca),
        node_ca_pem=memory_pki.chain_tail_pem(),
        serving_ca_pem=pki.cert_pem(memory_pki.serving_ca),
        serving_key=serving_key,
        relay_key=relay_key,
    )


def _gateway_cert(memory_pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = pki.generate_key()
    return make_gateway_cert(memory_pki, key.public_key(), GATEWAY, _now()), key


def _node_leaf(memory_pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = pki.generate_key()
    spiffe = pki.SpiffeId("td.example", "site_" + "0" * 26, "node_" + "0" * 26)
    return issue_node_leaf(memory_pki, key.public_key(), spiffe, "node", (), _now(), 3600), key


def _handshake(client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext) -> None:
    """A whole TLS handshake in memory; raises what the side that refused raised."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    sides = [
        client_ctx.wrap_bio(c_in, c_out, server_hostname=GATEWAY),
        server_ctx.wrap_bio(s_in, s_out, server_side=True),
    ]
    done: set[int] = set()
    for _ in range(8):
        for i, side in enumerate(sides):
            if i not in done:
                try:
                    side.do_handshake()
                    done.add(i)
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if len(done) == 2:
            return
    raise AssertionError("the handshake did not finish")


def _refusal(client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext) -> str:
    with pytest.raises(ssl.SSLCertVerificationError) as caught:
        _handshake(client_ctx, server_ctx)
    return str(caught.value.verify_message)


def _lax(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return ctx


# --- the flags of every context ---------------------------------------------------


def _pki_contexts(memory_pki: Pki) -> dict[str, ssl.SSLContext]:
    bundle = _bundle(memory_pki)
    leaf, key = _node_leaf(memory_pki)
    node_cert = (_pem(leaf) + memory_pki.chain_tail_pem(), key_to_pem(key))
    anchor = _anchor(memory_pki.serving_ca)
    return {
        "pinned": pinned_context(anchor),
        "pinned, with the node certificate": pinned_context(anchor, node_cert),
        "relay client": relay.client_context(bundle),
        "gateway listener": server_ssl_context(
            bundle.serving_chain_pem,
            bundle.serving_key,
            client_ca_pem=bundle.node_ca_pem,
            client_time_in_app=True,
        ),
        "relay listener": server_ssl_context(
            bundle.serving_chain_pem, bundle.serving_key, client_ca_pem=bundle.serving_ca_pem
        ),
        "listener without client certificates": server_ssl_context(
            bundle.serving_chain_pem, bundle.serving_key
        ),
    }


def test_every_context_of_the_pki_is_strict_and_writes_no_key_log(
    memory_pki: Pki, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SSLKEYLOGFILE", str(tmp_path / "keys.log"))
    contexts = _pki_contexts(memory_pki)
    for name, ctx in contexts.items():
        assert ctx.verify_flags & ssl.VERIFY_X509_STRICT, name
        assert ctx.keylog_filename is None, name
        partial = bool(ctx.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN)
        assert partial == name.startswith("pinned"), name  # only the pin anchors a part
    assert contexts["gateway listener"].verify_flags & 0x200000  # NO_CHECK_TIME kept
    assert contexts["gateway listener"].verify_mode == ssl.CERT_OPTIONAL
    assert contexts["relay client"].verify_mode == ssl.CERT_REQUIRED
    assert contexts["relay client"].check_hostname


def test_the_system_store_contexts_are_neither_strict_nor_partial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SSLKEYLOGFILE", str(tmp_path / "keys.log"))
    for ctx in (gatewayclient.system_store_context(), client.system_store_context()):
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.check_hostname
        assert not ctx.verify_flags & (ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN)
        assert ctx.keylog_filename is None


# --- the node's dial to the gateway -----------------------------------------------


def test_the_node_accepts_the_pki_gateway_and_the_gateway_accepts_the_node(
    memory_pki: Pki,
) -> None:
    contexts = _pki_contexts(memory_pki)
    _handshake(contexts["pinned, with the node certificate"], contexts["gateway listener"])
    _handshake(contexts["pinned"], contexts["gateway listener"])


@pytest.mark.parametrize(
    ("flaw", "message"),
    [("bc_not_critical", NO_BC_CRITICAL), ("ca_without_ski", NO_SKI), ("leaf_without_aki", NO_AKI)],
)
def test_the_node_refuses_a_gateway_chain_that_is_not_rfc5280(
    memory_pki: Pki, flaw: str, message: str
) -> None:
    ca, ca_key = memory_pki.serving_ca, memory_pki.serving_ca_key
    leaf, key = _gateway_cert(memory_pki)
    if flaw == "bc_not_critical":
        ca = _variant(ca, ca_key, not_critical=x509.BasicConstraints)
    elif flaw == "ca_without_ski":
        ca = _variant(ca, ca_key, drop=x509.SubjectKeyIdentifier)
    else:
        leaf = _variant(leaf, ca_key, drop=x509.AuthorityKeyIdentifier)
    gateway = server_ssl_context(_pem(leaf, ca), key)
    assert _refusal(pinned_context(_anchor(ca)), gateway) == message
    _handshake(_lax(pinned_context(_anchor(ca))), gateway)  # STRICT is what refuses it


async def test_a_gateway_chain_without_aki_never_receives_the_node_certificate(
    memory_pki: Pki,
) -> None:
    good_leaf, key = _gateway_cert(memory_pki)
    leaf = _variant(good_leaf, memory_pki.serving_ca_key, drop=x509.AuthorityKeyIdentifier)
    node_leaf, node_key = _node_leaf(memory_pki)
    node_cert = (_pem(node_leaf) + memory_pki.chain_tail_pem(), key_to_pem(node_key))
    recorders = []
    async with trio.open_nursery() as nursery:
        for presented in (leaf, good_leaf):  # the second: the recorder can tell
            recorder = Recorder(
                server_ssl_context(
                    _pem(presented, memory_pki.serving_ca),
                    key,
                    client_ca_pem=memory_pki.chain_tail_pem(),
                )
            )
            recorders.append(recorder)
            await nursery.start(recorder.run)
            dial = connect_pinned(
                "127.0.0.1",
                recorder.port,
                GATEWAY,
                _anchor(memory_pki.serving_ca),
                client_cert=node_cert,
                timeout=5,
            )
            if presented is leaf:
                with pytest.raises(PeerVerificationError, match="authorityKeyIdentifier"):
                    await dial
            else:
                (await dial).close()
            await recorder.connections(1)
        nursery.cancel_scope.cancel()
    assert recorders[0].seen == [None]
    assert recorders[1].seen == [node_leaf.public_bytes(serialization.Encoding.DER)]


# --- the gateway listener, the node's certificate -----------------------------------


def test_the_gateway_refuses_a_node_chain_that_is_not_rfc5280(memory_pki: Pki) -> None:
    anchor = _anchor(memory_pki.serving_ca)
    leaf, key = _node_leaf(memory_pki)
    chain_pem, key_pem = _pem(leaf) + memory_pki.chain_tail_pem(), key_to_pem(key)

    def gateway(client_ca_pem: str) -> ssl.SSLContext:
        bundle = _bundle(memory_pki)
        return server_ssl_context(
            bundle.serving_chain_pem,
            bundle.serving_key,
            client_ca_pem=client_ca_pem,
            client_time_in_app=True,
        )

    _handshake(pinned_context(anchor, (chain_pem, key_pem)), gateway(memory_pki.chain_tail_pem()))

    # the node leaf without its AKI
    no_aki = _variant(leaf, memory_pki.node_ca_key, drop=x509.AuthorityKeyIdentifier)
    node = pinned_context(anchor, (_pem(no_aki) + memory_pki.chain_tail_pem(), key_pem))
    assert _refusal(node, gateway(memory_pki.chain_tail_pem())) == NO_AKI
    _handshake(node, _lax(gateway(memory_pki.chain_tail_pem())))  # STRICT is what refuses it

    # a node CA whose basicConstraints is not critical
    node_ca = _variant(
        memory_pki.node_ca, memory_pki.node_root_ca_key, not_critical=x509.BasicConstraints
    )
    tail = _pem(node_ca, memory_pki.node_root_ca)
    node = pinned_context(anchor, (_pem(leaf) + tail, key_pem))
    assert _refusal(node, gateway(tail)) == NO_BC_CRITICAL
    _handshake(node, _lax(gateway(tail)))


# --- the relay, both ways ---------------------------------------------------------


def test_the_relay_and_its_listener_accept_the_pki_and_refuse_a_leaf_without_aki(
    memory_pki: Pki,
) -> None:
    contexts = _pki_contexts(memory_pki)
    _handshake(contexts["relay client"], contexts["relay listener"])

    # a replica whose serving certificate lacks the AKI: the relay refuses it
    leaf, key = _gateway_cert(memory_pki)
    leaf = _variant(leaf, memory_pki.serving_ca_key, drop=x509.AuthorityKeyIdentifier)
    replica = server_ssl_context(
        _pem(leaf, memory_pki.serving_ca), key, client_ca_pem=pki.cert_pem(memory_pki.serving_ca)
    )
    assert _refusal(relay.client_context(_bundle(memory_pki)), replica) == NO_AKI

    # a relay certificate lacking the AKI: the listener refuses it
    relay_key = pki.generate_key()
    relay_cert = make_relay_cert(memory_pki, relay_key.public_key(), RELAY_NAME, _now())
    relay_cert = _variant(relay_cert, memory_pki.serving_ca_key, drop=x509.AuthorityKeyIdentifier)
    bundle = _bundle(memory_pki)
    flawed = GatewayBundle(
        trust_domain=bundle.trust_domain,
        san=bundle.san,
        serving_chain_pem=bundle.serving_chain_pem,
        relay_chain_pem=_pem(relay_cert, memory_pki.serving_ca),
        node_ca_pem=bundle.node_ca_pem,
        serving_ca_pem=bundle.serving_ca_pem,
        serving_key=bundle.serving_key,
        relay_key=relay_key,
    )
    assert _refusal(relay.client_context(flawed), contexts["relay listener"]) == NO_AKI


def test_the_operator_cli_over_https_writes_no_key_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """http.client's default context would open $SSLKEYLOGFILE as it is built."""
    keys = tmp_path / "keys.log"
    monkeypatch.setenv("SSLKEYLOGFILE", str(keys))
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    api = client.ApiClient(f"https://127.0.0.1:{port}/api/compute", None, timeout=5)
    with pytest.raises(ControlError, match="cannot reach the control plane"):
        api.call("GET", "/.well-known/better-compute")
    assert not keys.exists()

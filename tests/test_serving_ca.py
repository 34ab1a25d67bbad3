"""The serving CA as the only trust anchor: an unpinned gateway never sees the node's
certificate; serving-ca.pem is checked against the pin at load; a node without the file
fetches it once from the gateway, checked against the pin.

Real TLS on loopback: a server that asks for a client certificate (``CERT_OPTIONAL``)
and records what the client presented, the node's real renewal and session calls.
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from bcd import pki, servingca, wire
from bcd.bootstrap import bootstrap_config, write_bootstrap
from bcd.config import Config, load_config
from bcd.errors import ConfigError, JoinError, PeerVerificationError, TransportError
from bcd.identity import LoadedState
from bcd.renew import RENEW_PATH
from bcd.session import SessionInfo, _one_session, post_as_node
from bcd.tls import anchor_of, connect_pinned, probe_anchor
from bcd.tlsstream import SocketTLSStream
from control.pki import Pki, build_pki, make_gateway_cert, server_ssl_context
from tests.adversarial import hostile
from tests.world.agent import joined_state


@pytest.fixture(autouse=True)
def _fresh_anchors() -> None:
    servingca.forget()


@dataclass
class Recorder:
    """A TLS server that records, per connection, the client certificate it got."""

    ctx: ssl.SSLContext
    port: int = 0
    seen: list[bytes | None] = field(default_factory=list)
    request_bytes: int = 0

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, tcp: trio.SocketStream) -> None:
        try:  # the gateway's own TLS (control.http's)
            tls = SocketTLSStream(tcp, self.ctx)
        except trio.BrokenResourceError:  # the client already gone
            self.seen.append(None)
            return
        try:
            try:
                with trio.fail_after(5):
                    await tls.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                pass
            # the certificate the client sent, as OpenSSL keeps it: once verified
            # (a handshake refused later keeps it; one refused for it does not)
            self.seen.append(next(iter(tls.unverified_chain_der()), None))
            try:
                with trio.move_on_after(2):
                    while data := await tls.receive_some(65536):
                        self.request_bytes += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        finally:
            tls.close()

    async def connections(self, count: int) -> list[bytes | None]:
        """What the client sent on each of the first ``count`` connections, once the
        handler recorded them (the client may be done before the server's side is)."""
        with trio.fail_after(5):
            while len(self.seen) < count:  # noqa: ASYNC110 - a test's bounded poll
                await trio.sleep(0.01)
        return self.seen


def _server_context(serving: Pki, client_ca: Pki) -> ssl.SSLContext:
    """A serving certificate of ``serving`` for 127.0.0.1, asking for a node certificate
    of ``client_ca`` (so a client that would send one, sends it)."""
    key = pki.generate_key()
    cert = make_gateway_cert(serving, key.public_key(), "127.0.0.1", datetime.now(UTC))
    return server_ssl_context(
        pki.cert_pem(cert) + pki.cert_pem(serving.serving_ca),
        key,
        pki.cert_pem(client_ca.node_ca) + pki.cert_pem(client_ca.node_root_ca),
    )


def _node(root: Path, memory_pki: Pki, port: int) -> tuple[Config, LoadedState]:
    """A joined node whose serving-ca.pem is ``memory_pki``'s serving CA."""
    config = hostile.write_config(root, memory_pki, port)
    (config.parent / "serving-ca.pem").write_text(pki.cert_pem(memory_pki.serving_ca))
    state = joined_state(root / "data", memory_pki, datetime.now(UTC).timestamp())
    return load_config(config), state


async def test_an_unpinned_gateway_never_receives_the_node_certificate(
    tmp_path: Path, memory_pki: Pki
) -> None:
    other = build_pki("td.example", datetime.now(UTC))  # a gateway of another serving CA
    async with trio.open_nursery() as nursery:
        unpinned = Recorder(_server_context(other, memory_pki))
        await nursery.start(unpinned.run)
        cfg, state = _node(tmp_path / "unpinned", memory_pki, unpinned.port)
        with pytest.raises(PeerVerificationError, match="does not chain to the pinned serving CA"):
            await post_as_node(cfg, state, None, RENEW_PATH, b"{}")
        with pytest.raises(PeerVerificationError, match="does not chain to the pinned serving CA"):
            await _one_session(cfg, state, SessionInfo(journal_id="j", boot_id="b"))

        # the same recorder with the pinned serving CA gets the certificate: it can tell
        pinned = Recorder(_server_context(memory_pki, memory_pki))
        await nursery.start(pinned.run)
        cfg_ok, state_ok = _node(tmp_path / "pinned", memory_pki, pinned.port)
        with pytest.raises(TransportError):  # it reads the request and answers nothing
            await post_as_node(cfg_ok, state_ok, None, RENEW_PATH, b"{}")
        await unpinned.connections(2)
        await pinned.connections(1)
        nursery.cancel_scope.cancel()

    assert unpinned.seen == [None, None]  # two attempts, neither presented a certificate
    assert unpinned.request_bytes == 0
    leaf = x509.load_pem_x509_certificate(state_ok.identity.chain.encode())
    assert pinned.seen == [leaf.public_bytes(serialization.Encoding.DER)]
    assert pinned.request_bytes > 0


async def test_serving_ca_pem_of_another_ca_is_a_clear_error_at_load(
    tmp_path: Path, memory_pki: Pki
) -> None:
    other = build_pki("td.example", datetime.now(UTC))
    config = hostile.write_config(tmp_path, memory_pki, 1, serving_ca=False)
    (config.parent / "serving-ca.pem").write_text(pki.cert_pem(other.serving_ca))
    with pytest.raises(ConfigError) as caught:
        await servingca.serving_ca(load_config(config))
    assert str(caught.value) == (
        f"{config.parent / 'serving-ca.pem'}: its SPKI pin is not serving_ca_spki_pin; it must "
        "be the serving CA certificate whose SPKI pin is serving_ca_spki_pin (run the install "
        "script again, or remove the file and bcd fetches it from the gateway, checked against "
        "the pin)"
    )
    (config.parent / "serving-ca.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"serving-ca\.pem: it is not a PEM certificate"):
        await servingca.serving_ca(load_config(config))


async def test_a_missing_serving_ca_pem_is_fetched_once_and_written(
    tmp_path: Path, memory_pki: Pki
) -> None:
    async with trio.open_nursery() as nursery:
        gw = Recorder(_server_context(memory_pki, memory_pki))
        await nursery.start(gw.run)
        config = hostile.write_config(tmp_path, memory_pki, gw.port, serving_ca=False)
        cfg = load_config(config)
        anchor = await servingca.serving_ca(cfg)
        again = await servingca.serving_ca(cfg)  # held: no second probe
        await gw.connections(1)
        nursery.cancel_scope.cancel()

    assert anchor is again
    assert anchor.pem == pki.cert_pem(memory_pki.serving_ca)
    written = config.parent / "serving-ca.pem"
    assert written.read_text() == anchor.pem
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o644
    assert gw.seen == [None]  # the probe is certless and sends no request
    assert gw.request_bytes == 0
    servingca.forget()
    assert (await servingca.serving_ca(cfg)).pem == anchor.pem  # now from the file


async def test_the_probe_refuses_an_unpinned_gateway(tmp_path: Path, memory_pki: Pki) -> None:
    other = build_pki("td.example", datetime.now(UTC))
    async with trio.open_nursery() as nursery:
        gw = Recorder(_server_context(other, memory_pki))
        await nursery.start(gw.run)
        config = hostile.write_config(tmp_path, memory_pki, gw.port, serving_ca=False)
        with pytest.raises(PeerVerificationError, match="does not chain to the pinned serving CA"):
            await servingca.serving_ca(load_config(config))
        nursery.cancel_scope.cancel()
    assert not (config.parent / "serving-ca.pem").exists()


def test_the_probe_keeps_the_anchor_in_memory_when_it_cannot_write(
    tmp_path: Path, memory_pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: Path, data: bytes, mode: int = 0o600) -> None:
        raise PermissionError(13, "Permission denied")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            gw = Recorder(_server_context(memory_pki, memory_pki))
            await nursery.start(gw.run)
            config = hostile.write_config(tmp_path, memory_pki, gw.port, serving_ca=False)
            monkeypatch.setattr(servingca.fs, "atomic_write", refuse)
            cfg = load_config(config)
            anchor = await servingca.serving_ca(cfg)
            assert anchor.pem == pki.cert_pem(memory_pki.serving_ca)
            assert not (config.parent / "serving-ca.pem").exists()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_bootstrap_checks_the_published_serving_ca_and_writes_it(
    tmp_path: Path, memory_pki: Pki
) -> None:
    pins = memory_pki.pins()
    jwk = memory_pki.well_known_join()["encryptionJwk"]
    key = wire.public_key_of_jwk(jwk)

    def document(pem: object) -> dict[str, Any]:
        return {
            "gateway": {
                "url": "https://127.0.0.1:1",
                "servingCaPin": pins["serving_ca_spki_pin"],
                "servingCaPem": pem,
            },
            "join": {
                "signingKeyPin": pins["join_signing_key_pin"],
                "encryptionKeyPin": pins["join_encryption_key_pin"],
            },
        }

    config = tmp_path / "etc" / "config.toml"
    other = build_pki("td.example", datetime.now(UTC)).serving_ca
    with pytest.raises(JoinError) as caught:
        bootstrap_config(
            document(pki.cert_pem(other)), server="https://cp", config=config, pins=pins
        )
    assert str(caught.value) == (
        "the serving CA certificate published by https://cp does not match serving_ca_spki_pin "
        "(its SPKI pin is not serving_ca_spki_pin); the document is not trusted"
    )
    pem = pki.cert_pem(memory_pki.serving_ca)
    cfg = bootstrap_config(document(pem), server="https://cp", config=config, pins=pins)
    assert not (config.parent / "serving-ca.pem").exists()  # not before the join succeeded
    write_bootstrap(cfg, "site_" + "a" * 26, key)
    written = config.parent / "serving-ca.pem"
    assert written.read_text() == pem
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o644


async def test_a_pinned_intermediate_anchors_the_handshake_and_the_probe(tmp_path: Path) -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from tests.test_http import SERVER_SAN, _key_pem, _make_ca, _make_leaf, _pem

    root = _make_ca("root")
    inter = _make_ca("serving intermediate", issuer=root)
    leaf, leaf_key = _make_leaf(inter, SERVER_SAN, ExtendedKeyUsageOID.SERVER_AUTH)
    (tmp_path / "chain.pem").write_text(_pem(leaf, inter[0], root[0]))
    (tmp_path / "key.pem").write_bytes(_key_pem(leaf_key))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "chain.pem", tmp_path / "key.pem")
    pin = pki.spki_pin(inter[1].public_key())
    async with trio.open_nursery() as nursery:
        gw = Recorder(ctx)
        await nursery.start(gw.run)
        probed = await probe_anchor("127.0.0.1", gw.port, "gw.test", pin)
        stream = await connect_pinned("127.0.0.1", gw.port, "gw.test", probed)
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert probed.pem == _pem(inter[0])


# --- the anchor is a CA valid now; a stale serving-ca.pem is replaced on the dial -------


def _recertified(
    memory_pki: Pki,
    *,
    days: tuple[int, int] = (-1, 365),
    ca: bool = True,
    key_usage: x509.KeyUsage | None = None,
) -> x509.Certificate:
    """The serving CA's key and subject in a new certificate (valid ``days`` from now)."""
    old, now = memory_pki.serving_ca, datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(old.subject)
        .issuer_name(old.issuer)
        .public_key(old.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + timedelta(days=days[0]))
        .not_valid_after(now + timedelta(days=days[1]))
    )
    for ext in old.extensions:
        value = ext.value
        if isinstance(value, x509.BasicConstraints):
            value = x509.BasicConstraints(ca=ca, path_length=None)
        elif isinstance(value, x509.KeyUsage) and key_usage is not None:
            value = key_usage
        builder = builder.add_extension(value, ext.critical)
    return builder.sign(memory_pki.serving_ca_key, hashes.SHA256())


_NO_CERT_SIGN = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def test_anchor_of_refuses_a_certificate_that_cannot_anchor(memory_pki: Pki) -> None:
    pin = memory_pki.pins()["serving_ca_spki_pin"]
    assert anchor_of(pki.cert_pem(_recertified(memory_pki)), pin).pin == pin
    cases = [
        (_recertified(memory_pki, ca=False), r"^it is not a CA certificate \(basicConstraints"),
        (
            _recertified(memory_pki, key_usage=_NO_CERT_SIGN),
            r"^its keyUsage does not allow signing certificates \(keyCertSign\)$",
        ),
        (_recertified(memory_pki, days=(-30, -1)), r"^it is not valid at .* \(valid .* to .*\)$"),
        (_recertified(memory_pki, days=(1, 30)), r"^it is not valid at "),
    ]
    for cert, message in cases:
        with pytest.raises(ValueError, match=message):
            anchor_of(pki.cert_pem(cert), pin)
    # serving-ca.pem's dates are left to the dial (which replaces a stale one)
    expired = pki.cert_pem(_recertified(memory_pki, days=(-30, -1)))
    assert anchor_of(expired, pin, check_dates=False).pem == expired


def test_a_published_serving_ca_about_to_break_renewals_is_refused(
    tmp_path: Path, memory_pki: Pki
) -> None:
    config = hostile.write_config(tmp_path, memory_pki, 1, serving_ca=False)
    cfg = load_config(config)
    for cert in (_recertified(memory_pki, days=(-30, -1)), _recertified(memory_pki, ca=False)):
        with pytest.raises(JoinError, match=r"does not match serving_ca_spki_pin .*not trusted"):
            servingca.accept_published(cfg, pki.cert_pem(cert), "https://cp")
    pem = config.parent / "serving-ca.pem"
    pem.write_text(pki.cert_pem(_recertified(memory_pki, ca=False)))
    with pytest.raises(ConfigError, match=r"serving-ca\.pem: it is not a CA certificate"):
        servingca.read_anchor(pem, cfg.serving_ca_spki_pin)


async def test_a_stale_serving_ca_pem_is_replaced_by_the_presented_one(
    tmp_path: Path, memory_pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """The CA re-certified with the same key: OpenSSL refuses the expired stored anchor
    (before the node certificate goes out), the chain verifies against the pin, and the
    presented certificate becomes the anchor, in memory and in serving-ca.pem."""
    expired = pki.cert_pem(_recertified(memory_pki, days=(-30, -1)))
    async with trio.open_nursery() as nursery:
        gw = hostile.HostileGateway(
            hostile.gateway_context(memory_pki), [hostile.tls(hostile.answer(200, b"{}"))]
        )
        await nursery.start(gw.run)
        cfg, state = _node(tmp_path, memory_pki, gw.port)
        pem = cfg.path.parent / "serving-ca.pem"
        pem.write_text(expired)
        with caplog.at_level(logging.WARNING, logger="bcd.servingca"):
            answer = await post_as_node(cfg, state, None, RENEW_PATH, b"{}")
        assert answer.status == 200
        assert gw.connections == 2  # refused once, then retried
        assert len(gw.requests) == 1
        assert pem.read_text() == pki.cert_pem(memory_pki.serving_ca)
        assert stat.S_IMODE(os.stat(pem).st_mode) == 0o644
        assert [r.levelname for r in caplog.records if "is stale" in r.getMessage()] == ["WARNING"]
        # held in memory too: the next call dials once
        answer = await post_as_node(cfg, state, None, RENEW_PATH, b"{}")
        assert answer.status == 200
        assert gw.connections == 3
        nursery.cancel_scope.cancel()


async def test_without_the_file_the_stale_anchor_is_replaced_in_memory(
    tmp_path: Path, memory_pki: Pki
) -> None:
    """connect_pinned alone (no config): the callback gets the presented anchor."""
    pin = memory_pki.pins()["serving_ca_spki_pin"]
    stale = anchor_of(
        pki.cert_pem(_recertified(memory_pki, days=(-30, -1))), pin, check_dates=False
    )
    got: list[str] = []
    async with trio.open_nursery() as nursery:
        gw = Recorder(_server_context(memory_pki, memory_pki))
        await nursery.start(gw.run)
        with pytest.raises(PeerVerificationError, match="check the clock"):
            await connect_pinned("127.0.0.1", gw.port, "127.0.0.1", stale, timeout=5)
        stream = await connect_pinned(
            "127.0.0.1",
            gw.port,
            "127.0.0.1",
            stale,
            timeout=5,
            on_stale_anchor=lambda fresh: got.append(fresh.pem),
        )
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert got == [pki.cert_pem(memory_pki.serving_ca)]


def test_serving_ca_pem_is_read_as_config_toml_is(tmp_path: Path, memory_pki: Pki) -> None:
    pin = memory_pki.pins()["serving_ca_spki_pin"]
    pem = tmp_path / "serving-ca.pem"
    real = tmp_path / "elsewhere.pem"
    real.write_text(pki.cert_pem(memory_pki.serving_ca))
    real.chmod(0o644)
    pem.symlink_to(real)
    with pytest.raises(ConfigError) as caught:
        servingca.read_anchor(pem, pin)
    assert str(caught.value) == f"{pem}: is a symbolic link, not a regular file"
    pem.unlink()
    pem.write_text(pki.cert_pem(memory_pki.serving_ca))
    pem.chmod(0o664)
    with pytest.raises(ConfigError) as caught:
        servingca.read_anchor(pem, pin)
    assert str(caught.value) == (
        f"{pem} can be changed by other users (mode 0664); it is the serving CA bcd trusts: "
        f"chmod 0644 {pem}"
    )
    pem.chmod(0o644)
    assert servingca.read_anchor(pem, pin) is not None
    if os.geteuid() == 0:
        os.chown(pem, 54321, -1)
        with pytest.raises(ConfigError) as caught:
            servingca.read_anchor(pem, pin)
        assert str(caught.value) == (
            f"{pem} is owned by uid 54321, not root or this user; it is the serving CA bcd "
            f"trusts: chown root {pem}"
        )

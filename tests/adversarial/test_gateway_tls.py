"""The gateway's TLS: ALPN http/1.1, and TLS 1.2 only with forward-secret AEAD suites."""

from __future__ import annotations

import socket
import ssl

import pytest

from tests.world import ControlPlane

pytestmark = pytest.mark.e2e


def _client(max_version: ssl.TLSVersion, ciphers: str | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only the negotiation is under test
    ctx.maximum_version = max_version
    if ciphers:
        ctx.set_ciphers(ciphers)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


def _handshake(cp: ControlPlane, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", cp.gateway_port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def test_alpn_is_http_1_1_on_tls_1_3_and_1_2(sqlite_control_plane: ControlPlane) -> None:
    for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
        with _handshake(sqlite_control_plane, _client(version)) as tls:
            assert tls.selected_alpn_protocol() == "http/1.1"
            if version is ssl.TLSVersion.TLSv1_2:
                assert "GCM" in tls.cipher()[0] or "CHACHA20" in tls.cipher()[0]


@pytest.mark.parametrize("suite", ["ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384"])
def test_tls_1_2_cbc_suites_are_refused(sqlite_control_plane: ControlPlane, suite: str) -> None:
    with pytest.raises(ssl.SSLError):
        _handshake(sqlite_control_plane, _client(ssl.TLSVersion.TLSv1_2, suite)).close()

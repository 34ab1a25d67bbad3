"""The serving TLS context of the API and the gateway, from the loaded PKI's files."""

from __future__ import annotations

import os
import ssl

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from control.pkicerts import PkiSetupError


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
    (``CERT_OPTIONAL``, the chain held to RFC 5280 by ``VERIFY_X509_STRICT``, and
    never partial: the root of ``client_ca_pem`` anchors it, not an intermediate);
    the application refuses a connection without one, and checks revocation on every
    connection (OpenSSL's in-process TLS 1.2 session-ID cache cannot be turned off
    from Python).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # TLS 1.2 with forward-secret AEAD suites only (TLS 1.3's are all AEAD)
    ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.options |= ssl.OP_NO_TICKET
    ctx.num_tickets = 0
    # no TLS 1.2 renegotiation: a write never has to read (bcd.tlsstream)
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    load_chain(ctx, chain_pem, key)
    if client_ca_pem is not None:
        ctx.load_verify_locations(cadata=client_ca_pem)
        ctx.verify_mode = ssl.CERT_OPTIONAL
        if client_time_in_app:
            # The gateway: an expired node certificate completes the handshake, so the
            # application answers it UNAUTHENTICATED (it checks every certificate
            # against its node_certs row and the database's time, live_peer_or_details), and the
            # node learns its identity expired instead of seeing a broken handshake.
            ctx.verify_flags = ctx.verify_flags | _NO_CHECK_TIME
    return ctx

"""Pinned TLS to the gateway: the serving CA pin is the only trust anchor.

The client context verifies nothing itself (``CERT_NONE``); after the handshake,
and before any request byte is written, :func:`verify_server_chain` checks the
chain the gateway presented: some certificate in it must carry the pinned SPKI,
and the leaf must verify up to that certificate (validity, key usage, extended
key usage, the gateway's name) with cryptography's X.509 path validation. The
system trust store is never consulted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import ssl
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from bcd import pki
from bcd.errors import PeerVerificationError, TransportError

_ENCODING_DER = 2  # _ssl.ENCODING_DER, for the 3.11 private Certificate objects
_MAX_CHAIN = 8
_NOT_PINNED = (
    "the gateway's certificate does not chain to the pinned serving CA (serving_ca_spki_pin)"
)


def os_reason(exc: OSError) -> str:
    """A short reason for a failed connect (trio groups the per-address errors)."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        for err in cause.exceptions:
            if isinstance(err, OSError) and (err.errno or err.strerror):
                return os.strerror(err.errno) if err.errno else str(err.strerror)
    return str(exc.strerror or exc or type(exc).__name__)


def _subject(name: str) -> x509.DNSName | x509.IPAddress:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _spki_pin(cert: x509.Certificate) -> str | None:
    try:
        der = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    except Exception:  # unsupported or malformed key: it cannot be the pinned CA
        return None
    return pki.pin_of_der_spki(der)


def _verifies(
    leaf: x509.Certificate,
    intermediates: list[x509.Certificate],
    anchor: x509.Certificate,
    name: str,
    now: datetime,
) -> Exception | None:
    """Verify ``leaf`` for ``name`` up to ``anchor`` alone; return the failure, if any."""
    try:
        verifier = (
            PolicyBuilder().store(Store([anchor])).time(now).build_server_verifier(_subject(name))
        )
        verifier.verify(leaf, intermediates)
    except (VerificationError, ValueError, TypeError) as exc:
        return exc
    return None


def _own_name(leaf: x509.Certificate) -> str | None:
    """A name the leaf is valid for, to tell a name mismatch from a broken chain."""
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return None
    for dns in san.get_values_for_type(x509.DNSName):
        return dns.replace("*", "x", 1) if dns.startswith("*.") else dns
    for ip in san.get_values_for_type(x509.IPAddress):
        return str(ip)
    return None


def verify_server_chain(chain_der: list[bytes], server_name: str, pin: str, now: datetime) -> None:
    """Check a presented chain (leaf first) against ``pin`` and ``server_name``.

    Returns ``None`` when the leaf verifies up to a certificate of the chain whose
    SPKI pin is ``pin``; raises :class:`TransportError` otherwise, and never
    anything else.
    """
    try:
        _check_chain(chain_der, server_name, pin, now)
    except TransportError:
        raise
    except Exception as exc:  # a certificate cryptography could not take apart
        raise PeerVerificationError(_NOT_PINNED) from exc


def _check_chain(chain_der: list[bytes], server_name: str, pin: str, now: datetime) -> None:
    not_pinned = PeerVerificationError(_NOT_PINNED)
    if not chain_der or len(chain_der) > _MAX_CHAIN:
        raise not_pinned
    try:
        certs = [x509.load_der_x509_certificate(der) for der in chain_der]
    except (ValueError, TypeError) as exc:
        raise PeerVerificationError("the gateway's certificate chain does not parse") from exc
    anchors = [c for c in certs if (p := _spki_pin(c)) is not None and pki.pins_equal(p, pin)]
    if not anchors:
        raise not_pinned
    anchor, leaf = anchors[0], certs[0]
    intermediates = [c for c in certs[1:] if c is not anchor]
    when = now.astimezone(UTC) if now.tzinfo else now.replace(tzinfo=UTC)
    failure = _verifies(leaf, intermediates, anchor, server_name, when)
    if failure is None:
        return
    # Tell the usual causes apart for the message.
    not_before, not_after = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    if not not_before <= when <= not_after:
        raise PeerVerificationError(
            f"the gateway's certificate is not valid at {when:%Y-%m-%dT%H:%M:%SZ} "
            f"(valid {not_before:%Y-%m-%dT%H:%M:%SZ} to {not_after:%Y-%m-%dT%H:%M:%SZ}); "
            "check the clock"
        ) from failure
    own = _own_name(leaf)
    if (
        own is not None
        and own != server_name
        and _verifies(leaf, intermediates, anchor, own, when) is None
    ):
        raise PeerVerificationError(
            f"the gateway's certificate is not valid for {server_name} "
            "(set server_name in config.toml to the name the gateway serves)"
        ) from failure
    raise PeerVerificationError(f"{_NOT_PINNED}: {failure}") from failure


def peer_chain_der(stream: trio.SSLStream[Any]) -> list[bytes]:
    """The chain the peer presented, leaf first, unverified (3.11 private, 3.13 public)."""
    ssl_object: Any = stream._ssl_object
    getter = getattr(ssl_object, "get_unverified_chain", None)
    if getter is None:
        getter = ssl_object._sslobj.get_unverified_chain
    out: list[bytes] = []
    for cert in getter() or ():
        out.append(cert if isinstance(cert, bytes) else cert.public_bytes(_ENCODING_DER))
    return out


@contextlib.contextmanager
def _memfd(name: str, data: bytes) -> Iterator[str]:
    """A path under /proc/self/fd for ``data`` that never touches a disk."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def client_context(client_cert: tuple[str, bytes] | None = None) -> ssl.SSLContext:
    """A fresh client context that verifies nothing itself (we verify the chain)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    if client_cert is not None:
        chain_pem, key_pem = client_cert
        try:
            with (
                _memfd("bcd-chain", chain_pem.encode("ascii")) as cert_path,
                _memfd("bcd-key", key_pem) as key_path,
            ):
                ctx.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError, UnicodeEncodeError) as exc:
            raise TransportError("the node certificate or key does not load") from exc
    return ctx


async def connect_pinned(
    host: str,
    port: int,
    server_name: str,
    serving_ca_pin: str,
    *,
    client_cert: tuple[str, bytes] | None = None,
    timeout: float = 15.0,  # noqa: ASYNC109 - covers connect and handshake separately
) -> trio.SSLStream[trio.SocketStream]:
    """Connect, handshake and verify the gateway against ``serving_ca_pin``.

    ``client_cert`` is (chain PEM, PKCS#8 key PEM) for mutual TLS. Nothing is
    written after the handshake until the chain verified; any failure closes the
    connection and raises :class:`TransportError`.
    """
    where = f"{host}:{port}"
    ctx = client_context(client_cert)
    try:
        with trio.fail_after(timeout):
            tcp = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError as exc:
        raise TransportError(f"cannot reach the gateway at {where}: timed out") from exc
    except OSError as exc:
        raise TransportError(f"cannot reach the gateway at {where}: {os_reason(exc)}") from exc
    stream = trio.SSLStream(tcp, ctx, server_hostname=server_name, https_compatible=True)
    try:
        try:
            with trio.fail_after(timeout):
                await stream.do_handshake()
        except trio.TooSlowError as exc:
            raise TransportError(f"TLS handshake with the gateway at {where} timed out") from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc
            reason = getattr(cause, "reason", None) or cause.__class__.__name__
            raise TransportError(
                f"TLS handshake with the gateway at {where} failed: {reason}"
            ) from exc
        try:
            chain = peer_chain_der(stream)
        except Exception as exc:
            raise PeerVerificationError(
                "cannot read the certificate chain the gateway presented"
            ) from exc
        verify_server_chain(chain, server_name, serving_ca_pin, datetime.now(UTC))
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream

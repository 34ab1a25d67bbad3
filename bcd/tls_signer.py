"""Pinned mutual TLS whose client key signs through a callback (a TPM-held node key).

Python's ``ssl`` cannot use a key it does not hold, so this client runs
tlslite-ng (pure Python, TLS 1.3 and 1.2) on a blocking socket in worker threads.
The client certificate's key is :class:`_CallbackKey`: the handshake's
CertificateVerify digest (SHA-256, P-256) goes to ``sign_digest_sync``, which
returns a P1363 signature (``r || s``, what ``bcd helper``'s ``tpm.sign``
answers). The callback runs in a worker thread started by trio, so it may call
back into trio with ``trio.from_thread.run`` (e.g. ``HelperClient.sign``).

Pinning is :func:`bcd.tls.verify_server_chain`, the same pure check as
:func:`bcd.tls.connect_pinned`, done twice: when the server's Certificate
arrives (before our certificate or any signature by the node key is sent) and
again on the finished session, before any request byte is written.

:func:`connect_with_signer` returns a :class:`trio.abc.Stream`: it is the dial of
:class:`bcd.transport.DialTransport`, so :class:`bcd.gatewayclient.GatewayClient`
runs over it unchanged (the exception to the ``ssl`` path, documented in
docs/decisions.md); :func:`request_with_signer` is connect, one request, close.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket
import threading
import types
import warnings
from collections.abc import Callable, Generator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from bcd.errors import PeerVerificationError, TransportError
from bcd.tls import os_reason, presented_leaf, verify_server_chain

if TYPE_CHECKING:
    from bcd.gatewayanswer import Response

with warnings.catch_warnings():
    # tlslite's package imports its asyncore integration (deprecated in 3.11).
    warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*asyncore")
    from tlslite.api import HandshakeSettings, TLSConnection, X509CertChain
    from tlslite.errors import TLSError
    from tlslite.utils.python_ecdsakey import Python_ECDSAKey

SignDigest = Callable[[bytes], bytes]
"""Sign a 32-byte SHA-256 digest with the node key; a 64-byte P1363 signature."""

_RECV = 64 * 1024
_T = TypeVar("_T")


class _CallbackKey(Python_ECDSAKey):  # type: ignore[misc]
    """A P-256 key whose private half is elsewhere: signing calls ``sign_digest``."""

    def __init__(self, public_key: ec.EllipticCurvePublicKey, sign_digest: SignDigest) -> None:
        if not isinstance(public_key.curve, ec.SECP256R1):
            raise TransportError("the node key is not a P-256 key")
        numbers = public_key.public_numbers()
        super().__init__(numbers.x, numbers.y, "NIST256p")
        self._sign_digest = sign_digest
        # TLS 1.2's CertificateVerify reads the curve off the private key object.
        self.private_key = types.SimpleNamespace(curve=self.public_key.curve)

    def hasPrivateKey(self) -> bool:
        return True

    def _sign(self, data: Any, hAlg: str) -> bytearray:
        digest = bytes(data)
        if hAlg != "sha256" or len(digest) != 32:
            raise TLSError(f"the node key signs SHA-256 digests, not {hAlg}")
        signature = self._sign_digest(digest)
        if not isinstance(signature, bytes) or len(signature) != 64:
            raise TLSError("the node key's signature is not 64 bytes (P1363)")
        r, s = int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
        return bytearray(encode_dss_signature(r, s))

    def _hashAndSign(self, data: Any, hAlg: str) -> bytearray:
        raise TLSError("the node key signs digests only")


class _PinnedConnection(TLSConnection):  # type: ignore[misc]
    """Checks the server's chain against the pin as soon as it arrives."""

    def __init__(self, sock: socket.socket, server_name: str, pin: str) -> None:
        super().__init__(sock)
        self._pin_name = server_name
        self._pin = pin

    def _clientGetKeyFromChain(
        self, certificate: Any, settings: Any, tack_ext: Any = None
    ) -> Generator[Any]:
        for result in super()._clientGetKeyFromChain(certificate, settings, tack_ext):
            if result in (0, 1):
                yield result
                continue
            _, chain, _ = result
            verify_server_chain(_chain_der(chain), self._pin_name, self._pin, datetime.now(UTC))
            yield result


def _chain_der(chain: Any) -> list[bytes]:
    if not isinstance(chain, X509CertChain):
        raise PeerVerificationError("the gateway presented no X.509 certificate chain")
    return [bytes(cert.bytes) for cert in chain.x509List]


def _settings() -> HandshakeSettings:
    settings = HandshakeSettings()
    settings.minVersion = (3, 3)
    settings.maxVersion = (3, 4)
    settings.ecdsaSigHashes = ["sha256"]  # the node key signs SHA-256 digests
    settings.more_sig_schemes = []  # no EdDSA
    settings.useEncryptThenMAC = True
    # tlslite-ng 0.8 sends its TLS 1.3 client Certificate compressed (RFC 8879)
    # even to a server that offered no compression (OpenSSL 3.0 answers
    # unexpected_message): never compress, never offer it.
    settings.certificate_compression_send = []
    settings.certificate_compression_receive = []
    return settings


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class SignerTlsStream(trio.abc.Stream):
    """A handshaken, pinned tlslite connection as a trio stream (blocking I/O in threads).

    One send and one receive at a time; a call that is cancelled while its thread
    blocks breaks the stream (the socket is shut down so the thread ends).
    """

    def __init__(self, conn: TLSConnection, sock: socket.socket) -> None:
        self._conn = conn
        self._sock = sock
        self._broken = False
        self._closed = False

    @property
    def socket(self) -> socket.socket:
        """The TCP socket (whether an idle connection was closed by the gateway)."""
        return self._sock

    @property
    def version(self) -> tuple[int, int]:
        """The negotiated protocol version: (3, 4) is TLS 1.3, (3, 3) TLS 1.2."""
        return tuple(self._conn.version)

    async def _run(self, fn: Callable[[], _T]) -> _T:
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        if self._broken:
            raise trio.BrokenResourceError("the connection broke")
        try:
            return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except trio.Cancelled:
            self._break()
            raise
        except (TLSError, OSError, ValueError) as exc:
            self._break()
            raise trio.BrokenResourceError(f"the connection broke: {exc!r}") from exc

    def _break(self) -> None:
        self._broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        payload = bytes(data)
        await self._run(lambda: self._conn.write(payload))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        size = _RECV if max_bytes is None else max_bytes
        data = await self._run(lambda: self._conn.read(size))
        return bytes(data)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._break()
            self._sock.close()
        await trio.lowlevel.checkpoint()


class _Deadline:
    """Shuts the handshake's socket down at the deadline or on cancellation.

    tlslite blocks in a worker thread with a per-I/O socket timeout only; a peer
    dripping a byte within each timeout would hold it forever. Shutting the socket
    down ends every blocked read or write at once, whoever calls :meth:`fire`.
    """

    def __init__(self, timeout: float) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.fired = False
        self._timer = threading.Timer(timeout, self.fire)
        self._timer.daemon = True
        self._timer.start()

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.fired:
                _shutdown(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            if self._sock is not None:
                _shutdown(self._sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _handshake(
    host: str,
    port: int,
    server_name: str,
    serving_ca_pin: str,
    chain_pem: str,
    public_key: ec.EllipticCurvePublicKey,
    sign_digest_sync: SignDigest,
    timeout: float,
    deadline: _Deadline,
) -> tuple[TLSConnection, socket.socket]:
    """Connect and handshake (blocking, in a worker thread); the chain is pinned.

    ``deadline`` bounds connect and handshake together (``timeout`` is per I/O).
    """
    where = f"{host}:{port}"
    timed_out = f"TLS handshake with the gateway at {where} timed out"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError as exc:
        raise TransportError(f"cannot reach the gateway at {where}: timed out") from exc
    except OSError as exc:
        raise TransportError(f"cannot reach the gateway at {where}: {os_reason(exc)}") from exc
    try:
        deadline.attach(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        certs = X509CertChain()
        try:
            certs.parsePemList(presented_leaf(chain_pem))  # the leaf alone, as a file key
        except (SyntaxError, ValueError) as exc:
            raise TransportError("the node certificate chain does not load") from exc
        key = _CallbackKey(public_key, sign_digest_sync)
        conn = _PinnedConnection(sock, server_name, serving_ca_pin)
        try:
            conn.handshakeClientCert(
                certs,
                key,
                settings=_settings(),
                serverName=None if _is_ip(server_name) else server_name,
                alpn=[bytearray(b"http/1.1")],
            )
        except TimeoutError as exc:
            raise TransportError(timed_out) from exc
        except (TLSError, OSError, ValueError, AssertionError) as exc:
            if deadline.fired:
                raise TransportError(timed_out) from exc
            raise TransportError(
                f"TLS handshake with the gateway at {where} failed: {exc!r}"
            ) from exc
        deadline.cancel()
        if deadline.fired:  # it fired as the handshake finished: the socket is shut
            raise TransportError(timed_out)
        # Again on the finished session, before any request byte.
        verify_server_chain(
            _chain_der(conn.session.serverCertChain),
            server_name,
            serving_ca_pin,
            datetime.now(UTC),
        )
    except BaseException:
        sock.close()
        raise
    return conn, sock


async def connect_with_signer(
    host: str,
    port: int,
    server_name: str,
    serving_ca_pin: str,
    chain_pem: str,
    public_key: ec.EllipticCurvePublicKey,
    sign_digest_sync: SignDigest,
    *,
    timeout: float = 15.0,  # noqa: ASYNC109 - bounds connect and handshake together
) -> SignerTlsStream:
    """Like :func:`bcd.tls.connect_pinned`, with the client key signing through a callback.

    ``chain_pem`` is the node's certificate chain (leaf first) and ``public_key`` the
    leaf's key; ``sign_digest_sync`` signs the CertificateVerify digest. Raises
    :class:`TransportError` (a :class:`PeerVerificationError` for the pin). ``timeout``
    bounds connect and handshake together; a cancellation shuts the socket down and
    leaves the worker thread to finish on its own.
    """
    deadline = _Deadline(timeout)
    try:
        conn, sock = await trio.to_thread.run_sync(
            functools.partial(
                _handshake,
                host,
                port,
                server_name,
                serving_ca_pin,
                chain_pem,
                public_key,
                sign_digest_sync,
                timeout,
                deadline,
            ),
            abandon_on_cancel=True,
        )
    except BaseException:
        deadline.fire()
        raise
    finally:
        deadline.cancel()
    return SignerTlsStream(conn, sock)


async def request_with_signer(
    host: str,
    port: int,
    server_name: str,
    serving_ca_pin: str,
    chain_pem: str,
    public_key: ec.EllipticCurvePublicKey,
    sign_digest_sync: SignDigest,
    method: str,
    target: str,
    body: bytes | None = None,
    headers: Sequence[tuple[str, str]] = (),
    *,
    timeout: float = 30.0,  # noqa: ASYNC109 - bounds the exchange after the handshake
) -> Response:
    """Connect with the signer, send one request, read the whole answer, close."""
    from bcd.gatewayclient import GatewayClient
    from bcd.transport import DialTransport

    async def dial(dial_host: str, dial_port: int) -> trio.abc.Stream:
        return await connect_with_signer(
            dial_host,
            dial_port,
            server_name,
            serving_ca_pin,
            chain_pem,
            public_key,
            sign_digest_sync,
        )

    async with GatewayClient(
        DialTransport(dial), host=host, port=port, server_name=server_name, timeout=timeout
    ) as client:
        return await client.request(method, target, body, headers)

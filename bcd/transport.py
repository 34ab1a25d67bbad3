"""The node's transports to the gateway: httpcore's HTTP/1.1 pool over a pinned dial.

:class:`DialTransport` is an ``httpx.AsyncBaseTransport`` (the seam
:class:`bcd.gatewayclient.GatewayClient` takes): httpcore's connection pool speaking
HTTP/1.1 over streams that a *dial* function opens, TLS handshaken and pinned. Two
dials exist:

- a file key: :func:`bcd.tls.connect_pinned`, Python's ``ssl`` with the serving CA
  certificate as the only trust anchor (OpenSSL refuses an unpinned gateway inside
  the handshake, before the node's certificate is sent);
- a TPM-held key (the exception): :func:`bcd.tls_signer.connect_with_signer`,
  tlslite-ng, whose CertificateVerify is signed through ``bcd helper``; it checks the
  pin as soon as the server's Certificate arrives, before sending its own.

The pool never dials by itself (``retries=0``) and never sees a proxy; the URL's
host and port are the gateway's, the TLS name is ``server_name``. A simulator or a
hostile test passes its own ``httpx.AsyncBaseTransport`` instead.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpcore
import httpx
import trio

from bcd.config import Config, gateway_host_port
from bcd.errors import TransportError
from bcd.gatewayclient import GatewayClient
from bcd.helper.nodekeys import HelperKeys
from bcd.identity import AnyState
from bcd.keys.node import SignerMaterial, node_key_of
from bcd.netstream import NetworkStream, TcpBackend
from bcd.servingca import replace_stale, serving_ca
from bcd.tls import Anchor, connect_pinned

Dial = Callable[[str, int], Awaitable[trio.abc.Stream]]
"""Open a TLS stream to (host, port), handshaken and pinned, or raise TransportError."""

CONNECT_TIMEOUT_S = 15.0

# httpcore wants an SSLContext for an https origin (it sets ALPN on it); the dial
# does the TLS itself, so this one is never used for a handshake.
_UNUSED_CONTEXT = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


async def _dialled(
    dial: Dial,
    host: str,
    port: int,
    timeout: float | None,  # noqa: ASYNC109 - the dial has its own
) -> httpcore.AsyncNetworkStream:
    return NetworkStream(await dial(host, port))


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: AsyncIterator[bytes] | Any) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        closer = getattr(self._stream, "aclose", None)
        if closer is not None:
            await closer()


class DialTransport(httpx.AsyncBaseTransport):
    """httpcore's HTTP/1.1 pool over ``dial``; httpcore's exceptions pass through
    (:class:`bcd.gatewayclient.GatewayClient` maps them, and the dial's
    :class:`~bcd.errors.TransportError`, into :mod:`bcd.errors`)."""

    def __init__(self, dial: Dial, *, max_connections: int = 4) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=_UNUSED_CONTEXT,
            max_connections=max_connections,
            keepalive_expiry=5.0,
            http1=True,
            http2=False,
            retries=0,
            network_backend=TcpBackend(functools.partial(_dialled, dial)),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        resp = await self._pool.handle_async_request(core)
        return httpx.Response(
            status_code=resp.status,
            headers=resp.headers,
            stream=_Body(resp.stream),
            extensions=resp.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


async def gateway_transport(
    cfg: Config, state: AnyState | None = None, tpm: HelperKeys | None = None
) -> DialTransport:
    """The transport to ``cfg``'s gateway: certless (``state`` None, for the join),
    mutual TLS with a file key, or with a TPM-held key through ``bcd helper``.

    The node key's TLS material (:meth:`bcd.keys.node.NodeKey.tls`) decides: a PEM goes
    to an ``ssl`` context, a digest signer to tlslite-ng (the documented exception).
    """
    if state is None:
        return pinned_transport(cfg.server_name, await serving_ca(cfg), cfg=cfg)
    if state.identity.key == "tpm" and tpm is None:
        raise TransportError("a TPM-held node key needs bcd helper ([helper] in config.toml)")
    material, chain = node_key_of(state, tpm=tpm).tls(), state.identity.chain
    if isinstance(material, SignerMaterial):
        from bcd.tls_signer import connect_with_signer  # tlslite only where it is used

        public_key, signer = material.public_key, material.sign_digest

        async def dial_signer(host: str, port: int) -> trio.abc.Stream:
            return await connect_with_signer(
                host, port, cfg.server_name, cfg.serving_ca_spki_pin, chain, public_key, signer
            )

        return DialTransport(dial_signer)
    anchor = await serving_ca(cfg)
    return pinned_transport(
        cfg.server_name, anchor, (chain, material.key_pem), cfg=cfg, owner=state
    )


def pinned_transport(
    server_name: str,
    anchor: Anchor,
    client_cert: tuple[str, bytes] | None = None,
    *,
    cfg: Config | None = None,
    owner: object | None = None,
) -> DialTransport:
    """The file-key transport: :func:`bcd.tls.connect_pinned` with ``anchor`` as the only
    trust anchor and ``client_cert`` (chain PEM, key PEM) for mutual TLS, its context
    kept per ``owner`` (the loaded state ``client_cert`` is of:
    :func:`bcd.tls.cached_context`).

    A stale anchor (OpenSSL refuses a chain that verifies against the pin) is replaced
    by the presented one for later dials and, with ``cfg``, in serving-ca.pem
    (:func:`bcd.servingca.replace_stale`)."""
    current = [anchor]

    def on_stale_anchor(fresh: Anchor) -> None:
        current[0] = fresh
        if cfg is not None:
            replace_stale(cfg, fresh)

    async def dial(host: str, port: int) -> trio.abc.Stream:
        return await connect_pinned(
            host,
            port,
            server_name,
            current[0],
            client_cert=client_cert,
            timeout=CONNECT_TIMEOUT_S,
            on_stale_anchor=on_stale_anchor,
            owner=owner,
        )

    return DialTransport(dial)


async def gateway_client(
    cfg: Config, state: AnyState | None = None, tpm: HelperKeys | None = None
) -> GatewayClient:
    """A :class:`GatewayClient` to ``cfg``'s gateway over :func:`gateway_transport`."""
    host, port = gateway_host_port(cfg)
    transport = await gateway_transport(cfg, state, tpm)
    return GatewayClient(transport, host=host, port=port, server_name=cfg.server_name)

"""Calls to a real gateway as a node makes them, for end-to-end tests.

The serving CA comes from the gateway itself, checked against the pin
(:func:`bcd.tls.probe_anchor`, as a node without serving-ca.pem fetches it); the call
then goes through :class:`bcd.gatewayclient.GatewayClient` over the pinned transport.
"""

from __future__ import annotations

from bcd.gatewayclient import GatewayClient, Response
from bcd.identity import LoadedState
from bcd.keys.file import key_to_pem
from bcd.tls import Anchor, probe_anchor
from bcd.transport import pinned_transport

HOST = "127.0.0.1"


async def gateway_anchor(port: int, pin: str) -> Anchor:
    return await probe_anchor(HOST, port, HOST, pin)


async def node_client(port: int, pin: str, state: LoadedState | None = None) -> GatewayClient:
    """A client to the gateway on ``port``: certless, or as ``state``'s identity."""
    cert = None if state is None else (state.identity.chain, key_to_pem(state.key))
    transport = pinned_transport(HOST, await gateway_anchor(port, pin), cert)
    return GatewayClient(transport, host=HOST, port=port, server_name=HOST)


async def node_post(
    port: int, pin: str, state: LoadedState | None, path: str, body: bytes
) -> Response:
    """One POST to the gateway on ``port`` (one connection, closed after)."""
    async with await node_client(port, pin, state) as client:
        return await client.post(path, body)

"""``bcd vouch``: a site agent vouches for a machine that booted on its site.

Run on a site agent (a node joined with ``bcd join --role site``), typically from its
DHCP or PXE server's hook when a machine takes a boot lease: ``POST
/v1/discovery/vouch`` over mutual TLS with the site agent's own certificate, pinned
to the serving CA like every gateway call. The machine can then join with ``bcd join
--attestor discovery`` (see :mod:`attestors.discovery`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import trio

from bcd import pki, wire
from bcd.config import Config
from bcd.errors import BcdError, GatewayUnauthenticated, JoinError
from bcd.gatewayanswer import Response, refusal
from bcd.keys.node import node_key_of
from bcd.node import helper_keys, load_identity
from bcd.revocation import judge_unauthenticated
from bcd.session import post_as_node

VOUCH_PATH = "/v1/discovery/vouch"


def vouch_fields(
    mac: str, boot_lease_epoch: int, ip: str | None, workflow_id: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"mac": mac, "boot_lease_epoch": boot_lease_epoch}
    if ip:
        body["ip"] = ip
    if workflow_id:
        body["workflow_id"] = workflow_id
    return body


def signed_vouch_body(
    fields: dict[str, Any], node_id: str, client_time_ms: int, sign: Callable[[bytes], bytes]
) -> bytes:
    """The vouch with its proof of possession: ``sign`` is a P1363 signer of a SHA-256
    digest by the site agent's current key (a file key, or the TPM through the helper),
    so a gateway that relays it cannot make one up (docs/decisions.md)."""
    message = pki.vouch_pop_message(wire.dumps(fields), node_id, client_time_ms)
    pop = sign(hashlib.sha256(message).digest())
    return wire.dumps({**fields, "client_time": client_time_ms, "pop_sig": pki.b64url(pop)})


def vouch_answer(status: int, body: bytes, pushback_ms: str = "") -> dict[str, Any]:
    """The gateway's answer: the stored vouch, or an error naming what went wrong."""
    if status == 200:
        try:
            return wire.loads_object(body, 4096)
        except wire.WireError as exc:
            raise JoinError("the gateway's answer to the vouch is not JSON") from exc
    raise refusal(
        Response(status, {"retry-pushback-ms": pushback_ms}, body),
        failed="the vouch was refused",
        unauthenticated="this site agent's certificate is not live (revoked or expired)",
        say_when=True,
    )


async def vouch(
    cfg: Config, mac: str, boot_lease_epoch: int, ip: str | None, workflow_id: str | None
) -> dict[str, Any]:
    tpm = helper_keys(cfg)
    state = await trio.to_thread.run_sync(load_identity, cfg, datetime.now(UTC), tpm)
    if state.identity.role != "site":
        raise BcdError(
            f"this node is a {state.identity.role}, not a site agent: only a node joined with "
            "bcd join --role site may vouch for machines"
        )
    # a file key, or the TPM-held key through bcd helper (load_identity gives a TPM-held
    # state only with a helper); its signer runs in the worker thread below
    sign = node_key_of(state, tpm=tpm).digest_signer()
    fields = vouch_fields(mac, boot_lease_epoch, ip, workflow_id)
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    body = await trio.to_thread.run_sync(
        signed_vouch_body, fields, state.identity.node_id, now_ms, sign
    )
    resp = await post_as_node(cfg, state, tpm, VOUCH_PATH, body)
    try:
        return vouch_answer(
            resp.status, resp.body, resp.headers.get("retry-pushback-ms", "").strip()
        )
    except GatewayUnauthenticated as exc:  # revoked only on a signed notice
        raise judge_unauthenticated(
            exc.notice, cfg.join_signing_key_pin, state, datetime.now(UTC), exc.reason
        ) from exc

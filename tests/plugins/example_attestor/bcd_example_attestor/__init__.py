"""serial-allowlist: an example third-party bcd attestor.

Node half (``bcd join --attestor serial-allowlist``, no token): sends the machine's
product serial (``/sys/class/dmi/id/product_serial`` under the root named by the
environment variable ``SERIAL_ALLOWLIST_SYSFS_ROOT``, default ``/``) as evidence
``{"v": 1, "serial": ...}``.

Server half: admits into the pool ``serial-allowlist.pool`` when the serial is one
of ``serial-allowlist.serials`` (comma-separated), both given with
``better-compute serve --attestor-setting serial-allowlist.KEY=VALUE``.

Refusal reasons: ``not-configured``, ``evidence-malformed``, ``serial-mismatch``
(the evidence's serial is not the one in the request's claims), ``role``,
``serial-unknown``, ``pool-unknown``.

It trusts what the machine says about itself: it shows the plugin contract and is
not an attestor to deploy.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from bcd import wire
from bcd.errors import BcdError
from bcd.hardware import read_claims
from bcd.plugins import (
    Admit,
    NodeEvidence,
    NodeJoinContext,
    Refuse,
    ServerJoinContext,
    Verdict,
    hookimpl,
)

NAME = "serial-allowlist"
SETTING_SERIALS = f"{NAME}.serials"
SETTING_POOL = f"{NAME}.pool"
SYSFS_ROOT_ENV = "SERIAL_ALLOWLIST_SYSFS_ROOT"
MAX_SERIAL = 256


@hookimpl
def bcd_attestor_names() -> list[str]:
    return [NAME]


@hookimpl
def bcd_node_evidence(attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
    if attestor != NAME:
        return None
    claims = ctx.claims  # what bcd join read; older bcd without it: read sysfs ourselves
    if claims is None:
        claims = read_claims(Path(os.environ.get(SYSFS_ROOT_ENV, "/")))
    serial = claims.product_serial
    if not serial:
        raise BcdError("serial-allowlist: this machine reports no product serial")
    return NodeEvidence(sealed_token=None, evidence={"v": 1, "serial": serial})


def _serials(value: str) -> frozenset[str]:
    return frozenset(s.strip() for s in value.split(",") if s.strip())


@hookimpl
def bcd_server_verify(
    attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
) -> Verdict | None:
    if attestor != NAME:
        return None
    pool_id = ctx.settings.get(SETTING_POOL)
    allowed = _serials(ctx.settings.get(SETTING_SERIALS, ""))
    if not pool_id or not allowed:
        return Refuse("not-configured")
    evidence = request.evidence
    serial = evidence.get("serial")
    if evidence.get("v") != 1 or not isinstance(serial, str) or not 0 < len(serial) <= MAX_SERIAL:
        return Refuse("evidence-malformed")
    if not hmac.compare_digest(serial.encode(), request.claims.product_serial.encode()):
        return Refuse("serial-mismatch")
    if request.role != "node":
        return Refuse("role")
    if serial not in allowed:
        return Refuse("serial-unknown")
    pool = ctx.lookup_pool(pool_id)
    if pool is None:
        return Refuse("pool-unknown")
    return Admit(
        tenant_id=pool.tenant_id,
        pool_id=pool.pool_id,
        site_id=pool.site_id,
        role=request.role,
    )

"""serial-allowlist: an example third-party bcd attestor.

Node half (``bcd join --attestor serial-allowlist``, no token): sends one of the
machine's serials as evidence ``{"v": 1, "serial": ..., "field": ...}``: the one its
table in config.toml names (default ``product_serial``)::

    [attestors.serial-allowlist]
    serial_field = "board_serial"      # product_serial | board_serial | chassis_serial

read from the claims bcd join read (an older bcd without them: from
``/sys/class/dmi/id/<field>`` under the root named by the environment variable
``SERIAL_ALLOWLIST_SYSFS_ROOT``, default ``/``). ``bcd_node_check_settings`` refuses
any other key or value, so a typo fails when bcd loads the file.

Server half: admits into the pool ``serial-allowlist.pool`` when the serial is one
of ``serial-allowlist.serials`` (comma-separated), both given with
``better-compute serve --attestor-setting serial-allowlist.KEY=VALUE``;
``bcd_server_check_settings`` stops ``serve`` when only one of them is.

Refusal reasons: ``not-configured``, ``evidence-malformed``, ``serial-mismatch``
(the evidence's serial is not the one in the request's claims), ``role``,
``serial-unknown``, ``pool-unknown``.

It trusts what the machine says about itself: it shows the plugin contract and is
not an attestor to deploy.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bcd import wire
from bcd.attestor_api import (  # the public face of the plugin contract
    Admit,
    NodeEvidence,
    NodeJoinContext,
    Refuse,
    ServerJoinContext,
    Verdict,
    hookimpl,
)
from bcd.errors import BcdError
from bcd.hardware import read_claims

NAME = "serial-allowlist"
SETTING_SERIALS = f"{NAME}.serials"
SETTING_POOL = f"{NAME}.pool"
SYSFS_ROOT_ENV = "SERIAL_ALLOWLIST_SYSFS_ROOT"
MAX_SERIAL = 256
SERIAL_FIELDS = ("product_serial", "board_serial", "chassis_serial")
NODE_KEYS = ("serial_field",)


@hookimpl
def bcd_attestor_names() -> list[str]:
    return [NAME]


@hookimpl
def bcd_node_check_settings(attestor: str, table: Mapping[str, Any]) -> list[str] | None:
    if attestor != NAME:
        return None
    problems = [
        f"unknown key {key!r} (it takes serial_field)" for key in table if key not in NODE_KEYS
    ]
    if table.get("serial_field", SERIAL_FIELDS[0]) not in SERIAL_FIELDS:
        problems.append(f'"serial_field" must be one of {", ".join(SERIAL_FIELDS)}')
    return problems


@hookimpl
def bcd_node_evidence(attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
    if attestor != NAME:
        return None
    field = str(ctx.settings.get("serial_field", SERIAL_FIELDS[0]))  # checked at load
    claims = ctx.claims  # what bcd join read; older bcd without it: read sysfs ourselves
    if claims is None:
        claims = read_claims(Path(os.environ.get(SYSFS_ROOT_ENV, "/")))
    serial = getattr(claims, field)
    if not serial:
        raise BcdError(f"serial-allowlist: this machine reports no {field.replace('_', ' ')}")
    return NodeEvidence(sealed_token=None, evidence={"v": 1, "serial": serial, "field": field})


def _serials(value: str) -> frozenset[str]:
    return frozenset(s.strip() for s in value.split(",") if s.strip())


@hookimpl
def bcd_server_check_settings(attestor: str, settings: Mapping[str, str]) -> list[str] | None:
    if attestor != NAME:
        return None
    if (SETTING_POOL in settings) != (SETTING_SERIALS in settings):
        return [
            f"{NAME} needs both --attestor-setting {SETTING_POOL}=POOL and {SETTING_SERIALS}=..."
        ]
    return []


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
    field = evidence.get("field", SERIAL_FIELDS[0])
    if (
        evidence.get("v") != 1
        or not isinstance(serial, str)
        or not 0 < len(serial) <= MAX_SERIAL
        or field not in SERIAL_FIELDS
    ):
        return Refuse("evidence-malformed")
    claimed: str = getattr(request.claims, field)
    if not hmac.compare_digest(serial.encode(), claimed.encode()):
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

"""The discovery attestor: a machine that booted on a site joins with no token.

A site agent (``bcd join --role site`` with a site token) vouches for machines that
booted on its site (``bcd vouch``: ``POST /v1/discovery/vouch``, :mod:`control.discovery`):
their MAC, the boot's DHCP lease epoch, their address and a workflow id. A machine
then runs ``bcd join --attestor discovery`` (PXE-booted, no token).

Node half: no evidence beyond the claims ``bcd join`` sends (its MACs among them).

Server half, inside the join transaction, configured by ``better-compute serve
--discovery-pool POOL`` (``discovery.pool``; unset: refused ``not-configured``),
``--attestor-setting discovery.approval=unknown-machines|always`` (default
``unknown-machines``), optionally ``discovery.allowed_kinds`` (a comma list of
command kinds, exact or ``prefix.*``, that the certificate accepts) and
``discovery.match_ip`` (default ``true``: the join must come from the address the
site agent vouched for, as the gateway sees it; ``false`` only where a NAT or proxy
hides the site's addresses from the gateway):

1. the role is ``node`` (a site agent joins with a site token, never by discovery);
2. one of the claimed MACs has a vouch of a site agent of the pool's site (the
   newest boot of that MAC), or the machine already has a join request with this
   CSR (it is waiting, or was approved or rejected: JoinService decides);
3. the vouch is unexpired and unused (a vouch admits one join per boot), and with
   ``match_ip`` the join came from the vouched address;
4. ``unknown-machines``: a machine whose trusted hardware key already belongs to a
   node of this pool (it was reinstalled or PXE-booted again) is admitted at once
   as a reclaim of that node; every other machine, and with ``always`` every
   machine, becomes a join request a person approves or rejects
   (``better-compute join-requests``). The request records the vouching site agent
   (``vouchedBy``), the boot (``bootLeaseEpoch``), the MAC, the address and the
   workflow id. The machine is keyed by its trusted hardware key, else by
   ``<site>|<mac>``.

What it trusts: the site agent's certificate (a live ``site`` certificate of that
site) and its word about the MAC; the claims themselves are the machine's own word,
so an unknown machine is admitted only by a person. Refusal reasons:
``not-configured``, ``role``, ``pool-unknown``, ``not-vouched``, ``vouch-expired``,
``vouch-used``, ``ip-mismatch``.
"""

from __future__ import annotations

from collections.abc import Mapping

from bcd import hardware, wire
from bcd.attestor_api import (
    Admit,
    Defer,
    NodeEvidence,
    NodeJoinContext,
    Refuse,
    ServerJoinContext,
    Verdict,
    VouchRecord,
    hookimpl,
    valid_allowed_kind,
)

DISCOVERY = "discovery"
SETTING_POOL = "discovery.pool"
SETTING_APPROVAL = "discovery.approval"
SETTING_ALLOWED_KINDS = "discovery.allowed_kinds"
SETTING_MATCH_IP = "discovery.match_ip"
APPROVALS = ("unknown-machines", "always")
PENDING_RETRY_S = 5


def parse_allowed_kinds(value: str) -> tuple[str, ...] | None:
    """``a.b,c.*`` as a tuple; None when an entry is not a kind or ``prefix.*``."""
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    if not all(valid_allowed_kind(k) for k in kinds):
        return None
    return kinds


def check_settings(settings: Mapping[str, str]) -> str | None:
    """What is wrong with the discovery settings (for ``serve`` to fail at start), or None."""
    approval = settings.get(SETTING_APPROVAL, APPROVALS[0])
    if approval not in APPROVALS:
        return f"discovery.approval must be one of {', '.join(APPROVALS)}, not {approval!r}"
    if settings.get(SETTING_MATCH_IP, "true") not in ("true", "false"):
        return "discovery.match_ip must be true or false"
    kinds = settings.get(SETTING_ALLOWED_KINDS)
    if kinds is not None and parse_allowed_kinds(kinds) is None:
        return "discovery.allowed_kinds must be a comma list of kinds (a.b) or prefixes (a.*)"
    if (SETTING_APPROVAL in settings or kinds is not None) and not settings.get(SETTING_POOL):
        return "the discovery attestor needs --discovery-pool POOL"
    return None


@hookimpl
def bcd_attestor_names() -> list[str]:
    return [DISCOVERY]


@hookimpl
def bcd_server_check_settings(attestor: str, settings: Mapping[str, str]) -> list[str] | None:
    if attestor != DISCOVERY:
        return None
    problem = check_settings(settings)
    return [] if problem is None else [problem]


@hookimpl
def bcd_node_evidence(attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
    if attestor != DISCOVERY:
        return None
    return NodeEvidence(sealed_token=None, evidence={})


def _newest_vouch(
    ctx: ServerJoinContext, site_id: str, macs: tuple[str, ...]
) -> VouchRecord | None:
    found: VouchRecord | None = None
    for mac in macs:
        vouch = ctx.lookup_vouch(site_id, mac)
        if vouch is not None and (found is None or vouch.expires_at_ms > found.expires_at_ms):
            found = vouch
    return found


def _fresh(vouch: VouchRecord, now_ms: int) -> bool:
    return not vouch.used and vouch.expires_at_ms > now_ms


@hookimpl
def bcd_server_verify(
    attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
) -> Verdict | None:
    if attestor != DISCOVERY:
        return None
    pool_id = ctx.settings.get(SETTING_POOL)
    if not pool_id or check_settings(ctx.settings) is not None:
        return Refuse("not-configured")
    if request.role != "node":
        return Refuse("role")
    pool = ctx.lookup_pool(pool_id)
    if pool is None:
        return Refuse("pool-unknown")
    kinds = parse_allowed_kinds(ctx.settings.get(SETTING_ALLOWED_KINDS, "")) or ()
    macs = tuple(sorted({m for m in map(hardware.normalize_mac, request.claims.macs) if m}))
    hw = hardware.hardware_key(request.claims)
    trusted = hw.hex if hw.trusted and hw.hex is not None else None
    vouch = _newest_vouch(ctx, pool.site_id, macs)
    admit = Admit(
        tenant_id=pool.tenant_id,
        pool_id=pool.pool_id,
        site_id=pool.site_id,
        role="node",
        allow_reclaim=True,  # a known machine, or one a person approved
        allowed_kinds=kinds,
    )

    def defer(mac: str, seen: VouchRecord | None) -> Defer:
        return Defer(
            machine_key=trusted or f"{pool.site_id}|{mac}",
            pool_id=pool.pool_id,
            hardware_key=trusted,
            mac=mac,
            ip=ctx.peer_ip or (seen.ip if seen else None),  # where the join came from
            workflow_id=seen.workflow_id if seen else None,
            vouched_by=seen.vouched_by if seen else None,
            boot_lease_epoch=seen.boot_lease_epoch if seen else None,
            admit=admit,
            retry_after_s=PENDING_RETRY_S,
        )

    # A machine already waiting (or decided on) with this CSR: JoinService admits an
    # approved request once, refuses a rejected one, refreshes a pending one.
    for mac in [vouch.mac] if vouch else macs:
        waiting = ctx.lookup_join_request(trusted or f"{pool.site_id}|{mac}")
        if waiting is not None:
            if waiting.usable and vouch is not None and _fresh(vouch, ctx.now_ms):
                # the approved join spends this boot's vouch too (undone if refused):
                # nobody may follow it as a "known machine" on the same boot
                ctx.consume_vouch(vouch.vouch_id)
            return defer(mac, vouch)
    if vouch is None:
        return Refuse("not-vouched")
    if vouch.expires_at_ms <= ctx.now_ms:
        return Refuse("vouch-expired")
    if vouch.used:
        return Refuse("vouch-used")
    if ctx.settings.get(SETTING_MATCH_IP, "true") == "true" and (
        vouch.ip is None or ctx.peer_ip != vouch.ip
    ):
        return Refuse("ip-mismatch")
    approval = ctx.settings.get(SETTING_APPROVAL, APPROVALS[0])
    if approval == "unknown-machines" and trusted is not None:
        known = ctx.lookup_node_by_hardware_key(trusted, pool.tenant_id)
        if known is not None and not known.retired and known.pool_id == pool.pool_id:
            ctx.consume_vouch(vouch.vouch_id)
            return admit
    return defer(vouch.mac, vouch)

"""The admission core: pure judgements over frozen records, no database, no I/O.

JoinService and RenewService are transactional shells around it: inside one
transaction they read the records below (:mod:`control.repos` owns the SQL), ask
this module for the verdict, and write what it decided. A refusal is a
:class:`Refusal` — its ``reason`` is a wire contract (PROTOCOL.md: the
``security.join.refused`` / ``security.renew.refused`` events), the caller only ever
sees ``ACCESS_DENIED``.

Join, in the seed's order: :func:`check_seal`, the attestor's verdict, then for a
:class:`~bcd.attestor_api.Admit` :func:`screen` (the verdict's own shape, the CSR, the
expect and placeholder rules), the records of the node it may reclaim, its pool and
the approved join request, and :func:`judge_admit` (reclaim, pool, node id,
approval). A :class:`~bcd.attestor_api.Defer` is :func:`judge_defer`; a
:class:`~bcd.attestor_api.Challenge` :func:`check_challenge`. Renew is
:func:`judge_renew_leaf` (the presented leaf, its node, the caller) and
:func:`judge_renew_proof` (replay, proof, CSR). :func:`lifetime_s` is the
certificate's lifetime for both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cryptography import x509

from bcd import hardware, wire
from bcd.attestor_api import JOIN_TOKEN, Admit, Challenge, Defer, valid_allowed_kind

CERT_TTL_MAX_S = 86_400
RAMDISK_TTL_MAX_S = 7_200
RENEWALS_PER_HOUR = 6
"""RenewService's limit: at most this many renewals per node in any hour (a sliding window)."""
RATE_WINDOW_MS = 3_600_000
NODE_RENEW_FRACTION = 0.6
"""When the node renews: 60 % of the way through its leaf (``bcd.renew.RENEW_FRACTION``)."""
RENEWAL_MARGIN = 1.8
"""How much of the hourly renewal limit a node's schedule may use at the shortest cap:
at most 1/1.8 of it (3⅓ of 6), the rest is room for a retry after a failure."""
MIN_LIFETIME_S = round(
    RENEWAL_MARGIN * RATE_WINDOW_MS / 1000 / (RENEWALS_PER_HOUR * NODE_RENEW_FRACTION)
)
"""The shortest lifetime an attestor may ask for (1,800 s at 6 renewals an hour): a
node renewing every ``NODE_RENEW_FRACTION`` of a shorter leaf would use up the hour's
renewals and lose its identity, so a shorter cap is the attestor's failure."""
MAX_ROUNDS = 3
CLOCK_SKEW_MS = 60_000


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal: ``reason`` (without the attestor prefix) and the tenant to tell."""

    reason: str
    tenant_id: str | None = None


# --- the records the shells read ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolFacts:
    pool_id: str
    tenant_id: str
    site_id: str
    agent: str
    join_attestors: tuple[str, ...] | None
    """policy.joinAttestors when it is a list (the attestors the pool admits), else None."""
    platform_operated: bool
    """policy.kubernetes.platformOperated, and the platform's root tenant owns the pool."""


@dataclass(frozen=True, slots=True)
class NodeFacts:
    node_id: str
    tenant_id: str
    site_id: str
    pool_id: str
    role: str
    identity_generation: int
    retired: bool
    latest_statements: tuple[str, ...] | None
    """The statements of its latest certificate (None: it has none)."""
    max_lifetime_s: int | None = None
    """The lifetime cap its admitting attestor set, kept for its renewals."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """A join request as admission needs it."""

    request_id: str
    state: str
    csr_sha256: str
    pool_id: str | None
    usable: bool
    """Approved, unconsumed and unexpired at ``compute_now()``."""
    consumed: bool


@dataclass(frozen=True, slots=True)
class JoinSubject:
    """What the join request itself says, parsed once before the transaction."""

    attestor: str
    csr_sha256: str
    csr: x509.CertificateSigningRequest | None
    """The parsed CSR (P-256, self-signature valid), or None when it is not one."""
    claims: wire.Claims
    hw: hardware.HardwareKey
    request_round: int = 0
    node_id: str | None = None
    """The node id the request names (a re-join asks for its own id)."""


@dataclass(frozen=True, slots=True)
class Issue:
    """Admit: the node row to write (new, or ``existing`` reclaimed) and the leaf."""

    tenant_id: str
    site_id: str
    pool_id: str
    role: str
    hw: hardware.HardwareKey
    existing: NodeFacts | None
    consume_request: str | None
    max_lifetime_s: int | None


@dataclass(frozen=True, slots=True)
class AdmitApproved:
    """A deferred join whose approved request admits it now."""

    admit: Admit


@dataclass(frozen=True, slots=True)
class RecordPending:
    """Record (or refresh) the machine's pending join request."""

    tenant_id: str
    site_id: str


# --- lifetime ----------------------------------------------------------------------------


def lifetime_s(cert_ttl_s: int, role: str, cap_s: int | None = None) -> int:
    """A leaf's lifetime: JoinService's certTtlSeconds within the role's maximum (24 h,
    a ramdisk's 2 h), shortened, never lengthened, by the attestor's cap."""
    ttl = min(cert_ttl_s, RAMDISK_TTL_MAX_S if role == "ramdisk" else CERT_TTL_MAX_S)
    return ttl if cap_s is None else min(ttl, cap_s)


def valid_lifetime_cap(value: object) -> bool:
    """``Admit.max_lifetime_s``: None, or an int of at least :data:`MIN_LIFETIME_S`."""
    if value is None:
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= MIN_LIFETIME_S


# --- join ---------------------------------------------------------------------------------


def check_seal(
    seal: wire.OpenedSeal | None, seal_error: str | None, csr_sha256: str, now_ms: int
) -> Refusal | None:
    """The sealed token: it opened, it is bound to this CSR and fresh at ``now_ms``."""
    if seal_error:
        return Refusal(seal_error)
    if seal is not None:
        if seal.csr_sha256 != csr_sha256:
            return Refusal("seal-csr")
        if abs(seal.iat * 1000 - now_ms) > wire.SEAL_MAX_SKEW_S * 1000:
            return Refusal("seal-stale")
    return None


def check_challenge(subject: JoinSubject, verdict: Challenge) -> Refusal | None:
    """A challenge round the attestor asks for: the CSR parses and the round is valid."""
    if subject.csr is None:
        return Refusal("csr-invalid")
    valid = (
        isinstance(verdict.round, int)
        and subject.request_round < verdict.round <= MAX_ROUNDS
        and isinstance(verdict.challenge, dict)
        and isinstance(verdict.not_after_ms, int)
    )
    return None if valid else Refusal("plugin-error")


def judge_defer(
    subject: JoinSubject,
    defer: Defer,
    pool: PoolFacts | None,
    request: RequestFacts | None,
) -> Refusal | AdmitApproved | RecordPending:
    """A join request: admit an approved retry once, refuse a rejected or spent one,
    else record (or refresh) the pending request."""
    if subject.csr is None:
        return Refusal("csr-invalid")
    if pool is None:
        return Refusal("pool-unknown")
    tenant = pool.tenant_id
    if pool.join_attestors is not None and subject.attestor not in pool.join_attestors:
        return Refusal("pool-attestor", tenant)  # no request a person can't use
    if request is not None and request.state == "rejected":
        return Refusal("request-rejected", tenant)
    if request is not None and request.state == "approved":
        if defer.admit is not None and request.usable:
            return AdmitApproved(
                dataclasses.replace(defer.admit, join_request_id=request.request_id)
            )
        if request.consumed:
            return Refusal("request-consumed", tenant)
    return RecordPending(tenant, pool.site_id)


def screen(subject: JoinSubject, admit: Admit) -> Refusal | hardware.HardwareKey:
    """The Admit's own shape, the CSR, the expect and placeholder rules; the hardware
    key the rest of the judgement uses (the attestor's proven one, or the claims')."""
    tenant = admit.tenant_id
    hw = subject.hw
    if admit.hardware_key is not None:
        hw = hardware.HardwareKey(
            hex=admit.hardware_key,
            trusted=True,
            has_uuid_or_serial=True,
            kinds=frozenset({subject.attestor}),
        )
    if not isinstance(admit.allowed_kinds, tuple) or not all(
        valid_allowed_kind(k) for k in admit.allowed_kinds
    ):
        return Refusal("plugin-error", tenant)
    if not valid_lifetime_cap(admit.max_lifetime_s):
        return Refusal("plugin-error", tenant)
    if subject.csr is None:
        return Refusal("csr-invalid", tenant)
    if admit.expect and not hardware.expect_matches(dict(admit.expect), subject.claims):
        return Refusal("expect-mismatch", tenant)
    placeholder = hw.placeholder  # the node's rule too (bcd doctor shows it)
    if subject.attestor == JOIN_TOKEN and placeholder and not admit.expect:
        return Refusal("placeholder-hardware", tenant)
    if subject.attestor == JOIN_TOKEN and placeholder and hw.trusted:
        # admitted by its expect binding: the seed's untrusted key, never a reclaim key
        hw = dataclasses.replace(hw, trusted=False)
    return hw


def reclaim_lookup(admit: Admit, hw: hardware.HardwareKey) -> tuple[str, str] | None:
    """Which node this join may reclaim: ``("id", node id)`` for a re-join of exactly
    that node, ``("hardware", key)`` for a trusted hardware key (looked up within the
    Admit's tenant: another tenant's node claiming the same key can neither lock this
    machine out nor learn of it), else None."""
    if admit.node_id is not None:
        return ("id", admit.node_id)
    if hw.trusted and hw.hex is not None:
        return ("hardware", hw.hex)
    return None


def cert_role(admit: Admit, pool: PoolFacts | None) -> str:
    """``node-tenant`` for a hosted token unless the pool is platform-operated."""
    if admit.role != "node" or admit.hosted is None or pool is None:
        return admit.role
    return "node" if pool.platform_operated else "node-tenant"


def _same_statements(node: NodeFacts, admit: Admit) -> bool:
    return node.latest_statements is not None and sorted(node.latest_statements) == sorted(
        admit.statements
    )


def judge_admit(
    subject: JoinSubject,
    admit: Admit,
    hw: hardware.HardwareKey,
    existing: NodeFacts | None,
    pool: PoolFacts | None,
    approved: RequestFacts | None,
) -> Refusal | Issue:
    """The reclaim, pool, node-id and approval rules over the records read for ``admit``
    (``existing`` as :func:`reclaim_lookup` named it, ``approved`` for
    ``admit.join_request_id``)."""
    tenant = admit.tenant_id
    if admit.node_id is not None:  # a re-join of exactly this node (x509pop)
        if existing is None:
            return Refusal("reclaim", tenant)
        if not admit.statements and not _same_statements(existing, admit):
            # never downgrade a TPM-bound node to a bare key, whatever the attestor
            return Refusal("reclaim", tenant)
    role = cert_role(admit, pool)
    if existing is not None:
        same_home = (
            existing.tenant_id == tenant
            and existing.site_id == admit.site_id
            and existing.pool_id == admit.pool_id
            and existing.role in (admit.role, role)
        )
        may_reclaim = admit.allow_reclaim or admit.node_id is not None
        if not (may_reclaim and same_home) or existing.retired:
            return Refusal("reclaim", tenant)
        if admit.statements and not _same_statements(existing, admit):
            return Refusal("reclaim", tenant)
    if pool is None or pool.agent != "bcd":
        return Refusal("pool-agent", tenant)
    if pool.tenant_id != tenant or pool.site_id != admit.site_id:
        return Refusal("pool-tenant", tenant)
    if pool.join_attestors is not None and subject.attestor not in pool.join_attestors:
        return Refusal("pool-attestor", tenant)
    if subject.node_id is not None and (existing is None or existing.node_id != subject.node_id):
        return Refusal("node-id", tenant)
    if admit.join_request_id is not None and (
        approved is None
        or approved.csr_sha256 != subject.csr_sha256
        or approved.pool_id != admit.pool_id
        or not approved.usable
    ):
        return Refusal("request-not-approved", tenant)
    return Issue(
        tenant_id=tenant,
        site_id=admit.site_id,
        pool_id=admit.pool_id,
        role=role,
        hw=hw,
        existing=existing,
        consume_request=admit.join_request_id,
        max_lifetime_s=node_lifetime_cap(admit, existing),
    )


def node_lifetime_cap(admit: Admit, existing: NodeFacts | None) -> int | None:
    """The cap the node keeps. A re-join of exactly this node (``admit.node_id``,
    x509pop: it proves only the node's current identity) keeps the shorter of the
    node's cap and the admission's, a None on either side being no cap, so a node
    admitted for an hour cannot shed its cap by re-joining. A new node, or a reclaim
    by hardware key (the admitting attestor proved the machine afresh), takes the
    admission's cap as it is."""
    if admit.node_id is None or existing is None:
        return admit.max_lifetime_s
    caps = [c for c in (existing.max_lifetime_s, admit.max_lifetime_s) if c is not None]
    return min(caps) if caps else None


def clock_skewed(client_time_ms: int, now_ms: int) -> bool:
    """A signed ``client_time`` more than 60 s from ``compute_now()`` (renewal, vouch)."""
    return abs(client_time_ms - now_ms) > CLOCK_SKEW_MS


# --- renew ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CertFacts:
    """A node_certs row as renewal needs it."""

    serial: str
    node_id: str
    identity_generation: int
    role: str
    allowed_kinds: tuple[str, ...]
    not_after_ms: int
    revoked: bool


def judge_renew_leaf(
    leaf: CertFacts,
    node: NodeFacts | None,
    peer: CertFacts | None,
    client_time_ms: int,
    now_ms: int,
) -> Refusal | None:
    """Steps 1 to 4 of Renew: the presented leaf (re-read under the node's lock), its
    node, the caller's certificate, the client's clock."""
    if leaf.revoked:
        return Refusal("leaf-revoked")
    if now_ms > leaf.not_after_ms:
        return Refusal("leaf-expired")
    if node is None or node.retired:
        return Refusal("node-retired")
    if leaf.identity_generation != node.identity_generation:
        return Refusal("generation")
    if peer is None or peer.node_id != leaf.node_id or peer.revoked:
        return Refusal("identity-mismatch")
    if clock_skewed(client_time_ms, now_ms):
        return Refusal("clock-skew")
    return None


def judge_renew_proof(
    proof_fresh: bool, pop_ok: bool, csr: x509.CertificateSigningRequest | None, tenant_id: str
) -> Refusal | None:
    """Step 5 and the CSR of step 6: an unspent proof that verifies, a CSR that parses
    (from the CSR on, the caller proved the current key: the node's tenant hears)."""
    if not proof_fresh:
        return Refusal("pop-replay")
    if not pop_ok:
        return Refusal("pop-invalid")
    if csr is None:
        return Refusal("csr-invalid", tenant_id)
    return None

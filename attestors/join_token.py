"""The join-token attestor: both halves, registered through ``bcd.attestors``.

Node half: seal the bearer token to the JoinService encryption key, bound to the
CSR (PROTOCOL.md "Sealed token"). Server half, inside the join transaction and in
the seed's order: lock the token row, check the secret in constant time, then
revocation, expiry at ``compute_now()``, uses left and role, and consume one use.
"""

from __future__ import annotations

from bcd import wire
from bcd.attestor_api import (
    JOIN_TOKEN,
    Admit,
    NodeEvidence,
    NodeJoinContext,
    Refuse,
    ServerJoinContext,
    Verdict,
    hookimpl,
)
from bcd.errors import CredentialError


@hookimpl
def bcd_attestor_names() -> list[str]:
    return [JOIN_TOKEN]


@hookimpl
def bcd_node_evidence(attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
    if attestor != JOIN_TOKEN:
        return None
    if ctx.credential is None:
        raise CredentialError("a join token is needed: on standard input or with --token-file")
    if ctx.encryption_key is None:
        raise CredentialError("no join encryption key to seal the token to")
    try:
        token = wire.parse_token(ctx.credential)
    except wire.WireError as exc:
        raise CredentialError("the join credential is not a join token (bcjt_…)") from exc
    sealed = wire.seal_token(token, ctx.encryption_key, ctx.csr_der, ctx.now_s)
    return NodeEvidence(sealed_token=sealed, evidence={})


@hookimpl
def bcd_server_verify(
    attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
) -> Verdict | None:
    if attestor != JOIN_TOKEN:
        return None
    if ctx.seal is None:
        return Refuse("token-malformed")
    token = ctx.seal.token
    record = ctx.lock_join_token(token.token_id)
    if record is None:
        return Refuse("token-unknown")
    if not wire.secret_matches(token.secret, record.secret_sha256):
        return Refuse("token-secret")
    tenant = record.tenant_id
    if record.revoked:
        return Refuse("token-revoked", tenant)
    if record.expires_at_ms <= ctx.now_ms:
        return Refuse("token-expired", tenant)
    if record.uses_left <= 0:
        return Refuse("token-used-up", tenant)
    if record.role != request.role:
        return Refuse("token-role", tenant)
    ctx.consume_join_token(record.token_id)
    return Admit(
        tenant_id=tenant,
        pool_id=record.pool_id,
        site_id=record.site_id,
        role=record.role,
        expect=record.expect,
        allow_reclaim=record.allow_reclaim,
        hosted=record.hosted,
        credential_id=record.token_id,
    )

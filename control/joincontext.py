"""The ServerJoinContext JoinService lends an attestor's server half.

What an attestor may read and write inside the join transaction, as the records of
:mod:`bcd.attestor_api` (pools, nodes, node certificates, join tokens, challenges,
vouches and join requests); the SQL behind them is here and in :mod:`control.repos`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bcd import wire
from bcd.attestor_api import (
    ChallengeRecord,
    JoinRequestRecord,
    NodeCertRecord,
    NodeRecord,
    PoolRecord,
    TokenRecord,
    VouchRecord,
)
from control import discovery, joinrequests, repos
from control.ids import new_id
from control.store import Tx

CHALLENGE_KEEP_MS = 3_600_000  # challenge rows are pruned an hour after their not_after


class JoinContext:
    """The ServerJoinContext lent to an attestor's server half."""

    def __init__(
        self,
        tx: Tx,
        seal: wire.OpenedSeal | None,
        attestor: str,
        settings: Mapping[str, str],
        csr_sha256: str,
        peer_ip: str | None = None,
    ) -> None:
        self._tx = tx
        self._attestor = attestor
        self._csr_sha256 = csr_sha256
        self.now_ms = tx.now_ms()
        self.seal = seal
        self.settings = settings
        self.peer_ip = peer_ip

    def lookup_pool(self, pool_id: str) -> PoolRecord | None:
        row = repos.pool_row(self._tx, pool_id)
        if row is None:
            return None
        return PoolRecord(
            pool_id=row["id"],
            tenant_id=row["tenant_id"],
            site_id=row["site_id"],
            agent=row["agent"],
        )

    def save_challenge(
        self,
        *,
        secret_sha256: str,
        ak_name: str,
        ek_sha256: str,
        csr_sha256: str,
        not_after_ms: int,
    ) -> str:
        self._tx.execute(
            "DELETE FROM join_challenges WHERE not_after < ?", (self.now_ms - CHALLENGE_KEEP_MS,)
        )
        challenge_id = new_id("jc")
        self._tx.execute(
            "INSERT INTO join_challenges (id, attestor, secret_sha256, ak_name, ek_sha256, "
            "csr_sha256, not_after, used_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)",
            (
                challenge_id,
                self._attestor,
                secret_sha256,
                ak_name,
                ek_sha256,
                csr_sha256,
                not_after_ms,
                self.now_ms,
            ),
        )
        return challenge_id

    def lock_challenge(self, challenge_id: str) -> ChallengeRecord | None:
        row = self._tx.one(
            "SELECT * FROM join_challenges WHERE id = ? AND attestor = ?" + self._tx.for_update,
            (challenge_id, self._attestor),
        )
        if row is None:
            return None
        return ChallengeRecord(
            challenge_id=row["id"],
            attestor=row["attestor"],
            secret_sha256=row["secret_sha256"],
            ak_name=row["ak_name"],
            ek_sha256=row["ek_sha256"],
            csr_sha256=row["csr_sha256"],
            not_after_ms=int(row["not_after"]),
            used=row["used_at"] is not None,
        )

    def consume_challenge(self, challenge_id: str) -> None:
        changed = self._tx.execute(
            "UPDATE join_challenges SET used_at = ? WHERE id = ? AND used_at IS NULL",
            (self.now_ms, challenge_id),
        )
        repos.consumed_or_conflict(changed)

    def lookup_node_by_hardware_key(
        self, hardware_key: str, tenant_id: str | None = None
    ) -> NodeRecord | None:
        sql = "SELECT * FROM nodes WHERE hardware_key = ? AND hardware_key_trusted = 1"
        params: list[Any] = [hardware_key]
        if tenant_id is not None:
            sql += " AND tenant_id = ?"
            params.append(tenant_id)
        row = self._tx.one(sql + " ORDER BY created_at, id LIMIT 1", params)
        if row is None:
            return None
        return NodeRecord(
            node_id=row["id"],
            tenant_id=row["tenant_id"],
            site_id=row["site_id"],
            pool_id=row["pool_id"],
            role=row["role"],
            identity_generation=int(row["identity_generation"]),
            retired=row["retired_at"] is not None,
        )

    def lookup_vouch(self, site_id: str, mac: str) -> VouchRecord | None:
        return discovery.lock_vouch(self._tx, site_id, mac)

    def consume_vouch(self, vouch_id: str) -> None:
        discovery.consume_vouch(self._tx, vouch_id)

    def lookup_join_request(self, machine_key: str) -> JoinRequestRecord | None:
        row = joinrequests.lock_for_csr(self._tx, self._attestor, machine_key, self._csr_sha256)
        return None if row is None else joinrequests.as_record(row, self.now_ms)

    def lookup_node_cert(self, der: bytes) -> NodeCertRecord | None:
        row = repos.cert_row(self._tx, der)
        if row is None:
            return None
        node = self._tx.one("SELECT * FROM nodes WHERE id = ?", (row["node_id"],))
        if node is None:
            return None
        later = self._tx.one(
            "SELECT serial FROM node_certs WHERE node_id = ? AND serial <> ? AND "
            "(created_at > ? OR not_after > ?) LIMIT 1",
            (row["node_id"], row["serial"], row["created_at"], row["not_after"]),
        )
        return NodeCertRecord(
            serial=str(row["serial"]),
            node_id=str(node["id"]),
            tenant_id=str(node["tenant_id"]),
            site_id=str(node["site_id"]),
            pool_id=str(node["pool_id"]),
            role=str(row["role"]),
            node_role=str(node["role"]),
            identity_generation=int(row["identity_generation"]),
            node_generation=int(node["identity_generation"]),
            statements=tuple(json.loads(row["statements"])),
            allowed_kinds=tuple(json.loads(row["allowed_kinds"])),
            not_after_ms=int(row["not_after"]),
            spki_sha256=str(row["spki_sha256"]),
            revoked=row["revoked_at"] is not None,
            node_retired=node["retired_at"] is not None,
            newest=later is None,
        )

    def lock_join_token(self, token_id: str) -> TokenRecord | None:
        row = self._tx.one(
            "SELECT * FROM join_tokens WHERE id = ?" + self._tx.for_update, (token_id,)
        )
        if row is None:
            return None
        return TokenRecord(
            token_id=row["id"],
            tenant_id=row["tenant_id"],
            pool_id=row["pool_id"],
            site_id=row["site_id"],
            role=row["role"],
            secret_sha256=row["secret_sha256"],
            uses_left=int(row["uses_left"]),
            expires_at_ms=int(row["expires_at"]),
            revoked=row["revoked_at"] is not None,
            expect=json.loads(row["expect"]),
            allow_reclaim=bool(row["allow_reclaim"]),
            hosted=row["hosted"],
        )

    def consume_join_token(self, token_id: str) -> None:
        changed = self._tx.execute(
            "UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ? AND uses_left > 0",
            (token_id,),
        )
        repos.consumed_or_conflict(changed)

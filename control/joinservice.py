"""JoinService.Join: one database transaction, in the seed's order.

1. open the seal (typ, kid, CSR binding, iat window) — the attestor's server half
   then locks the token row, checks the secret in constant time, revocation, expiry
   at ``compute_now()``, uses left and role, and consumes one use;
2. ``expect`` (a mismatch consumes nothing: every refusal rolls the transaction
   back), the placeholder-hardware rule, the reclaim rules, the pool (runs bcd,
   belongs to the token's tenant, lists the attestor when its policy says which);
3. the node row (``adopting``, identity generation 1, or the reclaimed node with
   its generation raised), ``node.joined`` event and audit row, the certificate
   recorded as a node_certs row, the signed response.

Every refusal leaves as the same ``ACCESS_DENIED`` / ``Join refused``; its reason
goes only to a ``security.join.refused`` event, written after the rollback.

An attestor may instead answer a :class:`~bcd.plugins.Challenge` (the tpm attestor's
credential activation): the signed ``challenge`` body, nothing issued or consumed,
the transaction committed with whatever the attestor stored (``join_challenges``).
Or a :class:`~bcd.plugins.Defer`: a join request (:mod:`control.joinrequests`)
recorded or refreshed and a signed ``pending`` body; an approved request admits one
join with its CSR, consumed inside that join's transaction.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import hardware, pki, wire
from bcd.plugins import (
    JOIN_TOKEN,
    Admit,
    Challenge,
    ChallengeRecord,
    Defer,
    JoinRequestRecord,
    NodeCertRecord,
    NodeRecord,
    Plugins,
    PoolRecord,
    Refuse,
    TokenRecord,
    VouchRecord,
    canonical_name,
    valid_allowed_kind,
    wire_name,
)
from control import discovery, events, joinrequests, tenancy
from control.errors import ControlError, Refused, StoreConflict, invalid
from control.ids import new_id
from control.store import Store, Tx

log = logging.getLogger("control.joinservice")

JOIN_REFUSED = "Join refused"
CONCURRENT = "This machine joined concurrently; retry"
CERT_TTL_MAX_S = 86_400
RAMDISK_TTL_MAX_S = 7_200
MAX_ROUNDS = 3
REANSWER_MS = 600_000
"""How long a join whose answer was lost may ask again with the same CSR (the agent's
retries with backoff fit well inside)."""
CHALLENGE_KEEP_MS = 3_600_000  # challenge rows are pruned an hour after their not_after

IssueLeaf = Callable[
    [ec.EllipticCurvePublicKey, pki.SpiffeId, str, tuple[str, ...], datetime, int],
    x509.Certificate,
]


@dataclass(frozen=True)  # not slots: the cached properties need a __dict__
class JoinCrypto:
    """pkiJoinCrypto: what JoinService needs of the PKI (the seed's ``pki.join``)."""

    trust_domain: str
    signing_key: ec.EllipticCurvePrivateKey
    encryption_key: ec.EllipticCurvePrivateKey
    issue_leaf: IssueLeaf
    chain_tail_pem: str
    bundle_pem: str
    trust_version: int
    cert_ttl_s: int = CERT_TTL_MAX_S

    @functools.cached_property
    def encryption_pin(self) -> str:
        return pki.spki_pin(self.encryption_key.public_key())

    @functools.cached_property
    def decryption_jwk(self) -> Any:
        return wire.decryption_jwk(self.encryption_key)


class _Ctx:
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
        row = self._tx.one("SELECT * FROM pools WHERE id = ?", (pool_id,))
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
        if changed != 1:  # pragma: no cover - the row is locked and was checked
            raise ControlError("CONFLICT", CONCURRENT)

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
        try:
            serial = format(x509.load_der_x509_certificate(der).serial_number, "x")
        except (ValueError, x509.InvalidVersion):
            return None
        row = self._tx.one("SELECT * FROM node_certs WHERE serial = ?", (serial,))
        if row is None or base64.b64decode(row["der"]) != der:
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
        if changed != 1:  # pragma: no cover - the row is locked and was checked
            raise ControlError("CONFLICT", CONCURRENT)


@dataclass(frozen=True)
class _Attempt:
    request: wire.JoinRequest
    attestor: str
    csr_sha256: str
    hw: hardware.HardwareKey
    seal: wire.OpenedSeal | None
    seal_error: str | None
    peer_ip: str | None = None


class JoinService:
    def __init__(
        self,
        store: Store,
        crypto: JoinCrypto | None,
        plugins: Plugins,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.store = store
        self.crypto = crypto
        self.plugins = plugins
        self.settings: Mapping[str, str] = dict(settings or {})

    def join(self, body: bytes, peer_ip: str | None = None) -> str:
        """Judge one JoinRequest body; return the SignedResponse or raise ControlError.

        ``peer_ip`` is the address the gateway saw the request come from (None when
        there is none, e.g. in process); attestors may compare it (discovery)."""
        crypto = self.crypto
        if crypto is None:
            raise ControlError("INVALID_CONFIG", "JoinService has no pki.join configuration")
        try:
            request = wire.parse_join_request(wire.loads_object(body))
        except wire.WireError as exc:
            raise invalid(f"malformed join request: {exc}") from exc
        attempt = dataclasses.replace(self._prepare(request, crypto), peer_ip=peer_ip)
        for last in (False, True):
            try:
                with self.store.tx() as tx:
                    return self._admit(tx, attempt, crypto)
            except Refused as refusal:
                self._record_refusal(attempt, refusal)
                raise
            except StoreConflict as exc:
                # A concurrent join of the same machine committed first: judge again,
                # now seeing it, so the loser is answered as it would be after it (a
                # reclaim, refused without allow_reclaim) on both stores alike.
                if last:
                    raise ControlError("CONFLICT", CONCURRENT) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # --- steps ------------------------------------------------------------------

    def _prepare(self, request: wire.JoinRequest, crypto: JoinCrypto) -> _Attempt:
        seal, seal_error = None, None
        if request.sealed_token is not None:
            try:
                seal = wire.open_seal(
                    request.sealed_token, crypto.decryption_jwk, crypto.encryption_pin
                )
            except wire.NotAToken:
                seal_error = "token-malformed"
            except wire.WireError:
                seal_error = "seal-invalid"
        return _Attempt(
            request=request,
            attestor=canonical_name(request.attestor),
            csr_sha256=pki.sha256_hex(request.csr_der),
            hw=hardware.hardware_key(request.claims),
            seal=seal,
            seal_error=seal_error,
        )

    def _label(self, attempt: _Attempt) -> str:
        """The attestor as events name it: a loaded plugin's name, else ``unknown``, so
        inventing names neither multiplies the refusal budget nor writes their text."""
        return attempt.attestor if attempt.attestor in self.plugins.names() else UNKNOWN_ATTESTOR

    def _refuse(self, attempt: _Attempt, reason: str, tenant_id: str | None = None) -> Refused:
        return Refused(JOIN_REFUSED, f"{self._label(attempt)}:{reason}", tenant_id)

    def _admit(self, tx: Tx, attempt: _Attempt, crypto: JoinCrypto) -> str:
        request = attempt.request
        now_ms = tx.now_ms()
        if attempt.seal_error:
            raise self._refuse(attempt, attempt.seal_error)
        if attempt.seal is not None:
            if attempt.seal.csr_sha256 != attempt.csr_sha256:
                raise self._refuse(attempt, "seal-csr")
            if abs(attempt.seal.iat * 1000 - now_ms) > wire.SEAL_MAX_SKEW_S * 1000:
                raise self._refuse(attempt, "seal-stale")
        answered = self._answered_before(tx, attempt, crypto)
        if answered is not None:
            return answered
        if attempt.attestor not in self.plugins.names():
            raise self._refuse(attempt, "attestor-unknown")
        ctx = _Ctx(
            tx,
            attempt.seal,
            attempt.attestor,
            self.settings,
            attempt.csr_sha256,
            attempt.peer_ip,
        )
        try:
            verdict = self.plugins.server_verify(attempt.attestor, request, ctx)
        except (ControlError, StoreConflict):
            raise
        except Exception:
            log.exception("attestor %s failed", attempt.attestor)
            raise self._refuse(attempt, "plugin-error") from None
        if verdict is None:
            raise self._refuse(attempt, "attestor-unknown")
        if isinstance(verdict, Refuse):
            raise self._refuse(attempt, verdict.reason, verdict.tenant_id)
        if isinstance(verdict, Challenge):
            return self._challenge(attempt, verdict, crypto)
        if isinstance(verdict, Defer):
            return self._defer(tx, attempt, verdict, crypto)
        if not isinstance(verdict, Admit):  # a plugin breaking the contract
            log.error("attestor %s returned %s, not a verdict", attempt.attestor, type(verdict))
            raise self._refuse(attempt, "plugin-error")
        return self._issue(tx, attempt, verdict, crypto)

    def _answered_before(self, tx: Tx, attempt: _Attempt, crypto: JoinCrypto) -> str | None:
        """The same identity again for a join whose answer was lost (None otherwise).

        The CSR's key already has a live certificate, recorded less than
        :data:`REANSWER_MS` ago, of its node's current generation: this CSR was
        admitted, and the join committed, but the agent never stored the answer (a
        dropped connection) and sent its request again. Answering again issues and
        consumes nothing (a token's use, an approval or an x509pop challenge was spent
        once), and the answer is of use only to whoever holds the CSR's key.
        """
        try:
            key = pki.csr_public_key(pki.parse_csr(attempt.request.csr_der))
        except pki.PkiError:
            return None
        row = tx.one(
            "SELECT c.der, c.role, c.identity_generation FROM node_certs c "
            "JOIN nodes n ON n.id = c.node_id WHERE c.spki_sha256 = ? "
            "AND c.revoked_at IS NULL AND c.created_at > ? AND c.not_after > ? "
            "AND n.retired_at IS NULL AND n.identity_generation = c.identity_generation "
            "AND n.attestor = ? ORDER BY c.created_at DESC LIMIT 1",
            (
                pki.sha256_hex(pki.spki_der(key)),
                tx.now_ms() - REANSWER_MS,
                tx.now_ms(),
                attempt.attestor,
            ),
        )
        if row is None:
            return None
        leaf = x509.load_der_x509_certificate(base64.b64decode(row["der"]))
        spiffe = pki.leaf_info(leaf).spiffe
        log.info("join of %s answered again (its answer was lost)", spiffe.node_id)
        return signed_identity(
            crypto,
            "joined",
            spiffe,
            str(row["role"]),
            leaf,
            attempt.csr_sha256,
            tx.now_ms(),
            int(row["identity_generation"]),
        )

    def _defer(self, tx: Tx, attempt: _Attempt, defer: Defer, crypto: JoinCrypto) -> str:
        """A join request: admit an approved retry once, refuse a rejected one, else
        record (or refresh) the pending request and answer a signed ``pending`` body."""
        try:
            pki.parse_csr(attempt.request.csr_der)
        except pki.PkiError:
            raise self._refuse(attempt, "csr-invalid") from None
        pool = tx.one("SELECT * FROM pools WHERE id = ?", (defer.pool_id,))
        if pool is None:
            raise self._refuse(attempt, "pool-unknown")
        tenant = str(pool["tenant_id"])
        allowed = json.loads(pool["policy"]).get("joinAttestors")
        if isinstance(allowed, list) and attempt.attestor not in allowed:
            raise self._refuse(attempt, "pool-attestor", tenant)  # no request a person can't use
        row = joinrequests.lock_for_csr(tx, attempt.attestor, defer.machine_key, attempt.csr_sha256)
        if row is not None and row["state"] == "rejected":
            raise self._refuse(attempt, "request-rejected", tenant)
        if row is not None and row["state"] == "approved":
            if defer.admit is not None and joinrequests.usable(row, tx.now_ms()):
                admit = dataclasses.replace(defer.admit, join_request_id=str(row["id"]))
                return self._issue(tx, attempt, admit, crypto)
            if row["consumed_at"] is not None:
                raise self._refuse(attempt, "request-consumed", tenant)
        request_id = joinrequests.record_pending(
            tx,
            tenant_id=tenant,
            site_id=str(pool["site_id"]),
            attestor=attempt.attestor,
            defer=defer,
            claims=attempt.request.claims.to_json(),
            csr_sha256=attempt.csr_sha256,
            source_ip=attempt.peer_ip,
        )
        retry = defer.retry_after_s if isinstance(defer.retry_after_s, int) else 5
        body = {
            "kind": "pending",
            "attestor": wire_name(attempt.attestor),
            "request_id": request_id,
            "retry_after_s": max(1, retry),
        }
        return wire.sign_response(body, crypto.signing_key)

    def _challenge(self, attempt: _Attempt, verdict: Challenge, crypto: JoinCrypto) -> str:
        """A JoinChallenge: the signed ``challenge`` body; nothing issued, nothing consumed."""
        try:
            pki.parse_csr(attempt.request.csr_der)
        except pki.PkiError:
            raise self._refuse(attempt, "csr-invalid") from None
        valid = (
            isinstance(verdict.round, int)
            and attempt.request.round < verdict.round <= MAX_ROUNDS
            and isinstance(verdict.challenge, dict)
            and isinstance(verdict.not_after_ms, int)
        )
        if not valid:
            log.error("attestor %s answered an invalid challenge", attempt.attestor)
            raise self._refuse(attempt, "plugin-error")
        body = {
            "kind": "challenge",
            "attestor": wire_name(attempt.attestor),
            "round": verdict.round,
            "challenge": verdict.challenge,
            "not_after": verdict.not_after_ms,
        }
        return wire.sign_response(body, crypto.signing_key)

    def _issue(self, tx: Tx, attempt: _Attempt, admit: Admit, crypto: JoinCrypto) -> str:
        request, hw, tenant = attempt.request, attempt.hw, admit.tenant_id
        if admit.hardware_key is not None:
            hw = hardware.HardwareKey(
                hex=admit.hardware_key,
                trusted=True,
                has_uuid_or_serial=True,
                kinds=frozenset({attempt.attestor}),
            )
        if not isinstance(admit.allowed_kinds, tuple) or not all(
            valid_allowed_kind(k) for k in admit.allowed_kinds
        ):
            log.error("attestor %s admitted with malformed allowed kinds", attempt.attestor)
            raise self._refuse(attempt, "plugin-error", tenant)
        try:
            csr = pki.parse_csr(request.csr_der)
        except pki.PkiError:
            raise self._refuse(attempt, "csr-invalid", tenant) from None
        if admit.expect and not hardware.expect_matches(dict(admit.expect), request.claims):
            raise self._refuse(attempt, "expect-mismatch", tenant)
        placeholder = hw.hex is None or not hw.trusted or not hw.has_uuid_or_serial
        if attempt.attestor == JOIN_TOKEN and placeholder and not admit.expect:
            raise self._refuse(attempt, "placeholder-hardware", tenant)
        if attempt.attestor == JOIN_TOKEN and placeholder and hw.trusted:
            # admitted by its expect binding: the seed's untrusted key, never a reclaim key
            hw = dataclasses.replace(hw, trusted=False)
        existing = None
        if admit.node_id is not None:  # a re-join of exactly this node (x509pop)
            existing = tx.one("SELECT * FROM nodes WHERE id = ?" + tx.for_update, (admit.node_id,))
            if existing is None:
                raise self._refuse(attempt, "reclaim", tenant)
            if not admit.statements and not _latest_statements_are(tx, existing["id"], admit):
                # never downgrade a TPM-bound node to a bare key, whatever the attestor
                raise self._refuse(attempt, "reclaim", tenant)
        elif hw.trusted and hw.hex is not None:
            # judged within the tenant: another tenant's node claiming the same key can
            # neither lock this machine out nor learn of it (docs/decisions.md)
            existing = tx.one(
                "SELECT * FROM nodes WHERE hardware_key = ? AND hardware_key_trusted = 1 "
                "AND tenant_id = ?" + tx.for_update,
                (hw.hex, tenant),
            )
        pool = tx.one("SELECT * FROM pools WHERE id = ?", (admit.pool_id,))
        role = self._cert_role(tx, admit, pool)
        if existing is not None:
            same_home = (
                existing["tenant_id"] == tenant
                and existing["site_id"] == admit.site_id
                and existing["pool_id"] == admit.pool_id
                and existing["role"] in (admit.role, role)
            )
            may_reclaim = admit.allow_reclaim or admit.node_id is not None
            if not (may_reclaim and same_home) or existing["retired_at"] is not None:
                raise self._refuse(attempt, "reclaim", tenant)
            if admit.statements and not _latest_statements_are(tx, existing["id"], admit):
                raise self._refuse(attempt, "reclaim", tenant)
        if pool is None or pool["agent"] != "bcd":
            raise self._refuse(attempt, "pool-agent", tenant)
        if pool["tenant_id"] != tenant or pool["site_id"] != admit.site_id:
            raise self._refuse(attempt, "pool-tenant", tenant)
        policy = json.loads(pool["policy"])
        allowed = policy.get("joinAttestors")
        if isinstance(allowed, list) and attempt.attestor not in allowed:
            raise self._refuse(attempt, "pool-attestor", tenant)
        if request.node_id is not None and (existing is None or existing["id"] != request.node_id):
            raise self._refuse(attempt, "node-id", tenant)
        if admit.join_request_id is not None:
            approved = tx.one(
                "SELECT * FROM join_requests WHERE id = ? AND attestor = ?" + tx.for_update,
                (admit.join_request_id, attempt.attestor),
            )
            if (
                approved is None
                or approved["csr_sha256"] != attempt.csr_sha256
                or approved["pool_id"] != admit.pool_id
                or not joinrequests.usable(approved, tx.now_ms())
            ):
                raise self._refuse(attempt, "request-not-approved", tenant)
            joinrequests.consume(tx, admit.join_request_id)
        now_ms = tx.now_ms()
        if existing is None:
            node_id = new_id("node")
            generation = 1
            tx.execute(
                "INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, "
                "identity_generation, hardware_key, hardware_key_trusted, claims, attestor, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'adopting', 1, ?, ?, ?, ?, ?, ?)",
                (
                    node_id,
                    tenant,
                    admit.site_id,
                    admit.pool_id,
                    role,
                    hw.hex,
                    1 if hw.trusted else 0,
                    json.dumps(request.claims.to_json(), sort_keys=True),
                    attempt.attestor,
                    now_ms,
                    now_ms,
                ),
            )
        else:
            node_id = str(existing["id"])
            generation = int(existing["identity_generation"]) + 1
            tx.execute(
                "UPDATE nodes SET identity_generation = ?, state = 'adopting', role = ?, "
                "claims = ?, attestor = ?, updated_at = ? WHERE id = ?",
                (
                    generation,
                    role,
                    json.dumps(request.claims.to_json(), sort_keys=True),
                    attempt.attestor,
                    now_ms,
                    node_id,
                ),
            )
            revoke_node_certs(
                tx,
                tenant,
                node_id,
                "rejoined" if admit.node_id is not None else "reclaimed",
                notice_signer(crypto.signing_key),
            )
        spiffe = pki.SpiffeId(crypto.trust_domain, admit.site_id, node_id)
        leaf, info = issue_recorded_leaf(
            tx,
            crypto,
            pki.csr_public_key(csr),
            spiffe,
            role,
            admit.statements,
            admit.allowed_kinds,
            generation,
        )
        reclaim = existing is not None
        payload = {
            "nodeId": node_id,
            "attestor": attempt.attestor,
            "reclaim": reclaim,
            "hardwareKeyTrusted": hw.trusted,
            "certSerial": info.serial_hex,
            "nodeKey": admit.node_key,
            "poolId": admit.pool_id,
            "siteId": admit.site_id,
        }
        if admit.join_request_id is not None:
            payload["joinRequestId"] = admit.join_request_id
        if admit.node_id is not None:
            payload["rejoin"] = True
        events.publish(tx, tenant, "node.joined", payload)
        events.audit(tx, tenant, "node.reclaimed" if reclaim else "node.joined", node_id, payload)
        if hw.trusted and hw.hex is not None:
            _report_shared_key(tx, tenant, node_id, hw.hex)
        return signed_identity(
            crypto, "joined", spiffe, role, leaf, attempt.csr_sha256, now_ms, generation
        )

    def _cert_role(self, tx: Tx, admit: Admit, pool: Mapping[str, Any] | None) -> str:
        """``node-tenant`` for a hosted token unless the pool is platform-operated."""
        if admit.role != "node" or admit.hosted is None or pool is None:
            return admit.role
        return "node" if platform_operated(tx, pool) else "node-tenant"

    def _record_refusal(self, attempt: _Attempt, refusal: Refused) -> None:
        record_refusal(
            self.store,
            refusal,
            "security.join.refused",
            f"join|{refusal.reason}",
            {
                "attestor": self._label(attempt),
                "reason": refusal.reason,
                "role": attempt.request.role,
                "csrSha256": attempt.csr_sha256,
                "hardwareKey": attempt.hw.hex,
            },
        )


def _latest_statements_are(tx: Tx, node_id: str, admit: Admit) -> bool:
    """Whether the node's latest certificate carries exactly ``admit.statements``."""
    row = tx.one(
        "SELECT statements FROM node_certs WHERE node_id = ? "
        "ORDER BY identity_generation DESC, created_at DESC LIMIT 1",
        (node_id,),
    )
    return row is not None and sorted(json.loads(row["statements"])) == sorted(admit.statements)


def platform_operated(tx: Tx, pool: Mapping[str, Any]) -> bool:
    """policy.kubernetes.platformOperated, and the platform owns the pool (seed)."""
    policy = json.loads(pool["policy"])
    kube = policy.get("kubernetes")
    if not isinstance(kube, dict) or kube.get("platformOperated") is not True:
        return False
    site = tx.one("SELECT tenant_id, custom FROM sites WHERE id = ?", (pool["site_id"],))
    if site is None or site["custom"] or site["tenant_id"] != pool["tenant_id"]:
        return False
    root = tenancy.root_tenant(tx)
    return root is None or root == pool["tenant_id"]


def _report_shared_key(tx: Tx, tenant: str, node_id: str, hardware_key: str) -> None:
    """Tell the root tenant (never either tenant) when live nodes of other tenants
    claim the same trusted hardware key: one of them copied the other's identifiers."""
    others = tx.query(
        "SELECT id, tenant_id FROM nodes WHERE hardware_key = ? AND hardware_key_trusted = 1 "
        "AND tenant_id <> ? AND retired_at IS NULL ORDER BY created_at, id LIMIT 10",
        (hardware_key, tenant),
    )
    root = tenancy.root_tenant(tx) if others else None
    if root is None:
        return
    events.publish(
        tx,
        root,
        "security.hardware-key.shared",
        {
            "hardwareKey": hardware_key,
            "nodeId": node_id,
            "tenantId": tenant,
            "others": [{"nodeId": r["id"], "tenantId": r["tenant_id"]} for r in others],
        },
    )


NoticeSigner = Callable[[dict[str, Any]], str]
"""Signs a RevocationNotice body (bcd.wire.revocation_notice_body) under the join-signing key."""


def notice_signer(signing_key: ec.EllipticCurvePrivateKey) -> NoticeSigner:
    return lambda body: wire.sign_response(body, signing_key)


def revoke_node_certs(
    tx: Tx, tenant_id: str, node_id: str, reason: str, sign_notice: NoticeSigner
) -> list[str]:
    """Revoke every live certificate of a node, with a security.certificate-revoked event each.

    Each revocation stores its signed RevocationNotice (``revoke_notice``), made here,
    where the join-signing key is: the gateways push it as it is, and bcd believes
    only a notice that verifies under its pin. Returns the serials it revoked (none
    when every certificate already was).
    """
    rows = tx.query(
        "SELECT serial FROM node_certs WHERE node_id = ? AND revoked_at IS NULL ORDER BY serial",
        (node_id,),
    )
    tx.revoked = tx.revoked or bool(rows)
    for row in rows:
        now_ms = tx.now_ms()
        notice = sign_notice(wire.revocation_notice_body(node_id, row["serial"], reason, now_ms))
        tx.execute(
            "UPDATE node_certs SET revoked_at = ?, revoke_reason = ?, revoke_notice = ? "
            "WHERE serial = ?",
            (now_ms, reason, notice, row["serial"]),
        )
        events.publish(
            tx,
            tenant_id,
            "security.certificate-revoked",
            {"nodeId": node_id, "serial": row["serial"], "reason": reason},
        )
    return [str(row["serial"]) for row in rows]


# --- shared with renewal (control.renewal) --------------------------------------------


def leaf_ttl_s(crypto: JoinCrypto, role: str) -> int:
    return min(crypto.cert_ttl_s, RAMDISK_TTL_MAX_S if role == "ramdisk" else CERT_TTL_MAX_S)


def issue_recorded_leaf(
    tx: Tx,
    crypto: JoinCrypto,
    public_key: ec.EllipticCurvePublicKey,
    spiffe: pki.SpiffeId,
    role: str,
    statements: Sequence[str],
    allowed_kinds: Sequence[str],
    generation: int,
) -> tuple[x509.Certificate, pki.LeafInfo]:
    """Issue a node leaf valid from ``compute_now()`` and record it as a node_certs row."""
    now_ms = tx.now_ms()
    now = datetime.fromtimestamp(now_ms / 1000, UTC)
    leaf = crypto.issue_leaf(
        public_key, spiffe, role, tuple(statements), now, leaf_ttl_s(crypto, role)
    )
    info = pki.leaf_info(leaf)
    der = leaf.public_bytes(serialization.Encoding.DER)
    tx.execute(
        "INSERT INTO node_certs (serial, node_id, identity_generation, role, spki_sha256, der, "
        "statements, allowed_kinds, not_before, not_after, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            info.serial_hex,
            spiffe.node_id,
            generation,
            role,
            info.spki_sha256,
            base64.b64encode(der).decode("ascii"),
            json.dumps(list(info.statements)),
            json.dumps(list(allowed_kinds)),
            int(info.not_before.timestamp() * 1000),
            int(info.not_after.timestamp() * 1000),
            now_ms,
        ),
    )
    return leaf, info


def signed_identity(
    crypto: JoinCrypto,
    kind: str,
    spiffe: pki.SpiffeId,
    role: str,
    leaf: x509.Certificate,
    csr_sha256: str,
    server_time_ms: int,
    generation: int,
) -> str:
    """The SignedResponse of a ``joined`` or ``renewed`` answer."""
    body = {
        "kind": kind,
        "node_id": spiffe.node_id,
        "site_id": spiffe.site_id,
        "role": role,
        "trust_domain": crypto.trust_domain,
        "chain": pki.cert_pem(leaf) + crypto.chain_tail_pem,
        "bundle": crypto.bundle_pem,
        "trust_version": crypto.trust_version,
        "csr_sha256": csr_sha256,
        "server_time": server_time_ms,
        "identity_generation": generation,
    }
    return wire.sign_response(body, crypto.signing_key)


UNKNOWN_ATTESTOR = "unknown"


def record_refusal(
    store: Store, refusal: Refused, type_: str, rate_key: str, payload: dict[str, Any]
) -> None:
    """Publish a refusal event after the rollback, rate-limited per tenant and ``rate_key``.

    It goes to ``refusal.tenant_id`` when set (the caller proved a secret or key),
    else to the root tenant. The budget is per receiving tenant, so one tenant's
    refusals neither use up another's nor show in its ``suppressed`` counts. A failure here is logged, never raised: the refusal
    itself must still reach the caller.
    """
    try:
        with store.tx() as tx:
            tenant = refusal.tenant_id or tenancy.root_tenant(tx)
            if tenant is None:
                log.warning("%s (%s) and no root tenant to tell", type_, refusal.reason)
                return
            events.publish_rate_limited(tx, tenant, type_, f"{tenant}|{rate_key}", payload)
    except Exception:
        log.exception("could not record a refusal (%s)", type_)

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

This module is the transactional shell: it reads the records in the transaction
(:mod:`control.repos`), asks the pure admission core (:mod:`control.admission`) for
the verdict and writes what it decided. The CSR is parsed once, before the
transaction.

Every refusal leaves as the same ``ACCESS_DENIED`` / ``Join refused``; its reason
goes only to a ``security.join.refused`` event, written after the rollback.

An attestor may instead answer a :class:`~bcd.attestor_api.Challenge` (the tpm attestor's
credential activation): the signed ``challenge`` body, nothing issued or consumed,
the transaction committed with whatever the attestor stored (``join_challenges``).
Or a :class:`~bcd.attestor_api.Defer`: a join request (:mod:`control.joinrequests`)
recorded or refreshed and a signed ``pending`` body; an approved request admits one
join with its CSR, consumed inside that join's transaction.
"""

from __future__ import annotations

import base64
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import hardware, pki, wire
from bcd.attestor_api import Admit, Challenge, Defer, Refuse, canonical_name, wire_name
from bcd.plugins import Plugins
from control import admission, events, joinrequests, repos, tenancy
from control.admission import CERT_TTL_MAX_S, MAX_ROUNDS, RAMDISK_TTL_MAX_S, JoinSubject
from control.errors import ControlError, Refused, StoreConflict, invalid
from control.issuance import (
    IssueLeaf,
    JoinCrypto,
    NoticeSigner,
    issue_recorded_leaf,
    leaf_ttl_s,
    notice_signer,
    record_refusal,
    revoke_node_certs,
    signed_identity,
)
from control.joincontext import CHALLENGE_KEEP_MS
from control.joincontext import JoinContext as _Ctx
from control.metrics import Metrics
from control.nodefacts import printable_version
from control.repos import CONCURRENT, platform_operated
from control.store import Store, Tx

__all__ = [
    "CERT_TTL_MAX_S",
    "CHALLENGE_KEEP_MS",
    "CONCURRENT",
    "JOIN_REFUSED",
    "MAX_ROUNDS",
    "RAMDISK_TTL_MAX_S",
    "REANSWER_MS",
    "UNKNOWN_ATTESTOR",
    "IssueLeaf",
    "JoinCrypto",
    "JoinService",
    "NoticeSigner",
    "issue_recorded_leaf",
    "leaf_ttl_s",
    "notice_signer",
    "platform_operated",
    "record_refusal",
    "revoke_node_certs",
    "signed_identity",
]

log = logging.getLogger("control.joinservice")

JOIN_REFUSED = "Join refused"
REANSWER_MS = 600_000
"""How long a join whose answer was lost may ask again with the same CSR (the agent's
retries with backoff fit well inside)."""
UNKNOWN_ATTESTOR = "unknown"


@dataclass(frozen=True)
class _Attempt:
    request: wire.JoinRequest
    subject: JoinSubject
    seal: wire.OpenedSeal | None
    seal_error: str | None
    peer_ip: str | None = None
    answered: list[str] = field(default_factory=list, compare=False)
    """What the transaction answered (joined, challenge, pending): read after commit."""

    @property
    def attestor(self) -> str:
        return self.subject.attestor

    @property
    def csr_sha256(self) -> str:
        return self.subject.csr_sha256

    @functools.cached_property
    def csr_key(self) -> ec.EllipticCurvePublicKey:
        """The CSR's key, taken out once (each ``public_key()`` call builds it anew)."""
        assert self.subject.csr is not None
        return pki.csr_public_key(self.subject.csr)

    @functools.cached_property
    def csr_spki_sha256(self) -> str:
        return pki.sha256_hex(pki.spki_der(self.csr_key))


class JoinService:
    def __init__(
        self,
        store: Store,
        crypto: JoinCrypto | None,
        plugins: Plugins,
        settings: Mapping[str, str] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.crypto = crypto
        self.plugins = plugins
        self.settings: Mapping[str, str] = dict(settings or {})
        self.metrics = metrics or Metrics()

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
            self.metrics.join(UNKNOWN_ATTESTOR, "error")
            raise invalid(f"malformed join request: {exc}") from exc
        attempt = _prepare(request, crypto, peer_ip)
        try:
            answer = self._judge(attempt, crypto)
        except Refused:
            raise  # counted by _record_refusal
        except ControlError:
            self.metrics.join(self._label(attempt), "error")
            raise
        self.metrics.join(self._label(attempt), attempt.answered[-1])
        return answer

    def _judge(self, attempt: _Attempt, crypto: JoinCrypto) -> str:
        for last in (False, True):
            try:
                attempt.answered.clear()
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

    def _label(self, attempt: _Attempt) -> str:
        """The attestor as events name it: a loaded plugin's name, else ``unknown``, so
        inventing names neither multiplies the refusal budget nor writes their text."""
        return attempt.attestor if attempt.attestor in self.plugins.names() else UNKNOWN_ATTESTOR

    def _refuse(self, attempt: _Attempt, reason: str, tenant_id: str | None = None) -> Refused:
        return Refused(JOIN_REFUSED, f"{self._label(attempt)}:{reason}", tenant_id)

    def _refused(self, attempt: _Attempt, refusal: admission.Refusal) -> Refused:
        return self._refuse(attempt, refusal.reason, refusal.tenant_id)

    def _admit(self, tx: Tx, attempt: _Attempt, crypto: JoinCrypto) -> str:
        request = attempt.request
        refusal = admission.check_seal(
            attempt.seal, attempt.seal_error, attempt.csr_sha256, tx.now_ms()
        )
        if refusal is not None:
            raise self._refused(attempt, refusal)
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
        except ControlError:  # the store's own (StoreConflict, StoreUnavailable)
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
        csr = attempt.subject.csr
        if csr is None:
            return None
        row = repos.recent_live_cert_for_key(
            tx,
            attempt.csr_spki_sha256,
            attempt.attestor,
            tx.now_ms() - REANSWER_MS,
        )
        if row is None:
            return None
        leaf = x509.load_der_x509_certificate(base64.b64decode(row["der"]))
        spiffe = pki.leaf_info(leaf).spiffe
        log.info("join of %s answered again (its answer was lost)", spiffe.node_id)
        attempt.answered.append("joined")
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
        pool = repos.pool_facts(tx, defer.pool_id) if attempt.subject.csr is not None else None
        row = None
        if pool is not None:
            row = joinrequests.lock_for_csr(
                tx, attempt.attestor, defer.machine_key, attempt.csr_sha256
            )
        decision = admission.judge_defer(
            attempt.subject, defer, pool, repos.request_facts(row, tx.now_ms())
        )
        if isinstance(decision, admission.Refusal):
            raise self._refused(attempt, decision)
        if isinstance(decision, admission.AdmitApproved):
            return self._issue(tx, attempt, decision.admit, crypto)
        request_id = joinrequests.record_pending(
            tx,
            tenant_id=decision.tenant_id,
            site_id=decision.site_id,
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
        attempt.answered.append("pending")
        return wire.sign_response(body, crypto.signing_key)

    def _challenge(self, attempt: _Attempt, verdict: Challenge, crypto: JoinCrypto) -> str:
        """A JoinChallenge: the signed ``challenge`` body; nothing issued, nothing consumed."""
        refusal = admission.check_challenge(attempt.subject, verdict)
        if refusal is not None:
            if refusal.reason == "plugin-error":
                log.error("attestor %s answered an invalid challenge", attempt.attestor)
            raise self._refused(attempt, refusal)
        body = {
            "kind": "challenge",
            "attestor": wire_name(attempt.attestor),
            "round": verdict.round,
            "challenge": verdict.challenge,
            "not_after": verdict.not_after_ms,
        }
        attempt.answered.append("challenge")
        return wire.sign_response(body, crypto.signing_key)

    def _issue(self, tx: Tx, attempt: _Attempt, admit: Admit, crypto: JoinCrypto) -> str:
        screened = admission.screen(attempt.subject, admit)
        if isinstance(screened, admission.Refusal):
            if screened.reason == "plugin-error":
                log.error("attestor %s admitted with a malformed Admit", attempt.attestor)
            raise self._refused(attempt, screened)
        lookup = admission.reclaim_lookup(admit, screened)
        existing = repos.lock_reclaim_target(tx, lookup, admit.tenant_id)
        approved = None
        if admit.join_request_id is not None:
            approved = repos.lock_join_request(tx, admit.join_request_id, attempt.attestor)
        verdict = admission.judge_admit(
            attempt.subject,
            admit,
            screened,
            existing,
            repos.pool_facts(tx, admit.pool_id),
            approved,
        )
        if isinstance(verdict, admission.Refusal):
            raise self._refused(attempt, verdict)
        if verdict.consume_request is not None:
            joinrequests.consume(tx, verdict.consume_request)
        return self._write_join(tx, attempt, admit, verdict, crypto)

    def _write_join(
        self,
        tx: Tx,
        attempt: _Attempt,
        admit: Admit,
        issue: admission.Issue,
        crypto: JoinCrypto,
    ) -> str:
        """What an Admit decided: the node row, its revoked older certificates, the
        leaf, the events and the signed ``joined`` answer."""
        csr = attempt.subject.csr
        assert csr is not None  # admission.screen refused a CSR that does not parse
        tenant, hw, existing = issue.tenant_id, issue.hw, issue.existing
        claims = attempt.request.claims.to_json()
        if existing is None:
            generation = 1
            node_id = repos.insert_node(
                tx,
                tenant_id=tenant,
                site_id=issue.site_id,
                pool_id=issue.pool_id,
                role=issue.role,
                hardware_key=hw.hex,
                hardware_key_trusted=hw.trusted,
                claims=claims,
                attestor=attempt.attestor,
                max_lifetime_s=issue.max_lifetime_s,
                daemon_version=printable_version(attempt.request.daemon_version),
            )
        else:
            node_id = existing.node_id
            generation = existing.identity_generation + 1
            repos.rejoin_node(
                tx,
                node_id,
                generation=generation,
                role=issue.role,
                claims=claims,
                attestor=attempt.attestor,
                max_lifetime_s=issue.max_lifetime_s,
                daemon_version=printable_version(attempt.request.daemon_version),
            )
            revoke_node_certs(
                tx,
                tenant,
                node_id,
                "rejoined" if admit.node_id is not None else "reclaimed",
                notice_signer(crypto.signing_key),
            )
        spiffe = pki.SpiffeId(crypto.trust_domain, issue.site_id, node_id)
        leaf, info = issue_recorded_leaf(
            tx,
            crypto,
            attempt.csr_key,
            spiffe,
            issue.role,
            admit.statements,
            admit.allowed_kinds,
            generation,
            issue.max_lifetime_s,
        )
        reclaim = existing is not None
        payload = {
            "nodeId": node_id,
            "attestor": attempt.attestor,
            "reclaim": reclaim,
            "hardwareKeyTrusted": hw.trusted,
            "certSerial": info.serial_hex,
            "nodeKey": admit.node_key,
            "poolId": issue.pool_id,
            "siteId": issue.site_id,
        }
        if admit.join_request_id is not None:
            payload["joinRequestId"] = admit.join_request_id
        if admit.node_id is not None:
            payload["rejoin"] = True
        events.publish(tx, tenant, "node.joined", payload)
        events.audit(tx, tenant, "node.reclaimed" if reclaim else "node.joined", node_id, payload)
        if hw.trusted and hw.hex is not None:
            _report_shared_key(tx, tenant, node_id, hw.hex)
        attempt.answered.append("joined")
        return signed_identity(
            crypto, "joined", spiffe, issue.role, leaf, attempt.csr_sha256, tx.now_ms(), generation
        )

    def _record_refusal(self, attempt: _Attempt, refusal: Refused) -> None:
        label = self._label(attempt)
        self.metrics.join(label, "refused", refusal.reason.removeprefix(f"{label}:"))
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
                "hardwareKey": attempt.subject.hw.hex,
            },
        )


def _prepare(request: wire.JoinRequest, crypto: JoinCrypto, peer_ip: str | None) -> _Attempt:
    """What needs no database: the seal opened, the CSR parsed (once), the claims' key."""
    seal, seal_error = None, None
    if request.sealed_token is not None:
        try:
            seal = crypto.seal_opener.open(request.sealed_token)
        except wire.NotAToken:
            seal_error = "token-malformed"
        except wire.WireError:
            seal_error = "seal-invalid"
    try:
        csr: x509.CertificateSigningRequest | None = pki.parse_csr(request.csr_der)
    except pki.PkiError:
        csr = None
    subject = JoinSubject(
        attestor=canonical_name(request.attestor),
        csr_sha256=pki.sha256_hex(request.csr_der),
        csr=csr,
        claims=request.claims,
        hw=hardware.hardware_key(request.claims),
        request_round=request.round,
        node_id=request.node_id,
    )
    return _Attempt(request, subject, seal, seal_error, peer_ip)


def _report_shared_key(tx: Tx, tenant: str, node_id: str, hardware_key: str) -> None:
    """Tell the root tenant (never either tenant) when live nodes of other tenants
    claim the same trusted hardware key: one of them copied the other's identifiers."""
    others = repos.shared_key_nodes(tx, hardware_key, tenant)
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

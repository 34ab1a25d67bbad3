"""JoinService.Renew, and what the gateway asks of the store about node certificates.

Renew judges one RenewRequest in one transaction, in this order (the seed's checks;
every refusal is the same ``ACCESS_DENIED`` / ``Renew refused`` to the caller):

1. the presented leaf (the first certificate of ``chain``) is byte for byte a
   node_certs row (``leaf-unknown``), unrevoked (``leaf-revoked``) and unexpired at
   ``compute_now()`` (``leaf-expired``);
2. its node exists and is not retired (``node-retired``), and the leaf is of the
   node's current identity generation (``generation``);
3. the caller's mTLS certificate is a live node_certs row of that same node
   (``identity-mismatch``, also when there is none);
4. ``client_time`` is within 60 s of ``compute_now()`` (``clock-skew``);
5. the proof was not accepted in the last 120 s (``pop-replay``), then it verifies
   under the presented leaf's key (``pop-invalid``);
6. from here the caller proved the current key, so the refusal event goes to the
   node's tenant: the CSR parses and holds a P-256 key (``csr-invalid``); a leaf
   naming a TPM AK needs ``key_attestation`` (``key-attestation-missing``): that
   AK's TPM2_Certify of the new key over sha256(csr) (bcd.tpm.attestation:
   ``key-attestation-ak``, ``node-key-*``), refused, never downgraded;
7. at most 6 renewals per node and hour (``RESOURCE_EXHAUSTED`` with
   ``retry-pushback-ms``; not a refusal), then the new leaf: same node, site,
   role, identity generation, allowed kinds and ``urn:bc:`` statements, all read
   from the stored leaf and its node_certs row, never from the CSR.

The signature checks and parsing happen before the transaction (pure CPU over the
request); their verdicts are used only once the presented leaf proved to be the
stored one, so the row lock on the node is held briefly.

The gateway's ``POST /v1/renew`` (:meth:`RenewService.renew_live`) puts the
caller's checks in the same transaction, before all of these: the client
certificate is live (UNAUTHENTICATED), then the caller's node is locked and its rate
checked (RESOURCE_EXHAUSTED), then the body parses (INVALID_ARGUMENT). The presented
leaf is most often the client certificate, so its row and its node's lock serve
steps 1, 2 and 7 too: 10 statements in one transaction, where the checks in a
transaction of their own made 13 in two.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki, wire
from bcd.tpm.attestation import AttestationRefused, check_key_attestation
from control import admission, events, repos
from control.errors import ControlError, Refused, StoreConflict, invalid
from control.issuance import JoinCrypto, issue_recorded_leaf, record_refusal, signed_identity
from control.metrics import Metrics
from control.proofs import proof_sha256, spend_proof
from control.store import Row, Store, Tx, marks

RENEW_REFUSED = "Renew refused"
CONCURRENT = "This node renewed concurrently; retry"
RENEWALS_PER_HOUR = admission.RENEWALS_PER_HOUR  # admission's MIN_LIFETIME_S depends on it
RATE_WINDOW_MS = admission.RATE_WINDOW_MS
# How far a revocation poller should look back behind its previous poll: revoked_at
# is the revoking transaction's start, so a slow transaction can commit a
# revocation stamped before one already seen (see revoked_since).
REVOKED_SINCE_OVERLAP_MS = 120_000
# The UNAUTHENTICATED answer's ``reason`` for a client certificate that is no
# node_certs row (a database restored from an older backup; PROTOCOL.md addition).
UNKNOWN_CERTIFICATE = "unknown-certificate"
UNKNOWN_MESSAGE = "this certificate is not known to the control plane"


class RenewRefused(Refused):
    """A renewal refusal; ``node_id`` and ``serial`` are set once the leaf matched a row."""

    def __init__(
        self,
        reason: str,
        tenant_id: str | None = None,
        *,
        node_id: str | None = None,
        serial: str | None = None,
    ) -> None:
        super().__init__(RENEW_REFUSED, reason, tenant_id)
        self.node_id = node_id
        self.serial = serial


@dataclass(frozen=True)
class _Attempt:
    request: wire.RenewRequest
    csr_sha256: str
    proof_sha256: str
    leaf_der: bytes | None  # the presented leaf, when the chain parsed
    leaf: pki.LeafInfo | None  # its identity, when it reads as a node leaf
    pop_ok: bool  # pop_sig verifies under the presented leaf's key and node id
    csr: x509.CertificateSigningRequest | None
    peer_der: bytes | None

    @functools.cached_property
    def csr_key(self) -> ec.EllipticCurvePublicKey:
        """The CSR's key, taken out once (each ``public_key()`` call builds it anew)."""
        assert self.csr is not None
        return pki.csr_public_key(self.csr)


class RenewService:
    """JoinService.Renew: ``renew(body, peer_cert_der)`` runs in a worker thread."""

    def __init__(
        self, store: Store, crypto: JoinCrypto | None, metrics: Metrics | None = None
    ) -> None:
        self.store = store
        self.crypto = crypto
        self.metrics = metrics or Metrics()

    def renew(self, body: bytes, peer_cert_der: bytes | None) -> str:
        """Judge one RenewRequest body; return the SignedResponse or raise ControlError.

        A refusal is a :class:`RenewRefused` (ACCESS_DENIED / ``Renew refused``);
        a node over its renewal budget gets ``RESOURCE_EXHAUSTED`` with
        ``retry_after_ms``; a malformed body ``INVALID_ARGUMENT``.
        """
        return self._judge(body, peer_cert_der, caller=False)

    def renew_live(self, body: bytes, peer_cert_der: bytes) -> str:
        """The gateway's ``POST /v1/renew``: :meth:`renew` behind the caller's checks,
        all in one transaction, in the seed's order. First the client certificate must
        be live (else :class:`NotLive`, whose details the UNAUTHENTICATED answer
        carries), then its node is locked and its rate checked under the lock
        (``RESOURCE_EXHAUSTED``), then the body must parse (``INVALID_ARGUMENT``), then
        Renew's own checks. The request's signatures are checked before the
        transaction, as :meth:`renew` does, and their verdicts used only after those
        answers, so no answer or its order depends on them.
        """
        return self._judge(body, peer_cert_der, caller=True)

    def _judge(self, body: bytes, peer_cert_der: bytes | None, *, caller: bool) -> str:
        crypto = self.crypto
        if crypto is None:
            raise ControlError("INVALID_CONFIG", "JoinService has no pki.join configuration")
        malformed: ControlError | None = None
        attempt: _Attempt | None = None
        try:
            attempt = _prepare(wire.parse_renew_request(wire.loads_object(body)), peer_cert_der)
        except wire.WireError as exc:
            malformed = invalid(f"malformed renew request: {exc}")
            if not caller:  # the gateway's answers to the caller come first
                self.metrics.renewal("error")
                raise malformed from exc
        try:
            with self.store.tx() as tx:
                held = _check_caller(tx, peer_cert_der, attempt) if caller else None
                if attempt is None:
                    assert malformed is not None
                    raise malformed
                answer = self._renew(tx, attempt, crypto, held)
        except RenewRefused as refusal:
            assert attempt is not None  # only Renew's own checks refuse
            self.metrics.renewal("refused", refusal.reason)
            self._record_refusal(attempt, refusal)
            raise
        except StoreConflict as exc:
            self.metrics.renewal("error")
            raise ControlError("CONFLICT", CONCURRENT) from exc
        except ControlError as exc:
            self.metrics.renewal("rate-limited" if exc.code == "RESOURCE_EXHAUSTED" else "error")
            raise
        self.metrics.renewal("renewed")
        return answer

    def _renew(self, tx: Tx, attempt: _Attempt, crypto: JoinCrypto, held: _Held | None) -> str:
        request, info = attempt.request, attempt.leaf
        now_ms = tx.now_ms()
        # The presented leaf is most often the client certificate itself, whose row
        # the caller's check read in this transaction (a row's DER never changes).
        same = attempt.peer_der is not None and attempt.peer_der == attempt.leaf_der
        if held is not None and same:
            found: Row | None = held.row
        else:
            found = None if info is None else repos.cert_row(tx, attempt.leaf_der, info.serial_hex)
        if found is None or info is None:
            raise RenewRefused("leaf-unknown")
        node_id, serial = str(found["node_id"]), str(found["serial"])

        def refuse(refusal: admission.Refusal) -> RenewRefused:
            return RenewRefused(refusal.reason, refusal.tenant_id, node_id=node_id, serial=serial)

        # Lock the node, then read its certificates again: a revocation, reclaim or
        # deletion (which lock the node first) is either wholly before or after us.
        # The caller's node is locked already, its rate checked under the lock. A leaf
        # of another node than the caller's is refused (identity-mismatch, below):
        # its node is read without a lock, so no two nodes are ever locked at once.
        locked = held is not None and held.node.node_id == node_id
        if held is None:
            node = repos.lock_node(tx, node_id, statements=False)  # the leaf's, never the node's
        elif locked:
            node = held.node
        else:
            node = repos.read_node(tx, node_id, statements=False)
        leaf_row = repos.cert_by_serial(tx, serial)
        leaf = repos.cert_facts(leaf_row)
        assert leaf is not None  # node_certs rows are never deleted
        peer_row = leaf_row if same else repos.cert_row(tx, attempt.peer_der)
        if held is not None:  # revoked since the caller's check read its row: as then
            dead = _dead_cert(peer_row, now_ms)
            if dead is not None:
                raise NotLive(dead)
        peer = repos.cert_facts(peer_row)
        refusal = admission.judge_renew_leaf(leaf, node, peer, request.client_time_ms, now_ms)
        if refusal is not None:
            raise refuse(refusal)
        assert node is not None  # judge_renew_leaf refused a missing node
        fresh = spend_proof(tx, attempt.proof_sha256, node_id, now_ms)
        # The caller proved the current key: from here the node's owner hears of it.
        tenant = node.tenant_id
        refusal = admission.judge_renew_proof(fresh, attempt.pop_ok, attempt.csr, tenant)
        if refusal is not None:
            raise refuse(refusal)
        assert attempt.csr is not None  # judge_renew_proof refused a CSR that does not parse
        try:  # a leaf naming an AK renews only with that AK's proof: never downgraded
            check_key_attestation(
                request.key_attestation,
                info.statements,
                attempt.csr_key,
                request.csr_der,
            )
        except AttestationRefused as exc:
            raise refuse(admission.Refusal(exc.reason, tenant)) from None
        if not locked:
            _within_rate(tx, node_id)
        # Role, allowed kinds and statements come from the stored leaf and its row
        # (the presented leaf is byte for byte that leaf), never from the CSR; the
        # lifetime keeps the cap the node's admitting attestor set.
        role, generation = leaf.role, node.identity_generation
        spiffe = pki.SpiffeId(crypto.trust_domain, info.spiffe.site_id, node_id)
        cert, new = issue_recorded_leaf(
            tx,
            crypto,
            attempt.csr_key,
            spiffe,
            role,
            info.statements,
            leaf.allowed_kinds,
            generation,
            node.max_lifetime_s,
        )
        tx.defer(
            "DELETE FROM renewals WHERE node_id = ? AND renewed_at <= ?",
            (node_id, now_ms - RATE_WINDOW_MS),
        )
        tx.defer(
            "INSERT INTO renewals (serial, node_id, renewed_at) VALUES (?, ?, ?)",
            (new.serial_hex, node_id, now_ms),
        )
        events.audit(
            tx,
            tenant,
            "node.renewed",
            node_id,
            {"nodeId": node_id, "previousSerial": serial, "certSerial": new.serial_hex},
        )
        tx.on_commit(
            lambda: events.log_event(
                "node.renewed",
                "node renewed",
                tenant_id=tenant,
                node_id=node_id,
                previous_serial=serial,
                serial=new.serial_hex,
            )
        )
        return signed_identity(
            crypto, "renewed", spiffe, role, cert, attempt.csr_sha256, now_ms, generation
        )

    def _record_refusal(self, attempt: _Attempt, refusal: RenewRefused) -> None:
        payload: dict[str, Any] = {"reason": refusal.reason, "csrSha256": attempt.csr_sha256}
        if refusal.node_id is not None:
            payload["nodeId"] = refusal.node_id
        if refusal.serial is not None:
            payload["serial"] = refusal.serial
        record_refusal(
            self.store, refusal, "security.renew.refused", f"renew|{refusal.reason}", payload
        )


def _prepare(request: wire.RenewRequest, peer_cert_der: bytes | None) -> _Attempt:
    leaf_der, info, pop_ok = None, None, False
    try:
        leaf_cert = pki.load_pem_chain(request.chain)[0]
        leaf_der = leaf_cert.public_bytes(serialization.Encoding.DER)
        info = pki.leaf_info(leaf_cert)
        key = leaf_cert.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey)  # leaf_info checked it
        message = pki.renew_pop_message(
            request.csr_der, info.spiffe.node_id, request.client_time_ms
        )
        pki.verify_p1363(key, request.pop_sig, message)
        pop_ok = True
    except (ValueError, x509.InvalidVersion):  # PkiError is a ValueError
        pass
    try:
        csr: x509.CertificateSigningRequest | None = pki.parse_csr(request.csr_der)
    except (ValueError, x509.InvalidVersion):
        csr = None
    return _Attempt(
        request=request,
        csr_sha256=pki.sha256_hex(request.csr_der),
        proof_sha256=proof_sha256(request.pop_sig),
        leaf_der=leaf_der,
        leaf=info,
        pop_ok=pop_ok,
        csr=csr,
        peer_der=peer_cert_der,
    )


class NotLive(Exception):
    """The client certificate of a gateway's renewal is not live: ``details`` are the
    UNAUTHENTICATED answer's fields beside code and message
    (:func:`live_peer_or_details`)."""

    def __init__(self, details: dict[str, str]) -> None:
        super().__init__(details.get("reason", ""))
        self.details = details


@dataclass(frozen=True)
class _Held:
    """The caller of a gateway's renewal: its client certificate's row (read before the
    lock) and its node, locked in this transaction, its rate checked under the lock."""

    row: Row
    node: admission.NodeFacts


def _check_caller(tx: Tx, peer_cert_der: bytes | None, attempt: _Attempt | None) -> _Held:
    """:meth:`RenewService.renew_live`'s first checks: the client certificate is live
    (:class:`NotLive`), then the node's rate, under the node's lock."""
    leaf = None if attempt is None else attempt.leaf
    # The client certificate is most often the presented leaf, parsed already.
    known = leaf is not None and attempt is not None and attempt.leaf_der == peer_cert_der
    row = repos.cert_row(tx, peer_cert_der, leaf.serial_hex if known and leaf else None)
    details = _dead_cert(row, tx.now_ms())
    if details is not None:
        raise NotLive(details)
    assert row is not None  # _dead_cert answers a missing row
    node = repos.lock_node(tx, str(row["node_id"]), statements=False)
    if node is None or node.retired:
        raise NotLive({"reason": "node-retired"})
    _within_rate(tx, node.node_id)
    return _Held(row, node)


def _within_rate(tx: Tx, node_id: str) -> None:
    pushback = check_renew_rate(tx, node_id)
    if pushback is not None:
        raise ControlError(
            "RESOURCE_EXHAUSTED", "at most 6 renewals per node and hour", retry_after_ms=pushback
        )


# --- for the gateway --------------------------------------------------------------------


def check_renew_rate(tx: Tx, node_id: str) -> int | None:
    """Milliseconds to wait before the node may renew again, or None when it may now.

    A sliding window: at most 6 renewals per node in any hour, read with the node row
    locked: :meth:`RenewService.renew_live` asks it first, so a busy node is turned
    away before its request is judged; :meth:`RenewService.renew` at its step 7.
    """
    now_ms = tx.now_ms()
    rows = tx.query(
        "SELECT renewed_at FROM renewals WHERE node_id = ? AND renewed_at > ? ORDER BY renewed_at",
        (node_id, now_ms - RATE_WINDOW_MS),
    )
    if len(rows) < RENEWALS_PER_HOUR:
        return None
    leaves_window = int(rows[len(rows) - RENEWALS_PER_HOUR]["renewed_at"]) + RATE_WINDOW_MS
    return max(1, leaves_window - now_ms)


@dataclass(frozen=True)
class LivePeer:
    """A live node certificate: its node, its serial, and how long it is still valid
    at ``compute_now()`` (the session's life)."""

    node_id: str
    serial: str
    remaining_ms: int


def live_peer_or_details(tx: Tx, peer_cert_der: bytes) -> tuple[LivePeer | None, dict[str, str]]:
    """The :class:`LivePeer` of a live node certificate, else the fields of the
    UNAUTHENTICATED answer beside code and message: ``reason``
    (:data:`UNKNOWN_CERTIFICATE`, ``revoked``, ``expired`` or ``node-retired``) and, for
    a revoked certificate, its signed ``notice``.

    Live: byte for byte a node_certs row, unrevoked, within its validity at
    ``compute_now()``, of a node that is not retired. One statement reads the
    certificate's row and its node's.

    A certificate the store has no row for is what a node that joined or renewed
    after the backup the database was restored from presents (docs/operators.md,
    "Backup and restore"). The reason is a hint, not a proof: a relaying gateway can
    send any, so the node stops only on the signed notice (:mod:`bcd.revocation`).
    """
    row = repos.cert_row(tx, peer_cert_der, with_node=True)
    now_ms = tx.now_ms()
    details = _dead_cert(row, now_ms)
    if details is not None:
        return None, details
    assert row is not None  # _dead_cert answers a missing row
    if row["node_found"] is None or row["node_retired_at"] is not None:
        return None, {"reason": "node-retired"}
    return LivePeer(str(row["node_id"]), str(row["serial"]), int(row["not_after"]) - now_ms), {}


def _dead_cert(row: Row | None, now_ms: int) -> dict[str, str] | None:
    """Why a client certificate's row is not live (the UNAUTHENTICATED answer's fields),
    or None; its node is not looked at here."""
    if row is None:
        return {"reason": UNKNOWN_CERTIFICATE}
    if row["revoked_at"] is not None:
        notice = row.get("revoke_notice")
        return {"reason": "revoked", **({"notice": str(notice)} if notice else {})}
    if not int(row["not_before"]) <= now_ms <= int(row["not_after"]):
        return {"reason": "expired"}
    return None


def revoked_since(tx: Tx, since_ms: int) -> list[Row]:
    """Certificates revoked after ``since_ms``: serial, node_id, revoke_reason, revoked_at.

    ``revoked_at`` is the revoking transaction's ``compute_now()`` (its start), so a
    revocation can commit after a later-stamped one was already read. A poller
    should ask again from (its previous poll's start - REVOKED_SINCE_OVERLAP_MS)
    and skip serials it already handled. The signed notices are not read here (about
    1 KB each, read again by every poll of the window): :func:`revoke_notices` reads
    those of the serials a gateway holds a session of.
    """
    return tx.query(
        "SELECT serial, node_id, revoke_reason, revoked_at FROM node_certs "
        "WHERE revoked_at IS NOT NULL AND revoked_at > ? ORDER BY revoked_at, serial",
        (since_ms,),
    )


MAX_NOTICES_READ = 500
""":func:`revoke_notices` reads at most this many serials' notices a statement."""


def revoke_notices(tx: Tx, serials: Sequence[str]) -> dict[str, str | None]:
    """serial → its signed revocation notice (None: none was stored), for revoked
    certificates among ``serials``."""
    out: dict[str, str | None] = {}
    for start in range(0, len(serials), MAX_NOTICES_READ):
        part = list(serials[start : start + MAX_NOTICES_READ])
        for row in tx.query(
            "SELECT serial, revoke_notice FROM node_certs "
            f"WHERE serial IN ({marks(len(part))}) AND revoked_at IS NOT NULL",
            part,
        ):
            notice = row["revoke_notice"]
            out[str(row["serial"])] = None if notice is None else str(notice)
    return out

"""The control plane's renewal half in process: a node made by a real join (JoinService
with a token), then renewing the way bcd does, through RenewService over the real store
(SQLite and PostgreSQL, fixture ``store``).

:class:`Env` (fixture ``env``): ``join`` a machine, build a renewal ``body`` (each
keyword bends one part), ``renew`` it, ``refused`` checks everything a refusal
promises, ``issue_extra`` records another leaf as a tpm join or an attestor would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki as bpki
from bcd import wire
from control import events, tenancy, tokens
from control.joinservice import (
    JoinCrypto,
    JoinService,
    NoticeSigner,
    issue_recorded_leaf,
    notice_signer,
)
from control.pki import Pki
from control.renewal import RenewRefused, RenewService, live_peer_or_details
from control.server import join_crypto
from control.store import Store, Tx
from tests.world.joins import PLUGINS, join_body, machine

ROOT = "root"
OWNER = "owner"


@dataclass(frozen=True)
class NodeId:
    """What bcd holds: its node id, site, key and chain."""

    node_id: str
    site_id: str
    key: ec.EllipticCurvePrivateKey
    chain: str

    @property
    def leaf(self) -> x509.Certificate:
        return bpki.load_pem_chain(self.chain)[0]

    @property
    def der(self) -> bytes:
        return self.leaf.public_bytes(serialization.Encoding.DER)

    @property
    def serial(self) -> str:
        return format(self.leaf.serial_number, "x")


@dataclass(frozen=True)
class RenewAttempt:
    body: bytes
    key: ec.EllipticCurvePrivateKey
    csr_der: bytes


@dataclass
class Env:
    store: Store
    pki: Pki
    crypto: JoinCrypto
    joins: JoinService
    renewals: RenewService
    root: str
    tenant: str
    site: str
    pool: str
    tenant_credential: str = ""
    root_credential: str = ""

    @property
    def sign(self) -> NoticeSigner:
        """Signs RevocationNotices as the API does (the join-signing key)."""
        return notice_signer(self.pki.join_signing_key)

    @property
    def pin(self) -> str:
        return self.pki.pins()["join_signing_key_pin"]

    def mint(self, **kw: Any) -> str:
        kw.setdefault("ttl_s", 3600)
        with self.store.tx() as tx:
            return str(tokens.create(tx, self.tenant, self.pool, **kw)["token"])

    def join(self, n: int, **kw: Any) -> NodeId:
        attempt = join_body(self.mint(**kw), self.pki.join_encryption_key.public_key(), machine(n))
        body = wire.verify_response(self.joins.join(attempt.body), self.pin)
        return NodeId(body["node_id"], body["site_id"], attempt.key, body["chain"])

    def body(
        self,
        node: NodeId,
        *,
        csr_der: bytes | None = None,
        client_time: int | None = None,
        sign_with: ec.EllipticCurvePrivateKey | None = None,
        pop_node_id: str | None = None,
        pop_sig: bytes | None = None,
        chain: str | None = None,
        key_attestation: dict[str, Any] | None = None,
    ) -> RenewAttempt:
        """A RenewRequest body as bcd builds it; each keyword bends one part."""
        key = bpki.generate_key()
        csr = csr_der if csr_der is not None else bpki.make_csr(key)
        t = int(time.time() * 1000) if client_time is None else client_time
        message = bpki.renew_pop_message(csr, pop_node_id or node.node_id, t)
        sig = pop_sig if pop_sig is not None else bpki.sign_p1363(sign_with or node.key, message)
        request = wire.RenewRequest(
            csr, node.chain if chain is None else chain, t, sig, key_attestation
        )
        return RenewAttempt(wire.dumps(request.to_json()), key, csr)

    def renew_raw(self, attempt: RenewAttempt, peer: bytes | None) -> dict[str, Any]:
        return wire.verify_response(self.renewals.renew(attempt.body, peer), self.pin)

    def renew(self, node: NodeId, **kw: Any) -> NodeId:
        attempt = self.body(node, **kw)
        body = self.renew_raw(attempt, node.der)
        return NodeId(body["node_id"], body["site_id"], attempt.key, body["chain"])

    def rows(self, statement: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return tx.query(statement, params)

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> None:
        with self.store.tx() as tx:
            tx.execute(statement, params)

    def now_ms(self) -> int:
        with self.store.tx() as tx:
            return tx.now_ms()

    def events(self, tenant: str, type_: str) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return events.list_events(tx, tenant, type_, limit=100_000)

    def snapshot(self) -> tuple[Any, ...]:
        """Everything a refusal must leave untouched."""
        return (
            self.rows("SELECT * FROM nodes ORDER BY id"),
            self.rows("SELECT serial, revoked_at FROM node_certs ORDER BY serial"),
            self.rows("SELECT * FROM renewals ORDER BY serial"),
            self.rows("SELECT * FROM renew_proofs ORDER BY proof_sha256"),
            self.rows("SELECT id FROM audit ORDER BY id"),
            self.rows("SELECT id FROM events WHERE type <> 'security.renew.refused' ORDER BY id"),
        )

    def refused(
        self,
        attempt: RenewAttempt,
        peer: bytes | None,
        reason: str,
        *,
        routed_to: str,
        node: NodeId | None = None,
        owner: str | None = None,
    ) -> RenewRefused:
        """Renew must be refused for ``reason``; check everything a refusal promises.

        ``node`` is the node the presented leaf belongs to (None: the leaf is not
        ours), ``owner`` its tenant when not ``self.tenant``.
        """
        owner = owner or self.tenant
        tenant = self.root if routed_to == ROOT else owner
        other = owner if routed_to == ROOT else self.root
        before = self.snapshot()
        seen = {e["id"] for e in self.events(tenant, "security.renew.refused")}
        with pytest.raises(RenewRefused) as info:
            self.renewals.renew(attempt.body, peer)
        refusal = info.value
        assert (refusal.code, refusal.message, str(refusal)) == (
            "ACCESS_DENIED",
            "Renew refused",
            "Renew refused",
        )
        assert refusal.reason == reason
        assert self.snapshot() == before
        new = [e for e in self.events(tenant, "security.renew.refused") if e["id"] not in seen]
        assert len(new) == 1
        expected: dict[str, Any] = {
            "reason": reason,
            "csrSha256": bpki.sha256_hex(attempt.csr_der),
            "suppressed": 0,
        }
        if node is not None:
            expected |= {"nodeId": node.node_id, "serial": node.serial}
        assert new[0]["payload"] == expected
        if other != tenant:
            assert all(
                e["payload"]["reason"] != reason
                for e in self.events(other, "security.renew.refused")
            )
        return refusal

    def issue_extra(
        self,
        node: NodeId,
        statements: tuple[str, ...] = (),
        allowed_kinds: tuple[str, ...] = (),
    ) -> NodeId:
        """Record another leaf for ``node`` (as a tpm join or an attestor would issue)."""
        key = bpki.generate_key()
        with self.store.tx() as tx:
            (gen,) = tx.query(
                "SELECT identity_generation, role FROM nodes WHERE id = ?", (node.node_id,)
            )
            leaf, _ = issue_recorded_leaf(
                tx,
                self.crypto,
                key.public_key(),
                bpki.SpiffeId(self.pki.trust_domain, node.site_id, node.node_id),
                gen["role"],
                statements,
                allowed_kinds,
                int(gen["identity_generation"]),
            )
        return NodeId(
            node.node_id, node.site_id, key, bpki.cert_pem(leaf) + self.pki.chain_tail_pem()
        )


def make_env(store: Store, memory_pki: Pki) -> Env:
    with store.tx() as tx:
        root, root_cred = tenancy.create_tenant(tx, "platform", root=True)
        tenant, cred = tenancy.create_tenant(tx, "acme")
        site = tenancy.create_site(tx, tenant, "rack-b7")["id"]
        pool = tenancy.create_pool(tx, tenant, site, "gpu", "bcd", {})["id"]
    crypto = join_crypto(memory_pki)
    return Env(
        store,
        memory_pki,
        crypto,
        JoinService(store, crypto, PLUGINS),
        RenewService(store, crypto),
        root,
        tenant,
        site,
        pool,
        cred,
        root_cred,
    )


def peer_status(tx: Tx, der: bytes) -> tuple[str, str] | None:
    """(node id, serial) of a live node certificate, else None: what the gateway's
    check (:func:`control.renewal.live_peer_or_details`) finds."""
    peer = live_peer_or_details(tx, der)[0]
    return None if peer is None else (peer.node_id, peer.serial)

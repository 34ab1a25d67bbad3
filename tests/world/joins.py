"""The control plane's join half in process: JoinService over the real store (SQLite
and PostgreSQL, fixture ``store``) and the real PKI (``memory_pki``), and the bodies a
node sends, built as ``bcd join`` builds them.

:class:`World` (fixture ``world``): the root tenant, a tenant with a site and a pool,
and a JoinService; ``mint`` a token, ``body`` a JoinRequest, ``join`` it, ``refused``
checks everything a refusal promises. :class:`TpmWorld` (fixture ``tw``) is the same
for the tpm attestor on the session's swtpm.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki as bpki
from bcd import wire
from bcd.attestor_api import NodeJoinContext
from bcd.keys.node import RootTpmKey, new_root_tpm_key
from bcd.plugins import load_plugins
from bcd.wire import Claims, JoinRequest
from control import events, tenancy, tokens
from control.errors import Refused
from control.joinservice import JoinService
from control.pki import Pki
from control.server import join_crypto
from control.store import Store
from tests.swtpm import SwTpm

PLUGINS = load_plugins()
ROOT_ONLY = "root"
TENANT = "tenant"


# --- building what the node sends -------------------------------------------------


def machine(n: int, **overrides: Any) -> Claims:
    """A distinct machine with a trusted hardware key: product UUID, serial, one MAC."""
    fields: dict[str, Any] = {
        "product_uuid": str(uuid.UUID(int=(0x4C4C4544 << 96) | (n + 1))),
        "product_serial": f"SN-{n:04d}",
        "macs": (f"00:1b:21:{(n >> 8) & 0xFF:02x}:{n & 0xFF:02x}:5e",),
        "hostname": f"node-{n}",
        "boot_id": str(uuid.uuid4()),
    }
    fields.update(overrides)
    return Claims(**fields)


PLACEHOLDER_CLAIMS = Claims(
    product_uuid="00000000-0000-0000-0000-000000000000",
    product_serial="To Be Filled By O.E.M.",
    board_serial="Default string",
    chassis_serial="System Serial Number",
    hostname="localhost",
)


@dataclass(frozen=True)
class Attempt:
    body: bytes
    key: ec.EllipticCurvePrivateKey
    csr_der: bytes


_SEAL = object()


def join_body(
    token: str | None,
    encryption_key: ec.EllipticCurvePublicKey,
    claims: Claims,
    *,
    role: str = "node",
    key: ec.EllipticCurvePrivateKey | None = None,
    csr_der: bytes | None = None,
    seal_csr_der: bytes | None = None,
    iat: int | None = None,
    sealed: object = _SEAL,
    node_id: str | None = None,
) -> Attempt:
    """A JoinRequest body as bcd builds it (join-token attestor, sent as ``""``).

    ``seal_csr_der`` binds the seal to another CSR, ``iat`` overrides the seal's
    time, ``sealed`` replaces the sealed token outright (a string or None).
    """
    key = key or bpki.generate_key()
    csr = csr_der if csr_der is not None else bpki.make_csr(key)
    if sealed is _SEAL:
        assert token is not None
        sealed = wire.seal_token(
            wire.parse_token(token),
            encryption_key,
            seal_csr_der if seal_csr_der is not None else csr,
            int(time.time()) if iat is None else iat,
        )
    assert sealed is None or isinstance(sealed, str)
    request = JoinRequest(
        role=role,
        attestor="",
        sealed_token=sealed,
        csr_der=csr,
        claims=claims,
        evidence={},
        node_id=node_id,
        daemon_version="0.1.0-test",
    )
    return Attempt(wire.dumps(request.to_json()), key, csr)


# --- the world: root tenant, a tenant with a site and a pool ----------------------


@dataclass
class World:
    store: Store
    pki: Pki
    svc: JoinService
    root: str
    tenant: str
    site: str
    pool: str

    @property
    def enc(self) -> ec.EllipticCurvePublicKey:
        return self.pki.join_encryption_key.public_key()

    @property
    def signing_pin(self) -> str:
        return self.pki.pins()["join_signing_key_pin"]

    def mint(self, *, tenant: str | None = None, pool: str | None = None, **kw: Any) -> str:
        kw.setdefault("ttl_s", 3600)
        with self.store.tx() as tx:
            created = tokens.create(tx, tenant or self.tenant, pool or self.pool, **kw)
        return str(created["token"])

    def pool_in(self, tenant: str, site: str, *, agent: str = "bcd", policy: Any = None) -> str:
        with self.store.tx() as tx:
            return str(tenancy.create_pool(tx, tenant, site, "p", agent, policy or {})["id"])

    def body(self, token: str | None, claims: Claims, **kw: Any) -> Attempt:
        return join_body(token, self.enc, claims, **kw)

    def join(self, attempt: Attempt) -> dict[str, Any]:
        return wire.verify_response(self.svc.join(attempt.body), self.signing_pin)

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> None:
        with self.store.tx() as tx:
            tx.execute(statement, params)

    def rows(self, statement: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return tx.query(statement, params)

    def events(self, tenant: str, type_: str) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return events.list_events(tx, tenant, type_, limit=100_000)

    def snapshot(self) -> tuple[Any, ...]:
        """Everything a refusal must leave untouched."""
        return (
            self.rows("SELECT id, uses_left, revoked_at FROM join_tokens ORDER BY id"),
            self.rows("SELECT * FROM nodes ORDER BY id"),
            self.rows("SELECT serial, revoked_at FROM node_certs ORDER BY serial"),
            self.rows("SELECT id FROM audit ORDER BY id"),
            self.rows("SELECT id FROM events WHERE type <> 'security.join.refused' ORDER BY id"),
        )

    def refused(self, attempt: Attempt, reason: str, *, routed_to: str) -> Refused:
        """Join must be refused for ``reason``; check everything a refusal promises."""
        tenant = self.root if routed_to == ROOT_ONLY else self.tenant
        other = self.tenant if routed_to == ROOT_ONLY else self.root
        before = self.snapshot()
        seen_before = {e["id"] for e in self.events(tenant, "security.join.refused")}
        with pytest.raises(Refused) as info:
            self.svc.join(attempt.body)
        refusal = info.value
        assert (refusal.code, refusal.message, str(refusal)) == (
            "ACCESS_DENIED",
            "Join refused",
            "Join refused",
        )
        assert refusal.reason == f"join-token:{reason}"
        assert self.snapshot() == before
        # events of one millisecond have no defined order: find the new one by id
        new = [
            e for e in self.events(tenant, "security.join.refused") if e["id"] not in seen_before
        ]
        assert len(new) == 1
        payload = new[0]["payload"]
        assert payload == {
            "attestor": "join-token",
            "reason": f"join-token:{reason}",
            "role": json.loads(attempt.body)["role"],
            "csrSha256": bpki.sha256_hex(attempt.csr_der),
            "hardwareKey": payload["hardwareKey"],
            "suppressed": 0,
        }
        assert all(
            e["payload"]["reason"] != f"join-token:{reason}"
            for e in self.events(other, "security.join.refused")
        )
        return refusal


def make_world(store: Store, memory_pki: Pki) -> World:
    """The root tenant, a tenant with a site and a pool, and a JoinService over them."""
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        tenant, _ = tenancy.create_tenant(tx, "acme")
        site = tenancy.create_site(tx, tenant, "rack-b7")["id"]
        pool = tenancy.create_pool(tx, tenant, site, "gpu", "bcd", {})["id"]
    svc = JoinService(store, join_crypto(memory_pki), PLUGINS)
    return World(store, memory_pki, svc, root, tenant, site, pool)


# --- the tpm attestor -------------------------------------------------------------


def tpm_key(tcti: str) -> RootTpmKey:
    """A node key in the TPM and its CSR, as ``bcd join --attestor tpm`` makes them."""
    return new_root_tpm_key(tcti)


@dataclass
class TpmWorld:
    store: Store
    pki: Pki
    svc: JoinService
    root: str
    tenant: str
    site: str
    pool: str
    swtpm: SwTpm

    def ctx(self, key: RootTpmKey) -> NodeJoinContext:
        return NodeJoinContext(
            credential=None,
            csr_der=key.csr_der,
            encryption_key=None,
            now_s=0,
            role="node",
            tcti=self.swtpm.tcti,
            node_key_record=key.key_record.to_dict(),
        )

    def request(
        self, key: RootTpmKey, rnd: int = 0, answer: dict[str, Any] | None = None, **evidence: Any
    ) -> bytes:
        made = PLUGINS.node_evidence("tpm", self.ctx(key))
        assert made is not None
        request = wire.JoinRequest(
            role="node",
            attestor="tpm",
            sealed_token=None,
            csr_der=key.csr_der,
            claims=machine(7),
            evidence=made.evidence | evidence,
            node_id=None,
            daemon_version="0.1.0-test",
            round=rnd,
            answer=answer,
        )
        return wire.dumps(request.to_json())

    def send(self, body: bytes) -> dict[str, Any]:
        return wire.verify_response(self.svc.join(body), self.pki.pins()["join_signing_key_pin"])

    def challenge(self, key: RootTpmKey) -> dict[str, Any]:
        body = self.send(self.request(key))
        assert body["kind"] == "challenge"
        return body

    def answer(self, key: RootTpmKey, challenge: dict[str, Any]) -> dict[str, Any]:
        answer = PLUGINS.node_answer("tpm", challenge["challenge"], self.ctx(key))
        assert answer is not None
        return answer

    def refused(self, body: bytes, reason: str) -> None:
        nodes_before = self.rows("SELECT id, identity_generation FROM nodes ORDER BY id")
        with pytest.raises(Refused) as info:
            self.svc.join(body)
        assert (info.value.code, info.value.message) == ("ACCESS_DENIED", "Join refused")
        assert info.value.reason == f"tpm:{reason}"
        assert self.rows("SELECT id, identity_generation FROM nodes ORDER BY id") == nodes_before

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            return tx.query(sql, params)

    def with_settings(self, **settings: str) -> JoinService:
        base = {"tpm.pool": self.pool}
        return JoinService(self.store, self.svc.crypto, PLUGINS, base | settings)


def make_tpm_world(store: Store, memory_pki: Pki, swtpm: SwTpm) -> TpmWorld:
    """The root tenant, a tenant with a site and a tpm pool, and a JoinService trusting
    ``swtpm``'s EK CA for it."""
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        tenant, _ = tenancy.create_tenant(tx, "acme")
        site = tenancy.create_site(tx, tenant, "rack-t")["id"]
        pool = tenancy.create_pool(tx, tenant, site, "tpm", "bcd", {})["id"]
    settings = {"tpm.ek_ca": str(swtpm.ca_bundle), "tpm.pool": pool}
    svc = JoinService(store, join_crypto(memory_pki), PLUGINS, settings)
    return TpmWorld(store, memory_pki, svc, root, tenant, site, pool, swtpm)

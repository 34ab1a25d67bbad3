"""What the fuzzer needs of a running control plane: ids, credentials, joined identities.

Everything is made through the real interfaces (the API for sites, pools and tokens;
``POST /v1/join`` through the gateway, as bcd.join sends it, for every identity), so
the fuzzer holds real node certificates and keys to present at renewal, session and
vouch. Pools are split by purpose so fuzzing one cannot starve another:

- ``fuzz``: the pool of the fuzzer's node identities and of its valid JoinRequests;
- ``ctrl``: the control client's; never named by any generated input;
- ``sac``: the tenant-API fuzzer's (policies, tokens, revocations, deletions);
- ``disc`` and ``tpm``: the discovery and tpm attestors' (``serve`` flags name them).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bcd import __version__, pki, wire
from bench.common import join_once
from control.client import ApiClient

JOIN_POOL_SIZE = 48
JOIN_POOL_MAX_AGE_S = 120.0  # seals are judged stale after 300 s
MAC_POOL = tuple(f"0c:c4:7a:{i >> 8:02x}:{i & 0xFF:02x}:{(i * 7) & 0xFF:02x}" for i in range(64))
"""MACs shared by the vouch and discovery-join generators (so some joins find a vouch)."""


@dataclass
class Identity:
    name: str
    node_id: str
    site_id: str
    role: str
    key: ec.EllipticCurvePrivateKey = field(repr=False)
    chain: str = field(repr=False)

    @cached_property
    def leaf_der(self) -> bytes:
        first = self.chain.split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n"
        return x509.load_pem_x509_certificate(first.encode()).public_bytes(
            serialization.Encoding.DER
        )

    @cached_property
    def chain_der(self) -> list[bytes]:
        return [
            c.public_bytes(serialization.Encoding.DER)
            for c in x509.load_pem_x509_certificates(self.chain.encode())
        ]


@dataclass(frozen=True)
class BaseJoin:
    """A valid JoinRequest (JSON form) with a real sealed token bound to its CSR."""

    body: dict[str, Any]
    csr_der: bytes
    made_at: float


def random_claims() -> wire.Claims:
    u = uuid.uuid4()
    return wire.Claims(
        product_uuid=str(u),
        product_serial=f"FUZZ{u.hex[:12].upper()}",
        macs=(":".join(["0c", "c4", "7a", u.hex[12:14], u.hex[14:16], u.hex[16:18]]),),
        hostname=f"fuzz-{u.hex[:8]}",
        boot_id=str(uuid.uuid4()),
    )


def join_body(
    token: str,
    encryption_key: ec.EllipticCurvePublicKey,
    *,
    role: str = "node",
    claims: wire.Claims | None = None,
) -> tuple[dict[str, Any], ec.EllipticCurvePrivateKey, bytes]:
    """A JoinRequest as bcd.join builds it: a fresh key, its CSR, the token sealed to it."""
    key = pki.generate_key()
    csr_der = pki.make_csr(key)
    sealed = wire.seal_token(wire.parse_token(token), encryption_key, csr_der, int(time.time()))
    req = wire.JoinRequest(
        role=role,
        attestor="",
        sealed_token=sealed,
        csr_der=csr_der,
        claims=claims or random_claims(),
        evidence={},
        node_id=None,
        daemon_version=__version__,
    )
    return req.to_json(), key, csr_der


def foreign_identity() -> tuple[str, ec.EllipticCurvePrivateKey]:
    """A self-signed certificate that chains to nothing the gateway trusts."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fuzz-foreign")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=2))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key


@dataclass
class World:
    """One control plane as the fuzzer sees it (the one-process serve, or a fleet)."""

    label: str
    api_url: str
    gateway_port: int
    root_tenant: str
    credential: str = field(repr=False)
    pins: dict[str, str]
    encryption_jwk: dict[str, str]
    pools: dict[str, str]
    sites: dict[str, str]
    relay_port: int | None = None
    other_tenant: str = ""
    other_credential: str = field(default="", repr=False)
    identities: dict[str, Identity] = field(default_factory=dict)
    sacrificial_nodes: list[str] = field(default_factory=list)
    token_ids: list[str] = field(default_factory=list)
    jreq_ids: list[str] = field(default_factory=list)
    all_node_ids: list[str] = field(default_factory=list)
    _joins: list[BaseJoin] = field(default_factory=list, repr=False)
    _joins_at: float = 0.0
    _ids_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def api_port(self) -> int:
        return int(self.api_url.rsplit(":", 1)[1])

    @cached_property
    def encryption_key(self) -> ec.EllipticCurvePublicKey:
        return wire.public_key_of_jwk(self.encryption_jwk)

    @cached_property
    def encryption_pin(self) -> str:
        return pki.spki_pin(self.encryption_key)

    def api(self, credential: str | None = None) -> ApiClient:
        return ApiClient(self.api_url + "/api/compute", credential or self.credential)

    def token(self, pool: str, **fields: Any) -> dict[str, Any]:
        body = {"ttlSeconds": 86_400, **fields}
        return self.api().call(
            "POST", f"/v1/tenants/{self.root_tenant}/pools/{pool}/join-tokens", body
        )

    # --- valid JoinRequests, refreshed (called from the generator thread) ---------------

    def base_joins(self) -> list[BaseJoin]:
        with self._lock:
            if not self._joins or time.monotonic() - self._joins_at > JOIN_POOL_MAX_AGE_S:
                token = self.token(self.pools["fuzz"], maxUses=10_000)["token"]
                made = []
                for _ in range(JOIN_POOL_SIZE):
                    body, _key, csr = join_body(token, self.encryption_key)
                    made.append(BaseJoin(body, csr, time.monotonic()))
                self._joins, self._joins_at = made, time.monotonic()
            return self._joins

    def refresh_ids(self, max_age_s: float = 15.0) -> None:
        """The ids the tenant-API generator may name: only the ``sac`` and discovery
        pools' nodes and tokens are revoked or deleted by it."""
        with self._lock:
            if time.monotonic() - self._ids_at < max_age_s:
                return
            self._ids_at = time.monotonic()
            api, t = self.api(), self.root_tenant
            try:
                nodes = api.call("GET", f"/v1/tenants/{t}/nodes")["items"]
                mine = {self.pools["sac"], self.pools["disc"], self.pools["tpm"]}
                self.all_node_ids = [n["id"] for n in nodes][-500:]
                self.sacrificial_nodes = [n["id"] for n in nodes if n["poolId"] in mine][-200:]
                toks = api.call("GET", f"/v1/tenants/{t}/pools/{self.pools['sac']}/join-tokens")
                self.token_ids = [x["id"] for x in toks.get("items", [])][-100:]
                reqs: list[str] = []
                for pool in ("disc", "tpm"):
                    got = api.call("GET", f"/v1/tenants/{t}/pools/{self.pools[pool]}/join-requests")
                    reqs += [r["id"] for r in got.get("items", [])]
                self.jreq_ids = reqs[-200:]
            except Exception as exc:
                print(f"fuzz: refreshing ids from the API failed: {exc}", flush=True)


def unverified_payload(jws: str) -> dict[str, Any]:
    payload = jws.split(".")[1]
    obj: dict[str, Any] = json.loads(pki.b64url_decode(payload))
    return obj


async def join_identity(
    world: World, name: str, token: str, *, role: str = "node", claims: wire.Claims | None = None
) -> Identity:
    """Join one node through the gateway (as bcd.join does) and keep its key and chain."""
    body, key, _csr = join_body(token, world.encryption_key, role=role, claims=claims)
    outcome = await join_once(
        world.gateway_port, world.pins["serving_ca_spki_pin"], wire.dumps(body)
    )
    if outcome.status != 200:
        raise RuntimeError(
            f"joining {name} failed: {outcome.status} {outcome.error} {outcome.body[:300]!r}"
        )
    answer = wire.verify_response(outcome.body.decode("ascii"), world.pins["join_signing_key_pin"])
    leaf_pem = answer["chain"]
    leaf = x509.load_pem_x509_certificate(leaf_pem.encode())
    info = pki.leaf_info(leaf)
    return Identity(name, info.spiffe.node_id, info.spiffe.site_id, role, key, leaf_pem)


def make_identities(
    world: World, nodes: int = 4, renew_slots: int = 16, site_slots: int = 4
) -> None:
    """The fuzzer's identities: node0…, a site agent, one for the session attack, two
    sacrificial nodes (one of them revoked at once), the renewal slots r0… and the
    site-agent slots s0…, all joined for real."""
    pools = world.pools
    tok = world.token(pools["fuzz"], maxUses=nodes + 1)["token"]
    site_tok = world.token(pools["fuzz"], maxUses=1, role="site")["token"]
    sac_tok = world.token(pools["sac"], maxUses=2)["token"]
    slot_tok = world.token(pools["fuzz"], maxUses=renew_slots)["token"]
    site_slot_tok = world.token(pools["fuzz"], maxUses=site_slots, role="site")["token"]

    async def run() -> None:
        for i in range(nodes):
            world.identities[f"node{i}"] = await join_identity(world, f"node{i}", tok)
        world.identities["sess"] = await join_identity(world, "sess", tok)
        world.identities["site"] = await join_identity(world, "site", site_tok, role="site")
        world.identities["revoked"] = await join_identity(world, "revoked", sac_tok)
        world.identities["sac"] = await join_identity(world, "sac", sac_tok)
        for i in range(renew_slots):
            world.identities[f"r{i}"] = await join_identity(world, f"r{i}", slot_tok)
        for i in range(site_slots):
            world.identities[f"s{i}"] = await join_identity(
                world, f"s{i}", site_slot_tok, role="site"
            )

    trio.run(run)
    revoked = world.identities["revoked"]
    world.api().call(
        "POST",
        f"/v1/tenants/{world.root_tenant}/nodes/{revoked.node_id}/revoke-identity",
        {"reason": "fuzz: a revoked identity to present"},
    )
    world.refresh_ids(0)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_downloads(root: Path) -> Path:
    """A downloads tree: one real artifact, a symlink to /etc/passwd, a directory."""
    ok = root / "bcd" / "0.1.0"
    ok.mkdir(parents=True)
    (ok / "linux-amd64").write_bytes(b"\x7fELF" + bytes(range(256)) * 2400)  # ~600 KiB
    link = root / "bcd" / "0.1.1"
    link.mkdir()
    (link / "linux-arm64").symlink_to("/etc/passwd")
    (root / "bcd" / "0.2.0" / "linux-amd64").mkdir(parents=True)
    return root

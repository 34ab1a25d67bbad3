"""A stolen gateway: its files, its memory, its relay credential, its database login.

Each test acts as the attacker holding what a gateway holds (the bundle of ``pki
issue-gateway --out``, the JoinRequest bytes it sees, its PostgreSQL login) and shows
what that buys: it can relay and drop, but it cannot read a join token, spend a token
use for a CSR of its own, mint a certificate or write anything that admits a node.
"""

from __future__ import annotations

import base64
import functools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import psycopg.errors
import pytest
import trio
from cryptography.hazmat.primitives import serialization

from bcd import pki as bcd_pki
from bcd import wire
from control import gatewaypki, relay
from control.http import Request, Response, error_response, serve
from control.pki import PkiSetupError, load_pki, server_ssl_context
from control.store import open_store
from tests.world import (
    BIN,
    SECRET,
    Node,
    cli_env,
    drop_login,
    fleet,
    gateway_login,
    pg_schema,
    pg_schema_url,
    relay_url,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

BUNDLE_FILES = {
    "gateway.crt", "gateway.key", "relay.crt", "relay.key", "node-ca.crt", "serving-ca.crt",
    "gateway.json",
}  # fmt: skip


def test_the_gateway_bundle_holds_only_its_own_two_keys(tmp_path: Path, pki_template: Path) -> None:
    out = tmp_path / "bundle"
    done = subprocess.run(
        [str(BIN / "better-compute"), "pki", "issue-gateway", "--san", "gw.example", "--out",
         str(out)],
        env=cli_env(pki_template), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} == BUNDLE_FILES
    assert out.stat().st_mode & 0o777 == 0o700
    for name in ("gateway.key", "relay.key"):
        assert (out / name).stat().st_mode & 0o777 == 0o600
    bundle = gatewaypki.load_bundle(out)
    loaded = load_pki(pki_template / "pki", SECRET.encode())
    pki_keys = {k.public_key().public_numbers() for k in loaded.private_keys()}
    held = {bundle.serving_key.public_key().public_numbers(),
            bundle.relay_key.public_key().public_numbers()}  # fmt: skip
    assert not held & pki_keys  # no CA key, no JoinService signing or encryption key
    for path in out.iterdir():
        text = path.read_bytes()
        assert b"ENCRYPTED PRIVATE KEY" not in text
        assert SECRET.encode() not in text
    # a node-ca.crt without the node CA is refused at load: nodes present their leaf
    # alone, so such a gateway would refuse every one of them
    node_cas = (out / "node-ca.crt").read_bytes()
    for only in (bcd_pki.cert_pem(loaded.node_root_ca), bcd_pki.cert_pem(loaded.node_ca)):
        (out / "node-ca.crt").write_text(only)
        with pytest.raises(PkiSetupError, match="must hold the node CA and the node root CA"):
            gatewaypki.load_bundle(out)
    (out / "node-ca.crt").write_bytes(node_cas)
    assert gatewaypki.load_bundle(out).node_ca_pem == node_cas.decode("ascii")
    # a key readable by another user is refused at load
    (out / "relay.key").chmod(0o640)
    with pytest.raises(Exception, match="can be read by other users"):
        gatewaypki.load_bundle(out)


def _spawn_join(node: Node, token: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [str(BIN / "bcd"), "join", "--sysfs-root", str(node.sysfs), "--config", str(node.config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(node.root, secret=False),
    )
    assert proc.stdin is not None
    proc.stdin.write((token + "\n").encode())
    proc.stdin.close()
    return proc


async def _capture_join(node: Node, token: str, bundle: gatewaypki.GatewayBundle) -> dict[str, Any]:
    """Act as the gateway bcd dials (its real serving certificate): keep the JoinRequest."""
    seen: list[bytes] = []
    got = trio.Event()

    async def handler(req: Request) -> Response:
        seen.append(req.body)
        got.set()
        return error_response("UNAVAILABLE", "later", [("retry-pushback-ms", "60000")])

    ctx = server_ssl_context(bundle.serving_chain_pem, bundle.serving_key)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            functools.partial(serve, handler, "127.0.0.1", 0, ssl_context=ctx)
        )
        lines = node.config.read_text().splitlines()
        node.config.write_text("\n".join(
            f'gateway_url = "https://127.0.0.1:{port}"' if ln.startswith("gateway_url") else ln
            for ln in lines) + "\n")  # fmt: skip
        proc = _spawn_join(node, token)
        try:
            with trio.fail_after(30):
                await got.wait()
        finally:
            proc.kill()
            proc.wait(10)
        nursery.cancel_scope.cancel()
    body: dict[str, Any] = json.loads(seen[0])
    return body


async def test_a_stolen_gateway_cannot_read_a_token_or_spend_it_for_its_own_csr(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=1, gateways=0) as f:
        bundle = gatewaypki.load_bundle(f.bundle)
        site, pool = f.api.site_and_pool()
        minted = f.api.token(pool, maxUses=1)
        node = Node.make(tmp_path / "victim", f.api, site, seed=7)
        seen = await _capture_join(node, minted["token"], bundle)

        # what crossed the gateway: a sealed token, never the bearer
        assert minted["token"] not in json.dumps(seen)
        sealed = seen["sealed_token"]
        kid = json.loads(bcd_pki.b64url_decode(sealed.split(".")[0]))["kid"]
        for key in (bundle.serving_key, bundle.relay_key):
            with pytest.raises(wire.WireError, match="does not open"):
                wire.open_seal(sealed, key, kid)

        own_key = bcd_pki.generate_key()
        own_csr = base64.b64encode(bcd_pki.make_csr(own_key)).decode()
        header = json.loads(bcd_pki.b64url_decode(sealed.split(".")[0]))
        header["csr"] = bcd_pki.sha256_hex(bcd_pki.make_csr(own_key))
        rebound = ".".join([bcd_pki.b64url(json.dumps(header).encode()), *sealed.split(".")[1:]])
        attempts = [
            {**seen, "csr": own_csr},  # the seal names the victim's CSR
            {**seen, "csr": own_csr, "sealed_token": rebound},  # the header is GCM's AAD
        ]
        async with httpx.AsyncClient(verify=relay.client_context(bundle)) as client:
            for body in attempts:
                answer = await client.post(relay_url(f.api) + "/v1/join", json=body)
                assert answer.status_code == 403
                assert answer.json() == {"code": "ACCESS_DENIED", "message": "Join refused"}
            # the relay credential reaches no tenant API path
            answer = await client.post(
                relay_url(f.api) + f"/api/compute/v1/tenants/{f.api.root_tenant}/sites",
                json={"name": "x"},
            )
            assert answer.status_code == 404
        row = f.api.one("SELECT uses_left FROM join_tokens WHERE id = ?", (minted["id"],))
        assert row == {"uses_left": 1}  # no use spent
        assert f.api.one("SELECT count(*) AS n FROM node_certs") == {"n": 0}
        reasons = [e["reason"] for e in f.api.events(type_="security.join.refused")]
        assert reasons == ["join-token:seal-csr", "join-token:seal-invalid"]


async def test_the_relay_listener_takes_only_relay_certificates(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=1, gateways=0) as f:
        bundle = gatewaypki.load_bundle(f.bundle)
        url = relay_url(f.api) + "/v1/join"
        anchor = relay.client_context(bundle)  # only to build the others from its CA
        del anchor
        import ssl

        def ctx_with(chain: str | None, key: Any) -> ssl.SSLContext:
            ctx = ssl.create_default_context(cadata=bundle.serving_ca_pem)
            if chain is not None:
                from control.pki import load_chain

                load_chain(ctx, chain, key)
            return ctx

        async with httpx.AsyncClient(verify=ctx_with(None, None)) as client:
            answer = await client.post(url, json={})
            assert answer.status_code == 401
            assert answer.json()["code"] == "UNAUTHENTICATED"
        # the gateway's serving certificate (serverAuth only) is not a relay credential
        serving = ctx_with(bundle.serving_chain_pem, bundle.serving_key)
        async with httpx.AsyncClient(verify=serving) as client:
            with pytest.raises(httpx.TransportError):
                await client.post(url, json={})


def test_the_gateway_database_role_reads_little_and_writes_nothing(tmp_path: Path) -> None:
    with pg_schema() as schema:
        store = open_store(pg_schema_url(schema))
        store.migrate()
        store.close()
        url = gateway_login(schema)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT serial, der, revoked_at FROM node_certs").fetchall()
                conn.execute("SELECT id, retired_at FROM nodes").fetchall()
                conn.execute("SELECT max(version) FROM schema_migrations").fetchall()
                denied = [
                    "SELECT secret_sha256 FROM join_tokens",
                    "SELECT hardware_key FROM nodes",
                    "SELECT * FROM api_credentials",
                    "SELECT * FROM join_requests",
                    "INSERT INTO join_tokens (id, tenant_id, pool_id, site_id, role, "
                    "secret_sha256, max_uses, uses_left, created_at, expires_at) "
                    "VALUES ('jt_x', 't', 'p', 's', 'node', 'h', 1, 1, 0, 9)",
                    "UPDATE join_tokens SET uses_left = uses_left + 1",
                    "UPDATE join_requests SET state = 'approved'",
                    "UPDATE node_certs SET revoked_at = NULL",
                    "INSERT INTO node_certs (serial) VALUES ('ff')",
                    "DELETE FROM renewals",
                    "UPDATE nodes SET retired_at = NULL",
                    "INSERT INTO discovery_vouches (id) VALUES ('v')",
                    "CREATE TABLE node_certs_copy (x int)",
                ]
                for sql in denied:
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        conn.execute(sql)
        finally:
            drop_login(url)


async def test_a_stolen_gateway_cannot_vouch_as_a_site_agent(
    tmp_path: Path, pki_template: Path
) -> None:
    with fleet(tmp_path, pki_template, apis=1, gateways=1) as f:
        (gw,) = f.gateways
        bundle = gatewaypki.load_bundle(f.bundle)
        site, agents = f.api.site_and_pool()
        agent = Node.make(tmp_path / "agent", f.api, site, seed=21, gateway_port=gw.port)
        done = agent.join(f.api.token(agents, role="site")["token"], "--role", "site")
        assert done.returncode == 0, done.stderr
        # the real site agent vouches through the gateway: accepted
        done = agent.bcd("vouch", "--mac", "0c:c4:7a:00:00:01", "--boot-lease-epoch", "7")
        assert done.returncode == 0, done.stderr
        # the stolen gateway knows the agent's certificate (every handshake shows it, and
        # its database login reads node_certs), not its key
        leaf = bcd_pki.load_pem_chain(
            json.loads((agent.data_dir / "identity.json").read_text())["chain"]
        )[0]
        der = leaf.public_bytes(serialization.Encoding.DER)
        headers = {relay.PEER_CERT_HEADER: base64.b64encode(der).decode()}
        now = int(time.time() * 1000)
        forged = [
            {"mac": "0c:c4:7a:00:00:02", "boot_lease_epoch": 9},  # no proof at all
            {"mac": "0c:c4:7a:00:00:02", "boot_lease_epoch": 9, "client_time": now,
             "pop_sig": bcd_pki.b64url(b"\x01" * 64)},  # a made-up signature
        ]  # fmt: skip
        async with httpx.AsyncClient(verify=relay.client_context(bundle)) as client:
            for body in forged:
                answer = await client.post(
                    relay_url(f.api) + "/v1/discovery/vouch", json=body, headers=headers
                )
                assert answer.status_code in (400, 403), answer.text
        rows = f.api.one("SELECT count(*) AS n FROM discovery_vouches")
        assert rows == {"n": 1}  # only the real agent's

"""A whole run's logs hold no secret, and hold the structured line of each event.

A real ``better-compute serve`` at ``--log-level debug`` (JSON, then text) with its PKI
secret from ``--secret-file``, the CLI with a tenant's bearer credential, a join token
created and used by ``bcd join``, a vouch, a join refused for a wrong token and one for
a used-up token, a join request approved and joined, ``bcd node --log-level debug``
renewing, holding sessions and stopped by a pushed revocation. Then every log of the
run (serve's, bcd node's, every other process's stderr) is read: none holds the PKI
secret, a join token or its secret part, the bearer or its secret part, a sealed token,
or a line of any private key's PEM body (the node keys and every key file under serve's
PKI directory, read from disk after the run)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12

from bcd import wire, wirejson
from control import tenancy
from control.store import open_store
from tests.e2e import BIN, SECRET, ControlPlane, Node, cli_env, root_site_store, start_serve
from tests.world import E2EWorld, leaf, post_join, wait_for
from tests.world.joins import join_body, machine

pytestmark = pytest.mark.e2e
EPOCH = 1_764_400_000


def _start(e2e: E2EWorld, log_format: str) -> tuple[ControlPlane, str, str, str]:
    """serve with the secret from --secret-file (none in its environment), at debug."""
    db_url, site, (agents, pool) = root_site_store(
        e2e.tmp, "dc-1", ("site-agents", {}), ("discovered", {"joinAttestors": ["discovery"]})
    )
    home = e2e.tmp / "cp"
    home.mkdir()
    shutil.copytree(e2e.pki_template / "pki", home / "pki")
    secret = home / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    store = open_store(db_url)
    with store.tx() as tx:
        root = tenancy.root_tenant(tx)
        assert root is not None
        credential = tenancy.create_credential(tx, root)
    cred_file = home / "root.credential"
    cred_file.write_text(credential + "\n")
    cred_file.chmod(0o600)
    args = [
        "--db", db_url, "--api-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0",
        "--gateway-san", "127.0.0.1", "--secret-file", str(secret), "--discovery-pool", pool,
        "--cert-ttl-seconds", "10", "--log-level", "debug", "--log-format", log_format,
    ]  # fmt: skip
    proc, info = start_serve(home, args, cli_env(home, secret=False))
    cp = ControlPlane(home, db_url, proc, info["api"], info["gateway_port"], root, cred_file,
                      store, info)  # fmt: skip
    e2e.stack.callback(cp.stop)
    return cp, site, agents, pool


def _mac(node: Node) -> str:
    return (node.sysfs / "sys" / "class" / "net" / "eth0" / "address").read_text().strip()


def _private_key_texts(pki_dir: Path, node_keys: list[Path]) -> list[str]:
    """What of each private key a log must not hold: the body lines of its unencrypted
    PKCS#8 PEM, its private scalar in hex and, for serve's encrypted key files
    (PKCS#12 under the secret), the file's bytes in base64 too."""
    keys: list[ec.EllipticCurvePrivateKey] = []
    texts: list[str] = []
    for path in sorted(pki_dir.glob("*.key")):
        data = path.read_bytes()
        key, _cert, _more = pkcs12.load_key_and_certificates(data, SECRET.encode())
        assert isinstance(key, ec.EllipticCurvePrivateKey), path
        keys.append(key)
        b64 = base64.b64encode(data).decode()
        texts += [b64[i : i + 64] for i in range(0, len(b64) - 63, 64)]
    for path in node_keys:
        key = serialization.load_pem_private_key(path.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey), path
        keys.append(key)
    for key in keys:
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        texts += [ln for ln in pem.splitlines() if not ln.startswith("-----") and len(ln) >= 16]
        texts.append(format(key.private_numbers().private_value, "064x"))
    return texts


def _records(text: str, log_format: str) -> list[dict[str, Any]]:
    """The serve log's lines as JSON objects (every line must be one), or for text the
    lines with their ``key=value`` fields, as ``{"line": …}``."""
    if log_format == "json":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{"line": line} for line in text.splitlines()]


def _has(records: list[dict[str, Any]], log_format: str, event: str, **fields: Any) -> bool:
    for rec in records:
        if log_format == "json":
            if rec.get("event") == event and all(rec.get(k) == v for k, v in fields.items()):
                return True
        else:
            line = rec["line"]
            pairs = [f"event={event}"] + [f"{k}={v}" for k, v in fields.items()]
            if all(f" {p}" in line for p in pairs):
                return True
    return False


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_whole_runs_logs_hold_no_secret(tmp_path: Path, e2e: E2EWorld, log_format: str) -> None:
    cp, site, agents, pool = _start(e2e, log_format)
    stderrs: list[str] = []

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        done = cp.cli(*args)
        stderrs.append(done.stderr)
        assert done.returncode == 0, done.stderr
        return done

    # a join token, created with the CLI and used by bcd join
    token_file = tmp_path / "site.token"
    cli("join-tokens", "create", "--tenant", cp.root_tenant, "--pool", agents, "--role", "site",
        "--out", str(token_file))  # fmt: skip
    token = token_file.read_text().strip()
    site_agent = Node.make(tmp_path / "site-agent", cp, site, seed=1)
    joined = site_agent.join(token, "--role", "site")
    stderrs.append(joined.stderr)
    assert joined.returncode == 0, joined.stderr
    site_agent_id = leaf(site_agent).spiffe.node_id

    # the site agent vouches for a machine that booted (before its 10 s leaf expires)
    discovered = Node.make(tmp_path / "machine", cp, site, seed=2)
    vouched = site_agent.bcd(
        "vouch", "--mac", _mac(discovered), "--boot-lease-epoch", str(EPOCH), "--ip", "127.0.0.1"
    )
    stderrs.append(vouched.stderr)
    assert vouched.returncode == 0, vouched.stderr

    # refused joins: a wrong secret for the token's id, and the used-up token itself
    jwk = cp.well_known()["join"]["encryptionJwk"]
    enc = wirejson.public_key_of_jwk(jwk)
    token_id = wire.parse_token(token).token_id
    wrong = f"bcjt_{token_id}.{'Q' * 43}"
    sealed: list[str] = []
    for attempt_token, n in ((wrong, 7), (token, 8)):
        attempt = join_body(attempt_token, enc, machine(n))
        sealed.append(json.loads(attempt.body)["sealed_token"])
        status, answer = trio.run(post_join, cp, attempt.body)
        assert (status, answer["message"]) == (403, "Join refused")

    # a machine waits on its join request, which the CLI approves; it joins
    agent = discovered.spawn_join("--attestor", "discovery")
    try:
        row: dict[str, Any] | None = None
        deadline = time.monotonic() + 30
        while row is None:
            assert agent.poll() is None, agent.communicate()
            assert time.monotonic() < deadline, "no join request was recorded"
            row = cp.one("SELECT id FROM join_requests")
            time.sleep(0.1)
        cli("join-requests", "approve", row["id"], "--tenant", cp.root_tenant, "--pool", pool)
        _out, err = agent.communicate(timeout=60)
        stderrs.append(err)
        assert agent.returncode == 0, err
    finally:
        if agent.poll() is None:
            agent.kill()
    node_id = leaf(discovered).spiffe.node_id
    first_serial = leaf(discovered).serial_hex

    # bcd node at debug: it renews, holds sessions, and stops when its identity is revoked
    node_log = discovered.root / "node.log"
    with node_log.open("wb") as stderr:
        proc = subprocess.Popen(
            [str(BIN / "bcd"), "node", "--config", str(discovered.config),
             "--log-level", "debug", "--log-format", log_format],
            env=cli_env(discovered.root, secret=False),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )  # fmt: skip
        try:
            wait_for(lambda: leaf(discovered).serial_hex != first_serial, 30, "a renewal")
            serve_log = cp.home / "serve.log"
            wait_for(lambda: "session.opened" in serve_log.read_text(), 20, "a session")
            cli("nodes", "revoke-identity", node_id, "--tenant", cp.root_tenant)
            assert proc.wait(20) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    cp.stop()

    serve_text = (cp.home / "serve.log").read_text()
    node_text = node_log.read_text()
    logs = {"serve": serve_text, "bcd node": node_text, **{f"stderr {i}": s
            for i, s in enumerate(stderrs)}}  # fmt: skip

    # --- what no log may hold -------------------------------------------------------
    credential = cp.root_credential_file.read_text().strip()
    secrets = {
        "the PKI secret": SECRET,
        "the join token": token,
        "the join token's secret": token.split(".", 1)[1],
        "the wrong token's secret": wrong.split(".", 1)[1],
        "the bearer credential": credential,
        "the bearer's secret": credential.split(".", 1)[1],
        **{f"sealed token {i}": s for i, s in enumerate(sealed)},
    }
    node_keys = [p for n in (site_agent, discovered) for p in n.data_dir.rglob("*.key")]
    assert discovered.data_dir / "node.key" in node_keys
    key_lines = _private_key_texts(cp.home / "pki", node_keys)
    assert len(key_lines) >= 7 * 4 + 2 * 3, key_lines  # 7 PKI keys, 2 node keys at least
    for where, text in logs.items():
        for what, value in secrets.items():
            assert value not in text, f"{what} is in the {where} log"
        for line in key_lines:
            assert line not in text, f"a private key's line is in the {where} log"

    # --- what the logs must hold: one structured line per event ---------------------
    recs = _records(serve_text, log_format)
    assert _has(recs, log_format, "security.join-token.created", token_id=token_id)
    assert _has(recs, log_format, "node.joined", node_id=site_agent_id, attestor="join-token")
    assert _has(recs, log_format, "discovery.vouched", vouched_by=site_agent_id)
    assert _has(recs, log_format, "security.join.refused")
    assert _has(recs, log_format, "security.join-request.approved", request_id=row["id"])
    assert _has(recs, log_format, "node.joined", node_id=node_id, attestor="discovery")
    assert _has(recs, log_format, "node.renewed", node_id=node_id, previous_serial=first_serial)
    assert _has(recs, log_format, "session.opened", node_id=node_id)
    assert _has(recs, log_format, "session.closed", node_id=node_id)
    assert _has(recs, log_format, "security.certificate-revoked", node_id=node_id)
    assert _has(recs, log_format, "revocation.pushed", node_id=node_id)
    assert any("DEBUG" in line for line in serve_text.splitlines())  # --log-level debug
    node_lines = [ln for ln in node_text.splitlines() if ln.strip()]
    if log_format == "json":
        last = json.loads(node_lines[-1])
        assert (last["level"], last["message"]) == (
            "ERROR",
            "agent: this node's certificate was revoked",
        )
        assert all(json.loads(ln)["logger"] for ln in node_lines)  # every line is JSON
    else:
        assert node_lines[-1] == "agent: this node's certificate was revoked"

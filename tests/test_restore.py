"""A control plane restored from an older backup, as its nodes see it.

A node whose certificate the store has no row for (it joined or renewed after the
backup) is told ``unknown-certificate``, prints a message of its own (not
"revoked") and keeps retrying; a node the backup knows carries on; a revocation
after the restore still stops a node, and ``bcd doctor`` then fails naming it.
docs/operators.md "Backup and restore" quotes what is shown here.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import stat
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives import serialization

from bcd import pki as bpki
from bcd.errors import CertificateRevoked, CertificateUnknown, RetryableError
from bcd.revocation import NOT_ACCEPTED, judge_unauthenticated
from control import nodes
from control.clock import ManualClock
from control.pki import Pki
from control.renewal import UNKNOWN_CERTIFICATE, live_peer_or_details
from control.store import open_store
from tests.e2e import BIN, cli_env, run, start_serve
from tests.gatewaycalls import node_post
from tests.world import (
    ControlPlane,
    E2EWorld,
    Node,
    RunningNode,
    loaded,
    node_id,
    renew_body,
    wait_for,
)
from tests.world.agent import joined_state
from tests.world.renewals import Env

UNKNOWN = "the control plane does not know this node's certificate"
CAUSE = "its database was probably restored from a backup older than this certificate"
WAY_BACK = "join again as root: bcd join --reset --yes, then bcd join"
REVOKED = "agent: this node's certificate was revoked"


# --- the store's answer ------------------------------------------------------------------


def test_the_answer_names_why_a_certificate_is_not_live(env: Env, clock: ManualClock) -> None:
    node = env.join(60)
    retired = env.join(61)
    stray = env.crypto.issue_leaf(
        bpki.generate_key().public_key(),
        bpki.SpiffeId(env.pki.trust_domain, env.site, node.node_id),
        "node",
        (),
        datetime.now(UTC),
        3600,
    )
    env.sql("UPDATE nodes SET retired_at = 1 WHERE id = ?", (retired.node_id,))
    with env.store.tx() as tx:
        peer, details = live_peer_or_details(tx, node.der)
        assert peer is not None
        assert (peer.node_id, peer.serial, details) == (node.node_id, node.serial, {})
        assert 0 < peer.remaining_ms <= 86_400_001  # the session's life: the certificate's
        # signed by the CA, never recorded: what a restored older backup sees
        der = stray.public_bytes(serialization.Encoding.DER)
        assert live_peer_or_details(tx, der) == (None, {"reason": UNKNOWN_CERTIFICATE})
        assert live_peer_or_details(tx, b"junk") == (None, {"reason": UNKNOWN_CERTIFICATE})
        assert live_peer_or_details(tx, retired.der) == (None, {"reason": "node-retired"})
    issued = clock.now_ms()
    clock.advance(86_400_001)
    with env.store.tx() as tx:
        assert live_peer_or_details(tx, node.der) == (None, {"reason": "expired"})
    clock.set(issued)
    with env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign)
        peer, details = live_peer_or_details(tx, node.der)
    assert peer is None
    assert details["reason"] == "revoked"
    assert details["notice"]  # the signed RevocationNotice goes with it


def test_a_live_check_reads_the_certificate_and_its_node_in_one_statement(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's open asks this of every node: one statement, not one a table."""
    node = env.join(62)
    retired = env.join(63)
    env.sql("UPDATE nodes SET retired_at = 1 WHERE id = ?", (retired.node_id,))
    with env.store.tx() as tx:
        tx.now_ms()
        seen: list[str] = []
        real = tx.query

        def query(sql: str, params: Any = ()) -> list[dict[str, Any]]:
            seen.append(sql)
            return real(sql, params)

        monkeypatch.setattr(tx, "query", query)
        peer, _ = live_peer_or_details(tx, node.der)
        assert peer is not None
        assert peer.node_id == node.node_id
        assert live_peer_or_details(tx, retired.der) == (None, {"reason": "node-retired"})
    assert len(seen) == 2
    assert all("JOIN nodes" in sql for sql in seen)


def test_the_node_judges_unknown_apart_from_revoked(tmp_path: Path, memory_pki: Pki) -> None:
    """Pure verdicts: only a signed notice revokes; ``unknown-certificate`` is its own
    retryable message naming the serial and the way back; nothing else is trusted."""
    now = datetime.now(UTC)
    state = joined_state(tmp_path, memory_pki, now.timestamp())
    unknown = judge_unauthenticated(None, "sha256:x", state, now, UNKNOWN_CERTIFICATE)
    assert isinstance(unknown, CertificateUnknown)
    assert str(unknown) == (
        f"{UNKNOWN} (node {state.identity.node_id}, serial {state.leaf_info.serial_hex}): "
        f"{CAUSE}; bcd keeps retrying until the certificate expires at "
        f"{state.identity.not_after}; unless the operator restores a newer backup, {WAY_BACK}"
    )
    other = judge_unauthenticated(None, "sha256:x", state, now, "revoked")
    assert type(other) is RetryableError  # "revoked" without a signed notice: a claim only
    assert str(other) == NOT_ACCEPTED
    assert not isinstance(
        judge_unauthenticated("forged", "sha256:x", state, now, UNKNOWN_CERTIFICATE),
        CertificateRevoked,
    )
    later = now + timedelta(days=2)  # after its end: expired wins over the hint
    assert "expired" in str(judge_unauthenticated(None, "x", state, later, UNKNOWN_CERTIFICATE))


# --- end to end: back up, join, restore ------------------------------------------------


def backup(cp: ControlPlane, out: Path) -> subprocess.CompletedProcess[str]:
    """``better-compute backup``: an online copy with SQLite's backup API."""
    return run(
        [str(BIN / "better-compute"), "backup", "--db", cp.db_url, "--out", str(out), "--json"],
        env=cli_env(cp.home, secret=False),
    )


def restart(e2e: E2EWorld, cp: ControlPlane) -> ControlPlane:
    """``serve`` again on the same PKI, database URL and gateway port."""
    (cp.home / "ready.json").unlink()
    (cp.home / "serve.log").rename(cp.home / "serve.log.1")
    proc, info = start_serve(
        cp.home,
        [
            "--db", cp.db_url,
            "--api-listen", "127.0.0.1:0",
            "--gateway-listen", f"127.0.0.1:{cp.gateway_port}",
            "--gateway-san", "127.0.0.1",
        ],
        cli_env(cp.home),
    )  # fmt: skip
    again = dataclasses.replace(
        cp, proc=proc, api=info["api"], store=open_store(cp.db_url), ready=info
    )
    e2e.stack.callback(again.stop)
    return again


def joined(e2e: E2EWorld, cp: ControlPlane, site: str, pool: str, name: str, seed: int) -> Node:
    node = e2e.node(cp, site, name, seed=seed)
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    return node


def running(e2e: E2EWorld, node: Node) -> RunningNode:
    agent = RunningNode(node)
    e2e.stack.callback(agent.stop)
    return agent


async def test_a_node_unknown_to_a_restored_backup_is_told_so_and_not_revoked(
    e2e: E2EWorld, tmp_path: Path
) -> None:
    cp = e2e.control_plane()
    db = tmp_path / "store.db"
    site, pool = cp.site_and_pool()
    a = joined(e2e, cp, site, pool, "a", 1)
    done = backup(cp, tmp_path / "backup.db")  # while serve runs
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bytes"] == (tmp_path / "backup.db").stat().st_size
    assert stat.S_IMODE((tmp_path / "backup.db").stat().st_mode) == 0o600
    b = joined(e2e, cp, site, pool, "b", 2)
    cp.stop()
    for name in ("store.db", "store.db-wal", "store.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    shutil.copyfile(tmp_path / "backup.db", db)
    cp = restart(e2e, cp)
    assert cp.one("SELECT id FROM nodes WHERE id = ?", (node_id(b),)) is None

    # /v1/renew says it too, with the reason beside code and message
    pin = cp.pins()["serving_ca_spki_pin"]
    state_b = loaded(b)
    answer = await node_post(cp.gateway_port, pin, state_b, "/v1/renew", renew_body(state_b))
    assert answer.status == 401
    assert json.loads(answer.body) == {
        "code": "UNAUTHENTICATED",
        "message": "this certificate is not known to the control plane",
        "reason": UNKNOWN_CERTIFICATE,
    }

    agent_b = running(e2e, b)
    agent_a = running(e2e, a)
    serial_b = state_b.leaf_info.serial_hex
    wait_for(lambda: f"serial {serial_b}): {CAUSE}" in agent_b.log(), 30, "B's message")
    wait_for(lambda: agent_a.sessions() >= 1, 30, "A's session")  # the backup knows A
    await trio.sleep(2)
    log_b = agent_b.log()
    assert agent_b.proc.poll() is None, log_b  # retrying, not stopped as revoked
    assert REVOKED not in log_b
    assert "certificate revoked" not in log_b
    assert f"{UNKNOWN} (node {node_id(b)}, serial {serial_b})" in log_b
    assert WAY_BACK in log_b
    assert "reconnecting in 300.0 s" in log_b  # slower than a broken session's 1 s
    assert agent_a.proc.poll() is None

    # bcd doctor on B shows what the agent last heard (it makes no network call)
    doctor = b.bcd("doctor", "--sysfs-root", str(b.sysfs))
    assert doctor.returncode == 0, doctor.stdout
    session = [line for line in doctor.stdout.splitlines() if line.startswith("warn  session")]
    assert len(session) == 1, doctor.stdout
    assert f"{UNKNOWN} (serial {serial_b})" in session[0]
    assert session[0].endswith(WAY_BACK)

    # a revocation made now still stops A, and doctor then fails naming it
    done = cp.cli("nodes", "revoke-identity", node_id(a), "--tenant", cp.root_tenant)
    assert done.returncode == 0, done.stderr
    agent_a.proc.wait(30)
    assert agent_a.proc.returncode == 1
    assert REVOKED in agent_a.log()
    doctor = a.bcd("doctor", "--sysfs-root", str(a.sysfs))
    assert doctor.returncode == 1, doctor.stdout
    line = next(x for x in doctor.stdout.splitlines() if x.startswith("fail  revoked"))
    assert f"serial {loaded(a).leaf_info.serial_hex}" in line
    assert line.endswith("as root, bcd join --reset --yes, then bcd join")


def test_backup_writes_a_new_0600_file_that_opens_and_never_overwrites(
    e2e: E2EWorld, tmp_path: Path
) -> None:
    cp = e2e.control_plane()
    site, _pool = cp.site_and_pool()
    out = tmp_path / "copy.db"
    done = backup(cp, out)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    copy = sqlite3.connect(out)
    try:
        assert copy.execute("SELECT id FROM sites").fetchall() == [(site,)]
        assert copy.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    finally:
        copy.close()
    before = out.read_bytes()
    again = backup(cp, out)
    assert again.returncode == 1
    assert again.stderr == (
        f"better-compute: ALREADY_EXISTS: {out} exists; --out never writes over a file\n"
    )
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".copy.db")] == []


def test_backup_names_pg_dump_for_postgresql_and_a_missing_database(tmp_path: Path) -> None:
    env = cli_env(tmp_path, secret=False)
    args = [str(BIN / "better-compute"), "backup", "--out", str(tmp_path / "x.db")]
    done = run([*args, "--db", "postgresql://127.0.0.1/test"], env=env)
    assert done.returncode == 2
    assert "back up PostgreSQL with pg_dump" in done.stderr
    done = run([*args, "--db", f"sqlite:///{tmp_path / 'none.db'}"], env=env)
    assert done.returncode == 1
    assert done.stderr == (
        f"better-compute: NOT_FOUND: no database at {tmp_path / 'none.db'} (name it with --db)\n"
    )
    assert not (tmp_path / "none.db").exists()
    assert not (tmp_path / "x.db").exists()

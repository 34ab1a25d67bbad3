"""A renewal through :class:`control.gateway.NodeCalls`, the API side of ``POST
/v1/renew``: the client certificate's liveness, the node's rate and RenewService's
own checks are judged in one transaction, in one worker-thread hop, and in the seed's
order (UNAUTHENTICATED, then RESOURCE_EXHAUSTED, then the body, then the renewal).
A request turned away before Renew's own checks leaves everything as it was: no
proof spent, no refusal event."""

from __future__ import annotations

import json
import threading
from functools import partial
from typing import Any

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bcd import pki, wire
from control import nodes
from control.gateway import NodeCalls
from control.http import Request, Response
from control.metrics import Metrics
from control.renewal import RENEWALS_PER_HOUR, RenewService
from tests.world.renewals import Env, NodeId


def node_calls(env: Env, metrics: Metrics) -> NodeCalls:
    """NodeCalls as serve builds it: RenewService counts into the same metrics."""
    renewals = RenewService(env.store, env.crypto, metrics)
    return NodeCalls(env.store, env.joins, renewals, trio.CapacityLimiter(2), metrics)


def renew_request(env: Env, node: NodeId, peer: bytes | None) -> Request:
    body = env.body(node).body
    return Request("POST", "/v1/renew", {}, {}, body, peer, "127.0.0.1:4000")


async def renew_once(env: Env, calls: NodeCalls, node: NodeId) -> NodeId:
    """The node renews through ``calls``; its new identity (the new key, the new chain)."""
    attempt = env.body(node)
    req = Request("POST", "/v1/renew", {}, {}, attempt.body, node.der, "127.0.0.1:4000")
    answer = await calls.handle(req)
    assert answer.status == 200, answer.body
    body = wire.verify_response(answer.body.decode("ascii"), env.pin)
    return NodeId(body["node_id"], body["site_id"], attempt.key, body["chain"])


def counted(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("bc_renewals_total", {"outcome": outcome})
    return value or 0.0


def counted_refusal(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("bc_renewal_refusals_total", {"reason": reason})
    return value or 0.0


def assert_refused(answer: Response) -> None:
    """Renew's own refusal: 403, its reason in the metrics and the event only."""
    assert answer.status == 403
    assert json.loads(answer.body)["message"] == "Renew refused"


def refusal_events(env: Env) -> int:
    return len(env.events(env.tenant, "security.renew.refused"))


async def test_a_renewal_is_one_transaction_and_answers_the_new_identity(env: Env) -> None:
    node = env.join(1)
    calls = node_calls(env, Metrics())
    durations: list[float] = []
    env.store.on_tx = durations.append
    answer = await calls.handle(renew_request(env, node, node.der))
    env.store.on_tx = None
    body: dict[str, Any] = wire.verify_response(answer.body.decode("ascii"), env.pin)
    assert answer.status == 200
    assert (body["kind"], body["node_id"]) == ("renewed", node.node_id)
    assert len(durations) == 1  # the caller's checks and RenewService's own
    assert len(env.rows("SELECT * FROM renewals WHERE node_id = ?", (node.node_id,))) == 1


async def test_a_revoked_client_certificate_is_unauthenticated_before_anything_else(
    env: Env,
) -> None:
    node = env.join(2)
    env.sql("UPDATE node_certs SET revoked_at = 1 WHERE serial = ?", (node.serial,))
    metrics = Metrics()
    calls = node_calls(env, metrics)
    before = env.snapshot()
    answer = await calls.handle(renew_request(env, node, node.der))
    assert answer.status == 401
    assert json.loads(answer.body) == {
        "reason": "revoked",
        "code": "UNAUTHENTICATED",
        "message": "this certificate is not a live node certificate",
    }
    assert env.snapshot() == before  # no proof spent: Renew's own checks never ran
    assert refusal_events(env) == 0
    assert counted(metrics, "refused") == 0


async def test_an_unauthenticated_caller_hears_so_before_its_body_is_judged(env: Env) -> None:
    node = env.join(5)
    env.sql("UPDATE node_certs SET revoked_at = 1 WHERE serial = ?", (node.serial,))
    calls = node_calls(env, Metrics())
    junk = Request("POST", "/v1/renew", {}, {}, b"{not json", node.der, "127.0.0.1:4000")
    answer = await calls.handle(junk)
    assert answer.status == 401
    assert json.loads(answer.body)["reason"] == "revoked"


async def test_a_live_caller_with_a_malformed_body_is_told_so(env: Env) -> None:
    node = env.join(6)
    metrics = Metrics()
    calls = node_calls(env, metrics)
    before = env.snapshot()
    junk = Request("POST", "/v1/renew", {}, {}, b"{not json", node.der, "127.0.0.1:4000")
    answer = await calls.handle(junk)
    assert answer.status == 400
    assert json.loads(answer.body)["code"] == "INVALID_ARGUMENT"
    assert env.snapshot() == before
    assert counted(metrics, "error") == 1


async def test_an_unknown_or_missing_client_certificate_is_unauthenticated(env: Env) -> None:
    node = env.join(3)
    calls = node_calls(env, Metrics())
    before = env.snapshot()
    unknown = await calls.handle(renew_request(env, node, b"not a certificate we issued"))
    assert unknown.status == 401
    assert json.loads(unknown.body)["reason"] == "unknown-certificate"
    missing = await calls.handle(renew_request(env, node, None))
    assert missing.status == 401
    assert json.loads(missing.body) == {
        "code": "UNAUTHENTICATED",
        "message": "a node client certificate is required",
    }
    assert env.snapshot() == before
    assert refusal_events(env) == 0


async def test_a_leaf_of_another_node_is_refused_as_an_identity_mismatch(env: Env) -> None:
    node, other = env.join(7), env.join(8)
    metrics = Metrics()
    calls = node_calls(env, metrics)
    before = env.snapshot()
    # The caller is live, but presents (and proves) another node's leaf.
    assert_refused(await calls.handle(renew_request(env, other, node.der)))
    assert counted_refusal(metrics, "identity-mismatch") == 1
    assert env.snapshot() == before


async def test_a_node_over_its_hourly_renewals_is_turned_away_before_it_is_judged(
    env: Env,
) -> None:
    node = env.join(4)
    metrics = Metrics()
    calls = node_calls(env, metrics)
    for _ in range(RENEWALS_PER_HOUR):
        node = await renew_once(env, calls, node)
    before = env.snapshot()
    answer = await calls.handle(renew_request(env, node, node.der))
    assert answer.status == 429
    assert json.loads(answer.body) == {
        "code": "RESOURCE_EXHAUSTED",
        "message": "at most 6 renewals per node and hour",
    }
    assert int(dict(answer.headers)["retry-pushback-ms"]) > 0
    assert env.snapshot() == before  # the seventh's proof is not spent: never judged
    assert counted(metrics, "rate-limited") == 1
    assert counted(metrics, "renewed") == RENEWALS_PER_HOUR
    # Over its rate, a malformed body still hears RESOURCE_EXHAUSTED first.
    junk = Request("POST", "/v1/renew", {}, {}, b"{not json", node.der, "127.0.0.1:4000")
    assert (await calls.handle(junk)).status == 429


BENT_LEAVES = {
    # prime256v1 in the leaf's SPKI renamed, same length, no such curve: its key does
    # not load (UnsupportedAlgorithm)
    "unknown-curve": ("06082a8648ce3d030107", "06082a8648ce3d030106", "not P-256"),
    # its key usage's identifier renamed to the alternative name's: two of one
    # extension (DuplicateExtension)
    "duplicate-extension": ("0603551d0f", "0603551d11", "do not parse"),
}


def bent_leaf(node: NodeId, was: str, becomes: str) -> str:
    """The node's chain with its leaf's DER bent: it loads, a lazy part of it does not."""
    certs = pki.load_pem_chain(node.chain)
    der = certs[0].public_bytes(serialization.Encoding.DER)
    assert der.count(bytes.fromhex(was)) == 1
    bent = x509.load_der_x509_certificate(der.replace(bytes.fromhex(was), bytes.fromhex(becomes)))
    return "".join(pki.cert_pem(c) for c in [bent, *certs[1:]])


@pytest.mark.parametrize("bending", sorted(BENT_LEAVES))
async def test_a_leaf_that_does_not_parse_is_answered_in_the_seeds_order(
    env: Env, bending: str
) -> None:
    """A leaf whose key or extensions do not parse is a malformed leaf, never a 500: a
    dead caller still hears UNAUTHENTICATED first, a live one a refusal, and nothing is
    written."""
    was, becomes, why = BENT_LEAVES[bending]
    node, dead = env.join(9), env.join(10)
    chain = bent_leaf(node, was, becomes)
    with pytest.raises(pki.PkiError, match=why):
        pki.leaf_info(pki.load_pem_chain(chain)[0])
    env.sql("UPDATE node_certs SET revoked_at = 1 WHERE serial = ?", (dead.serial,))
    metrics = Metrics()
    calls = node_calls(env, metrics)
    before = env.snapshot()
    bent = env.body(node, chain=chain).body
    answer = await calls.handle(Request("POST", "/v1/renew", {}, {}, bent, dead.der, "x:1"))
    assert answer.status == 401
    assert json.loads(answer.body)["reason"] == "revoked"
    assert_refused(await calls.handle(Request("POST", "/v1/renew", {}, {}, bent, node.der, "x:1")))
    assert counted(metrics, "refused") == 1
    assert env.snapshot() == before


async def test_a_revocation_committed_while_the_caller_waits_for_its_node_is_unauthenticated(
    env: Env,
) -> None:
    """The caller's row is read before its node's lock: a revocation holding that lock
    commits, and the renewal, once it has the lock, answers UNAUTHENTICATED with the
    signed notice, as if it had come later (PostgreSQL: SQLite runs one writer)."""
    if env.store.dialect != "postgres":
        pytest.skip("SQLite's BEGIN IMMEDIATE runs one transaction at a time")
    node = env.join(11)
    calls = node_calls(env, Metrics())
    req = renew_request(env, node, node.der)
    locked, release = threading.Event(), threading.Event()
    revoker: list[int] = []

    def revoke() -> None:
        with env.store.tx() as tx:
            nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign)
            revoker.append(int(tx.query("SELECT pg_backend_pid() AS pid")[0]["pid"]))
            locked.set()
            release.wait(20)

    answers: list[Any] = []

    async def renew() -> None:
        answers.append(await calls.handle(req))

    async with trio.open_nursery() as nursery:
        try:
            nursery.start_soon(partial(trio.to_thread.run_sync, revoke, abandon_on_cancel=False))
            assert await trio.to_thread.run_sync(locked.wait, 20)
            nursery.start_soon(renew)
            # the renewal's backend, and no other, waits for the revoker's lock
            blocked = "SELECT pid FROM pg_stat_activity WHERE ? = ANY(pg_blocking_pids(pid))"
            with trio.fail_after(20):
                while not env.rows(blocked, (revoker[0],)):  # noqa: ASYNC110 - polled
                    await trio.sleep(0.02)
        finally:
            release.set()
    assert answers[0].status == 401
    body = json.loads(answers[0].body)
    assert body["reason"] == "revoked"
    assert body["notice"]
    assert refusal_events(env) == 0
    assert env.rows("SELECT serial FROM renewals") == []  # nothing issued, no proof spent
    assert env.rows("SELECT proof_sha256 FROM renew_proofs") == []
    assert len(env.rows("SELECT serial FROM node_certs WHERE node_id = ?", (node.node_id,))) == 1

"""A renewal through :class:`control.gateway.NodeCalls`, the API side of ``POST
/v1/renew``: the client certificate's liveness and the node's rate are judged in
one transaction before RenewService's own, all in one worker-thread hop, and in the
seed's order (UNAUTHENTICATED, then RESOURCE_EXHAUSTED, then the renewal)."""

from __future__ import annotations

import json
from typing import Any

import trio

from bcd import wire
from control.gateway import NodeCalls
from control.http import Request
from control.metrics import Metrics
from control.renewal import RENEWALS_PER_HOUR
from tests.world.renewals import Env, NodeId


class Counting:
    """RenewService with its calls counted."""

    def __init__(self, env: Env) -> None:
        self.inner = env.renewals
        self.calls = 0

    def renew(self, body: bytes, peer_cert_der: bytes | None) -> str:
        self.calls += 1
        return self.inner.renew(body, peer_cert_der)


def node_calls(env: Env, metrics: Metrics) -> tuple[NodeCalls, Counting]:
    counting = Counting(env)
    calls = NodeCalls(env.store, env.joins, env.renewals, trio.CapacityLimiter(2), metrics)
    calls.renewservice = counting  # type: ignore[assignment]
    return calls, counting


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


async def test_a_renewal_is_two_transactions_and_answers_the_new_identity(env: Env) -> None:
    node = env.join(1)
    metrics = Metrics()
    calls, counting = node_calls(env, metrics)
    durations: list[float] = []
    env.store.on_tx = durations.append
    answer = await calls.handle(renew_request(env, node, node.der))
    env.store.on_tx = None
    body: dict[str, Any] = wire.verify_response(answer.body.decode("ascii"), env.pin)
    assert answer.status == 200
    assert (body["kind"], body["node_id"]) == ("renewed", node.node_id)
    assert len(durations) == 2  # the gateway's checks, then RenewService's own
    assert counting.calls == 1


async def test_a_revoked_client_certificate_is_unauthenticated_before_anything_else(
    env: Env,
) -> None:
    node = env.join(2)
    env.sql("UPDATE node_certs SET revoked_at = 1 WHERE serial = ?", (node.serial,))
    metrics = Metrics()
    calls, counting = node_calls(env, metrics)
    answer = await calls.handle(renew_request(env, node, node.der))
    assert answer.status == 401
    assert json.loads(answer.body) == {
        "reason": "revoked",
        "code": "UNAUTHENTICATED",
        "message": "this certificate is not a live node certificate",
    }
    assert counting.calls == 0
    assert counted(metrics, "refused") == 0


async def test_an_unknown_or_missing_client_certificate_is_unauthenticated(env: Env) -> None:
    node = env.join(3)
    calls, counting = node_calls(env, Metrics())
    unknown = await calls.handle(renew_request(env, node, b"not a certificate we issued"))
    assert unknown.status == 401
    assert json.loads(unknown.body)["reason"] == "unknown-certificate"
    missing = await calls.handle(renew_request(env, node, None))
    assert missing.status == 401
    assert json.loads(missing.body) == {
        "code": "UNAUTHENTICATED",
        "message": "a node client certificate is required",
    }
    assert counting.calls == 0


async def test_a_node_over_its_hourly_renewals_is_turned_away_before_it_is_judged(
    env: Env,
) -> None:
    node = env.join(4)
    metrics = Metrics()
    calls, counting = node_calls(env, metrics)
    for _ in range(RENEWALS_PER_HOUR):
        node = await renew_once(env, calls, node)
    assert counting.calls == RENEWALS_PER_HOUR
    answer = await calls.handle(renew_request(env, node, node.der))
    assert answer.status == 429
    assert json.loads(answer.body) == {
        "code": "RESOURCE_EXHAUSTED",
        "message": "at most 6 renewals per node and hour",
    }
    assert int(dict(answer.headers)["retry-pushback-ms"]) > 0
    assert counting.calls == RENEWALS_PER_HOUR  # RenewService never saw the seventh
    assert counted(metrics, "rate-limited") == 1

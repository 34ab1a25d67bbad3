"""Prometheus metrics of a real ``serve --metrics-listen``: the counters move as a
scripted run did (a join, a refused join, a renewal, a session, a revocation pushed),
and no label value names a node, a token, a tenant or an address."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from bcd import wire
from bcd.identity import LoadedState
from control.http import Request
from control.metrics import REASONS_PER_ATTESTOR, Metrics, reason_label
from tests.fleet import issue_bundle, start_api, start_gateway
from tests.gatewaycalls import node_client, node_post
from tests.world import (
    ControlPlane,
    E2EWorld,
    Fleet,
    Node,
    fleet_node,
    gateway_login,
    loaded,
    node_id,
    pg_schema,
    pg_schema_url,
    relay_url,
    renew_body,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# what must never be a label value: ids of nodes, tokens, tenants, sites, pools,
# join requests (a prefix and 26 base32 characters), a token, an IP address
_ID = re.compile(r"(node|jt|ten|site|pool|jr|sess)_[0-9a-z]{8,}|bcjt_|\d+\.\d+\.\d+\.\d+|:.*:")


def _scrape(url: str) -> tuple[Samples, str]:
    answer = httpx.get(url + "/metrics", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=")
    samples: Samples = {}
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, answer.text


def _no_ids(samples: Samples) -> None:
    for (_name, labels), _v in samples.items():
        for key, value in labels:
            if key != "le":
                assert not _ID.search(value), (key, value)


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _hello(state: LoadedState) -> bytes:
    hello = wire.Hello(
        node_id=state.identity.node_id,
        journal_id="jrn_" + "a" * 26,
        boot_id="b" * 32,
        daemon_version="test",
    )
    return wire.dumps(hello.to_json())


@pytest.mark.e2e
async def test_the_counters_move_as_the_run_did(
    e2e: E2EWorld, store_url: str, tmp_path: Path
) -> None:
    cp: ControlPlane = e2e.control_plane(store_url, extra_args=["--metrics-listen", "127.0.0.1:0"])
    url = str(cp.ready["metrics"])
    before, _ = _scrape(url)
    assert _value(before, "bc_joins_total", attestor="join-token", outcome="joined") == 0
    assert _value(before, "bc_sessions_live") == 0

    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "a", cp, site, seed=1)
    assert node.join(cp.token(pool)["token"]).returncode == 0
    good = cp.token(pool)["token"]
    bad = Node.make(tmp_path / "b", cp, site, seed=2)
    assert bad.join(good[:-1] + ("A" if good[-1] != "A" else "B")).returncode == 1

    state = loaded(node)
    pin = cp.pins()["serving_ca_spki_pin"]
    renewed = await node_post(cp.gateway_port, pin, state, "/v1/renew", renew_body(state))
    assert renewed.status == 200
    refused = await node_post(cp.gateway_port, pin, state, "/v1/renew", b'{"chain": 1}')
    assert refused.status == 400

    async with (
        await node_client(cp.gateway_port, pin, state) as client,
        client.session(_hello(state), idle_timeout=30) as lines,
    ):
        it = aiter(lines)
        assert wire.loads_object(await anext(it))["type"] == "welcome"
        during, _ = _scrape(url)
        assert _value(during, "bc_sessions_live") == 1
        assert _value(during, "bc_session_opens_total") == 1
        done = cp.cli("nodes", "revoke-identity", node_id(node), "--tenant", cp.root_tenant)
        assert done.returncode == 0, done.stderr
        with trio.fail_after(10):
            assert wire.loads_object(await anext(it))["type"] == "revocation"

    deadline = time.monotonic() + 10
    while _value(after := _scrape(url)[0], "bc_sessions_live") != 0:
        assert time.monotonic() < deadline, "the session stayed live"
        await trio.sleep(0.1)
    assert _value(after, "bc_joins_total", attestor="join-token", outcome="joined") == 1
    assert _value(after, "bc_joins_total", attestor="join-token", outcome="refused") == 1
    assert (
        _value(after, "bc_join_refusals_total", attestor="join-token", reason="token-secret") == 1
    )
    assert _value(after, "bc_renewals_total", outcome="renewed") == 1
    assert _value(after, "bc_renewals_total", outcome="error") == 1  # the malformed body
    assert _value(after, "bc_session_opens_total") == 1
    assert _value(after, "bc_revocations_pushed_total") == 1
    assert _value(after, "bc_revocation_delivery_seconds_count") == 1
    assert 0 <= _value(after, "bc_revocation_delivery_seconds_sum") < 5
    # written after it was queued: the same notice, no sooner
    assert _value(after, "bc_revocation_written_seconds_count") == 1
    written = _value(after, "bc_revocation_written_seconds_sum")
    assert _value(after, "bc_revocation_delivery_seconds_sum") <= written < 5
    assert _value(after, "bc_db_transaction_duration_seconds_count") > 10
    assert _value(after, "bc_join_requests_pending") == 0
    assert _value(after, "bc_rate_limit_hits_total", limit="renewals-per-node") == 0
    # two joins, two renewals and a session, each its own TLS connection to the gateway
    hs = "bc_tls_handshakes_total"
    assert _value(after, hs, listener="gateway", outcome="completed") >= 5
    assert {k[1] for k in after if k[0] == hs} == {
        (("listener", "gateway"), ("outcome", o))
        for o in ("completed", "failed", "timed-out", "silent", "no-slot", "late")
    }  # the plain API and metrics listeners have no handshakes
    assert _value(after, hs, listener="gateway", outcome="no-slot") == 0
    assert _value(after, hs, listener="gateway", outcome="timed-out") == 0
    _no_ids(after)


@pytest.mark.e2e
@pytest.mark.postgres
async def test_an_api_and_a_gateway_each_count_their_part(
    tmp_path: Path, pki_template: Path
) -> None:
    metrics = ["--metrics-listen", "127.0.0.1:0"]
    with pg_schema() as schema:
        api = start_api(tmp_path / "api", pki_template, pg_schema_url(schema), metrics)
        f = Fleet(tmp_path, schema, [api], [], gateway_login(schema), Path())
        try:
            f.bundle = issue_bundle(api.home, tmp_path / "bundle")
            gw = start_gateway(
                tmp_path / "gw", f.bundle, f.gateway_db_url, [relay_url(api)], extra=metrics
            )
            f.gateways.append(gw)
            site, pool = api.site_and_pool()
            state = loaded(fleet_node(f, tmp_path / "n", 3, site, pool, gw.port))
            pin = api.pins()["serving_ca_spki_pin"]
            renewed = await node_post(gw.port, pin, state, "/v1/renew", renew_body(state))
            assert renewed.status == 200
            async with (
                await node_client(gw.port, pin, state) as client,
                client.session(_hello(state), idle_timeout=30) as lines,
            ):
                assert wire.loads_object(await anext(aiter(lines)))["type"] == "welcome"
                at_gw, _ = _scrape(str(gw.ready["metrics"]))
            at_api, _ = _scrape(str(api.ready["metrics"]))
        finally:
            f.stop()
    assert _value(at_api, "bc_joins_total", attestor="join-token", outcome="joined") == 1
    assert _value(at_api, "bc_renewals_total", outcome="renewed") == 1
    assert _value(at_api, "bc_session_opens_total") == 0  # the API holds no session
    assert _value(at_gw, "bc_session_opens_total") == 1
    assert _value(at_gw, "bc_sessions_live") == 1
    assert _value(at_gw, "bc_joins_total", attestor="join-token", outcome="joined") == 0
    # the join and the renewal went through the relay, answered
    assert _value(at_gw, "bc_relay_duration_seconds_count", outcome="answered") >= 2
    assert _value(at_gw, "bc_db_transaction_duration_seconds_count") >= 2  # peer checks
    # the node's calls at the gateway; the gateway's relayed calls at the API's relay listener
    hs = "bc_tls_handshakes_total"
    assert _value(at_gw, hs, listener="gateway", outcome="completed") >= 3
    assert _value(at_api, hs, listener="relay", outcome="completed") >= 1
    assert _value(at_api, hs, listener="gateway", outcome="completed") == 0
    _no_ids(at_api)
    _no_ids(at_gw)


@pytest.mark.e2e
def test_the_metrics_listener_answers_only_get_metrics_and_health(e2e: E2EWorld) -> None:
    cp: ControlPlane = e2e.control_plane(extra_args=["--metrics-listen", "127.0.0.1:0"])
    url = str(cp.ready["metrics"])
    with httpx.Client(timeout=10) as client:
        assert client.get(url + "/metrics").status_code == 200
        # a load balancer's probe, over plain HTTP: no TLS handshake slot to wait for
        for path, status in (("/healthz", "alive"), ("/readyz", "ready")):
            answer = client.get(url + path)
            assert answer.status_code == 200, path
            assert answer.json() == {"status": "ok", "reason": status}, answer.text
        assert client.post(url + "/healthz").status_code == 404
        for method, path in (("GET", "/"), ("POST", "/metrics"), ("GET", "/metrics/x")):
            answer = client.request(method, url + path)
            assert answer.status_code == 404, (method, path)
            assert answer.json()["code"] == "NOT_FOUND"
        too_big = client.post(url + "/metrics", content=b"x" * (1 << 17))
        assert too_big.status_code == 413
    samples, _ = _scrape(url)
    assert _value(samples, "bc_rate_limit_hits_total", limit="request-body") == 1


@pytest.mark.e2e
def test_an_accept_it_cannot_parse_is_answered_in_the_text_format(e2e: E2EWorld) -> None:
    """prometheus-client's choose_encoder raises on ``version=abc``: a 500 and a traceback
    logged per scrape, were it not caught."""
    cp: ControlPlane = e2e.control_plane(extra_args=["--metrics-listen", "127.0.0.1:0"])
    url = str(cp.ready["metrics"])
    with httpx.Client(timeout=10) as client:
        for accept in (
            "application/openmetrics-text; version=abc",
            "text/plain, application/openmetrics-text; version=1.0.0x",
        ):
            answer = client.get(url + "/metrics", headers={"accept": accept})
            assert answer.status_code == 200, accept
            assert answer.headers["content-type"].startswith("text/plain; version="), accept
            assert "bc_joins" in answer.text
        fine = client.get(url + "/metrics", headers={"accept": "application/openmetrics-text"})
        assert fine.status_code == 200
        assert fine.headers["content-type"].startswith("application/openmetrics-text")


@pytest.mark.e2e
def test_without_the_flag_nothing_listens(e2e: E2EWorld) -> None:
    cp: ControlPlane = e2e.control_plane()
    assert "metrics" not in cp.ready
    assert httpx.get(cp.api + "/metrics", timeout=10).status_code == 404


def test_a_reason_that_is_not_a_protocol_word_is_other() -> None:
    assert reason_label("token-secret") == "token-secret"
    assert reason_label("node-key-ak") == "node-key-ak"
    for hostile in ("Token Secret", "x" * 41, "node_0123456789", "", "a:b", "10.0.0.1"):
        assert reason_label(hostile) == "other"


def test_distinct_reasons_per_attestor_are_capped() -> None:
    m = Metrics()
    for i in range(REASONS_PER_ATTESTOR + 10):
        m.join("plugin-a", "refused", f"reason-{i}")
        m.renewal("refused", f"reason-{i}")
    m.join("plugin-a", "refused", "reason-0")  # one already counted keeps its label
    m.join("plugin-b", "refused", "reason-40")  # another attestor has its own allowance

    def reasons(name: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in m.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                    out[s.labels["reason"]] = s.value
        return out

    joined = reasons("bc_join_refusals_total", attestor="plugin-a")
    assert len(joined) == REASONS_PER_ATTESTOR + 1
    assert joined["other"] == 10
    assert joined["reason-0"] == 2
    assert "reason-40" not in joined
    assert reasons("bc_join_refusals_total", attestor="plugin-b") == {"reason-40": 1}
    renewed = reasons("bc_renewal_refusals_total")
    assert len(renewed) == REASONS_PER_ATTESTOR + 1
    assert renewed["other"] == 10


async def test_two_metrics_never_share_a_counter() -> None:
    a, b = Metrics(), Metrics()
    a.join("join-token", "joined")
    a.limit_hit("not-a-limit")
    scraped = await b.handle(_get("/metrics"))
    assert b'bc_joins_total{attestor="join-token"' not in scraped.body
    mine = (await a.handle(_get("/metrics"))).body.decode()
    assert 'bc_joins_total{attestor="join-token",outcome="joined"} 1.0' in mine
    assert 'bc_rate_limit_hits_total{limit="other"} 1.0' in mine


def test_handshake_outcomes_are_bounded_labels() -> None:
    m = Metrics()
    gateway = m.handshake_counter("gateway")
    gateway("completed")
    gateway("from a hostile peer")  # never a label of its own
    m.handshake_counter("api; drop")("silent")
    samples = {
        tuple(sorted(s.labels.items())): s.value
        for family in m.registry.collect()
        for s in family.samples
        if s.name == "bc_tls_handshakes_total"
    }
    assert samples[(("listener", "gateway"), ("outcome", "completed"))] == 1
    assert samples[(("listener", "gateway"), ("outcome", "other"))] == 1
    assert samples[(("listener", "gateway"), ("outcome", "no-slot"))] == 0  # there from the start
    assert samples[(("listener", "gateway"), ("outcome", "late"))] == 0
    assert samples[(("listener", "other"), ("outcome", "silent"))] == 1
    assert {v for k in samples for name, v in k if name == "listener"} == {"gateway", "other"}


def test_every_metric_is_documented_for_operators() -> None:
    documented = (Path(__file__).parent.parent / "docs" / "operators.md").read_text()
    for family in Metrics().registry.collect():
        shown = f"{family.name}_total" if family.type == "counter" else family.name
        assert f"| `{shown}` |" in documented, shown


def _get(path: str) -> Request:
    return Request("GET", path, {}, {}, b"", None, "127.0.0.1:1")


async def test_the_metrics_listener_answers_health_with_its_roles_readiness(
    tmp_path: Path,
) -> None:
    """A gateway's /readyz on the metrics listener is its readiness, an unready upstream
    included; the check runs at most once a second however often it is probed, and a
    health path asked other than by GET is the metrics listener's 404."""
    from control import server
    from control.store import open_store

    checks: list[float] = []

    class Gateway(server._Readiness):
        async def _check(self) -> tuple[bool, str]:
            checks.append(trio.current_time())
            return False, "no API upstream answers"

    store = open_store(f"sqlite:///{tmp_path / 'cp.db'}")
    store.migrate()
    handle = server._metrics_handler(Metrics(), Gateway(store, trio.CapacityLimiter(1)))

    def get(path: str, method: str = "GET") -> Request:
        return Request(method, path, {}, {}, b"", None, "127.0.0.1:1")

    alive = await handle(get("/healthz"))
    assert (alive.status, wire.loads_object(alive.body)["reason"]) == (200, "alive")
    for _ in range(3):
        ready = await handle(get("/readyz"))
        assert ready.status == 503
        assert wire.loads_object(ready.body) == {
            "status": "unavailable", "reason": "no API upstream answers"
        }  # fmt: skip
    assert len(checks) == 1  # three probes, one check
    assert (await handle(get("/readyz", "POST"))).status == 404
    store.close()

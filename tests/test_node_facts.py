"""Node states and facts in the store, on SQLite and PostgreSQL: session reports
(last seen, daemon version, first-Hello adoption), ``nodes adopt``, revoked and
retired, the facts the API shows and its paging, and the gateway's reporter (its
queue, its chunks, its failures) against the real NodeCalls handler.

Nodes come from real joins (JoinService with a token, :class:`tests.world.renewals.Env`).
"""

from __future__ import annotations

import json
import threading
from typing import Any, cast

import pytest
import trio

from bcd import wire
from control import nodefacts, nodes, tenancy
from control.clock import ManualClock
from control.errors import ControlError
from control.gateway import NodeCalls
from control.http import Request, Response
from control.ids import iso
from control.metrics import Metrics
from control.sessionreport import MAX_REPORT_BYTES, SessionReporter, chunks
from control.store import Tx
from tests.world.renewals import Env


def record(env: Env, seen: dict[str, str]) -> dict[str, int]:
    with env.store.tx() as tx:
        return nodefacts.record_sessions(tx, seen)


def node_row(env: Env, node_id: str) -> dict[str, Any]:
    (row,) = env.rows("SELECT * FROM nodes WHERE id = ?", (node_id,))
    return row


def shown(env: Env, node_id: str) -> dict[str, Any]:
    with env.store.tx() as tx:
        return nodes.show_node(tx, env.tenant, node_id)


def adopt(env: Env, node_id: str) -> dict[str, Any]:
    with env.store.tx() as tx:
        return nodes.adopt_node(tx, env.tenant, node_id)


def adopted_audit(env: Env, node_id: str) -> list[dict[str, Any]]:
    rows = env.rows(
        "SELECT payload FROM audit WHERE action = 'node.adopted' AND subject = ?", (node_id,)
    )
    return [json.loads(r["payload"]) for r in rows]


def checked_pool(env: Env) -> str:
    with env.store.tx() as tx:
        return str(
            tenancy.create_pool(
                tx, env.tenant, env.site, "checked", "bcd", {"acceptanceChecks": True}
            )["id"]
        )


def test_a_joined_node_shows_its_facts_before_any_session(env: Env) -> None:
    node = env.join(1)
    got = shown(env, node.node_id)
    assert got["state"] == "adopting"
    assert got["identityGeneration"] == 1
    assert got["hostname"] == "node-1"
    assert got["daemonVersion"] == "0.1.0-test"  # the join request's
    assert got["lastSeenAt"] is None
    not_after = int(node.leaf.not_valid_after_utc.timestamp() * 1000)
    assert got["certificateNotAfter"] == iso(not_after)


def test_the_first_hello_adopts_a_node_of_a_pool_without_acceptance_checks(env: Env) -> None:
    node, bystander = env.join(1), env.join(2)
    assert record(env, {node.serial: "1.2.3"}) == {"seen": 1, "adopted": 1}
    got = shown(env, node.node_id)
    assert (got["state"], got["daemonVersion"]) == ("adopted", "1.2.3")
    assert got["lastSeenAt"] is not None
    assert adopted_audit(env, node.node_id) == [
        {"nodeId": node.node_id, "by": "session", "serial": node.serial}
    ]
    assert [e["payload"]["nodeId"] for e in env.events(env.tenant, "node.adopted")] == [
        node.node_id
    ]
    # a bystander is untouched
    assert shown(env, bystander.node_id)["state"] == "adopting"
    assert node_row(env, bystander.node_id)["last_seen_at"] is None
    # again (the 5-minute re-report): last seen only, no second adoption, a version kept
    assert record(env, {node.serial: ""}) == {"seen": 1, "adopted": 0}
    assert shown(env, node.node_id)["daemonVersion"] == "1.2.3"
    assert len(adopted_audit(env, node.node_id)) == 1


def test_a_pool_with_acceptance_checks_stays_adopting_until_the_operator_adopts(
    env: Env,
) -> None:
    env.pool = checked_pool(env)
    node = env.join(1)
    assert record(env, {node.serial: "1.2.3"}) == {"seen": 1, "adopted": 0}
    got = shown(env, node.node_id)
    assert got["state"] == "adopting"
    assert got["lastSeenAt"] is not None
    assert adopt(env, node.node_id) == {"nodeId": node.node_id, "state": "adopted",
                                        "changed": True}  # fmt: skip
    assert shown(env, node.node_id)["state"] == "adopted"
    assert adopted_audit(env, node.node_id) == [{"nodeId": node.node_id, "by": "operator"}]
    # idempotent: nothing written the second time
    assert adopt(env, node.node_id)["changed"] is False
    assert len(adopted_audit(env, node.node_id)) == 1
    assert len(env.events(env.tenant, "node.adopted")) == 1


def test_revoked_then_reclaimed_then_retired(env: Env) -> None:
    node = env.join(3)
    record(env, {node.serial: "1.0"})
    with env.store.tx() as tx:
        nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign)
    got = shown(env, node.node_id)
    assert (got["state"], got["certificateNotAfter"]) == ("revoked", None)
    # a revoked certificate's session report changes nothing
    seen_at = node_row(env, node.node_id)["last_seen_at"]
    assert record(env, {node.serial: "2.0"}) == {"seen": 0, "adopted": 0}
    assert node_row(env, node.node_id)["last_seen_at"] == seen_at
    with pytest.raises(ControlError) as info:
        adopt(env, node.node_id)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "revoked" in info.value.message

    back = env.join(3, allow_reclaim=True)
    assert back.node_id == node.node_id
    got = shown(env, node.node_id)
    assert (got["state"], got["identityGeneration"]) == ("adopting", 2)
    assert record(env, {back.serial: "2.0"}) == {"seen": 1, "adopted": 1}
    assert shown(env, node.node_id)["state"] == "adopted"

    with env.store.tx() as tx:
        nodes.delete_node(tx, env.tenant, node.node_id, env.sign)
    assert shown(env, node.node_id)["state"] == "retired"
    with env.store.tx() as tx:  # revoking a retired node keeps it retired
        nodes.revoke_identity(tx, env.tenant, node.node_id, env.sign)
    assert shown(env, node.node_id)["state"] == "retired"
    with pytest.raises(ControlError) as info:
        adopt(env, node.node_id)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "retired" in info.value.message


def test_a_report_touches_only_live_certificates_of_the_current_generation(env: Env) -> None:
    node = env.join(4)
    renewed = env.renew(node)
    expired = env.join(5)
    env.sql("UPDATE node_certs SET not_after = ? WHERE serial = ?", (1, expired.serial))
    unknown = "ab" * 20
    assert record(env, {unknown: "x", expired.serial: "x"}) == {"seen": 0, "adopted": 0}
    assert node_row(env, expired.node_id)["last_seen_at"] is None
    # both live certificates of one node: one node seen
    assert record(env, {node.serial: "1", renewed.serial: "1"})["seen"] == 1
    # the latest live not_after is shown
    not_after = max(int(n.leaf.not_valid_after_utc.timestamp() * 1000) for n in (node, renewed))
    assert shown(env, node.node_id)["certificateNotAfter"] == iso(not_after)


class Recording:
    """A transaction that records every statement run through it (else the real one)."""

    def __init__(self, tx: Tx) -> None:
        self._tx = tx
        self.statements: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)

    def query(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        self.statements.append(sql)
        return self._tx.query(sql, params)

    def execute(self, sql: str, params: Any = ()) -> int:
        self.statements.append(sql)
        return self._tx.execute(sql, params)

    def defer(self, sql: str, params: Any = ()) -> None:
        self.statements.append(sql)
        self._tx.defer(sql, params)


def recorded(env: Env, seen: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    with env.store.tx() as tx:
        rec = Recording(tx)
        got = nodefacts.record_sessions(cast(Tx, rec), seen)
    return got, rec.statements


def row_version(env: Env, node_id: str) -> Any:
    """PostgreSQL: the row version's xmin (a write makes a new one); SQLite: the row."""
    if env.store.dialect == "postgres":
        return env.rows("SELECT xmin::text AS v FROM nodes WHERE id = ?", (node_id,))[0]["v"]
    return node_row(env, node_id)


def test_a_re_report_that_changes_nothing_locks_and_writes_nothing(
    env: Env, clock: ManualClock
) -> None:
    """The common report (a node seen less than LAST_SEEN_FRESH_MS ago, its version
    unchanged, nothing to adopt) is read only: no FOR UPDATE, no UPDATE, no INSERT."""
    plain, env.pool = env.pool, checked_pool(env)  # stays adopting: read, not adoptable
    waiting = env.join(1)
    env.pool = plain
    nodes_ = [waiting, env.join(2), env.join(3)]
    report = {n.serial: "1.2.3" for n in nodes_}
    got, statements = recorded(env, report)
    assert got == {"seen": 3, "adopted": 2}
    before = [node_row(env, n.node_id) for n in nodes_]
    versions = [row_version(env, n.node_id) for n in nodes_]
    audits = env.rows("SELECT id FROM audit ORDER BY id")

    clock.advance(nodefacts.LAST_SEEN_FRESH_MS - 1)
    for again in (report, dict.fromkeys(report, "")):  # an empty version keeps the old
        got, statements = recorded(env, again)
        assert got == {"seen": 3, "adopted": 0}
        assert all(s.lstrip().upper().startswith("SELECT") for s in statements), statements
        assert not any("FOR UPDATE" in s for s in statements)
        assert [node_row(env, n.node_id) for n in nodes_] == before
        assert [row_version(env, n.node_id) for n in nodes_] == versions
        assert env.rows("SELECT id FROM audit ORDER BY id") == audits


def test_a_stale_last_seen_or_a_new_version_is_written(env: Env, clock: ManualClock) -> None:
    node, other = env.join(1), env.join(2)
    record(env, {node.serial: "1.0", other.serial: "1.0"})
    first = node_row(env, node.node_id)["last_seen_at"]
    assert first == clock.now_ms()

    # within the freshness window a new version is written, and last seen with it
    clock.advance(1000)
    got, statements = recorded(env, {node.serial: "1.1", other.serial: "1.0"})
    assert got == {"seen": 2, "adopted": 0}
    assert sum(s.lstrip().upper().startswith("UPDATE") for s in statements) == 1
    assert (node_row(env, node.node_id)["daemon_version"],
            node_row(env, node.node_id)["last_seen_at"]) == ("1.1", first + 1000)  # fmt: skip
    assert node_row(env, other.node_id)["last_seen_at"] == first  # not stale, not written

    # once stale, last seen is written again, by one UPDATE for both
    clock.advance(nodefacts.LAST_SEEN_FRESH_MS)
    got, statements = recorded(env, {node.serial: "1.1", other.serial: ""})
    assert got == {"seen": 2, "adopted": 0}
    writes = [s for s in statements if not s.lstrip().upper().startswith("SELECT")]
    assert len(writes) == 1
    assert writes[0].startswith("UPDATE nodes")
    assert env.store.dialect == "sqlite" or any("FOR UPDATE" in s for s in statements)
    for n, version in ((node, "1.1"), (other, "1.0")):
        row = node_row(env, n.node_id)
        assert (row["last_seen_at"], row["daemon_version"]) == (clock.now_ms(), version)


def test_first_hellos_of_many_nodes_are_one_update_and_one_insert_each(env: Env) -> None:
    made = [env.join(n) for n in range(1, 5)]
    versions = {made[0].serial: "2.0", made[1].serial: "2.1", made[2].serial: "",
                made[3].serial: "0.1.0-test"}  # fmt: skip
    got, statements = recorded(env, versions)
    assert got == {"seen": 4, "adopted": 4}
    writes = [s.split("(")[0].split(" SET ")[0] for s in statements
              if not s.lstrip().upper().startswith("SELECT")]  # fmt: skip
    assert writes == ["UPDATE nodes", "INSERT INTO audit ", "INSERT INTO events "]
    for n, version in zip(made, ("2.0", "2.1", "0.1.0-test", "0.1.0-test"), strict=True):
        got_node = shown(env, n.node_id)
        assert (got_node["state"], got_node["daemonVersion"]) == ("adopted", version)
        assert got_node["lastSeenAt"] is not None
        assert adopted_audit(env, n.node_id) == [
            {"nodeId": n.node_id, "by": "session", "serial": n.serial}
        ]
    assert sorted(e["payload"]["nodeId"] for e in env.events(env.tenant, "node.adopted")) == (
        sorted(n.node_id for n in made)
    )


def test_overlapping_reports_of_two_gateways_never_deadlock(env: Env) -> None:
    """Two gateways report overlapping nodes at once, each report writing every node
    (a new version each time): the nodes are locked in id order, so neither waits
    on the other forever (PostgreSQL would answer a deadlock with an error)."""
    made = [env.join(n) for n in range(1, 13)]
    serials = [n.serial for n in made]
    errors: list[BaseException] = []

    def gateway(name: str, names: list[str]) -> None:
        try:
            for i in range(15):
                # the same nodes, named in another order by each gateway
                record(env, {s: f"{name}{i}" for s in names})
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=gateway, args=("a", serials[:9])),
        threading.Thread(target=gateway, args=("b", list(reversed(serials[3:])))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert {shown(env, n.node_id)["state"] for n in made} == {"adopted"}
    assert all(len(adopted_audit(env, n.node_id)) == 1 for n in made)


def test_a_report_cannot_name_a_node_id() -> None:
    """The serial names the node: a report cannot name a node id at all."""
    with pytest.raises(ControlError) as info:
        nodefacts.parse_report({"sessions": [{"daemonVersion": "1", "serials": ["node_x"]}]})
    assert info.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "sessions must be a list"),
        ({"sessions": "x"}, "sessions must be a list"),
        ({"sessions": [1]}, "each sessions group must be an object"),
        ({"sessions": [{"serials": "ab"}]}, "serials must be a list"),
        ({"sessions": [{"serials": ["AB"]}]}, "lower-case hex"),
        ({"sessions": [{"serials": ["a" * 41]}]}, "lower-case hex"),
        ({"sessions": [{"daemonVersion": "1\n", "serials": []}]}, "printable ASCII"),
        ({"sessions": [{"daemonVersion": "v" * 65, "serials": []}]}, "printable ASCII"),
        ({"sessions": [{"serials": [format(i, "x") for i in range(1001)]}]}, "at most 1000"),
        ({"sessions": [{"serials": []}] * 1001}, "at most 1000"),
    ],
)
def test_a_hostile_report_is_invalid_argument(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ControlError) as info:
        nodefacts.parse_report(body)
    assert info.value.code == "INVALID_ARGUMENT"
    assert message in info.value.message


def test_printable_version() -> None:
    assert nodefacts.printable_version("0.1.0+g1234") == "0.1.0+g1234"
    for bad in ("", "x" * 65, "1.0\x1b[31m", "1.0\n", "ü"):
        assert nodefacts.printable_version(bad) == ""


def test_nodes_page_like_join_tokens(env: Env) -> None:
    made = sorted(env.join(n).node_id for n in range(1, 4))
    with env.store.tx() as tx:
        first = nodes.list_nodes(tx, env.tenant, page_size=2)
    assert [n["id"] for n in first["items"]] == made[:2]
    assert first["nextPageToken"] == made[1]
    with env.store.tx() as tx:
        rest = nodes.list_nodes(tx, env.tenant, page_size=2, page_token=first["nextPageToken"])
    assert [n["id"] for n in rest["items"]] == made[2:]
    assert "nextPageToken" not in rest
    item = rest["items"][0]
    for key in ("lastSeenAt", "daemonVersion", "hostname", "certificateNotAfter", "state",
                "identityGeneration"):  # fmt: skip
        assert key in item
    for size in (0, 1001, True):
        with pytest.raises(ControlError) as info, env.store.tx() as tx:
            nodes.list_nodes(tx, env.tenant, page_size=size)
        assert info.value.code == "INVALID_ARGUMENT"


# --- the gateway's reporter, against the real NodeCalls --------------------------------


def calls(env: Env) -> NodeCalls:
    return NodeCalls(env.store, env.joins, env.renewals, trio.CapacityLimiter(2))


async def test_the_reporter_sends_what_it_queued_and_the_api_records_it(env: Env) -> None:
    node = env.join(1)
    sent: list[int] = []
    handler = calls(env).handle

    async def send(req: Request) -> Response:
        answer = await handler(req)
        sent.append(answer.status)
        return answer

    metrics = Metrics()
    reporter = SessionReporter(send, list, metrics)
    reporter.seen(node.serial, "9.9.9")
    await reporter.flush()
    assert sent == [200]
    assert reporter.pending == {}
    got = shown(env, node.node_id)
    assert (got["state"], got["daemonVersion"]) == ("adopted", "9.9.9")


async def test_the_reporter_counts_what_it_drops_and_never_raises(env: Env) -> None:
    metrics = Metrics()

    async def down(req: Request) -> Response:
        raise ControlError("UNAVAILABLE", "no JoinService replica answers; retry")

    reporter = SessionReporter(down, list, metrics, max_pending=2)
    for serial in ("a1", "a2", "a3"):
        reporter.seen(serial, "1")
    reporter.seen("a1", "2")  # already queued: updated, not dropped
    assert reporter.pending == {"a1": "2", "a2": "1"}
    await reporter.flush()
    dropped = metrics.session_reports_dropped
    assert dropped.labels("queue-full")._value.get() == 1
    assert dropped.labels("upstream")._value.get() == 2

    async def refuses(req: Request) -> Response:
        return Response(400, b"{}")

    reporter = SessionReporter(refuses, list, metrics)
    reporter.seen("b1", "1")
    await reporter.flush()
    assert dropped.labels("upstream")._value.get() == 3


async def test_the_reporter_re_reports_live_sessions(env: Env) -> None:
    """Nothing queued: the periodic re-report alone brings both nodes' last seen."""
    nodes_ = [env.join(n) for n in (1, 2)]
    handler = calls(env).handle
    answered = trio.Event()

    async def send(req: Request) -> Response:
        answer = await handler(req)
        answered.set()
        return answer

    reporter = SessionReporter(
        send, lambda: [(n.serial, "3.0") for n in nodes_], Metrics(), flush_s=0.01,
        refresh_s=0.0,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reporter.run)
        with trio.fail_after(10):
            await answered.wait()
        nursery.cancel_scope.cancel()
    for n in nodes_:
        assert node_row(env, n.node_id)["last_seen_at"] is not None
        assert shown(env, n.node_id)["daemonVersion"] == "3.0"


def test_chunks_are_bounded_in_serials_and_bytes() -> None:
    many = {format(i, "040x"): "1.0" for i in range(2500)}
    got = list(chunks(many))
    assert [len(c) for c in got] == [1000, 1000, 500]
    assert all(len(nodefacts.encode_report(c)) <= 64 * 1024 for c in got)
    # every serial with a version of its own: bounded by bytes, not count
    odd = {format(i, "040x"): f"v{i:062d}" for i in range(1000)}
    parts = list(chunks(odd))
    assert len(parts) > 1
    assert sum(len(c) for c in parts) == 1000
    assert all(len(nodefacts.encode_report(c)) <= MAX_REPORT_BYTES + 1024 for c in parts)
    # what a chunk encodes, the API parses back
    assert nodefacts.parse_report(wire.loads_object(nodefacts.encode_report(parts[0]))) == parts[0]


def test_a_nodes_own_text_cannot_forge_a_table_row_or_reach_the_terminal_raw() -> None:
    from control.cli_client import _fact

    assert _fact("web-1.example") == "web-1.example"
    assert _fact("") == "-"
    assert _fact(None) == "-"
    forged = _fact("web1\x1b[2K\rnode_x adopted\n")
    assert "\x1b" not in forged
    assert "\n" not in forged
    assert "\r" not in forged
    assert forged.startswith('"')
    assert forged.endswith('"')
    assert _fact("two words") == '"two words"'
    assert _fact("caf\u00e9\u2028") == '"caf\\u00e9\\u2028"'

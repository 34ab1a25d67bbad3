"""The API's OpenAPI description (control/openapi.py, served at /api/compute/v1/openapi.json):
a valid document, in step with control/api.py's routes both ways, and what a running
``better-compute serve`` answers, operation by operation (a scripted happy path and
error cases, each answer validated by schemathesis against the document) and under a
short seeded schemathesis property run (issue 13)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from openapi_spec_validator import validate
from schemathesis.core import NOT_SET

from control import api, openapi
from fuzz.openapi_fuzz import CHECKS, figures, load, probe, seed_world
from tests.world import JOINED, ControlPlane, E2EWorld, Node, root_site_store, stop_process

EXAMPLE = {
    "tenantId": "ten_" + "0" * 26,
    "siteId": "site_" + "0" * 26,
    "poolId": "pool_" + "0" * 26,
    "nodeId": "node_" + "0" * 26,
    "requestId": "jreq_" + "0" * 26,
    "tokenId": "jt_" + "0" * 26,
}
TENANT_PREFIX = f"{openapi.BASE}/v1/tenants/{{tenantId}}"


def _documented() -> set[tuple[str, str]]:
    doc = openapi.document()
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in item}


def _filled(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: EXAMPLE[m.group(1)], path)


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = openapi.document()
    validate(doc)  # raises on an invalid document
    assert doc["openapi"] == "3.1.0"
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)) == len(openapi.OPERATIONS)


def test_every_route_is_documented_and_every_documented_tenant_path_is_routed() -> None:
    documented = _documented()
    under = TENANT_PREFIX + "/"
    tenant_ops = {(m, p[len(TENANT_PREFIX) :]) for m, p in documented if p.startswith(under)}
    for method, pattern, name in api._ROUTES:
        matching = [p for m, p in tenant_ops if m == method and pattern.fullmatch(_filled(p))]
        assert len(matching) == 1, f"route {method} {pattern.pattern} ({name}) is not documented"
    names = set()
    for method, rest in tenant_ops:
        routed = api._route(method, _filled(rest))
        assert routed is not None, f"{method} {TENANT_PREFIX}{rest} is documented, not routed"
        names.add(routed[0])
    assert names == {name for _m, _p, name in api._ROUTES}
    others = {(m, p) for m, p in documented if not p.startswith(under)}
    assert others == {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", f"{openapi.BASE}/.well-known/better-compute"),
        ("GET", f"{openapi.BASE}{openapi.PATH}"),
        ("GET", f"{openapi.BASE}/downloads/bcd/{{version}}/linux-{{arch}}"),
        ("GET", f"{openapi.BASE}/v1/tenants"),
        ("GET", f"{openapi.BASE}/v1/tenants/self"),
        ("GET", f"{openapi.BASE}/v1/tenants/{{tenantId}}"),
    }


# --- against a running serve ----------------------------------------------------------


class Caller:
    """Calls one documented operation and validates the answer against the document."""

    def __init__(self, cp: ControlPlane, schema: Any) -> None:
        self.cp, self.schema = cp, schema
        self.credential = cp.root_credential_file.read_text().strip()
        self.session = requests.Session()
        self.answered: set[tuple[str, str, int]] = set()

    def __call__(
        self,
        method: str,
        path: str,
        status: int,
        *,
        credential: str | None = "",
        body: Any = NOT_SET,
        query: dict[str, Any] | None = None,
        code: str | None = None,
        **params: str,
    ) -> Any:
        op = self.schema[path][method]
        bearer = self.credential if credential == "" else credential
        headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
        case = op.Case(path_parameters=params or None, query=query, headers=headers, body=body,
                       media_type="application/json" if body is not NOT_SET else None)  # fmt: skip
        response = case.call(base_url=self.cp.api, session=self.session, timeout=15)
        assert response.status_code == status, (method, path, response.text)
        case.validate_response(response, checks=CHECKS)
        self.answered.add((method, path, status))
        if "application/json" not in str(response.headers.get("content-type")):
            return response.content
        answer = response.json()
        if code is not None:
            assert answer["code"] == code, answer
        return answer


def _served_schema(cp: ControlPlane) -> Any:
    served = requests.get(cp.api + openapi.BASE + openapi.PATH, timeout=10)  # no credential
    assert served.status_code == 200
    assert served.headers["content-type"] == "application/json"
    assert served.json() == openapi.document()
    return load(cp.api)


def _downloads(root: Path) -> Path:
    artifact = root / "bcd" / "0.1.0" / "linux-amd64"
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
    return root


def _pending(cp: ControlPlane, agent: subprocess.Popen[str], mac: str) -> str:
    deadline = time.monotonic() + 30
    while (row := cp.one("SELECT id FROM join_requests WHERE mac = ?", (mac,))) is None:
        assert agent.poll() is None, agent.communicate()
        assert time.monotonic() < deadline, "no join request was recorded"
        time.sleep(0.1)
    return str(row["id"])


def _mac(node: Node) -> str:
    return (node.sysfs / "sys" / "class" / "net" / "eth0" / "address").read_text().strip()


@pytest.mark.e2e
def test_every_operation_answers_as_documented(tmp_path: Path, e2e: E2EWorld) -> None:
    db_url, site, (agents, disc) = root_site_store(
        tmp_path, "dc-1", ("site-agents", {}), ("discovered", {"joinAttestors": ["discovery"]})
    )
    cp = e2e.control_plane(
        db_url,
        extra_args=[
            "--discovery-pool", disc,
            "--attestor-setting", "discovery.approval=always",
            "--downloads", str(_downloads(tmp_path / "downloads")),
        ],
    )  # fmt: skip
    call = Caller(cp, _served_schema(cp))
    root = cp.root_tenant
    other, other_file = cp.tenant("other")
    other_cred = other_file.read_text().strip()
    T = TENANT_PREFIX
    P = f"{T}/pools/{{poolId}}"
    B = openapi.BASE

    # public paths
    assert call("GET", "/healthz", 200, credential=None)["status"] == "ok"
    assert call("GET", "/readyz", 200, credential=None)["status"] == "ok"
    assert call("GET", f"{B}/.well-known/better-compute", 200, credential=None)["basePath"] == B
    assert call("GET", f"{B}{openapi.PATH}", 200, credential=None)["openapi"] == "3.1.0"
    got = call("GET", f"{B}/downloads/bcd/{{version}}/linux-{{arch}}", 200, credential=None,
               version="0.1.0", arch="amd64")  # fmt: skip
    assert got.startswith(b"\x7fELF")
    call("GET", f"{B}/downloads/bcd/{{version}}/linux-{{arch}}", 404, credential=None,
         version="0.1.0", arch="arm64", code="NOT_FOUND")  # fmt: skip

    # tenants
    listed = call("GET", f"{B}/v1/tenants", 200, query={"pageSize": 1})
    assert len(listed["items"]) == 1
    assert "nextPageToken" in listed
    call("GET", f"{B}/v1/tenants", 200, query={"pageToken": listed["nextPageToken"]})
    call("GET", f"{B}/v1/tenants", 401, credential=None, code="UNAUTHENTICATED")
    call("GET", f"{B}/v1/tenants", 401, credential="bcak_ak_x.y", code="UNAUTHENTICATED")
    call("GET", f"{B}/v1/tenants", 400, query={"pageSize": 0}, code="INVALID_ARGUMENT")
    assert call("GET", f"{B}/v1/tenants/self", 200, credential=other_cred)["id"] == other
    assert call("GET", f"{B}/v1/tenants/{{tenantId}}", 200, tenantId=other)["name"] == "other"
    call("GET", f"{B}/v1/tenants/{{tenantId}}", 404, credential=other_cred, tenantId=root,
         code="NOT_FOUND")  # fmt: skip

    # sites and pools
    made = call("POST", f"{T}/sites", 200, tenantId=root, body={"name": "rack-c1"})
    assert made["createdAt"].endswith("Z")
    call("POST", f"{T}/sites", 400, tenantId=root, body={"name": ""}, code="INVALID_ARGUMENT")
    call("POST", f"{T}/sites", 404, tenantId=root, credential=other_cred, body={"name": "x"})
    assert len(call("GET", f"{T}/sites", 200, tenantId=root)["items"]) == 2
    call("GET", f"{T}/sites/{{siteId}}", 200, tenantId=root, siteId=made["id"])
    call("GET", f"{T}/sites/{{siteId}}", 404, tenantId=root, siteId=EXAMPLE["siteId"])
    pool = call("POST", f"{T}/pools", 200, tenantId=root,
                body={"siteId": made["id"], "name": "gpu", "agent": "bcd"})["id"]  # fmt: skip
    call("POST", f"{T}/pools", 400, tenantId=root, code="INVALID_ARGUMENT",
         body={"siteId": made["id"], "name": "x", "agent": "bcd",
               "policy": {"joinAttestors": ["join-tokn"]}})  # fmt: skip
    call("POST", f"{T}/pools", 404, tenantId=root, code="NOT_FOUND",
         body={"siteId": EXAMPLE["siteId"], "name": "x", "agent": "bcd"})  # fmt: skip
    by_site = call("GET", f"{T}/pools", 200, tenantId=root, query={"siteId": made["id"]})
    assert [p["id"] for p in by_site["items"]] == [pool]
    call("GET", P, 200, tenantId=root, poolId=pool)
    call("GET", P, 404, tenantId=other, credential=other_cred, poolId=pool, code="NOT_FOUND")
    call("POST", f"{P}/policy", 200, tenantId=root, poolId=pool, body={"policy": {}})
    call("POST", f"{P}/policy", 400, tenantId=root, poolId=pool, body={"policy": []})
    for bad in ({"acceptanceChecks": "yes"}, {"kubernetes": []}, {"joinAttestors": "tpm"}):
        call("POST", f"{P}/policy", 400, tenantId=root, poolId=pool, body={"policy": bad},
             code="INVALID_ARGUMENT")  # fmt: skip

    # join tokens
    created = call("POST", f"{P}/join-tokens", 200, tenantId=root, poolId=pool,
                   body={"ttlSeconds": 600, "maxUses": 3, "idempotencyKey": "k1"})  # fmt: skip
    assert created["token"].startswith("bcjt_")
    replay = call("POST", f"{P}/join-tokens", 200, tenantId=root, poolId=pool,
                  body={"ttlSeconds": 600, "maxUses": 3, "idempotencyKey": "k1"})  # fmt: skip
    assert "token" not in replay
    call("POST", f"{P}/join-tokens", 409, tenantId=root, poolId=pool, code="CONFLICT",
         body={"ttlSeconds": 600, "idempotencyKey": "k1", "allowReclaim": True})  # fmt: skip
    call("POST", f"{P}/join-tokens", 400, tenantId=root, poolId=pool, body={"ttlSeconds": 59},
         code="INVALID_ARGUMENT")  # fmt: skip
    other_site = call("POST", f"{T}/sites", 200, tenantId=other, credential=other_cred,
                      body={"name": "s"})["id"]  # fmt: skip
    other_pool = call("POST", f"{T}/pools", 200, tenantId=other, credential=other_cred,
                      body={"siteId": other_site, "name": "p", "agent": "bcd"})["id"]  # fmt: skip
    call("POST", f"{P}/join-tokens", 403, tenantId=other, credential=other_cred,
         poolId=other_pool, body={"ttlSeconds": 600, "role": "site"},
         code="ACCESS_DENIED")  # fmt: skip
    page = call("GET", f"{P}/join-tokens", 200, tenantId=root, poolId=pool,
                query={"includeInactive": "true", "pageSize": 1})  # fmt: skip
    assert [t["id"] for t in page["items"]] == [created["id"]]
    call("GET", f"{P}/join-tokens", 400, tenantId=root, poolId=pool, query={"pageSize": 201})
    revoke = f"{P}/join-tokens/{{tokenId}}/revoke"
    assert call("POST", revoke, 200, tenantId=root, poolId=pool, tokenId=created["id"])["revoked"]
    call(
        "POST",
        revoke,
        400,
        tenantId=root,
        poolId=pool,
        tokenId="bcjt_jt_x.y",
        code="INVALID_ARGUMENT",
    )
    call("POST", revoke, 404, tenantId=root, poolId=pool, tokenId=EXAMPLE["tokenId"])

    # nodes: two joined with a token through the real gateway
    node_token = cp.token(pool, maxUses=2)["token"]
    joined = []
    for seed in (4, 5):
        node = Node.make(tmp_path / f"n{seed}", cp, made["id"], seed=seed)
        done = node.join(node_token)
        assert done.returncode == 0, done.stderr
        m = JOINED.match(done.stdout.strip().splitlines()[-1])
        assert m, done.stdout
        joined.append(m.group(1))
    first, second = joined
    nodes = call("GET", f"{T}/nodes", 200, tenantId=root, query={"poolId": pool, "pageSize": 1})
    assert nodes["items"][0]["id"] == min(joined)
    assert "nextPageToken" in nodes
    call("GET", f"{T}/nodes", 400, tenantId=root, query={"pageToken": "ten_x"})
    shown = call("GET", f"{T}/nodes/{{nodeId}}", 200, tenantId=root, nodeId=first)
    assert shown["state"] == "adopting"
    assert shown["certificates"]
    call("GET", f"{T}/nodes/{{nodeId}}", 404, tenantId=other, credential=other_cred,
         nodeId=first, code="NOT_FOUND")  # fmt: skip
    assert call("POST", f"{T}/nodes/{{nodeId}}/adopt", 200, tenantId=root, nodeId=first)["changed"]
    revoked = call("POST", f"{T}/nodes/{{nodeId}}/revoke-identity", 200, tenantId=root,
                   nodeId=first, body={"reason": "decommissioned"})  # fmt: skip
    assert revoked["revoked"]
    call("POST", f"{T}/nodes/{{nodeId}}/revoke-identity", 400, tenantId=root, nodeId=first,
         body={"reason": "\u00e9"}, code="INVALID_ARGUMENT")  # fmt: skip
    call("POST", f"{T}/nodes/{{nodeId}}/adopt", 400, tenantId=root, nodeId=first)
    deleted = call("DELETE", f"{T}/nodes/{{nodeId}}", 200, tenantId=root, nodeId=second)
    assert deleted["state"] == "retired"
    call("DELETE", f"{T}/nodes/{{nodeId}}", 404, tenantId=root, nodeId=EXAMPLE["nodeId"])

    # join requests: a site agent vouches for two machines that join by discovery
    site_agent = Node.make(tmp_path / "agent", cp, site, seed=1)
    done = site_agent.join(cp.token(agents, role="site")["token"], "--role", "site")
    assert done.returncode == 0, done.stderr
    requests_ = []
    for seed in (2, 3):
        machine = Node.make(tmp_path / f"m{seed}", cp, site, seed=seed, write_jwk=False)
        vouched = site_agent.bcd("vouch", "--mac", _mac(machine), "--boot-lease-epoch", "7",
                                 "--ip", "127.0.0.1")  # fmt: skip
        assert vouched.returncode == 0, vouched.stderr
        waiting = machine.spawn_join("--attestor", "discovery")
        try:
            requests_.append(_pending(cp, waiting, _mac(machine)))
        finally:
            stop_process(waiting)
    listed = call("GET", f"{P}/join-requests", 200, tenantId=root, poolId=disc)
    assert {r["id"] for r in listed["items"]} == set(requests_)
    call("GET", f"{P}/join-requests", 400, tenantId=root, poolId=disc, query={"state": "x"})
    approve, reject = (
        f"{P}/join-requests/{{requestId}}/approve",
        f"{P}/join-requests/{{requestId}}/reject",
    )
    approved = call("POST", approve, 200, tenantId=root, poolId=disc, requestId=requests_[0],
                    body={"ttlSeconds": 600, "reason": "intake"})  # fmt: skip
    assert approved["state"] == "approved"
    call("POST", approve, 400, tenantId=root, poolId=disc, requestId=requests_[0],
         code="INVALID_STATE")  # fmt: skip
    rejected = call("POST", reject, 200, tenantId=root, poolId=disc, requestId=requests_[1])
    assert rejected["state"] == "rejected"
    call("POST", reject, 404, tenantId=root, poolId=disc, requestId=EXAMPLE["requestId"])

    # events
    events = call("GET", f"{T}/events", 200, tenantId=root,
                  query={"type": "security.join-token.created", "limit": 2})  # fmt: skip
    assert [e["type"] for e in events["items"]] == ["security.join-token.created"] * 2
    call("GET", f"{T}/events", 400, tenantId=root, query={"since": -1}, code="INVALID_ARGUMENT")

    # every documented operation answered 200 at least once
    ok = {(m, p) for m, p, status in call.answered if status == 200}
    assert ok == _documented()


@pytest.mark.e2e
def test_a_short_seeded_property_run_finds_no_5xx_and_no_nonconforming_answer(
    e2e: E2EWorld,
) -> None:
    """fuzz/openapi_fuzz.py's probe, as `make fuzz` runs it, with a small budget."""
    cp = e2e.control_plane()
    fixed = seed_world(cp, e2e.tmp, nodes=1)
    schema = load(cp.api)
    started = time.monotonic()
    results = [
        probe(schema, cp.api, fixed, examples=12, seed_value=13),
        probe(
            schema,
            cp.api,
            fixed,
            examples=4,
            mode=schemathesis.GenerationMode.NEGATIVE,
            seed_value=13,
        ),
    ]
    table, failed = figures(results)
    assert failed == 0, table
    assert time.monotonic() - started < 60, table
    cases = sum(s.cases for r in results for s in r.values())
    assert cases > 200, table
    statuses = {code for r in results for s in r.values() for code in s.statuses}
    assert {200, 400, 401, 404} <= statuses, table
    assert all(code < 500 for code in statuses), table
    assert cp.proc.poll() is None
    assert "Traceback" not in (cp.home / "serve.log").read_text()

"""The OpenAPI 3.1 description of the API listener (the tenant API and its public paths).

Built here from one table (:data:`OPERATIONS`) rather than kept as a JSON file: the
limits it states (page sizes, TTLs, name lengths, id patterns) are read from the
modules that enforce them, so the description cannot drift from them, and nothing
beyond the Python package has to be shipped. Served by the API at
``GET /api/compute/v1/openapi.json`` (no credential: it describes a public
interface), and printed by ``python -m control.openapi`` for client generators and
fuzzers. ``tests/test_openapi.py`` checks it is a valid document, that every route
of :mod:`control.api` is in it and every path in it is routed, and that a running
``better-compute serve`` answers as it says.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from bcd import __version__, hardware, wire
from control import joinrequests, tenancy, tokens

BASE = "/api/compute"
PATH = "/v1/openapi.json"
"""Where the API serves this document, under :data:`BASE`."""

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _id(prefix: str) -> Schema:
    return {"type": "string", "pattern": f"^{prefix}_[0-9a-z]{{26}}$"}


def _nullable(schema: Schema) -> Schema:
    return {"oneOf": [schema, {"type": "null"}]}


_TIME: Schema = {
    "type": "string",
    "format": "date-time",
    "description": "RFC 3339 UTC with milliseconds, e.g. 2026-01-02T03:04:05.678Z",
}
_TEXT: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}
_INT: Schema = {"type": "integer"}
_OBJECT: Schema = {"type": "object"}
_STRINGS: Schema = {"type": "array", "items": {"type": "string"}}
NODE_STATES = ("adopting", "adopted", "revoked", "retired")


def _record(props: dict[str, Schema], optional: tuple[str, ...] = ()) -> Schema:
    return {
        "type": "object",
        "required": [k for k in props if k not in optional],
        "properties": props,
    }


def _page(item: str) -> Schema:
    return {
        "type": "object",
        "required": ["items"],
        "properties": {
            "items": {"type": "array", "items": _ref(item)},
            "nextPageToken": {
                "type": "string",
                "description": "present when more remain: pass it as pageToken for the next page",
            },
        },
    }


_POLICY: Schema = {
    "type": "object",
    "description": "A pool's policy; keys not named here are kept as given.",
    "properties": {
        "joinAttestors": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "description": "the attestors this pool admits (loaded plugins' names); absent: any",
        },
        "acceptanceChecks": {"type": "boolean"},
        "kubernetes": {
            "type": "object",
            "properties": {"platformOperated": {"type": "boolean"}},
        },
    },
}

_NODE: dict[str, Schema] = {
    "id": _id("node"),
    "siteId": _id("site"),
    "poolId": _id("pool"),
    "role": _TEXT,
    "state": {"type": "string", "enum": list(NODE_STATES)},
    "identityGeneration": _INT,
    "hardwareKeyTrusted": _BOOL,
    "attestor": _TEXT,
    "createdAt": _TIME,
    "hostname": {"type": "string", "description": "the hostname claimed at join; may be empty"},
    "lastSeenAt": _nullable(_TIME),
    "daemonVersion": _nullable(_TEXT),
    "certificateNotAfter": _nullable(_TIME),
}

SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object",
        "required": ["code", "message"],
        "properties": {
            "code": {"type": "string", "enum": list(wire.STATUS)},
            "message": _TEXT,
        },
        "additionalProperties": {"type": "string"},
        "description": "Every refusal (PROTOCOL.md); the HTTP status follows the code.",
    },
    "Health": _record(
        {"status": {"type": "string", "enum": ["ok", "unavailable"]}, "reason": _TEXT}
    ),
    "WellKnown": _record(
        {
            "name": {"const": "better-compute"},
            "version": _TEXT,
            "basePath": {"const": BASE},
            "protocol": _record({"min": _INT, "max": _INT}),
            "join": _record(
                {
                    "encryptionJwk": _OBJECT,
                    "encryptionKeyPin": _TEXT,
                    "signingCertificate": _TEXT,
                    "signingKeyPin": _TEXT,
                }
            ),
            "gateway": _record(
                {"url": _TEXT, "serverName": _TEXT, "servingCaPin": _TEXT, "servingCaPem": _TEXT}
            ),
        },
        optional=("join", "gateway"),
    ),
    "Tenant": _record({"id": _id("ten"), "name": _TEXT, "root": _BOOL, "createdAt": _TIME}),
    "TenantPage": _page("Tenant"),
    "Site": _record(
        {
            "id": _id("site"),
            "tenantId": _id("ten"),
            "name": _TEXT,
            "custom": _BOOL,
            "createdAt": _TIME,
        }
    ),
    "SitePage": _page("Site"),
    "SiteCreate": _record({"name": {"type": "string", "minLength": 1, "maxLength": 100}}),
    "Policy": _POLICY,
    "Pool": _record(
        {
            "id": _id("pool"),
            "tenantId": _id("ten"),
            "siteId": _id("site"),
            "name": _TEXT,
            "agent": {"type": "string", "enum": list(tenancy.AGENTS)},
            "policy": _ref("Policy"),
            "createdAt": _TIME,
        }
    ),
    "PoolPage": _page("Pool"),
    "PoolCreate": _record(
        {
            "siteId": _id("site"),
            "name": {"type": "string", "minLength": 1, "maxLength": 100},
            "agent": {"type": "string", "enum": list(tenancy.AGENTS)},
            "policy": _ref("Policy"),
        },
        optional=("policy",),
    ),
    "PoolPolicy": _record({"policy": _ref("Policy")}),
    "Expect": {
        "type": "object",
        "description": "Binds a token to one machine: every named identifier must match.",
        "properties": {key: {"type": "string", "maxLength": 256} for key in hardware.EXPECT_KEYS},
        "additionalProperties": False,
    },
    "JoinToken": _record(
        {
            "id": _id("jt"),
            "poolId": _id("pool"),
            "siteId": _id("site"),
            "role": {"type": "string", "enum": list(tokens.TOKEN_ROLES)},
            "usesLeft": _INT,
            "maxUses": _INT,
            "expect": {"type": "object", "additionalProperties": {"type": "string"}},
            "allowReclaim": _BOOL,
            "hosted": _nullable({"type": "string", "enum": list(tokens.HOSTED_KINDS)}),
            "createdAt": _TIME,
            "expiresAt": _TIME,
            "revoked": _BOOL,
        }
    ),
    "JoinTokenCreated": {
        "allOf": [_ref("JoinToken")],
        "type": "object",
        "properties": {
            "token": {
                "type": "string",
                "pattern": "^bcjt_jt_[0-9a-z]{26}\\.[A-Za-z0-9_-]{43}$",
                "description": "the bearer token, only in the answer of the call that "
                "created it (never on an idempotent replay); shown once, never stored",
            }
        },
    },
    "JoinTokenPage": _page("JoinToken"),
    "JoinTokenCreate": _record(
        {
            "ttlSeconds": {
                "type": "integer",
                "minimum": tokens.TTL_MIN_S,
                "maximum": tokens.TTL_MAX_S,
            },
            "maxUses": _nullable(
                {"type": "integer", "minimum": 1, "maximum": tokens.MAX_USES_LIMIT, "default": 1}
            ),
            "allowReclaim": _nullable({"type": "boolean", "default": False}),
            "hosted": _nullable({"type": "string", "enum": list(tokens.HOSTED_KINDS)}),
            "idempotencyKey": _nullable({"type": "string", "minLength": 1, "maxLength": 128}),
            "role": _nullable(
                {
                    "type": "string",
                    "enum": list(tokens.TOKEN_ROLES),
                    "default": "node",
                    "description": "site and ramdisk: the root tenant only (ACCESS_DENIED)",
                }
            ),
            "expect": _nullable(_ref("Expect")),
        },
        optional=("maxUses", "allowReclaim", "hosted", "idempotencyKey", "role", "expect"),
    ),
    "JoinRequest": _record(
        {
            "id": _id("jreq"),
            "tenantId": _id("ten"),
            "poolId": _id("pool"),
            "siteId": _id("site"),
            "attestor": _TEXT,
            "state": {"type": "string", "enum": list(joinrequests.STATES)},
            "claims": _OBJECT,
            "hardwareKey": _nullable(_TEXT),
            "mac": _nullable(_TEXT),
            "ip": _nullable(_TEXT),
            "workflowId": _nullable(_TEXT),
            "vouchedBy": _nullable(_TEXT),
            "bootLeaseEpoch": _nullable(_INT),
            "csrSha256": _TEXT,
            "createdAt": _TIME,
            "updatedAt": _TIME,
            "decidedAt": _nullable(_TIME),
            "decidedBy": _nullable(_TEXT),
            "reason": _nullable(_TEXT),
            "expiresAt": _nullable(_TIME),
            "consumedAt": _nullable(_TIME),
        }
    ),
    "JoinRequestPage": _page("JoinRequest"),
    "JoinRequestApprove": _record(
        {
            "ttlSeconds": _nullable(
                {
                    "type": "integer",
                    "minimum": joinrequests.TTL_MIN_S,
                    "maximum": joinrequests.TTL_MAX_S,
                    "default": joinrequests.TTL_DEFAULT_S,
                }
            ),
            "reason": _nullable({"type": "string", "maxLength": joinrequests.REASON_MAX}),
            "csrSha256": _nullable(
                {
                    "type": "string",
                    "pattern": "^[0-9a-f]{64}$",
                    "description": "the CSR the operator checked; INVALID_STATE when it changed",
                }
            ),
        },
        optional=("ttlSeconds", "reason", "csrSha256"),
    ),
    "JoinRequestReject": _record(
        {"reason": _nullable({"type": "string", "maxLength": joinrequests.REASON_MAX})},
        optional=("reason",),
    ),
    "Event": _record(
        {
            "id": _id("ev"),
            "type": _TEXT,
            "payload": _OBJECT,
            "createdAt": _TIME,
            "createdAtMs": _INT,
        }
    ),
    "EventList": _record({"items": {"type": "array", "items": _ref("Event")}}),
    "Node": _record(_NODE),
    "NodePage": _page("Node"),
    "Certificate": _record(
        {
            "serial": _TEXT,
            "identityGeneration": _INT,
            "role": _TEXT,
            "notBefore": _TIME,
            "notAfter": _TIME,
            "revoked": _BOOL,
            "revokeReason": _nullable(_TEXT),
            "statements": _STRINGS,
            "allowedKinds": _STRINGS,
        }
    ),
    "NodeDetail": {
        "allOf": [_ref("Node")],
        "type": "object",
        "required": ["certificates"],
        "properties": {"certificates": {"type": "array", "items": _ref("Certificate")}},
    },
    "RevokeIdentity": _record(
        {
            "reason": _nullable(
                {"type": "string", "pattern": "^[\\x20-\\x7e]{1,200}$", "default": "revoked"}
            )
        },
        optional=("reason",),
    ),
    "Revoked": _record({"nodeId": _id("node"), "reason": _TEXT, "revoked": _STRINGS}),
    "Adopted": _record({"nodeId": _id("node"), "state": {"const": "adopted"}, "changed": _BOOL}),
    "Deleted": _record({"nodeId": _id("node"), "state": {"const": "retired"}, "revoked": _STRINGS}),
}

# --- parameters ----------------------------------------------------------------------


def _path_param(name: str, schema: Schema, description: str = "") -> Schema:
    p: Schema = {"name": name, "in": "path", "required": True, "schema": schema}
    if description:
        p["description"] = description
    return p


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}  # fmt: skip


def _paging(prefix: str, page_max: int, default: int = tenancy.PAGE_DEFAULT) -> list[Schema]:
    return [
        _query(
            "pageSize",
            {"type": "integer", "minimum": 1, "maximum": page_max, "default": default},
            f"items per page, 1 to {page_max}",
        ),
        _query(
            "pageToken",
            _id(prefix) if prefix else {"type": "string"},
            "the nextPageToken of the page before",
        ),
    ]


TENANT = _path_param("tenantId", _id("ten"), "the caller's own tenant (else NOT_FOUND)")
POOL = _path_param("poolId", _id("pool"))
SITE = _path_param("siteId", _id("site"))
NODE = _path_param("nodeId", _id("node"))
REQUEST = _path_param("requestId", _id("jreq"))
TOKEN_ID = _path_param(
    "tokenId",
    {"type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[^/.]+$"},
    "the token's id (jt_…), never the token itself (INVALID_ARGUMENT)",
)

# --- the table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One operation: method, path (from the listener's root), what it takes and answers."""

    method: str
    path: str
    operation_id: str
    summary: str
    answer: str | None
    """The 200 body's schema name (None: :attr:`raw_answer`, of :attr:`media`)."""
    params: tuple[Schema, ...] = ()
    body: str | None = None
    body_required: bool = False
    errors: tuple[int, ...] = (400, 401, 404, 503)
    auth: bool = True
    tags: tuple[str, ...] = ()
    raw_answer: Schema = field(default_factory=dict)
    media: str = "application/json"
    also_503: str | None = None
    """The 503 body's schema name when it is not Error (health)."""


_T = f"{BASE}/v1/tenants/{{tenantId}}"
_P = f"{_T}/pools/{{poolId}}"
_WRITE = (400, 401, 404, 409, 413, 503)

OPERATIONS: tuple[Op, ...] = (
    Op("get", "/healthz", "healthz", "Liveness: the process answers", "Health",
       errors=(), auth=False, tags=("health",)),
    Op("get", "/readyz", "readyz", "Readiness: the database answers", "Health",
       errors=(), auth=False, tags=("health",), also_503="Health"),
    Op("get", f"{BASE}/.well-known/better-compute", "wellKnown",
       "The discovery document bcd join --server reads", "WellKnown",
       errors=(404, 503), auth=False, tags=("public",)),
    Op("get", f"{BASE}{PATH}", "openapi", "This description (OpenAPI 3.1)", None,
       errors=(503,), auth=False, tags=("public",), raw_answer={"type": "object"}),
    Op("get", f"{BASE}/downloads/bcd/{{version}}/linux-{{arch}}", "download",
       "The bcd artifact (serve --downloads DIR)", None,
       params=(
           _path_param("version", {"type": "string",
                                   "pattern": "^[0-9]{1,6}\\.[0-9]{1,6}\\.[0-9]{1,6}$"}),
           _path_param("arch", {"type": "string", "enum": ["amd64", "arm64"]}),
       ),
       errors=(404, 503), auth=False, tags=("public",),
       media="application/octet-stream"),
    Op("get", f"{BASE}/v1/tenants", "tenantsList",
       "Every tenant (the root tenant), else the caller's own", "TenantPage",
       params=tuple(_paging("ten", tenancy.PAGE_MAX)), tags=("tenants",)),
    Op("get", f"{BASE}/v1/tenants/self", "tenantsSelf",
       "The caller's own tenant (how a CLI learns its credential's tenant)", "Tenant",
       errors=(401, 503), tags=("tenants",)),
    Op("get", f"{BASE}/v1/tenants/{{tenantId}}", "tenantsShow",
       "A tenant: the caller's own, or any for the root tenant", "Tenant",
       params=(_path_param("tenantId", _id("ten")),), errors=(401, 404, 503),
       tags=("tenants",)),
    Op("post", f"{_T}/sites", "sitesCreate", "Create a site", "Site",
       params=(TENANT,), body="SiteCreate", body_required=True, errors=_WRITE,
       tags=("sites",)),
    Op("get", f"{_T}/sites", "sitesList", "The tenant's sites, in id order", "SitePage",
       params=(TENANT, *_paging("site", tenancy.SITE_POOL_PAGE_MAX)), tags=("sites",)),
    Op("get", f"{_T}/sites/{{siteId}}", "sitesShow", "A site", "Site",
       params=(TENANT, SITE), errors=(401, 404, 503), tags=("sites",)),
    Op("post", f"{_T}/pools", "poolsCreate", "Create a pool in a site", "Pool",
       params=(TENANT,), body="PoolCreate", body_required=True, errors=_WRITE,
       tags=("pools",)),
    Op("get", f"{_T}/pools", "poolsList", "The tenant's pools, in id order", "PoolPage",
       params=(TENANT, _query("siteId", _id("site"), "only this site's pools"),
               *_paging("pool", tenancy.SITE_POOL_PAGE_MAX)),
       tags=("pools",)),
    Op("get", f"{_P}", "poolsShow", "A pool", "Pool",
       params=(TENANT, POOL), errors=(401, 404, 503), tags=("pools",)),
    Op("post", f"{_P}/policy", "poolsSetPolicy", "Replace a pool's policy", "Pool",
       params=(TENANT, POOL), body="PoolPolicy", body_required=True, errors=_WRITE,
       tags=("pools",)),
    Op("post", f"{_P}/join-tokens", "joinTokensCreate",
       "Mint a join token (joinTokens.create)", "JoinTokenCreated",
       params=(TENANT, POOL), body="JoinTokenCreate", body_required=True,
       errors=(400, 401, 403, 404, 409, 413, 503), tags=("join-tokens",)),
    Op("get", f"{_P}/join-tokens", "joinTokensList",
       "The pool's tokens, in id order, never a secret", "JoinTokenPage",
       params=(TENANT, POOL,
               _query("includeInactive", {"type": "string", "enum": ["true", "false"]},
                      "true: revoked, expired and used-up tokens too"),
               *_paging("", tokens.PAGE_MAX, tokens.PAGE_DEFAULT)),
       tags=("join-tokens",)),
    Op("post", f"{_P}/join-tokens/{{tokenId}}/revoke", "joinTokensRevoke",
       "End a token at once (idempotent)", "JoinToken",
       params=(TENANT, POOL, TOKEN_ID), errors=(400, 401, 404, 413, 503),
       tags=("join-tokens",)),
    Op("get", f"{_P}/join-requests", "joinRequestsList",
       "The pool's join requests, newest first", "JoinRequestPage",
       params=(TENANT, POOL,
               _query("state", {"type": "string",
                                "enum": [*joinrequests.STATES, "all"], "default": "pending"},
                      "which requests"),
               *_paging("jreq", 1000)),
       tags=("join-requests",)),
    Op("post", f"{_P}/join-requests/{{requestId}}/approve", "joinRequestsApprove",
       "Approve a pending request: one join with its CSR until ttlSeconds from now",
       "JoinRequest", params=(TENANT, POOL, REQUEST), body="JoinRequestApprove",
       errors=(400, 401, 404, 413, 503), tags=("join-requests",)),
    Op("post", f"{_P}/join-requests/{{requestId}}/reject", "joinRequestsReject",
       "Reject a pending request", "JoinRequest",
       params=(TENANT, POOL, REQUEST), body="JoinRequestReject",
       errors=(400, 401, 404, 413, 503), tags=("join-requests",)),
    Op("get", f"{_T}/events", "eventsList", "The tenant's events, oldest first", "EventList",
       params=(TENANT,
               _query("type", {"type": "string", "pattern": "^[a-z][a-z0-9.-]{0,99}$"},
                      "only events of this type, e.g. security.join.refused"),
               _query("since", {"type": "integer", "minimum": 0, "maximum": 253_402_300_799_999},
                      "only events at or after this time (unix milliseconds)"),
               _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000,
                                "default": 100}, "at most this many")),
       tags=("events",)),
    Op("get", f"{_T}/nodes", "nodesList", "The tenant's nodes, in id order", "NodePage",
       params=(TENANT, _query("poolId", _id("pool"), "only this pool's nodes"),
               *_paging("node", tenancy.PAGE_MAX)),
       tags=("nodes",)),
    Op("get", f"{_T}/nodes/{{nodeId}}", "nodesShow", "A node and its certificates",
       "NodeDetail", params=(TENANT, NODE), errors=(401, 404, 503), tags=("nodes",)),
    Op("post", f"{_T}/nodes/{{nodeId}}/revoke-identity", "nodesRevokeIdentity",
       "Revoke every live certificate of the node (nodes.revokeIdentity)", "Revoked",
       params=(TENANT, NODE), body="RevokeIdentity", errors=(400, 401, 404, 413, 503),
       tags=("nodes",)),
    Op("post", f"{_T}/nodes/{{nodeId}}/adopt", "nodesAdopt",
       "Mark an adopting node adopted (a pool with acceptance checks)", "Adopted",
       params=(TENANT, NODE), errors=(400, 401, 404, 413, 503), tags=("nodes",)),
    Op("delete", f"{_T}/nodes/{{nodeId}}", "nodesDelete",
       "Retire a node and revoke its certificates (idempotent)", "Deleted",
       params=(TENANT, NODE), errors=(401, 404, 503), tags=("nodes",)),
)  # fmt: skip

_DESCRIPTIONS = {
    400: "INVALID_ARGUMENT or INVALID_STATE",
    401: "UNAUTHENTICATED: no Authorization: Bearer bcak_… or not a valid one",
    403: "ACCESS_DENIED",
    404: "NOT_FOUND, also for another tenant's tenant, site, pool, token, request or node",
    409: "ALREADY_EXISTS or CONFLICT",
    413: "INVALID_ARGUMENT: request body too large (64 KiB)",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE: the database does not answer, or an internal error",
}
_PUSHBACK = {
    "retry-pushback-ms": {
        "description": "wait this many milliseconds before retrying",
        "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"},
    }
}


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(op: Op) -> dict[str, Any]:
    schema = _ref(op.answer) if op.answer is not None else op.raw_answer
    responses: dict[str, Any] = {
        "200": {"description": "OK", "content": {op.media: {"schema": schema}}}
    }
    for status in op.errors:
        response: dict[str, Any] = {
            "description": _DESCRIPTIONS[status],
            "content": _json(_ref("Error")),
        }
        if status in (429, 503):
            response["headers"] = _PUSHBACK
        responses[str(status)] = response
    if op.also_503:
        responses["503"] = {"description": "not ready", "content": _json(_ref(op.also_503))}
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "tags": list(op.tags),
        "responses": responses,
        "security": [{"bearer": []}] if op.auth else [],
    }
    if op.params:
        out["parameters"] = list(op.params)
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required, "content": _json(_ref(op.body))}
    return out


@functools.cache
def document() -> dict[str, Any]:
    """The whole OpenAPI document (built once)."""
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "better-compute tenant API",
            "version": __version__,
            "description": (
                "The API listener of better-compute serve (--api-listen): the tenant API "
                f"under {BASE}/v1 with Authorization: Bearer bcak_…, the well-known "
                "document, the bcd downloads and the health probes. Errors are "
                '{"code", "message"} with the status of the code (PROTOCOL.md).'
            ),
        },
        "servers": [{"url": "/", "description": "the API listener"}],
        "security": [{"bearer": []}],
        "tags": [{"name": t} for t in dict.fromkeys(t for op in OPERATIONS for t in op.tags)],
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "bcak_<id>.<secret>",
                    "description": "a tenant API credential (better-compute tenants create)",
                }
            },
        },
    }


@functools.cache
def document_bytes() -> bytes:
    """:func:`document` as the API serves it."""
    return wire.dumps(document())


def main() -> int:
    sys.stdout.write(json.dumps(document(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tenant API under /api/compute, the well-known document, and the gateway routes.

Handlers parse the request into typed values, run one store transaction in a worker
thread, and answer JSON. A ControlError becomes ``{"code", "message"}``; any other
exception becomes a generic 503 UNAVAILABLE in control.http, never its text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from bcd import __version__, wire
from control import downloads, events, joinrequests, nodes, openapi, tenancy, tokens
from control.errors import ControlError, invalid
from control.http import Request, Response, error_response, health_response, json_response
from control.joinservice import NoticeSigner
from control.store import Store, Tx

log = logging.getLogger("control.api")

BASE_PATH = "/api/compute"
T = TypeVar("T")


@dataclass
class App:
    store: Store
    well_known_join: dict[str, Any] | None
    gateway: dict[str, Any] | None
    limiter: trio.CapacityLimiter
    on_revocation: Callable[[], None] = lambda: None
    """Called after a revocation made through this API (the gateway looks at once)."""
    downloads: Path | None = None
    """``serve --downloads DIR``: the bcd artifacts served under /downloads (control.downloads)."""
    ready: Callable[[], Awaitable[tuple[bool, str]]] | None = None
    """``GET /readyz``: whether this replica can do its job now (the database answers)."""
    sign_notice: NoticeSigner | None = None
    """Signs the RevocationNotice of each certificate this API revokes (the join key)."""
    attestors: tuple[str, ...] | None = None
    """The loaded attestor plugins' names: a pool's policy.joinAttestors may name only
    these (None: not checked)."""

    def _notice_signer(self) -> NoticeSigner:
        if self.sign_notice is None:
            raise ControlError("INVALID_CONFIG", "this API has no join-signing key to revoke with")
        return self.sign_notice

    async def run(self, fn: Callable[[Tx], T]) -> T:
        def work() -> T:
            with self.store.tx() as tx:
                return fn(tx)

        return await trio.to_thread.run_sync(work, limiter=self.limiter)

    # --- the API ------------------------------------------------------------------

    async def api(self, req: Request) -> Response:
        try:
            return await self._api(req)
        except ControlError as exc:
            return _error(exc)

    async def _api(self, req: Request) -> Response:
        path = req.path
        if req.method == "GET" and path in ("/healthz", "/readyz"):
            if path == "/healthz" or self.ready is None:
                return health_response(True, "alive" if path == "/healthz" else "ready")
            return health_response(*await self.ready())
        if not path.startswith(BASE_PATH + "/"):
            raise ControlError("NOT_FOUND", "no such path")
        path = path[len(BASE_PATH) :]
        if path == "/.well-known/better-compute" and req.method == "GET":
            return json_response(200, self.well_known())
        if path == openapi.PATH and req.method == "GET":  # public: describes a public API
            return Response(200, openapi.document_bytes(), [("content-type", "application/json")])
        if path.startswith(downloads.PREFIX):
            return await downloads.serve_download(self.downloads, req.method, path)
        if req.method == "GET" and (
            m := re.fullmatch(r"/v1/tenants(?:/(ten_[0-9a-z]{26}|self))?", path)
        ):
            return await self._tenants(await self._authenticate(req), m.group(1), req.query)
        m = re.fullmatch(r"/v1/tenants/([a-z]+_[0-9a-z]{26})(/.*)", path)
        if not m:
            raise ControlError("NOT_FOUND", "no such path")
        tenant_id, rest = m.group(1), m.group(2)
        caller = await self._authenticate(req)
        if caller != tenant_id:
            raise ControlError("NOT_FOUND", "no such tenant")
        body = _json_body(req) if req.method == "POST" else {}
        route = _route(req.method, rest)
        if route is None:
            raise ControlError("NOT_FOUND", "no such path")
        name, args = route
        handler: Callable[..., Awaitable[Response]] = getattr(self, f"_r_{name}")
        return await handler(tenant_id, body, req.query, *args)

    async def _authenticate(self, req: Request) -> str:
        header = req.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise ControlError("UNAUTHENTICATED", "an API credential is required (Bearer bcak_…)")
        bearer = header[len("Bearer ") :].strip()
        tenant = await self.run(lambda tx: tenancy.authenticate(tx, bearer))
        if tenant is None:
            raise ControlError("UNAUTHENTICATED", "the API credential is not valid")
        return tenant

    async def _tenants(self, caller: str, tenant_id: str | None, q: dict[str, str]) -> Response:
        """``GET /v1/tenants`` (every tenant for the root tenant, else the caller's own)
        and ``GET /v1/tenants/{id}`` (the caller's own, or any for the root tenant;
        ``self``: the caller's own, which is how a CLI learns its credential's tenant)."""
        if tenant_id == "self":
            tenant_id = caller
        if tenant_id is not None:
            return json_response(
                200, await self.run(lambda tx: tenancy.show_tenant(tx, caller, tenant_id))
            )
        size, token = _paging(q, "ten")
        return json_response(
            200,
            await self.run(
                lambda tx: tenancy.list_tenants(tx, caller, page_size=size, page_token=token)
            ),
        )

    def _check_attestors(self, policy: dict[str, Any]) -> None:
        if self.attestors is not None:
            tenancy.check_policy_attestors(policy, self.attestors)

    def well_known(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": "better-compute",
            "version": __version__,
            "basePath": BASE_PATH,
            "protocol": {"min": wire.PROTOCOL_VERSION, "max": wire.PROTOCOL_VERSION},
        }
        if self.well_known_join is not None:
            doc["join"] = self.well_known_join
        if self.gateway is not None:
            doc["gateway"] = self.gateway
        return doc

    async def _r_sites_create(
        self, tenant: str, body: dict[str, Any], q: dict[str, str]
    ) -> Response:
        name = _field(body, "name", str)
        return json_response(200, await self.run(lambda tx: tenancy.create_site(tx, tenant, name)))

    async def _r_pools_create(
        self, tenant: str, body: dict[str, Any], q: dict[str, str]
    ) -> Response:
        site_id = _field(body, "siteId", str)
        name = _field(body, "name", str)
        agent = _field(body, "agent", str)
        policy = body.get("policy") or {}
        if not isinstance(policy, dict):
            raise invalid("policy must be an object")
        self._check_attestors(policy)

        def create(tx: Tx) -> dict[str, Any]:
            site = tx.one("SELECT tenant_id FROM sites WHERE id = ?", (site_id,))
            if site is None or site["tenant_id"] != tenant:
                raise ControlError("NOT_FOUND", "no such site")
            return tenancy.create_pool(tx, tenant, site_id, name, agent, policy)

        return json_response(200, await self.run(create))

    async def _r_sites_list(self, tenant: str, body: dict[str, Any], q: dict[str, str]) -> Response:
        size, token = _paging(q, "site", tenancy.SITE_POOL_PAGE_MAX)
        return json_response(
            200,
            await self.run(
                lambda tx: tenancy.list_sites(tx, tenant, page_size=size, page_token=token)
            ),
        )

    async def _r_sites_show(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], site_id: str
    ) -> Response:
        return json_response(200, await self.run(lambda tx: tenancy.show_site(tx, tenant, site_id)))

    async def _r_pools_list(self, tenant: str, body: dict[str, Any], q: dict[str, str]) -> Response:
        size, token = _paging(q, "pool", tenancy.SITE_POOL_PAGE_MAX)
        site = q.get("siteId") or None
        if site is not None and not re.fullmatch(r"site_[0-9a-z]{26}", site):
            raise invalid("siteId must be a site id (site_…)")
        return json_response(
            200,
            await self.run(
                lambda tx: tenancy.list_pools(
                    tx, tenant, site_id=site, page_size=size, page_token=token
                )
            ),
        )

    async def _r_pools_show(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str
    ) -> Response:
        return json_response(200, await self.run(lambda tx: tenancy.show_pool(tx, tenant, pool_id)))

    async def _r_tokens_create(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str
    ) -> Response:
        ttl = _field(body, "ttlSeconds", int)
        max_uses = _field(body, "maxUses", int, 1)
        allow_reclaim = _field(body, "allowReclaim", bool, False)
        hosted = _field(body, "hosted", str, None)
        key = _field(body, "idempotencyKey", str, None)
        role = _field(body, "role", str, "node")
        expect = body.get("expect")
        created = await self.run(
            lambda tx: tokens.create(
                tx,
                tenant,
                pool_id,
                ttl_s=ttl,
                max_uses=max_uses,
                allow_reclaim=allow_reclaim,
                expect=expect,
                hosted=hosted,
                idempotency_key=key,
                role=role,
            )
        )
        return json_response(200, created)

    async def _r_tokens_list(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str
    ) -> Response:
        include = q.get("includeInactive", "false") == "true"
        try:
            size = int(q.get("pageSize", tokens.PAGE_DEFAULT))
        except ValueError:
            raise invalid("pageSize must be a number") from None
        page = q.get("pageToken")
        return json_response(
            200,
            await self.run(
                lambda tx: tokens.list_tokens(
                    tx, tenant, pool_id, include_inactive=include, page_size=size, page_token=page
                )
            ),
        )

    async def _r_tokens_revoke(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str, token_id: str
    ) -> Response:
        return json_response(
            200, await self.run(lambda tx: tokens.revoke(tx, tenant, pool_id, token_id))
        )

    async def _r_requests_list(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str
    ) -> Response:
        state = q.get("state", "pending")
        size = _bounded_int(q, "pageSize", 1, 1000, 100) or 100
        token = q.get("pageToken") or None
        if token is not None and not re.fullmatch(r"jreq_[0-9a-z]{26}", token):
            raise invalid("pageToken must be a request id (jreq_…)")
        return json_response(
            200,
            await self.run(
                lambda tx: joinrequests.list_requests(
                    tx, tenant, pool_id, state, page_size=size, page_token=token
                )
            ),
        )

    async def _r_requests_approve(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str, request_id: str
    ) -> Response:
        ttl = _field(body, "ttlSeconds", int, joinrequests.TTL_DEFAULT_S)
        reason = _field(body, "reason", str, None)
        csr = _field(body, "csrSha256", str, None)
        return json_response(
            200,
            await self.run(
                lambda tx: joinrequests.approve(
                    tx,
                    tenant,
                    pool_id,
                    request_id,
                    ttl_s=ttl,
                    reason=reason,
                    decided_by=tenant,
                    csr_sha256=csr,
                )
            ),
        )

    async def _r_requests_reject(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str, request_id: str
    ) -> Response:
        reason = _field(body, "reason", str, None)
        return json_response(
            200,
            await self.run(
                lambda tx: joinrequests.reject(
                    tx, tenant, pool_id, request_id, reason=reason, decided_by=tenant
                )
            ),
        )

    async def _r_events_list(
        self, tenant: str, body: dict[str, Any], q: dict[str, str]
    ) -> Response:
        type_ = q.get("type") or None
        if type_ is not None and not re.fullmatch(r"[a-z][a-z0-9.-]{0,99}", type_):
            raise invalid("type must be an event type such as security.join.refused")
        since = _bounded_int(q, "since", 0, MAX_MS, None)
        limit = _bounded_int(q, "limit", 1, 1000, 100) or 100
        items = await self.run(lambda tx: events.list_events(tx, tenant, type_, since, limit))
        return json_response(200, {"items": items})

    async def _r_pools_policy(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], pool_id: str
    ) -> Response:
        policy = body.get("policy")
        if not isinstance(policy, dict):
            raise invalid("policy must be an object")
        self._check_attestors(policy)
        return json_response(
            200, await self.run(lambda tx: tenancy.set_pool_policy(tx, tenant, pool_id, policy))
        )

    async def _r_nodes_show(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], node_id: str
    ) -> Response:
        return json_response(200, await self.run(lambda tx: nodes.show_node(tx, tenant, node_id)))

    async def _r_nodes_list(self, tenant: str, body: dict[str, Any], q: dict[str, str]) -> Response:
        size, token = _paging(q, "node")
        pool = q.get("poolId") or None
        if pool is not None and not re.fullmatch(r"pool_[0-9a-z]{26}", pool):
            raise invalid("poolId must be a pool id (pool_…)")
        return json_response(
            200,
            await self.run(
                lambda tx: nodes.list_nodes(tx, tenant, pool, page_size=size, page_token=token)
            ),
        )

    async def _r_nodes_adopt(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], node_id: str
    ) -> Response:
        return json_response(200, await self.run(lambda tx: nodes.adopt_node(tx, tenant, node_id)))

    async def _r_nodes_revoke_identity(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], node_id: str
    ) -> Response:
        reason = _field(body, "reason", str, "revoked")
        sign = self._notice_signer()
        result = await self.run(lambda tx: nodes.revoke_identity(tx, tenant, node_id, sign, reason))
        self.on_revocation()
        return json_response(200, result)

    async def _r_nodes_delete(
        self, tenant: str, body: dict[str, Any], q: dict[str, str], node_id: str
    ) -> Response:
        sign = self._notice_signer()
        result = await self.run(lambda tx: nodes.delete_node(tx, tenant, node_id, sign))
        self.on_revocation()
        return json_response(200, result)


_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"/sites"), "sites_create"),
    ("GET", re.compile(r"/sites"), "sites_list"),
    ("GET", re.compile(r"/sites/(site_[0-9a-z]{26})"), "sites_show"),
    ("POST", re.compile(r"/pools"), "pools_create"),
    ("GET", re.compile(r"/pools"), "pools_list"),
    ("GET", re.compile(r"/pools/(pool_[0-9a-z]{26})"), "pools_show"),
    ("POST", re.compile(r"/pools/(pool_[0-9a-z]{26})/join-tokens"), "tokens_create"),
    ("GET", re.compile(r"/pools/(pool_[0-9a-z]{26})/join-tokens"), "tokens_list"),
    (
        "POST",
        re.compile(r"/pools/(pool_[0-9a-z]{26})/join-tokens/([^/]{1,200})/revoke"),
        "tokens_revoke",
    ),
    ("GET", re.compile(r"/pools/(pool_[0-9a-z]{26})/join-requests"), "requests_list"),
    (
        "POST",
        re.compile(r"/pools/(pool_[0-9a-z]{26})/join-requests/(jreq_[0-9a-z]{26})/approve"),
        "requests_approve",
    ),
    (
        "POST",
        re.compile(r"/pools/(pool_[0-9a-z]{26})/join-requests/(jreq_[0-9a-z]{26})/reject"),
        "requests_reject",
    ),
    ("GET", re.compile(r"/events"), "events_list"),
    ("GET", re.compile(r"/nodes"), "nodes_list"),
    ("GET", re.compile(r"/nodes/(node_[0-9a-z]{26})"), "nodes_show"),
    ("POST", re.compile(r"/nodes/(node_[0-9a-z]{26})/revoke-identity"), "nodes_revoke_identity"),
    ("POST", re.compile(r"/nodes/(node_[0-9a-z]{26})/adopt"), "nodes_adopt"),
    ("DELETE", re.compile(r"/nodes/(node_[0-9a-z]{26})"), "nodes_delete"),
    ("POST", re.compile(r"/pools/(pool_[0-9a-z]{26})/policy"), "pools_policy"),
]


def _route(method: str, path: str) -> tuple[str, tuple[str, ...]] | None:
    for m, pattern, name in _ROUTES:
        match = pattern.fullmatch(path)
        if match and m == method:
            return name, match.groups()
    return None


_MISSING = object()


def _field(body: dict[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    value = body.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise invalid(f"{key} is required")
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise invalid(f"{key} must be a whole number")
    if not isinstance(value, kind):
        raise invalid(f"{key} must be a {kind.__name__}")
    return value


def _json_body(req: Request) -> dict[str, Any]:
    if not req.body:
        return {}
    try:
        return wire.loads_object(req.body)
    except wire.WireError as exc:
        raise invalid(str(exc)) from exc


MAX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, within BIGINT on both stores


def _bounded_int(
    q: dict[str, str], name: str, low: int, high: int, default: int | None
) -> int | None:
    """A query parameter of ASCII digits within [low, high]; absent: ``default``."""
    text = q.get(name)
    if text is None or text == "":
        return default
    if not (text.isascii() and text.isdigit()) or len(text) > 15 or not low <= int(text) <= high:
        raise invalid(f"{name} must be a whole number from {low} to {high}")
    return int(text)


def _paging(
    q: dict[str, str], prefix: str, page_max: int = tenancy.PAGE_MAX
) -> tuple[int, str | None]:
    """``pageSize`` (1 to ``page_max``, default 100) and ``pageToken`` (the last id of
    the page before, ``{prefix}_…``) of a list."""
    size = _bounded_int(q, "pageSize", 1, page_max, tenancy.PAGE_DEFAULT)
    token = q.get("pageToken") or None
    if token is not None and not re.fullmatch(rf"{prefix}_[0-9a-z]{{26}}", token):
        raise invalid(f"pageToken must be an id ({prefix}_…), the nextPageToken of a page")
    return size or tenancy.PAGE_DEFAULT, token


def _error(exc: ControlError) -> Response:
    headers: list[tuple[str, str]] = []
    if exc.retry_after_ms is not None:
        headers.append(("retry-pushback-ms", str(exc.retry_after_ms)))
    return error_response(exc.code, exc.message, headers, details=exc.details)

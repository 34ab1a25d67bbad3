"""``better-compute serve``: the tenant API and the gateway in one trio process."""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import resource
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from bcd import fs
from bcd.pki import cert_pem
from bcd.plugins import Plugins, load_plugins
from bcd.systemd import LEVELS, configure_logging, notify, under_journald
from control import gatewaypki, pki, relay, retention, revocations
from control.api import App
from control.errors import ControlError, StoreUnavailable
from control.gateway import PING_INTERVAL_S, Gateway, NodeCalls
from control.http import (
    ADDRESS_PREFIX,
    SITE_PREFIX,
    Handler,
    Lifecycle,
    Limits,
    Request,
    Response,
    health_response,
    serve,
)
from control.joinservice import CERT_TTL_MAX_S, JoinCrypto, JoinService, notice_signer
from control.metrics import Metrics
from control.relay import RelayClient, RelayListener
from control.renewal import RenewService
from control.store import Store, open_store, reach
from control.store.base import migrations

log = logging.getLogger("control.server")


def join_crypto(loaded: pki.Pki, cert_ttl_s: int = CERT_TTL_MAX_S) -> JoinCrypto:
    return JoinCrypto(
        trust_domain=loaded.trust_domain,
        signing_key=loaded.join_signing_key,
        encryption_key=loaded.join_encryption_key,
        issue_leaf=functools.partial(pki.issue_node_leaf, loaded),
        chain_tail_pem=loaded.chain_tail_pem(),
        bundle_pem=loaded.bundle_pem(),
        trust_version=loaded.trust_version,
        cert_ttl_s=cert_ttl_s,
    )


def check_attestor_settings(plugins: Plugins, settings: Mapping[str, str]) -> None:
    """Fail at start, not at the first join, when an attestor's settings are unusable:
    each loaded attestor checks its own (``bcd_server_check_settings``)."""
    problems = plugins.server_settings_problems(settings)
    if problems:
        raise ControlError("INVALID_CONFIG", problems[0])


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ControlError("INVALID_ARGUMENT", f"listen address {listen!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


ROLES = ("all", "api", "gateway")
DRAIN_S = 30.0
RELAY_MAX_CONNECTIONS = 2_048
RELAY_MAX_PER_SOURCE = 512
"""``--relay-max-per-source``'s default: 64 per gateway's relay pool, so eight gateways
behind one address (a NAT), and at least four sources to fill the listener."""
_RELAY_MAX_HANDSHAKES = 64
IPV6_SOURCE_PREFIX = SITE_PREFIX
"""``--ipv6-source-prefix``'s default: every listener but the relay counts an IPv6
client by its /48 (a site's prefix, one source's share however many /64s it holds).
A fleet with public addresses in one /48 gives each machine's prefix a share of its
own: 64 where a machine holds a /64, up to 128 (each address) where many share a /64,
as a cloud subnet's VMs do. The relay listener counts each address whatever it is
(:func:`relay_limits`)."""


def relay_limits(max_per_source: int = RELAY_MAX_PER_SOURCE) -> Limits:
    """The relay listener's limits with ``max_per_source`` connections from one address
    (``--relay-max-per-source``); ValueError, saying the range, outside 1 to 2,048.

    A source's share of the handshakes follows its share of the connections (at most
    8), so stalling every handshake takes as many addresses as filling the listener
    does (down to 32 per source; below that, 64 addresses).

    A source is one address, an IPv6 one too (``source_prefix`` 128), whatever
    ``--ipv6-source-prefix`` says: the relay's clients are the operator's own gateways
    (relay certificates), on an internal network usually inside one /48 or one /64,
    which counted by a prefix would share one source's share among them all."""
    if isinstance(max_per_source, bool) or not 1 <= max_per_source <= RELAY_MAX_CONNECTIONS:
        raise ValueError(f"a whole number from 1 to {RELAY_MAX_CONNECTIONS:,}")
    share = _RELAY_MAX_HANDSHAKES * max_per_source // RELAY_MAX_CONNECTIONS
    return Limits(
        max_connections=RELAY_MAX_CONNECTIONS,
        max_per_source=max_per_source,
        max_handshakes=_RELAY_MAX_HANDSHAKES,
        max_handshakes_per_source=min(8, max(1, share)),
        source_prefix=ADDRESS_PREFIX,
    )


# Per listener (docs/decisions.md, "Connection limits"): the gateway holds a session
# per node; the relay takes a few gateways' pools; the tenant API, operators' calls.
# Stalling every TLS handshake of a listener takes max_handshakes /
# max_handshakes_per_source addresses, no fewer than filling it takes (max_connections /
# max_per_source): the gateway 1,024 / 64 = 16 against 16,000 / 1,024 (16), the relay
# 64 / 8 = 8 against 2,048 / 512 (4). A connection holds a slot only once it has sent
# something, so that is max_handshakes talking connections every 5 s (the gateway's
# about 205 a second). The gateway's 64 per source are for a site of up to 1,024 nodes
# (the per-source connection bound) behind one NAT address, all redialling at once.
# The API and metrics listeners have no TLS. A source is an IPv4 address, or an IPv6
# address's /48 (serve --ipv6-source-prefix changes it), the relay's each address.
LIMITS = {
    "gateway": Limits(
        max_connections=16_000,
        max_per_source=1_024,
        idle_timeout=30.0,
        max_handshakes=1_024,
        max_handshakes_per_source=64,
    ),
    "relay": relay_limits(),  # the file limit caps the total
    "api": Limits(max_connections=1_024, max_per_source=128),
    "metrics": Limits(max_connections=64, max_per_source=16),
}


def raise_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit; return the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft


def setup_logging(level: str = "info", log_format: str = "text") -> None:
    """``--log-level`` and ``--log-format`` on stderr (:func:`bcd.systemd.configure_logging`:
    under journald each line carries its ``<N>`` priority and the text format no second
    timestamp, since the journal stamps each line)."""
    text = "%(levelname)s %(name)s: %(message)s"
    if not under_journald(sys.stderr):
        text = "%(asctime)s " + text
    configure_logging(sys.stderr, LEVELS[level], text, log_format=log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per relayed call


@dataclass
class _Readiness:
    """``/readyz`` for every listener of a process: draining, else the database (and, on
    a gateway, an upstream), asked at most once a second however often it is called."""

    store: Store
    limiter: trio.CapacityLimiter
    upstream: RelayClient | None = None
    draining: bool = False
    _at: float = -1e9
    _answer: tuple[bool, str] = (False, "starting")
    _checking: bool = False

    async def __call__(self) -> tuple[bool, str]:
        """One check at a time, at most one a second: while one runs (a database that
        hangs holds it up to 2 s), callers get the last answer."""
        if self.draining:
            return False, "draining"
        now = trio.current_time()
        if now - self._at >= 1.0 and not self._checking:
            self._at, self._checking = now, True
            try:
                self._answer = await self._check()
            finally:
                self._checking = False
        return self._answer

    async def _check(self) -> tuple[bool, str]:
        ok, reason = await _db_ready(self.store, self.limiter)
        if ok and self.upstream is not None and not await self.upstream.any_up():
            return False, "no API upstream answers"
        return ok, reason


async def _db_ready(store: Store, limiter: trio.CapacityLimiter) -> tuple[bool, str]:
    def ping() -> None:
        with store.tx() as tx:
            tx.now_ms()

    try:
        with trio.fail_after(2):
            await trio.to_thread.run_sync(ping, limiter=limiter, abandon_on_cancel=True)
    except (StoreUnavailable, trio.TooSlowError):
        return False, "the database does not answer"
    except Exception:
        log.exception("readiness check failed")
        return False, "the database check failed"
    return True, "ready"


def main(
    *,
    home: Path,
    db_url: str,
    api_listen: str,
    gateway_listen: str,
    gateway_san: str,
    gateway_url: str | None,
    ready_file: Path | None,
    secret: bytes | None,
    cert_ttl_s: int = CERT_TTL_MAX_S,
    attestor_settings: Mapping[str, str] | None = None,
    downloads: Path | None = None,
    role: str = "all",
    relay_listen: str | None = None,
    relay_san: str | None = None,
    gateway_dir: Path | None = None,
    api_upstreams: Sequence[str] = (),
    drain_s: float = DRAIN_S,
    session_ping_s: float = PING_INTERVAL_S,
    metrics_listen: str | None = None,
    log_level: str = "info",
    log_format: str = "text",
    relay_max_per_source: int = RELAY_MAX_PER_SOURCE,
    ipv6_source_prefix: int = IPV6_SOURCE_PREFIX,
) -> int:
    """``better-compute serve``: ``role`` all (one process, the default), api or gateway."""
    setup_logging(log_level, log_format)
    files = raise_file_limit()
    if files < sum(lim.max_connections for lim in LIMITS.values()) + 256:
        log.warning("open-file limit %d is below the connection limits' sum", files)
    if role not in ROLES:
        raise ControlError("INVALID_ARGUMENT", f"--role must be one of {', '.join(ROLES)}")
    if not 0.05 <= session_ping_s <= 45:  # a node drops a session after 50 s of silence
        raise ControlError("INVALID_ARGUMENT", "--session-ping-seconds must be from 0.05 to 45")
    try:
        relay_limit = relay_limits(relay_max_per_source)
    except ValueError as exc:
        raise ControlError("INVALID_ARGUMENT", f"--relay-max-per-source must be {exc}") from exc
    try:  # every listener but the relay (each address) counts IPv6 by the operator's prefix
        limits = {
            name: lim if name == "relay" else replace(lim, source_prefix=ipv6_source_prefix)
            for name, lim in {**LIMITS, "relay": relay_limit}.items()
        }
    except ValueError:
        raise ControlError(
            "INVALID_ARGUMENT",
            f"--ipv6-source-prefix must be a whole number from {SITE_PREFIX} to {ADDRESS_PREFIX}",
        ) from None
    metrics = Metrics()
    if role == "gateway":
        if gateway_dir is None:
            raise ControlError("INVALID_ARGUMENT", "--role gateway needs --gateway-dir DIR")
        parts = _gateway_parts(db_url, gateway_dir, api_upstreams, metrics)
    else:
        if secret is None:
            raise ControlError(
                "INVALID_CONFIG",
                "set BETTER_COMPUTE_SECRET (at least 16 characters); "
                "it encrypts the PKI's private keys",
            )
        if role == "api" and relay_listen is None:
            raise ControlError(
                "INVALID_ARGUMENT", "--role api needs --relay-listen HOST:PORT for the gateways"
            )
        parts = _api_parts(
            role=role,
            home=home,
            db_url=db_url,
            gateway_san=gateway_san,
            gateway_url=gateway_url,
            secret=secret,
            cert_ttl_s=cert_ttl_s,
            attestor_settings=attestor_settings,
            downloads=downloads,
            relay_san=relay_san or gateway_san,
            metrics=metrics,
        )
    parts.limits = limits
    if parts.gateway is not None:
        parts.gateway.ping_interval_s = session_ping_s
    if role == "all" and not gateway_url:
        parts.gateway_url_host = default_gateway_host(gateway_listen, gateway_san)
    if role != "gateway" and not gateway_url and parts.gateway_url_host is None:
        log.warning(
            "no --gateway-url: the well-known document has no gateway section, so bcd join "
            "--server cannot bootstrap a machine; give --gateway-url https://NAME[:PORT], "
            "the address nodes dial"
        )
    listens = {"api": api_listen, "gateway": gateway_listen}
    if relay_listen is not None:
        listens["relay"] = relay_listen
    if metrics_listen is not None:
        _split(metrics_listen)  # a usage error before anything starts
        listens["metrics"] = metrics_listen
        parts.handlers["metrics"] = (_metrics_handler(metrics, parts.readiness), None)
    try:
        trio.run(_run, parts, listens, ready_file, drain_s)
    finally:
        parts.store.close()
    return 0


@dataclass
class _Parts:
    """What one role runs: its store, its listeners' handlers, its background tasks."""

    role: str
    store: Store
    limiter: trio.CapacityLimiter
    handlers: dict[str, tuple[Handler, ssl.SSLContext | None]] = field(default_factory=dict)
    limits: dict[str, Limits] = field(default_factory=lambda: dict(LIMITS))
    gateway: Gateway | None = None
    relay_client: RelayClient | None = None
    listen_url: str | None = None  # PostgreSQL LISTEN for revocations
    readiness: _Readiness | None = None
    metrics: Metrics = field(default_factory=Metrics)
    # --gateway-url's loopback default (default_gateway_host): published once the
    # gateway listener has its port, before the API listens
    publish_gateway: Callable[[str], None] | None = None
    gateway_url_host: str | None = None


def _api_parts(
    *,
    role: str,
    home: Path,
    db_url: str,
    gateway_san: str,
    gateway_url: str | None,
    secret: bytes,
    cert_ttl_s: int,
    attestor_settings: Mapping[str, str] | None,
    downloads: Path | None,
    relay_san: str,
    metrics: Metrics,
) -> _Parts:
    if downloads is not None and not downloads.is_dir():
        raise ControlError("INVALID_CONFIG", f"--downloads {downloads}: not a directory")
    pki_dir = home / "pki"
    try:
        loaded = pki.load_pki(pki_dir, secret)
        chain_pem, gw_key = pki.load_gateway(pki_dir, relay_san if role == "api" else gateway_san,
                                             secret)  # fmt: skip
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    crypto = join_crypto(loaded, cert_ttl_s)
    settings = dict(attestor_settings or {})
    plugins = load_plugins()
    for failure in plugins.failures:
        log.warning("attestor plugin %s did not load: %s", failure.name, failure.error)
    log.debug("attestor plugins loaded: %s", ", ".join(sorted(plugins.names())))
    check_attestor_settings(plugins, settings)
    reach.probe(db_url)  # one line, exit 1, within the connect timeout: not 30 s of retries
    store = open_store(db_url, max_size=12)
    store.migrate()
    check_autovacuum(store)
    store.on_tx = metrics.observe_tx
    metrics.count_pending = functools.partial(_count_pending, store)

    def gateway_doc(url: str) -> dict[str, Any]:
        return {
            "url": url,
            "serverName": gateway_san,
            "servingCaPin": loaded.pins()["serving_ca_spki_pin"],
            # the node's only TLS trust anchor (bcd.servingca), checked against the pin
            "servingCaPem": cert_pem(loaded.serving_ca),
        }

    # the tenant API has threads (and connections) of its own, so a flood of node calls
    # cannot keep an operator from revoking a node, nor the other way round
    limiter, api_limiter = trio.CapacityLimiter(8), trio.CapacityLimiter(4)
    calls = NodeCalls(store, JoinService(store, crypto, plugins, settings, metrics),
                      RenewService(store, crypto, metrics), limiter, metrics)  # fmt: skip
    parts = _Parts(role, store, limiter, metrics=metrics)

    ready = _Readiness(store, limiter)
    parts.readiness = ready
    on_revocation: Callable[[], None] = lambda: None  # noqa: E731
    if role == "all":
        gateway = Gateway(store, calls.handle, limiter, ready=ready, metrics=metrics)
        node_ca_pem = loaded.chain_tail_pem()
        ssl_ctx = pki.server_ssl_context(
            chain_pem, gw_key, client_ca_pem=node_ca_pem, client_time_in_app=True
        )
        parts.handlers["gateway"] = (gateway.handle, ssl_ctx)
        parts.gateway = gateway
        on_revocation = gateway.poke
        if store.dialect == "postgres":
            parts.listen_url = db_url
    else:
        relay_ctx = pki.server_ssl_context(
            chain_pem, gw_key, client_ca_pem=cert_pem(loaded.serving_ca)
        )
        listener = RelayListener(calls.handle, functools.partial(_health, ready))
        parts.handlers["relay"] = (listener.handle, relay_ctx)
    app = App(
        store=store,
        well_known_join=dict(loaded.well_known_join()),
        gateway=gateway_doc(gateway_url) if gateway_url else None,
        limiter=api_limiter,
        on_revocation=on_revocation,
        downloads=downloads.absolute() if downloads is not None else None,
        ready=ready,
        sign_notice=notice_signer(crypto.signing_key),
        attestors=tuple(plugins.names()),
    )
    parts.handlers["api"] = (app.api, None)

    def publish_gateway(url: str) -> None:
        app.gateway = gateway_doc(url)

    parts.publish_gateway = publish_gateway
    return parts


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_gateway_host(gateway_listen: str, gateway_san: str) -> str | None:
    """The host of ``--gateway-url``'s default for ``--role all``, or None for no default.

    Only a one-machine run has one: the gateway listens on a loopback address and its
    certificate names a loopback address or ``localhost`` (the defaults, 127.0.0.1), so
    no other machine can dial it and the listener's own address is the one right URL.
    Anywhere else the URL is the name and port nodes dial, perhaps through a load
    balancer or NAT, which only the operator knows: no guess is published.
    """
    host, _port = _split(gateway_listen)
    if not (_loopback(host) and _loopback(gateway_san)):
        return None
    return f"[{host}]" if ":" in host else host


def _gateway_parts(
    db_url: str, gateway_dir: Path, api_upstreams: Sequence[str], metrics: Metrics
) -> _Parts:
    try:
        bundle = gatewaypki.load_bundle(gateway_dir)
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    for url in api_upstreams:
        if not url.startswith("https://"):
            raise ControlError("INVALID_ARGUMENT", f"--api-upstream {url}: must be https://")
    # each upstream URL checked (scheme, host and port only) before the database is opened
    relay_client = RelayClient(api_upstreams, relay.client_context(bundle), metrics=metrics)
    try:
        store = open_store(db_url, read_only=True, timeout=5.0)
    except ValueError as exc:
        raise ControlError("INVALID_ARGUMENT", str(exc)) from exc
    store.on_tx = metrics.observe_tx
    limiter = trio.CapacityLimiter(8)

    ready = _Readiness(store, limiter, upstream=relay_client)
    _check_schema(store)
    gateway = Gateway(store, relay_client.forward, limiter, ready=ready, metrics=metrics)
    ssl_ctx = pki.server_ssl_context(
        bundle.serving_chain_pem,
        bundle.serving_key,
        client_ca_pem=bundle.node_ca_pem,
        client_time_in_app=True,
    )
    parts = _Parts(
        "gateway", store, limiter, gateway=gateway, relay_client=relay_client, metrics=metrics
    )
    parts.readiness = ready
    parts.handlers["gateway"] = (gateway.handle, ssl_ctx)
    parts.listen_url = db_url
    return parts


def check_autovacuum(store: Store) -> bool:
    """Warn, once at start, when PostgreSQL's autovacuum is off (True when it is).

    Every join and renewal updates rows that stay (its token's use count, its node's
    row): without VACUUM their dead versions pile up, and without ANALYZE the planner
    keeps the plans of an empty table (the revocation poll read every ``node_certs``
    row by a sequential scan), so the database's CPU per call grows with the fleet. A
    database that does not answer is let pass (the caller has just migrated it)."""
    if store.dialect != "postgres":
        return False
    try:
        with store.tx() as tx:
            row = tx.one("SELECT current_setting('autovacuum') AS setting")
    except StoreUnavailable:
        return False
    if row is None or row["setting"] == "on":
        return False
    log.warning(
        "PostgreSQL's autovacuum is off: the rows each join and renewal updates are "
        "never vacuumed nor the tables analyzed, so the database's CPU per call grows "
        "with the fleet; set autovacuum = on (PostgreSQL's default), or run VACUUM "
        "(ANALYZE) on this schema on a schedule (docs/fleet.md)",
        extra={"event": "database.autovacuum_off"},
    )
    return True


def _check_schema(store: Store) -> None:
    """A gateway never migrates: refuse a database older than this code's schema.

    A database that does not answer yet is let pass (the gateway starts unready and
    waits for it); a newer schema is accepted, since migrations only add.
    """
    needed = max(version for version, _dialect, _sql in migrations())
    try:
        with store.tx() as tx:
            row = tx.one("SELECT max(version) AS v FROM schema_migrations")
    except StoreUnavailable:
        log.warning("the database does not answer yet; starting unready")
        return
    except Exception as exc:  # no table, no grant: the role or the migration is missing
        raise ControlError(
            "INVALID_CONFIG",
            "the gateway's database login cannot read schema_migrations: run better-compute "
            "migrate with the API's login, and make this login a member of "
            "better_compute_gateway",
        ) from exc
    with store.tx() as tx:
        writes = tx.one(
            "SELECT has_table_privilege(current_user, 'join_tokens', 'INSERT,UPDATE') "
            "OR has_table_privilege(current_user, 'join_requests', 'INSERT,UPDATE') "
            "OR has_table_privilege(current_user, 'node_certs', 'INSERT,UPDATE') "
            "OR has_table_privilege(current_user, 'nodes', 'INSERT,UPDATE') AS w"
        )
    if writes is not None and writes["w"]:
        raise ControlError(
            "INVALID_CONFIG",
            "the gateway's database login can write admission tables (an owner or a "
            "superuser?): give the gateway a login that is only a member of "
            "better_compute_gateway",
        )
    have = int(row["v"]) if row and row["v"] is not None else 0
    if have < needed:
        raise ControlError(
            "INVALID_CONFIG",
            f"the database schema is at {have}, this gateway needs {needed}: "
            "run better-compute migrate (an API replica migrates at start)",
        )


async def _count_pending(store: Store) -> int:
    """``bc_join_requests_pending``: one count in a worker thread of its own."""

    def count() -> int:
        with store.tx() as tx:
            row = tx.one("SELECT count(*) AS n FROM join_requests WHERE state = 'pending'")
        return int(row["n"]) if row else 0

    with trio.fail_after(2):
        return await trio.to_thread.run_sync(count, abandon_on_cancel=True)


def _metrics_handler(metrics: Metrics, readiness: _Readiness | None) -> Handler:
    """The metrics listener: ``GET /metrics``, and ``/healthz`` and ``/readyz`` as the
    role's own listeners answer them. A load balancer probes here, over plain HTTP, so
    its probe never waits for a TLS handshake slot behind a redial storm."""

    async def handle(req: Request) -> Response:
        if readiness is not None and req.method == "GET" and req.path in ("/healthz", "/readyz"):
            return await _health(readiness, req.path)
        return await metrics.handle(req)

    return handle


async def _health(ready: Callable[[], Awaitable[tuple[bool, str]]], path: str) -> Response:
    if path == "/healthz":
        return health_response(True, "alive")
    ok, reason = await ready()
    return health_response(ok, reason)


async def _run(
    parts: _Parts, listens: Mapping[str, str], ready_file: Path | None, drain_s: float
) -> None:
    life = Lifecycle()
    # SIGTERM is ours before anything listens, so a stop right after start still drains
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        await _serve_until_signal(parts, listens, ready_file, drain_s, life, signals)
    log.info("stopped")


async def _serve_until_signal(
    parts: _Parts,
    listens: Mapping[str, str],
    ready_file: Path | None,
    drain_s: float,
    life: Lifecycle,
    signals: AsyncIterator[int],
) -> None:
    async with trio.open_nursery() as nursery:
        bound: dict[str, int] = {}
        async with trio.open_nursery() as servers:
            for name, (handler, ctx) in parts.handlers.items():
                host, port = _split(listens[name])
                # a TLS listener's handshakes, by outcome (a plain listener has none)
                counted = parts.metrics.handshake_counter(name) if ctx is not None else None
                bound[name] = await servers.start(
                    functools.partial(
                        serve,
                        handler,
                        host,
                        port,
                        ssl_context=ctx,
                        life=life,
                        limits=parts.limits[name],
                        on_limit=parts.metrics.limit_hit,
                        on_handshake=counted,
                    )
                )
                if name == "gateway" and parts.gateway_url_host and parts.publish_gateway:
                    url = f"https://{parts.gateway_url_host}:{bound[name]}"
                    parts.publish_gateway(url)  # before the API listens: never half a document
                    log.info(
                        "the well-known document publishes the gateway as %s (no --gateway-url, "
                        "a loopback default: nodes on other machines need --gateway-url)",
                        url,
                    )
            if parts.role != "gateway":
                nursery.start_soon(retention.pruner, parts.store, parts.limiter)
            if parts.gateway is not None:
                nursery.start_soon(parts.gateway.revocation_poller)
                nursery.start_soon(parts.gateway.pinger)
                nursery.start_soon(parts.gateway.reporter.run)
                if parts.listen_url is not None:
                    nursery.start_soon(revocations.listen, parts.listen_url, parts.gateway.poke)
            ready = _ready_doc(parts.role, listens, bound)
            if ready_file is not None:
                fs.atomic_write(ready_file, json.dumps(ready).encode(), 0o644)
            log.info(
                "serving (role %s): %s",
                parts.role,
                ", ".join(f"{k} on {v}" for k, v in ready.items() if "://" in str(v)),
            )
            notify("READY=1", f"STATUS=serving, role {parts.role}")
            async for _ in signals:
                break
            notify("STOPPING=1")
            log.info("draining: no new connections, sessions end, calls in flight finish")
            life.begin_drain()
            if parts.readiness is not None:
                parts.readiness.draining = True
            if parts.gateway is not None:
                parts.gateway.drain()
            if not await life.wait_idle(drain_s):
                log.warning("drain: calls still in flight after %.0f s; stopping anyway", drain_s)
            servers.cancel_scope.cancel()
        if parts.relay_client is not None:
            await parts.relay_client.aclose()
        nursery.cancel_scope.cancel()


def _ready_doc(role: str, listens: Mapping[str, str], bound: Mapping[str, int]) -> dict[str, Any]:
    doc: dict[str, Any] = {"role": role}
    for name, port in bound.items():
        host, _ = _split(listens[name])
        scheme = "http" if name in ("api", "metrics") else "https"
        doc[name] = f"{scheme}://{host}:{port}"
        doc[f"{name}_port"] = port
    return doc

"""``better-compute``: the reference control plane's command line.

Exit codes: 0 success, 1 a failure or refusal, 2 a usage error, 70 a bug. Errors
print one line, ``better-compute: CODE: message``, never a traceback on the terminal
(``serve`` keeps one in its log when it stops on a bug).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bcd import __version__
from bcd.errors import describe_os_error, os_error_in
from bcd.systemd import FORMATS, LEVELS, prioritized, under_journald
from control.cli_admin import (
    cmd_backup,
    cmd_migrate,
    cmd_pki_init,
    cmd_pki_issue_gateway,
    cmd_pki_pins,
    cmd_pki_rotate_join_key,
    cmd_serve,
    cmd_tenants_create,
)
from control.cli_client import (
    _request_ttl,
    cmd_events_list,
    cmd_nodes_adopt,
    cmd_nodes_delete,
    cmd_nodes_list,
    cmd_nodes_revoke_identity,
    cmd_nodes_show,
    cmd_pools_create,
    cmd_pools_list,
    cmd_pools_set_policy,
    cmd_pools_show,
    cmd_requests_approve,
    cmd_requests_list,
    cmd_requests_reject,
    cmd_sites_create,
    cmd_sites_list,
    cmd_sites_show,
    cmd_tenants_list,
    cmd_tenants_show,
    cmd_tokens_create,
    cmd_tokens_list,
    cmd_tokens_revoke,
)
from control.cli_common import (
    DEFAULT_API,
    DEFAULT_HOME,
    SECRET_FILE_HELP,
    TENANT_HELP,
    _cert_ttl,
    _home,
    _Parser,
    _secret,
    parse_ttl,
    usage_error,
)
from control.errors import ControlError


def cmd_daemon_install_script(args: argparse.Namespace) -> int:
    from bcd.pki import cert_pem
    from control import installscript, pki

    try:
        loaded = pki.load_pki(_home(args) / "pki", _secret(args))
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    jwk = loaded.well_known_join()["encryptionJwk"]
    assert isinstance(jwk, dict)
    try:
        values = installscript.build_values(
            pool=args.pool,
            site=args.site,
            gateway_url=args.gateway_url,
            base_url=args.base_url,
            bcd_version=args.bcd_version,
            sha256=args.sha256,
            pins=loaded.pins(),
            join_jwk=jwk,
            server_name=args.server_name,
            serving_ca_pem=cert_pem(loaded.serving_ca),
        )
        script = installscript.render(values)
    except installscript.InstallScriptError as exc:
        raise ControlError("INVALID_ARGUMENT", str(exc)) from exc
    if args.out:
        try:
            installscript.write_script(Path(args.out), script)
        except OSError as exc:
            raise ControlError("INVALID_ARGUMENT", f"--out {args.out}: {exc.strerror}") from exc
        print(f"install script for pool {values.pool} (site {values.site}) written to {args.out}")
    else:
        sys.stdout.write(script)
    return 0


def _relay_max_per_source(text: str) -> int:
    from control.server import RELAY_MAX_CONNECTIONS, relay_limits

    try:
        value = int(text)
        relay_limits(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a whole number from 1 to {RELAY_MAX_CONNECTIONS:,}"
        ) from None
    return value


def _ipv6_source_prefix(text: str) -> int:
    from control.http import ADDRESS_PREFIX, SITE_PREFIX, Limits

    try:
        value = int(text)
        Limits(source_prefix=value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a whole number from {SITE_PREFIX} to {ADDRESS_PREFIX}"
        ) from None
    return value


# --- the parser ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(prog="better-compute", description="the better-compute reference control plane")
    top.add_argument("--version", action="version", version=f"better-compute {__version__}")
    top.add_argument(
        "--home", help=f"state directory (default $BETTER_COMPUTE_HOME or {DEFAULT_HOME})"
    )
    sub = top.add_subparsers(dest="group", required=True, parser_class=_Parser)

    def verb(
        group: Any, name: str, fn: Any, *, client: bool = False, db: bool = False,
        secret: bool = False, json: bool = True,
    ) -> Any:  # fmt: skip
        p = group.add_parser(name)
        p.set_defaults(fn=fn)
        if json:  # not on a verb whose output cannot be JSON (serve, a script): a usage error
            p.add_argument("--json", action="store_true", help="print JSON")
        if secret:
            p.add_argument("--secret-file", metavar="FILE", help=SECRET_FILE_HELP)
        if client:
            p.add_argument(
                "--api", help=f"control plane URL (default $BETTER_COMPUTE_API or {DEFAULT_API})"
            )
            p.add_argument("--credential-file", help="file holding the API credential (bcak_…)")
        if db:
            p.add_argument("--db", help="database URL: sqlite:///FILE (default) or postgresql://…")
        return p

    def paging(p: Any) -> None:
        p.add_argument(
            "--page-size",
            type=int,
            default=100,
            help="1 to 1000 (sites and pools: 1 to 100) (default 100)",
        )
        p.add_argument("--page-token", help="the nextPageToken of the previous page")

    pki_group = sub.add_parser("pki").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(pki_group, "init", cmd_pki_init, secret=True)
    p.add_argument("--trust-domain", required=True)
    p = verb(pki_group, "issue-gateway", cmd_pki_issue_gateway, secret=True)
    p.add_argument("--san", required=True, help="the gateway's DNS name or IP address")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write a gateway bundle (serving and relay certificates and keys, unencrypted, "
        "0600) for a gateway-role host to DIR instead of into the PKI",
    )
    verb(pki_group, "pins", cmd_pki_pins, secret=True)
    verb(pki_group, "rotate-join-key", cmd_pki_rotate_join_key, secret=True)

    daemon = sub.add_parser("daemon").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(daemon, "install-script", cmd_daemon_install_script, secret=True, json=False)
    p.add_argument("--pool", required=True, help="the pool the machines join (pool_…)")
    p.add_argument("--site", required=True, help="the site written to config.toml (site_…)")
    p.add_argument("--gateway-url", required=True, help="https://host[:port] the nodes dial")
    p.add_argument("--server-name", help="the gateway certificate's name, if not the URL's host")
    p.add_argument(
        "--base-url",
        required=True,
        help="the control plane, https://host[:port] (http:// only on loopback); the "
        "artifact is fetched from BASE/api/compute/downloads/bcd/<version>/linux-<arch>",
    )
    p.add_argument("--bcd-version", required=True, help="the bcd version to install")
    p.add_argument(
        "--sha256", required=True, metavar="amd64=HEX,arm64=HEX", help="each artifact's SHA-256"
    )
    p.add_argument("--out", help="write the script to this file (mode 0755) instead of stdout")

    p = verb(sub, "serve", cmd_serve, db=True, secret=True, json=False)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of serve's flags (key: the flag's name without --); flags override it",
    )
    p.add_argument(
        "--role",
        choices=["all", "api", "gateway"],
        default="all",
        help="all: API and gateway in one process (default); api: the tenant API and "
        "JoinService, with the PKI keys; gateway: the nodes' front door, relaying to --api-upstream",
    )
    p.add_argument("--api-listen", default="127.0.0.1:8080")
    p.add_argument("--gateway-listen", default="127.0.0.1:8443")
    p.add_argument(
        "--relay-listen",
        metavar="HOST:PORT",
        help="role api: where gateways relay node calls (mutual TLS, relay certificates only)",
    )
    p.add_argument(
        "--relay-san",
        help="role api: which issued certificate (pki issue-gateway --san) the relay "
        "listener serves (default: --gateway-san)",
    )
    p.add_argument(
        "--relay-max-per-source",
        type=_relay_max_per_source,
        default=None,
        metavar="N",
        help="role api: connections the relay listener takes from one address (default 512: "
        "eight gateways behind one NAT address; at most 2048, the listener's)",
    )
    p.add_argument(
        "--ipv6-source-prefix",
        type=_ipv6_source_prefix,
        default=None,
        metavar="N",
        help="every listener but the relay (which counts each address) counts an IPv6 "
        "client's connections and handshakes by its /N, 48 to 128 (default 48: a site's "
        "prefix). For a fleet with public IPv6 addresses in one /48: the prefix one machine "
        "holds, 64 for a /64 each; 128, each address a source as with IPv4 (a cloud "
        "subnet's /64 holds many VMs), only for addresses you control or trust, e.g. a "
        "fleet in its own VPC: one holder of a /64 can then fill a listener",
    )
    p.add_argument(
        "--gateway-dir",
        metavar="DIR",
        help="role gateway: the bundle of pki issue-gateway --out DIR (no PKI, no secret)",
    )
    p.add_argument(
        "--api-upstream",
        action="append",
        metavar="URL",
        help="role gateway: an API replica's relay listener, https://HOST:PORT (repeatable; "
        "tried in turn)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long calls in flight may take to finish (default 30)",
    )
    p.add_argument(
        "--session-ping-seconds",
        type=float,
        default=15.0,
        help="seconds between the pings of an idle node session (default 15; shorter for "
        "benchmarks and tests; a node gives up on a session after 50 s without a byte)",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (plain HTTP; default off)",
    )
    p.add_argument(
        "--log-level",
        choices=list(LEVELS),
        default="info",
        help="the least severe log lines written (default info; debug is verbose)",
    )
    p.add_argument(
        "--log-format",
        choices=list(FORMATS),
        default="text",
        help="text (default), or json: one JSON object a line with the event's fields",
    )
    p.add_argument(
        "--gateway-san", default="127.0.0.1", help="which issued gateway certificate to serve"
    )
    p.add_argument(
        "--gateway-url", help="the gateway URL nodes dial, published in the well-known document"
    )
    p.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    p.add_argument(
        "--downloads",
        metavar="DIR",
        help="serve DIR/bcd/<version>/linux-<arch> at /api/compute/downloads/bcd/<version>/"
        "linux-<arch> (unauthenticated; packaging/build_artifact.py --out DIR)",
    )
    p.add_argument(
        "--cert-ttl-seconds",
        type=_cert_ttl,
        default=86_400,
        metavar="10..86400",
        help="node certificate lifetime (certTtlSeconds; default and maximum 86400)",
    )
    p.add_argument(
        "--tpm-ek-ca",
        metavar="FILE",
        help="tpm attestor: PEM bundle of the TPM manufacturer CAs EK certificates chain to",
    )
    p.add_argument(
        "--tpm-ek-allow",
        metavar="FILE",
        help="tpm attestor: EK allow-list, one hex SHA-256 of an EK public area a line",
    )
    p.add_argument("--tpm-pool", metavar="POOL", help="tpm attestor: the pool TPM joins go to")
    p.add_argument(
        "--x509pop-ca",
        metavar="FILE",
        help="x509pop attestor: PEM bundle the re-joining nodes' certificates chain to "
        "(normally pki/node-root-ca.crt); unset, x509pop refuses every join",
    )
    p.add_argument(
        "--discovery-pool",
        metavar="POOL",
        help="discovery attestor: the pool machines a site agent vouched for join",
    )
    p.add_argument(
        "--attestor-setting",
        action="append",
        metavar="ATTESTOR.KEY=VALUE",
        help="a setting for an attestor plugin's server half (repeatable)",
    )
    verb(sub, "migrate", cmd_migrate, db=True)
    p = verb(sub, "backup", cmd_backup, db=True)
    p.add_argument(
        "--out", required=True, help="new 0600 file for an online copy of the SQLite store"
    )

    tenants = sub.add_parser("tenants").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(tenants, "create", cmd_tenants_create, db=True)
    p.add_argument("--name", required=True)
    p.add_argument("--root", action="store_true", help="the root (platform) tenant")
    p.add_argument("--credential-out", required=True, help="new 0600 file for the API credential")
    p = verb(tenants, "list", cmd_tenants_list, client=True)
    paging(p)
    p = verb(tenants, "show", cmd_tenants_show, client=True)
    p.add_argument("tenant_id", nargs="?", help="ten_… (default: the credential's own tenant)")

    sites = sub.add_parser("sites").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(sites, "create", cmd_sites_create, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--name", required=True)
    p = verb(sites, "list", cmd_sites_list, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    paging(p)
    p = verb(sites, "show", cmd_sites_show, client=True)
    p.add_argument("site_id")
    p.add_argument("--tenant", help=TENANT_HELP)

    pools = sub.add_parser("pools").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(pools, "create", cmd_pools_create, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--site", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--agent", default="bcd")
    p.add_argument("--attestors", help="policy.joinAttestors, comma separated")
    p.add_argument("--acceptance-checks", action="store_true")
    p = verb(pools, "list", cmd_pools_list, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--site", help="only this site's pools")
    paging(p)
    p = verb(pools, "show", cmd_pools_show, client=True)
    p.add_argument("pool_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p = verb(pools, "set-policy", cmd_pools_set_policy, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)
    p.add_argument("--attestors", help="policy.joinAttestors, comma separated (none: any)")
    p.add_argument("--acceptance-checks", action="store_true")
    p.add_argument("--kubernetes-platform-operated", action="store_true")

    jt = sub.add_parser("join-tokens").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(jt, "create", cmd_tokens_create, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)
    p.add_argument("--ttl", type=parse_ttl, default=3600, help="1m to 24h (default 1h)")
    p.add_argument("--max-uses", type=int, default=1)
    p.add_argument("--allow-reclaim", action="store_true")
    p.add_argument("--expect-product-uuid")
    p.add_argument("--expect-serial")
    p.add_argument("--expect-mac")
    p.add_argument("--expect-gpu-uuid")
    p.add_argument("--hosted", choices=["kubernetes"])
    p.add_argument("--role", default="node", choices=["node", "site", "ramdisk"])
    p.add_argument("--key", help="idempotency key")
    p.add_argument("--out", help="write the token to this new 0600 file instead of printing it")
    p = verb(jt, "list", cmd_tokens_list, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)
    p.add_argument("--all", action="store_true", help="include revoked, expired and used-up tokens")
    p.add_argument("--page-size", type=int, default=100)
    p.add_argument("--page-token")
    p = verb(jt, "revoke", cmd_tokens_revoke, client=True)
    p.add_argument("token_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)

    jr = sub.add_parser("join-requests").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(jr, "list", cmd_requests_list, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)
    p.add_argument(
        "--state",
        default="pending",
        choices=["pending", "approved", "rejected", "all"],
        help="which requests (default pending)",
    )
    p.add_argument("--page-size", type=int, default=100, help="1 to 1000 (newest first)")
    p.add_argument("--page-token", help="the nextPageToken of the previous page")
    p = verb(jr, "approve", cmd_requests_approve, client=True)
    p.add_argument("request_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)
    p.add_argument(
        "--ttl",
        type=_request_ttl,
        default=900,
        metavar="60..86400",
        help="seconds the approval stays usable (default 900)",
    )
    p.add_argument("--reason")
    p.add_argument(
        "--csr-sha256",
        metavar="HEX",
        help="approve only if the request still names this CSR (its csrSha256 when listed)",
    )
    p = verb(jr, "reject", cmd_requests_reject, client=True)
    p.add_argument("request_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", required=True)
    p.add_argument("--reason")

    ev = sub.add_parser("events").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(ev, "list", cmd_events_list, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--type")
    p.add_argument("--since", help="unix milliseconds")

    nd = sub.add_parser("nodes").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(nd, "list", cmd_nodes_list, client=True)
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--pool", help="only this pool's nodes (pool_…)")
    paging(p)
    p = verb(nd, "adopt", cmd_nodes_adopt, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p = verb(nd, "show", cmd_nodes_show, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p = verb(nd, "revoke-identity", cmd_nodes_revoke_identity, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    p.add_argument("--reason", help="sent to the node with the revocation (default: revoked)")
    p = verb(nd, "delete", cmd_nodes_delete, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", help=TENANT_HELP)
    return top


def _error_line(args: argparse.Namespace, line: str) -> None:
    """The last line on stderr: under journald with its ``<3>`` priority; from a
    ``serve --log-format json`` whose logging is set up, a JSON line of ``control``."""
    if (
        getattr(args, "fn", None) is cmd_serve
        and getattr(args, "log_format", "text") == "json"
        and logging.getLogger().handlers
    ):
        logging.getLogger("control").error("%s", line)
        return
    print(prioritized(line, logging.ERROR) if under_journald(sys.stderr) else line, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    os.umask(0o077)  # the store, logs and anything else we create: owner only
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        from control import serveconfig

        try:
            serveconfig.apply(
                parser, sys.argv[1:] if argv is None else argv, args, Path(args.config)
            )
        except serveconfig.ServeConfigError as exc:
            usage_error(str(exc))
    try:
        code: int = args.fn(args)
    except ControlError as exc:
        _error_line(args, f"better-compute: {exc.code}: {exc.message}")
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, never a traceback (a DB URL may hold a password)
        if os.environ.get("BETTER_COMPUTE_DEBUG") == "1":
            raise
        os_error = os_error_in(exc)
        if os_error is not None:  # the system said no (a port in use, a permission): not a bug
            _error_line(args, f"better-compute: {describe_os_error(os_error)}")
            return 1
        if getattr(args, "fn", None) is cmd_serve:
            # a daemon's log is its operator's: keep the traceback there for the post-mortem
            logging.getLogger("control").error("serve stopped on a bug", exc_info=exc)
        _error_line(
            args,
            f"better-compute: internal error ({type(exc).__name__}); this is a bug. Run the "
            "same command with BETTER_COMPUTE_DEBUG=1 for the traceback",
        )
        return 70
    return code


if __name__ == "__main__":
    sys.exit(main())

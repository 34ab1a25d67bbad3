"""``better-compute``: the reference control plane's command line.

Exit codes: 0 success, 1 a failure or refusal, 2 a usage error, 70 a bug. Errors
print one line, ``better-compute: CODE: message``, never a traceback on the terminal
(``serve`` keeps one in its log when it stops on a bug).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from bcd import fs
from bcd.errors import describe_os_error, os_error_in
from control.errors import ControlError

DEFAULT_HOME = "/var/lib/better-compute"
DEFAULT_API = "http://127.0.0.1:8080"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"better-compute: usage: {message}\n")


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get("BETTER_COMPUTE_HOME") or DEFAULT_HOME)


def _secret() -> bytes:
    secret = os.environ.get("BETTER_COMPUTE_SECRET", "")
    if len(secret) < 16:
        raise ControlError(
            "INVALID_CONFIG",
            "set BETTER_COMPUTE_SECRET (at least 16 characters); it encrypts the PKI's private keys",
        )
    return secret.encode("utf-8")


def _db_url(args: argparse.Namespace) -> str:
    url = args.db or os.environ.get("BETTER_COMPUTE_DB")
    return url or f"sqlite:///{_home(args) / 'store.db'}"


def parse_ttl(text: str) -> int:
    """``90s``, ``15m``, ``1h``, ``24h`` or plain seconds: a whole number of seconds."""
    m = re.fullmatch(r"(\d{1,6})([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError("a duration like 30m, 1h or 24h")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _cert_ttl(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("a whole number of seconds") from None
    if not 10 <= value <= 86_400:
        raise argparse.ArgumentTypeError("from 10 to 86400 seconds")
    return value


def _now() -> datetime:
    return datetime.now(UTC)


# --- pki ------------------------------------------------------------------------------


def cmd_pki_init(args: argparse.Namespace) -> int:
    from control import pki

    secret = _secret()
    directory = _home(args) / "pki"
    try:
        pki.init_pki(directory, args.trust_domain, secret, _now())
        loaded = pki.load_pki(directory, secret)
    except pki.PkiSetupError as exc:
        raise ControlError(
            "ALREADY_EXISTS" if "already" in str(exc) else "INVALID_ARGUMENT", str(exc)
        ) from exc
    print(f"PKI for {args.trust_domain} written to {directory}")
    for name, pin in loaded.pins().items():
        print(f'{name} = "{pin}"')
    return 0


def cmd_pki_issue_gateway(args: argparse.Namespace) -> int:
    from control import pki

    secret = _secret()
    directory = _home(args) / "pki"
    try:
        loaded = pki.load_pki(directory, secret)
        if args.out:
            from control import gatewaypki

            meta = gatewaypki.issue_bundle(loaded, Path(args.out), args.san, _now())
            print(f"gateway bundle for {args.san} written to {meta.parent}")
            return 0
        cert, _key = pki.issue_gateway(loaded, directory, args.san, secret, _now())
    except (pki.PkiSetupError, ValueError) as exc:
        raise ControlError("INVALID_ARGUMENT", str(exc)) from exc
    print(f"gateway certificate for {args.san} written to {cert}")
    return 0


def cmd_pki_pins(args: argparse.Namespace) -> int:
    from control import pki

    directory = _home(args) / "pki"
    try:
        found = pki.public_pins(directory)  # public values: no secret needed
        pins = found if found is not None else pki.load_pki(directory, _secret()).pins()
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    if args.json:
        print(json.dumps(pins, indent=2))
    else:
        for name, pin in pins.items():
            print(f'{name} = "{pin}"')
    return 0


def cmd_pki_rotate_join_key(args: argparse.Namespace) -> int:
    from control import pki

    secret = _secret()
    directory = _home(args) / "pki"
    try:
        retired = pki.rotate_join_encryption_key(directory, secret, _now())
        loaded = pki.load_pki(directory, secret)
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    print(f"a new join encryption key is in {directory}; the old one is kept as {retired.name}")
    print(f'join_encryption_key_pin = "{loaded.pins()["join_encryption_key_pin"]}"')
    print(
        "restart better-compute serve to use it, then generate every install script again "
        "(better-compute daemon install-script): old scripts and join-encryption.jwk files no "
        "longer match; joined nodes are not affected"
    )
    return 0


def cmd_daemon_install_script(args: argparse.Namespace) -> int:
    from control import installscript, pki

    try:
        loaded = pki.load_pki(_home(args) / "pki", _secret())
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


# --- serve and bootstrap ----------------------------------------------------------------


_ROLE_FLAGS = {
    "api": ("relay_listen", "relay_san"),
    "gateway": ("gateway_dir", "api_upstream"),
    "api/all": (
        "downloads", "tpm_ek_ca", "tpm_ek_allow", "tpm_pool", "x509pop_ca", "discovery_pool",
        "attestor_setting", "gateway_url",
    ),
}  # fmt: skip


def _check_role_flags(args: argparse.Namespace) -> None:
    """A flag of another role is a usage error, never silently ignored."""
    for roles, flags in _ROLE_FLAGS.items():
        if args.role in roles.split("/"):
            continue
        for flag in flags:
            if getattr(args, flag, None):
                name = "--" + flag.replace("_", "-")
                print(
                    f"better-compute: usage: {name} is for --role {roles.replace('/', ' or ')}",
                    file=sys.stderr,
                )
                raise SystemExit(2)


def cmd_serve(args: argparse.Namespace) -> int:
    from control import server

    _check_role_flags(args)
    if args.role == "gateway":
        if os.environ.get("BETTER_COMPUTE_SECRET"):
            raise ControlError(
                "INVALID_CONFIG",
                "a gateway holds no PKI key: unset BETTER_COMPUTE_SECRET in its environment",
            )
        if not args.db and not os.environ.get("BETTER_COMPUTE_DB"):
            raise ControlError(
                "INVALID_ARGUMENT", "--role gateway needs --db postgresql://… (its read-only role)"
            )
        if not args.api_upstream:
            raise ControlError("INVALID_ARGUMENT", "--role gateway needs --api-upstream URL")
    return server.main(
        home=_home(args),
        db_url=_db_url(args),
        api_listen=args.api_listen,
        gateway_listen=args.gateway_listen,
        gateway_san=args.gateway_san,
        gateway_url=args.gateway_url,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        secret=None if args.role == "gateway" else _secret(),
        cert_ttl_s=args.cert_ttl_seconds,
        attestor_settings=_attestor_settings(args),
        downloads=Path(args.downloads) if args.downloads else None,
        role=args.role,
        relay_listen=args.relay_listen,
        relay_san=args.relay_san,
        gateway_dir=Path(args.gateway_dir) if args.gateway_dir else None,
        api_upstreams=args.api_upstream or (),
        drain_s=args.drain_seconds,
    )


def _attestor_settings(args: argparse.Namespace) -> dict[str, str]:
    """``--attestor-setting NAME=VALUE`` (repeatable) and the tpm attestor's named flags."""
    settings: dict[str, str] = {}
    for item in args.attestor_setting or []:
        name, sep, value = item.partition("=")
        if not sep or "." not in name or not name.split(".", 1)[1]:
            raise ControlError(
                "INVALID_ARGUMENT", f"--attestor-setting {name!r}: expected ATTESTOR.KEY=VALUE"
            )
        settings[name] = value
    for flag, name in (
        ("tpm_ek_ca", "tpm.ek_ca"),
        ("tpm_ek_allow", "tpm.ek_allow"),
        ("tpm_pool", "tpm.pool"),
        ("discovery_pool", "discovery.pool"),
        ("x509pop_ca", "x509pop.ca"),
    ):
        value = getattr(args, flag, None)
        if value:
            is_file = flag in ("tpm_ek_ca", "tpm_ek_allow", "x509pop_ca")
            settings[name] = str(Path(value).absolute()) if is_file else value
    return settings


def cmd_migrate(args: argparse.Namespace) -> int:
    from control.store import open_store

    store = open_store(_db_url(args))
    try:
        applied = store.migrate()
    finally:
        store.close()
    print(f"applied migrations: {applied or 'none'}")
    return 0


def cmd_tenants_create(args: argparse.Namespace) -> int:
    from control import tenancy
    from control.store import open_store

    out = Path(args.credential_out)
    if out.exists() or out.is_symlink():
        raise ControlError(
            "ALREADY_EXISTS", f"{out} exists; --credential-out never writes over a file"
        )
    _home(args).mkdir(parents=True, exist_ok=True, mode=0o700)
    store = open_store(_db_url(args))
    written = False
    try:
        store.migrate()
        with store.tx() as tx:
            tenant_id, credential = tenancy.create_tenant(tx, args.name, root=args.root)
            try:
                fs.create_new(out, (credential + "\n").encode("ascii"), 0o600)
            except FileExistsError as exc:
                raise ControlError("ALREADY_EXISTS", f"{out} exists") from exc
            written = True
    except BaseException:
        if written:  # the tenant was not created: its credential must not linger
            fs.remove(out)
        raise
    finally:
        store.close()
    _emit(args, {"id": tenant_id, "name": args.name, "root": args.root}, f"tenant {tenant_id}")
    return 0


# --- API client verbs -------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from control.client import ApiClient

    path = args.credential_file or os.environ.get("BETTER_COMPUTE_CREDENTIAL_FILE")
    if not path:
        raise ControlError(
            "UNAUTHENTICATED", "name the API credential file: --credential-file FILE"
        )
    try:
        credential = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ControlError("UNAUTHENTICATED", f"cannot read the credential file {path}") from exc
    api = args.api or os.environ.get("BETTER_COMPUTE_API") or DEFAULT_API
    return ApiClient(api.rstrip("/") + "/api/compute", credential)


def _emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    print(json.dumps(obj, indent=2) if getattr(args, "json", False) else text)


def cmd_sites_create(args: argparse.Namespace) -> int:
    site = _client(args).call("POST", f"/v1/tenants/{args.tenant}/sites", {"name": args.name})
    _emit(args, site, f"site {site['id']}")
    return 0


def cmd_pools_create(args: argparse.Namespace) -> int:
    policy: dict[str, Any] = {}
    if args.attestors:
        policy["joinAttestors"] = [a.strip() for a in args.attestors.split(",") if a.strip()]
    if args.acceptance_checks:
        policy["acceptanceChecks"] = True
    body = {"siteId": args.site, "name": args.name, "agent": args.agent, "policy": policy}
    pool = _client(args).call("POST", f"/v1/tenants/{args.tenant}/pools", body)
    _emit(args, pool, f"pool {pool['id']}")
    return 0


def cmd_pools_set_policy(args: argparse.Namespace) -> int:
    policy: dict[str, Any] = {}
    if args.attestors:
        policy["joinAttestors"] = [a.strip() for a in args.attestors.split(",") if a.strip()]
    if args.acceptance_checks:
        policy["acceptanceChecks"] = True
    if args.kubernetes_platform_operated:
        policy["kubernetes"] = {"platformOperated": True}
    pool = _client(args).call(
        "POST", f"/v1/tenants/{args.tenant}/pools/{args.pool}/policy", {"policy": policy}
    )
    _emit(args, pool, f"pool {pool['id']} policy {json.dumps(pool['policy'], sort_keys=True)}")
    return 0


def _expect(args: argparse.Namespace) -> dict[str, str]:
    pairs = {
        "productUuid": args.expect_product_uuid,
        "serial": args.expect_serial,
        "mac": args.expect_mac,
        "gpuUuid": args.expect_gpu_uuid,
    }
    return {k: v for k, v in pairs.items() if v}


def _token_line(rec: dict[str, Any]) -> str:
    state = "revoked" if rec["revoked"] else f"{rec['usesLeft']}/{rec['maxUses']} uses left"
    return f"{rec['id']}  {rec['role']}  {state}  expires {rec['expiresAt']}"


def cmd_tokens_create(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and (out.exists() or out.is_symlink()):
        raise ControlError("ALREADY_EXISTS", f"{out} exists; --out never writes over a file")
    body: dict[str, Any] = {
        "ttlSeconds": args.ttl,
        "maxUses": args.max_uses,
        "allowReclaim": args.allow_reclaim,
        "role": args.role,
    }
    if expect := _expect(args):
        body["expect"] = expect
    if args.hosted:
        body["hosted"] = args.hosted
    if args.key:
        body["idempotencyKey"] = args.key
    rec = _client(args).call(
        "POST", f"/v1/tenants/{args.tenant}/pools/{args.pool}/join-tokens", body
    )
    token = rec.pop("token", None)
    if out is not None:
        if token is None:
            raise ControlError(
                "INVALID_STATE",
                f"--key {args.key} was used before and its answer carries no token; revoke that "
                f"token and create a new one (better-compute join-tokens revoke {rec['id']} "
                f"--tenant {args.tenant} --pool {args.pool})",
            )
        try:
            fs.create_new(out, (token + "\n").encode("ascii"), 0o600)
        except FileExistsError as exc:
            raise ControlError(
                "ALREADY_EXISTS",
                f"{out} appeared meanwhile; the token {rec['id']} was minted but not written: "
                f"revoke it and create a new one",
            ) from exc
        _emit(args, rec, f"{_token_line(rec)}\ntoken written to {out}")
        return 0
    if args.json:
        print(json.dumps({**rec, "token": token} if token else rec, indent=2))
    else:
        print(_token_line(rec))
        print(
            token if token else "(an earlier answer for this --key; the token is not shown again)"
        )
    return 0


def cmd_tokens_list(args: argparse.Namespace) -> int:
    query = f"?pageSize={args.page_size}" + ("&includeInactive=true" if args.all else "")
    if args.page_token:
        query += f"&pageToken={args.page_token}"
    page = _client(args).call(
        "GET", f"/v1/tenants/{args.tenant}/pools/{args.pool}/join-tokens{query}"
    )
    if args.json:
        print(json.dumps(page, indent=2))
    else:
        for rec in page["items"]:
            print(_token_line(rec))
        if page.get("nextPageToken"):
            print(f"more: --page-token {page['nextPageToken']}")
    return 0


def cmd_tokens_revoke(args: argparse.Namespace) -> int:
    if "." in args.token_id:
        raise ControlError(
            "INVALID_ARGUMENT",
            "join-tokens revoke takes the token id (jt_…), never the token itself",
        )
    rec = _client(args).call(
        "POST", f"/v1/tenants/{args.tenant}/pools/{args.pool}/join-tokens/{args.token_id}/revoke"
    )
    _emit(args, rec, f"revoked {rec['id']}")
    return 0


def _request_ttl(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("a whole number of seconds") from None
    if not 60 <= value <= 86_400:
        raise argparse.ArgumentTypeError("from 60 to 86400 seconds")
    return value


def _request_lines(rec: dict[str, Any]) -> str:
    """A join request as text: what the attestor saw, then the decision."""
    lines = [f"{rec['id']}  {rec['state']}  {rec['attestor']}  created {rec['createdAt']}"]
    for label, key in (
        ("hardwareKey", "hardwareKey"),
        ("mac", "mac"),
        ("ip", "ip"),
        ("workflowId", "workflowId"),
        ("vouchedBy", "vouchedBy"),
        ("bootLeaseEpoch", "bootLeaseEpoch"),
        ("csrSha256", "csrSha256"),
        ("decidedAt", "decidedAt"),
        ("decidedBy", "decidedBy"),
        ("reason", "reason"),
        ("expiresAt", "expiresAt"),
        ("consumedAt", "consumedAt"),
    ):
        if rec.get(key) is not None:
            lines.append(f"  {label}: {rec[key]}")
    lines.append(f"  claims: {json.dumps(rec['claims'], sort_keys=True)}")
    return "\n".join(lines)


def _request_path(args: argparse.Namespace) -> str:
    if not re.fullmatch(r"jreq_[0-9a-z]{26}", args.request_id):
        raise ControlError(
            "INVALID_ARGUMENT", f"{args.request_id!r} is not a join request id (jreq_…)"
        )
    return f"/v1/tenants/{args.tenant}/pools/{args.pool}/join-requests/{args.request_id}"


def cmd_requests_list(args: argparse.Namespace) -> int:
    query = f"state={args.state}&pageSize={args.page_size}"
    if args.page_token:
        query += f"&pageToken={args.page_token}"
    page = _client(args).call(
        "GET", f"/v1/tenants/{args.tenant}/pools/{args.pool}/join-requests?{query}"
    )
    if args.json:
        print(json.dumps(page, indent=2))
    else:
        for rec in page["items"]:
            print(_request_lines(rec))
        if page.get("nextPageToken"):
            print(f"more (older) requests: --page-token {page['nextPageToken']}")
    return 0


def cmd_requests_approve(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"ttlSeconds": args.ttl}
    if args.reason:
        body["reason"] = args.reason
    if args.csr_sha256:
        body["csrSha256"] = args.csr_sha256
    rec = _client(args).call("POST", _request_path(args) + "/approve", body)
    _emit(args, rec, f"approved {rec['id']} until {rec['expiresAt']}")
    return 0


def cmd_requests_reject(args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    rec = _client(args).call("POST", _request_path(args) + "/reject", body)
    _emit(args, rec, f"rejected {rec['id']}")
    return 0


def cmd_events_list(args: argparse.Namespace) -> int:
    query = []
    if args.type:
        query.append(f"type={args.type}")
    if args.since:
        query.append(f"since={args.since}")
    page = _client(args).call("GET", f"/v1/tenants/{args.tenant}/events?" + "&".join(query))
    if args.json:
        print(json.dumps(page, indent=2))
    else:
        for ev in page["items"]:
            print(f"{ev['id']}  {ev['type']}  {json.dumps(ev['payload'], sort_keys=True)}")
    return 0


def cmd_nodes_show(args: argparse.Namespace) -> int:
    node = _client(args).call("GET", f"/v1/tenants/{args.tenant}/nodes/{args.node_id}")
    if args.json:
        print(json.dumps(node, indent=2))
    else:
        print(f"{node['id']}  {node['role']}  {node['state']}  gen {node['identityGeneration']}")
        for c in node["certificates"]:
            state = f"revoked ({c['revokeReason']})" if c["revoked"] else "live"
            print(
                f"  cert {c['serial']}  gen {c['identityGeneration']}  until {c['notAfter']}  {state}"
            )
            kinds = c.get("allowedKinds") or []
            if kinds:
                print(f"    allowed kinds: {', '.join(kinds)}")
    return 0


def _node_path(args: argparse.Namespace) -> str:
    if not re.fullmatch(r"node_[0-9a-z]{26}", args.node_id):
        raise ControlError("INVALID_ARGUMENT", f"{args.node_id!r} is not a node id (node_…)")
    return f"/v1/tenants/{args.tenant}/nodes/{args.node_id}"


def cmd_nodes_revoke_identity(args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    rec = _client(args).call("POST", _node_path(args) + "/revoke-identity", body)
    revoked = rec["revoked"]
    text = (
        f"revoked {len(revoked)} certificate(s) of {rec['nodeId']}: {', '.join(revoked)}"
        if revoked
        else f"{rec['nodeId']} has no live certificate; nothing revoked"
    )
    _emit(args, rec, text)
    return 0


def cmd_nodes_delete(args: argparse.Namespace) -> int:
    rec = _client(args).call("DELETE", _node_path(args))
    _emit(args, rec, f"deleted {rec['nodeId']} ({len(rec['revoked'])} certificate(s) revoked)")
    return 0


def cmd_nodes_list(args: argparse.Namespace) -> int:
    page = _client(args).call("GET", f"/v1/tenants/{args.tenant}/nodes")
    if args.json:
        print(json.dumps(page, indent=2))
    else:
        for n in page["items"]:
            print(
                f"{n['id']}  {n['role']}  {n['state']}  pool {n['poolId']}  gen {n['identityGeneration']}"
            )
    return 0


# --- the parser ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(prog="better-compute", description="the better-compute reference control plane")
    top.add_argument(
        "--home", help=f"state directory (default $BETTER_COMPUTE_HOME or {DEFAULT_HOME})"
    )
    sub = top.add_subparsers(dest="group", required=True, parser_class=_Parser)

    def verb(group: Any, name: str, fn: Any, *, client: bool = False, db: bool = False) -> Any:
        p = group.add_parser(name)
        p.set_defaults(fn=fn)
        p.add_argument("--json", action="store_true", help="print JSON")
        if client:
            p.add_argument(
                "--api", help=f"control plane URL (default $BETTER_COMPUTE_API or {DEFAULT_API})"
            )
            p.add_argument("--credential-file", help="file holding the API credential (bcak_…)")
        if db:
            p.add_argument("--db", help="database URL: sqlite:///FILE (default) or postgresql://…")
        return p

    pki_group = sub.add_parser("pki").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(pki_group, "init", cmd_pki_init)
    p.add_argument("--trust-domain", required=True)
    p = verb(pki_group, "issue-gateway", cmd_pki_issue_gateway)
    p.add_argument("--san", required=True, help="the gateway's DNS name or IP address")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write a gateway bundle (serving and relay certificates and keys, unencrypted, "
        "0600) for a gateway-role host to DIR instead of into the PKI",
    )
    verb(pki_group, "pins", cmd_pki_pins)
    verb(pki_group, "rotate-join-key", cmd_pki_rotate_join_key)

    daemon = sub.add_parser("daemon").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(daemon, "install-script", cmd_daemon_install_script)
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

    p = verb(sub, "serve", cmd_serve, db=True)
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

    tenants = sub.add_parser("tenants").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(tenants, "create", cmd_tenants_create, db=True)
    p.add_argument("--name", required=True)
    p.add_argument("--root", action="store_true", help="the root (platform) tenant")
    p.add_argument("--credential-out", required=True, help="new 0600 file for the API credential")

    sites = sub.add_parser("sites").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(sites, "create", cmd_sites_create, client=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--name", required=True)

    pools = sub.add_parser("pools").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(pools, "create", cmd_pools_create, client=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--site", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--agent", default="bcd")
    p.add_argument("--attestors", help="policy.joinAttestors, comma separated")
    p.add_argument("--acceptance-checks", action="store_true")
    p = verb(pools, "set-policy", cmd_pools_set_policy, client=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--attestors", help="policy.joinAttestors, comma separated (none: any)")
    p.add_argument("--acceptance-checks", action="store_true")
    p.add_argument("--kubernetes-platform-operated", action="store_true")

    jt = sub.add_parser("join-tokens").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(jt, "create", cmd_tokens_create, client=True)
    p.add_argument("--tenant", required=True)
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
    p.add_argument("--tenant", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--all", action="store_true", help="include revoked, expired and used-up tokens")
    p.add_argument("--page-size", type=int, default=100)
    p.add_argument("--page-token")
    p = verb(jt, "revoke", cmd_tokens_revoke, client=True)
    p.add_argument("token_id")
    p.add_argument("--tenant", required=True)
    p.add_argument("--pool", required=True)

    jr = sub.add_parser("join-requests").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = verb(jr, "list", cmd_requests_list, client=True)
    p.add_argument("--tenant", required=True)
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
    p.add_argument("--tenant", required=True)
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
    p.add_argument("--tenant", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--reason")

    ev = sub.add_parser("events").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(ev, "list", cmd_events_list, client=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--type")
    p.add_argument("--since", help="unix milliseconds")

    nd = sub.add_parser("nodes").add_subparsers(dest="verb", required=True, parser_class=_Parser)
    p = verb(nd, "list", cmd_nodes_list, client=True)
    p.add_argument("--tenant", required=True)
    p = verb(nd, "show", cmd_nodes_show, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", required=True)
    p = verb(nd, "revoke-identity", cmd_nodes_revoke_identity, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", required=True)
    p.add_argument("--reason", help="sent to the node with the revocation (default: revoked)")
    p = verb(nd, "delete", cmd_nodes_delete, client=True)
    p.add_argument("node_id")
    p.add_argument("--tenant", required=True)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    os.umask(0o077)  # the store, logs and anything else we create: owner only
    args = build_parser().parse_args(argv)
    try:
        code: int = args.fn(args)
    except ControlError as exc:
        print(f"better-compute: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, never a traceback (a DB URL may hold a password)
        if os.environ.get("BETTER_COMPUTE_DEBUG") == "1":
            raise
        os_error = os_error_in(exc)
        if os_error is not None:  # the system said no (a port in use, a permission): not a bug
            print(f"better-compute: {describe_os_error(os_error)}", file=sys.stderr)
            return 1
        if getattr(args, "fn", None) is cmd_serve:
            # a daemon's log is its operator's: keep the traceback there for the post-mortem
            logging.getLogger("control").error("serve stopped on a bug", exc_info=exc)
        print(
            f"better-compute: internal error ({type(exc).__name__}); this is a bug. Run the "
            "same command with BETTER_COMPUTE_DEBUG=1 for the traceback",
            file=sys.stderr,
        )
        return 70
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``better-compute`` commands that call the API: sites, pools, join tokens, join
requests, events and nodes."""

from __future__ import annotations

import argparse
import json
import re
import urllib.parse
from datetime import datetime
from pathlib import Path
from typing import Any

from bcd import fs
from control.cli_common import _client, _emit, _now, usage_error
from control.errors import ControlError


def cmd_sites_create(args: argparse.Namespace) -> int:
    site = _client(args).call("POST", f"/v1/tenants/{args.tenant}/sites", {"name": args.name})
    _emit(args, site, f"site {site['id']}")
    return 0


def _paged(args: argparse.Namespace, path: str, line: Any, **query: str | None) -> int:
    """``GET path`` (``{tenant}`` the --tenant), one page (--page-size, --page-token), and
    print it: JSON, or a line a record and the way to the next page."""
    client = _client(args)
    params = {"pageSize": str(args.page_size), "pageToken": args.page_token, **query}
    qs = urllib.parse.urlencode({k: v for k, v in params.items() if v})
    page = client.call("GET", f"{path.format(tenant=getattr(args, 'tenant', ''))}?{qs}")
    return _print_page(args, page, line)


def _print_page(args: argparse.Namespace, page: Any, line: Any, more: str = "more") -> int:
    """A page as JSON, or a line a record and the way to the next page."""
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    for rec in page["items"]:
        print(line(rec))
    if page.get("nextPageToken"):
        print(f"{more}: --page-token {page['nextPageToken']}")
    return 0


def _tenant_line(rec: dict[str, Any]) -> str:
    return (
        f"{rec['id']}  {rec['name']}{'  (root)' if rec['root'] else ''}  created {rec['createdAt']}"
    )


def _site_line(rec: dict[str, Any]) -> str:
    return f"{rec['id']}  {rec['name']}  created {rec['createdAt']}"


def _pool_line(rec: dict[str, Any]) -> str:
    attestors = rec["policy"].get("joinAttestors")
    admits = ", ".join(attestors) if isinstance(attestors, list) else "any attestor"
    checks = "  acceptance checks" if rec["policy"].get("acceptanceChecks") else ""
    return (
        f"{rec['id']}  {rec['name']}  site {rec['siteId']}  agent {rec['agent']}  "
        f"admits {admits}{checks}"
    )


def _shown(args: argparse.Namespace, path: str, line: Any) -> int:
    client = _client(args)
    rec = client.call("GET", path.format(tenant=getattr(args, "tenant", "")))
    _emit(args, rec, line(rec))
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    return _paged(args, "/v1/tenants", _tenant_line)


def cmd_tenants_show(args: argparse.Namespace) -> int:
    if args.tenant_id is None:
        return _shown(args, "/v1/tenants/self", _tenant_line)
    _id_arg(args.tenant_id, "ten", "tenant")
    return _shown(args, f"/v1/tenants/{args.tenant_id}", _tenant_line)


def cmd_sites_list(args: argparse.Namespace) -> int:
    return _paged(args, "/v1/tenants/{tenant}/sites", _site_line)


def cmd_sites_show(args: argparse.Namespace) -> int:
    _id_arg(args.site_id, "site", "site")
    return _shown(args, f"/v1/tenants/{{tenant}}/sites/{args.site_id}", _site_line)


def cmd_pools_list(args: argparse.Namespace) -> int:
    return _paged(args, "/v1/tenants/{tenant}/pools", _pool_line, siteId=args.site)


def cmd_pools_show(args: argparse.Namespace) -> int:
    _id_arg(args.pool_id, "pool", "pool")
    return _shown(args, f"/v1/tenants/{{tenant}}/pools/{args.pool_id}", _pool_line)


def _id_arg(value: str, prefix: str, what: str) -> None:
    if not re.fullmatch(rf"{prefix}_[0-9a-z]{{26}}", value):
        raise ControlError("INVALID_ARGUMENT", f"{value[:64]!r} is not a {what} id ({prefix}_…)")


def _attestor_list(text: str | None) -> list[str] | None:
    """--attestors as a list, each name one a loaded plugin serves (else a usage error)."""
    if not text:
        return None
    names = [a.strip() for a in text.split(",") if a.strip()]
    from bcd.plugins import load_plugins
    from control.tenancy import unknown_attestors

    problem = unknown_attestors(names, load_plugins().names())
    if problem is not None:
        usage_error(f"--attestors: {problem}")
    return names


def cmd_pools_create(args: argparse.Namespace) -> int:
    policy: dict[str, Any] = {}
    if (attestors := _attestor_list(args.attestors)) is not None:
        policy["joinAttestors"] = attestors
    if args.acceptance_checks:
        policy["acceptanceChecks"] = True
    body = {"siteId": args.site, "name": args.name, "agent": args.agent, "policy": policy}
    pool = _client(args).call("POST", f"/v1/tenants/{args.tenant}/pools", body)
    _emit(args, pool, f"pool {pool['id']}")
    return 0


def cmd_pools_set_policy(args: argparse.Namespace) -> int:
    policy: dict[str, Any] = {}
    if (attestors := _attestor_list(args.attestors)) is not None:
        policy["joinAttestors"] = attestors
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


def token_state(rec: dict[str, Any], now: datetime) -> str:
    """``revoked``, ``used-up``, ``expired`` or ``active``, in that order (a revoked
    token that also expired is shown revoked: that is what an operator did)."""
    if rec["revoked"]:
        return "revoked"
    if rec["usesLeft"] <= 0:
        return "used-up"
    if datetime.fromisoformat(rec["expiresAt"]) <= now:
        return "expired"
    return "active"


def _token_line(rec: dict[str, Any]) -> str:
    state = token_state(rec, _now())
    return (
        f"{rec['id']}  {rec['role']}  {state}  {rec['usesLeft']}/{rec['maxUses']} uses left  "
        f"expires {rec['expiresAt']}"
    )


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
    now = _now()
    for rec in page["items"]:
        rec["state"] = token_state(rec, now)
    return _print_page(args, page, _token_line)


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
    return _print_page(args, page, _request_lines, "more (older) requests")


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


def _fact(value: Any) -> str:
    """A node's own text (its hostname, its daemon version) as a table cell: JSON-quoted
    (ASCII) unless it is printable ASCII without spaces, so a machine cannot send
    escape sequences to the operator's terminal or forge a row."""
    if not value:
        return "-"
    text = str(value)
    if all("!" <= c <= "~" for c in text):
        return text
    return json.dumps(text, ensure_ascii=True)


def cmd_nodes_show(args: argparse.Namespace) -> int:
    node = _client(args).call("GET", f"/v1/tenants/{args.tenant}/nodes/{args.node_id}")
    if args.json:
        print(json.dumps(node, indent=2))
    else:
        print(f"{node['id']}  {node['role']}  {node['state']}  gen {node['identityGeneration']}")
        print(f"  hostname:          {_fact(node.get('hostname'))}")
        print(f"  daemon version:    {_fact(node.get('daemonVersion'))}")
        print(f"  last seen:         {node.get('lastSeenAt') or 'never'}")
        print(f"  certificate until: {_fact(node.get('certificateNotAfter'))}")
        print(f"  pool:              {node['poolId']}")
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


NODE_COLUMNS = ("ID", "STATE", "HOSTNAME", "VERSION", "LAST SEEN", "CERT UNTIL", "GEN")


def _node_cells(n: dict[str, Any]) -> tuple[str, ...]:
    return (
        n["id"],
        n["state"],
        _fact(n.get("hostname")),
        _fact(n.get("daemonVersion")),
        n.get("lastSeenAt") or "never",
        _fact(n.get("certificateNotAfter")),
        str(n["identityGeneration"]),
    )


def cmd_nodes_list(args: argparse.Namespace) -> int:
    params = {"pageSize": str(args.page_size), "pageToken": args.page_token, "poolId": args.pool}
    qs = urllib.parse.urlencode({k: v for k, v in params.items() if v})
    page = _client(args).call("GET", f"/v1/tenants/{args.tenant}/nodes?{qs}")
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    rows = [NODE_COLUMNS, *(_node_cells(n) for n in page["items"])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(NODE_COLUMNS))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if page.get("nextPageToken"):
        print(f"more: --page-token {page['nextPageToken']}")
    return 0


def cmd_nodes_adopt(args: argparse.Namespace) -> int:
    rec = _client(args).call("POST", _node_path(args) + "/adopt", {})
    text = f"adopted {rec['nodeId']}" if rec["changed"] else f"{rec['nodeId']} was adopted already"
    _emit(args, rec, text)
    return 0

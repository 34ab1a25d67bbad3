"""The control client: a process of its own, so the fuzzer's load never delays it.

``python fuzz/control_client.py CONFIG.json`` reads a line from stdin per check and
writes one JSON line back: it mints a one-use join token through the tenant API,
builds a JoinRequest as bcd.join does (a fresh key and CSR, the token sealed to the
JoinService key; not timed), joins through the gateway over a pinned TLS connection
(bench.common.join_once), checks that the answer is a signed ``joined`` response,
and GETs the well-known document. Each of the three calls is timed on its own.
CONFIG names one or more targets (the one-process serve, a fleet).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import trio  # noqa: E402

from bcd import wire  # noqa: E402
from bench.common import join_once  # noqa: E402
from fuzz.world import join_body  # noqa: E402

CALL_TIMEOUT_S = 20.0


async def api_call(
    api: str, method: str, path: str, credential: str | None, body: dict[str, Any] | None
) -> tuple[int, bytes]:
    headers = {"authorization": f"Bearer {credential}"} if credential else {}
    data = json.dumps(body).encode() if body is not None else None
    async with httpx.AsyncClient(trust_env=False, timeout=CALL_TIMEOUT_S) as client:
        resp = await client.request(method, api + path, content=data, headers=headers)
    return resp.status_code, resp.content


async def timed(fn: Any, *args: Any) -> tuple[float, Any, str | None]:
    start = time.perf_counter()
    try:
        with trio.fail_after(CALL_TIMEOUT_S):
            result = await fn(*args)
        return time.perf_counter() - start, result, None
    except Exception as exc:
        return time.perf_counter() - start, None, f"{type(exc).__name__}: {exc}"[:300]


async def check(target: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"target": target["label"], "errors": []}
    tokens = f"/api/compute/v1/tenants/{target['tenant']}/pools/{target['pool']}/join-tokens"
    out["mint_s"], got, err = await timed(
        api_call, target["api"], "POST", tokens, target["credential"], {"ttlSeconds": 600}
    )
    token = None
    if err is not None or got is None or got[0] != 200:
        out["errors"].append(f"mint: {err or got[0]} {got[1][:200]!r}" if got else f"mint: {err}")
    else:
        token = json.loads(got[1])["token"]
    if token is not None:
        key = wire.public_key_of_jwk(target["encryption_jwk"])
        body, _key, _csr = join_body(token, key)
        out["join_s"], outcome, err = await timed(
            join_once, target["gateway_port"], target["serving_pin"], wire.dumps(body)
        )
        if err is not None:
            out["errors"].append(f"join: {err}")
        elif outcome.status != 200:
            out["errors"].append(f"join: {outcome.status} {outcome.error} {outcome.body[:200]!r}")
        else:
            try:
                answer = wire.verify_response(outcome.body.decode("ascii"), target["signing_pin"])
                if answer.get("kind") != "joined":
                    out["errors"].append(f"join: answer of kind {answer.get('kind')!r}")
            except Exception as exc:
                out["errors"].append(f"join: the answer does not verify: {exc}")
    well_known = "/api/compute/.well-known/better-compute"
    out["wk_s"], got, err = await timed(api_call, target["api"], "GET", well_known, None, None)
    if err is not None or got is None or got[0] != 200:
        out["errors"].append(f"well-known: {err or got[0]}" if got else f"well-known: {err}")
    elif "join" not in json.loads(got[1]):
        out["errors"].append("well-known: no join section")
    return out


async def main(config_path: str) -> None:
    targets = json.loads(Path(config_path).read_bytes())["targets"]  # noqa: ASYNC240 - once, at start
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    buf = b""
    while True:
        while b"\n" not in buf:
            data = await stdin.receive_some(4096)
            if not data:
                return
            buf += data
        _line, _, buf = buf.partition(b"\n")
        results = [await check(t) for t in targets]
        sys.stdout.write(json.dumps(results) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])

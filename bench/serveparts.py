"""Where a one-process ``serve`` spends its CPU per call, part by part.

Run from the repository root::

    .venv/bin/python bench/serveparts.py [--calls N] [--store sqlite|postgres|both]
                                         [--concurrency C]

It prints figures and judges nothing; it is not part of the test suite.

A real ``better-compute serve`` is started as ``bench/join.py`` starts it, and N
calls of each kind are made over a fresh TLS connection each (a bare trio
``SSLStream`` client, one request, ``connection: close``), C at a time. Each kind
adds one layer to the one before, so the differences are the layers' costs in the
serve process (utime + stime from ``/proc``, all threads, over N):

- ``tls``: connect, TLS handshake, close (accept, trio's SSLStream, OpenSSL);
- ``healthz``: and one ``GET /healthz`` (h11, the gateway's handler, the answer);
- ``join-bad``: ``POST /v1/join`` with ``{}`` (the node-call dispatch, the worker
  thread hop, JSON, the error answer);
- ``join``: a real join (JoinService, its transaction, the leaf, the answer);
  PostgreSQL's backends' CPU is printed apart.

With ``--renewals``, N nodes are joined and then:

- ``mtls``: connect, a TLS handshake with the node's client certificate, close;
- ``renew-bad``: ``POST /v1/renew`` with ``{}`` (the live-certificate check, the
  rate check, the hand-off to RenewService, the error answer);
- ``renew``: a real renewal.

Each line also splits the serve process's CPU between its trio thread (TLS, HTTP,
the event loop) and its worker threads (JoinService, RenewService, the store), user
and system time apart (``/proc/<pid>/task``). ``(+x)`` is the difference to the line
before (for ``mtls``, to nothing: it starts the mutual-TLS series).
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bcd import pki, wire  # noqa: E402
from bench.common import (  # noqa: E402
    CLK_TCK,
    SERVER_NAME,
    build_bodies,
    pg_backends_cpu_s,
    proc_cpu_s,
    store_url,
)
from bench.renew import Member, join_members, prepare_steps  # noqa: E402
from control import pki as cpki  # noqa: E402
from tests.e2e import SECRET, ControlPlane, make_pki  # noqa: E402


def client_context(serving_ca_pem: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=serving_ca_pem)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def one_call(port: int, ctx: ssl.SSLContext, request: bytes | None) -> bytes:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, ctx, server_hostname=SERVER_NAME, https_compatible=True)
    try:
        await tls.do_handshake()
        if request is None:
            return b""
        await tls.send_all(request)
        answer = bytearray()
        while data := await tls.receive_some(65536):
            answer += data
        return bytes(answer)
    finally:
        await tls.aclose()


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {SERVER_NAME}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii") + body


Call = tuple[ssl.SSLContext | None, bytes | None]
"""A call: its client context (None: the anonymous one), its request (None: TLS only)."""


async def drive(port: int, ctx: ssl.SSLContext, requests: list[Call], c: int) -> list[bytes]:
    out: list[bytes] = [b""] * len(requests)
    it = iter(range(len(requests)))

    async def worker() -> None:
        for i in it:
            own, request = requests[i]
            out[i] = await one_call(port, own or ctx, request)

    async with trio.open_nursery() as nursery:
        for _ in range(c):
            nursery.start_soon(worker)
    return out


def cpu_split(pid: int) -> tuple[float, float, float, float]:
    """(main thread user, main thread sys, process user, process sys) in seconds."""

    def fields(path: str) -> list[str]:
        with open(path, encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()

    main, whole = fields(f"/proc/{pid}/task/{pid}/stat"), fields(f"/proc/{pid}/stat")
    return tuple(int(x) / CLK_TCK for x in (main[11], main[12], whole[11], whole[12]))  # type: ignore[return-value]


SPLIT: dict[str, tuple[float, ...]] = {}


def measure(
    cp: ControlPlane, ctx: ssl.SSLContext, requests: list[Call], c: int, app: str | None
) -> tuple[float, float | None, list[bytes]]:
    pg0 = pg_backends_cpu_s(app) if app else None
    before = proc_cpu_s(cp.proc.pid)
    split0 = cpu_split(cp.proc.pid)
    answers = trio.run(drive, cp.gateway_port, ctx, requests, c)
    spent = proc_cpu_s(cp.proc.pid) - before
    split1 = cpu_split(cp.proc.pid)
    mu, ms_, pu, ps = ((b - a) * 1000 / len(requests) for a, b in zip(split0, split1, strict=True))
    SPLIT["last"] = (mu, ms_, pu - mu, ps - ms_)
    pg = None
    if pg0 is not None:
        pg1 = pg_backends_cpu_s(app) if app else None
        pg = sum(v - pg0.get(pid, 0.0) for pid, v in (pg1 or {}).items())
    return (
        spent * 1000 / len(requests),
        (pg * 1000 / len(requests)) if pg is not None else None,
        answers,
    )


def member_context(serving_ca_pem: str, member: Member) -> ssl.SSLContext:
    ctx = client_context(serving_ca_pem)
    with tempfile.NamedTemporaryFile("w") as chain, tempfile.NamedTemporaryFile("wb") as key:
        chain.write(member.chain)
        chain.flush()
        key.write(member.key_pem)
        key.flush()
        ctx.load_cert_chain(chain.name, key.name)
    return ctx


def run(kind: str, n: int, c: int, tmp: Path, template: Path, renewals: bool) -> None:
    home = tmp / f"cp-{kind}"
    home.mkdir()
    app = f"bcdparts_{secrets.token_hex(4)}"
    loaded = cpki.load_pki(template / "pki", SECRET.encode())
    ctx_ca = pki.cert_pem(loaded.serving_ca)
    ctx = client_context(ctx_ca)
    with store_url(kind, tmp, app) as url:
        cp = ControlPlane.start(home, template, url)
        try:
            jwk = cp.well_known()["join"]["encryptionJwk"]
            key = wire.public_key_of_jwk(jwk)
            _site, pool = cp.site_and_pool()
            warm = cp.token(pool, maxUses=20)["token"]
            token = cp.token(pool, maxUses=n)["token"]
            warm_bodies = [post("/v1/join", p.body) for p in build_bodies(20, warm, key, seed=1)]
            bodies = [post("/v1/join", p.body) for p in build_bodies(n, token, key, seed=2)]
            health = f"GET /healthz HTTP/1.1\r\nhost: {SERVER_NAME}\r\nconnection: close\r\n\r\n"
            kinds: list[tuple[str, Callable[[], list[Call]]]] = [
                ("tls", lambda: [(None, None)] * n),
                ("healthz", lambda: [(None, health.encode())] * n),
                ("join-bad", lambda: [(None, post("/v1/join", b"{}"))] * n),
                ("join", lambda: [(None, b) for b in bodies]),
            ]
            if renewals:
                members = join_members(cp, cp.pins(), pool, n, seed=3)
                prepare_steps(members, 1)
                mtls = [member_context(ctx_ca, m) for m in members]
                renew_bodies = [
                    post(
                        "/v1/renew",
                        wire.dumps(
                            dataclasses.replace(m.steps[0].request, chain=m.chain).to_json()
                        ),
                    )
                    for m in members
                ]
                kinds += [
                    ("mtls", lambda: [(x, None) for x in mtls]),
                    ("renew-bad", lambda: [(x, post("/v1/renew", b"{}")) for x in mtls]),
                    ("renew", lambda: list(zip(mtls, renew_bodies, strict=True))),
                ]
            measure(cp, ctx, [(None, b) for b in warm_bodies], c, None)  # warm-up
            print(f"\n[{kind}] {n} calls each, {c} at a time, a fresh TLS connection per call")
            prev = 0.0
            for name, make in kinds:
                if name == "mtls":
                    prev = 0.0  # the mutual-TLS series starts again from nothing
                ms, pg, answers = measure(cp, ctx, make(), c, app if kind == "postgres" else None)
                heads = {a.split(b"\r\n", 1)[0].decode() for a in answers if a}
                extra = f", pg {pg:.3f} ms" if pg is not None else ""
                mu, msy, wu, wsy = SPLIT["last"]
                print(
                    f"  {name:<9} serve {ms:7.3f} ms/call (+{ms - prev:6.3f}){extra}  "
                    f"[trio thread user {mu:.3f} sys {msy:.3f}; workers user {wu:.3f} "
                    f"sys {wsy:.3f}]  {sorted(heads)}"
                )
                prev = ms
        finally:
            cp.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--store", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--renewals", action="store_true", help="and mutual TLS, renewals")
    args = parser.parse_args(argv)
    kinds = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    with tempfile.TemporaryDirectory(prefix="bcd-parts-") as name:
        tmp = Path(name)
        template = tmp / "pki-template"
        template.mkdir()
        make_pki(template)
        for kind in kinds:
            start = time.perf_counter()
            run(kind, args.calls, args.concurrency, tmp, template, args.renewals)
            print(f"  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

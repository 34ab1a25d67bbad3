"""The relay's own TLS client (control.relay's backend over bcd.tlsstream), against a
real listener of control.http on loopback: the call is relayed over a kept-alive
connection, and an upstream whose certificate does not verify never receives it."""

from __future__ import annotations

import functools
import os
import ssl
from pathlib import Path

import trio

from control import http
from control.metrics import Metrics
from control.relay import RelayClient
from tests.adversarial.test_review_fixes import _replica
from tests.test_http import _pem, material, server_context


async def _upstream(
    nursery: trio.Nursery, tmp_path: Path, seen: list[bytes], outcomes: list[str]
) -> str:
    async def handler(req: http.Request) -> http.Response:
        seen.append(req.body)
        return http.Response(200, b"signed:" + req.body)

    port: int = await nursery.start(
        functools.partial(
            http.serve,
            handler,
            "127.0.0.1",
            0,
            ssl_context=server_context(tmp_path),
            on_handshake=outcomes.append,
        )
    )
    return f"https://127.0.0.1:{port}"


def _request(body: bytes) -> http.Request:
    return http.Request("POST", "/v1/renew", {}, {}, body, None, "192.0.2.1:1")


async def test_relayed_calls_go_over_one_kept_alive_tls_connection(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    seen: list[bytes] = []
    outcomes: list[str] = []
    url = await _upstream(nursery, tmp_path, seen, outcomes)
    client = RelayClient([url], ssl.create_default_context(cadata=_pem(material().ca)))
    answers = [await client.forward(_request(b"x" * size)) for size in (10, 60_000, 3)]
    assert [(a.status, a.body) for a in answers] == [
        (200, b"signed:" + b"x" * size) for size in (10, 60_000, 3)
    ]
    assert seen == [b"x" * 10, b"x" * 60_000, b"x" * 3]
    assert outcomes == ["completed"]  # one handshake for the three calls
    await client.aclose()


async def test_an_upstream_whose_certificate_does_not_verify_is_never_sent_the_call(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The relay's context trusts another CA: the handshake fails before a byte of the
    call is sent, so the call moves to the next upstream (an httpcore connect error)."""
    seen: list[bytes] = []
    outcomes: list[str] = []
    unverified = await _upstream(nursery, tmp_path, seen, outcomes)
    calls: list[str] = []
    good = await _replica(nursery, "good", calls, answer=True)
    metrics = Metrics()
    client = RelayClient([unverified, good], ssl.create_default_context(), metrics=metrics)
    answer = await client.forward(_request(b"{}"))
    assert (answer.status, answer.body, calls, seen) == (200, b"signed", ["good"], [])
    assert metrics.registry.get_sample_value("bc_relay_not_sent_total") == 1
    await client.aclose()


async def test_a_connection_above_select_s_descriptor_range_is_still_kept_alive(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A gateway holds thousands of sessions, so its relay connections' descriptors
    are above 1,024, where select() cannot look: the idle check must still see a
    live connection as live and reuse it (one handshake for the calls)."""
    seen: list[bytes] = []
    outcomes: list[str] = []
    url = await _upstream(nursery, tmp_path, seen, outcomes)
    filler = [os.dup(0) for _ in range(1100)]
    try:
        client = RelayClient([url], ssl.create_default_context(cadata=_pem(material().ca)))
        for body in (b"one", b"two", b"three"):
            assert (await client.forward(_request(body))).body == b"signed:" + body
        assert outcomes == ["completed"]
        await client.aclose()
    finally:
        for fd in filler:
            os.close(fd)

"""A hostile gateway against real `bcd join` and `bcd node` processes.

The gateway holds a real serving certificate (so every byte after the pin check is
the attacker's) and sends endless bodies, endless heads, bad ``retry-pushback-ms``
values, malformed session lines, or stalls at each stage. Whatever it does, the
child's peak RSS stays under 200 MiB, it never exits 70 (a bug) nor prints a
traceback, and it ends with the documented exit code and one line: ``bcd join``
retries what is retryable and exits 1 on the refusal that follows; ``bcd node``
keeps going (the session redials, the renewal retries) until SIGTERM (exit 0) or a
revocation (exit 1).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio

from bcd import pki, wire
from control.pki import Pki, issue_node_leaf
from tests.adversarial import hostile
from tests.adversarial.hostile import (
    REFUSED,
    Child,
    HostileGateway,
    Responder,
    Script,
    assert_clean,
    one_line_error,
    tls,
)
from tests.world.agent import joined_state

pytestmark = pytest.mark.e2e

JOIN_REFUSED = "bcd: the control plane refused the join (ACCESS_DENIED: Join refused)"
ATTEMPT_1 = re.compile(r"join attempt 1 failed \((.*)\); retrying in ([0-9.]+) s")
NODE_REVOKED = "agent: this node's certificate was revoked"
HEAD_OVER = "127.0.0.1 sent an HTTP head or chunk header over 102400 bytes"
BODY_OVER = "the response from 127.0.0.1 is over 1048576 bytes"


async def _with_gateway(
    memory_pki: Pki, scripts: Sequence[Script], nursery: trio.Nursery
) -> HostileGateway:
    gw = HostileGateway(hostile.gateway_context(memory_pki), scripts)
    await nursery.start(gw.run)
    return gw


# --- bcd join --------------------------------------------------------------------


async def _run(
    root: Path,
    memory_pki: Pki,
    scripts: Sequence[Script],
    spawn: Callable[[Path, int], Child],
    *,
    until: Sequence[str] = (),
    timeout: float = 60,  # noqa: ASYNC109
) -> tuple[Child, str, HostileGateway, bool]:
    """Run a child against a hostile gateway playing ``scripts``.

    Without ``until``, wait for the child to exit; with it, wait until every string
    of ``until`` is in its output, then SIGTERM it. Returns the child, its output,
    the gateway, and whether the child was still running at that point.
    """
    async with trio.open_nursery() as nursery:
        gw = await _with_gateway(memory_pki, scripts, nursery)
        child = spawn(root, gw.port)
        try:
            if until:
                await child.wait_for_log(*until, timeout=timeout)
            else:
                await child.wait(timeout)
            running = child.returncode is None
        finally:
            await child.stop()
            nursery.cancel_scope.cancel()
    return child, child.log(), gw, running


def _spawn_join(memory_pki: Pki) -> Callable[[Path, int], Child]:
    def spawn(root: Path, port: int) -> Child:
        return hostile.spawn_join(root, hostile.write_config(root, memory_pki, port))

    return spawn


async def _join(
    root: Path, memory_pki: Pki, first: Script
) -> tuple[Child, str, re.Match[str] | None]:
    """``bcd join`` against a gateway that plays ``first``, then refuses the join."""
    child, text, _, _ = await _run(root, memory_pki, [first, tls(REFUSED)], _spawn_join(memory_pki))
    return child, text, ATTEMPT_1.search(text)


@pytest.mark.parametrize(
    ("responder", "reason"),
    [
        (hostile.endless_chunked(200), BODY_OVER),
        (hostile.endless_chunked(503), BODY_OVER),
        (hostile.endless_content_length(200), BODY_OVER),
        (hostile.huge_head(), HEAD_OVER),
        (hostile.huge_chunk_header(), HEAD_OVER),
    ],
    ids=["endless-chunked", "endless-chunked-error", "endless-length", "endless-head",
         "endless-chunk-size"],
)  # fmt: skip
async def test_bcd_join_reads_a_bounded_answer_then_retries(
    tmp_path: Path, memory_pki: Pki, responder: Responder, reason: str
) -> None:
    child, text, attempt = await _join(tmp_path, memory_pki, tls(responder))

    assert_clean(child, text)
    assert attempt is not None, text
    assert attempt.group(1) == reason
    assert child.returncode == 1
    assert one_line_error(text) == JOIN_REFUSED


@pytest.mark.parametrize(
    ("value", "waited"),
    [
        (b"2500", 2.5),  # a sane value is waited out exactly
        (b"100000000000000", None),  # 15 digits: not believed
        (b"1" * 4000, None),
        (b"\xb2", None),  # latin-1 SUPERSCRIPT TWO: str.isdigit() says yes, int() no
        ("٣".encode(), None),  # an Arabic-Indic digit (UTF-8)
        (b"-5", None),
        (b"1.5", None),
        (b"1, 2", None),
        (b"", None),
    ],
    ids=["2500", "15-digits", "4000-digits", "latin1-digit", "arabic-digit", "negative",
         "fraction", "two-values", "empty"],
)  # fmt: skip
async def test_bcd_join_believes_only_a_plain_pushback(
    tmp_path: Path, memory_pki: Pki, value: bytes, waited: float | None
) -> None:
    child, text, attempt = await _join(tmp_path, memory_pki, tls(hostile.pushback(value)))

    assert_clean(child, text)
    assert attempt is not None, text
    assert attempt.group(1) == "UNAVAILABLE: later"
    wait = float(attempt.group(2))
    if waited is None:  # absent: the first backoff, 1 s with 50-100 % jitter
        assert 0.5 <= wait <= 1.0, text
    else:
        assert wait == waited
    assert child.returncode == 1
    assert one_line_error(text) == JOIN_REFUSED


async def test_bcd_join_caps_a_long_pushback_at_five_minutes(
    tmp_path: Path, memory_pki: Pki
) -> None:
    child, text, _, running = await _run(
        tmp_path,
        memory_pki,
        [tls(hostile.pushback(b"999999999"))],
        _spawn_join(memory_pki),
        until=["retrying in"],
        timeout=30,
    )

    assert running, text
    attempt = ATTEMPT_1.search(text)
    assert attempt is not None, text
    assert attempt.group(2) == "300.0"
    assert_clean(child, text)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"this is not a JWS", "the response is not a compact JWS"),
        (
            pki.b64url(b"[" * 50000).encode() + b".e30.AAAA",
            "the response signature does not verify",
        ),
        (b"\xff" * 1000 + b"..", "the response signature does not verify"),
    ],
    ids=["not-jws", "nested-header", "binary"],
)
async def test_bcd_join_refuses_a_malformed_answer_in_one_line(
    tmp_path: Path, memory_pki: Pki, body: bytes, message: str
) -> None:
    child, text, gw, _ = await _run(
        tmp_path, memory_pki, [tls(hostile.answer(200, body))], _spawn_join(memory_pki)
    )

    assert_clean(child, text)
    assert child.returncode == 1
    assert one_line_error(text) == f"bcd: the join answer does not verify: {message}"
    assert gw.connections == 1  # not retried


async def test_bcd_join_shows_a_gateways_error_message_on_one_line(
    tmp_path: Path, memory_pki: Pki
) -> None:
    message = "bad\nbcd: joined as node_forged\x1b[2J" + "m" * 3000
    refusal = hostile.error("INVALID_ARGUMENT", message)
    child, text, _, _ = await _run(tmp_path, memory_pki, [tls(refusal)], _spawn_join(memory_pki))

    assert_clean(child, text)
    assert child.returncode == 1
    assert text.splitlines() == [
        "bcd: the join failed: INVALID_ARGUMENT: bad bcd: joined as node_forged [2J"
        + "m" * (512 - 34)
    ]


async def test_bcd_join_gives_up_on_a_stall_at_every_stage_and_retries(
    tmp_path: Path, memory_pki: Pki
) -> None:
    stages: dict[str, tuple[Script, str]] = {
        "accept": (hostile.stall_after_accept(), "TLS handshake with the gateway at {} timed out"),
        "handshake": (
            hostile.stall_mid_handshake(),
            "TLS handshake with the gateway at {} timed out",
        ),
        "head": (tls(hostile.stall_after_head()), "127.0.0.1 did not answer within 30 s"),
        "body": (tls(hostile.stall_mid_body()), "127.0.0.1 did not answer within 30 s"),
    }
    outcomes: dict[str, tuple[Child, str, re.Match[str] | None]] = {}
    ports: dict[str, int] = {}

    async def one(name: str, script: Script) -> None:
        child, text, gw, _ = await _run(
            tmp_path / name,
            memory_pki,
            [script, tls(REFUSED)],
            _spawn_join(memory_pki),
            timeout=90,
        )
        ports[name] = gw.port
        outcomes[name] = (child, text, ATTEMPT_1.search(text))

    async with trio.open_nursery() as nursery:  # the four at once: about 32 s in all
        for name, (script, _) in stages.items():
            nursery.start_soon(one, name, script)

    for name, (_, reason) in stages.items():
        child, text, attempt = outcomes[name]
        assert_clean(child, text)
        assert attempt is not None, (name, text)
        assert attempt.group(1) == reason.format(f"127.0.0.1:{ports[name]}"), name
        assert child.returncode == 1, name
        assert one_line_error(text) == JOIN_REFUSED, name


async def test_bcd_join_accepts_an_answer_signed_with_an_x5c_header(
    tmp_path: Path, memory_pki: Pki
) -> None:
    """PROTOCOL.md: the signer may send its certificate as ``x5c`` instead of ``jwk``."""

    async def joined(stream: hostile.Tls, req: hostile.Request) -> None:
        body = json.loads(req.body)
        csr_der = wire.b64_field(body, "csr")
        key = pki.csr_public_key(pki.parse_csr(csr_der))
        spiffe = pki.SpiffeId("td.example", "site_" + "a" * 26, "node_" + "e" * 26)
        leaf = issue_node_leaf(memory_pki, key, spiffe, "node", (), datetime.now(UTC), 3600)
        answer = {
            "kind": "joined",
            "node_id": spiffe.node_id,
            "site_id": spiffe.site_id,
            "role": "node",
            "trust_domain": "td.example",
            "chain": pki.cert_pem(leaf) + memory_pki.chain_tail_pem(),
            "bundle": memory_pki.bundle_pem(),
            "trust_version": 1,
            "csr_sha256": pki.sha256_hex(csr_der),
            "server_time": int(time.time() * 1000),
            "identity_generation": 1,
        }
        signed = wire.sign_response(
            answer,
            memory_pki.join_signing_key,
            x5c=[memory_pki.join_signing_cert, memory_pki.serving_ca],
            include_jwk=False,
        )
        await hostile.answer(200, signed.encode())(stream, req)

    child, text, _, _ = await _run(tmp_path, memory_pki, [tls(joined)], _spawn_join(memory_pki))

    assert_clean(child, text)
    assert child.returncode == 0, text
    identity = json.loads((tmp_path / "data" / "identity.json").read_text())
    assert identity["node_id"] == "node_" + "e" * 26


# --- bcd node ----------------------------------------------------------------------


def _node(root: Path, memory_pki: Pki, port: int, *, renewal_due: bool) -> Child:
    """A joined node (its renewal due at once, or in 36 minutes) running `bcd node`."""
    config = hostile.write_config(root, memory_pki, port)
    now = time.time() - (0.65 * 3600 if renewal_due else 0)
    joined_state(root / "data", memory_pki, now)
    return Child.spawn(["node", "--config", str(config)], root)


def _spawn_node(memory_pki: Pki, *, renewal_due: bool) -> Callable[[Path, int], Child]:
    def spawn(root: Path, port: int) -> Child:
        return _node(root, memory_pki, port, renewal_due=renewal_due)

    return spawn


async def _run_node(
    root: Path,
    memory_pki: Pki,
    routes: dict[str, Responder],
    needles: Sequence[str] = (),
    *,
    renewal_due: bool = False,
    timeout: float = 40,  # noqa: ASYNC109
) -> tuple[Child, str, bool]:
    """Run `bcd node` until every needle is logged (then SIGTERM it), or until it exits.

    Returns the child, its log, and whether it was still running at that point.
    """
    spawn = _spawn_node(memory_pki, renewal_due=renewal_due)
    child, text, _, running = await _run(
        root, memory_pki, [tls(routes)], spawn, until=needles, timeout=timeout
    )
    return child, text, running


QUIET = hostile.stall_after_head(200)
"""A route that answers a head, then nothing: the other task stays out of the way."""


@pytest.mark.parametrize(
    ("session", "expected"),
    [
        (
            hostile.endless_chunked(503),
            "session lost (the gateway refused the session (HTTP 503))",
        ),
        (
            hostile.endless_chunked(200, b"y" * 4096),  # one line that never ends
            "session lost (a line from 127.0.0.1 is over 65536 bytes)",
        ),
        (hostile.huge_head(), f"session lost ({HEAD_OVER})"),
        (
            hostile.pushback(b"999999999"),
            "session lost (the gateway refused the session (HTTP 503, UNAVAILABLE)); "
            "reconnecting in 300.0 s",
        ),
    ],
    ids=["endless-error-body", "endless-line", "endless-head", "long-pushback"],
)
async def test_bcd_node_session_survives_a_hostile_answer(
    tmp_path: Path, memory_pki: Pki, session: Responder, expected: str
) -> None:
    routes = {"/v1/session": session, "/v1/renew": QUIET}
    child, text, running = await _run_node(
        tmp_path, memory_pki, routes, [expected], renewal_due=False
    )

    assert_clean(child, text)
    assert running, text
    assert expected in text
    assert child.returncode == 0  # SIGTERM


@pytest.mark.parametrize("value", [b"\xb2", b"1" * 4000, b"-5", b"100000000000000"])
async def test_bcd_node_session_treats_a_bad_pushback_as_absent(
    tmp_path: Path, memory_pki: Pki, value: bytes
) -> None:
    routes = {"/v1/session": hostile.pushback(value), "/v1/renew": QUIET}
    needle = "session lost (the gateway refused the session (HTTP 503, UNAVAILABLE)); reconnecting"
    child, text, running = await _run_node(
        tmp_path, memory_pki, routes, [needle], renewal_due=False
    )

    assert_clean(child, text)
    assert running, text
    m = re.search(re.escape(needle) + r" in ([0-9.]+) s", text)
    assert m is not None, text
    assert 0.5 <= float(m.group(1)) <= 1.0  # the first backoff
    assert child.returncode == 0


async def test_bcd_node_an_endless_unauthenticated_answer_without_a_notice_does_not_stop_it(
    tmp_path: Path, memory_pki: Pki
) -> None:
    routes = {"/v1/session": hostile.endless_chunked(401), "/v1/renew": QUIET}
    child, text, running = await _run_node(
        tmp_path, memory_pki, routes, ["sent no valid signed revocation notice"]
    )

    assert_clean(child, text)
    assert running  # a gateway's word alone does not stop the node
    assert child.returncode == 0  # stopped by the test's SIGTERM
    assert NODE_REVOKED not in text


async def test_bcd_node_skips_malformed_session_lines(tmp_path: Path, memory_pki: Pki) -> None:
    lines = [
        b"not json\n",
        b"[" * 60000 + b"\n",  # nested past the JSON parser's recursion limit
        b"\xff\xfe\xfd\n",
        b"[1, 2, 3]\n",
        b'{"type": ' + b'"x' * 20000 + b'"}\n',
        b'{"type": "welcome", "session_id": "s-\\u0007\\nforged: x-' + b"z" * 5000 + b'"}\n',
        b'{"type": "ping"}\n',
        b'{"type": "revocation", "reason": {"not": ["a", "string"]}, "serial": 12}\n',
    ]
    routes = {"/v1/session": hostile.stream_lines(200, lines), "/v1/renew": QUIET}
    child, text, running = await _run_node(
        tmp_path, memory_pki, routes, ["a revocation without a valid signed notice"]
    )

    assert_clean(child, text)
    assert text.count("the gateway sent a line that is not a JSON object") == 1
    # at most 200 characters, escaped: no control character, no forged line
    assert "session open (s-\\x07\\nforged: x-" + "z" * 186 + ")\n" in text
    assert "\x07" not in text
    assert "\nforged" not in text
    assert running  # an unsigned revocation is a broken session, not a revocation
    assert NODE_REVOKED not in text


async def test_bcd_node_stops_on_a_signed_revocation_notice_only(
    tmp_path: Path, memory_pki: Pki
) -> None:
    forged = {
        "/v1/session": hostile.revocation_stream(
            memory_pki, tmp_path / "forged" / "data", signing_key=pki.generate_key()
        ),
        "/v1/renew": QUIET,
    }
    child, text, running = await _run_node(
        tmp_path / "forged", memory_pki, forged, ["a revocation without a valid signed notice"]
    )
    assert_clean(child, text)
    assert running
    assert "not signed by the pinned join-signing key" in text

    signed = {
        "/v1/session": hostile.revocation_stream(memory_pki, tmp_path / "signed" / "data"),
        "/v1/renew": QUIET,
    }
    child, text, _running = await _run_node(tmp_path / "signed", memory_pki, signed)
    assert_clean(child, text)
    assert child.returncode == 1
    assert one_line_error(text) == NODE_REVOKED
    assert "certificate revoked (reason: key compromised" in text


# the message, then the text format's structured fields (attempt=… expiresIn=…)
RENEWAL_FAILED = re.compile(
    r"renewal failed \(attempt 1, expiresIn [^)]*\): (.*?)(?: attempt=\d+ expiresIn=\S+ "
    r"expiresInSeconds=-?\d+)?$",
    re.M,
)


@pytest.mark.parametrize(
    ("renew", "reason", "wait"),
    [
        (hostile.endless_chunked(200), BODY_OVER, "30.0"),
        (hostile.endless_content_length(503), BODY_OVER, "30.0"),
        (hostile.huge_head(), HEAD_OVER, "30.0"),
        (hostile.pushback(b"\xb2"), "UNAVAILABLE: later", "30.0"),
        (hostile.pushback(b"1" * 4000), "UNAVAILABLE: later", "30.0"),
        (hostile.pushback(b"-5"), "UNAVAILABLE: later", "30.0"),
        (hostile.pushback(b"999999999"), "UNAVAILABLE: later", "300.0"),
        (hostile.pushback(b"2500"), "UNAVAILABLE: later", "2.5"),
    ],
    ids=["endless-chunked", "endless-length", "endless-head", "latin1-digit", "4000-digits",
         "negative", "long", "2500"],
)  # fmt: skip
async def test_bcd_node_renewal_survives_a_hostile_answer(
    tmp_path: Path, memory_pki: Pki, renew: Responder, reason: str, wait: str
) -> None:
    routes = {"/v1/session": QUIET, "/v1/renew": renew}
    child, text, running = await _run_node(
        tmp_path, memory_pki, routes, ["renewal: next attempt in"], renewal_due=True
    )

    assert_clean(child, text)
    assert running, text
    failed = RENEWAL_FAILED.search(text)
    assert failed is not None, text
    assert failed.group(1) == reason
    assert f"renewal: next attempt in {wait} s" in text
    assert child.returncode == 0


async def test_bcd_node_gives_up_on_a_stall_at_every_stage(tmp_path: Path, memory_pki: Pki) -> None:
    handshake = "TLS handshake with the gateway at 127.0.0.1:{port} timed out"
    slow = "127.0.0.1 did not answer within 30 s"
    cases: dict[str, tuple[Sequence[Script], str, str]] = {
        "accept": ([hostile.stall_after_accept()], handshake, handshake),
        "handshake": ([hostile.stall_mid_handshake()], handshake, handshake),
        # the session's error answer stops mid-body, the renewal's after its head
        "mid-body": (
            [tls({"/v1/session": hostile.stall_mid_body(503, chunked=True),
                  "/v1/renew": hostile.stall_after_head()})],
            "the gateway refused the session (HTTP 503)",
            slow,
        ),
        # the session's stream stops after its head, the renewal's answer mid-body
        "after-head": (
            [tls({"/v1/session": hostile.stall_after_head(200),
                  "/v1/renew": hostile.stall_mid_body()})],
            "127.0.0.1 did not answer within 50 s",
            slow,
        ),
    }  # fmt: skip
    outcomes: dict[str, tuple[Child, str, bool, int]] = {}

    async def one(name: str, scripts: Sequence[Script]) -> None:
        async with trio.open_nursery() as nursery:
            gw = await _with_gateway(memory_pki, scripts, nursery)
            child = _node(tmp_path / name, memory_pki, gw.port, renewal_due=True)
            _, session, renew = cases[name]
            needles = [
                f"session lost ({session.format(port=gw.port)})",
                f"): {renew.format(port=gw.port)}",
            ]
            try:
                await child.wait_for_log(*needles, timeout=75)
                running = child.returncode is None
            finally:
                await child.stop()
                nursery.cancel_scope.cancel()
            outcomes[name] = (child, child.log(), running, gw.port)

    async with trio.open_nursery() as nursery:  # all at once: about 52 s in all
        for name, (scripts, _, _) in cases.items():
            nursery.start_soon(one, name, scripts)

    for name, (_, session, renew) in cases.items():
        child, text, running, port = outcomes[name]
        assert_clean(child, text)
        assert running, (name, text)
        assert f"session lost ({session.format(port=port)})" in text, (name, text)
        failed = RENEWAL_FAILED.search(text)
        assert failed is not None, (name, text)
        assert failed.group(1) == renew.format(port=port), name
        assert child.returncode == 0, name

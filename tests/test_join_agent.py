"""agent.Join's pure parts: the answer's checks in the seed's order, retries and pushback."""

from __future__ import annotations

import base64
import itertools
import json
import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from bcd import pki, wire
from bcd.attestor_api import NodeEvidence, NodeJoinContext, hookimpl
from bcd.config import Config, parse_config
from bcd.errors import JoinError, PeerVerificationError, RetryableError, TransportError
from bcd.join import MAX_ATTEMPTS, join, send_with_retries, verify_joined
from bcd.plugins import load_plugins
from control.pki import Pki, issue_node_leaf

SITE = "site_" + "a" * 26
NODE = "node_" + "b" * 26


def _signed(memory_pki: Pki, key: pki.ec.EllipticCurvePrivateKey, csr: bytes, **over: Any) -> str:
    spiffe = pki.SpiffeId("td.example", SITE, NODE)
    role = over.pop("cert_role", "node")
    leaf_key = over.pop("leaf_key", key.public_key())
    leaf = issue_node_leaf(memory_pki, leaf_key, spiffe, role, (), datetime.now(UTC), 3600)
    body = {
        "kind": "joined",
        "node_id": NODE,
        "site_id": SITE,
        "role": role,
        "trust_domain": "td.example",
        "chain": pki.cert_pem(leaf) + memory_pki.chain_tail_pem(),
        "bundle": memory_pki.bundle_pem(),
        "trust_version": 1,
        "csr_sha256": pki.sha256_hex(csr),
        "server_time": 0,
        **over,
    }
    signer = over.pop("signer", None) or memory_pki.join_signing_key
    body.pop("signer", None)
    return wire.sign_response(body, signer)


def _verify(
    memory_pki: Pki, signed: str, key: Any, csr: bytes, role: str = "node"
) -> wire.SignedBody:
    return verify_joined(
        signed,
        signing_pin=memory_pki.pins()["join_signing_key_pin"],
        csr_der=csr,
        key=key.public_key(),
        role=role,
    )


def test_a_good_answer_verifies(memory_pki: Pki) -> None:
    key = pki.generate_key()
    csr = pki.make_csr(key)
    body = _verify(memory_pki, _signed(memory_pki, key, csr), key, csr)
    assert isinstance(body, wire.Issued)
    assert body.node_id == NODE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"signer": pki.generate_key()}, "pinned join-signing key"),
        ({"csr_sha256": "0" * 64}, "csr_sha256 differs"),
        ({"leaf_key": pki.generate_key().public_key()}, "does not certify this node's key"),
        ({"node_id": "node_" + "c" * 26}, "SPIFFE ID"),
        ({"cert_role": "site", "role": "site"}, "role site"),
    ],
)
def test_the_answer_is_checked_in_the_seeds_order(
    memory_pki: Pki, change: dict[str, Any], message: str
) -> None:
    key = pki.generate_key()
    csr = pki.make_csr(key)
    with pytest.raises(JoinError, match=message):
        _verify(memory_pki, _signed(memory_pki, key, csr, **change), key, csr)


async def test_the_servers_pushback_is_waited_out_exactly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[float] = []

    async def send(body: bytes) -> str:
        calls.append(trio.current_time())
        if len(calls) < 3:
            raise RetryableError("RESOURCE_EXHAUSTED: busy", pushback_s=2.75)
        return "ok"

    start = trio.current_time()
    assert await send_with_retries(send, lambda: b"{}") == "ok"
    assert [round(c - start, 6) for c in calls] == [0, 2.75, 5.5]


async def test_backoff_grows_and_gives_up_after_twenty_attempts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[float] = []

    async def send(body: bytes) -> str:
        calls.append(trio.current_time())
        raise TransportError("cannot reach the gateway at 127.0.0.1:1: Connection refused")

    with pytest.raises(JoinError, match="after 20 attempts"):
        await send_with_retries(send, lambda: b"{}", rng=random.Random(1))
    assert len(calls) == MAX_ATTEMPTS
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert all(0.5 <= g <= 30 for g in gaps)
    assert gaps[-1] > gaps[0]


async def test_an_unverified_gateway_is_never_retried() -> None:
    calls = 0

    async def send(body: bytes) -> str:
        nonlocal calls
        calls += 1
        raise PeerVerificationError(
            "the gateway's certificate does not chain to the pinned serving CA"
        )

    with pytest.raises(PeerVerificationError):
        await send_with_retries(send, lambda: b"{}")
    assert calls == 1


async def test_a_refusal_is_not_retried() -> None:
    calls = 0

    async def send(body: bytes) -> str:
        nonlocal calls
        calls += 1
        raise JoinError("the control plane refused the join (ACCESS_DENIED: Join refused)")

    with pytest.raises(JoinError, match="Join refused"):
        await send_with_retries(send, lambda: b"{}")
    assert calls == 1


# --- challenge rounds ------------------------------------------------------------------


class _Answering:
    """A node half for the attestor ``x-challenged`` that answers every challenge."""

    def __init__(self) -> None:
        self.challenges: list[dict[str, Any]] = []

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["x-challenged"]

    @hookimpl
    def bcd_node_evidence(self, attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
        return NodeEvidence(None, {"e": 1}) if attestor == "x-challenged" else None

    @hookimpl
    def bcd_node_answer(
        self, attestor: str, challenge: dict[str, Any], ctx: NodeJoinContext
    ) -> dict[str, Any] | None:
        if attestor != "x-challenged":
            return None
        self.challenges.append(challenge)
        return {"echo": challenge["n"]}


def _config(memory_pki: Pki) -> Config:
    pins = memory_pki.pins()
    return parse_config(
        'gateway_url = "https://127.0.0.1:1"\n'
        f'site = "{SITE}"\n' + "".join(f'{k} = "{v}"\n' for k, v in pins.items()),
        Path("/nonexistent/config.toml"),
    )


def _challenge(memory_pki: Pki, rnd: int, not_after: int, **over: Any) -> str:
    body = {
        "kind": "challenge",
        "attestor": "x-challenged",
        "round": rnd,
        "challenge": {"n": rnd},
        "not_after": not_after,
        **over,
    }
    return wire.sign_response(body, memory_pki.join_signing_key)


def test_challenges_are_answered_with_the_same_csr(memory_pki: Pki) -> None:
    plugin = _Answering()
    plugins = load_plugins([plugin])
    key = pki.generate_key()
    far = int(time.time() * 1000) + 60_000
    sent: list[dict[str, Any]] = []

    async def send(body: bytes) -> str:
        sent.append(json.loads(body))
        if len(sent) < 3:
            return _challenge(memory_pki, len(sent), far)
        return _signed(memory_pki, key, base64.b64decode(sent[-1]["csr"]))

    async def main() -> None:
        await join(
            _config(memory_pki),
            plugins,
            attestor="x-challenged",
            role="node",
            credential=None,
            encryption_key=None,
            claims=wire.Claims(),
            key=key,
            send=send,
        )

    trio.run(main)
    assert [(r["round"], r["answer"]) for r in sent] == [
        (0, None),
        (1, {"echo": 1}),
        (2, {"echo": 2}),
    ]
    assert len({r["csr"] for r in sent}) == 1
    assert plugin.challenges == [{"n": 1}, {"n": 2}]


@pytest.mark.parametrize(
    ("replies", "message"),
    [
        ([(1, -1)], "expired before it could be answered"),
        ([(1, 0), (1, 0)], "malformed challenge"),  # a round that does not go up
        ([(4, 0)], "malformed challenge"),
        ([(1, 0), (2, 0), (3, 0), (3, 0)], "malformed challenge"),
    ],
)
def test_challenge_limits(memory_pki: Pki, replies: list[tuple[int, int]], message: str) -> None:
    plugins = load_plugins([_Answering()])
    now = int(time.time() * 1000)
    answers = iter(replies)

    async def send(body: bytes) -> str:
        rnd, offset = next(answers)
        return _challenge(memory_pki, rnd, now + (offset or 60_000) if offset >= 0 else now - 1)

    async def main() -> None:
        await join(
            _config(memory_pki),
            plugins,
            attestor="x-challenged",
            role="node",
            credential=None,
            encryption_key=None,
            claims=wire.Claims(),
            key=pki.generate_key(),
            send=send,
        )

    with pytest.raises(JoinError, match=message):
        trio.run(main)


def test_a_challenge_for_another_attestor_is_refused(memory_pki: Pki) -> None:
    plugins = load_plugins([_Answering()])

    async def send(body: bytes) -> str:
        return _challenge(memory_pki, 1, int(time.time() * 1000) + 60_000, attestor="tpm")

    async def main() -> None:
        await join(
            _config(memory_pki),
            plugins,
            attestor="x-challenged",
            role="node",
            credential=None,
            encryption_key=None,
            claims=wire.Claims(),
            key=pki.generate_key(),
            send=send,
        )

    with pytest.raises(JoinError, match="another attestor"):
        trio.run(main)

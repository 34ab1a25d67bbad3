"""agent.Join's pure parts: the answer's checks in the seed's order, retries and pushback."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime
from typing import Any

import pytest
import trio
import trio.testing

from bcd import pki, wire
from bcd.errors import JoinError, PeerVerificationError, RetryableError, TransportError
from bcd.join import MAX_ATTEMPTS, send_with_retries, verify_joined
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
) -> dict[str, Any]:
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
    assert body["node_id"] == NODE


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

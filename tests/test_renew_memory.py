"""renew_once over the in-memory identity store: the one renewal path without a disk.

Many nodes in one process (the fleet simulator's case): each node's identity lives
in a :class:`bcd.identitystore.MemoryStore`, renewal stores into it, and LoadState
over it gives back exactly what the renewal returned. The gateway here checks the
request as JoinService does and signs a real leaf (control.pki).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
import trio

from bcd import pki, wire
from bcd.errors import JoinError
from bcd.identity import LoadedState, MemoryStore, load_from, make_identity
from bcd.keys.file import key_to_pem
from bcd.renew import renew_once
from control.pki import Pki, issue_node_leaf
from tests.certs import new_id

TTL_S = 3600


def _joined(memory_pki: Pki, name: str) -> LoadedState:
    key = pki.generate_key()
    spiffe = pki.SpiffeId("td.example", new_id("site"), new_id("node"))
    now = datetime.now(UTC)
    leaf = issue_node_leaf(memory_pki, key.public_key(), spiffe, "node", (), now, TTL_S)
    identity = make_identity(
        chain=pki.cert_pem(leaf) + memory_pki.chain_tail_pem(),
        bundle=memory_pki.bundle_pem(),
        trust_version=1,
        server_time="2025-01-01T00:00:00Z",
        key="file",
        identity_generation=1,
    )
    store = MemoryStore(name, {"identity.json": identity.to_json(), "node.key": key_to_pem(key)})
    state = load_from(store)
    assert state is not None
    return state


def _gateway(memory_pki: Pki, peer: LoadedState, seen: list[bytes]):  # type: ignore[no-untyped-def]
    """A sender for ``peer``: checks the proof of possession, answers ``renewed``."""

    async def send(body: bytes) -> str:
        store = peer.store
        assert isinstance(store, MemoryStore)
        seen.append(store.files["node.key.next"])  # written before the request
        req = wire.parse_renew_request(wire.loads_object(body))
        info = pki.leaf_info(pki.load_pem_chain(req.chain)[0])
        current = peer.leaf.public_key()
        assert isinstance(current, pki.ec.EllipticCurvePublicKey)
        message = pki.renew_pop_message(req.csr_der, info.spiffe.node_id, req.client_time_ms)
        pki.verify_p1363(current, req.pop_sig, message)
        csr_key = pki.csr_public_key(pki.parse_csr(req.csr_der))
        now = datetime.now(UTC)
        leaf = issue_node_leaf(memory_pki, csr_key, info.spiffe, info.role, (), now, TTL_S)
        answer = {
            "kind": "renewed",
            "node_id": info.spiffe.node_id,
            "site_id": info.spiffe.site_id,
            "role": info.role,
            "trust_domain": info.spiffe.trust_domain,
            "chain": pki.cert_pem(leaf) + memory_pki.chain_tail_pem(),
            "trust_version": 2,
            "csr_sha256": pki.sha256_hex(req.csr_der),
            "server_time": int(time.time() * 1000),
        }
        return wire.sign_response(answer, memory_pki.join_signing_key)

    return send


async def test_many_nodes_renew_into_their_memory_stores(memory_pki: Pki) -> None:
    signing_pin = memory_pki.pins()["join_signing_key_pin"]
    nodes = [_joined(memory_pki, f"n{i}") for i in range(20)]
    renewed: list[LoadedState] = []

    async def one(state: LoadedState) -> None:
        seen: list[bytes] = []
        new = await renew_once(
            state, _gateway(memory_pki, state, seen), signing_pin=signing_pin, wall=time.time
        )
        assert isinstance(new, LoadedState)
        assert seen == [key_to_pem(new.key)]
        renewed.append(new)

    async with trio.open_nursery() as nursery:
        for state in nodes:
            nursery.start_soon(one, state)
    assert len(renewed) == len(nodes)
    for new in renewed:
        store = new.store
        assert isinstance(store, MemoryStore)
        assert "node.key.next" not in store.files
        assert store.files["node.key"] == key_to_pem(new.key)
        again = load_from(store)
        assert again is not None
        assert again.identity == new.identity
        assert again.identity.trust_version == 2
        assert again.store is store


async def test_a_refused_renewal_leaves_the_memory_store_as_it_was(memory_pki: Pki) -> None:
    state = _joined(memory_pki, "refused")
    store = state.store
    assert isinstance(store, MemoryStore)
    before = dict(store.files)

    async def refuse(body: bytes) -> str:
        raise JoinError("the control plane refused the renewal (ACCESS_DENIED: Renew refused)")

    with pytest.raises(JoinError, match="Renew refused"):
        await renew_once(state, refuse, signing_pin="sha256/x", wall=time.time)
    assert store.files["identity.json"] == before["identity.json"]
    assert store.files["node.key"] == before["node.key"]
    again = load_from(store)  # the stale node.key.next is removed, the old pair loads
    assert again is not None
    assert again.identity == state.identity
    assert "node.key.next" not in store.files

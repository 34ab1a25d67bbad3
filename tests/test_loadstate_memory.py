"""LoadState over the in-memory store: the seed's three rules without a disk.

:func:`bcd.loadstate.decide` is pure: the same snapshot gives the same plan, and it
names the changes the store must make. :func:`bcd.loadstate.load_from` over a
:class:`bcd.identitystore.MemoryStore` runs it the way ``load_state`` does over the
data directory, which tests/test_identity.py and tests/test_crash_safety.py show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcd.errors import IdentityError
from bcd.identity import (
    KEY_MISMATCH,
    TPM_KEY_MISMATCH,
    TPM_NODE_UNSUPPORTED,
    Identity,
    LoadedState,
    LoadedTpmState,
    MemoryStore,
    Snapshot,
    decide,
    load_from,
    load_state,
    store_of,
    store_renewal,
    write_next_key,
)
from bcd.identitystore import Found, Unreadable
from bcd.keys.file import generate_file_key, key_to_pem
from bcd.loadstate import Refuse, TpmToDerive
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmKeyMismatch
from bcd.tpm.record import create_node_key_record
from tests.certs import CertAuthority, make_ca, node_identity

WAY_BACK = "join again: bcd join --reset --yes, then bcd join"


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return make_ca()


def joined_store(ca: CertAuthority) -> tuple[MemoryStore, bytes, Identity]:
    key, identity = node_identity(ca)
    pem = key_to_pem(key)
    store = MemoryStore("n1", {"identity.json": identity.to_json(), "node.key": pem})
    return store, pem, identity


def test_an_empty_store_has_not_joined() -> None:
    assert load_from(MemoryStore()) is None


def test_a_joined_store_loads_its_identity_and_key(ca: CertAuthority) -> None:
    store, pem, identity = joined_store(ca)
    state = load_from(store)
    assert isinstance(state, LoadedState)
    assert state.identity == identity
    assert key_to_pem(state.key) == pem
    assert state.next_key == "none"
    assert state.store is store
    assert store_of(state) is store
    assert state.data_dir == Path("/memory/n1")


def test_a_certified_next_key_is_promoted(ca: CertAuthority) -> None:
    """A renewal stopped after storing the certificate: the new key is promoted."""
    store, _, _ = joined_store(ca)
    new_key, new_identity = node_identity(ca)
    store.files["identity.json"] = new_identity.to_json()
    store.files["node.key.next"] = key_to_pem(new_key)
    state = load_from(store)
    assert state is not None
    assert state.next_key == "promoted"
    assert state.identity == new_identity
    assert store.files["node.key"] == key_to_pem(new_key)
    assert "node.key.next" not in store.files


def test_an_uncertified_next_key_is_removed(ca: CertAuthority) -> None:
    """A renewal stopped before storing the certificate: the old pair stays."""
    store, pem, _ = joined_store(ca)
    store.files["node.key.next"] = key_to_pem(generate_file_key())
    state = load_from(store)
    assert state is not None
    assert state.next_key == "removed"
    assert store.files["node.key"] == pem
    assert "node.key.next" not in store.files


def test_a_next_key_other_users_could_touch_is_moved_aside(
    ca: CertAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    store, pem, _ = joined_store(ca)
    new_key, new_identity = node_identity(ca)
    store.files["identity.json"] = new_identity.to_json()
    store.files["node.key.next"] = key_to_pem(new_key)
    store.exposed["node.key.next"] = "it is mode 0644: other users can read it"
    store.clock = 1234.5
    with caplog.at_level(logging.WARNING, logger="bcd.identity"), pytest.raises(IdentityError):
        load_from(store)  # the old key does not match the new identity: never promoted
    assert store.files["node.key.next.refused-1234"] == key_to_pem(new_key)
    assert store.files["node.key"] == pem
    assert "was not promoted: it is mode 0644" in caplog.text


def test_a_tpm_record_certifying_a_file_identity_is_never_promoted(ca: CertAuthority) -> None:
    store, pem, identity = joined_store(ca)
    leaf_key = identity.leaf().public_key()
    record = create_node_key_record().pinned(leaf_key)  # type: ignore[arg-type]
    store.files["node.key.next"] = record.to_json()
    state = load_from(store)
    assert state is not None
    assert state.next_key == "removed"
    assert store.files["node.key.next.refused-0"] == record.to_json()
    assert store.files["node.key"] == pem


def test_a_node_key_that_is_not_the_leafs_is_refused(ca: CertAuthority) -> None:
    store, _, _ = joined_store(ca)
    store.files["node.key"] = key_to_pem(generate_file_key())
    with pytest.raises(IdentityError) as info:
        load_from(store)
    assert str(info.value) == KEY_MISMATCH


def test_a_missing_or_damaged_node_key_names_the_way_back(ca: CertAuthority) -> None:
    store, _, _ = joined_store(ca)
    del store.files["node.key"]
    with pytest.raises(IdentityError, match=r"the node key /memory/n1/node\.key is missing"):
        load_from(store)
    store.files["node.key"] = b"not a key"
    with pytest.raises(IdentityError, match="does not load") as info:
        load_from(store)
    assert str(info.value).endswith(WAY_BACK)


def test_a_damaged_identity_is_refused_after_tidying(ca: CertAuthority) -> None:
    store, _, _ = joined_store(ca)
    store.files["identity.json"] = b"{"
    plan = decide(store.snapshot())  # type: ignore[arg-type]
    assert plan.actions == ("tidy",)
    assert isinstance(plan.outcome, str)
    assert plan.outcome.startswith("identity.json is damaged")


def test_a_tpm_identity_needs_a_derive_and_the_tpms_key(ca: CertAuthority) -> None:
    key, identity = node_identity(ca)
    identity = dataclasses.replace(identity, key="tpm")
    record = create_node_key_record().pinned(key.public_key())
    store = MemoryStore("t", {"identity.json": identity.to_json(), "node.key": record.to_json()})
    with pytest.raises(IdentityError) as info:
        load_from(store)
    assert str(info.value) == TPM_NODE_UNSUPPORTED
    state = load_from(store, lambda r: key.public_key())
    assert isinstance(state, LoadedTpmState)
    assert state.record == record
    assert state.store is store

    def cleared(_r: object) -> object:
        raise TpmKeyMismatch(KEY_MISMATCH_MESSAGE)

    with pytest.raises(IdentityError) as info:
        load_from(store, cleared)  # type: ignore[arg-type]
    assert str(info.value) == TPM_KEY_MISMATCH
    with pytest.raises(IdentityError) as info:
        load_from(store, lambda r: generate_file_key().public_key())
    assert str(info.value) == TPM_KEY_MISMATCH


def test_a_renewal_stored_in_memory_loads_at_every_step(ca: CertAuthority) -> None:
    """store_renewal over a MemoryStore: whatever step it stops after, LoadState gives
    a matching pair, old before the identity is written and new from then on."""
    for stop in ("none", "next-key", "identity", "rename"):
        store, pem, old = joined_store(ca)
        new_key, new = node_identity(ca)
        write_next_key(store, key_to_pem(new_key))

        class Crash(Exception):
            pass

        def after(step: str, stop: str = stop) -> None:
            if step == stop:
                raise Crash

        with pytest.raises(Crash) if stop != "none" else contextlib.nullcontext():
            store_renewal(store, new, key_to_pem(new_key), after if stop != "none" else None)
        state = load_from(store)
        assert state is not None
        expected = old if stop == "next-key" else new
        assert state.identity == expected
        assert key_to_pem(state.key) == (pem if expected is old else key_to_pem(new_key))


def test_decide_does_no_io_and_gives_the_same_plan_twice(ca: CertAuthority) -> None:
    key, _ = node_identity(ca)
    new_key, new_identity = node_identity(ca)
    snapshot = Snapshot(
        Path("/nowhere"),
        new_identity.to_json(),
        Found(key_to_pem(key)),
        Found(key_to_pem(new_key)),
    )
    first, second = decide(snapshot), decide(snapshot)
    assert first.actions == second.actions == ("tidy", "promote")
    assert isinstance(first.outcome, LoadedState)
    assert first.outcome.identity == new_identity
    assert not Path("/nowhere").exists()


def test_decide_names_each_refusal(ca: CertAuthority) -> None:
    key, identity = node_identity(ca)
    where = Path("/x")
    base = Snapshot(where, identity.to_json(), Found(key_to_pem(key)), None)
    unreadable = dataclasses.replace(base, next_key=Unreadable("/x/node.key.next is a link"))
    assert decide(unreadable).outcome == "/x/node.key.next is a link"
    exposed = dataclasses.replace(base, node_key=Found(key_to_pem(key), "why", "refused: why"))
    assert decide(exposed).outcome == "refused: why"
    aside = dataclasses.replace(base, next_key=Found(b"x", "it is mode 0666"))
    assert decide(aside).actions == ("tidy", Refuse("it is mode 0666"))
    tpm = dataclasses.replace(
        base,
        identity=dataclasses.replace(identity, key="tpm").to_json(),
        node_key=Found(create_node_key_record().pinned(key.public_key()).to_json()),
    )
    assert isinstance(decide(tpm, can_derive=True).outcome, TpmToDerive)
    assert decide(tpm).outcome == TPM_NODE_UNSUPPORTED


@settings(max_examples=60, deadline=None)
@given(
    identity=st.binary(max_size=64),
    node_key=st.none() | st.binary(max_size=64).map(Found),
    next_key=st.none() | st.binary(max_size=64).map(Found),
)
def test_decide_over_any_bytes_refuses_with_a_text(
    identity: bytes, node_key: Found | None, next_key: Found | None
) -> None:
    plan = decide(Snapshot(Path("/h"), identity, node_key, next_key))
    assert isinstance(plan.outcome, str)
    assert plan.actions[0] == "tidy"


def test_load_state_over_the_directory_is_the_same_decision(
    tmp_path: Path, ca: CertAuthority
) -> None:
    """The directory store and the memory store holding the same bytes load alike."""
    from datetime import UTC, datetime

    from bcd.identity import persist_join

    key, identity = node_identity(ca)
    persist_join(tmp_path, identity, key_to_pem(key), datetime.now(UTC))
    on_disk = load_state(tmp_path)
    in_memory = load_from(
        MemoryStore("m", {n: (tmp_path / n).read_bytes() for n in ("identity.json", "node.key")})
    )
    assert on_disk is not None
    assert in_memory is not None
    assert on_disk.identity == in_memory.identity
    assert on_disk.store is None

"""LoadState (seed 003): what a store's identity means, decided without I/O of its own.

:func:`decide` is a pure function over a :class:`~bcd.identitystore.Snapshot`. It
follows the seed's three rules:

1. no identity.json: the node has not joined (the store returns no snapshot);
2. a node.key.next that the stored leaf certifies, of the kind identity.json names
   (``file`` or ``tpm``), is promoted to node.key (a renewal stopped after storing the
   certificate); any other node.key.next is removed, except that one of another kind
   that would otherwise be promoted, or one another user could read or write, is
   moved aside as ``node.key.next.refused-<unix>`` with a warning (never promoted);
3. node.key must be the leaf's key, else :data:`~bcd.identitydoc.KEY_MISMATCH`.

It returns a :class:`Plan`: the changes to make to the store (tidy, promote, remove,
refuse), in order, and then the outcome: a :class:`LoadedState`, a TPM key to derive
(:class:`TpmToDerive`, finished by :func:`finish_tpm` with what the TPM derived) or
the IdentityError text. :func:`load_from` runs a plan against a store;
:func:`load_state` is that over the data directory (:class:`~bcd.identitystore.DirectoryStore`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, overload

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki
from bcd.errors import IdentityError
from bcd.identitydoc import (
    KEY_MISMATCH,
    NEXT_KEY_FILE,
    NODE_KEY_FILE,
    TPM_KEY_MISMATCH,
    TPM_NODE_UNSUPPORTED,
    WAY_BACK,
    Identity,
    KeyKind,
    as_utc,
    parse_identity,
)
from bcd.identitystore import DirectoryStore, Found, IdentityStore, KeyFile, Snapshot, Unreadable
from bcd.keys.file import load_key_pem
from bcd.tpm import TpmError, TpmKeyMismatch
from bcd.tpm.record import NodeKeyRecord

NextKey = Literal["none", "promoted", "removed"]


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class LoadedState:
    """An identity whose key matches its leaf. ``next_key`` tells what rule 2 did.

    ``store`` is where it was loaded from when that is not the data directory
    ``data_dir`` (a :class:`~bcd.identitystore.MemoryStore`).
    """

    data_dir: Path
    identity: Identity
    key: ec.EllipticCurvePrivateKey
    leaf: x509.Certificate
    leaf_info: pki.LeafInfo
    next_key: NextKey = "none"
    store: IdentityStore | None = None

    def expired(self, now: datetime) -> bool:
        return as_utc(now) >= self.leaf_info.not_after


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class LoadedTpmState:
    """An identity whose key the TPM derives from node.key's record, matching its leaf."""

    data_dir: Path
    identity: Identity
    record: NodeKeyRecord
    public_key: ec.EllipticCurvePublicKey
    leaf: x509.Certificate
    leaf_info: pki.LeafInfo
    store: IdentityStore | None = None

    def expired(self, now: datetime) -> bool:
        return as_utc(now) >= self.leaf_info.not_after


AnyState = LoadedState | LoadedTpmState
"""A loaded identity: a file key, or a key the TPM holds."""

Derive = Callable[[NodeKeyRecord], ec.EllipticCurvePublicKey]
"""Maps node.key's TPM record to the public key the TPM derives from it (opening the
TPM: only root may); raises :class:`~bcd.tpm.TpmKeyMismatch` or TpmError."""


def store_of(state: AnyState) -> IdentityStore:
    """The store ``state`` was loaded from (its data directory unless it names one)."""
    return state.store if state.store is not None else DirectoryStore(state.data_dir)


# --- the pure part -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refuse:
    """Move node.key.next aside, for ``why``."""

    why: str


Action = Literal["tidy", "promote", "remove"] | Refuse


@dataclass(frozen=True, slots=True)
class TpmToDerive:
    """A TPM identity whose node.key record is pinned to the leaf: the TPM must derive it."""

    where: Path
    identity: Identity
    record: NodeKeyRecord
    leaf: x509.Certificate
    leaf_info: pki.LeafInfo


@dataclass(frozen=True, slots=True)
class Plan:
    """What LoadState does: ``actions`` in order, then ``outcome`` (a text: refused)."""

    actions: tuple[Action, ...]
    outcome: LoadedState | TpmToDerive | str


def is_record(raw: bytes) -> bool:
    """Whether key bytes are a TPM record (JSON) rather than a PKCS#8 PEM file key."""
    return raw.lstrip().startswith(b"{")


def certifies(raw: bytes, leaf_key: ec.EllipticCurvePublicKey) -> bool:
    """Whether key bytes hold the leaf's key: a file key, or a TPM record pinned to it.

    A record is promoted on its pin alone; the TPM derives it (and is checked) at load.
    """
    if is_record(raw):
        try:
            pin = NodeKeyRecord.from_json(raw).pin
        except TpmError:
            return False
        return pin is not None and pki.pins_equal(pin, pki.spki_pin(leaf_key))
    try:
        return pki.same_public_key(load_key_pem(raw).public_key(), leaf_key)
    except IdentityError:
        return False


def _settle_next(
    next_key: KeyFile, leaf_key: ec.EllipticCurvePublicKey, kind: KeyKind
) -> tuple[Action | None, NextKey]:
    """Rule 2: promote a certified node.key.next of the identity's kind, remove any other.

    A node.key.next that is not private (another user could have planted or read it),
    or of the other kind than ``kind`` (identity.json's ``key``) while it would
    otherwise be promoted (a TPM record pinned to a file key's public half, which
    anyone can build from the leaf), is never promoted: it is moved aside.
    """
    if next_key is None:
        return None, "none"
    assert isinstance(next_key, Found)
    if next_key.not_private is not None:
        return Refuse(next_key.not_private), "removed"
    certified = certifies(next_key.data, leaf_key)
    next_kind: KeyKind = "tpm" if is_record(next_key.data) else "file"
    if certified and next_kind != kind:
        why = (
            f"it holds a {next_kind} key and identity.json's key is a {kind} key "
            "(only a renewal writes node.key.next, always of the kind it stores)"
        )
        return Refuse(why), "removed"
    if certified:
        return "promote", "promoted"
    return "remove", "removed"


def decide(snapshot: Snapshot, *, can_derive: bool = False) -> Plan:
    """LoadState over what a store holds: the changes to make and the outcome.

    ``can_derive``: a TPM identity may load (the caller can have the TPM derive its
    key); without it one is refused with :data:`TPM_NODE_UNSUPPORTED`.
    """
    actions: list[Action] = ["tidy"]

    def refused(text: str) -> Plan:
        return Plan(tuple(actions), text)

    try:
        identity = parse_identity(snapshot.identity)
    except IdentityError as exc:
        return refused(str(exc))
    leaf = identity.leaf()
    info = pki.leaf_info(leaf)
    leaf_key = leaf.public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)  # leaf_info checked it
    if identity.key == "tpm" and not can_derive:
        return refused(TPM_NODE_UNSUPPORTED)
    if isinstance(snapshot.next_key, Unreadable):
        return refused(snapshot.next_key.message)
    action, next_state = _settle_next(snapshot.next_key, leaf_key, identity.key)
    node_key = snapshot.node_key
    if action is not None:
        actions.append(action)
    if action == "promote":
        assert isinstance(snapshot.next_key, Found)
        node_key = Found(snapshot.next_key.data)
    path = snapshot.where / NODE_KEY_FILE
    if isinstance(node_key, Unreadable):
        return refused(node_key.message)
    if node_key is None:
        return refused(f"the node key {path} is missing; {WAY_BACK}")
    if node_key.refusal is not None:
        return refused(node_key.refusal)
    if identity.key == "tpm":
        try:
            record = NodeKeyRecord.from_json(node_key.data)
        except TpmError as exc:
            return refused(f"the node key {path} does not load: {exc}; {WAY_BACK}")
        if record.pin is None or not pki.pins_equal(record.pin, pki.spki_pin(leaf_key)):
            return refused(KEY_MISMATCH)
        return Plan(tuple(actions), TpmToDerive(snapshot.where, identity, record, leaf, info))
    try:
        key = load_key_pem(node_key.data)
    except IdentityError as exc:
        return refused(f"the node key {path} does not load: {exc}; {WAY_BACK}")
    if not pki.same_public_key(key.public_key(), leaf_key):
        return refused(KEY_MISMATCH)
    return Plan(tuple(actions), LoadedState(snapshot.where, identity, key, leaf, info, next_state))


def finish_tpm(pending: TpmToDerive, derived: ec.EllipticCurvePublicKey) -> LoadedTpmState:
    """A TPM identity once the TPM derived ``derived`` from its record (pure)."""
    leaf_key = pending.leaf.public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)
    if not pki.same_public_key(derived, leaf_key):
        raise IdentityError(TPM_KEY_MISMATCH)
    return LoadedTpmState(
        pending.where, pending.identity, pending.record, derived, pending.leaf, pending.leaf_info
    )


# --- running it ----------------------------------------------------------------------


def _apply(store: IdentityStore, actions: tuple[Action, ...]) -> None:
    for action in actions:
        try:
            if action == "tidy":
                store.tidy()
            elif action == "promote":
                store.promote_next()
            elif action == "remove":
                store.remove(NEXT_KEY_FILE)
            else:
                store.refuse_next(action.why)
        except OSError as exc:
            where = store.where if action == "tidy" else store.where / NEXT_KEY_FILE
            verb = "tidy" if action == "tidy" else "settle"
            detail = exc.strerror or exc
            tail = "" if action == "tidy" else f"; {WAY_BACK}"
            raise IdentityError(f"cannot {verb} {where}: {detail}{tail}") from exc


@overload
def load_from(store: IdentityStore) -> LoadedState | None: ...


@overload
def load_from(store: IdentityStore, derive: Derive) -> LoadedState | LoadedTpmState | None: ...


def load_from(store: IdentityStore, derive: Derive | None = None) -> AnyState | None:
    """LoadState over ``store``: :func:`decide` on its snapshot, its changes made, and for
    a TPM key the TPM's derivation through ``derive``; None when the node has not joined."""
    snapshot = store.snapshot()
    if snapshot is None:
        return None
    plan = decide(snapshot, can_derive=derive is not None)
    _apply(store, plan.actions)
    outcome = plan.outcome
    if isinstance(outcome, str):
        raise IdentityError(outcome)
    keep = None if isinstance(store, DirectoryStore) else store
    if isinstance(outcome, LoadedState):
        return outcome if keep is None else _with_store(outcome, keep)
    assert derive is not None
    try:
        derived = derive(outcome.record)
    except TpmKeyMismatch as exc:
        raise IdentityError(TPM_KEY_MISMATCH) from exc
    loaded = finish_tpm(outcome, derived)
    return loaded if keep is None else _with_store(loaded, keep)


def _with_store(state: AnyState, store: IdentityStore) -> AnyState:
    return dataclasses.replace(state, store=store)


@overload
def load_state(data_dir: Path, *, owners: Iterable[int] | None = None) -> LoadedState | None: ...


@overload
def load_state(
    data_dir: Path, derive: Derive, *, owners: Iterable[int] | None = None
) -> LoadedState | LoadedTpmState | None: ...


def load_state(
    data_dir: Path, derive: Derive | None = None, *, owners: Iterable[int] | None = None
) -> LoadedState | LoadedTpmState | None:
    """Load the identity (the seed's LoadState); None when the node has not joined.

    An identity with a TPM key (``key: "tpm"``) loads only with ``derive``: node.key's
    record must be pinned to the leaf's key and the TPM must derive that key again,
    else :data:`TPM_KEY_MISMATCH`. Without ``derive`` it is refused with
    :data:`TPM_NODE_UNSUPPORTED`. A TPM that cannot be reached raises TpmError.

    ``owners`` are the uids trusted to own the data directory and its files (default:
    root and the user running bcd; :func:`bcd.config.trusted_owners` adds the
    ``[helper]`` user). A directory or file that is not private is refused
    (:func:`~bcd.identitystore.private_problem`), whether or not the node has joined.
    """
    store = DirectoryStore(data_dir, owners)
    if derive is None:
        return load_from(store)
    return load_from(store, derive)

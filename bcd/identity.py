"""The node's identity on disk: identity.json, node.key, node.key.next (PROTOCOL.md).

Layout of the data directory (0700)::

    identity.json     0600  the Identity below, as JSON
    node.key          0600  the node key: PKCS#8 PEM (key "file"), or the JSON record
                            the TPM derives it from (key "tpm", bcd.tpm.record)
    node.key.next     0600  the next key, only while a renewal is under way
    journal.db        the node's journal (SQLite); not touched here except to move it

Loading (:func:`load_state`) follows the seed's three rules:

1. no identity.json: the node has not joined (``None``);
2. a node.key.next that the stored leaf certifies, of the kind identity.json names
   (``file`` or ``tpm``), is promoted to node.key (a renewal stopped after storing the
   certificate); any other node.key.next is removed, except that one of another kind
   that would otherwise be promoted, or one another user could read or write, is
   moved aside as ``node.key.next.refused-<unix>`` with a warning (never promoted);
3. node.key must be the leaf's key, else :data:`KEY_MISMATCH`.

Before any of them, the data directory and every file read from it must be private
(:func:`check_private`): owned by one of the trusted uids (root and the user running
bcd, plus the ``[helper]`` user: :func:`bcd.config.trusted_owners`); the directory
neither readable nor writable by group or other (0700, or 0711), identity.json not
writable by them, node.key and node.key.next without any group or other bit (0600 or
0400). Anything else is an :class:`~bcd.errors.IdentityError` naming the path and the
chmod or chown back (a node.key.next is moved aside instead, see rule 2).

Writing goes only through :mod:`bcd.fs`: :func:`persist_join` for a join,
:func:`write_next_key` and :func:`store_renewal` for a renewal, :func:`reset_plan` and
:func:`apply_reset` for ``bcd join --reset``. No file in the data directory is read
through a symlink; a symlink where a file should be is refused.

Every :class:`~bcd.errors.IdentityError` message ends with the way back.

This module is the face; the parts are :mod:`bcd.identitydoc` (the Identity value and
identity.json), :mod:`bcd.identitystore` (the stores: the data directory, and one in
memory), :mod:`bcd.loadstate` (LoadState, a pure decision over a store's snapshot) and
:mod:`bcd.persist` (the writes).
"""

from __future__ import annotations

from bcd.identitydoc import (
    IDENTITY_FIELDS,
    IDENTITY_FILE,
    IDENTITY_VERSION,
    JOURNAL_FILE,
    JOURNAL_SIDECARS,
    KEY_KINDS,
    KEY_MISMATCH,
    MAX_IDENTITY_BYTES,
    MAX_KEY_BYTES,
    NEXT_KEY_FILE,
    NODE_KEY_FILE,
    NOT_JOINED,
    REFUSED_NEXT_SUFFIX,
    TPM_KEY_MISMATCH,
    TPM_NODE_UNSUPPORTED,
    WAY_BACK,
    Identity,
    KeyKind,
    format_time,
    make_identity,
    parse_identity,
    parse_time,
)
from bcd.identitystore import (
    DIR_MASK,
    KEY_FILE_MASK,
    PUBLIC_FILE_MASK,
    DirectoryStore,
    IdentityStore,
    MemoryStore,
    Snapshot,
    StoreOrDir,
    as_store,
    check_data_dir,
    check_private,
    default_owners,
    private_problem,
)
from bcd.loadstate import (
    AnyState,
    Derive,
    LoadedState,
    LoadedTpmState,
    NextKey,
    Plan,
    decide,
    load_from,
    load_state,
    store_of,
)
from bcd.persist import (
    JOIN_RECORD_FILE,
    RENEWAL_STEPS,
    RESET_FILES,
    apply_reset,
    hand_over,
    persist_join,
    persist_rejoin,
    reset_plan,
    store_renewal,
    write_join_record,
    write_next_key,
)

__all__ = [
    "DIR_MASK",
    "IDENTITY_FIELDS",
    "IDENTITY_FILE",
    "IDENTITY_VERSION",
    "JOIN_RECORD_FILE",
    "JOURNAL_FILE",
    "JOURNAL_SIDECARS",
    "KEY_FILE_MASK",
    "KEY_KINDS",
    "KEY_MISMATCH",
    "MAX_IDENTITY_BYTES",
    "MAX_KEY_BYTES",
    "NEXT_KEY_FILE",
    "NODE_KEY_FILE",
    "NOT_JOINED",
    "PUBLIC_FILE_MASK",
    "REFUSED_NEXT_SUFFIX",
    "RENEWAL_STEPS",
    "RESET_FILES",
    "TPM_KEY_MISMATCH",
    "TPM_NODE_UNSUPPORTED",
    "WAY_BACK",
    "AnyState",
    "Derive",
    "DirectoryStore",
    "Identity",
    "IdentityStore",
    "KeyKind",
    "LoadedState",
    "LoadedTpmState",
    "MemoryStore",
    "NextKey",
    "Plan",
    "Snapshot",
    "StoreOrDir",
    "apply_reset",
    "as_store",
    "check_data_dir",
    "check_private",
    "decide",
    "default_owners",
    "format_time",
    "hand_over",
    "load_from",
    "load_state",
    "make_identity",
    "parse_identity",
    "parse_time",
    "persist_join",
    "persist_rejoin",
    "private_problem",
    "reset_plan",
    "store_of",
    "store_renewal",
    "write_join_record",
    "write_next_key",
]

"""Writing the identity: a join, a renewal, a re-join, root's record, ``bcd join --reset``.

Every write goes through :mod:`bcd.fs` (the data directory's files, 0600 and
atomically) or through an :class:`~bcd.identitystore.IdentityStore` (a renewal's,
which a :class:`~bcd.identitystore.MemoryStore` serves as well): :func:`persist_join`
for a join, :func:`write_next_key` and :func:`store_renewal` for a renewal,
:func:`persist_rejoin` for a re-join of this node, :func:`reset_plan` and
:func:`apply_reset` for ``bcd join --reset``. The order of each is the seed's, so a
crash at any instant leaves a state :func:`bcd.loadstate.load_state` settles.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from bcd import fs, pki
from bcd.errors import IdentityError
from bcd.identitydoc import (
    IDENTITY_FILE,
    JOURNAL_FILE,
    JOURNAL_SIDECARS,
    MAX_IDENTITY_BYTES,
    NEXT_KEY_FILE,
    NODE_ID_RE,
    NODE_KEY_FILE,
    Identity,
    as_utc,
)
from bcd.identitystore import StoreOrDir, as_store, data_dir_exists, free_name, read_regular
from bcd.keys.file import load_key_pem
from bcd.loadstate import certifies
from bcd.tpm import TpmError
from bcd.tpm.record import NodeKeyRecord


def persist_join(data_dir: Path, identity: Identity, key_pem: bytes, now: datetime) -> None:
    """Store a joined identity (the seed's Persist step).

    In order: the data directory exists with mode 0700; when it held another node's
    identity.json, that node's journal.db is moved aside as
    ``journal.db.<oldNode>-<unix time>``; a stale node.key.next is removed; node.key
    then identity.json are written (0600, atomically).
    """
    leaf_key = identity.leaf().public_key()
    if not isinstance(leaf_key, ec.EllipticCurvePublicKey):
        raise IdentityError("the issued certificate does not certify the node key")
    if identity.key == "file":
        if not pki.same_public_key(load_key_pem(key_pem).public_key(), leaf_key):
            raise IdentityError("the issued certificate does not certify the node key")
    else:
        try:
            pin = NodeKeyRecord.from_json(key_pem).pin
        except TpmError as exc:
            raise IdentityError(f"the TPM key record does not load: {exc}") from exc
        if pin is None or not pki.pins_equal(pin, pki.spki_pin(leaf_key)):
            raise IdentityError("the issued certificate does not certify the node key")
    try:
        fs.ensure_dir(data_dir, 0o700)
        old_node = _previous_node_id(data_dir)
        if old_node is not None and old_node != identity.node_id:
            _move_journal_aside(data_dir, f"{old_node}-{int(as_utc(now).timestamp())}")
        fs.remove(data_dir / NEXT_KEY_FILE)
        fs.atomic_write(data_dir / NODE_KEY_FILE, key_pem, 0o600)
        fs.atomic_write(data_dir / IDENTITY_FILE, identity.to_json(), 0o600)
    except OSError as exc:
        raise IdentityError(
            f"cannot store the identity in {data_dir}: {exc.strerror or exc}"
        ) from exc


def _previous_node_id(data_dir: Path) -> str | None:
    """The node id in an existing identity.json; ``unknown`` when it cannot be read."""
    try:
        raw = read_regular(data_dir / IDENTITY_FILE, MAX_IDENTITY_BYTES)
    except (IdentityError, OSError):
        return "unknown"
    if raw is None:
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "unknown"
    node_id = obj.get("node_id") if isinstance(obj, dict) else None
    return node_id if isinstance(node_id, str) and NODE_ID_RE.fullmatch(node_id) else "unknown"


def _move_journal_aside(data_dir: Path, tag: str) -> None:
    names = [JOURNAL_FILE, *(JOURNAL_FILE + s for s in JOURNAL_SIDECARS)]
    present = [n for n in names if os.path.lexists(data_dir / n)]
    if not present:
        return
    base = free_name(data_dir, f"{JOURNAL_FILE}.{tag}", JOURNAL_SIDECARS)
    for name in present:
        os.rename(data_dir / name, data_dir / (base + name[len(JOURNAL_FILE) :]))
    fs.fsync_dir(data_dir)


def write_next_key(where: StoreOrDir, next_key_pem: bytes) -> None:
    """Renewal step 2: node.key.next is written before the request is built."""
    store = as_store(where)
    try:
        store.write(NEXT_KEY_FILE, next_key_pem)
    except OSError as exc:
        raise IdentityError(f"cannot write {store.where / NEXT_KEY_FILE}: {exc.strerror}") from exc


RENEWAL_STEPS = ("next-key", "identity", "rename")


def store_renewal(
    where: StoreOrDir,
    identity: Identity,
    next_key_pem: bytes,
    after_step: Callable[[str], None] | None = None,
) -> None:
    """Renewal step 5: node.key.next again, identity.json, then node.key.next over node.key.

    A crash between any two steps leaves a state :func:`~bcd.loadstate.load_state`
    settles to a key and certificate that match. ``after_step`` (a test's fail point)
    is called with each name of :data:`RENEWAL_STEPS` once that step is done.
    """
    store = as_store(where)
    done = after_step or (lambda _name: None)
    try:
        store.write(NEXT_KEY_FILE, next_key_pem)
        done("next-key")
        store.write(IDENTITY_FILE, identity.to_json())
        done("identity")
        store.promote_next()
        done("rename")
    except OSError as exc:
        raise IdentityError(
            f"cannot store the renewed identity in {store.where}: {exc.strerror or exc}"
        ) from exc


def persist_rejoin(
    data_dir: Path,
    identity: Identity,
    key_bytes: bytes,
    after_step: Callable[[str], None] | None = None,
) -> None:
    """Store the identity of a re-join of this same node (``bcd join --attestor x509pop``).

    The steps of a renewal (:func:`store_renewal`), so a crash at any point leaves
    a state :func:`load_state` settles to a matching key and certificate: the old
    identity until identity.json is replaced (the new key waits in node.key.next and
    is removed as uncertified), the new one after (node.key.next is promoted). The
    journal stays: it is this node's. ``key_bytes`` must be the new leaf's key.
    """
    previous = _previous_node_id(data_dir)
    if previous != identity.node_id:
        raise IdentityError(
            f"the re-join answered for {identity.node_id}, not this machine's {previous}; "
            "nothing was stored"
        )
    leaf_key = identity.leaf().public_key()
    if not isinstance(leaf_key, ec.EllipticCurvePublicKey) or not certifies(key_bytes, leaf_key):
        raise IdentityError("the issued certificate does not certify the node key")
    store_renewal(data_dir, identity, key_bytes, after_step)


JOIN_RECORD_FILE = "join-response.jws"


def write_join_record(hostconfig_dir: Path, signed: str) -> Path:
    """Join step 5, root's record: the verified SignedResponse as received (compact JWS).

    ``<hostconfig_dir>/join-response.jws``, 0600, written atomically, in a directory
    made (or set to) 0700; a symlink where the directory should be is refused. Called
    before the identity is persisted: an IdentityError here leaves no identity.
    """
    path = hostconfig_dir / JOIN_RECORD_FILE
    try:
        data = signed.encode("ascii")
        fs.ensure_dir(hostconfig_dir, 0o700)
        fs.atomic_write(path, data, 0o600)
    except (OSError, UnicodeEncodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise IdentityError(
            f"cannot record the join response in {path}: {detail}; no identity was stored. "
            "Make the directory writable by root and join again (a join token is spent: "
            "use a new one)"
        ) from exc
    return path


def hand_over(data_dir: Path, uid: int, gid: int) -> None:
    """Join step 7: give identity.json and node.key to the [helper] user.

    ``lchown`` changes only a link if a name was swapped for one.
    """
    for name in (IDENTITY_FILE, NODE_KEY_FILE):
        try:
            os.lchown(data_dir / name, uid, gid)
        except OSError as exc:
            raise IdentityError(f"cannot hand {data_dir / name} over: {exc.strerror}") from exc


# --- bcd join --reset -------------------------------------------------------------

RESET_FILES = (IDENTITY_FILE, NODE_KEY_FILE, NEXT_KEY_FILE, JOURNAL_FILE)


def reset_plan(data_dir: Path, now: datetime) -> list[tuple[Path, Path]]:
    """What ``bcd join --reset`` moves aside: each present file to ``<name>.reset-<unix>``.

    identity.json, node.key, node.key.next and journal.db, in the same directory. The
    journal's SQLite companions (-wal, -shm, -journal) go with it as
    ``journal.db.reset-<unix>-wal`` and so on. Nothing is moved here.
    """
    if not data_dir_exists(data_dir):
        return []
    suffix = f".reset-{int(as_utc(now).timestamp())}"
    sources = [*RESET_FILES, *(JOURNAL_FILE + s for s in JOURNAL_SIDECARS)]
    present = [n for n in sources if os.path.lexists(data_dir / n)]

    def target(name: str, sfx: str) -> str:
        if name.startswith(JOURNAL_FILE + "-"):
            return JOURNAL_FILE + sfx + name[len(JOURNAL_FILE) :]
        return name + sfx

    n = 0
    chosen = suffix
    while any(os.path.lexists(data_dir / target(name, chosen)) for name in present):
        n += 1
        chosen = f"{suffix}-{n}"
    return [(data_dir / name, data_dir / target(name, chosen)) for name in present]


def apply_reset(
    plan: list[tuple[Path, Path]], moved: Callable[[Path, Path], None] | None = None
) -> None:
    """Do the renames of :func:`reset_plan` (never over an existing name), then fsync.

    ``moved`` is called with each ``(src, dst)`` right after that rename is done, so
    what is reported is what happened, also when a later rename fails.
    """
    directories: list[Path] = []
    for src, dst in plan:
        try:
            if os.path.lexists(dst):
                raise FileExistsError(errno.EEXIST, "the target exists", str(dst))
            os.rename(src, dst)
        except OSError as exc:
            raise IdentityError(f"cannot move {src} aside: {exc.strerror or exc}") from exc
        if moved is not None:
            moved(src, dst)
        if src.parent not in directories:
            directories.append(src.parent)
    for directory in directories:
        with contextlib.suppress(OSError):
            fs.fsync_dir(directory)

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
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, overload

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import fs, pki
from bcd.errors import IdentityError
from bcd.keys.file import load_key_pem
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmError, TpmKeyMismatch
from bcd.tpm.record import NodeKeyRecord

IDENTITY_FILE = "identity.json"
NODE_KEY_FILE = "node.key"
NEXT_KEY_FILE = "node.key.next"
JOURNAL_FILE = "journal.db"
# SQLite's companions of journal.db; they move with it so the moved copy stays whole
# and a new journal.db never replays an old write-ahead log.
JOURNAL_SIDECARS = ("-wal", "-shm", "-journal")
IDENTITY_VERSION = 1
KEY_KINDS = ("file", "tpm")
MAX_IDENTITY_BYTES = 1024 * 1024
MAX_KEY_BYTES = 64 * 1024

WAY_BACK = "join again: bcd join --reset --yes, then bcd join"
KEY_MISMATCH = f"the node key does not match the node certificate; {WAY_BACK}"
TPM_KEY_MISMATCH = (
    f"the node key does not match the node certificate; {KEY_MISMATCH_MESSAGE}; {WAY_BACK}"
)
TPM_NODE_UNSUPPORTED = (
    "this identity's key is held in the TPM, and bcd node uses it only through bcd helper: "
    "add a [helper] table to config.toml and run bcd helper as root"
)
NOT_JOINED = "this node has not joined (run bcd join)"

KeyKind = Literal["file", "tpm"]

IDENTITY_FIELDS = (
    "version",
    "node_id",
    "site_id",
    "role",
    "trust_domain",
    "spiffe_id",
    "chain",
    "bundle",
    "trust_version",
    "server_time",
    "not_after",
    "key",
    "identity_generation",
)
_NODE_ID = re.compile(r"^node_[0-9a-z]{26}$")
_SITE_ID = re.compile(r"^site_[0-9a-z]{26}$")
REFUSED_NEXT_SUFFIX = ".refused-"

log = logging.getLogger("bcd.identity")


# --- times ------------------------------------------------------------------------


def format_time(when: datetime) -> str:
    """ISO 8601 in UTC to the second: ``2025-01-02T03:04:05Z``."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    """Parse an ISO 8601 UTC time (``Z`` or ``+00:00``); raise ValueError otherwise."""
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError("not an ISO 8601 time")
    when = datetime.fromisoformat(text)
    if when.tzinfo is None or when.utcoffset() != UTC.utcoffset(None):
        raise ValueError("not a UTC time")
    return when.astimezone(UTC)


def _utc(now: datetime) -> datetime:
    return now.replace(tzinfo=UTC) if now.tzinfo is None else now


# --- identity.json ----------------------------------------------------------------


class _Bad(ValueError):
    """An inconsistency found while checking an Identity; wrapped by the caller."""


@dataclass(frozen=True, slots=True)
class Identity:
    """identity.json. ``chain`` is PEM, leaf first; ``bundle`` the command-signing roots."""

    node_id: str
    site_id: str
    role: str
    trust_domain: str
    spiffe_id: str
    chain: str
    bundle: str
    trust_version: int
    server_time: str
    not_after: str
    key: KeyKind
    identity_generation: int
    version: int = IDENTITY_VERSION

    def certificates(self) -> list[x509.Certificate]:
        return pki.load_pem_chain(self.chain)

    def leaf(self) -> x509.Certificate:
        return self.certificates()[0]

    def not_after_time(self) -> datetime:
        return parse_time(self.not_after)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}

    def to_json(self) -> bytes:
        """The identity.json bytes (UTF-8, indented, newline at the end)."""
        return (json.dumps(self.to_dict(), indent=2) + "\n").encode("utf-8")


def make_identity(
    *,
    chain: str,
    bundle: str,
    trust_version: int,
    server_time: str,
    key: KeyKind,
    identity_generation: int,
) -> Identity:
    """Build the Identity for a verified chain; names and not_after come from its leaf.

    Raises IdentityError when the chain does not carry a node identity.
    """
    try:
        info = pki.leaf_info(pki.load_pem_chain(chain)[0])
        identity = Identity(
            node_id=info.spiffe.node_id,
            site_id=info.spiffe.site_id,
            role=info.role,
            trust_domain=info.spiffe.trust_domain,
            spiffe_id=str(info.spiffe),
            chain=chain,
            bundle=bundle,
            trust_version=trust_version,
            server_time=server_time,
            not_after=format_time(info.not_after),
            key=key,
            identity_generation=identity_generation,
        )
        _check(identity)
    except (_Bad, pki.PkiError, ValueError) as exc:
        raise IdentityError(f"the issued identity is unusable: {exc}") from exc
    return identity


def parse_identity(data: bytes) -> Identity:
    """Parse identity.json strictly; raise IdentityError ("identity.json is damaged: …")."""
    try:
        return _parse_identity(data)
    except (_Bad, pki.PkiError, ValueError, TypeError, RecursionError) as exc:
        detail = str(exc) if isinstance(exc, _Bad | pki.PkiError) else "it does not parse"
        raise IdentityError(f"{IDENTITY_FILE} is damaged: {detail}; {WAY_BACK}") from exc


def _parse_identity(data: bytes) -> Identity:
    if not isinstance(data, bytes):
        raise _Bad("not bytes")
    if len(data) > MAX_IDENTITY_BYTES:
        raise _Bad("it is too large")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Bad("it is not JSON") from exc
    if not isinstance(obj, dict):
        raise _Bad("it is not a JSON object")
    for name in obj:
        if name not in IDENTITY_FIELDS:
            raise _Bad("it has an unknown field")
    for name in IDENTITY_FIELDS:
        if name not in obj:
            raise _Bad(f"{name} is missing")
    version = _int(obj, "version")
    if version != IDENTITY_VERSION:
        raise _Bad(f"version {version} is not {IDENTITY_VERSION}")
    key = _str(obj, "key")
    if key not in KEY_KINDS:
        raise _Bad("key must be file or tpm")
    identity = Identity(
        node_id=_str(obj, "node_id"),
        site_id=_str(obj, "site_id"),
        role=_str(obj, "role"),
        trust_domain=_str(obj, "trust_domain"),
        spiffe_id=_str(obj, "spiffe_id"),
        chain=_str(obj, "chain"),
        bundle=_str(obj, "bundle", empty=True),
        trust_version=_int(obj, "trust_version"),
        server_time=_str(obj, "server_time"),
        not_after=_str(obj, "not_after"),
        key="file" if key == "file" else "tpm",
        identity_generation=_int(obj, "identity_generation"),
        version=version,
    )
    _check(identity)
    return identity


def _str(obj: dict[str, Any], name: str, *, empty: bool = False) -> str:
    value = obj[name]
    if not isinstance(value, str) or (not value and not empty):
        raise _Bad(f"{name} must be a string")
    return value


def _int(obj: dict[str, Any], name: str) -> int:
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise _Bad(f"{name} must be a non-negative integer")
    return value


def _check(identity: Identity) -> None:
    """The fields agree with each other and with the leaf certificate."""
    if not _NODE_ID.fullmatch(identity.node_id):
        raise _Bad("node_id is not a node id")
    if not _SITE_ID.fullmatch(identity.site_id):
        raise _Bad("site_id is not a site id")
    if identity.role not in pki.ROLES:
        raise _Bad("role is not a known role")
    if not pki.valid_trust_domain(identity.trust_domain):
        raise _Bad("trust_domain is not a trust domain")
    expected = pki.SpiffeId(identity.trust_domain, identity.site_id, identity.node_id)
    if identity.spiffe_id != str(expected):
        raise _Bad("spiffe_id does not match node_id, site_id and trust_domain")
    if identity.key not in KEY_KINDS:
        raise _Bad("key must be file or tpm")
    for name in ("trust_version", "identity_generation", "version"):
        value = getattr(identity, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _Bad(f"{name} must be a non-negative integer")
    try:
        parse_time(identity.server_time)
    except ValueError as exc:
        raise _Bad("server_time is not an ISO 8601 UTC time") from exc
    try:
        not_after = parse_time(identity.not_after)
    except ValueError as exc:
        raise _Bad("not_after is not an ISO 8601 UTC time") from exc
    try:
        certs = pki.load_pem_chain(identity.chain)
        info = pki.leaf_info(certs[0])
    except (pki.PkiError, ValueError) as exc:
        raise _Bad("the chain does not hold a node certificate") from exc
    if info.spiffe != expected or info.role != identity.role:
        raise _Bad("the certificate names another identity")
    if info.not_after != not_after:
        raise _Bad("not_after is not the certificate's")
    if identity.bundle:
        try:
            pki.load_pem_chain(identity.bundle)
        except (pki.PkiError, ValueError) as exc:
            raise _Bad("the bundle does not parse") from exc


# --- reading the data directory ---------------------------------------------------


def _symlink_refused(path: Path) -> IdentityError:
    return IdentityError(f"{path} is a symbolic link, which bcd refuses; {WAY_BACK}")


def default_owners() -> frozenset[int]:
    """The uids trusted without a configuration: root and the user running bcd."""
    return frozenset({0, os.geteuid()})


def _owners(owners: Iterable[int] | None) -> frozenset[int]:
    return default_owners() if owners is None else frozenset(owners) | {0}


DIR_MASK = 0o066
"""The data directory: no other user may list it or create, rename or remove in it
(search permission alone, 0711, lets no one read or change anything)."""
PUBLIC_FILE_MASK = 0o022
"""identity.json holds only public values: no other user may write it."""
KEY_FILE_MASK = 0o077
"""node.key and node.key.next: no other user may read or write them (0600 or 0400)."""


def _not_private(st: os.stat_result, owners: frozenset[int], mask: int) -> str | None:
    """Why a file or directory with ``st`` is not private to bcd, in short; None if it is."""
    if st.st_uid not in owners:
        return (
            f"it is owned by uid {st.st_uid}, which is not root, the user running bcd or the "
            "[helper] user"
        )
    mode = stat.S_IMODE(st.st_mode)
    bits = mode & mask
    if bits:
        verbs = [v for v, m in (("read", 0o044), ("write", 0o022), ("execute", 0o011)) if bits & m]
        return f"it is mode {mode:04o}: other users can {' and '.join(verbs)} it"
    return None


def private_problem(
    path: Path, st: os.stat_result, owners: frozenset[int], mask: int
) -> str | None:
    """Why ``path`` (its ``st``) is not private to bcd, with the way back; None when it is.

    Private: owned by one of ``owners`` and without a permission bit of ``mask`` for
    group or other (:data:`DIR_MASK`, :data:`PUBLIC_FILE_MASK`, :data:`KEY_FILE_MASK`),
    so no other user can read a private key or plant, swap or change a file.
    """
    why = _not_private(st, owners, mask)
    if why is None:
        return None
    directory = stat.S_ISDIR(st.st_mode)
    what = "the data directory " if directory else ""
    if st.st_uid not in owners:
        back = f"check what is in it, then give it back: chown root {path}"
        back += f" (under [helper]: chown <helper user> {path})"
    else:
        back = f"make it its owner's alone: chmod {'0700' if directory else '0600'} {path}"
        if mask == KEY_FILE_MASK and stat.S_IMODE(st.st_mode) & 0o044:
            back += f" (another user may have read the key: {WAY_BACK})"
    return f"{what}{path} is not private ({why}), so bcd does not trust it; {back}"


def check_private(
    path: Path, st: os.stat_result, mask: int, owners: Iterable[int] | None = None
) -> None:
    """Raise IdentityError (:func:`private_problem`) unless ``path`` is private to bcd."""
    problem = private_problem(path, st, _owners(owners), mask)
    if problem is not None:
        raise IdentityError(problem)


def _open_regular(path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
    """A regular file's content and stat, never through a symlink; None when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink_refused(path) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"{path} is not a regular file; {WAY_BACK}")
        if st.st_size > limit:
            raise IdentityError(f"{path} is too large; {WAY_BACK}")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise IdentityError(f"{path} is too large; {WAY_BACK}")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _read_regular(
    path: Path, limit: int, owners: frozenset[int] | None = None, mask: int = KEY_FILE_MASK
) -> bytes | None:
    """:func:`_open_regular`'s content; with ``owners``, the file must be private too."""
    found = _open_regular(path, limit)
    if found is None:
        return None
    raw, st = found
    if owners is not None:
        check_private(path, st, mask, owners)
    return raw


def _data_dir_stat(data_dir: Path) -> os.stat_result | None:
    try:
        st = os.lstat(data_dir)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IdentityError(f"cannot read {data_dir}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise IdentityError(f"the data directory {data_dir} is not a directory")
    return st


def _data_dir_exists(data_dir: Path) -> bool:
    return _data_dir_stat(data_dir) is not None


def check_data_dir(data_dir: Path, owners: Iterable[int] | None = None) -> bool:
    """Whether the data directory exists; raise IdentityError if it is not private."""
    st = _data_dir_stat(data_dir)
    if st is None:
        return False
    check_private(data_dir, st, DIR_MASK, owners)
    return True


NextKey = Literal["none", "promoted", "removed"]


@dataclass(frozen=True, slots=True, eq=False)
class LoadedState:
    """An identity whose key matches its leaf. ``next_key`` tells what rule 2 did."""

    data_dir: Path
    identity: Identity
    key: ec.EllipticCurvePrivateKey
    leaf: x509.Certificate
    leaf_info: pki.LeafInfo
    next_key: NextKey = "none"

    def expired(self, now: datetime) -> bool:
        return _utc(now) >= self.leaf_info.not_after


@dataclass(frozen=True, slots=True, eq=False)
class LoadedTpmState:
    """An identity whose key the TPM derives from node.key's record, matching its leaf."""

    data_dir: Path
    identity: Identity
    record: NodeKeyRecord
    public_key: ec.EllipticCurvePublicKey
    leaf: x509.Certificate
    leaf_info: pki.LeafInfo

    def expired(self, now: datetime) -> bool:
        return _utc(now) >= self.leaf_info.not_after


AnyState = LoadedState | LoadedTpmState
"""A loaded identity: a file key, or a key the TPM holds."""

Derive = Callable[[NodeKeyRecord], ec.EllipticCurvePublicKey]
"""Maps node.key's TPM record to the public key the TPM derives from it (opening the
TPM: only root may); raises :class:`~bcd.tpm.TpmKeyMismatch` or TpmError."""


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
    (:func:`private_problem`), whether or not the node has joined.
    """
    trusted = _owners(owners)
    if not check_data_dir(data_dir, trusted):
        return None
    identity_path = data_dir / IDENTITY_FILE
    try:
        raw = _read_regular(identity_path, MAX_IDENTITY_BYTES, trusted, PUBLIC_FILE_MASK)
    except OSError as exc:
        raise IdentityError(f"cannot read {identity_path}: {exc.strerror or exc}") from exc
    if raw is None:
        return None
    try:
        fs.remove_stale_temps(data_dir, (IDENTITY_FILE, NODE_KEY_FILE, NEXT_KEY_FILE))
    except OSError as exc:
        raise IdentityError(f"cannot tidy {data_dir}: {exc.strerror or exc}") from exc
    identity = parse_identity(raw)
    leaf = identity.leaf()
    info = pki.leaf_info(leaf)
    leaf_key = leaf.public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)  # leaf_info checked it
    if identity.key == "tpm":
        if derive is None:
            raise IdentityError(TPM_NODE_UNSUPPORTED)
        _settle_next_key(data_dir, leaf_key, "tpm", trusted)
        record, public_key = _derive_tpm_key(data_dir, leaf_key, derive, trusted)
        return LoadedTpmState(data_dir, identity, record, public_key, leaf, info)
    next_key = _settle_next_key(data_dir, leaf_key, "file", trusted)
    key = _load_node_key(data_dir, trusted)
    if not pki.same_public_key(key.public_key(), leaf_key):
        raise IdentityError(KEY_MISMATCH)
    return LoadedState(
        data_dir=data_dir,
        identity=identity,
        key=key,
        leaf=leaf,
        leaf_info=info,
        next_key=next_key,
    )


def _read_node_key(data_dir: Path, owners: frozenset[int]) -> tuple[Path, bytes]:
    """node.key's path and bytes (a private regular file, size-capped), or the way back."""
    path = data_dir / NODE_KEY_FILE
    try:
        raw = _read_regular(path, MAX_KEY_BYTES, owners)
    except OSError as exc:
        raise IdentityError(f"cannot read {path}: {exc.strerror or exc}; {WAY_BACK}") from exc
    if raw is None:
        raise IdentityError(f"the node key {path} is missing; {WAY_BACK}")
    return path, raw


def _derive_tpm_key(
    data_dir: Path, leaf_key: ec.EllipticCurvePublicKey, derive: Derive, owners: frozenset[int]
) -> tuple[NodeKeyRecord, ec.EllipticCurvePublicKey]:
    path, raw = _read_node_key(data_dir, owners)
    try:
        record = NodeKeyRecord.from_json(raw)
    except TpmError as exc:
        raise IdentityError(f"the node key {path} does not load: {exc}; {WAY_BACK}") from exc
    if record.pin is None or not pki.pins_equal(record.pin, pki.spki_pin(leaf_key)):
        raise IdentityError(KEY_MISMATCH)
    try:
        public_key = derive(record)
    except TpmKeyMismatch as exc:
        raise IdentityError(TPM_KEY_MISMATCH) from exc
    if not pki.same_public_key(public_key, leaf_key):
        raise IdentityError(TPM_KEY_MISMATCH)
    return record, public_key


def _settle_next_key(
    data_dir: Path, leaf_key: ec.EllipticCurvePublicKey, kind: KeyKind, owners: frozenset[int]
) -> NextKey:
    """Rule 2: promote a certified node.key.next of the identity's kind, remove any other.

    A node.key.next that is not private (another user could have planted or read it),
    or of the other kind than ``kind`` (identity.json's ``key``) while it would
    otherwise be promoted (a TPM record pinned to a file key's public half, which
    anyone can build from the leaf), is never promoted: it is moved aside as
    ``node.key.next.refused-<unix>`` and logged, and the current node.key stays.
    """
    next_path = data_dir / NEXT_KEY_FILE
    try:
        found = _open_regular(next_path, MAX_KEY_BYTES)
        if found is None:
            return "none"
        raw, st = found
        why = _not_private(st, owners, KEY_FILE_MASK)
        if why is not None:
            _refuse_next(data_dir, why)
            return "removed"
        certified = _certified_next(raw, leaf_key)
        next_kind: KeyKind = "tpm" if _is_record(raw) else "file"
        if certified and next_kind != kind:
            _refuse_next(
                data_dir,
                f"it holds a {next_kind} key and identity.json's key is a {kind} key "
                "(only a renewal writes node.key.next, always of the kind it stores)",
            )
            return "removed"
        if certified:
            os.rename(next_path, data_dir / NODE_KEY_FILE)
            fs.fsync_dir(data_dir)
            return "promoted"
        fs.remove(next_path)
        return "removed"
    except OSError as exc:
        raise IdentityError(
            f"cannot settle {next_path}: {exc.strerror or exc}; {WAY_BACK}"
        ) from exc


def _refuse_next(data_dir: Path, why: str) -> Path:
    """Move node.key.next aside, never over anything, and log why."""
    base = _free_name(data_dir, f"{NEXT_KEY_FILE}{REFUSED_NEXT_SUFFIX}{int(time.time())}", ())
    aside = data_dir / base
    os.rename(data_dir / NEXT_KEY_FILE, aside)
    fs.fsync_dir(data_dir)
    log.warning("%s was not promoted: %s; moved aside to %s", data_dir / NEXT_KEY_FILE, why, aside)
    return aside


def _is_record(raw: bytes) -> bool:
    """Whether key bytes are a TPM record (JSON) rather than a PKCS#8 PEM file key."""
    return raw.lstrip().startswith(b"{")


def _certified_next(raw: bytes, leaf_key: ec.EllipticCurvePublicKey) -> bool:
    """Whether node.key.next holds the leaf's key: a file key, or a TPM record pinned to it.

    A record is promoted on its pin alone; the TPM derives it (and is checked) at load.
    """
    if _is_record(raw):
        try:
            pin = NodeKeyRecord.from_json(raw).pin
        except TpmError:
            return False
        return pin is not None and pki.pins_equal(pin, pki.spki_pin(leaf_key))
    try:
        return pki.same_public_key(load_key_pem(raw).public_key(), leaf_key)
    except IdentityError:
        return False


def _load_node_key(data_dir: Path, owners: frozenset[int]) -> ec.EllipticCurvePrivateKey:
    path, raw = _read_node_key(data_dir, owners)
    try:
        return load_key_pem(raw)
    except IdentityError as exc:
        raise IdentityError(f"the node key {path} does not load: {exc}; {WAY_BACK}") from exc


# --- writing ----------------------------------------------------------------------


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
            _move_journal_aside(data_dir, f"{old_node}-{int(_utc(now).timestamp())}")
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
        raw = _read_regular(data_dir / IDENTITY_FILE, MAX_IDENTITY_BYTES)
    except (IdentityError, OSError):
        return "unknown"
    if raw is None:
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "unknown"
    node_id = obj.get("node_id") if isinstance(obj, dict) else None
    return node_id if isinstance(node_id, str) and _NODE_ID.fullmatch(node_id) else "unknown"


def _move_journal_aside(data_dir: Path, tag: str) -> None:
    names = [JOURNAL_FILE, *(JOURNAL_FILE + s for s in JOURNAL_SIDECARS)]
    present = [n for n in names if os.path.lexists(data_dir / n)]
    if not present:
        return
    base = _free_name(data_dir, f"{JOURNAL_FILE}.{tag}", JOURNAL_SIDECARS)
    for name in present:
        os.rename(data_dir / name, data_dir / (base + name[len(JOURNAL_FILE) :]))
    fs.fsync_dir(data_dir)


def _free_name(directory: Path, base: str, suffixes: tuple[str, ...]) -> str:
    """``base``, or ``base-N``, such that neither it nor it+suffix exists."""
    candidate, n = base, 0
    while any(os.path.lexists(directory / (candidate + s)) for s in ("", *suffixes)):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def write_next_key(data_dir: Path, next_key_pem: bytes) -> None:
    """Renewal step 2: node.key.next is written before the request is built."""
    try:
        fs.atomic_write(data_dir / NEXT_KEY_FILE, next_key_pem, 0o600)
    except OSError as exc:
        raise IdentityError(f"cannot write {data_dir / NEXT_KEY_FILE}: {exc.strerror}") from exc


RENEWAL_STEPS = ("next-key", "identity", "rename")


def store_renewal(
    data_dir: Path,
    identity: Identity,
    next_key_pem: bytes,
    after_step: Callable[[str], None] | None = None,
) -> None:
    """Renewal step 5: node.key.next again, identity.json, then node.key.next over node.key.

    A crash between any two steps leaves a state :func:`load_state` settles to a key
    and certificate that match. ``after_step`` (a test's fail point) is called with
    each name of :data:`RENEWAL_STEPS` once that step is on disk.
    """
    next_path = data_dir / NEXT_KEY_FILE
    done = after_step or (lambda _name: None)
    try:
        fs.atomic_write(next_path, next_key_pem, 0o600)
        done("next-key")
        fs.atomic_write(data_dir / IDENTITY_FILE, identity.to_json(), 0o600)
        done("identity")
        os.rename(next_path, data_dir / NODE_KEY_FILE)
        fs.fsync_dir(data_dir)
        done("rename")
    except OSError as exc:
        raise IdentityError(
            f"cannot store the renewed identity in {data_dir}: {exc.strerror or exc}"
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
    if not isinstance(leaf_key, ec.EllipticCurvePublicKey) or not _certified_next(
        key_bytes, leaf_key
    ):
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
    if not _data_dir_exists(data_dir):
        return []
    suffix = f".reset-{int(_utc(now).timestamp())}"
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

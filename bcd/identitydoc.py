"""identity.json: the :class:`Identity` value, its strict parser and the data directory's names.

The names of the files in the data directory, the messages every loader and writer
shares (each ends with the way back), and the times as identity.json writes them.
No I/O here: :mod:`bcd.identitystore` reads and writes the files, :mod:`bcd.loadstate`
decides what they mean, :mod:`bcd.persist` stores a join, a renewal or a reset.
:mod:`bcd.identity` is the face that re-exports them all.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from cryptography import x509

from bcd import pki
from bcd.errors import IdentityError
from bcd.tpm import KEY_MISMATCH_MESSAGE

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
NODE_ID_RE = re.compile(r"^node_[0-9a-z]{26}$")
_SITE_ID = re.compile(r"^site_[0-9a-z]{26}$")
REFUSED_NEXT_SUFFIX = ".refused-"


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


def as_utc(now: datetime) -> datetime:
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
    if not NODE_ID_RE.fullmatch(identity.node_id):
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

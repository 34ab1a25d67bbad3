"""Node keys in the TPM: derived, never stored.

The node key is a primary under the owner hierarchy, created from the node-key
template (:mod:`bcd.tpm.templates`) and a random 32-byte ``unique`` value. node.key
holds only a :class:`NodeKeyRecord`: the same record derives the same key after a
restart, and another key once the owner seed changes (``tpm2_clear``), which
:func:`derive_node_key` reports with :class:`~bcd.tpm.TpmKeyMismatch`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec
from tpm2_pytss import TPMT_SIG_SCHEME
from tpm2_pytss.constants import TPM2_ALG

from bcd.pki import PkiError, parse_pin, pins_equal, spki_pin
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmError, TpmKeyMismatch
from bcd.tpm.device import OWNER, Loaded, Tpm
from bcd.tpm.structures import parse_signature_ecdsa
from bcd.tpm.templates import (
    NODE_KEY_TEMPLATE,
    UNIQUE_SIZE,
    check_node_key_public,
    node_key_template,
)

RECORD_VERSION = 1
RECORD_KIND = "tpm"
MAX_RECORD = 4096
_UNIQUE_HEX = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"version", "kind", "template", "unique", "pin"}


@dataclass(frozen=True, slots=True)
class NodeKeyRecord:
    """What node.key holds for a TPM key: how to derive it, and the key it must be.

    ``pin`` is the SPKI pin (``sha256/…``) of the derived key; a fresh record has
    none until :meth:`pinned` is called with the key the TPM derived.
    """

    unique: str
    pin: str | None = None
    template: str = NODE_KEY_TEMPLATE
    kind: str = RECORD_KIND
    version: int = RECORD_VERSION

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version != RECORD_VERSION:
            raise TpmError("node.key: unsupported TPM key record version")
        if self.kind != RECORD_KIND:
            raise TpmError("node.key: not a TPM key record")
        if self.template != NODE_KEY_TEMPLATE:
            raise TpmError("node.key: unknown TPM key template")
        if not isinstance(self.unique, str) or not _UNIQUE_HEX.fullmatch(self.unique):
            raise TpmError("node.key: the unique value is not 32 bytes of lowercase hex")
        if self.pin is not None:
            try:
                parse_pin(self.pin)
            except PkiError as exc:
                raise TpmError("node.key: the key pin is malformed") from exc

    @property
    def unique_bytes(self) -> bytes:
        return bytes.fromhex(self.unique)

    def pinned(self, public_key: ec.EllipticCurvePublicKey) -> NodeKeyRecord:
        """This record with the pin of ``public_key``."""
        return replace(self, pin=spki_pin(public_key))

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.kind,
            "template": self.template,
            "unique": self.unique,
            "pin": self.pin,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_dict(cls, data: object) -> NodeKeyRecord:
        if not isinstance(data, dict) or not set(data) <= _FIELDS:
            raise TpmError("node.key: not a TPM key record")
        missing = {"version", "kind", "template", "unique"} - set(data)
        if missing:
            raise TpmError(f"node.key: the TPM key record has no {sorted(missing)[0]}")
        return cls(
            unique=data["unique"],
            pin=data.get("pin"),
            template=data["template"],
            kind=data["kind"],
            version=data["version"],
        )

    @classmethod
    def from_json(cls, data: bytes) -> NodeKeyRecord:
        """Parse node.key's TPM record; raise TpmError for anything else."""
        if not isinstance(data, bytes) or len(data) > MAX_RECORD:
            raise TpmError("node.key: not a TPM key record")
        try:
            parsed = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise TpmError("node.key: not a TPM key record") from exc
        return cls.from_dict(parsed)


@dataclass(frozen=True, slots=True)
class NodeKeyPublic:
    """A derived node key: its public key, TPMT_PUBLIC and name."""

    public_key: ec.EllipticCurvePublicKey
    public_area: bytes
    name: bytes


def create_node_key_record() -> NodeKeyRecord:
    """A new record with a random unique value (not yet pinned)."""
    return NodeKeyRecord(unique=secrets.token_hex(UNIQUE_SIZE))


def check_derived(key: Loaded, record: NodeKeyRecord) -> NodeKeyPublic:
    """Check a freshly derived node key: node-key attributes, its name, the record's pin."""
    try:
        info = check_node_key_public(key.public)
    except TpmError as exc:
        raise TpmError("the TPM derived a key without the node-key attributes") from exc
    if info.name != key.name:
        raise TpmError("the TPM's name for the node key does not match its public area")
    public_key = info.ec_key()
    if record.pin is not None and not pins_equal(spki_pin(public_key), record.pin):
        raise TpmKeyMismatch(KEY_MISMATCH_MESSAGE)
    return NodeKeyPublic(public_key, key.public, key.name)


def public_key_of(tpm: Tpm, record: NodeKeyRecord) -> NodeKeyPublic:
    """Derive the record's key and return its public half, public area and name.

    Raises TpmError if the key lacks the node-key attributes, TpmKeyMismatch if the
    record is pinned to another key.
    """
    with (
        tpm.op("deriving the node key"),
        tpm.primary(OWNER, node_key_template(record.unique_bytes)) as key,
    ):
        return check_derived(key, record)


def derive_node_key(tpm: Tpm, record: NodeKeyRecord) -> ec.EllipticCurvePublicKey:
    """The public key the TPM derives from ``record`` (checked as :func:`public_key_of`)."""
    return public_key_of(tpm, record).public_key


def sign(tpm: Tpm, record: NodeKeyRecord, digest: bytes) -> bytes:
    """Sign a SHA-256 digest with the record's key: a 64-byte P1363 signature (r || s)."""
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise TpmError("the TPM signs a 32-byte SHA-256 digest")
    with (
        tpm.op("signing with the node key") as esapi,
        tpm.primary(OWNER, node_key_template(record.unique_bytes)) as key,
    ):
        check_derived(key, record)
        signature = esapi.sign(key.handle, digest, TPMT_SIG_SCHEME(scheme=TPM2_ALG.NULL))
        return parse_signature_ecdsa(bytes(signature.marshal()))

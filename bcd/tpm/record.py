"""What node.key holds for a TPM-held node key, and the pure check of a derived key.

No TPM and no tpm2-pytss here: ``bcd node`` (which never opens the TPM) loads
node.key and checks the helper's answers with these; :mod:`bcd.tpm.nodekey` derives
and uses the key.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from bcd.pki import PkiError, parse_pin, pins_equal, spki_pin
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmError, TpmKeyMismatch
from bcd.tpm.templates import NODE_KEY_TEMPLATE, UNIQUE_SIZE, check_node_key_public

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


def node_key_public(public_area: bytes, record: NodeKeyRecord) -> NodeKeyPublic:
    """Check a node key's TPMT_PUBLIC against the node-key template and the record's pin.

    Raises TpmError if it lacks the node-key attributes, TpmKeyMismatch if the
    record is pinned to another key.
    """
    info = check_node_key_public(public_area)
    public_key = info.ec_key()
    if record.pin is not None and not pins_equal(spki_pin(public_key), record.pin):
        raise TpmKeyMismatch(KEY_MISMATCH_MESSAGE)
    return NodeKeyPublic(public_key, public_area, info.name)

"""Hardware claims: reading them, normalising them, the hardware key, expect bindings.

bcd reads what firmware and kernel say about the machine (:func:`read_claims`) and
sends it as read; the control plane normalises and hashes it (:func:`hardware_key`)
and checks join tokens' ``expect`` bindings against it (:func:`expect_matches`).
Everything but :func:`read_claims` is a pure function over values, and nothing here
raises on odd input except :func:`normalize_expect`, which raises :class:`ValueError`.

Normalisation (PROTOCOL.md "Hardware key"); a value that does not survive is dropped:

- every value is trimmed; a value holding a control character or a lone surrogate is
  dropped, so no value can forge a second ``kind:value`` line;
- product UUID: ASCII lower case, dashed ``8-4-4-4-12``; dashed or 32-hex input in any
  case is accepted, anything else is dropped;
- serials (product, board, chassis): ASCII upper case (compared case-insensitively);
- MACs: lower-case colon form; ``aa:bb:..``, ``aa-bb-..``, ``aabb.ccdd.eeff`` and bare
  12-hex input are accepted; locally administered (bit 0x02 of the first octet),
  multicast (bit 0x01) and zero MACs are dropped;
- GPU UUIDs: ASCII lower case (compared case-insensitively);
- placeholders are dropped: empty, the strings in :data:`PLACEHOLDERS` (trimmed,
  case-insensitive), and any value of one repeated character once dashes and colons
  are ignored (all-zero and all-F UUIDs among them; a GPU UUID's ``GPU-`` prefix is
  ignored too).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

from bcd import wire

MAX_VALUE = 256
MAX_LIST = 64
PLACEHOLDERS = (
    "To Be Filled By O.E.M.",
    "Default string",
    "System Serial Number",
    "Not Specified",
    "None",
    "N/A",
    "0123456789",
)
KINDS = ("product_uuid", "serial", "mac", "gpu_uuid")
EXPECT_KEYS = ("productUuid", "serial", "mac", "gpuUuid")

_UPPER = str.maketrans(string.ascii_lowercase, string.ascii_uppercase)
_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_PLACEHOLDER_SET = frozenset(p.translate(_UPPER) for p in PLACEHOLDERS)
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
_MAC_RE = re.compile(
    r"[0-9a-f]{2}(?::[0-9a-f]{2}){5}|[0-9a-f]{2}(?:-[0-9a-f]{2}){5}"
    r"|[0-9a-f]{4}(?:\.[0-9a-f]{4}){2}|[0-9a-f]{12}"
)
_BAD_CHAR = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


# --- normalisation ----------------------------------------------------------------


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or _BAD_CHAR.search(value):
        return None
    return value


def _one_char(value: str) -> bool:
    """True for a value of (at most) one repeated character, ignoring dashes and colons."""
    return len(set(value.replace("-", "").replace(":", ""))) <= 1


def _placeholder(value: str) -> bool:
    return value.translate(_UPPER) in _PLACEHOLDER_SET or _one_char(value)


def normalize_uuid(value: object) -> str | None:
    """A product UUID in lower-case dashed form, or None if it is not one or a placeholder."""
    v = _clean(value)
    if v is None:
        return None
    v = v.translate(_LOWER)
    if not _UUID_RE.fullmatch(v):
        return None
    h = v.replace("-", "")
    return None if _one_char(h) else f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def normalize_serial(value: object) -> str | None:
    """A serial in ASCII upper case, or None if empty or a placeholder."""
    v = _clean(value)
    if v is None or _placeholder(v):
        return None
    return v.translate(_UPPER)


def normalize_mac(value: object) -> str | None:
    """A permanent, globally administered unicast MAC as ``aa:bb:cc:dd:ee:ff``, else None."""
    v = _clean(value)
    if v is None:
        return None
    v = v.translate(_LOWER)
    if not _MAC_RE.fullmatch(v):
        return None
    h = re.sub(r"[-:.]", "", v)
    if int(h[:2], 16) & 0x03 or _one_char(h):
        return None
    return ":".join(h[i : i + 2] for i in range(0, 12, 2))


def normalize_gpu_uuid(value: object) -> str | None:
    """A GPU UUID in ASCII lower case, or None if empty or a placeholder."""
    v = _clean(value)
    if v is None:
        return None
    v = v.translate(_LOWER)
    if _placeholder(v) or _one_char(v.removeprefix("gpu-")):
        return None
    return v


def identifiers(claims: wire.Claims) -> dict[str, frozenset[str]]:
    """The normalised identifiers of each kind in :data:`KINDS` (possibly empty sets)."""
    serials = (claims.product_serial, claims.board_serial, claims.chassis_serial)
    found = {
        "product_uuid": [normalize_uuid(claims.product_uuid)],
        "serial": [normalize_serial(s) for s in serials],
        "mac": [normalize_mac(m) for m in claims.macs],
        "gpu_uuid": [normalize_gpu_uuid(g) for g in claims.gpu_uuids],
    }
    return {kind: frozenset(v for v in values if v is not None) for kind, values in found.items()}


# --- the hardware key -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HardwareKey:
    """The machine's hardware key, and how far it can be trusted.

    ``hex`` is None when no identifier survived. ``trusted`` means at least two of the
    four kinds survived; ``kinds`` names the kinds that did.
    """

    hex: str | None
    trusted: bool
    has_uuid_or_serial: bool
    kinds: frozenset[str]

    @property
    def placeholder(self) -> bool:
        """The placeholder-hardware rule (control.admission.screen refuses a join-token
        join of such a key unless its token has an ``expect`` binding; ``bcd doctor``
        shows it): no identifier survived, fewer than two kinds did, or neither a
        product UUID nor a serial did."""
        return self.hex is None or not self.trusted or not self.has_uuid_or_serial


def hardware_key(claims: wire.Claims) -> HardwareKey:
    """Derive the hardware key from raw claims.

    After normalisation (see the module docstring) each surviving identifier becomes
    one line ``<kind>:<value>``, kind being ``product_uuid``, ``serial`` (any of the
    product, board and chassis serials), ``mac`` or ``gpu_uuid``. Duplicate lines are
    dropped, the lines are sorted by code point, joined with ``"\\n"`` (no trailing
    newline), encoded as UTF-8 and hashed with SHA-256; ``hex`` is the lower-case hex
    digest. For example ``mac:0c:c4:7a:12:34:56\\nproduct_uuid:4c4c...\\nserial:ABC123``.
    """
    ids = identifiers(claims)
    lines = sorted({f"{kind}:{value}" for kind, values in ids.items() for value in values})
    kinds = frozenset(kind for kind, values in ids.items() if values)
    digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest() if lines else None
    return HardwareKey(
        hex=digest,
        trusted=len(kinds) >= 2,
        has_uuid_or_serial=bool(kinds & {"product_uuid", "serial"}),
        kinds=kinds,
    )


KIND_NAMES = {
    "product_uuid": "product UUID",
    "serial": "serial",
    "mac": "permanent MAC",
    "gpu_uuid": "GPU UUID",
}


def placeholder_reasons(claims: wire.Claims) -> list[str]:
    """Why :func:`hardware_key` of ``claims`` is a placeholder, in words (empty when it
    is not): each value that normalisation dropped, then which rule it breaks. Values
    are shown JSON-quoted (a control character cannot forge a line)."""
    hw = hardware_key(claims)
    if not hw.placeholder:
        return []
    why: list[str] = []
    raw = [
        ("product UUID", claims.product_uuid, normalize_uuid),
        ("product serial", claims.product_serial, normalize_serial),
        ("board serial", claims.board_serial, normalize_serial),
        ("chassis serial", claims.chassis_serial, normalize_serial),
        *(("MAC", mac, normalize_mac) for mac in claims.macs),
        *(("GPU UUID", gpu, normalize_gpu_uuid) for gpu in claims.gpu_uuids),
    ]
    for label, value, normalize in raw:
        if not value.strip():
            if label in ("product UUID", "product serial"):
                why.append(f"no {label}")
        elif normalize(value) is None:
            why.append(f"{label} {json.dumps(value)} is a placeholder or malformed (dropped)")
    if not claims.macs:
        why.append("no permanent MAC (a NIC with a device and addr_assign_type 0)")
    kinds = ", ".join(KIND_NAMES[k] for k in KINDS if k in hw.kinds) or "none"
    if not hw.trusted:
        why.append(f"kinds that survived: {kinds}; a trusted key needs two of them")
    if not hw.has_uuid_or_serial:
        why.append("neither a product UUID nor a serial survived")
    return why


# --- expect bindings --------------------------------------------------------------

_EXPECT = {
    "productUuid": ("product_uuid", normalize_uuid, "is not a UUID, or is a placeholder"),
    "serial": ("serial", normalize_serial, "is empty or a placeholder"),
    "mac": ("mac", normalize_mac, "is not a permanent, globally administered unicast MAC"),
    "gpuUuid": ("gpu_uuid", normalize_gpu_uuid, "is empty or a placeholder"),
}


def normalize_expect(obj: object) -> dict[str, str]:
    """Validate a join token's ``expect`` (an object with keys among :data:`EXPECT_KEYS`,
    string values of at most 256 characters) and return it normalised.

    Raises ValueError naming the offending key.
    """
    if not isinstance(obj, dict):
        raise ValueError("expect must be an object")
    out: dict[str, str] = {}
    for key, value in obj.items():
        if key not in _EXPECT:
            allowed = ", ".join(EXPECT_KEYS)
            raise ValueError(f"expect has an unknown key {key!r:.64} (allowed: {allowed})")
        if not isinstance(value, str) or len(value) > MAX_VALUE:
            raise ValueError(f"expect.{key} must be a string of at most {MAX_VALUE} characters")
        _, normalize, problem = _EXPECT[key]
        normalized = normalize(value)
        if normalized is None:
            raise ValueError(f"expect.{key} {problem}")
        out[key] = normalized
    return out


def expect_matches(expect: dict[str, str], claims: wire.Claims) -> bool:
    """True when every identifier named in ``expect`` is among the machine's claims.

    Values are normalised again (so raw values work too); a value that does not
    normalise, or an unknown key, never matches. ``serial`` may match the product,
    board or chassis serial. An empty ``expect`` matches any machine.
    """
    ids = identifiers(claims)
    for key, value in expect.items():
        if key not in _EXPECT:
            return False
        kind, normalize, _ = _EXPECT[key]
        normalized = normalize(value)
        if normalized is None or normalized not in ids[kind]:
            return False
    return True


# --- reading the machine ----------------------------------------------------------


def _read_text(path: Path, limit: int = 64 * 1024) -> str | None:
    try:
        with path.open("rb") as f:
            data = f.read(limit)
    except (OSError, ValueError):
        return None
    return data.decode("utf-8", "replace")


def _read_value(path: Path) -> str | None:
    text = _read_text(path, 4096)
    return None if text is None else text.strip()[:MAX_VALUE]


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (OSError, ValueError):
        return []


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _permanent_macs(net: Path) -> tuple[str, ...]:
    """``address`` of every NIC with a ``device`` entry whose ``addr_assign_type`` is 0.

    A missing or unreadable ``addr_assign_type`` counts as permanent. A bond member
    reports the bond's address, so its ``bonding_slave/perm_hwaddr`` is used instead.
    """
    macs: set[str] = set()
    for name in _listdir(net):
        nic = net / name
        if not _exists(nic / "device") or _read_value(nic / "addr_assign_type") not in (None, "0"):
            continue
        address = _read_value(nic / "bonding_slave" / "perm_hwaddr") or _read_value(nic / "address")
        if address:
            macs.add(address)
    return tuple(sorted(macs)[:MAX_LIST])


def _gpu_uuids(gpus: Path) -> tuple[str, ...]:
    """``GPU UUID:`` lines of the NVIDIA driver's per-GPU ``information`` files."""
    found: set[str] = set()
    for bus in _listdir(gpus):
        for line in (_read_text(gpus / bus / "information") or "").splitlines():
            label, sep, value = line.partition(":")
            if sep and label.strip() == "GPU UUID" and value.strip():
                found.add(value.strip()[:MAX_VALUE])
    return tuple(sorted(found)[:MAX_LIST])


def read_claims(root: Path = Path("/")) -> wire.Claims:
    """Read this machine's hardware claims under ``root`` (``/`` but for tests).

    Values are trimmed and capped at 256 characters, lists at 64 sorted entries, and
    otherwise sent as read: normalisation is the control plane's. A missing or
    unreadable file gives ``""`` (or no entry); this never raises.
    """
    dmi = root / "sys" / "class" / "dmi" / "id"
    kernel = root / "proc" / "sys" / "kernel"
    return wire.Claims(
        product_uuid=_read_value(dmi / "product_uuid") or "",
        product_serial=_read_value(dmi / "product_serial") or "",
        board_serial=_read_value(dmi / "board_serial") or "",
        chassis_serial=_read_value(dmi / "chassis_serial") or "",
        macs=_permanent_macs(root / "sys" / "class" / "net"),
        gpu_uuids=_gpu_uuids(root / "proc" / "driver" / "nvidia" / "gpus"),
        hostname=_read_value(kernel / "hostname") or "",
        boot_id=_read_value(kernel / "random" / "boot_id") or "",
    )

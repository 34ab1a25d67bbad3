"""Hypothesis strategies: one per path family, each drawing a whole :class:`Case`.

A case is the exact bytes to write (one request, or a few pipelined), where to write
them (which listener, with which client certificate), where to cut them into pieces
and how long to pause between pieces, and whether a whole answer is owed (a request
whose head and body framing are complete). Bodies are random JSON, mutations of
valid requests built with real keys (a real sealed token bound to its CSR, a real
proof of possession by the identity's key), type confusion, and huge or deeply
nested values; raw framing mixes methods, targets, versions, headers and every
Content-Length / Transfer-Encoding combination, then may mangle the bytes.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from bcd import __version__, pki, wire
from fuzz.world import MAC_POOL, Identity, World, b64

MAX_BODY = 64 * 1024


class _Cached:
    """``st`` with every strategy it builds kept by its arguments: a composite builds
    its inner strategies on every draw, and building (and validating) them again each
    time costs more than drawing from them."""

    def __init__(self) -> None:
        self._made: dict[Any, SearchStrategy[Any]] = {}

    def __getattr__(self, name: str) -> Callable[..., SearchStrategy[Any]]:
        make = getattr(st, name)

        def cached(*args: Any, **kwargs: Any) -> SearchStrategy[Any]:
            key = (
                name,
                tuple(_key(a) for a in args),
                tuple(sorted((k, _key(v)) for k, v in kwargs.items())),
            )
            try:
                return self._made[key]
            except KeyError:
                made = self._made[key] = make(*args, **kwargs)
                return made
            except TypeError:  # an unhashable argument: build it each time
                return make(*args, **kwargs)

        return cached


def _key(value: Any) -> Any:
    if isinstance(value, list):
        flat = tuple(value)
        if all(type(v) in (str, bytes) for v in flat):  # the common case, hashed as is
            return ("list", flat)
        return ("list", tuple(_key(v) for v in flat))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v)) for k, v in value.items()))
    return (type(value).__name__, value)


S = _Cached()


@dataclass
class Case:
    family: str
    endpoint: str  # a key of the run's endpoints: gw, api, relay, fgw
    identity: str | None
    path: str
    data: bytes = field(repr=False)
    methods: list[str]
    """One per answer expected (more than one: pipelined requests)."""
    cuts: list[int] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    complete: bool = True
    """Head and body framing are complete, so an answer (or a refusal) is owed."""
    fresh: bool = False
    """Needs a connection of its own (raw framing, cut bytes, a huge body)."""
    kind: str = ""

    def pieces(self) -> list[bytes]:
        if not self.cuts:
            return [self.data]
        points = sorted({c for c in self.cuts if 0 < c < len(self.data)})
        out, last = [], 0
        for p in points:
            out.append(self.data[last:p])
            last = p
        out.append(self.data[last:])
        return out

    def describe(self, limit: int = 700) -> str:
        data = self.data
        shown = data if len(data) <= limit else data[: limit // 2] + b"..." + data[-limit // 3 :]
        # the run's real API credential is not printed (made-up bcak_ strings are)
        shown = re.sub(rb"bcak_ak_[0-9a-z]{26}\.[A-Za-z0-9_-]{20,}", b"bcak_<credential>", shown)
        who = self.identity or "-"
        return (
            f"[{self.family}/{self.kind}] {self.endpoint} as {who}, {len(data)} bytes, "
            f"cuts {sorted(self.cuts)[:8]}, complete={self.complete}: {shown!r}"
        )


# --- JSON values ------------------------------------------------------------------

INTERESTING_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",  # a lone surrogate: not encodable as UTF-8
    "\udfff\ud800",
    "\u2028\u2029",
    "\r\nX-Injected: 1",
    "A" * 257,
    "A" * 8193,
    "../../../../etc/passwd",
    "%00%2e%2e%2f",
    "null",
    "true",
    "1e999",
    "-0",
    "0x10",
    "١٢٣",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "bcjt_jt_" + "0" * 26 + "." + "A" * 43,
    "node_" + "0" * 26,
    "pool_" + "0" * 26,
    "site_" + "0" * 26,
    "jreq_" + "0" * 26,
    "join-token",
    "tpm",
    "x509pop",
    "discovery",
    "ZmFrZQ==",
    "====",
    "{}",
    "[]",
    "9" * 30,
]
KEYS = [
    "protocol",
    "role",
    "attestor",
    "sealed_token",
    "csr",
    "claims",
    "evidence",
    "node_id",
    "daemon_version",
    "round",
    "answer",
    "chain",
    "client_time",
    "pop_sig",
    "key_attestation",
    "journal_id",
    "boot_id",
    "mac",
    "ip",
    "boot_lease_epoch",
    "workflow_id",
    "name",
    "siteId",
    "agent",
    "policy",
    "ttlSeconds",
    "maxUses",
    "expect",
    "reason",
    "__proto__",
    "",
]
BIG_INTS = [0, -1, 1, 2, 3, 4, 2**31, 2**32, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**30]


def pick(draw: st.DrawFn, items: list[Any]) -> Any:
    """An item of a list that changes while the run goes on (ids, fresh requests): drawn
    as an index, so the choices hypothesis records keep their shape."""
    return items[draw(S.integers(0, 1 << 16)) % len(items)]


@functools.cache
def text(max_size: int = 24) -> SearchStrategy[str]:
    return S.text(max_size=max_size) | S.sampled_from(INTERESTING_STRINGS)


SCALARS: SearchStrategy[Any] = S.one_of(
    S.none(),
    S.booleans(),
    S.integers(min_value=-(2**66), max_value=2**66),
    S.sampled_from(BIG_INTS),
    S.floats(),
    text(),
)


def json_values(max_leaves: int = 8) -> SearchStrategy[Any]:
    return S.recursive(
        SCALARS,
        lambda inner: (
            S.lists(inner, max_size=4)
            | S.dictionaries(S.sampled_from(KEYS) | S.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


JSON = json_values()


def encode_json(obj: Any, style: int) -> bytes:
    """JSON as a client might send it; style picks ASCII-only, raw UTF-8 (a lone
    surrogate passes through as invalid UTF-8), indented, or NaN written out."""
    if style == 1:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if style == 2:
        return json.dumps(obj, indent=1).encode()
    return json.dumps(obj).encode()


@st.composite
def hostile_body(draw: st.DrawFn) -> bytes:
    """Bodies that are not JSON objects, or are at a size limit, or nest deeply."""
    kind = draw(S.integers(0, 13))
    if kind == 0:
        return b""
    if kind == 1:
        return draw(S.binary(max_size=200))
    if kind == 2:
        n = draw(S.integers(10, 120_000))
        opener, closer = draw(S.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        tail = b"1" if opener != b"[" else b""
        return opener * n + tail + closer * n
    if kind == 3:
        return b'{"protocol":' + b"1" * draw(S.integers(4000, 60_000)) + b"}"
    if kind == 4:  # exactly at, or just over, the 64 KiB limit
        size = MAX_BODY + draw(S.integers(-3, 3))
        return b'{"p":"' + b"x" * (size - 8) + b'"}'
    if kind == 5:
        return b"\xef\xbb\xbf" + json.dumps({"protocol": 1}).encode()  # a BOM
    if kind == 6:
        return b'{"a":1,"a":2,"protocol":1,"protocol":"1"}'
    if kind == 7:
        return json.dumps({"protocol": 1}).encode() + draw(S.binary(min_size=1, max_size=20))
    if kind == 8:
        return draw(S.sampled_from([b"null", b"[]", b"1", b'"s"', b"true", b"NaN", b"-Infinity"]))
    if kind == 9:
        return b"\xff\xfe" + "{}".encode("utf-16-le")
    if kind == 10:
        return json.dumps(
            {draw(S.sampled_from(KEYS)): "v" * draw(S.integers(60_000, 64_000))}
        ).encode()
    if kind == 11:  # many keys
        n = draw(S.integers(100, 6000))
        return json.dumps({f"k{i}": i for i in range(n)}).encode()
    if kind == 12:
        return b'{"protocol":1e400,"round":-0.0,"x":' + b"[" * 20 + b"]" * 20 + b"}"
    return encode_json(draw(JSON), draw(S.integers(0, 3)))


HOSTILE = hostile_body()


@functools.cache
def huge_value() -> SearchStrategy[Any]:
    return S.one_of(
        S.integers(1, 70_000).map(lambda n: "A" * n),
        S.integers(1, 3000).map(lambda n: ["0c:c4:7a:00:00:01"] * n),
        S.integers(1, 2000).map(lambda n: {f"k{i}": [i] for i in range(n)}),
        S.integers(1, 300).map(lambda n: _nested(n)),
        S.sampled_from([10**300, -(10**300), 2**1000]),
    )


HUGE = huge_value()


def _nested(n: int) -> Any:
    out: Any = "leaf"
    for _ in range(n):
        out = {"a": out}
    return out


def mutate(
    draw: st.DrawFn,
    base: dict[str, Any],
    fields: dict[str, SearchStrategy[Any]],
    *,
    max_ops: int = 4,
    min_ops: int = 0,
) -> tuple[dict[str, Any], int]:
    """``base`` with 0..max_ops mutations: a key dropped, a value replaced by an
    interesting one for that field, by any JSON, by a huge one, by a value of another
    type, a nested object mutated, or an unknown key added. Returns (object, ops)."""
    obj = copy.deepcopy(base)
    ops = draw(S.integers(min_ops, max_ops))
    keys = sorted(set(base) | set(fields)) or ["x"]
    for _ in range(ops):
        op = draw(S.integers(0, 9))
        key = draw(S.sampled_from(keys))
        if op == 0:
            obj.pop(key, None)
        elif op in (1, 2, 3):
            obj[key] = draw(fields.get(key, JSON))
        elif op == 4:
            obj[key] = draw(JSON)
        elif op == 5:
            obj[key] = draw(HUGE)
        elif op == 6:
            value = obj.get(key)
            obj[key] = draw(
                S.sampled_from([None, str(value), [value], {"v": value}, 0, True, 1.5, ""])
            )
        elif op == 7 and isinstance(obj.get(key), dict) and obj[key]:
            inner = obj[key]
            ik = draw(S.sampled_from(sorted(inner)))
            inner[ik] = draw(JSON | S.sampled_from([None, "", 0, []]))
        elif op == 8:
            obj[draw(S.sampled_from(KEYS) | S.text(max_size=10))] = draw(JSON)
        else:
            obj = {k: obj[k] for k in sorted(obj, reverse=True)}  # order only
    return obj, ops


# --- shared pieces for the node calls -------------------------------------------------


class Material:
    """Keys, CSRs and certificates made once, for the value strategies to pick from."""

    def __init__(self, world: World) -> None:
        self.world = world
        key = pki.generate_key()
        self.csr_ok = pki.make_csr(key)
        p384 = ec.generate_private_key(ec.SECP384R1())
        rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)  # noqa: S505 - a CSR to refuse
        from cryptography import x509

        def csr_of(k: Any, subject: bool = False, ext: bool = False) -> bytes:
            b = x509.CertificateSigningRequestBuilder().subject_name(
                x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "x" * 60)])
                if subject
                else x509.Name([])
            )
            if ext:
                b = b.add_extension(
                    x509.SubjectAlternativeName([x509.DNSName("evil.example")]), critical=False
                )
            return b.sign(k, hashes.SHA256()).public_bytes(serialization.Encoding.DER)

        bad_sig = bytearray(self.csr_ok)
        bad_sig[-5] ^= 0xFF
        ident = next(iter(world.identities.values()))
        self.csrs = [
            self.csr_ok,
            csr_of(p384),
            csr_of(rsa_key),
            csr_of(key, subject=True, ext=True),
            bytes(bad_sig),
            self.csr_ok[:40],
            ident.leaf_der,  # a certificate, not a CSR
            b"\x30\x82\xff\xff" + b"\x00" * 20,
            b"",
        ]
        self.chains = [i.chain for i in world.identities.values()]
        self.leaf_ders = [i.leaf_der for i in world.identities.values()]
        self.node_ids = [i.node_id for i in world.identities.values()]
        self.x509pop_evidence = [
            {"chain": [b64(d) for d in i.chain_der]} for i in world.identities.values()
        ]
        header = {
            "alg": "ECDH-ES+A256KW",
            "enc": "A256GCM",
            "typ": wire.SEAL_TYP,
            "kid": world.encryption_pin,
            "iat": int(time.time()),
            "csr": "0" * 64,
        }
        self.seal_header = header

    def csr_values(self) -> SearchStrategy[str]:
        return S.one_of(
            S.sampled_from(self.csrs).map(b64),
            S.binary(max_size=300).map(b64),
            text(40),
            S.builds(lambda: b64(pki.make_csr(pki.generate_key()))),
        )

    def node_id_values(self) -> SearchStrategy[Any]:
        return S.one_of(
            S.sampled_from(self.node_ids),
            S.sampled_from(self.world.all_node_ids or self.node_ids),
            S.from_regex(r"node_[0-9a-z]{26}", fullmatch=True),
            text(70),
            JSON,
        )


def forged_seal(draw: st.DrawFn, mat: Material, real: str) -> str:
    """A compact JWE whose protected header passes (or nearly passes) the typ, alg and
    kid checks, with its other parts from the real seal, mutated or made up."""
    parts = real.split(".")
    header = dict(mat.seal_header)
    with contextlib.suppress(ValueError):
        header = json.loads(pki.b64url_decode(parts[0]))
    kind = draw(S.integers(0, 9))
    if kind == 0:
        header["epk"] = {
            "kty": "EC",
            "crv": draw(S.sampled_from(["P-256", "P-384", "P-521", "X25519", "secp256k1"])),
            "x": pki.b64url(draw(S.binary(min_size=0, max_size=66))),
            "y": pki.b64url(draw(S.binary(min_size=0, max_size=66))),
        }
    elif kind == 1:
        header.pop(draw(S.sampled_from(sorted(header))), None)
    elif kind == 2:
        header[
            draw(S.sampled_from([*sorted(header), "zip", "crit", "jku", "x5u", "apu", "apv"]))
        ] = draw(JSON | S.sampled_from(["DEF", ["exp"], "http://127.0.0.1:1/"]))
    elif kind == 3:
        header["epk"] = draw(JSON)
    elif kind == 4:
        header["iat"] = draw(S.sampled_from([0, -1, 2**63, 1.5, "now", None, int(time.time())]))
    elif kind == 5:
        header["csr"] = draw(S.sampled_from(["", "g" * 64, "0" * 63, None, 1]) | text(70))
    elif kind == 6:  # an epk that is a valid point on P-256 but not the sender's
        k = ec.generate_private_key(ec.SECP256R1())
        header["epk"] = {**wire.public_jwk_of(k.public_key())}
    elif kind == 7:
        header["alg"] = draw(S.sampled_from(["dir", "none", "ECDH-ES", "RSA-OAEP", "A256KW"]))
    elif kind == 8:
        header["enc"] = draw(S.sampled_from(["A128GCM", "A256CBC-HS512", "none"]))
    raw_header = json.dumps(header).encode()
    if draw(S.booleans()) and kind >= 6:
        raw_header = raw_header.replace(b"}", b', "kid": "other"}', 1)  # a second kid
    out = [pki.b64url(raw_header), *parts[1:]] if len(parts) == 5 else [pki.b64url(raw_header)]
    while len(out) < 5:
        out.append("")
    which = draw(S.integers(0, 5))
    if which == 1:
        out[1] = pki.b64url(draw(S.binary(max_size=80)))
    elif which == 2:
        out[2] = pki.b64url(draw(S.binary(max_size=16)))
    elif which == 3:
        out[3] = pki.b64url(draw(S.binary(max_size=200)))
    elif which == 4:
        out[4] = pki.b64url(draw(S.binary(max_size=20)))
    return ".".join(out)


def join_fields(mat: Material) -> dict[str, SearchStrategy[Any]]:
    macs = S.lists(S.sampled_from(MAC_POOL) | text(20), max_size=5)
    return {
        "protocol": S.sampled_from([1, 0, 2, "1", True, 1.0, -1, 2**64, None]),
        "role": S.sampled_from(["node", "site", "ramdisk", "NODE", "", "x" * 40]) | text(),
        "attestor": S.sampled_from(
            ["", "join-token", "tpm", "x509pop", "discovery", "JOIN-TOKEN", "Tpm", "nope", "a" * 70]
        ),
        "csr": mat.csr_values(),
        "claims": S.fixed_dictionaries(
            {},
            optional={
                "product_uuid": text(40),
                "product_serial": text(40),
                "board_serial": text(),
                "chassis_serial": text(),
                "macs": macs | S.integers(0, 100).map(lambda n: ["0c:c4:7a:00:00:02"] * n),
                "gpu_uuids": S.lists(text(40), max_size=4),
                "hostname": text(70),
                "boot_id": text(40),
                "unknown": JSON,
            },
        )
        | JSON,
        "evidence": S.one_of(
            S.fixed_dictionaries(
                {},
                optional={
                    "ek_public": S.binary(max_size=400).map(b64) | text(),
                    "ek_certificate": S.binary(max_size=200).map(b64) | text(),
                    "ak_public": S.binary(max_size=400).map(b64) | text(),
                    "ak_name": S.binary(max_size=40).map(b64) | text(),
                },
            ),
            S.builds(
                lambda chain: {"chain": chain},
                S.lists(
                    S.sampled_from([*mat.leaf_ders, mat.csr_ok]).map(b64)
                    | S.binary(max_size=100).map(b64)
                    | text(),
                    max_size=6,
                ),
            ),
            S.sampled_from(mat.x509pop_evidence),
            JSON,
        ),
        "node_id": mat.node_id_values() | S.none(),
        "daemon_version": S.sampled_from([__version__, "", "9" * 70]) | text(),
        "round": S.sampled_from([0, 1, 2, 3, 4, -1, True, "1", 1.5, None]),
        "answer": S.one_of(
            S.none(),
            S.fixed_dictionaries(
                {},
                optional={
                    "id": S.from_regex(r"jc_[0-9a-z]{26}", fullmatch=True) | text(),
                    "nonce": S.binary(max_size=40).map(b64) | text(),
                    "signature": S.binary(max_size=70).map(b64) | text(),
                    "secret": S.binary(max_size=40).map(b64) | text(),
                },
            ),
            JSON,
        ),
    }


def _headers(draw: st.DrawFn) -> list[tuple[str, str]]:
    """Headers a JSON client sends, now and then odd (the server ignores most)."""
    out = [("content-type", "application/json")]
    extra = draw(S.integers(0, 15))
    if extra == 0:
        out = [("content-type", draw(S.sampled_from(["text/plain", "", "application/jose"])))]
    elif extra == 1:
        out.append(("expect", "100-continue"))
    elif extra == 2:
        out.append(("connection", draw(S.sampled_from(["close", "keep-alive", "upgrade"]))))
    elif extra == 3:
        out.append(("bc-relay-peer-cert", base64.b64encode(b"x" * 300).decode()))
        out.append(("bc-relay-remote", "10.0.0.1:1"))
    elif extra == 4:
        out.append(("x-forwarded-for", "10.1.2.3"))
    return out


def _case(
    family: str,
    endpoint: str,
    identity: str | None,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
    kind: str,
    method: str = "POST",
) -> Case:
    data = _request(method, path, headers, body)
    return Case(
        family, endpoint, identity, path, data, [method], kind=kind, fresh=len(body) > MAX_BODY
    )


def _request(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1"]
    lines += [f"{n}: {v}" for n, v in headers]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body


# --- the gateway's node calls ---------------------------------------------------------


def gw_join(
    world: World, mat: Material, endpoint: str = "gw", family: str = "gw-join"
) -> SearchStrategy[Case]:
    fields = join_fields(mat)

    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        branch = draw(S.integers(0, 99))
        base = pick(draw, world.base_joins())
        identity = None
        if draw(S.integers(0, 9)) == 0:
            identity = draw(S.sampled_from(["node0", "site", "revoked"]))
        if branch < 40:
            obj, ops = mutate(draw, base.body, fields)
            kind = f"mutated-valid/{ops}"
            if ops and draw(S.integers(0, 3)) == 0:  # a tokenless join of another attestor
                obj["attestor"] = draw(S.sampled_from(["discovery", "tpm", "x509pop"]))
                obj["sealed_token"] = None
                kind = f"attestor-{obj['attestor']}/{ops}"
            body = encode_json(obj, draw(S.integers(0, 4)))
        elif branch < 55:
            obj = dict(base.body)
            obj["sealed_token"] = forged_seal(draw, mat, base.body["sealed_token"])
            kind = "forged-seal"
            body = wire.dumps(obj)
        elif branch < 65:
            obj = dict(base.body)
            attestor = draw(S.sampled_from(["discovery", "tpm", "x509pop"]))
            obj.update(attestor=attestor, sealed_token=None)
            obj["claims"] = dict(
                obj["claims"],
                macs=draw(S.lists(S.sampled_from(MAC_POOL), min_size=1, max_size=3)),
            )
            obj["evidence"] = draw(fields["evidence"])
            obj["round"] = draw(S.sampled_from([0, 0, 1]))
            obj["answer"] = draw(fields["answer"]) if obj["round"] else None
            kind = f"attestor-{attestor}"
            body = wire.dumps(obj)
        elif branch < 75:
            obj = draw(S.dictionaries(S.sampled_from(KEYS), JSON, max_size=8))
            kind = "random-object"
            body = encode_json(obj, draw(S.integers(0, 3)))
        elif branch < 85:
            obj = dict(base.body)
            obj[draw(S.sampled_from(sorted(obj)))] = draw(HUGE)
            kind = "huge-field"
            body = wire.dumps(obj)
        else:
            body = draw(HOSTILE)
            kind = "hostile-body"
        return _case(family, endpoint, identity, "/v1/join", body, _headers(draw), kind)

    return strategy()


LIVE = ["node0", "node1", "node2", "node3"]
RENEW_SLOTS = [f"r{i}" for i in range(16)]
"""Renewal identities: 6 renewals an hour each, then RESOURCE_EXHAUSTED before the body
is read, so the run joins a new node into a slot whose renewals ran out."""
SITE_SLOTS = [f"s{i}" for i in range(4)]
"""Site agents: 600 vouches a minute each, replaced the same way."""


def _identity(
    draw: st.DrawFn, live_weight: int, extra: list[str], live: list[str] = LIVE
) -> str | None:
    roll = draw(S.integers(0, 99))
    if roll < live_weight:
        return draw(S.sampled_from(live))
    if roll < live_weight + 10:
        return None
    return draw(S.sampled_from(extra))


def gw_renew(
    world: World, mat: Material, endpoint: str = "gw", family: str = "gw-renew"
) -> SearchStrategy[Case]:
    fields: dict[str, SearchStrategy[Any]] = {
        "csr": mat.csr_values(),
        "chain": S.sampled_from(mat.chains)
        | text(100)
        | S.integers(1, 40_000).map(lambda n: "-" * n),
        "client_time": S.sampled_from([0, -1, 2**63, 2**64, 1.5, "now", True, None])
        | S.integers(0, 2**45),
        "pop_sig": S.binary(max_size=100).map(pki.b64url) | text(130),
        "key_attestation": JSON,
    }

    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        identity = _identity(draw, 75, ["site", "revoked", "sac", "node0"], RENEW_SLOTS)
        ident: Identity = world.identities[identity or "node0"]
        branch = draw(S.integers(0, 99))
        if branch < 60:
            base = renew_body(
                ident, skew_ms=draw(S.sampled_from([0, 0, 0, 59_000, -61_000, 10**9]))
            )
            # a whole valid renewal spends one of the node's 6 an hour: mostly mutate
            obj, ops = mutate(draw, base, fields, min_ops=0 if branch < 3 else 1)
            kind = f"mutated-valid/{ops}"
            body = encode_json(obj, draw(S.integers(0, 3)))
        elif branch < 75:
            obj = draw(S.dictionaries(S.sampled_from(KEYS), JSON, max_size=6))
            kind = "random-object"
            body = encode_json(obj, 0)
        elif branch < 85:
            base = renew_body(ident)
            base[draw(S.sampled_from(sorted(base)))] = draw(HUGE)
            kind = "huge-field"
            body = wire.dumps(base)
        else:
            body = draw(HOSTILE)
            kind = "hostile-body"
        return _case(family, endpoint, identity, "/v1/renew", body, _headers(draw), kind)

    return strategy()


def renew_body(ident: Identity, skew_ms: int = 0) -> dict[str, Any]:
    """A valid RenewRequest by ``ident``: a fresh key's CSR and the proof of possession."""
    csr = pki.make_csr(pki.generate_key())
    now = int(time.time() * 1000) + skew_ms
    message = pki.renew_pop_message(csr, ident.node_id, now)
    req = wire.RenewRequest(csr, ident.chain, now, pki.sign_p1363(ident.key, message))
    return req.to_json()


def gw_session(
    world: World, mat: Material, endpoint: str = "gw", family: str = "gw-session"
) -> SearchStrategy[Case]:
    fields: dict[str, SearchStrategy[Any]] = {
        "node_id": mat.node_id_values(),
        "journal_id": S.sampled_from(["jrn_" + "a" * 26, "", "x" * 65]) | text(70),
        "boot_id": text(70),
        "daemon_version": text(70),
    }

    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        identity = _identity(draw, 70, ["site", "revoked", "sac", "sess"])
        ident = world.identities[identity or "node0"]
        branch = draw(S.integers(0, 99))
        base = wire.Hello(ident.node_id, "jrn_" + "a" * 26, "b" * 32, __version__).to_json()
        if branch < 65:
            obj, ops = mutate(draw, base, fields, max_ops=3)
            kind = f"mutated-valid/{ops}"
            body = encode_json(obj, draw(S.integers(0, 3)))
        elif branch < 80:
            body = encode_json(draw(S.dictionaries(S.sampled_from(KEYS), JSON, max_size=6)), 0)
            kind = "random-object"
        else:
            body = draw(HOSTILE)
            kind = "hostile-body"
        return _case(family, endpoint, identity, "/v1/session", body, _headers(draw), kind)

    return strategy()


def vouch_fields() -> dict[str, SearchStrategy[Any]]:
    return {
        "mac": S.sampled_from(MAC_POOL)
        | S.sampled_from(
            [
                "ff:ff:ff:ff:ff:ff",
                "01:00:5e:00:00:01",
                "02:00:00:00:00:01",
                "00:00:00:00:00:00",
                "0C-C4-7A-12-34-56",
                "0cc47a123456",
                "",
            ]
        )
        | text(20),
        "boot_lease_epoch": S.sampled_from([1, 0, -1, 2**53 - 1, 2**53, True, 1.5, "1", None])
        | S.integers(1, 2**40),
        "ip": S.sampled_from(
            ["10.0.0.1", "::1", "fe80::1%eth0", "999.1.1.1", "", None, "::ffff:10.0.0.1", "0.0.0.0"]  # noqa: S104
        )
        | text(50),
        "workflow_id": S.sampled_from(["wf-1", "a" * 128, "a" * 129, "", "a b", "é"]) | text(40),
        "client_time": S.sampled_from([0, -1, 2**63, "now", 1.5, None]) | S.integers(0, 2**45),
        "pop_sig": S.binary(max_size=100).map(pki.b64url) | text(130),
    }


def signed_vouch(fields: dict[str, Any], ident: Identity, skew_ms: int = 0) -> dict[str, Any]:
    now = int(time.time() * 1000) + skew_ms
    message = pki.vouch_pop_message(wire.dumps(fields), ident.node_id, now)
    sig = pki.sign_p1363(ident.key, message)
    return {**fields, "client_time": now, "pop_sig": pki.b64url(sig)}


def gw_vouch(
    world: World, mat: Material, endpoint: str = "gw", family: str = "gw-vouch"
) -> SearchStrategy[Case]:
    fields = vouch_fields()
    inner = {k: v for k, v in fields.items() if k not in ("client_time", "pop_sig")}

    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        roll = draw(S.integers(0, 99))
        identity: str | None = (
            draw(S.sampled_from(SITE_SLOTS))
            if roll < 60
            else draw(S.sampled_from([None, "site", "node0", "revoked", "sac"]))
        )
        ident = world.identities[identity or "site"]
        branch = draw(S.integers(0, 99))
        if branch < 50:  # the fields fuzzed, then signed for real: only the content is wrong
            chosen = draw(
                S.fixed_dictionaries(
                    {
                        "mac": S.sampled_from(MAC_POOL),
                        "boot_lease_epoch": S.integers(1, 2**40),
                    },
                    optional={
                        k: v for k, v in inner.items() if k not in ("mac", "boot_lease_epoch")
                    },
                )
            )
            obj, ops = mutate(draw, chosen, inner, max_ops=2)
            signed = signed_vouch(obj, ident, draw(S.sampled_from([0, 0, 0, 61_000, -59_000])))
            kind = f"signed-fields/{ops}"
            body = wire.dumps(signed)
        elif branch < 70:  # signed, then mutated: the proof no longer covers it
            base = signed_vouch(
                {"mac": draw(S.sampled_from(MAC_POOL)), "boot_lease_epoch": 7}, ident
            )
            obj, ops = mutate(draw, base, fields, max_ops=3)
            kind = f"mutated-signed/{ops}"
            body = encode_json(obj, draw(S.integers(0, 3)))
        elif branch < 85:
            body = encode_json(draw(S.dictionaries(S.sampled_from(KEYS), JSON, max_size=6)), 0)
            kind = "random-object"
        else:
            body = draw(HOSTILE)
            kind = "hostile-body"
        return _case(family, endpoint, identity, "/v1/discovery/vouch", body, _headers(draw), kind)

    return strategy()


# --- raw framing ---------------------------------------------------------------------

METHODS = [
    b"GET",
    b"POST",
    b"PUT",
    b"DELETE",
    b"HEAD",
    b"OPTIONS",
    b"PATCH",
    b"TRACE",
    b"CONNECT",
    b"PRI",
    b"get",
    b"Post",
    b"M" * 200,
]
BAD_METHODS = [b"GE T", b"G\x00T", b"", b"(", b"\xff\xfe", b"GET\t"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]
BAD_VERSIONS = [b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1 ", b"http/1.1", b"HTTP/1.12", b"HTTP/", b""]


def raw_target(draw: st.DrawFn, paths: list[str]) -> tuple[bytes, bool]:
    """A request target and whether it is a valid one."""
    base = draw(S.sampled_from(paths))
    kind = draw(S.integers(0, 14))
    valid = True
    if kind == 0:
        base += "?" + draw(S.text(alphabet="abc=&%;+/?0123", max_size=30))
    elif kind == 1:
        base = base.replace("/", "//", 1)
    elif kind == 2:
        base = base + "/"
    elif kind == 3:
        base = quote(base, safe="") if draw(S.booleans()) else base.replace("v1", "%76%31")
    elif kind == 4:
        base = "http://127.0.0.1" + base
    elif kind == 5:
        base = "*"
    elif kind == 6:
        base = base + "/" + "a" * draw(S.integers(100, 20_000))
    elif kind == 7:
        base = base.upper()
    elif kind == 8:
        base = base + "/../" + draw(S.sampled_from(paths)).lstrip("/")
    elif kind == 9:
        base = base + "#frag"
    elif kind == 10:
        return draw(S.sampled_from([b"/\xff\xfe", b"/a b", b"/\x00", b"", b"/\r"])), False
    elif kind == 11:
        base = base + "?" + "&".join(f"k{i}=v" for i in range(draw(S.integers(1, 2000))))
    return base.encode("latin-1", "replace"), valid


HEADER_POOL = [
    (b"Host", b"127.0.0.1"),
    (b"Host", b"evil.example"),
    (b"Content-Type", b"application/json"),
    (b"Connection", b"close"),
    (b"Connection", b"keep-alive"),
    (b"Connection", b"Upgrade, HTTP2-Settings"),
    (b"Upgrade", b"h2c"),
    (b"Upgrade", b"websocket"),
    (b"Expect", b"100-continue"),
    (b"Expect", b"200-ok"),
    (b"Authorization", b"Bearer bcak_x"),
    (b"Accept-Encoding", b"gzip, br"),
    (b"Range", b"bytes=0-10"),
    (b"If-None-Match", b"*"),
    (b"TE", b"trailers"),
    (b"Trailer", b"X-T"),
    (b"X-Forwarded-For", b"1.2.3.4"),
    (b"bc-relay-peer-cert", b"AAAA"),
    (b"bc-relay-remote", b"10.0.0.1:5"),
    (b"Cookie", b"a=" + b"b" * 4000),
]
BAD_HEADERS = [
    (b"Content-Length ", b"5"),
    (b" X-Lead", b"1"),
    (b"X-Fold", b"a\r\n b"),
    (b"X-Nul", b"a\x00b"),
    (b"X-Cr", b"a\rb"),
    (b"No-Colon", None),
    (b"", b"empty-name"),
    (b"X-\xff", b"v"),
    (b"X-Big", b"v" * 17_000),
]


@st.composite
def raw_framing(
    draw: st.DrawFn, family: str, endpoint: str, paths: list[str], identities: list[str | None]
) -> Case:
    identity = draw(S.sampled_from(identities))
    count = 1 if draw(S.integers(0, 9)) < 8 else draw(S.integers(2, 3))
    requests: list[bytes] = []
    methods: list[str] = []
    complete = True
    first_path = ""
    for index in range(count):
        part, method, ok, path = one_raw_request(draw, paths)
        complete = complete and ok  # a later incomplete one is waited for too
        if index == 0:
            first_path = path
        requests.append(part)
        methods.append(method)
    data = b"".join(requests)
    kind = "framed"
    if draw(S.integers(0, 4)) == 0:  # byte-level damage: no answer is owed any more
        complete = False
        kind = "mangled"
        for _ in range(draw(S.integers(1, 4))):
            op = draw(S.integers(0, 3))
            at = draw(S.integers(0, max(0, len(data) - 1)))
            if op == 0:
                data = data[:at]
            elif op == 1 and data:
                data = (
                    data[:at] + bytes([data[at] ^ (1 << draw(S.integers(0, 7)))]) + data[at + 1 :]
                )
            elif op == 2:
                data = data[:at] + draw(S.binary(min_size=1, max_size=8)) + data[at:]
            else:
                data = data[:at] + data[at + draw(S.integers(1, 8)) :]
    cuts = draw(S.lists(S.integers(0, max(1, len(data))), max_size=6))
    delays = draw(S.lists(S.sampled_from([0.0, 0.0, 0.001, 0.005, 0.02]), max_size=len(cuts) + 1))
    return Case(
        family,
        endpoint,
        identity,
        first_path,
        data,
        methods,
        cuts=cuts,
        delays=delays,
        complete=complete,
        fresh=True,
        kind=kind,
    )


def one_raw_request(draw: st.DrawFn, paths: list[str]) -> tuple[bytes, str, bool, str]:
    """(bytes, method, whether head and framing are complete, the path)."""
    ok = True
    if draw(S.integers(0, 14)) == 0:
        method = draw(S.sampled_from(BAD_METHODS))
    else:
        method = draw(S.sampled_from(METHODS))
    target, _valid = raw_target(draw, paths)
    version = (
        draw(S.sampled_from(VERSIONS))
        if draw(S.integers(0, 9))
        else draw(S.sampled_from(BAD_VERSIONS))
    )
    eol = b"\r\n" if draw(S.integers(0, 9)) else draw(S.sampled_from([b"\n", b"\r"]))
    if eol == b"\r":
        ok = False  # a bare CR never ends a line: the head never ends
    headers: list[tuple[bytes, bytes | None]] = []
    if draw(S.integers(0, 9)):
        headers.append((b"Host", b"127.0.0.1"))
    headers += draw(S.lists(S.sampled_from(HEADER_POOL), max_size=4))
    if draw(S.integers(0, 6)) == 0:
        headers += draw(S.lists(S.sampled_from(BAD_HEADERS), min_size=1, max_size=2))
    if draw(S.integers(0, 19)) == 0:
        headers += [(b"X-%d" % i, b"v") for i in range(draw(S.integers(50, 1500)))]
    body, framing, framing_ok = raw_body(draw)
    ok = ok and framing_ok
    head = method + b" " + target + b" " + version + eol
    for name, value in headers + framing:
        head += name + (b": " + value if value is not None else b"") + eol
    data = head + eol + body
    path = target.decode("latin-1").split("?")[0]
    return data, method.decode("latin-1", "replace").strip(), ok, path


def raw_body(draw: st.DrawFn) -> tuple[bytes, list[tuple[bytes, bytes | None]], bool]:
    """A body, its framing headers, and whether the framing is complete (an answer is
    owed: either the body is all there, or the head alone is refused)."""
    payload = draw(
        S.sampled_from([b"", b"{}", b'{"protocol":1}', b"x" * 100]) | S.binary(max_size=64)
    )
    kind = draw(S.integers(0, 13))
    if kind == 0:
        return b"", [], True
    if kind == 1:
        return payload, [(b"Content-Length", str(len(payload)).encode())], True
    if kind == 2:  # the rest is a second (garbage) request
        extra = draw(S.binary(min_size=1, max_size=30))
        return payload + extra, [(b"Content-Length", str(len(payload)).encode())], True
    if kind == 3:  # longer than what comes: waits for the rest
        return (
            payload,
            [(b"Content-Length", str(len(payload) + draw(S.integers(1, 10**6))).encode())],
            False,
        )
    if kind == 4:
        value = draw(
            S.sampled_from(
                [
                    b"-1",
                    b"abc",
                    b"1e3",
                    b"+5",
                    b" 5 ",
                    b"0x10",
                    b"99999999999999999999",
                    b"5, 5",
                    b"5, 6",
                    b"",
                    b"\xd9\xa1",
                ]
            )
        )
        if value in (b" 5 ", b"5, 5"):  # valid after all: a body of 5 bytes is owed
            return (payload + b"xxxxx")[:5], [(b"Content-Length", value)], True
        return payload, [(b"Content-Length", value)], True  # refused at the head
    if kind == 5:
        n = str(len(payload)).encode()
        other = str(len(payload) + draw(S.integers(0, 3))).encode()
        return payload, [(b"Content-Length", n), (b"Content-Length", other)], other == n
    if kind in (6, 7, 8):
        chunks = draw(S.lists(S.binary(min_size=1, max_size=40), max_size=5))
        out = b""
        for c in chunks:
            size = b"%x" % len(c)
            style = draw(S.integers(0, 5))
            if style == 1:
                size = size.upper()
            elif style == 2:
                size = b"000" + size
            elif style == 3:
                size += b";ext=1"
            out += size + b"\r\n" + c + b"\r\n"
        end = draw(S.integers(0, 4))
        if end == 0:
            out += b"0\r\nX-Trailer: 1\r\n\r\n"
        elif end == 1:
            return out, [(b"Transfer-Encoding", b"chunked")], False  # never ends
        else:
            out += b"0\r\n\r\n"
        return out, [(b"Transfer-Encoding", b"chunked")], True
    if kind == 9:  # broken chunk sizes
        size = draw(
            S.sampled_from([b"zz", b"-1", b"ffffffffffffffffff", b"1 2", b"", b"0x5", b"\xff"])
        )
        return size + b"\r\nabc\r\n0\r\n\r\n", [(b"Transfer-Encoding", b"chunked")], False
    if kind == 10:
        return b"0\r\n\r\n", [(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked")], True
    if kind == 11:
        te = draw(
            S.sampled_from(
                [
                    b"gzip, chunked",
                    b"chunked, chunked",
                    b"identity",
                    b"Chunked",
                    b" chunked",
                    b"chunked ",
                    b"gzip",
                    b"chunked;q=1",
                ]
            )
        )
        return b"0\r\n\r\n", [(b"Transfer-Encoding", te)], False
    if kind == 12:  # over the body limit
        n = draw(S.integers(MAX_BODY + 1, MAX_BODY * 20))
        return b"x" * min(n, 300_000), [(b"Content-Length", str(n).encode())], True
    return (
        payload,
        [(b"Content-Length", str(len(payload)).encode()), (b"Expect", b"100-continue")],
        True,
    )


# --- the tenant API -------------------------------------------------------------------

ID_RES = {
    "tenant": r"[a-z]{1,8}_[0-9a-z]{26}",
    "pool": r"pool_[0-9a-z]{26}",
    "node": r"node_[0-9a-z]{26}",
    "jreq": r"jreq_[0-9a-z]{26}",
    "token": r"jt_[0-9a-z]{26}",
}


def api_tenant(world: World) -> SearchStrategy[Case]:
    def ids(kind: str) -> SearchStrategy[str]:
        real: dict[str, Callable[[], list[str]]] = {
            "tenant": lambda: [world.root_tenant],
            "pool": lambda: [world.pools["sac"], world.pools["disc"], world.pools["tpm"]],
            "node": lambda: world.sacrificial_nodes or [world.identities["sac"].node_id],
            "show_node": lambda: world.all_node_ids or [world.identities["sac"].node_id],
            "jreq": lambda: world.jreq_ids or ["jreq_" + "0" * 26],
            "token": lambda: world.token_ids or ["jt_" + "0" * 26],
        }

        @st.composite
        def choose(draw: st.DrawFn) -> str:
            roll = draw(S.integers(0, 9))
            if roll < 6:
                return str(pick(draw, real[kind]()))
            if roll < 8:
                return draw(S.from_regex(ID_RES.get(kind, ID_RES["node"]), fullmatch=True))
            return quote(draw(text(40)), safe="%/", errors="surrogatepass") or "x"

        return choose()

    id_strategies = {k: ids(k) for k in ("tenant", "pool", "node", "show_node", "jreq", "token")}
    routes: list[tuple[str, str, list[str]]] = [
        ("POST", "/sites", []),
        ("POST", "/pools", []),
        ("POST", "/pools/{pool}/join-tokens", ["pool"]),
        ("GET", "/pools/{pool}/join-tokens", ["pool"]),
        ("POST", "/pools/{pool}/join-tokens/{token}/revoke", ["pool", "token"]),
        ("GET", "/pools/{pool}/join-requests", ["pool"]),
        ("POST", "/pools/{pool}/join-requests/{jreq}/approve", ["pool", "jreq"]),
        ("POST", "/pools/{pool}/join-requests/{jreq}/reject", ["pool", "jreq"]),
        ("GET", "/events", []),
        ("GET", "/nodes", []),
        ("GET", "/nodes/{show_node}", ["show_node"]),
        ("POST", "/nodes/{node}/revoke-identity", ["node"]),
        ("DELETE", "/nodes/{node}", ["node"]),
        ("POST", "/pools/{pool}/policy", ["pool"]),
    ]
    bodies: dict[str, SearchStrategy[dict[str, Any]]] = {
        "/sites": S.fixed_dictionaries({"name": text(80)}),
        "/pools": S.fixed_dictionaries(
            {
                "siteId": S.sampled_from([world.sites["sac"], "site_" + "0" * 26]) | text(),
                "name": text(),
                "agent": S.sampled_from(["bcd", "none", ""]) | text(),
            },
            optional={"policy": JSON},
        ),
        "/join-tokens": S.fixed_dictionaries(
            {"ttlSeconds": S.sampled_from([59, 60, 3600, 86_400, 86_401, 0, -1, 2**63]) | JSON},
            optional={
                "maxUses": S.sampled_from([1, 10_000, 10_001, 0, True]) | JSON,
                "allowReclaim": JSON,
                "hosted": S.sampled_from(["kubernetes", "k8s"]) | JSON,
                "idempotencyKey": text(130),
                "role": S.sampled_from(["node", "site", "ramdisk", "root"]) | JSON,
                "expect": S.fixed_dictionaries(
                    {},
                    optional={
                        "product_uuid": text(40),
                        "macs": S.lists(S.sampled_from(MAC_POOL) | text(), max_size=3),
                        "hostname": text(),
                        "product_serial": text(),
                    },
                )
                | JSON,
            },
        ),
        "/approve": S.fixed_dictionaries(
            {},
            optional={
                "ttlSeconds": JSON | S.sampled_from([60, 3600]),
                "reason": text(300),
                "csrSha256": S.sampled_from(["0" * 64, "g" * 64]) | text(70),
            },
        ),
        "/reject": S.fixed_dictionaries({}, optional={"reason": text(300)}),
        "/revoke-identity": S.fixed_dictionaries({}, optional={"reason": text(300)}),
        "/policy": S.fixed_dictionaries(
            {
                "policy": S.fixed_dictionaries(
                    {},
                    optional={
                        "joinAttestors": S.lists(
                            S.sampled_from(["join-token", "tpm", "x509pop", "discovery", ""])
                            | text(),
                            max_size=4,
                        )
                        | JSON,
                        "kubernetes": S.fixed_dictionaries({}, optional={"platformOperated": JSON}),
                        "x": JSON,
                    },
                )
                | JSON
            },
        ),
    }
    query_values = S.sampled_from(
        [
            "",
            "0",
            "1",
            "100",
            "1000",
            "1001",
            "-1",
            "true",
            "false",
            "١",
            " 5",
            "1e3",
            "9" * 20,
            "jreq_" + "0" * 26,
            "pending",
            "approved",
            "rejected",
            "security.join.refused",
            "A" * 200,
        ]
    ) | text(30)
    query_keys = S.sampled_from(
        ["pageSize", "pageToken", "includeInactive", "state", "type", "since", "limit", "x", ""]
    )

    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        world.refresh_ids()
        method, template, slots = draw(S.sampled_from(routes))
        path = template
        for slot in slots:
            path = path.replace("{" + slot + "}", draw(id_strategies[slot]))
        tenant = draw(id_strategies["tenant"]) if draw(S.integers(0, 9)) == 0 else world.root_tenant
        if draw(S.integers(0, 19)) == 0:
            tenant = world.other_tenant
        full = f"/api/compute/v1/tenants/{tenant}{path}"
        if draw(S.integers(0, 14)) == 0:
            method = draw(
                S.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
            )
        query = draw(S.lists(S.tuples(query_keys, query_values), max_size=4))
        if query:
            full += "?" + "&".join(
                f"{quote(k, errors='surrogatepass')}={quote(v, safe='', errors='surrogatepass')}"
                for k, v in query
            )
        roll = draw(S.integers(0, 99))
        auth = f"Bearer {world.credential}"
        if roll < 4:
            auth = ""
        elif roll < 8:
            auth = "Bearer " + draw(
                S.sampled_from(["", "bcak_x", "bcak_" + "0" * 60, " " * 5])
                | S.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789.", max_size=80)
            )
        elif roll < 10:
            auth = f"Bearer {world.other_credential}"
        elif roll < 11:
            auth = f"bearer {world.credential}"
        key = next((k for k in bodies if template.endswith(k)), None)
        branch = draw(S.integers(0, 99))
        if method in ("GET", "DELETE", "HEAD") and branch < 80:
            body = b""
        elif key is not None and branch < 70:
            obj, _ops = mutate(draw, draw(bodies[key]), {}, max_ops=2)
            body = encode_json(obj, draw(S.integers(0, 3)))
        elif branch < 85:
            body = encode_json(draw(JSON), 0)
        else:
            body = draw(HOSTILE)
        headers = [("authorization", auth)] if auth else []
        headers.append(("content-type", "application/json"))
        kind = f"{method} {template}"
        data = _request(method, full, headers, body)
        return Case(
            "api-tenant", "api", None, full, data, [method], kind=kind, fresh=len(body) > MAX_BODY
        )

    return strategy()


# --- well-known, downloads, health -------------------------------------------------------

STATIC_PATHS = [
    "/api/compute/.well-known/better-compute",
    "/api/compute/downloads/bcd/0.1.0/linux-amd64",
    "/api/compute/downloads/bcd/0.1.1/linux-arm64",  # a symlink to /etc/passwd
    "/api/compute/downloads/bcd/0.2.0/linux-amd64",  # a directory
    "/api/compute/downloads/bcd/9.9.9/linux-amd64",
    "/api/compute/downloads/bcd/0.1.0-rc.1/linux-arm64",
    "/api/compute/downloads/",
    "/api/compute/downloads/bcd/0.1.0/../0.1.0/linux-amd64",
    "/api/compute/downloads/bcd/0.1.0/linux-amd64/",
    "/api/compute/downloads/bcd/..%2f..%2fetc/linux-amd64",
    "/api/compute/",
    "/api/compute",
    "/api/",
    "/",
]


def api_static() -> SearchStrategy[Case]:
    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        path = draw(S.sampled_from(STATIC_PATHS))
        kind = draw(S.integers(0, 9))
        if kind == 0:
            path += "?" + draw(S.text(alphabet="abc=&%0123", max_size=20))
        elif kind == 1:
            path = path.replace(
                "0.1.0",
                draw(
                    S.from_regex(
                        r"[0-9]{1,7}\.[0-9]{1,7}\.[0-9]{1,7}(-[a-z0-9.]{1,30})?", fullmatch=True
                    )
                ),
            )
        elif kind == 2:
            path = path.replace(
                "amd64", draw(S.sampled_from(["arm64", "x86", "AMD64", "amd64%00", ""]))
            )
        elif kind == 3:
            path = "/api/compute/downloads/" + quote(draw(S.text(max_size=60)), safe="/%")
        elif kind == 4:
            path = path.replace(
                ".well-known",
                draw(S.sampled_from([".WELL-KNOWN", "%2ewell-known", ".well-known/"])),
            )
        method = draw(S.sampled_from(["GET"] * 6 + ["HEAD", "POST", "DELETE", "OPTIONS", "PUT"]))
        headers = draw(
            S.lists(
                S.sampled_from(
                    [
                        ("range", "bytes=0-1"),
                        ("if-modified-since", "Sat, 1 Jan 2000 00:00:00 GMT"),
                        ("accept", "*/*"),
                        ("accept-encoding", "gzip"),
                        ("authorization", "Bearer x"),
                    ]
                ),
                max_size=3,
            )
        )
        body = b"" if method in ("GET", "HEAD") or draw(S.booleans()) else draw(HOSTILE)
        data = _request(method, path, headers, body)
        return Case(
            "api-static",
            "api",
            None,
            path,
            data,
            [method],
            kind=f"{method}",
            fresh=len(body) > MAX_BODY,
        )

    return strategy()


HEALTH_PATHS = ["/healthz", "/readyz"]


def health(endpoints: list[tuple[str, list[str | None]]]) -> SearchStrategy[Case]:
    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        endpoint, identities = draw(S.sampled_from(endpoints))
        identity = draw(S.sampled_from(identities))
        path = draw(S.sampled_from(HEALTH_PATHS))
        kind = draw(S.integers(0, 9))
        if kind == 0:
            path += "?" + draw(S.text(alphabet="abc=&%0123", max_size=20))
        elif kind == 1:
            path = draw(
                S.sampled_from(["/healthz/", "/HEALTHZ", "//readyz", "/readyz%00", "/readyz/.."])
            )
        method = draw(S.sampled_from(["GET"] * 8 + ["HEAD", "POST", "DELETE", "OPTIONS"]))
        body = b"" if method == "GET" and draw(S.integers(0, 4)) else draw(HOSTILE)
        headers = [("x-probe", "1")] if draw(S.booleans()) else []
        data = _request(method, path, headers, body)
        return Case(
            "health",
            endpoint,
            identity,
            path,
            data,
            [method],
            kind=f"{endpoint} {method}",
            fresh=len(body) > MAX_BODY,
        )

    return strategy()


# --- the relay listener (a fleet) --------------------------------------------------------


def relay(world: World, mat: Material) -> SearchStrategy[Case]:
    """What a gateway (or a thief of its relay credential) sends an API replica."""
    join = gw_join(world, mat, endpoint="relay", family="relay")
    renew = gw_renew(world, mat, endpoint="relay", family="relay")
    vouch = gw_vouch(world, mat, endpoint="relay", family="relay")
    peer_values = S.one_of(
        S.sampled_from(mat.leaf_ders).map(b64),
        S.binary(max_size=600).map(b64),
        S.integers(8000, 9000).map(lambda n: "A" * n),
        text(60),
        S.just(""),
    )
    remote_values = S.sampled_from(
        ["127.0.0.1:5", "[::1]:80", "unknown", "10.0.0.1", "a" * 65, "1.2.3.4:5\x00", "é:1", ""]
    ) | text(70)

    @st.composite
    def strategy(draw: st.DrawFn) -> Case:
        inner = draw(S.sampled_from([join, renew, vouch]))
        case = draw(inner)
        identity = draw(S.sampled_from(["relay"] * 8 + [None, "node0"]))
        head, _, body = case.data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        if draw(S.integers(0, 3)):
            lines.append(b"bc-relay-peer-cert: " + draw(peer_values).encode("latin-1", "replace"))
        if draw(S.integers(0, 3)):
            lines.append(
                b"bc-relay-remote: " + draw(remote_values).encode("utf-8", "surrogatepass")
            )
        if draw(S.integers(0, 9)) == 0:
            method = draw(S.sampled_from([b"GET", b"PUT", b"DELETE"]))
            lines[0] = method + b" " + lines[0].split(b" ", 1)[1]
        if draw(S.integers(0, 9)) == 0:
            lines[0] = lines[0].replace(
                case.path.encode(),
                draw(
                    S.sampled_from(
                        [
                            b"/v1/session",
                            b"/healthz",
                            b"/readyz",
                            b"/api/compute/.well-known/better-compute",
                            b"/v1/joinx",
                        ]
                    )
                ),
            )
        data = b"\r\n".join(lines) + b"\r\n\r\n" + body
        method = lines[0].split(b" ", 1)[0].decode()
        return Case(
            "relay", "relay", identity, case.path, data, [method], kind=case.kind, fresh=case.fresh
        )

    return strategy()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]

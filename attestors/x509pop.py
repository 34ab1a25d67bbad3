"""The x509pop attestor: a node re-joins with the certificate it already holds.

A certificate that expired while the machine was offline cannot be renewed (renewal
needs an unexpired leaf). With x509pop configured on the control plane, the machine
proves possession of that certificate's key instead and re-joins as the same node,
within 7 days of the expiry. Unlike the seed's Go agent, bcd produces this evidence
(``bcd join --attestor x509pop``, as root).

Node half (the machine's existing identity, lent by ``bcd join`` through
``ctx.identity_chain_der`` and ``ctx.identity_signer``; the new key and CSR are made
as for any join):

- evidence: ``chain``, the existing identity's certificate chain, leaf first, a list
  of base64 DER certificates;
- answer to the challenge: ``id`` (the challenge's), ``nonce`` (its 32 bytes, base64)
  and ``signature``: base64 of the P1363 ECDSA P-256/SHA-256 signature (r || s, 64
  bytes) by the OLD key over :func:`pop_message`, ``b"bcd-x509pop-v1\\0" || nonce ||
  sha256(csr)``. The proof binds the new CSR, so it cannot be moved to another one.

Server half, inside the join transaction. Settings: ``x509pop.ca`` (a PEM bundle;
``better-compute serve --x509pop-ca FILE``; unset means not configured) and
``x509pop.max_expired_s`` (how long after its expiry a leaf may still re-join;
default and maximum 604800, 7 days). Both rounds check, in order:

1. the evidence parses (``evidence-malformed``) and the requested role is the leaf's
   (``role``; a ``node-tenant`` leaf is asked for as ``node``, as bcd does);
2. the leaf verifies up to a certificate of the bundle, with the presented chain as
   intermediates, ignoring only the leaf's expiry: it is verified at the earlier of
   ``compute_now()`` and its own last valid second, and every CA of the built chain
   must still be valid now (``chain``);
3. the leaf expired no more than ``max_expired_s`` ago at ``compute_now()``
   (``expired-too-long``) and has expired (``not-expired``: a live certificate
   renews, under the renewal limits); it is not a ``ramdisk`` certificate (``role``);
4. it is byte for byte a node_certs row (``leaf-unknown``), unrevoked
   (``leaf-revoked``), of its node's current identity generation (``generation``),
   the node's newest certificate (``superseded``: the key of a certificate a renewal
   replaced proves nothing any more), whose node is not retired (``node-retired``), and it carries no ``urn:bc:``
   statement (``statement``: a TPM-AK-bound node re-joins with ``--attestor tpm``,
   never downgraded to a bare key).

Round 0 then answers a challenge: 32 fresh random bytes, valid 60 s. Its state lives
only in ``join_challenges``, in the tpm-shaped columns: ``secret_sha256`` = SHA-256
of the nonce, ``ak_name`` = the leaf's serial (hex), ``ek_sha256`` = SHA-256 of the
leaf's DER, ``csr_sha256`` = the CSR's. Round 1 checks the answer: a challenge of
this attestor for this very leaf (``challenge-unknown``), for this CSR
(``challenge-csr``), unused (``challenge-used``), unexpired (``challenge-expired``),
the nonce's hash matches (constant time) and the signature verifies under the
leaf's key (``pop-invalid``); the challenge is consumed, and the verdict is an
:class:`~bcd.attestor_api.Admit` re-joining THAT node (``node_id``): JoinService keeps
its id, raises its identity generation, revokes its older certificates
(``rejoined``) and keeps the role and allowed kinds of the presented certificate
and the node's pool. JoinService's pool rules still apply (a pool whose
``policy.joinAttestors`` does not list ``x509pop`` refuses ``pool-attestor``).

Refusals before the proof verified go to the root tenant; the checks of step 4 at
round 1 run after it and go to the node's tenant.

Refusal reasons: ``not-configured``, ``evidence-malformed``, ``role``, ``chain``,
``expired-too-long``, ``not-expired``, ``leaf-unknown``, ``leaf-revoked``,
``generation``, ``superseded``,
``node-retired``, ``statement``, ``challenge-unknown``, ``challenge-csr``,
``challenge-used``, ``challenge-expired``, ``pop-invalid``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from bcd import pki, wire
from bcd.attestor_api import (
    Admit,
    Challenge,
    NodeCertRecord,
    NodeEvidence,
    NodeJoinContext,
    Refuse,
    ServerJoinContext,
    Verdict,
    hookimpl,
)
from bcd.errors import BcdError

log = logging.getLogger("attestors.x509pop")

X509POP = "x509pop"
SETTING_CA = "x509pop.ca"
SETTING_MAX_EXPIRED = "x509pop.max_expired_s"
MAX_EXPIRED_DEFAULT_S = 604_800  # 7 days, the seed's window
CHALLENGE_TTL_MS = 60_000
NONCE_SIZE = 32
SIGNATURE_SIZE = 64
POP_DOMAIN = b"bcd-x509pop-v1\0"
MAX_CHAIN = 4
MAX_CERT_BYTES = 8192
MAX_ID = 64


class Malformed(ValueError):
    """Evidence, a challenge or an answer that does not parse; ``str()`` names the field."""


# --- pure parsers and the signed message -------------------------------------------


def pop_message(nonce: bytes, csr_der: bytes) -> bytes:
    """What the old key signs: ``b"bcd-x509pop-v1\\0" || nonce || sha256(csr)``."""
    return POP_DOMAIN + nonce + hashlib.sha256(csr_der).digest()


def _b64_decode(value: object, name: str, limit: int) -> bytes:
    if not isinstance(value, str) or not value or len(value) > (limit * 4) // 3 + 4:
        raise Malformed(name)
    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise Malformed(name) from exc
    if not data or len(data) > limit:
        raise Malformed(name)
    return data


def _id(obj: dict[str, Any]) -> str:
    value = obj.get("id")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID or not value.isascii():
        raise Malformed("id")
    return value


def encode_evidence(chain_der: Sequence[bytes]) -> dict[str, Any]:
    return {"chain": [base64.b64encode(der).decode("ascii") for der in chain_der]}


def parse_evidence(evidence: object) -> tuple[bytes, ...]:
    """The chain's DER certificates, leaf first (1 to 4, each at most 8 KiB)."""
    if not isinstance(evidence, dict):
        raise Malformed("evidence")
    chain = evidence.get("chain")
    if not isinstance(chain, list) or not 0 < len(chain) <= MAX_CHAIN:
        raise Malformed("chain")
    return tuple(_b64_decode(item, "chain", MAX_CERT_BYTES) for item in chain)


def encode_challenge(challenge_id: str, nonce: bytes) -> dict[str, Any]:
    return {"id": challenge_id, "nonce": base64.b64encode(nonce).decode("ascii")}


def parse_challenge(challenge: object) -> tuple[str, bytes]:
    """The challenge's id and its 32-byte nonce."""
    if not isinstance(challenge, dict):
        raise Malformed("challenge")
    nonce = _b64_decode(challenge.get("nonce"), "nonce", NONCE_SIZE)
    if len(nonce) != NONCE_SIZE:
        raise Malformed("nonce")
    return _id(challenge), nonce


def encode_answer(challenge_id: str, nonce: bytes, signature: bytes) -> dict[str, Any]:
    return {
        "id": challenge_id,
        "nonce": base64.b64encode(nonce).decode("ascii"),
        "signature": base64.b64encode(signature).decode("ascii"),
    }


def parse_answer(answer: object) -> tuple[str, bytes, bytes]:
    """The answer's challenge id, nonce (32 bytes) and P1363 signature (64 bytes)."""
    if not isinstance(answer, dict):
        raise Malformed("answer")
    challenge_id, nonce = parse_challenge(answer)
    signature = _b64_decode(answer.get("signature"), "signature", SIGNATURE_SIZE)
    if len(signature) != SIGNATURE_SIZE:
        raise Malformed("signature")
    return challenge_id, nonce, signature


def max_expired_s(settings: Mapping[str, str]) -> int:
    """``x509pop.max_expired_s``: 1 to 604800 seconds, default 604800; ValueError else."""
    raw = settings.get(SETTING_MAX_EXPIRED)
    if raw is None or raw == "":
        return MAX_EXPIRED_DEFAULT_S
    text = str(raw).strip()
    if not text.isdigit() or not 0 < int(text) <= MAX_EXPIRED_DEFAULT_S:
        raise ValueError(
            f"{SETTING_MAX_EXPIRED} must be a whole number of seconds from 1 to "
            f"{MAX_EXPIRED_DEFAULT_S}"
        )
    return int(text)


def load_bundle(path: str) -> list[x509.Certificate]:
    """The CA bundle's certificates; ValueError (or OSError) when it is unusable."""
    certs = x509.load_pem_x509_certificates(Path(path).read_bytes())
    if not certs:  # pragma: no cover - cryptography refuses a file without one
        raise ValueError("no certificate")
    return certs


def check_settings(settings: Mapping[str, str]) -> None:
    """Start-up check of the server half's settings; raises ValueError with the flag."""
    ca = settings.get(SETTING_CA)
    if ca:
        try:
            load_bundle(ca)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--x509pop-ca {ca}: not a readable PEM certificate bundle") from exc
    max_expired_s(settings)


# --- node half -----------------------------------------------------------------------


@hookimpl
def bcd_attestor_names() -> list[str]:
    return [X509POP]


@hookimpl
def bcd_server_check_settings(attestor: str, settings: Mapping[str, str]) -> list[str] | None:
    if attestor != X509POP:
        return None
    try:
        check_settings(settings)
    except ValueError as exc:
        return [str(exc)]
    return []


@hookimpl
def bcd_node_evidence(attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
    if attestor != X509POP:
        return None
    if not ctx.identity_chain_der or ctx.identity_signer is None:
        raise BcdError(
            "the x509pop attestor re-joins this machine's existing identity, and bcd join "
            "lent it none"
        )
    return NodeEvidence(sealed_token=None, evidence=encode_evidence(ctx.identity_chain_der))


@hookimpl
def bcd_node_answer(
    attestor: str, challenge: dict[str, Any], ctx: NodeJoinContext
) -> dict[str, Any] | None:
    if attestor != X509POP:
        return None
    try:
        challenge_id, nonce = parse_challenge(challenge)
    except Malformed as exc:
        raise BcdError(f"the x509pop challenge is malformed ({exc})") from exc
    if ctx.identity_signer is None:
        raise BcdError("the x509pop attestor needs the existing identity's key to answer")
    digest = hashlib.sha256(pop_message(nonce, ctx.csr_der)).digest()
    signature = ctx.identity_signer(digest)
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
        raise BcdError("the existing identity's key made no P-256 signature")
    return encode_answer(challenge_id, nonce, signature)


# --- server half ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Leaf:
    der: bytes
    cert: x509.Certificate
    key: ec.EllipticCurvePublicKey
    info: pki.LeafInfo


def _parse_chain(evidence: object) -> tuple[_Leaf, list[x509.Certificate]]:
    chain_der = parse_evidence(evidence)
    try:
        certs = [x509.load_der_x509_certificate(der) for der in chain_der]
        info = pki.leaf_info(certs[0])
    except (ValueError, x509.InvalidVersion) as exc:  # PkiError is a ValueError
        raise Malformed("chain") from exc
    key = certs[0].public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):  # pragma: no cover - leaf_info checks
        raise Malformed("chain")
    return _Leaf(chain_der[0], certs[0], key, info), certs[1:]


def chain_verifies(
    leaf: x509.Certificate,
    intermediates: list[x509.Certificate],
    anchors: list[x509.Certificate],
    now: datetime,
) -> bool:
    """Whether ``leaf`` chains to ``anchors`` ignoring only its own expiry.

    cryptography's verifier (Web PKI client profile: signatures, names, CA
    constraints, key usages, clientAuth) at the earlier of ``now`` and the leaf's
    last valid second; then every CA of the chain it built must be valid ``now``.
    """
    at = min(now, leaf.not_valid_after_utc - timedelta(seconds=1))
    verifier = PolicyBuilder().store(Store(anchors)).time(at).build_client_verifier()
    try:
        built = verifier.verify(leaf, intermediates)
    except (VerificationError, ValueError):
        return False
    return all(ca.not_valid_before_utc <= now <= ca.not_valid_after_utc for ca in built.chain[1:])


def _judge_leaf(
    leaf: _Leaf, record: NodeCertRecord | None, now_ms: int, window_s: int
) -> str | None:
    """Steps 3 and 4: None when the leaf may re-join, else the refusal reason."""
    not_after_ms = int(leaf.info.not_after.timestamp() * 1000)
    if now_ms - not_after_ms > window_s * 1000:
        return "expired-too-long"
    if now_ms <= not_after_ms:
        return "not-expired"  # a live certificate renews (rate-limited), never re-joins
    if leaf.info.role == "ramdisk":
        return "role"  # a ramdisk identity lives at most 2 h, never 7 days more
    if record is None:
        return "leaf-unknown"
    if record.revoked:
        return "leaf-revoked"
    if record.identity_generation != record.node_generation:
        return "generation"
    if not record.newest:
        return "superseded"  # a key a renewal replaced is worth nothing more
    if record.node_retired:
        return "node-retired"
    if record.statements or leaf.info.statements:
        return "statement"
    return None


def _role_matches(requested: str, leaf_role: str) -> bool:
    return requested == leaf_role or (requested == "node" and leaf_role == "node-tenant")


@hookimpl
def bcd_server_verify(
    attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
) -> Verdict | None:
    if attestor != X509POP:
        return None
    ca_path = ctx.settings.get(SETTING_CA)
    if not ca_path:
        return Refuse("not-configured")
    try:
        window_s = max_expired_s(ctx.settings)
        anchors = load_bundle(ca_path)
    except (OSError, ValueError):
        log.error("x509pop is misconfigured (%s or %s)", SETTING_CA, SETTING_MAX_EXPIRED)
        return Refuse("not-configured")
    try:
        leaf, intermediates = _parse_chain(request.evidence)
    except Malformed:
        return Refuse("evidence-malformed")
    if not _role_matches(request.role, leaf.info.role):
        return Refuse("role")
    now = datetime.fromtimestamp(ctx.now_ms / 1000, UTC)
    if not chain_verifies(leaf.cert, intermediates, anchors, now):
        return Refuse("chain")
    csr_sha256 = pki.sha256_hex(request.csr_der)
    leaf_sha256 = hashlib.sha256(leaf.der).hexdigest()
    if request.round == 0:
        if request.answer is not None:
            return Refuse("evidence-malformed")
        reason = _judge_leaf(leaf, ctx.lookup_node_cert(leaf.der), ctx.now_ms, window_s)
        if reason is not None:
            return Refuse(reason)
        nonce = secrets.token_bytes(NONCE_SIZE)
        not_after = ctx.now_ms + CHALLENGE_TTL_MS
        challenge_id = ctx.save_challenge(
            secret_sha256=hashlib.sha256(nonce).hexdigest(),
            ak_name=leaf.info.serial_hex,
            ek_sha256=leaf_sha256,
            csr_sha256=csr_sha256,
            not_after_ms=not_after,
        )
        return Challenge(
            round=1, challenge=encode_challenge(challenge_id, nonce), not_after_ms=not_after
        )
    try:
        challenge_id, nonce, signature = parse_answer(request.answer)
    except Malformed:
        return Refuse("evidence-malformed")
    challenge = ctx.lock_challenge(challenge_id)
    if (
        challenge is None
        or not hmac.compare_digest(challenge.ek_sha256, leaf_sha256)
        or not hmac.compare_digest(challenge.ak_name, leaf.info.serial_hex)
    ):
        return Refuse("challenge-unknown")
    if not hmac.compare_digest(challenge.csr_sha256, csr_sha256):
        return Refuse("challenge-csr")
    if challenge.used:
        return Refuse("challenge-used")
    if challenge.not_after_ms <= ctx.now_ms:
        return Refuse("challenge-expired")
    if not hmac.compare_digest(hashlib.sha256(nonce).hexdigest(), challenge.secret_sha256):
        return Refuse("pop-invalid")
    try:
        pki.verify_p1363(leaf.key, signature, pop_message(nonce, request.csr_der))
    except pki.PkiError:
        return Refuse("pop-invalid")
    ctx.consume_challenge(challenge_id)
    # The caller proved the key: from here the node's tenant hears of a refusal.
    record = ctx.lookup_node_cert(leaf.der)
    reason = _judge_leaf(leaf, record, ctx.now_ms, window_s)
    if reason is not None or record is None:
        return Refuse(reason or "leaf-unknown", record.tenant_id if record else None)
    return Admit(
        tenant_id=record.tenant_id,
        pool_id=record.pool_id,
        site_id=record.site_id,
        role=record.role,
        allowed_kinds=record.allowed_kinds,
        node_id=record.node_id,
    )

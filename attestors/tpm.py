"""The tpm attestor: a machine joins with no token, proving it holds its TPM.

Node half (``bcd join --attestor tpm``, as root, the TPM at ``[tpm] tcti``):

- evidence: ``ek_kind``, ``ek_certificate`` (base64 DER, from the TCG NV index of
  that kind), ``ek_public``, ``ak_public`` (base64 TPMT_PUBLIC) and ``ak_name``
  (base64 nameAlg || digest). The node key is made in the same TPM by ``bcd join``
  (:mod:`bcd.tpm.nodekey`); ``ctx.node_key_record`` is its record;
- answer to a challenge: ``id`` (the challenge's), ``secret`` (TPM2_ActivateCredential
  of the server's credential with the EK and bcd's AK), ``certify_attest`` and
  ``certify_sig`` (the AK's TPM2_Certify of the node key over sha256(csr)), base64.

Server half, inside the join transaction. Round 0: the EK is trusted when its
SHA-256 is on the allow-list (``tpm.ek_allow``) or its certificate chains to the
manufacturer CA bundle (``tpm.ek_ca``) and names the EK; then the answer is a
challenge: MakeCredential(EK, AK name, 32 fresh random bytes), valid 60 s, whose
state (the secret's hash, the AK name, the EK hash, the CSR hash) lives only in
``join_challenges``. Round 1: the challenge is this machine's, for this CSR,
unused and not expired, the secret matches (constant time) and is consumed, and
the AK certifies the CSR's key over sha256(csr). Then it admits into the pool
``tpm.pool`` with the statement ``urn:bc:tpm-ak:sha256:<AK name digest>``, node key
``tpm``, and the EK's hash as the trusted hardware key (a machine joining again
with the same EK and AK reclaims its node).

With enrollment (``tpm.enrollment=true``), an EK that is on no allow-list and does
not chain is not refused: the answer is a :class:`~bcd.attestor_api.Defer`, a join request
keyed by the EK hash that a person approves or rejects. Once approved (for the CSR
the request recorded), the retry gets the same challenge round, and its admission
spends the approval (``join_request_id``) in the join transaction.

Refusal reasons: ``not-configured``, ``evidence-malformed``, ``ek-unknown``,
``ek-chain``, ``pool-unknown``, ``role``, ``activation``, ``challenge-csr``,
``challenge-used``, ``challenge-expired``, ``certify``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.x509.verification import (
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from bcd import pki, wire
from bcd.attestor_api import (
    Admit,
    Challenge,
    Defer,
    NodeEvidence,
    NodeJoinContext,
    Refuse,
    ServerJoinContext,
    Verdict,
    hookimpl,
)
from bcd.errors import BcdError
from bcd.tpm import TpmError
from bcd.tpm.attestation import ak_statement
from bcd.tpm.structures import name_of
from bcd.tpm.templates import check_ak_public, check_ek_public, node_key_public_area
from bcd.tpm.verify import check_ek_certificate, verify_certify

TPM = "tpm"
CHALLENGE_TTL_MS = 60_000
SECRET_SIZE = 32
SETTING_EK_CA = "tpm.ek_ca"
SETTING_EK_ALLOW = "tpm.ek_allow"
SETTING_POOL = "tpm.pool"
SETTING_ENROLLMENT = "tpm.enrollment"
PENDING_RETRY_S = 5
ROLES = ("node",)
_MAX_FIELD = 8192


class _Malformed(ValueError):
    """Evidence or an answer that does not parse."""


def _b64(obj: dict[str, Any], name: str, limit: int = _MAX_FIELD) -> bytes:
    try:
        return wire.b64_field(obj, name, limit)
    except wire.WireError as exc:
        raise _Malformed(name) from exc


def _enc(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@hookimpl
def bcd_attestor_names() -> list[str]:
    return [TPM]


@hookimpl
def bcd_server_check_settings(attestor: str, settings: Mapping[str, str]) -> list[str] | None:
    """At serve's start, not at the first join: the EK CA bundle and allow-list must be
    readable, and either needs a pool."""
    if attestor != TPM:
        return None
    ca = settings.get(SETTING_EK_CA)
    if ca:
        try:
            certs = x509.load_pem_x509_certificates(Path(ca).read_bytes())
        except (OSError, ValueError):
            return [f"--tpm-ek-ca {ca}: not a readable PEM certificate bundle"]
        if not certs:  # pragma: no cover - load_pem_x509_certificates refuses an empty file
            return [f"--tpm-ek-ca {ca}: no certificate"]
    allow = settings.get(SETTING_EK_ALLOW)
    if allow:
        try:
            Path(allow).read_text(encoding="utf-8")
        except (OSError, ValueError):
            return [f"--tpm-ek-allow {allow}: not readable"]
    if (ca or allow) and not settings.get(SETTING_POOL):
        return ["the tpm attestor needs --tpm-pool POOL"]
    return []


# --- node half ---------------------------------------------------------------------


def _record(ctx: NodeJoinContext) -> Any:
    from bcd.tpm.record import NodeKeyRecord

    if ctx.node_key_record is None:
        raise BcdError("the tpm attestor needs the node key in the TPM")
    return NodeKeyRecord.from_dict(dict(ctx.node_key_record))


@hookimpl
def bcd_node_evidence(attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
    if attestor != TPM:
        return None
    from bcd.tpm.ak import ak_public
    from bcd.tpm.device import open_tpm
    from bcd.tpm.ek import ek_kind, ek_public, read_ek_certificate

    _record(ctx)
    with open_tpm(ctx.tcti) as tpm:
        kind = ek_kind(tpm)
        certificate = read_ek_certificate(tpm, kind)
        ek = ek_public(tpm, kind)
        ak, name = ak_public(tpm)
    return NodeEvidence(
        sealed_token=None,
        evidence={
            "ek_kind": kind,
            "ek_certificate": _enc(certificate),
            "ek_public": _enc(ek),
            "ak_public": _enc(ak),
            "ak_name": _enc(name),
        },
    )


@hookimpl
def bcd_node_answer(
    attestor: str, challenge: dict[str, Any], ctx: NodeJoinContext
) -> dict[str, Any] | None:
    if attestor != TPM:
        return None
    from bcd.tpm.ak import certify
    from bcd.tpm.credential import activate_credential
    from bcd.tpm.device import open_tpm
    from bcd.tpm.ek import ek_kind

    record = _record(ctx)
    try:
        challenge_id = challenge.get("id")
        if not isinstance(challenge_id, str) or len(challenge_id) > 64:
            raise _Malformed("id")
        blob = _b64(challenge, "credential_blob")
        encrypted = _b64(challenge, "encrypted_secret")
    except _Malformed as exc:
        raise BcdError(f"the tpm challenge is malformed ({exc})") from exc
    with open_tpm(ctx.tcti) as tpm:
        secret = activate_credential(tpm, blob, encrypted, ek_kind(tpm))
        attest, signature = certify(tpm, record, hashlib.sha256(ctx.csr_der).digest())
    return {
        "id": challenge_id,
        "secret": _enc(secret),
        "certify_attest": _enc(attest),
        "certify_sig": _enc(signature),
    }


# --- server half -------------------------------------------------------------------


def _allow_list(path: str) -> frozenset[str]:
    """One lowercase hex SHA-256 of an EK public area (TPMT_PUBLIC) a line; ``#`` comments."""
    entries = set()
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        entry = line.split("#", 1)[0].strip().lower()
        if entry:
            entries.add(entry)
    return frozenset(entries)


def chains_to_bundle(certificate: x509.Certificate, bundle_path: str, now: datetime) -> bool:
    """Whether the EK certificate chains to a certificate of the manufacturer CA bundle.

    cryptography's X.509 verifier with the whole bundle as its trust store. EK
    certificates have no TLS profile (an EKU of tcg-kp-EKCertificate, a critical SAN
    holding a directoryName, an empty subject), so the leaf gets a permit-all
    extension policy; the CAs keep the Web PKI CA defaults, and signatures and
    validity dates (at the database's time) are checked as usual. A legitimate
    swtpm EK certificate passes this verifier as is, so no hand-made chain walk.
    """
    anchors = x509.load_pem_x509_certificates(Path(bundle_path).read_bytes())
    verifier = (
        PolicyBuilder()
        .store(Store(anchors))
        .time(now)
        .extension_policies(
            ca_policy=ExtensionPolicy.webpki_defaults_ca(),
            ee_policy=ExtensionPolicy.permit_all(),
        )
        .build_client_verifier()
    )
    try:
        verifier.verify(certificate, [])
    except VerificationError:
        return False
    return True


def _ek_trusted(
    ctx: ServerJoinContext, ek_public: bytes, certificate_der: bytes, ek_hash: str
) -> str | None:
    """None when the EK is trusted, else the refusal reason."""
    allow_path = ctx.settings.get(SETTING_EK_ALLOW)
    ca_path = ctx.settings.get(SETTING_EK_CA)
    if allow_path and ek_hash in _allow_list(allow_path):
        return None
    if not ca_path:
        return "ek-unknown"
    try:
        certificate = check_ek_certificate(ek_public, certificate_der)
    except TpmError:
        return "ek-chain"
    now = datetime.fromtimestamp(ctx.now_ms / 1000, UTC)
    return None if chains_to_bundle(certificate, ca_path, now) else "ek-chain"


@hookimpl
def bcd_server_verify(
    attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
) -> Verdict | None:
    if attestor != TPM:
        return None
    pool_id = ctx.settings.get(SETTING_POOL)
    enrollment = ctx.settings.get(SETTING_ENROLLMENT, "").strip().lower() in ("true", "1", "yes")
    trust_configured = ctx.settings.get(SETTING_EK_CA) or ctx.settings.get(SETTING_EK_ALLOW)
    if not pool_id or not (trust_configured or enrollment):
        return Refuse("not-configured")
    try:
        evidence = request.evidence
        ek_public = _b64(evidence, "ek_public")
        ek_certificate = _b64(evidence, "ek_certificate")
        ak_public = _b64(evidence, "ak_public")
        ak_name = _b64(evidence, "ak_name")
        check_ek_public(ek_public)
        check_ak_public(ak_public)
        if not hmac.compare_digest(name_of(ak_public), ak_name):
            raise _Malformed("ak_name")
    except (_Malformed, TpmError):
        return Refuse("evidence-malformed")
    if request.role not in ROLES:
        return Refuse("role")
    ek_hash = hashlib.sha256(ek_public).hexdigest()
    csr_sha256 = pki.sha256_hex(request.csr_der)
    if request.round == 0:
        if request.answer is not None:
            return Refuse("evidence-malformed")
        reason = _ek_trusted(ctx, ek_public, ek_certificate, ek_hash)
        if reason is not None:
            if not enrollment:
                return Refuse(reason)
            approved = ctx.lookup_join_request(ek_hash)
            if approved is None or not approved.usable:
                macs = request.claims.macs
                return Defer(
                    machine_key=ek_hash,
                    pool_id=pool_id,
                    hardware_key=ek_hash,
                    mac=macs[0] if macs else None,
                    retry_after_s=PENDING_RETRY_S,
                )
        from bcd.tpm.credential import make_credential

        secret = secrets.token_bytes(SECRET_SIZE)
        blob, encrypted = make_credential(ek_public, ak_name, secret)
        not_after = ctx.now_ms + CHALLENGE_TTL_MS
        challenge_id = ctx.save_challenge(
            secret_sha256=hashlib.sha256(secret).hexdigest(),
            ak_name=ak_name.hex(),
            ek_sha256=ek_hash,
            csr_sha256=csr_sha256,
            not_after_ms=not_after,
        )
        return Challenge(
            round=1,
            challenge={
                "id": challenge_id,
                "credential_blob": _enc(blob),
                "encrypted_secret": _enc(encrypted),
            },
            not_after_ms=not_after,
        )
    answer = request.answer
    if answer is None:
        return Refuse("evidence-malformed")
    try:
        answered_id = answer.get("id")
        if not isinstance(answered_id, str) or len(answered_id) > 64:
            raise _Malformed("id")
        secret = _b64(answer, "secret", 128)
        attest = _b64(answer, "certify_attest", 2048)
        signature = _b64(answer, "certify_sig", 128)
    except _Malformed:
        return Refuse("evidence-malformed")
    record = ctx.lock_challenge(answered_id)
    if (
        record is None
        or not hmac.compare_digest(record.ek_sha256, ek_hash)
        or not hmac.compare_digest(record.ak_name, ak_name.hex())
    ):
        return Refuse("activation")
    if record.csr_sha256 != csr_sha256:
        return Refuse("challenge-csr")
    if record.used:
        return Refuse("challenge-used")
    if record.not_after_ms <= ctx.now_ms:
        return Refuse("challenge-expired")
    if not hmac.compare_digest(hashlib.sha256(secret).hexdigest(), record.secret_sha256):
        return Refuse("activation")
    ctx.consume_challenge(answered_id)
    try:
        csr_key = pki.csr_public_key(pki.parse_csr(request.csr_der))
        key_name = name_of(node_key_public_area(csr_key))
        verify_certify(
            attest, signature, ak_public, key_name, hashlib.sha256(request.csr_der).digest()
        )
    except (TpmError, pki.PkiError):
        return Refuse("certify")
    pool = ctx.lookup_pool(pool_id)
    if pool is None:
        return Refuse("pool-unknown")
    join_request_id = None
    reason = _ek_trusted(ctx, ek_public, ek_certificate, ek_hash)
    if reason is not None:
        approved = ctx.lookup_join_request(ek_hash) if enrollment else None
        if approved is None or not approved.usable:
            return Refuse(reason if approved is None else "request-not-approved")
        join_request_id = approved.request_id
    return Admit(
        tenant_id=pool.tenant_id,
        pool_id=pool.pool_id,
        site_id=pool.site_id,
        role=request.role,
        allow_reclaim=True,
        node_key="tpm",
        statements=(ak_statement(ak_name),),
        hardware_key=ek_hash,
        join_request_id=join_request_id,
    )

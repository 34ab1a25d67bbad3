"""agent.Join: key, CSR, seal, call, verify, persist (seed 003, "What the join does").

The exchange with the gateway is :func:`gateway_sender`; the answer is checked by the
pure :func:`verify_joined` in the seed's order: the signature under the pinned key
(:func:`verify_signed`), then :func:`check_issued`: that ``csr_sha256`` is this
request's, that the leaf certifies this key, the SPIFFE ID, and the role. A renewal
(:mod:`bcd.renew`) reuses both.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import __version__, pki, wire
from bcd.config import Config, gateway_host_port
from bcd.errors import BcdError, JoinError, PeerVerificationError, RetryableError, TransportError
from bcd.httpclient import request
from bcd.identity import Identity, KeyKind, make_identity
from bcd.plugins import NodeEvidence, NodeJoinContext, Plugins, wire_name
from bcd.tls import connect_pinned

log = logging.getLogger("bcd.join")

MAX_ATTEMPTS = 20
MAX_CHALLENGE_ROUNDS = 3
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
MAX_PENDING_WAIT_S = 3600  # a pending answer's retry_after_s, however large, is waited at most 1 h
REFUSED = "the control plane refused the join (ACCESS_DENIED: Join refused)"


@dataclass(frozen=True, slots=True)
class Joined:
    """A verified join: the identity to persist, the answer's body, and ``signed``, the
    SignedResponse exactly as received (a compact JWS), for root's record."""

    identity: Identity
    body: dict[str, Any]
    signed: str


@dataclass(frozen=True, slots=True)
class HeldKey:
    """A node key held elsewhere (the TPM): its public half, its CSR and its record.

    ``record`` is the JSON object node.key holds (:class:`bcd.tpm.record.NodeKeyRecord`).
    """

    public_key: ec.EllipticCurvePublicKey
    csr_der: bytes
    record: dict[str, Any]


def verify_signed(signed: str, *, signing_pin: str, what: str = "join") -> dict[str, Any]:
    """Check a SignedResponse's signature under the pinned join-signing key; return its body."""
    try:
        return wire.verify_response(signed, signing_pin)
    except wire.WireError as exc:
        raise JoinError(f"the {what} answer does not verify: {exc}") from exc


def check_issued(
    body: dict[str, Any],
    *,
    csr_der: bytes,
    key: ec.EllipticCurvePublicKey,
    roles: Collection[str],
    expected: pki.SpiffeId | None = None,
    what: str = "join",
) -> pki.LeafInfo:
    """The checks on an issued certificate (``joined`` or ``renewed``), in the seed's order.

    ``csr_sha256`` is this request's; the leaf certifies ``key``; the leaf's SPIFFE ID
    is the one the body names and, when ``expected`` is given (a renewal), that one;
    its role is one of ``roles`` and the one the body names. Returns the leaf's
    :class:`~bcd.pki.LeafInfo`; raises :class:`JoinError` otherwise.
    """
    if body.get("csr_sha256") != pki.sha256_hex(csr_der):
        raise JoinError(f"the {what} answer is for another request (csr_sha256 differs)")
    chain = body.get("chain")
    if not isinstance(chain, str):
        raise JoinError(f"the {what} answer has no certificate chain")
    try:
        leaf = pki.load_pem_chain(chain)[0]
        leaf_key = leaf.public_key()
        if not isinstance(leaf_key, ec.EllipticCurvePublicKey) or not pki.same_public_key(
            leaf_key, key
        ):
            raise JoinError("the issued certificate does not certify this node's key")
        info = pki.leaf_info(leaf)
    except pki.PkiError as exc:
        raise JoinError(f"the issued certificate is not a node certificate: {exc}") from exc
    spiffe = info.spiffe
    if (
        spiffe.node_id != body.get("node_id")
        or spiffe.site_id != body.get("site_id")
        or spiffe.trust_domain != body.get("trust_domain")
    ):
        raise JoinError(f"the issued certificate's SPIFFE ID does not match the {what} answer")
    if expected is not None and spiffe != expected:
        raise JoinError(
            f"the issued certificate's SPIFFE ID {spiffe} is not this node's {expected}"
        )
    if info.role not in roles or body.get("role") != info.role:
        wanted = " or ".join(sorted(roles))
        raise JoinError(f"the issued certificate's role {info.role} is not the requested {wanted}")
    return info


def verify_joined(
    signed: str,
    *,
    signing_pin: str,
    csr_der: bytes,
    key: ec.EllipticCurvePublicKey,
    role: str,
) -> dict[str, Any]:
    """Check a SignedResponse in the seed's order; return its body or raise JoinError.

    A ``challenge`` or ``pending`` body is returned after the signature check alone.
    """
    body = verify_signed(signed, signing_pin=signing_pin)
    if body.get("kind") != "joined":
        return body
    allowed = (role, "node-tenant") if role == "node" else (role,)
    check_issued(body, csr_der=csr_der, key=key, roles=allowed)
    return body


def identity_of(body: dict[str, Any], key_kind: KeyKind = "file") -> Identity:
    server_ms = body.get("server_time")
    server_time = (
        datetime.fromtimestamp(server_ms / 1000, UTC).isoformat().replace("+00:00", "Z")
        if isinstance(server_ms, int)
        else ""
    )
    generation = body.get("identity_generation", 1)
    trust_version = body.get("trust_version", 1)
    bundle = body.get("bundle", "")
    return make_identity(
        chain=body["chain"],
        bundle=bundle if isinstance(bundle, str) else "",
        trust_version=trust_version if isinstance(trust_version, int) else 1,
        server_time=server_time,
        key=key_kind,
        identity_generation=generation if isinstance(generation, int) else 1,
    )


Sender = Callable[[bytes], Awaitable[str]]


def gateway_sender(cfg: Config) -> Sender:
    """POST /v1/join over TLS pinned to the serving CA; one connection per attempt."""
    host, port = gateway_host_port(cfg)

    async def send(body: bytes) -> str:
        stream = await connect_pinned(host, port, cfg.server_name, cfg.serving_ca_spki_pin)
        try:
            resp = await request(
                stream,
                "POST",
                "/v1/join",
                cfg.server_name,
                body,
                headers=[("content-type", "application/json")],
            )
        finally:
            await stream.aclose()
        if resp.status == 200:
            return resp.body.decode("ascii", "replace")
        err = wire.parse_error(resp.body)
        if err is None:
            raise RetryableError(f"the gateway answered HTTP {resp.status}")
        if err.code in wire.RETRYABLE:
            wait = wire.parse_pushback(resp.headers.get("retry-pushback-ms"))
            raise RetryableError(f"{err.code}: {err.message}", wait)
        if err.code == "ACCESS_DENIED":
            raise JoinError(REFUSED)
        raise JoinError(f"the join failed: {err.code}: {err.message}")

    return send


async def send_with_retries(
    send: Sender,
    make_body: Callable[[], bytes],
    *,
    attempts: int = MAX_ATTEMPTS,
    rng: random.Random | None = None,
) -> str:
    """Up to ``attempts`` tries; back off between them, or wait out the server's pushback.

    The pushback is ``retry-pushback-ms`` as :func:`bcd.wire.parse_pushback` reads it:
    at most :data:`bcd.wire.MAX_PUSHBACK_MS`, and absent when it does not parse.
    """
    rng = rng or random.Random()  # noqa: S311 - jitter, not a secret
    delay = BACKOFF_FIRST_S
    for attempt in range(1, attempts + 1):
        try:
            return await send(make_body())
        except PeerVerificationError:
            raise
        except (RetryableError, TransportError) as exc:
            if attempt == attempts:
                raise JoinError(f"the join failed after {attempts} attempts: {exc}") from exc
            pushback = exc.pushback_s if isinstance(exc, RetryableError) else None
            wait = pushback if pushback is not None else delay * (0.5 + rng.random() / 2)
            log.warning("join attempt %d failed (%s); retrying in %.1f s", attempt, exc, wait)
            await trio.sleep(wait)
            delay = min(delay * 2, BACKOFF_MAX_S)
    raise AssertionError("unreachable")  # pragma: no cover


async def join(
    cfg: Config,
    plugins: Plugins,
    *,
    attestor: str,
    role: str,
    credential: str | None,
    encryption_key: ec.EllipticCurvePublicKey | None,
    claims: wire.Claims,
    key: ec.EllipticCurvePrivateKey | HeldKey,
    node_id: str | None = None,
    send: Sender | None = None,
    attempts: int = MAX_ATTEMPTS,
    wall: Callable[[], float] | None = None,
    identity_chain_der: tuple[bytes, ...] = (),
    identity_signer: Callable[[bytes], bytes] | None = None,
) -> Joined:
    """Run the join; return the verified body and the identity to persist.

    ``key`` is a file key, or a :class:`HeldKey` (in the TPM; the identity's key is
    then ``tpm``). A ``challenge`` answer is answered by the attestor's node half with
    the same CSR, at most :data:`MAX_CHALLENGE_ROUNDS` times, never after its
    ``not_after``; a ``pending`` one is waited out. ``identity_chain_der`` and
    ``identity_signer`` lend the machine's existing identity to the attestor (a re-join
    with x509pop; see :class:`~bcd.plugins.NodeJoinContext`).
    """
    import time

    clock = wall or time.time
    key_kind: KeyKind
    record: dict[str, Any] | None
    if isinstance(key, HeldKey):
        csr_der, public_key, key_kind, record = key.csr_der, key.public_key, "tpm", key.record
    else:
        csr_der, public_key, key_kind, record = pki.make_csr(key), key.public_key(), "file", None
    rnd = 0
    answer: dict[str, Any] | None = None

    def context() -> NodeJoinContext:
        return NodeJoinContext(
            credential=credential,
            csr_der=csr_der,
            encryption_key=encryption_key,
            now_s=int(clock()),
            role=role,
            tcti=cfg.tpm.tcti,
            node_key_record=record,
            claims=claims,
            identity_chain_der=identity_chain_der,
            identity_signer=identity_signer,
        )

    built: list[NodeEvidence] = []

    def make_body() -> bytes:
        # A challenge round presents the evidence of round 0 again (the challenge is
        # bound to it, and rebuilding it costs TPM work); round 0 builds it anew on
        # every attempt, so a sealed token's iat stays fresh across retries.
        if rnd > 0 and built:
            return _request_body(built[0])
        try:
            evidence = plugins.node_evidence(attestor, context())
        except BcdError:
            raise
        except Exception as exc:  # a broken plugin is named, never a traceback
            log.debug("attestor plugin %s failed", attestor, exc_info=True)
            raise JoinError(
                f"the {attestor} attestor plugin failed to build its evidence ({type(exc).__name__})"
            ) from exc
        if evidence is None:
            raise JoinError(f"no attestor plugin named {attestor!r} is loaded")
        built[:] = [evidence]
        return _request_body(evidence)

    def _request_body(evidence: NodeEvidence) -> bytes:
        req = wire.JoinRequest(
            role=role,
            attestor=wire_name(attestor),
            sealed_token=evidence.sealed_token,
            csr_der=csr_der,
            claims=claims,
            evidence=evidence.evidence,
            node_id=node_id,
            daemon_version=__version__,
            round=rnd,
            answer=answer,
        )
        return wire.dumps(req.to_json())

    sender = send or gateway_sender(cfg)
    rounds = 0
    while True:
        signed = await send_with_retries(sender, make_body, attempts=attempts)
        body = verify_joined(
            signed,
            signing_pin=cfg.join_signing_key_pin,
            csr_der=csr_der,
            key=public_key,
            role=role,
        )
        if body["kind"] == "joined":
            return Joined(identity_of(body, key_kind), body, signed)
        if body["kind"] == "pending":
            wait = body.get("retry_after_s", 1)
            ok = isinstance(wait, int) and not isinstance(wait, bool)
            wait = min(max(1, wait), MAX_PENDING_WAIT_S) if ok else 1
            print(
                f"waiting for approval of join request {body.get('request_id', '?')}; "
                f"asking again in {wait} s",
                flush=True,
            )
            await trio.sleep(wait)
            rnd, answer = 0, None  # an attestor with a challenge starts a fresh round
            continue
        if body["kind"] != "challenge":
            raise JoinError(f"the join answer is of kind {body['kind']}, not a join answer")
        rounds += 1
        rnd, answer = await _answer_challenge(
            plugins, attestor, body, context, rounds=rounds, after=rnd, clock=clock
        )


async def _answer_challenge(
    plugins: Plugins,
    attestor: str,
    body: dict[str, Any],
    context: Callable[[], NodeJoinContext],
    *,
    rounds: int,
    after: int,
    clock: Callable[[], float],
) -> tuple[int, dict[str, Any]]:
    """Check a JoinChallenge and have the attestor's node half answer it."""
    if body.get("attestor") != wire_name(attestor):
        raise JoinError(f"the control plane sent a challenge for another attestor than {attestor}")
    rnd, not_after, challenge = body.get("round"), body.get("not_after"), body.get("challenge")
    if (
        not isinstance(rnd, int)
        or isinstance(rnd, bool)
        or not after < rnd <= MAX_CHALLENGE_ROUNDS
        or not isinstance(not_after, int)
        or not isinstance(challenge, dict)
    ):
        raise JoinError("the control plane sent a malformed challenge")
    if rounds > MAX_CHALLENGE_ROUNDS:
        raise JoinError(
            f"the control plane asked more than {MAX_CHALLENGE_ROUNDS} challenge rounds"
        )
    if clock() * 1000 >= not_after:
        raise JoinError("the join challenge expired before it could be answered; join again")
    ctx = context()
    try:
        answer = await trio.to_thread.run_sync(plugins.node_answer, attestor, challenge, ctx)
    except BcdError:
        raise
    except Exception as exc:  # a broken plugin is named, never a traceback
        log.debug("attestor plugin %s failed", attestor, exc_info=True)
        raise JoinError(
            f"the {attestor} attestor plugin failed to answer its challenge ({type(exc).__name__})"
        ) from exc
    if answer is None:
        raise JoinError(f"the {attestor} attestor's challenge rounds are not supported by this bcd")
    if clock() * 1000 >= not_after:
        raise JoinError("the join challenge expired before it could be answered; join again")
    return rnd, answer

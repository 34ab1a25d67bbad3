"""agent.Join: key, CSR, seal, call, verify, persist (seed 003, "What the join does").

The exchange with the gateway is :func:`gateway_sender`; the answer is checked by the
pure :func:`verify_joined` in the seed's order: the signature under the pinned key
(:func:`bcd.issued.verify_signed`, which parses the body once into a typed value),
then :func:`bcd.issued.check_issued`: that ``csr_sha256`` is this request's, that the
leaf certifies this key, the SPIFFE ID, and the role. A renewal (:mod:`bcd.renew`)
uses the same checks. The node key is a :class:`~bcd.keys.node.NodeKey` (a file key,
or a TPM key root holds: :class:`~bcd.keys.node.RootTpmKey`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import __version__, wire
from bcd.attestor_api import NodeEvidence, NodeJoinContext, wire_name
from bcd.config import Config
from bcd.errors import BcdError, JoinError, PeerVerificationError, RetryableError, TransportError
from bcd.gatewayanswer import refusal
from bcd.identity import Identity
from bcd.issued import check_issued, issued_identity, verify_signed
from bcd.keys.node import FileKey, NodeKey
from bcd.plugins import Plugins

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
    body: wire.Issued
    signed: str


def verify_joined(
    signed: str,
    *,
    signing_pin: str,
    csr_der: bytes,
    key: ec.EllipticCurvePublicKey,
    role: str,
) -> wire.SignedBody:
    """Check a SignedResponse in the seed's order; return its typed body or raise JoinError.

    A ``challenge`` or ``pending`` body is returned after the signature check alone.
    """
    body = verify_signed(signed, signing_pin=signing_pin)
    if not isinstance(body, wire.Issued) or body.kind != "joined":
        return body
    allowed = (role, "node-tenant") if role == "node" else (role,)
    check_issued(body, csr_der=csr_der, key=key, roles=allowed)
    return body


Sender = Callable[[bytes], Awaitable[str]]


def gateway_sender(cfg: Config) -> Sender:
    """POST /v1/join over TLS pinned to the serving CA; one connection per attempt."""
    from bcd.transport import gateway_client  # httpx only where the gateway is called

    async def send(body: bytes) -> str:
        async with await gateway_client(cfg) as client:
            resp = await client.join(body)
        if resp.status == 200:
            return resp.body.decode("ascii", "replace")
        raise refusal(resp, failed="the join failed", refused=REFUSED)

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
    key: NodeKey | ec.EllipticCurvePrivateKey,
    node_id: str | None = None,
    send: Sender | None = None,
    attempts: int = MAX_ATTEMPTS,
    wall: Callable[[], float] | None = None,
    identity_chain_der: tuple[bytes, ...] = (),
    identity_signer: Callable[[bytes], bytes] | None = None,
    say: Callable[[str], None] | None = None,
) -> Joined:
    """Run the join; return the verified body and the identity to persist.

    ``key`` is the node key (:class:`~bcd.keys.node.NodeKey`; a bare private key is a
    file key); the identity's key is of its kind. A ``challenge`` answer is answered by the attestor's node half with
    the same CSR, at most :data:`MAX_CHALLENGE_ROUNDS` times, never after its
    ``not_after``; a ``pending`` one is waited out. ``identity_chain_der`` and
    ``identity_signer`` lend the machine's existing identity to the attestor (a re-join
    with x509pop; see :class:`~bcd.attestor_api.NodeJoinContext`). ``say`` is told
    what the join waits for (a ``pending`` answer); by default it is logged.
    """
    import time

    clock = wall or time.time
    node_key = FileKey(key) if isinstance(key, ec.EllipticCurvePrivateKey) else key
    csr_der, public_key = await node_key.csr(), node_key.public_key
    record = node_key.record.to_dict() if node_key.record is not None else None
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
            settings=cfg.attestor_settings.get(attestor, {}),
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
        if isinstance(body, wire.Issued) and body.kind == "joined":
            return Joined(issued_identity(body, node_key.kind), body, signed)
        if isinstance(body, wire.Pending):
            wait = min(max(1, body.retry_after_s), MAX_PENDING_WAIT_S)
            (say or log.info)(
                f"waiting for approval of join request {body.request_id}; asking again in {wait} s"
            )
            await trio.sleep(wait)
            rnd, answer = 0, None  # an attestor with a challenge starts a fresh round
            continue
        if not isinstance(body, wire.Challenge):
            raise JoinError(f"the join answer is of kind {body.kind}, not a join answer")
        rounds += 1
        rnd, answer = await _answer_challenge(
            plugins, attestor, body, context, rounds=rounds, after=rnd, clock=clock
        )


async def _answer_challenge(
    plugins: Plugins,
    attestor: str,
    body: wire.Challenge,
    context: Callable[[], NodeJoinContext],
    *,
    rounds: int,
    after: int,
    clock: Callable[[], float],
) -> tuple[int, dict[str, Any]]:
    """Check a JoinChallenge (typed: :func:`bcd.wire.parse_challenge` refused a malformed
    one) and have the attestor's node half answer it."""
    if body.attestor != wire_name(attestor):
        raise JoinError(f"the control plane sent a challenge for another attestor than {attestor}")
    rnd, not_after, challenge = body.round, body.not_after_ms, body.challenge
    if not after < rnd <= MAX_CHALLENGE_ROUNDS:  # a round that does not go up, or too far
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

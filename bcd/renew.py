"""The renewal task (seed 003, "Renewal"): a new key and certificate at 60 % of the leaf.

:func:`renew_once` is the seed's renewOnce for a file key (a TPM-held key renews
through ``bcd helper`` with :func:`renew_once_tpm`, attaching the AK's
``key_attestation`` when the leaf names an AK; a file key moves into the TPM at a
renewal under ``[helper]`` with ``[tpm] mode`` auto or required):

1. a new P-256 key;
2. node.key.next written first, then the request: a new CSR, the current chain,
   the client time and the proof of possession by the current key
   (:func:`bcd.pki.renew_pop_message`);
3. the answer checked (:func:`verify_renewed`): the signature under the pinned
   join-signing key, kind ``renewed``, this CSR, the new key, and the same node,
   site, trust domain and role as the current leaf;
4. stored in the seed's order (:func:`bcd.identity.store_renewal`: node.key.next
   again, identity.json, node.key.next renamed over node.key), so a crash at any
   instant leaves a key and certificate that :func:`bcd.identity.load_state` matches.

:func:`renewal_task` sleeps until :func:`renew_at`, renews, and reschedules; a failed
renewal is logged as ``renewal failed`` with the attempt and ``expiresIn`` and retried
after 30 s, doubling to 10 minutes, or exactly after the gateway's
``retry-pushback-ms`` (at most 5 minutes). :class:`~bcd.errors.CertificateRevoked`
(the gateway answered UNAUTHENTICATED) ends the task. A replaced key is held by :class:`OldKeys` for 5
minutes, then dropped. Time comes from trio's clock (sleeps) and an injected wall
clock (certificate times), so tests run it under ``MockClock``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki, wire
from bcd.config import Config, TpmMode
from bcd.errors import (
    BcdError,
    CertificateRevoked,
    GatewayUnauthenticated,
    IdentityError,
    IdentityExpired,
    JoinError,
    RetryableError,
)
from bcd.helper import HelperError
from bcd.helper.nodekeys import HelperKeys
from bcd.httpclient import Response
from bcd.identity import (
    RENEWAL_STEPS,
    TPM_NODE_UNSUPPORTED,
    AnyState,
    Identity,
    KeyKind,
    LoadedState,
    LoadedTpmState,
    format_time,
    load_state,
    make_identity,
    store_renewal,
    write_next_key,
)
from bcd.join import check_issued, verify_signed
from bcd.keys.file import generate_file_key, key_to_pem
from bcd.revocation import expired, judge_unauthenticated
from bcd.session import post_as_node
from bcd.tpm.attestation import KeyAttestation, ak_statement, ak_statements
from bcd.tpm.record import NodeKeyRecord, create_node_key_record

RENEW_FRACTION = 0.6
BACKOFF_FIRST_S = 30.0
BACKOFF_MAX_S = 600.0
OLD_KEY_HOLD_S = 300.0
MIN_PUSHBACK_S = 1.0  # the shortest wait a retry-pushback-ms can ask of a renewal
# The longest single sleep: the wall clock is read again after it, so a suspended
# machine or a stepped clock delays a renewal by at most this much.
MAX_NAP_S = 60.0
# A renewal due within this much is due now (float noise between the two clocks).
_DUE_SLACK_S = 1e-3
RENEW_PATH = "/v1/renew"
REFUSED = "the control plane refused the renewal (ACCESS_DENIED: Renew refused)"
REVOKED = (
    "the gateway does not accept this node's certificate (UNAUTHENTICATED): it is "
    "revoked or unknown; join again: bcd join --reset --yes, then bcd join"
)
EXPIRED_HINT = "the certificate has expired; join again: bcd join --reset --yes, then bcd join"

_LOG = logging.getLogger("bcd.renew")

Sender = Callable[[bytes], Awaitable[str]]
SenderFactory = Callable[[AnyState], Sender]
Recorder = Callable[[str, dict[str, Any]], Awaitable[object]]
FailPoint = Callable[[str], None]
# The storage steps of a renewal, in order: node.key.next written first (before the
# request), then store_renewal's steps (node.key.next again, identity.json, rename).
FAIL_POINTS = ("next-key-first", *RENEWAL_STEPS)


# --- pure parts -------------------------------------------------------------------


def renew_at(
    not_before: datetime, not_after: datetime, fraction: float = RENEW_FRACTION
) -> datetime:
    """When to renew: ``fraction`` (60 %) of the way through the leaf's lifetime."""
    if not 0 < fraction < 1:
        raise ValueError("the renewal fraction is between 0 and 1")
    if not_after <= not_before:
        raise ValueError("the certificate's lifetime is empty")
    return not_before + (not_after - not_before) * fraction


def backoff_s(attempt: int) -> float:
    """The wait after failed attempt ``attempt`` (1-based): 30 s doubling to 10 minutes."""
    if attempt < 1:
        raise ValueError("attempts count from 1")
    return float(min(BACKOFF_FIRST_S * 2.0 ** min(attempt - 1, 32), BACKOFF_MAX_S))


def format_duration(seconds: float) -> str:
    """``5h12m``, ``12m30s``, ``45s``; negative (already expired) with a leading ``-``."""
    sign = "-" if seconds < 0 else ""
    total = math.floor(abs(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours}h{minutes}m"
    if minutes:
        return f"{sign}{minutes}m{secs}s"
    return f"{sign}{secs}s"


def build_request(
    state: LoadedState, next_key: ec.EllipticCurvePrivateKey, client_time_ms: int
) -> tuple[bytes, wire.RenewRequest]:
    """The CSR for ``next_key`` and the RenewRequest proving the current key."""
    csr_der = pki.make_csr(next_key)
    message = pki.renew_pop_message(csr_der, state.identity.node_id, client_time_ms)
    return csr_der, wire.RenewRequest(
        csr_der=csr_der,
        chain=state.identity.chain,
        client_time_ms=client_time_ms,
        pop_sig=pki.sign_p1363(state.key, message),
    )


def verify_renewed(
    signed: str,
    *,
    signing_pin: str,
    csr_der: bytes,
    key: ec.EllipticCurvePublicKey,
    current: pki.LeafInfo,
) -> dict[str, Any]:
    """Check a renewal answer; return its body or raise :class:`~bcd.errors.JoinError`.

    The signature under the pinned join-signing key, kind ``renewed``, ``csr_sha256``
    of this CSR, a leaf certifying ``key``, and the ``current`` leaf's SPIFFE ID
    (node, site, trust domain) and role.
    """
    body = verify_signed(signed, signing_pin=signing_pin, what="renewal")
    if body.get("kind") != "renewed":
        raise JoinError(f"the renewal answer is of kind {body.get('kind')!r}, not 'renewed'")
    check_issued(
        body,
        csr_der=csr_der,
        key=key,
        roles=(current.role,),
        expected=current.spiffe,
        what="renewal",
    )
    return body


def renewed_identity(state: AnyState, body: dict[str, Any], key: KeyKind = "file") -> Identity:
    """The Identity of a verified ``renewed`` body.

    Trust version, bundle and server time come from the answer when it carries them,
    else from the current identity; so does the identity generation.
    """
    current = state.identity
    trust_version = body.get("trust_version")
    bundle = body.get("bundle")
    generation = body.get("identity_generation")
    server_ms = body.get("server_time")
    server_time = current.server_time
    if isinstance(server_ms, int) and not isinstance(server_ms, bool) and server_ms >= 0:
        server_time = format_time(datetime.fromtimestamp(server_ms / 1000, UTC))
    return make_identity(
        chain=body["chain"],
        bundle=bundle if isinstance(bundle, str) and bundle else current.bundle,
        trust_version=_count_or(trust_version, current.trust_version),
        server_time=server_time,
        key=key,
        identity_generation=_count_or(generation, current.identity_generation),
    )


def _count_or(value: object, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default


# --- renewOnce --------------------------------------------------------------------


async def renew_once(
    state: AnyState,
    send: Sender,
    *,
    signing_pin: str,
    wall: Callable[[], float],
    fail_point: FailPoint | None = None,
    tpm: HelperKeys | None = None,
    tpm_mode: TpmMode = "off",
    log: logging.Logger = _LOG,
) -> AnyState:
    """Renew once (the seed's renewOnce); return the new state, stored on disk.

    Raises :class:`~bcd.errors.BcdError` when the renewal failed; the identity on
    disk is then still ``state``'s (a stale node.key.next is removed by the next
    load, or overwritten by the next attempt). ``fail_point`` (tests only) is called
    with each name of :data:`FAIL_POINTS` once that storage step is on disk. A
    TPM-held key renews through ``bcd helper`` (``tpm``, :func:`renew_once_tpm`).

    A file key moves into the TPM here (seed 003, "Renewal" step 1) when ``bcd
    helper`` serves the node (``tpm``) and ``tpm_mode`` (``[tpm] mode``) is ``auto``
    or ``required``: the next key is made in the TPM through the helper, the CSR is
    signed by it, the proof of possession still by the current file key (over the
    file key's TLS), with no ``key_attestation`` (a file-key leaf names no AK); the
    new state is a :class:`~bcd.identity.LoadedTpmState` (identity key ``tpm``).
    When the helper cannot make or use that key (no TPM, not reachable, an answer
    failing the node's checks), ``auto`` renews this once with a file key (logged as
    a warning) and ``required`` fails the renewal before anything is sent. ``off``,
    or no helper (``bcd node`` never opens the TPM itself), keeps a file key.
    """
    if isinstance(state, LoadedTpmState):
        if tpm is None:
            raise IdentityError(TPM_NODE_UNSUPPORTED)
        return await renew_once_tpm(
            state, send, tpm, signing_pin=signing_pin, wall=wall, fail_point=fail_point
        )
    if tpm is not None and tpm_mode != "off":
        try:
            prepared = await _prepare_tpm(state, tpm, wall, fail_point)
        except HelperError as exc:
            if tpm_mode == "required":
                raise JoinError(
                    "the renewal failed before anything was sent: [tpm] mode = required, "
                    f"but the TPM cannot be used through bcd helper ({exc})"
                ) from exc
            log.warning(
                "renewal: the next node key is a file key, not in the TPM: %s",
                exc,
                extra={"tpmMode": tpm_mode},
            )
        else:
            return await _finish_tpm(state, send, tpm, prepared, signing_pin, fail_point)
    next_key = generate_file_key()
    next_pem = key_to_pem(next_key)
    await trio.to_thread.run_sync(write_next_key, state.data_dir, next_pem)
    if fail_point is not None:
        fail_point(FAIL_POINTS[0])
    csr_der, req = build_request(state, next_key, int(wall() * 1000))
    signed = await send(wire.dumps(req.to_json()))
    body = verify_renewed(
        signed,
        signing_pin=signing_pin,
        csr_der=csr_der,
        key=next_key.public_key(),
        current=state.leaf_info,
    )
    identity = renewed_identity(state, body)
    try:
        await trio.to_thread.run_sync(store_renewal, state.data_dir, identity, next_pem, fail_point)
    except IdentityError:
        # Part of the store may have happened: settle the directory the way a restart
        # would, and go on with whatever it holds now.
        settled = await trio.to_thread.run_sync(_reload, state.data_dir)
        if settled is not None and settled.identity == identity:
            return settled
        raise
    leaf = identity.leaf()
    return LoadedState(
        data_dir=state.data_dir,
        identity=identity,
        key=next_key,
        leaf=leaf,
        leaf_info=pki.leaf_info(leaf),
    )


AK_MISMATCH = "the TPM derives another AK than the certificate names"


async def renew_once_tpm(
    state: LoadedTpmState,
    send: Sender,
    tpm: HelperKeys,
    *,
    signing_pin: str,
    wall: Callable[[], float],
    fail_point: FailPoint | None = None,
) -> LoadedTpmState:
    """renewOnce for a TPM-held key, through ``bcd helper`` (seed 003, "Renewal" 1-5).

    1. For a leaf naming an AK (``urn:bc:tpm-ak:``) the helper's AK must be that AK,
       checked before anything is written or sent (no downgrade: the renewal fails,
       and keeps failing); the next key is made in the TPM (a new record, derived
       through the helper and pinned).
    2. node.key.next (the record) is written first; the CSR is signed by the next
       key, the proof of possession by the current key (both through the helper).
    3. For a leaf naming an AK: ``key_attestation``, the AK's TPM2_Certify of the next
       key over sha256(csr).
    4. The answer is checked like a file key's; 5. stored in the same order.

    Any helper failure (not running, no TPM, an answer failing the node's checks)
    fails the renewal before the request is sent.
    """
    try:
        return await _renew_tpm(state, send, tpm, signing_pin, wall, fail_point)
    except HelperError as exc:
        raise JoinError(f"the renewal failed before anything was sent: {exc}") from exc


async def _renew_tpm(
    state: LoadedTpmState,
    send: Sender,
    tpm: HelperKeys,
    signing_pin: str,
    wall: Callable[[], float],
    fail_point: FailPoint | None,
) -> LoadedTpmState:
    prepared = await _prepare_tpm(state, tpm, wall, fail_point)
    return await _finish_tpm(state, send, tpm, prepared, signing_pin, fail_point)


@dataclass(frozen=True, slots=True)
class _TpmRenewal:
    """A renewal whose next key is in the TPM, ready to send (node.key.next written)."""

    request: wire.RenewRequest
    record: NodeKeyRecord
    public_key: ec.EllipticCurvePublicKey
    record_json: bytes


async def _prepare_tpm(
    state: AnyState,
    tpm: HelperKeys,
    wall: Callable[[], float],
    fail_point: FailPoint | None,
) -> _TpmRenewal:
    """Steps 1-3 with the next key in the TPM; every helper call happens here, before
    anything is sent (a HelperError leaves at most a stale node.key.next).

    The proof of possession is the current key's: through the helper for a TPM-held
    key, the file key itself for a file-key node moving into the TPM.
    """
    named = ak_statements(state.leaf_info.statements)
    ak = None
    if named:
        ak = await tpm.client.ak()
        if ak_statement(ak.name) not in named:
            raise JoinError(f"the renewal failed before anything was sent: {AK_MISMATCH}")
    fresh = create_node_key_record()
    next_public = await tpm.client.nodekey(fresh)
    next_record = fresh.pinned(next_public.public_key)
    next_json = next_record.to_json()
    await trio.to_thread.run_sync(write_next_key, state.data_dir, next_json)
    if fail_point is not None:
        fail_point(FAIL_POINTS[0])
    # the helper signs digests: the CSR's and the proof's SHA-256
    csr_der = await trio.to_thread.run_sync(
        pki.make_csr_with, next_public.public_key, tpm.signer(next_record)
    )
    client_time_ms = int(wall() * 1000)
    message = pki.renew_pop_message(csr_der, state.identity.node_id, client_time_ms)
    if isinstance(state, LoadedTpmState):
        pop_sig = await tpm.sign(state.record, hashlib.sha256(message).digest())
    else:
        pop_sig = pki.sign_p1363(state.key, message)
    attestation = None
    if ak is not None:
        certified = await tpm.client.certify(
            next_record, next_public, hashlib.sha256(csr_der).digest(), ak
        )
        attestation = KeyAttestation(
            ak.public_area, next_public.public_area, certified.attest, certified.signature
        ).to_json()
    req = wire.RenewRequest(
        csr_der=csr_der,
        chain=state.identity.chain,
        client_time_ms=client_time_ms,
        pop_sig=pop_sig,
        key_attestation=attestation,
    )
    return _TpmRenewal(req, next_record, next_public.public_key, next_json)


async def _finish_tpm(
    state: AnyState,
    send: Sender,
    tpm: HelperKeys,
    prepared: _TpmRenewal,
    signing_pin: str,
    fail_point: FailPoint | None,
) -> LoadedTpmState:
    """Steps 4-5 for a next key in the TPM: send, check the answer, store (key ``tpm``)."""
    req = prepared.request
    signed = await send(wire.dumps(req.to_json()))
    body = verify_renewed(
        signed,
        signing_pin=signing_pin,
        csr_der=req.csr_der,
        key=prepared.public_key,
        current=state.leaf_info,
    )
    identity = renewed_identity(state, body, "tpm")
    try:
        await trio.to_thread.run_sync(
            store_renewal, state.data_dir, identity, prepared.record_json, fail_point
        )
    except IdentityError:
        settled = await trio.to_thread.run_sync(_reload, state.data_dir, tpm)
        if isinstance(settled, LoadedTpmState) and settled.identity == identity:
            return settled
        raise
    leaf = identity.leaf()
    return LoadedTpmState(
        data_dir=state.data_dir,
        identity=identity,
        record=prepared.record,
        public_key=prepared.public_key,
        leaf=leaf,
        leaf_info=pki.leaf_info(leaf),
    )


def _reload(data_dir: Path, tpm: HelperKeys | None = None) -> AnyState | None:
    """LoadState from a worker thread (a TPM key derived through the helper)."""
    try:
        if tpm is None:
            return load_state(data_dir)
        return load_state(data_dir, tpm.derive_sync)
    except BcdError:
        return None


# --- the gateway ------------------------------------------------------------------


def renew_answer(resp: Response) -> str:
    """Map the gateway's answer to POST /v1/renew: the SignedResponse, or an error.

    UNAUTHENTICATED is :class:`~bcd.errors.CertificateRevoked`; UNAVAILABLE and
    RESOURCE_EXHAUSTED are :class:`~bcd.errors.RetryableError` with the
    ``retry-pushback-ms`` wait (:func:`bcd.wire.parse_pushback`: at most 5 minutes,
    absent when it does not parse); ACCESS_DENIED and the rest are
    :class:`~bcd.errors.JoinError` (the renewal task retries those too).
    """
    if resp.status == 200:
        return resp.body.decode("ascii", "replace")
    err = wire.parse_error(resp.body)
    if err is None:
        raise RetryableError(f"the gateway answered HTTP {resp.status}")
    if err.code == "UNAUTHENTICATED":
        raise GatewayUnauthenticated(REVOKED, _notice_in(resp.body))
    if err.code in wire.RETRYABLE:
        wait = wire.parse_pushback(resp.headers.get("retry-pushback-ms"))
        raise RetryableError(f"{err.code}: {err.message}", wait)
    if err.code == "ACCESS_DENIED":
        raise JoinError(REFUSED)
    raise JoinError(f"the renewal failed: {err.code}: {err.message}")


def _notice_in(body: bytes) -> object:
    """The signed RevocationNotice an UNAUTHENTICATED answer carries, if any."""
    try:
        obj = wire.loads_object(body, 64 * 1024)
    except wire.WireError:
        return None
    return obj.get("notice")


def gateway_renew_sender(cfg: Config, state: AnyState, tpm: HelperKeys | None = None) -> Sender:
    """POST /v1/renew over mutual TLS pinned to the serving CA, as ``state``'s identity.

    The client certificate is ``state``'s chain and key (a TPM-held key signs the
    handshake through ``bcd helper``, ``tpm``): build a new sender from the new state
    after a renewal (:func:`renewal_task` does, per attempt).
    """

    async def send(body: bytes) -> str:
        return renew_answer(await post_as_node(cfg, state, tpm, RENEW_PATH, body))

    return send


# --- the old key ------------------------------------------------------------------


HeldKey = ec.EllipticCurvePrivateKey | NodeKeyRecord
"""A replaced node key: a file key, or the TPM record it is derived from."""


def held_key(state: AnyState) -> HeldKey:
    return state.record if isinstance(state, LoadedTpmState) else state.key


class OldKeys:
    """Node keys a renewal replaced, each held ``hold_s`` seconds (trio clock), then dropped.

    Nothing may still be signing with a key when it goes: a handshake or statement
    started just before the renewal finishes with the old key in that time.
    ``on_unload`` is called with each key as it goes (a TPM key flushes its handle).
    """

    def __init__(
        self,
        hold_s: float = OLD_KEY_HOLD_S,
        on_unload: Callable[[HeldKey], None] | None = None,
    ) -> None:
        self.hold_s = hold_s
        self._on_unload = on_unload
        self._held: list[tuple[float, HeldKey]] = []

    def __len__(self) -> int:
        return len(self._held)

    def keys(self) -> tuple[HeldKey, ...]:
        return tuple(key for _, key in self._held)

    def retire(self, key: HeldKey, now: float) -> None:
        """Hold ``key`` until ``now + hold_s`` (trio time)."""
        self._held.append((now + self.hold_s, key))

    def next_due(self) -> float | None:
        """The trio time at which the next key goes, if one is held."""
        return min((due for due, _ in self._held), default=None)

    def unload_due(self, now: float) -> list[HeldKey]:
        """Drop every key whose time has come; return them."""
        going = [key for due, key in self._held if due <= now]
        self._held = [(due, key) for due, key in self._held if due > now]
        for key in going:
            if self._on_unload is not None:
                self._on_unload(key)
        return going


async def _pause(
    seconds: float, old_keys: OldKeys, log: logging.Logger, tpm: HelperKeys | None = None
) -> None:
    """Sleep ``seconds`` of trio time, waking to unload old keys when they are due; a
    TPM-held one is released in ``bcd helper`` (``tpm.release``), as the seed says."""
    end = trio.current_time() + max(seconds, 0.0)
    while True:
        going = old_keys.unload_due(trio.current_time())
        if going:
            log.info("the previous node key was unloaded")
        for key in going:
            if isinstance(key, NodeKeyRecord) and tpm is not None:
                await _release(tpm, key, log)
        due = old_keys.next_due()
        wake = end if due is None else min(end, due)
        if trio.current_time() >= end:
            await trio.lowlevel.checkpoint()
            return
        await trio.sleep_until(wake)


async def _release(tpm: HelperKeys, record: NodeKeyRecord, log: logging.Logger) -> None:
    tpm.forget(record)
    try:
        await tpm.client.release(record)
    except HelperError as exc:  # the helper holds nothing between calls: only logged
        log.warning("bcd helper did not release the previous node key: %s", exc)
    else:
        log.info("the previous node key was released in bcd helper")


# --- the task ---------------------------------------------------------------------


async def renewal_task(
    get_state: Callable[[], AnyState],
    set_state: Callable[[AnyState], None],
    send_factory: SenderFactory,
    *,
    signing_pin: str,
    wall: Callable[[], float],
    log: logging.Logger,
    old_keys: OldKeys | None = None,
    record: Recorder | None = None,
    fraction: float = RENEW_FRACTION,
    fail_point: FailPoint | None = None,
    tpm: HelperKeys | None = None,
    tpm_mode: TpmMode = "off",
) -> NoReturn:
    """Keep the identity fresh forever; only :class:`~bcd.errors.CertificateRevoked` ends it.

    Each round reads the current state, sleeps (trio clock) until :func:`renew_at` by
    the ``wall`` clock (unix seconds, read again at least every :data:`MAX_NAP_S`),
    and renews with a sender made by ``send_factory`` from that state. Success:
    ``set_state`` with the new state, the old key to ``old_keys`` for 5 minutes, and
    ``record("renewed", …)`` (the journal) when given. Failure: ``renewal failed``
    logged with the attempt and ``expiresIn``, then the backoff or the pushback.
    Any exception that is not a :class:`~bcd.errors.BcdError` is a bug and ends the
    task too. After a storage failure the data directory is settled the way a start
    would (:func:`bcd.identity.load_state`) and a newer certificate of this node
    found there is adopted. ``fail_point``, ``tpm`` (``bcd helper``, for a TPM-held
    key) and ``tpm_mode`` (``[tpm] mode``: whether a file key moves into the TPM) are
    passed to :func:`renew_once`. The kind of key can change at a renewal (a file key
    moving into the TPM): ``set_state`` then gets a
    :class:`~bcd.identity.LoadedTpmState`, and the next sender and session are built
    from it.
    """
    keys = old_keys if old_keys is not None else OldKeys()
    attempt = 0
    while True:
        state = get_state()
        gone = expired(state, datetime.fromtimestamp(wall(), UTC))
        if gone is not None:  # no renewal can succeed now: stop with the way back
            raise gone
        if attempt == 0:
            info = state.leaf_info
            remaining = renew_at(info.not_before, info.not_after, fraction).timestamp() - wall()
            if remaining > _DUE_SLACK_S:
                await _pause(min(remaining, MAX_NAP_S), keys, log, tpm)
                continue
        attempt += 1
        try:
            # a TPM key stays a TPM key; a file key may move into the TPM (tpm_mode)
            new = await renew_once(
                state,
                send_factory(state),
                signing_pin=signing_pin,
                wall=wall,
                fail_point=fail_point,
                tpm=tpm,
                tpm_mode=tpm_mode,
                log=log,
            )
        except CertificateRevoked:
            raise
        except GatewayUnauthenticated as exc:
            # revoked only on a notice signed where it was revoked; expired: stop
            verdict = judge_unauthenticated(
                exc.notice, signing_pin, state, datetime.fromtimestamp(wall(), UTC)
            )
            if isinstance(verdict, CertificateRevoked | IdentityExpired):
                raise verdict from exc
            wait = _failed(state, verdict, attempt, wall, log)
            log.info("renewal: next attempt in %.1f s", wait, extra={"waitSeconds": wait})
            await _pause(wait, keys, log, tpm)
            continue
        except BcdError as exc:
            wait = _failed(state, exc, attempt, wall, log)
            if isinstance(exc, IdentityError) and await _adopt_disk_state(
                state, set_state, log, tpm
            ):
                keys.retire(held_key(state), trio.current_time())
                attempt = 0
                continue
            log.info("renewal: next attempt in %.1f s", wait, extra={"waitSeconds": wait})
            await _pause(wait, keys, log, tpm)
            continue
        set_state(new)
        keys.retire(held_key(state), trio.current_time())
        attempt = 0
        log.info(
            "renewed: certificate %s valid until %s",
            new.leaf_info.serial_hex,
            new.identity.not_after,
        )
        if record is not None:
            await _record(record, state, new, log)


def _failed(
    state: AnyState,
    exc: BcdError,
    attempt: int,
    wall: Callable[[], float],
    log: logging.Logger,
) -> float:
    """Log ``renewal failed``; return how long to wait before the next attempt."""
    expires_in = state.leaf_info.not_after.timestamp() - wall()
    text = format_duration(expires_in)
    reason = f"{exc}; {EXPIRED_HINT}" if expires_in <= 0 else str(exc)
    log.warning(
        "renewal failed (attempt %d, expiresIn %s): %s",
        attempt,
        text,
        reason,
        extra={"attempt": attempt, "expiresIn": text, "expiresInSeconds": int(expires_in)},
    )
    pushback = exc.pushback_s if isinstance(exc, RetryableError) else None
    # at least MIN_PUSHBACK_S: a gateway answering "0" must not spin the agent
    return max(pushback, MIN_PUSHBACK_S) if pushback is not None else backoff_s(attempt)


async def _adopt_disk_state(
    state: AnyState,
    set_state: Callable[[AnyState], None],
    log: logging.Logger,
    tpm: HelperKeys | None = None,
) -> bool:
    """After a storage failure, go on with what the data directory holds (settled).

    Only a newer certificate of this same node is adopted; anything else on disk is
    left for the next start to judge.
    """
    on_disk = await trio.to_thread.run_sync(_reload, state.data_dir, tpm)
    if (
        on_disk is not None
        # a file key may have moved into the TPM; a TPM key never goes back to a file
        and not (isinstance(state, LoadedTpmState) and isinstance(on_disk, LoadedState))
        and on_disk.identity != state.identity
        and on_disk.identity.spiffe_id == state.identity.spiffe_id
        and on_disk.identity.role == state.identity.role
    ):
        log.warning(
            "the renewed certificate was stored after all; using it (valid until %s)",
            on_disk.identity.not_after,
        )
        set_state(on_disk)
        return True
    return False


async def _record(record: Recorder, old: AnyState, new: AnyState, log: logging.Logger) -> None:
    try:
        await record(
            "renewed",
            {
                "previousSerial": old.leaf_info.serial_hex,
                "serial": new.leaf_info.serial_hex,
                "notAfter": new.identity.not_after,
                "spkiSha256": new.leaf_info.spki_sha256,
            },
        )
    except BcdError as exc:
        log.warning("the renewal could not be written to the journal: %s", exc)

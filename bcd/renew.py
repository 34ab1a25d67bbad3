"""The renewal task (seed 003, "Renewal"): a new key and certificate at 60 % of the leaf.

:func:`renew_once` is the seed's renewOnce, one path for every node key
(:class:`~bcd.keys.node.NodeKey`: a file key, or a TPM-held key through ``bcd
helper``, which attaches the AK's ``key_attestation`` when the leaf names an AK; a
file key moves into the TPM at a renewal under ``[helper]`` with ``[tpm] mode`` auto
or required):

1. a new key (:class:`~bcd.keys.node.KeyMaker`);
2. node.key.next written first, then the request: a new CSR, the current chain,
   the client time and the proof of possession by the current key
   (:func:`bcd.pki.renew_pop_message`);
3. the answer checked (:func:`bcd.issued.verify_renewed`): the signature under the pinned
   join-signing key, kind ``renewed``, this CSR, the new key, and the same node,
   site, trust domain and role as the current leaf;
4. stored in the seed's order (:func:`bcd.identity.store_renewal`: node.key.next
   again, identity.json, node.key.next renamed over node.key), so a crash at any
   instant leaves a key and certificate that :func:`bcd.identity.load_state` matches
   (the state's store: the data directory, or a :class:`~bcd.identity.MemoryStore`).

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
from typing import TYPE_CHECKING, Any, NoReturn

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
from bcd.gatewayanswer import refusal
from bcd.helper import HelperError
from bcd.helper.nodekeys import HelperKeys
from bcd.identity import (
    RENEWAL_STEPS,
    AnyState,
    LoadedState,
    load_from,
    store_of,
    store_renewal,
    write_next_key,
)
from bcd.identitystore import StoreOrDir, as_store
from bcd.issued import issued_identity, verify_renewed
from bcd.keys.node import AK_MISMATCH as AK_MISMATCH
from bcd.keys.node import (
    FileKeyMaker,
    HelperKeyMaker,
    KeyMaker,
    NodeKey,
    node_key_of,
    state_with,
)
from bcd.revocation import expired, judge_unauthenticated
from bcd.session import post_as_node

if TYPE_CHECKING:
    from bcd.gatewayanswer import Response

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
    """Renew once (the seed's renewOnce); return the new state, stored.

    Raises :class:`~bcd.errors.BcdError` when the renewal failed; the stored identity
    is then still ``state``'s (a stale node.key.next is removed by the next load, or
    overwritten by the next attempt). ``fail_point`` (tests only) is called with each
    name of :data:`FAIL_POINTS` once that storage step is done.

    One path for every key (:class:`~bcd.keys.node.NodeKey`): the next key is made
    (:func:`_maker`), node.key.next written, the CSR signed by the next key and the
    proof of possession by the current one, the answer checked, the result stored. A
    TPM-held key renews through ``bcd helper`` (``tpm``) into a new TPM key, with the
    AK's ``key_attestation`` when the leaf names an AK; any helper failure fails the
    renewal before anything is sent. A file key moves into the TPM here (seed 003,
    "Renewal" step 1) when ``bcd helper`` serves the node and ``tpm_mode`` (``[tpm]
    mode``) is ``auto`` or ``required``: the next key is made in the TPM, the proof
    still by the file key, with no ``key_attestation`` (a file-key leaf names no AK);
    the new state is a :class:`~bcd.identity.LoadedTpmState`. When the helper cannot
    make or use that key, ``auto`` renews this once with a file key (logged as a
    warning) and ``required`` fails the renewal before anything is sent. ``off``, or no
    helper (``bcd node`` never opens the TPM itself), keeps a file key.
    """
    current = node_key_of(state, tpm=tpm)  # a TPM-held key without bcd helper is refused
    moving = current.kind == "file" and tpm is not None and tpm_mode != "off"
    try:
        prepared = await _prepare(state, current, _maker(current, tpm, moving), wall, fail_point)
    except HelperError as exc:
        if not moving:
            raise JoinError(f"the renewal failed before anything was sent: {exc}") from exc
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
        prepared = await _prepare(state, current, FileKeyMaker(), wall, fail_point)
    return await _finish(state, send, prepared, signing_pin, fail_point, tpm)


def _maker(current: NodeKey, tpm: HelperKeys | None, moving: bool) -> KeyMaker:
    """Where the next key is made: in the TPM through the helper for a TPM-held key (it
    stays one) and for a file key moving into the TPM; else a file key."""
    if tpm is not None and (current.kind == "tpm" or moving):
        return HelperKeyMaker(tpm)
    return FileKeyMaker()


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A renewal ready to send: node.key.next (``key``) written, the request built."""

    request: wire.RenewRequest
    key: NodeKey


async def _prepare(
    state: AnyState,
    current: NodeKey,
    maker: KeyMaker,
    wall: Callable[[], float],
    fail_point: FailPoint | None,
) -> _Prepared:
    """Steps 1-3: the next key, node.key.next, the CSR (by the next key), the proof of
    possession (by the current key) and, for a leaf naming an AK, the key attestation.

    Every helper call happens here, before anything is sent (a HelperError leaves at
    most a stale node.key.next).
    """
    fresh = await maker.make(state.leaf_info.statements)
    await trio.to_thread.run_sync(write_next_key, store_of(state), fresh.key.stored())
    if fail_point is not None:
        fail_point(FAIL_POINTS[0])
    csr_der = await fresh.key.csr()
    client_time_ms = int(wall() * 1000)
    message = pki.renew_pop_message(csr_der, state.identity.node_id, client_time_ms)
    pop_sig = await current.sign_digest(hashlib.sha256(message).digest())
    attestation = await fresh.attest(csr_der) if fresh.attest is not None else None
    request = wire.RenewRequest(csr_der, state.identity.chain, client_time_ms, pop_sig, attestation)
    return _Prepared(request, fresh.key)


async def _finish(
    state: AnyState,
    send: Sender,
    prepared: _Prepared,
    signing_pin: str,
    fail_point: FailPoint | None,
    tpm: HelperKeys | None,
) -> AnyState:
    """Steps 4-5: send, check the answer, store (node.key.next, identity.json, rename)."""
    req, key = prepared.request, prepared.key
    signed = await send(wire.dumps(req.to_json()))
    body = verify_renewed(
        signed,
        signing_pin=signing_pin,
        csr_der=req.csr_der,
        key=key.public_key,
        current=state.leaf_info,
    )
    identity = issued_identity(body, key.kind, state.identity)
    try:
        await trio.to_thread.run_sync(
            store_renewal, store_of(state), identity, key.stored(), fail_point
        )
    except IdentityError:
        # Part of the store may have happened: settle it the way a restart would, and
        # go on with whatever it holds now.
        settled = await trio.to_thread.run_sync(_reload, *_where(state, tpm))
        if settled is not None and settled.identity == identity:
            return settled
        raise
    return state_with(state.data_dir, identity, key, state.store)


def build_request(
    state: LoadedState, next_key: ec.EllipticCurvePrivateKey, client_time_ms: int
) -> tuple[bytes, wire.RenewRequest]:
    """The CSR for a file key ``next_key`` and the RenewRequest proving ``state``'s file
    key, as :func:`renew_once` builds them (for a caller without trio: tests, tools)."""
    csr_der = pki.make_csr(next_key)
    message = pki.renew_pop_message(csr_der, state.identity.node_id, client_time_ms)
    return csr_der, wire.RenewRequest(
        csr_der=csr_der,
        chain=state.identity.chain,
        client_time_ms=client_time_ms,
        pop_sig=pki.sign_p1363(state.key, message),
    )


def _where(state: AnyState, tpm: HelperKeys | None) -> tuple[Any, ...]:
    """:func:`_reload`'s arguments for ``state``: its store (data directory), and the
    helper when there is one."""
    where: StoreOrDir = state.data_dir if state.store is None else state.store
    return (where,) if tpm is None else (where, tpm)


def _reload(where: StoreOrDir, tpm: HelperKeys | None = None) -> AnyState | None:
    """LoadState from a worker thread (a TPM key derived through the helper)."""
    store = as_store(where)
    try:
        if tpm is None:
            return load_from(store)
        return load_from(store, tpm.derive_sync)
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
    raise refusal(resp, failed="the renewal failed", refused=REFUSED, unauthenticated=REVOKED)


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


class OldKeys:
    """Node keys a renewal replaced, each held ``hold_s`` seconds (trio clock), then dropped.

    Nothing may still be signing with a key when it goes: a handshake or statement
    started just before the renewal finishes with the old key in that time.
    ``on_unload`` is called with each key as it goes.
    """

    def __init__(
        self,
        hold_s: float = OLD_KEY_HOLD_S,
        on_unload: Callable[[NodeKey], None] | None = None,
    ) -> None:
        self.hold_s = hold_s
        self._on_unload = on_unload
        self._held: list[tuple[float, NodeKey]] = []

    def __len__(self) -> int:
        return len(self._held)

    def keys(self) -> tuple[NodeKey, ...]:
        return tuple(key for _, key in self._held)

    def retire(self, key: NodeKey, now: float) -> None:
        """Hold ``key`` until ``now + hold_s`` (trio time)."""
        self._held.append((now + self.hold_s, key))

    def next_due(self) -> float | None:
        """The trio time at which the next key goes, if one is held."""
        return min((due for due, _ in self._held), default=None)

    def unload_due(self, now: float) -> list[NodeKey]:
        """Drop every key whose time has come; return them."""
        going = [key for due, key in self._held if due <= now]
        self._held = [(due, key) for due, key in self._held if due > now]
        for key in going:
            if self._on_unload is not None:
                self._on_unload(key)
        return going


async def _pause(seconds: float, old_keys: OldKeys, log: logging.Logger) -> None:
    """Sleep ``seconds`` of trio time, waking to unload old keys when they are due; each
    is released (a TPM-held one in ``bcd helper``, as the seed says)."""
    end = trio.current_time() + max(seconds, 0.0)
    while True:
        going = old_keys.unload_due(trio.current_time())
        if going:
            log.info("the previous node key was unloaded")
        for key in going:
            await _release(key, log)
        due = old_keys.next_due()
        wake = end if due is None else min(end, due)
        if trio.current_time() >= end:
            await trio.lowlevel.checkpoint()
            return
        await trio.sleep_until(wake)


async def _release(key: NodeKey, log: logging.Logger) -> None:
    try:
        released = await key.release()
    except HelperError as exc:  # the helper holds nothing between calls: only logged
        log.warning("bcd helper did not release the previous node key: %s", exc)
    else:
        if released:
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
    on_failure: Callable[[], Awaitable[None]] | None = None,
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
    from it. ``on_failure`` (the metrics textfile) is awaited after each failed
    attempt, once the state is settled.
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
                await _pause(min(remaining, MAX_NAP_S), keys, log)
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
                exc.notice, signing_pin, state, datetime.fromtimestamp(wall(), UTC), exc.reason
            )
            if isinstance(verdict, CertificateRevoked | IdentityExpired):
                raise verdict from exc
            wait = _failed(state, verdict, attempt, wall, log)
            if on_failure is not None:
                await on_failure()
            log.info("renewal: next attempt in %.1f s", wait, extra={"waitSeconds": wait})
            await _pause(wait, keys, log)
            continue
        except BcdError as exc:
            wait = _failed(state, exc, attempt, wall, log)
            adopted = isinstance(exc, IdentityError) and await _adopt_disk_state(
                state, set_state, log, tpm
            )
            if on_failure is not None:
                await on_failure()
            if adopted:
                keys.retire(node_key_of(state, tpm=tpm), trio.current_time())
                attempt = 0
                continue
            log.info("renewal: next attempt in %.1f s", wait, extra={"waitSeconds": wait})
            await _pause(wait, keys, log)
            continue
        set_state(new)
        keys.retire(node_key_of(state, tpm=tpm), trio.current_time())
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
    """After a storage failure, go on with what the store holds (settled).

    Only a newer certificate of this same node is adopted; anything else on disk is
    left for the next start to judge.
    """
    on_disk = await trio.to_thread.run_sync(_reload, *_where(state, tpm))
    if (
        on_disk is not None
        # a file key may have moved into the TPM; a TPM key never goes back to a file
        and not (state.identity.key == "tpm" and on_disk.identity.key == "file")
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
    """Journal a renewal that is done (stored, in use): shielded, so a stop arriving
    while it is written (SIGTERM) does not leave the journal a renewal short."""
    try:
        with trio.CancelScope(shield=True):
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

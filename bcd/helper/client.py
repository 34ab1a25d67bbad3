"""The node's client of ``bcd helper``: every call under a timeout, every answer checked.

``bcd node`` runs unprivileged and never opens the TPM; it asks the helper over
its Unix socket. Each call opens a connection, sends one request and reads one
answer within :data:`CALL_TIMEOUT` seconds. The helper is not believed on its word:

- ``tpm.nodekey``: the public area must have the node-key attributes and, when the
  record is pinned, be the pinned key; the SPKI must be the public area's key;
- ``tpm.sign``: the signature must verify over the digest with the key's public half;
- ``tpm.ak``: the public area must have bcd's AK attributes and the name must be its
  name (and the expected name, when the caller knows one);
- ``tpm.certify``: the attestation must verify against the AK the helper announced,
  certify the node key's name, and carry the qualifying data sent.

An answer that fails one of these is refused with a :class:`~bcd.helper.HelperError`
naming the failed check. No tpm2-pytss here.
"""

from __future__ import annotations

import hmac
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import trio

from bcd.helper import HelperError, HelperKeyMismatch, HelperNoTpm
from bcd.helper.protocol import (
    FORBIDDEN,
    KEY_MISMATCH,
    MAX_LINE,
    NO_TPM,
    AkCall,
    AkResult,
    Call,
    CertifyCall,
    CertifyResult,
    ErrorAnswer,
    InfoCall,
    InfoResult,
    LineBuffer,
    NodeKeyCall,
    NodeKeyResult,
    ProtocolError,
    ReleaseCall,
    ReleaseResult,
    Result,
    SignCall,
    SignResult,
    encode_request,
    parse_answer,
)
from bcd.pki import spki_der
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmError, TpmKeyMismatch
from bcd.tpm.record import NodeKeyPublic, NodeKeyRecord, node_key_public
from bcd.tpm.templates import check_ak_public
from bcd.tpm.verify import verify_certify, verify_p1363_digest

CALL_TIMEOUT = 30.0

_R = TypeVar("_R", bound=Result)


@dataclass(frozen=True, slots=True)
class HelperAk:
    """The AK the helper announced: its TPMT_PUBLIC and its name (both checked)."""

    public_area: bytes
    name: bytes


@dataclass(frozen=True, slots=True)
class Certification:
    """A checked TPM2_Certify: the TPMS_ATTEST and the AK's P1363 signature over it."""

    attest: bytes
    signature: bytes
    ak: HelperAk


class HelperClient:
    """Calls ``bcd helper`` at ``socket_path``; safe to share between tasks."""

    def __init__(self, socket_path: Path, *, timeout: float = CALL_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._ids = itertools.count(1)

    # --- the calls --------------------------------------------------------------------

    async def nodekey(self, record: NodeKeyRecord) -> NodeKeyPublic:
        """Derive the record's key in the helper's TPM; its checked public half."""
        result = await self._call(NodeKeyCall(record), NodeKeyResult)
        try:
            public = node_key_public(result.public_area, record)
        except TpmKeyMismatch as exc:
            raise HelperKeyMismatch(KEY_MISMATCH_MESSAGE) from exc
        except TpmError as exc:
            raise _failed(
                "tpm.nodekey", f"the derived key does not have the node-key attributes ({exc})"
            ) from exc
        if not hmac.compare_digest(result.spki, spki_der(public.public_key)):
            raise _failed("tpm.nodekey", "the SPKI is not the key of the public area")
        return public

    async def sign(self, record: NodeKeyRecord, key: NodeKeyPublic, digest: bytes) -> bytes:
        """A P1363 signature over a SHA-256 digest by the record's key (``key``, checked)."""
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise HelperError("the helper signs a 32-byte SHA-256 digest")
        result = await self._call(SignCall(record, digest), SignResult)
        try:
            verify_p1363_digest(key.public_key, result.signature, digest, "the signature")
        except TpmError as exc:
            raise _failed(
                "tpm.sign",
                f"the signature does not verify against the node key ({exc}): "
                "the helper's signature is not the node key's",
            ) from exc
        return result.signature

    async def ak(self, expected_name: bytes | None = None) -> HelperAk:
        """The helper's AK; with ``expected_name``, it must be that AK."""
        result = await self._call(AkCall(), AkResult)
        try:
            info = check_ak_public(result.public_area)
        except TpmError as exc:
            raise _failed("tpm.ak", f"the AK does not have the AK attributes ({exc})") from exc
        if not hmac.compare_digest(info.name, result.name):
            raise _failed("tpm.ak", "the AK's name is not the name of its public area")
        if expected_name is not None and not hmac.compare_digest(info.name, expected_name):
            raise HelperError("the TPM derives another AK than the certificate names")
        return HelperAk(result.public_area, result.name)

    async def certify(
        self,
        record: NodeKeyRecord,
        key: NodeKeyPublic,
        qualifying_data: bytes,
        ak: HelperAk | None = None,
    ) -> Certification:
        """The AK's TPM2_Certify of the record's key (``key``) over ``qualifying_data``.

        The certification must come from ``ak``, by default the AK the helper
        announces now (:meth:`ak`).
        """
        if not isinstance(qualifying_data, bytes) or len(qualifying_data) != 32:
            raise HelperError("the qualifying data is a 32-byte SHA-256 digest")
        if ak is None:
            ak = await self.ak()
        result = await self._call(CertifyCall(record, qualifying_data), CertifyResult)
        try:
            verify_certify(
                result.attest, result.signature, ak.public_area, key.name, qualifying_data
            )
        except TpmError as exc:
            raise _failed(
                "tpm.certify",
                f"the certification does not verify against the AK the helper announced ({exc})"
                + (
                    "; the helper certified with another AK" if "AK's signature" in str(exc) else ""
                ),
            ) from exc
        return Certification(result.attest, result.signature, ak)

    async def release(self, record: NodeKeyRecord) -> None:
        """Tell the helper the key is no longer used."""
        await self._call(ReleaseCall(record), ReleaseResult)

    async def served_node(self) -> str:
        """The node id of the helper's root join record ("" when it has none)."""
        result = await self._call(InfoCall(), InfoResult)
        try:
            return result.node_id.decode("ascii")
        except UnicodeDecodeError as exc:
            raise _failed("helper.info", "the node id is not ASCII") from exc

    # --- the exchange -----------------------------------------------------------------

    async def _call(self, call: Call, kind: type[_R]) -> _R:
        try:
            with trio.fail_after(self.timeout):
                result = await self._exchange(call)
        except trio.TooSlowError as exc:
            raise HelperError(
                f"bcd helper did not answer {call.method} within {self.timeout:g} seconds"
            ) from exc
        if not isinstance(result, kind):  # pragma: no cover - parse_answer gives the kind
            raise _failed(call.method, "the answer is for another method")
        return result

    async def _exchange(self, call: Call) -> Result:
        path = self.socket_path
        request_id = next(self._ids)
        try:
            stream = await trio.open_unix_socket(str(path))
        except FileNotFoundError as exc:
            raise HelperError(
                f"bcd helper is not running: no socket at {path} (start bcd-helper.service)"
            ) from exc
        except PermissionError as exc:
            raise HelperError(
                f"cannot use bcd helper at {path}: permission denied (bcd node must run as "
                "the [helper] user)"
            ) from exc
        except OSError as exc:
            raise HelperError(f"cannot reach bcd helper at {path}: {exc.strerror or exc}") from exc
        async with stream:
            try:
                await stream.send_all(encode_request(request_id, call))
                line = await _read_line(stream)
            except (trio.BrokenResourceError, OSError) as exc:
                raise HelperError(
                    f"the connection to bcd helper broke during {call.method}"
                ) from exc
        if line is None:
            raise HelperError(f"bcd helper closed the connection without answering {call.method}")
        try:
            answer = parse_answer(line, call.method)
        except ProtocolError as exc:
            raise _failed(call.method, f"malformed answer: {exc}") from exc
        outcome = answer.outcome
        if isinstance(outcome, ErrorAnswer):
            if outcome.code == KEY_MISMATCH:
                raise HelperKeyMismatch(KEY_MISMATCH_MESSAGE)
            if outcome.code == NO_TPM:
                raise HelperNoTpm(f"bcd helper has no usable TPM: {outcome.message}")
            if outcome.code == FORBIDDEN:
                raise HelperError(
                    f"bcd helper refused this user ({outcome.message}); bcd node must run as "
                    "the [helper] user"
                )
            raise HelperError(f"bcd helper could not answer {call.method}: {outcome.message}")
        if answer.id != request_id:
            raise _failed(call.method, "the answer is for another request")
        return outcome


async def _read_line(stream: trio.abc.ReceiveStream) -> bytes | None:
    buffer = LineBuffer(MAX_LINE)
    while True:
        try:
            line = buffer.next_line()
        except ProtocolError as exc:
            raise HelperError(f"bcd helper sent a line over {MAX_LINE} bytes") from exc
        if line is not None:
            return line
        data = await stream.receive_some(16384)
        if not data:
            return None
        buffer.feed(data)


def _failed(method: str, check: str) -> HelperError:
    return HelperError(f"refused bcd helper's answer to {method}: {check}")

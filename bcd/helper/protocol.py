"""The helper protocol: one JSON object per line each way over a Unix stream socket.

Pure: no sockets, no TPM. A request is ``{"id", "method", "params"}``; an answer is
``{"id", "result"}`` or ``{"id", "error": {"code", "message"}}`` (``id`` is ``null``
when the request had none that parsed). Binary values are standard base64 with
padding. A line is at most :data:`MAX_LINE` bytes before its newline.

=============  =====================================  ===========================
method         params                                 result
=============  =====================================  ===========================
tpm.nodekey    record                                 public (TPMT_PUBLIC), spki
tpm.sign       record, digest (32 bytes)              signature (P1363, 64 bytes)
tpm.ak         (none)                                 public (TPMT_PUBLIC), name
tpm.certify    record, qualifying_data (32 bytes)     attest (TPMS_ATTEST), signature
tpm.release    record                                 (empty)
=============  =====================================  ===========================

``record`` is a node.key :class:`~bcd.tpm.record.NodeKeyRecord` as a JSON object:
the key is named by its ``unique``; the record also carries the template (only the
node-key template parses) and the pin, which the helper checks as well.

Every parse failure is a :class:`ProtocolError` whose ``code`` is the one to answer
with and whose message never echoes the input.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from bcd.helper import HelperError
from bcd.tpm import TpmError
from bcd.tpm.record import NodeKeyRecord

MAX_LINE: Final = 64 * 1024
MAX_ID: Final = 2**53 - 1
MAX_MESSAGE: Final = 500
DIGEST_SIZE: Final = 32

# error codes
BAD_REQUEST: Final = "bad-request"
UNKNOWN_METHOD: Final = "unknown-method"
TOO_LARGE: Final = "too-large"
FORBIDDEN: Final = "forbidden"
NO_TPM: Final = "no-tpm"
TPM_FAILED: Final = "tpm"
KEY_MISMATCH: Final = "key-mismatch"
INTERNAL: Final = "internal"
BAD_ANSWER: Final = "bad-answer"  # only raised on the client side, never sent
_CODE = re.compile(r"[a-z][a-z0-9-]{0,31}")


class ProtocolError(HelperError):
    """Raised when a request or an answer does not parse; ``code`` is the error code."""

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


# --- requests -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeKeyCall:
    """``tpm.nodekey``: derive the record's key and return its public area."""

    record: NodeKeyRecord
    method: str = "tpm.nodekey"


@dataclass(frozen=True, slots=True)
class SignCall:
    """``tpm.sign``: sign a SHA-256 digest with the record's key."""

    record: NodeKeyRecord
    digest: bytes
    method: str = "tpm.sign"


@dataclass(frozen=True, slots=True)
class AkCall:
    """``tpm.ak``: the AK's public area and name."""

    method: str = "tpm.ak"


@dataclass(frozen=True, slots=True)
class CertifyCall:
    """``tpm.certify``: the AK's TPM2_Certify of the record's key over qualifying data."""

    record: NodeKeyRecord
    qualifying_data: bytes
    method: str = "tpm.certify"


@dataclass(frozen=True, slots=True)
class ReleaseCall:
    """``tpm.release``: forget anything held for the record's key."""

    record: NodeKeyRecord
    method: str = "tpm.release"


@dataclass(frozen=True, slots=True)
class InfoCall:
    """``helper.info``: the node this helper serves (from root's join record)."""

    method: str = "helper.info"


Call = NodeKeyCall | SignCall | AkCall | CertifyCall | ReleaseCall | InfoCall
METHODS: Final = (
    "tpm.nodekey", "tpm.sign", "tpm.ak", "tpm.certify", "tpm.release", "helper.info",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    call: Call


def encode_request(request_id: int, call: Call) -> bytes:
    """One request line (with its newline)."""
    params: dict[str, Any] = {}
    if not isinstance(call, AkCall | InfoCall):
        params["record"] = call.record.to_dict()
    if isinstance(call, SignCall):
        params["digest"] = b64(call.digest)
    elif isinstance(call, CertifyCall):
        params["qualifying_data"] = b64(call.qualifying_data)
    return _line({"id": request_id, "method": call.method, "params": params})


def parse_request(line: bytes) -> Request:
    """Parse one request line (without its newline)."""
    doc = _object(line, "the request")
    request_id = doc.get("id")
    if not _valid_id(request_id):
        raise ProtocolError(BAD_REQUEST, "the request has no valid id (an integer)")
    assert isinstance(request_id, int)
    try:
        if set(doc) != {"id", "method", "params"}:
            raise ProtocolError(BAD_REQUEST, "a request has exactly id, method and params")
        method = doc["method"]
        params = doc["params"]
        if not isinstance(method, str):
            raise ProtocolError(BAD_REQUEST, "the method is not a string")
        if method not in METHODS:
            raise ProtocolError(UNKNOWN_METHOD, f"unknown method {_printable(method, 40)!r}")
        if not isinstance(params, dict):
            raise ProtocolError(BAD_REQUEST, "params is not an object")
        return Request(request_id, _parse_call(method, params))
    except ProtocolError as exc:
        exc.request_id = request_id
        raise


def _parse_call(method: str, params: dict[str, Any]) -> Call:
    if method == "tpm.ak":
        _keys(params, set(), method)
        return AkCall()
    if method == "helper.info":
        _keys(params, set(), method)
        return InfoCall()
    if method in ("tpm.nodekey", "tpm.release"):
        _keys(params, {"record"}, method)
        record = _record(params["record"])
        return NodeKeyCall(record) if method == "tpm.nodekey" else ReleaseCall(record)
    if method == "tpm.sign":
        _keys(params, {"record", "digest"}, method)
        return SignCall(_record(params["record"]), _digest(params["digest"], "digest"))
    _keys(params, {"record", "qualifying_data"}, method)
    return CertifyCall(
        _record(params["record"]), _digest(params["qualifying_data"], "qualifying_data")
    )


def _keys(params: dict[str, Any], expected: set[str], method: str) -> None:
    if set(params) != expected:
        names = ", ".join(sorted(expected)) or "nothing"
        raise ProtocolError(BAD_REQUEST, f"{method} takes {names} in params")


def _record(value: object) -> NodeKeyRecord:
    try:
        return NodeKeyRecord.from_dict(value)
    except TpmError as exc:
        # NodeKeyRecord's messages name the field, never echo the value
        raise ProtocolError(BAD_REQUEST, f"the record is not a node-key record ({exc})") from exc


def _digest(value: object, name: str) -> bytes:
    data = unb64(value, name, BAD_REQUEST)
    if len(data) != DIGEST_SIZE:
        raise ProtocolError(BAD_REQUEST, f"{name} is not a 32-byte SHA-256 digest")
    return data


# --- answers ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeKeyResult:
    public_area: bytes
    spki: bytes


@dataclass(frozen=True, slots=True)
class SignResult:
    signature: bytes


@dataclass(frozen=True, slots=True)
class AkResult:
    public_area: bytes
    name: bytes


@dataclass(frozen=True, slots=True)
class CertifyResult:
    attest: bytes
    signature: bytes


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    pass


@dataclass(frozen=True, slots=True)
class InfoResult:
    node_id: bytes
    """ASCII; empty when the helper has no join record to serve."""


Result = NodeKeyResult | SignResult | AkResult | CertifyResult | ReleaseResult | InfoResult

_RESULT_FIELDS: dict[str, tuple[type[Result], tuple[tuple[str, str], ...]]] = {
    # method: (result type, ((JSON name, attribute), ...))
    "tpm.nodekey": (NodeKeyResult, (("public", "public_area"), ("spki", "spki"))),
    "tpm.sign": (SignResult, (("signature", "signature"),)),
    "tpm.ak": (AkResult, (("public", "public_area"), ("name", "name"))),
    "tpm.certify": (CertifyResult, (("attest", "attest"), ("signature", "signature"))),
    "tpm.release": (ReleaseResult, ()),
    "helper.info": (InfoResult, (("node", "node_id"),)),
}
_METHOD_OF_RESULT = {kind: method for method, (kind, _) in _RESULT_FIELDS.items()}


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Answer:
    id: int | None
    outcome: Result | ErrorAnswer


def method_of(result: Result) -> str:
    """The method a result answers."""
    return _METHOD_OF_RESULT[type(result)]


def encode_result(request_id: int, result: Result) -> bytes:
    """One answer line carrying a result."""
    _, fields = _RESULT_FIELDS[method_of(result)]
    body = {name: b64(getattr(result, attribute)) for name, attribute in fields}
    return _line({"id": request_id, "result": body})


def encode_error(request_id: int | None, code: str, message: str) -> bytes:
    """One answer line carrying an error (the message is cut and made printable)."""
    if not _CODE.fullmatch(code):
        raise ValueError(f"not an error code: {code!r}")
    error = {"code": code, "message": _printable(message, MAX_MESSAGE)}
    return _line({"id": request_id, "error": error})


def parse_answer(line: bytes, method: str) -> Answer:
    """Parse one answer line (without its newline) to a request for ``method``."""
    if method not in _RESULT_FIELDS:
        raise ValueError(f"unknown method {method!r}")
    doc = _object(line, "the answer", code=BAD_ANSWER)
    answer_id = doc.get("id")
    if answer_id is not None and not _valid_id(answer_id):
        raise ProtocolError(BAD_ANSWER, "the answer's id is not an integer")
    assert answer_id is None or isinstance(answer_id, int)
    if set(doc) == {"id", "error"}:
        error = doc["error"]
        if not isinstance(error, dict) or set(error) != {"code", "message"}:
            raise ProtocolError(BAD_ANSWER, "the error is not an object with code and message")
        code, message = error["code"], error["message"]
        if not isinstance(code, str) or not _CODE.fullmatch(code):
            raise ProtocolError(BAD_ANSWER, "the error code is not a code")
        if not isinstance(message, str):
            raise ProtocolError(BAD_ANSWER, "the error message is not a string")
        return Answer(answer_id, ErrorAnswer(code, _printable(message, MAX_MESSAGE)))
    if set(doc) != {"id", "result"} or answer_id is None:
        raise ProtocolError(BAD_ANSWER, "an answer has exactly id and result, or id and error")
    body = doc["result"]
    kind, fields = _RESULT_FIELDS[method]
    if not isinstance(body, dict) or set(body) != {name for name, _ in fields}:
        names = ", ".join(name for name, _ in fields) or "nothing"
        raise ProtocolError(BAD_ANSWER, f"the result of {method} must hold {names}")
    values = {attribute: unb64(body[name], name, BAD_ANSWER) for name, attribute in fields}
    return Answer(answer_id, kind(**values))


# --- lines --------------------------------------------------------------------------


class LineBuffer:
    """Splits a byte stream into lines of at most :data:`MAX_LINE` bytes.

    :meth:`feed` what the socket gave, then take lines with :meth:`next_line` until
    it returns ``None``. A line longer than the limit raises ProtocolError(too-large).
    """

    def __init__(self, limit: int = MAX_LINE) -> None:
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        self._buffer += data

    def next_line(self) -> bytes | None:
        end = self._buffer.find(b"\n", 0, self._limit + 1)
        if end < 0:
            if len(self._buffer) > self._limit:
                raise ProtocolError(TOO_LARGE, f"a line is longer than {self._limit} bytes")
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line

    @property
    def pending(self) -> int:
        """How many bytes wait for their newline."""
        return len(self._buffer)


# --- values -------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(value: object, name: str, code: str) -> bytes:
    """Decode canonical standard base64 (with padding); raise ProtocolError with ``code``."""
    if not isinstance(value, str) or len(value) > MAX_LINE:
        raise ProtocolError(code, f"{name} is not base64")
    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise ProtocolError(code, f"{name} is not base64") from exc
    if b64(data) != value:
        raise ProtocolError(code, f"{name} is not canonical base64")
    return data


def _line(doc: dict[str, Any]) -> bytes:
    data = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    if len(data) > MAX_LINE:
        raise ValueError(f"a protocol line would exceed {MAX_LINE} bytes")
    return data + b"\n"


def _valid_id(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_ID


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError("duplicate key")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _object(line: bytes, what: str, code: str = BAD_REQUEST) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError(TOO_LARGE, f"{what} is longer than {MAX_LINE} bytes")
    try:
        doc = json.loads(
            line.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(code, f"{what} is not a JSON object") from exc
    if not isinstance(doc, dict):
        raise ProtocolError(code, f"{what} is not a JSON object")
    return doc


def _printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, anything unprintable escaped."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return out + ("…" if len(text) > limit else "")

"""The gateway's answer as the node's calls see it, and the one map of its refusals.

:class:`Response` is what :class:`bcd.gatewayclient.GatewayClient` returns (status,
headers with lower-case names, body). :func:`refusal` turns an answer other than 200
into the :mod:`bcd.errors` exception each call raises: an answer without a
``{"code", "message"}`` body and ``UNAVAILABLE`` or ``RESOURCE_EXHAUSTED`` are
:class:`~bcd.errors.RetryableError` (the latter two with the ``retry-pushback-ms``
wait, :func:`bcd.wire.parse_pushback`), ``UNAUTHENTICATED`` a
:class:`~bcd.errors.GatewayUnauthenticated` carrying the signed notice (for the calls
made with a node certificate), ``ACCESS_DENIED`` the call's refusal, and any other
code a :class:`~bcd.errors.JoinError` naming it. No httpx here: the agent imports
this at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bcd import wire
from bcd.errors import BcdError, GatewayUnauthenticated, JoinError, RetryableError

ERROR_BODY_MAX = 64 * 1024


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = field(repr=False)


def notice_in(body: bytes) -> object:
    """The ``notice`` of an error answer (the signed RevocationNotice), if any."""
    try:
        obj = wire.loads_object(body, ERROR_BODY_MAX)
    except wire.WireError:
        return None
    return obj.get("notice")


def reason_in(body: bytes) -> str | None:
    """The ``reason`` of an error answer (``unknown-certificate``, …), if it is a short
    printable word; a hint only, a relaying gateway may send any."""
    try:
        obj = wire.loads_object(body, ERROR_BODY_MAX)
    except wire.WireError:
        return None
    reason = obj.get("reason")
    if isinstance(reason, str) and 0 < len(reason) <= 64 and reason.isprintable():
        return reason
    return None


def refusal(
    resp: Response,
    *,
    failed: str,
    refused: str | None = None,
    unauthenticated: str | None = None,
    say_when: bool = False,
) -> BcdError:
    """The exception for an answer other than 200.

    ``failed`` starts the message for an unexpected code ("the join failed");
    ``refused`` is the message for ``ACCESS_DENIED`` (else it is one more code);
    ``unauthenticated`` the message for ``UNAUTHENTICATED`` (else one more code);
    ``say_when`` adds when to ask again to a retryable answer's message.
    """
    err = wire.parse_error(resp.body)
    if err is None:
        return RetryableError(f"the gateway answered HTTP {resp.status}")
    if unauthenticated is not None and err.code == "UNAUTHENTICATED":
        return GatewayUnauthenticated(unauthenticated, notice_in(resp.body), reason_in(resp.body))
    if err.code in wire.RETRYABLE:
        wait = wire.parse_pushback(resp.headers.get("retry-pushback-ms"))
        later = ""
        if say_when:
            later = f"; ask again in {wait:.0f} s" if wait is not None else "; ask again later"
        return RetryableError(f"{err.code}: {err.message}{later}", wait)
    if refused is not None and err.code == "ACCESS_DENIED":
        return JoinError(refused)
    return JoinError(f"{failed}: {err.code}: {err.message}")

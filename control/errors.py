"""The control plane's one error hierarchy.

::

    ControlError(code, message)     an answer the API or gateway sends as {"code", "message"}
    ├── Refused                     a join or renewal refusal: the client sees only the
    │   │                           uniform ACCESS_DENIED text; ``reason`` stays server-side
    │   └── RenewRefused            a renewal's (control.renewal), with the node and serial
    ├── StoreUnavailable            the database does not answer now: UNAVAILABLE with a
    │                               pushback, never reported as a bug
    └── StoreConflict               a uniqueness race in the store: CONFLICT

Only ``code`` and ``message`` ever leave the process; an exception's own text, a
traceback or a database error never does.
"""

from __future__ import annotations


class ControlError(Exception):
    """Raised to answer a request with ``code`` and a message fit for the caller."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after_ms: int | None = None,
        details: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.details = details or {}
        """Fields beside code and message in the answer (the signed ``notice`` of an
        UNAUTHENTICATED for a revoked certificate); never an exception's text."""


def invalid(message: str) -> ControlError:
    return ControlError("INVALID_ARGUMENT", message)


def not_found(what: str = "not found") -> ControlError:
    return ControlError("NOT_FOUND", what)


class Refused(ControlError):
    """Raised inside Join or Renew; the caller sees ``ACCESS_DENIED`` and ``public``.

    ``reason`` is ``<attestor>:<reason>`` (or a renew reason) and goes only to the
    ``security.*.refused`` event; ``tenant_id`` is set once the caller proved a secret.
    """

    def __init__(self, public: str, reason: str, tenant_id: str | None = None) -> None:
        super().__init__("ACCESS_DENIED", public)
        self.reason = reason
        self.tenant_id = tenant_id


STORE_PUSHBACK_MS = 2_000


class StoreUnavailable(ControlError):
    """Raised by the store when the database cannot be reached or stops answering."""

    def __init__(self, message: str = "the database is unavailable; retry") -> None:
        super().__init__("UNAVAILABLE", message, retry_after_ms=STORE_PUSHBACK_MS)


CONFLICT_MESSAGE = "a concurrent change conflicted with this one; retry"


class StoreConflict(ControlError):
    """Raised by the store when a unique constraint is violated.

    Callers that know the race catch it and answer in their own words (a join judged
    again, ``This node renewed concurrently; retry``); one that reaches the API
    unhandled is answered ``CONFLICT``, never as a bug."""

    def __init__(self, message: str = CONFLICT_MESSAGE) -> None:
        super().__init__("CONFLICT", message)

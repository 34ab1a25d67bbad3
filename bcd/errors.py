"""The agent's one error hierarchy.

::

    BcdError                 anything bcd reports to its user as one line
    ├── ConfigError          config.toml is missing, malformed, or has a bad pin
    ├── UsageError           the command line is wrong (exit 2)
    ├── CredentialError      the join credential could not be read safely
    ├── IdentityError        the identity in the data directory does not load
    │   └── IdentityExpired  the certificate expired before a renewal could be made
    ├── JoinError            the join failed (refused, or the answer did not verify)
    │   └── RetryableError   the control plane asked to retry (UNAVAILABLE, ...)
    │       ├── GatewayUnauthenticated  UNAUTHENTICATED, with the notice it carried
    │       └── CertificateUnknown  the gateway says the store has no row for this certificate
    ├── CertificateRevoked   a verified RevocationNotice: the node certificate is revoked
    └── TransportError       the gateway could not be reached or did not verify
        └── PeerVerificationError  the gateway's certificate did not verify (never retried)

Elsewhere, beside their modules: ``TpmError`` (bcd.tpm), ``HelperError``
(bcd.helper), ``JournalError`` (bcd.journal) are BcdErrors; ``SessionRefused``
(bcd.session) is a TransportError.

Every message says what happened and, where there is one, the way back.
Lower-layer exceptions are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations


class BcdError(Exception):
    """Raised for any failure bcd reports to its user; ``str()`` is the message."""

    exit_code = 1


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (itself, or inside an exception group), if any."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = os_error_in(inner)
            if found is not None:
                return found
    return None


def describe_os_error(err: OSError) -> str:
    """``strerror`` and errno, without the file name or address (they may say too much)."""
    return f"{err.strerror or type(err).__name__} (errno {err.errno})"


class ConfigError(BcdError):
    """Raised when config.toml cannot be used: missing, unknown key, malformed pin."""


class UsageError(BcdError):
    """Raised when the command line is wrong; bcd exits 2."""

    exit_code = 2


class CredentialError(BcdError):
    """Raised when the join credential cannot be read safely (never echoes it)."""


class IdentityError(BcdError):
    """Raised when the identity in the data directory does not load."""


class IdentityExpired(IdentityError):
    """Raised by the agent when its certificate expired (a renewal could not be made in
    time): it stops with the way back, as bcd doctor reports it."""


class JoinError(BcdError):
    """Raised when the join is refused or its answer does not verify."""


class RetryableError(JoinError):
    """Raised for an answer that may be retried; ``pushback_s`` is the server's wait."""

    def __init__(self, message: str, pushback_s: float | None = None) -> None:
        super().__init__(message)
        self.pushback_s = pushback_s


class GatewayUnauthenticated(RetryableError):
    """Raised when the gateway answers UNAUTHENTICATED; ``notice`` is the signed
    RevocationNotice it sent with it (None when it sent none). Only a notice that
    verifies makes it a :class:`CertificateRevoked` (:mod:`bcd.revocation`)."""

    def __init__(self, message: str, notice: object = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.notice = notice
        self.reason = reason
        """The answer's ``reason`` (``unknown-certificate``, ``revoked``, …): a hint only,
        a relaying gateway can send any."""


class CertificateUnknown(RetryableError):
    """Raised when the gateway answers UNAUTHENTICATED with ``reason``
    ``unknown-certificate`` and no signed notice: the control plane's store has no row
    for this certificate (its database was restored from an older backup, most
    likely). Not a revocation: the agent keeps retrying, more slowly, until the
    certificate expires (:mod:`bcd.revocation`)."""


class CertificateRevoked(BcdError):
    """Raised when the gateway answers UNAUTHENTICATED to the node's certificate.

    The certificate is revoked or unknown to the control plane: renewing or
    reconnecting with it cannot succeed, so the agent stops instead of retrying.
    Nothing on the node is deleted; the way back is joining again with fresh
    evidence (``bcd join --reset --yes``, then ``bcd join``).
    """


class TransportError(BcdError):
    """Raised when the gateway cannot be reached or its certificate does not verify."""


class PeerVerificationError(TransportError):
    """Raised when the gateway's certificate does not verify against the pins."""

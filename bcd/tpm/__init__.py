"""TPM 2.0 support: node keys, the EK, the AK, TPM2_Certify and credential activation.

Two halves live here:

- the device half (:mod:`bcd.tpm.device`, :mod:`bcd.tpm.nodekey`, :mod:`bcd.tpm.ek`,
  :mod:`bcd.tpm.ak`, the node side of :mod:`bcd.tpm.credential`) talks to a TPM
  through tpm2-pytss's ESAPI. It is synchronous; callers run it in a worker thread.
  Only root opens the TPM: ``bcd join`` (a tpm join, and LoadState's ``derive``)
  and, later, ``bcd helper``; never the unprivileged ``bcd node``;
- the pure half (:mod:`bcd.tpm.structures`, :mod:`bcd.tpm.templates`,
  :mod:`bcd.tpm.verify`, :func:`bcd.tpm.credential.make_credential`) parses and checks
  TPM structures without a TPM; the control plane uses it.

Every failure is a :class:`TpmError` with a one-line message.
"""

from __future__ import annotations

from bcd.errors import BcdError


class TpmError(BcdError):
    """Raised when the TPM cannot be used or a TPM structure does not parse or verify."""


class TpmKeyMismatch(TpmError):
    """Raised when the TPM derives another key than the one node.key records.

    The owner seed changed (``tpm2_clear``) or node.key belongs to another machine;
    the key cannot come back. The way back is joining again (``bcd join --reset``).
    """


KEY_MISMATCH_MESSAGE = "the TPM derives another key from node.key (was the TPM cleared?)"

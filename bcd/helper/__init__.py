"""``bcd helper``: the root process that alone opens the TPM, and the node's client of it.

- :mod:`bcd.helper.protocol` (pure): the JSON-lines requests and answers, parsed
  strictly into frozen values;
- :mod:`bcd.helper.server`: ``bcd helper`` itself (root; a Unix socket only the
  ``[helper]`` user and root may use, checked with SO_PEERCRED);
- :mod:`bcd.helper.client`: what the unprivileged ``bcd node`` calls, each call under
  a 30-second timeout, every answer checked before it is believed.

The client and the protocol never import tpm2-pytss: ``bcd node`` never opens the TPM.

::

    BcdError
    └── HelperError              bcd helper cannot be reached, refused, or answered wrong
        ├── ProtocolError        a request or an answer does not parse (has .code)
        ├── HelperNoTpm          bcd helper runs but has no usable TPM (answered no-tpm)
        └── HelperKeyMismatch    the TPM derives another key than node.key's pin
                                 (also a bcd.tpm.TpmKeyMismatch)
"""

from __future__ import annotations

from bcd.errors import BcdError
from bcd.tpm import TpmKeyMismatch


class HelperError(BcdError):
    """Raised when bcd helper cannot be reached, refuses a call, or its answer fails a check."""


class HelperNoTpm(HelperError):
    """Raised when bcd helper answers ``no-tpm``: it runs, but the TPM is off or unusable."""


class HelperKeyMismatch(HelperError, TpmKeyMismatch):
    """Raised when the key derived through the helper is not the one node.key is pinned to.

    It is a :class:`bcd.tpm.TpmKeyMismatch` too, so a caller that handles the TPM's
    "derives another key" case handles it the same way whichever side noticed.
    """


__all__ = ["HelperError", "HelperKeyMismatch", "HelperNoTpm"]

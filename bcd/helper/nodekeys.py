"""``bcd node``'s TPM-held keys, used through ``bcd helper`` (the node never opens the TPM).

:class:`HelperKeys` wraps a :class:`~bcd.helper.client.HelperClient` for the agent:
the checked public half of each record it derived (so a signature is checked
against the key the helper derived for that record), and sync entry points for
code that runs in a worker thread started by trio (``load_state``'s ``derive``,
the TLS signer's ``sign_digest``), which call back into trio with
``trio.from_thread.run``.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd.helper.client import HelperClient
from bcd.tpm.record import NodeKeyPublic, NodeKeyRecord


class HelperKeys:
    """Node keys derived and used through ``bcd helper``."""

    def __init__(self, client: HelperClient) -> None:
        self.client = client
        self._keys: dict[str, NodeKeyPublic] = {}

    async def key(self, record: NodeKeyRecord) -> NodeKeyPublic:
        """The record's key, derived through the helper once (checked against its pin)."""
        known = self._keys.get(record.unique)
        if known is not None and record.pin is not None:
            return known
        public = await self.client.nodekey(record)
        if record.pin is not None:
            self._keys[record.unique] = public
        return public

    async def sign(self, record: NodeKeyRecord, digest: bytes) -> bytes:
        """A P1363 signature by the record's key over a SHA-256 digest (checked)."""
        return await self.client.sign(record, await self.key(record), digest)

    def forget(self, record: NodeKeyRecord) -> None:
        self._keys.pop(record.unique, None)

    # --- from a worker thread ---------------------------------------------------------

    def derive_sync(self, record: NodeKeyRecord) -> ec.EllipticCurvePublicKey:
        """``load_state``'s ``derive``: run it in ``trio.to_thread.run_sync``."""
        return trio.from_thread.run(self.key, record).public_key

    def signer(self, record: NodeKeyRecord) -> Callable[[bytes], bytes]:
        """A sync ``sign_digest`` for :mod:`bcd.tls_signer` (called in a trio worker thread)."""

        def sign_digest(digest: bytes) -> bytes:
            return trio.from_thread.run(self.sign, record, digest)

        return sign_digest

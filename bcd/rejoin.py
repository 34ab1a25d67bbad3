"""``bcd join --attestor x509pop``: re-join this machine's existing identity.

A certificate that expired while the machine was offline cannot be renewed. When
the control plane has x509pop configured, ``bcd join --attestor x509pop`` (as root)
re-joins the same node within 7 days of the expiry: a fresh node key and CSR as any
join makes, the existing chain as evidence, and a proof of possession of the
existing key (a file key, or the TPM-held key through the TPM) over the server's
nonce and the new CSR (:mod:`attestors.x509pop`). The new identity replaces the old
one the way a renewal stores its result (:func:`bcd.identity.persist_rejoin`), so a
crash or a refusal leaves the old identity loadable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from cryptography.hazmat.primitives import serialization

from bcd.config import Config, trusted_owners
from bcd.errors import JoinError, UsageError
from bcd.identity import AnyState, Derive, load_state
from bcd.keys.node import node_key_of
from bcd.keys.node import sign_digest_p1363 as sign_digest_p1363

X509POP = "x509pop"

TPM_BOUND = (
    "this identity's certificate names its TPM attestation key (urn:bc:tpm-ak), which an "
    "x509pop re-join would not keep, so the control plane refuses it; re-join with "
    "bcd join --attestor tpm (or bcd join --reset --yes, then bcd join with a token)"
)


@dataclass(frozen=True, slots=True)
class Rejoin:
    """The existing identity lent to the x509pop node half."""

    state: AnyState
    chain_der: tuple[bytes, ...]
    signer: Callable[[bytes], bytes]

    @property
    def role(self) -> str:
        """The role to ask for: the certificate's (``node`` for a ``node-tenant`` one)."""
        role = self.state.identity.role
        return "node" if role == "node-tenant" else role


def _signer(cfg: Config, state: AnyState) -> Callable[[bytes], bytes]:
    """The existing key's digest signer: a file key, or the TPM-held key (root opens the TPM)."""
    return node_key_of(state, tcti=cfg.tpm.tcti).digest_signer()


def prepare(
    cfg: Config,
    derive: Derive,
    *,
    reset: bool,
    node_id: str | None,
    now: datetime,
) -> Rejoin:
    """Load the identity to re-join and check it can be; raise a clear error otherwise."""
    if reset:
        raise UsageError(
            "--attestor x509pop re-joins the identity this machine holds; it does not combine "
            "with --reset"
        )
    state = load_state(cfg.data_dir, derive, owners=trusted_owners(cfg))
    if state is None:
        raise JoinError(
            f"--attestor x509pop re-joins this machine's existing identity, and {cfg.data_dir} "
            "holds none; join with a token: bcd join"
        )
    if node_id and node_id != state.identity.node_id:
        raise JoinError(
            f"this machine's identity is {state.identity.node_id}; --node-id names another node"
        )
    if state.leaf_info.statements:
        raise JoinError(TPM_BOUND)
    if not state.expired(now):
        raise JoinError(
            f"this machine's certificate is valid until {state.identity.not_after}: bcd node "
            "renews it; --attestor x509pop re-joins only a certificate that expired"
        )
    if state.identity.role == "ramdisk":
        raise JoinError("a ramdisk identity never re-joins; boot the ramdisk again")
    chain = tuple(
        cert.public_bytes(serialization.Encoding.DER) for cert in state.identity.certificates()
    )
    return Rejoin(state, chain, _signer(cfg, state))

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

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, utils

from bcd.config import Config, trusted_owners
from bcd.errors import JoinError, UsageError
from bcd.identity import AnyState, Derive, LoadedState, load_state

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


def sign_digest_p1363(key: ec.EllipticCurvePrivateKey, digest: bytes) -> bytes:
    """ECDSA P-256 over a SHA-256 digest, as P1363 (r || s, 64 bytes)."""
    r, s = utils.decode_dss_signature(key.sign(digest, ec.ECDSA(utils.Prehashed(hashes.SHA256()))))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _signer(cfg: Config, state: AnyState) -> Callable[[bytes], bytes]:
    if isinstance(state, LoadedState):
        key = state.key
        return lambda digest: sign_digest_p1363(key, digest)
    record = state.record

    def sign_in_tpm(digest: bytes) -> bytes:
        from bcd.tpm.device import open_tpm
        from bcd.tpm.nodekey import sign

        with open_tpm(cfg.tpm.tcti) as tpm:
            return sign(tpm, record, digest)

    return sign_in_tpm


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

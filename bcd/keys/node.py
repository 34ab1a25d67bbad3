"""The node key, whichever holds it: :class:`NodeKey` and its three backends.

A node key is what join, renewal, vouch and TLS need of the key a certificate
certifies, and nothing of where it lives:

- :class:`FileKey`: a P-256 key in node.key (PKCS#8 PEM);
- :class:`HelperKey`: a key the TPM derives from node.key's record, used by ``bcd
  node`` through ``bcd helper`` (the node never opens the TPM);
- :class:`RootTpmKey`: a key the TPM derives from its record, used by root (``bcd
  join``, and an x509pop re-join's proof) opening the TPM itself.

Each offers its public half, what node.key holds, a CSR, signatures over a SHA-256
digest (P1363, ``r || s``), its client-certificate material for TLS
(:class:`PemMaterial` for an ``ssl`` context, :class:`SignerMaterial` for tlslite-ng,
the exception for a key that never leaves the TPM) and its release.
:func:`node_key_of` gives a loaded state's key and :func:`state_with` the state of a
new identity and key: the only places that tell the backends apart. A renewal makes
its next key with a :class:`KeyMaker` (:class:`FileKeyMaker`, :class:`HelperKeyMaker`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from bcd import pki
from bcd.errors import IdentityError, JoinError
from bcd.identitydoc import TPM_NODE_UNSUPPORTED, Identity, KeyKind
from bcd.keys.file import generate_file_key, key_to_pem
from bcd.loadstate import AnyState, LoadedState, LoadedTpmState
from bcd.tpm.record import NodeKeyPublic, NodeKeyRecord, create_node_key_record

if TYPE_CHECKING:
    from bcd.helper.nodekeys import HelperKeys
    from bcd.identitystore import IdentityStore

SignDigest = Callable[[bytes], bytes]
"""Sign a 32-byte SHA-256 digest with the node key; a 64-byte P1363 signature."""

AK_MISMATCH = "the TPM derives another AK than the certificate names"


@dataclass(frozen=True, slots=True)
class PemMaterial:
    """A file key's TLS client credential: its PKCS#8 PEM, for an ``ssl`` context."""

    key_pem: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class SignerMaterial:
    """A TPM-held key's TLS client credential: its public half and a digest signer
    (:mod:`bcd.tls_signer`, called in a trio worker thread)."""

    public_key: ec.EllipticCurvePublicKey
    sign_digest: SignDigest = field(repr=False)


TlsMaterial = PemMaterial | SignerMaterial


class NodeKey(Protocol):
    """What the node needs of its key, wherever it is held."""

    @property
    def kind(self) -> KeyKind:
        """identity.json's ``key``: ``file`` or ``tpm``."""
        ...

    @property
    def public_key(self) -> ec.EllipticCurvePublicKey: ...

    @property
    def record(self) -> NodeKeyRecord | None:
        """The TPM record the key is derived from; None for a file key."""
        ...

    def stored(self) -> bytes:
        """What node.key (or node.key.next) holds for this key."""
        ...

    def digest_signer(self) -> SignDigest:
        """A sync signer of SHA-256 digests (a :class:`HelperKey`'s only in a trio worker
        thread: it calls back into trio)."""
        ...

    async def sign_digest(self, digest: bytes) -> bytes:
        """A P1363 signature over a SHA-256 digest."""
        ...

    async def csr(self) -> bytes:
        """A PKCS#10 request for this key (DER), as :func:`bcd.pki.make_csr` makes."""
        ...

    def tls(self) -> TlsMaterial:
        """The client-certificate material for mutual TLS."""
        ...

    async def release(self) -> bool:
        """The key is no longer used: whether something was released (in ``bcd helper``).

        Raises :class:`~bcd.helper.HelperError` when the helper did not take it.
        """
        ...


def sign_digest_p1363(key: ec.EllipticCurvePrivateKey, digest: bytes) -> bytes:
    """ECDSA P-256 over a SHA-256 digest, as P1363 (r || s, 64 bytes)."""
    r, s = utils.decode_dss_signature(key.sign(digest, ec.ECDSA(utils.Prehashed(hashes.SHA256()))))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


@dataclass(frozen=True, slots=True)
class FileKey:
    """A file key: the private key itself (node.key, PKCS#8 PEM)."""

    private: ec.EllipticCurvePrivateKey = field(repr=False)

    @property
    def kind(self) -> KeyKind:
        return "file"

    @property
    def public_key(self) -> ec.EllipticCurvePublicKey:
        return self.private.public_key()

    @property
    def record(self) -> NodeKeyRecord | None:
        return None

    def stored(self) -> bytes:
        return key_to_pem(self.private)

    def digest_signer(self) -> SignDigest:
        key = self.private
        return lambda digest: sign_digest_p1363(key, digest)

    async def sign_digest(self, digest: bytes) -> bytes:
        return sign_digest_p1363(self.private, digest)

    async def csr(self) -> bytes:
        return pki.make_csr(self.private)

    def tls(self) -> TlsMaterial:
        return PemMaterial(key_to_pem(self.private))

    async def release(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class _TpmHeld:
    """What every TPM-held key is: its record (what node.key holds) and public half."""

    key_record: NodeKeyRecord
    public: ec.EllipticCurvePublicKey

    @property
    def kind(self) -> KeyKind:
        return "tpm"

    @property
    def public_key(self) -> ec.EllipticCurvePublicKey:
        return self.public

    @property
    def record(self) -> NodeKeyRecord | None:
        return self.key_record

    def stored(self) -> bytes:
        return self.key_record.to_json()

    def digest_signer(self) -> SignDigest:
        raise NotImplementedError

    def tls(self) -> TlsMaterial:
        return SignerMaterial(self.public, self.digest_signer())


@dataclass(frozen=True, slots=True)
class HelperKey(_TpmHeld):
    """A TPM-held key used through ``bcd helper``: its record, public half and helper.

    ``derived`` is the helper's answer when the key was made here (its TPMT_PUBLIC
    and name, which an AK's certification names).
    """

    keys: HelperKeys = field(repr=False)
    derived: NodeKeyPublic | None = field(default=None, repr=False)

    def digest_signer(self) -> SignDigest:
        return self.keys.signer(self.key_record)

    async def sign_digest(self, digest: bytes) -> bytes:
        return await self.keys.sign(self.key_record, digest)

    async def csr(self) -> bytes:
        import trio

        # the helper signs the CSR's digest; its signer calls back into trio
        return await trio.to_thread.run_sync(pki.make_csr_with, self.public, self.digest_signer())

    async def release(self) -> bool:
        self.keys.forget(self.key_record)
        await self.keys.client.release(self.key_record)
        return True


@dataclass(frozen=True, slots=True)
class RootTpmKey(_TpmHeld):
    """A TPM-held key root uses by opening the TPM at ``tcti`` itself (``bcd join``).

    ``csr_der`` is the CSR made when the key was (:func:`new_root_tpm_key`), if it was.
    """

    tcti: str
    csr_der: bytes | None = None

    def digest_signer(self) -> SignDigest:
        record, tcti = self.key_record, self.tcti

        def sign_in_tpm(digest: bytes) -> bytes:
            from bcd.tpm.device import open_tpm
            from bcd.tpm.nodekey import sign

            with open_tpm(tcti) as tpm:
                return sign(tpm, record, digest)

        return sign_in_tpm

    async def sign_digest(self, digest: bytes) -> bytes:
        import trio

        return await trio.to_thread.run_sync(self.digest_signer(), digest)

    async def csr(self) -> bytes:
        import trio

        if self.csr_der is not None:
            return self.csr_der
        return await trio.to_thread.run_sync(pki.make_csr_with, self.public, self.digest_signer())

    async def release(self) -> bool:
        return False


def new_root_tpm_key(tcti: str) -> RootTpmKey:
    """A new node key in the TPM at ``tcti`` (root): a record pinned to the key the TPM
    derives from it, and its CSR, in one opening of the TPM. Raises TpmError."""
    from bcd.tpm.device import open_tpm
    from bcd.tpm.nodekey import derive_node_key, sign

    with open_tpm(tcti) as tpm:
        record = create_node_key_record()
        record = record.pinned(derive_node_key(tpm, record))
        public_key = derive_node_key(tpm, record)
        csr_der = pki.make_csr_with(public_key, lambda digest: sign(tpm, record, digest))
    return RootTpmKey(record, public_key, tcti, csr_der)


# --- from and to a loaded state --------------------------------------------------------


def node_key_of(
    state: AnyState, *, tpm: HelperKeys | None = None, tcti: str | None = None
) -> NodeKey:
    """The key of a loaded identity: its file key, or its TPM-held key through ``bcd
    helper`` (``tpm``) or, for root, through the TPM at ``tcti``.

    A TPM-held key without either is :data:`~bcd.identitydoc.TPM_NODE_UNSUPPORTED`.
    """
    if isinstance(state, LoadedState):
        return FileKey(state.key)
    if tpm is not None:
        return HelperKey(state.record, state.public_key, tpm)
    if tcti is not None:
        return RootTpmKey(state.record, state.public_key, tcti)
    raise IdentityError(TPM_NODE_UNSUPPORTED)


def state_with(
    data_dir: Path, identity: Identity, key: NodeKey, store: IdentityStore | None = None
) -> AnyState:
    """The loaded state of ``identity`` (verified, stored) and its key ``key``."""
    leaf = identity.leaf()
    info = pki.leaf_info(leaf)
    if isinstance(key, FileKey):
        return LoadedState(data_dir, identity, key.private, leaf, info, store=store)
    record = key.record
    assert record is not None  # a key that is not a file key is derived from a record
    return LoadedTpmState(data_dir, identity, record, key.public_key, leaf, info, store=store)


# --- the next key of a renewal -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fresh:
    """A renewal's next key, and when the leaf names an AK, how to attest it: the AK's
    TPM2_Certify of the key over a CSR's SHA-256 (the ``key_attestation`` object)."""

    key: NodeKey
    attest: Callable[[bytes], Awaitable[dict[str, Any]]] | None = None


class KeyMaker(Protocol):
    """Makes a renewal's next key (before anything is written or sent)."""

    async def make(self, statements: tuple[str, ...]) -> Fresh:
        """A new key; ``statements`` are the current leaf's (an AK it names)."""
        ...


class FileKeyMaker:
    """A new P-256 file key; a file-key leaf names no AK."""

    async def make(self, statements: tuple[str, ...]) -> Fresh:
        return Fresh(FileKey(generate_file_key()))


class HelperKeyMaker:
    """A new key in the TPM through ``bcd helper``. For a leaf naming an AK
    (``urn:bc:tpm-ak:``) the helper's AK must be that AK, checked first (no downgrade);
    the new key's attestation is then that AK's certification of it."""

    def __init__(self, keys: HelperKeys) -> None:
        self.keys = keys

    async def make(self, statements: tuple[str, ...]) -> Fresh:
        from bcd.tpm.attestation import KeyAttestation, ak_statement, ak_statements

        named = ak_statements(statements)
        ak = None
        if named:
            ak = await self.keys.client.ak()
            if ak_statement(ak.name) not in named:
                raise JoinError(f"the renewal failed before anything was sent: {AK_MISMATCH}")
        fresh = create_node_key_record()
        derived = await self.keys.client.nodekey(fresh)
        record = fresh.pinned(derived.public_key)
        key = HelperKey(record, derived.public_key, self.keys, derived)
        if ak is None:
            return Fresh(key)
        client, the_ak = self.keys.client, ak

        async def attest(csr_der: bytes) -> dict[str, Any]:
            certified = await client.certify(
                record, derived, hashlib.sha256(csr_der).digest(), the_ak
            )
            return KeyAttestation(
                the_ak.public_area, derived.public_area, certified.attest, certified.signature
            ).to_json()

        return Fresh(key, attest)

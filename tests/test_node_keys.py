"""The NodeKey backends: a file key, a TPM key through ``bcd helper``, a TPM key root holds.

Each one's CSR is a valid request for its public key, its digest signatures verify
against it, node.key gets what LoadState loads back, and :func:`node_key_of` /
:func:`state_with` go from a loaded state to its key and back. The TPM backends run
against the session's swtpm (the helper as ``serve_helper`` on a Unix socket).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio

from bcd import pki
from bcd.errors import IdentityError
from bcd.helper.client import HelperClient
from bcd.helper.nodekeys import HelperKeys
from bcd.helper.server import HelperSettings, serve_helper
from bcd.identity import (
    TPM_NODE_UNSUPPORTED,
    LoadedState,
    LoadedTpmState,
    MemoryStore,
    load_state,
    persist_join,
)
from bcd.keys.file import generate_file_key, load_key_pem
from bcd.keys.node import (
    FileKey,
    FileKeyMaker,
    HelperKey,
    HelperKeyMaker,
    NodeKey,
    PemMaterial,
    RootTpmKey,
    SignerMaterial,
    new_root_tpm_key,
    node_key_of,
    state_with,
)
from tests.certs import make_ca, node_identity
from tests.swtpm import SwTpm


def _verifies(key: NodeKey, digest: bytes, signature: bytes) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, utils

    der = utils.encode_dss_signature(
        int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    )
    key.public_key.verify(der, digest, ec.ECDSA(utils.Prehashed(hashes.SHA256())))


def _csr_is_for(key: NodeKey, csr_der: bytes) -> None:
    csr = pki.parse_csr(csr_der)
    assert pki.same_public_key(csr.public_key(), key.public_key)  # type: ignore[arg-type]


async def test_a_file_key_signs_makes_its_csr_and_its_tls_pem() -> None:
    key: NodeKey = FileKey(generate_file_key())
    assert key.kind == "file"
    assert key.record is None
    digest = hashlib.sha256(b"m").digest()
    _verifies(key, digest, await key.sign_digest(digest))
    _verifies(key, digest, key.digest_signer()(digest))
    _csr_is_for(key, await key.csr())
    material = key.tls()
    assert isinstance(material, PemMaterial)
    assert pki.same_public_key(load_key_pem(material.key_pem).public_key(), key.public_key)
    assert load_key_pem(key.stored()).private_numbers() == key.private.private_numbers()  # type: ignore[attr-defined]
    assert await key.release() is False
    assert "PRIVATE" not in repr(key)


def test_a_loaded_state_gives_its_key_and_back() -> None:
    private, identity = node_identity(make_ca())
    store = MemoryStore("k")
    key = FileKey(private)
    state = state_with(Path("/memory/k"), identity, key, store)
    assert isinstance(state, LoadedState)
    assert state.key is private
    assert state.store is store
    assert node_key_of(state) == key


def test_a_tpm_state_needs_a_helper_or_root(tmp_path: Path) -> None:
    from bcd.tpm.record import create_node_key_record

    private, identity = node_identity(make_ca())
    identity = dataclasses.replace(identity, key="tpm")
    record = create_node_key_record().pinned(private.public_key())
    persist_join(tmp_path, identity, record.to_json(), datetime.now(UTC))
    state = load_state(tmp_path, lambda _r: private.public_key())
    assert isinstance(state, LoadedTpmState)
    with pytest.raises(IdentityError) as info:
        node_key_of(state)
    assert str(info.value) == TPM_NODE_UNSUPPORTED
    root = node_key_of(state, tcti="swtpm:host=127.0.0.1,port=1")
    assert isinstance(root, RootTpmKey)
    assert root.stored() == record.to_json()
    back = state_with(tmp_path, identity, root)
    assert isinstance(back, LoadedTpmState)
    assert back.record == record


async def test_a_file_key_maker_makes_file_keys() -> None:
    fresh = await FileKeyMaker().make(())
    assert isinstance(fresh.key, FileKey)
    assert fresh.attest is None


def test_a_tpm_key_root_holds_signs_in_the_tpm(swtpm: SwTpm) -> None:
    key = new_root_tpm_key(swtpm.tcti)
    assert key.kind == "tpm"
    assert key.record is not None
    assert key.record.pin == pki.spki_pin(key.public_key)
    assert key.csr_der is not None
    _csr_is_for(key, key.csr_der)
    digest = hashlib.sha256(b"proof").digest()

    async def main() -> None:
        _verifies(key, digest, await key.sign_digest(digest))
        assert await key.csr() == key.csr_der
        assert await key.release() is False

    trio.run(main)
    assert isinstance(key.tls(), SignerMaterial)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


async def test_a_key_through_the_helper_is_made_used_and_released(
    swtpm: SwTpm, sockdir: Path
) -> None:
    settings = HelperSettings(
        socket=sockdir / "run" / "helper.sock",
        allowed_uids=frozenset({os.getuid()}),
        socket_gid=os.getgid(),
        tcti=swtpm.tcti,
        tpm_mode="required",
    )
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_helper, settings)
        keys = HelperKeys(HelperClient(path))
        fresh = await HelperKeyMaker(keys).make(())
        key = fresh.key
        assert isinstance(key, HelperKey)
        assert fresh.attest is None  # the leaf names no AK
        assert key.record is not None
        assert key.record.pin == pki.spki_pin(key.public_key)
        digest = hashlib.sha256(b"vouch").digest()
        _verifies(key, digest, await key.sign_digest(digest))
        _csr_is_for(key, await key.csr())
        material = key.tls()
        assert isinstance(material, SignerMaterial)
        signature = await trio.to_thread.run_sync(material.sign_digest, digest)
        _verifies(key, digest, signature)
        assert await key.release() is True
        nursery.cancel_scope.cancel()

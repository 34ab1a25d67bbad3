"""renew_once for a TPM-held key, on the node side: what fails before anything is sent.

A leaf naming an AK renews only when ``bcd helper``'s AK is that AK (no downgrade),
and only while the helper answers; the full renewal through a real `bcd helper` and
`bcd node` is in tests/test_e2e_tpm.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio

from bcd import pki
from bcd.errors import JoinError
from bcd.helper.client import HelperClient
from bcd.helper.nodekeys import HelperKeys
from bcd.helper.server import HelperSettings, serve_helper
from bcd.identity import LoadedTpmState, load_state, persist_join
from bcd.renew import AK_MISMATCH, renew_once
from bcd.tpm.attestation import ak_statement
from bcd.tpm.record import create_node_key_record
from tests.certs import make_ca, node_identity
from tests.swtpm import SwTpm


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _tpm_state(data_dir: Path, statements: tuple[str, ...]) -> LoadedTpmState:
    """A TPM identity on disk whose leaf names ``statements`` (its key is not the TPM's:
    everything here fails before the current key would sign)."""
    key, identity = node_identity(make_ca(), None, statements=statements)
    identity = dataclasses.replace(identity, key="tpm")
    record = create_node_key_record().pinned(key.public_key())
    persist_join(data_dir, identity, record.to_json(), datetime.now(UTC))
    state = load_state(data_dir, lambda _r: key.public_key())
    assert isinstance(state, LoadedTpmState)
    return state


async def _never(_body: bytes) -> str:
    raise AssertionError("nothing may be sent")


async def test_a_helper_deriving_another_ak_fails_the_renewal_before_sending(
    tmp_path: Path, swtpm: SwTpm, sockdir: Path
) -> None:
    other_ak = b"\x00\x0b" + bytes(range(32))
    state = _tpm_state(tmp_path, (ak_statement(other_ak),))
    settings = HelperSettings(
        socket=sockdir / "run" / "helper.sock",
        allowed_uids=frozenset({os.getuid()}),
        socket_gid=os.getgid(),
        tcti=swtpm.tcti,
        tpm_mode="required",
    )
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_helper, settings)
        tpm = HelperKeys(HelperClient(path))
        for _attempt in range(2):  # and keeps failing: no downgrade
            with pytest.raises(JoinError) as info:
                await renew_once(state, _never, signing_pin="sha256/x", wall=time.time, tpm=tpm)
            assert str(info.value) == (
                f"the renewal failed before anything was sent: {AK_MISMATCH}"
            )
            assert not (tmp_path / "node.key.next").exists()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("names_ak", [True, False])
async def test_an_unavailable_helper_fails_the_renewal_before_sending(
    tmp_path: Path, sockdir: Path, names_ak: bool
) -> None:
    statements = (ak_statement(b"\x00\x0b" + bytes(32)),) if names_ak else ()
    state = _tpm_state(tmp_path, statements)
    tpm = HelperKeys(HelperClient(sockdir / "missing.sock"))
    with pytest.raises(JoinError) as info:
        await renew_once(state, _never, signing_pin="sha256/x", wall=time.time, tpm=tpm)
    assert str(info.value).startswith(
        "the renewal failed before anything was sent: bcd helper is not running"
    )
    assert not (tmp_path / "node.key.next").exists()
    assert pki.spki_pin(state.public_key) == state.record.pin

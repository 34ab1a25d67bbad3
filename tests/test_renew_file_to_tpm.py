"""A file-key node moves into the TPM at its next renewal (seed 003, "Renewal" step 1).

Under ``[helper]`` with ``[tpm] mode`` auto or required, the next key of a file-key
identity is made in the TPM through a real, in-process ``bcd helper`` (on the test
session's swtpm, never cleared here); the proof of possession is still the file
key's. ``auto`` falls back to a file key when the helper has no TPM or cannot be
reached; ``required`` then fails before anything is sent; ``off`` keeps a file key.
The gateway is tests/test_renew.py's fake, which checks the proof under the leaf.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from bcd import pki
from bcd.config import TpmMode
from bcd.errors import CertificateRevoked, JoinError
from bcd.helper.client import HelperClient
from bcd.helper.nodekeys import HelperKeys
from bcd.helper.server import HelperSettings, serve_helper
from bcd.identity import LoadedState, LoadedTpmState, load_state
from bcd.keys.file import load_key_pem
from bcd.renew import renew_once, renewal_task
from bcd.tpm.record import NodeKeyRecord
from control.pki import Pki
from tests.swtpm import SwTpm
from tests.world.agent import TTL_S, FakeGateway, joined_state, pin, wall

LOG = logging.getLogger("bcd.test.renew_file_to_tpm")


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def slow_autojump_clock() -> trio.testing.MockClock:
    """Mock time that jumps only after a real idle second: a helper call (real I/O,
    real TPM work in a thread) never sees its 30-second timeout jump past."""
    return trio.testing.MockClock(autojump_threshold=1.0)


@contextlib.asynccontextmanager
async def _helper(
    sockdir: Path, tcti: str, mode: TpmMode = "required"
) -> AsyncIterator[HelperKeys]:
    settings = HelperSettings(
        socket=sockdir / "run" / "helper.sock",
        allowed_uids=frozenset({os.getuid()}),
        socket_gid=os.getgid(),
        tcti=tcti,
        tpm_mode=mode,
    )
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_helper, settings)
        yield HelperKeys(HelperClient(path))
        nursery.cancel_scope.cancel()


def _assert_tpm_identity(data_dir: Path, state: LoadedTpmState) -> NodeKeyRecord:
    ident = json.loads((data_dir / "identity.json").read_text())
    assert ident["key"] == "tpm"
    record = NodeKeyRecord.from_json((data_dir / "node.key").read_bytes())
    assert record == state.record
    assert record.pin == pki.spki_pin(state.leaf.public_key())  # type: ignore[arg-type]
    assert not (data_dir / "node.key.next").exists()
    return record


async def test_auto_moves_a_file_key_into_the_tpm_and_renews_it_there(
    tmp_path: Path, memory_pki: Pki, swtpm: SwTpm, sockdir: Path
) -> None:
    state = joined_state(tmp_path, memory_pki, time.time())
    file_key = state.key
    gateway = FakeGateway(memory_pki, tmp_path, clock=time.time)
    async with _helper(sockdir, swtpm.tcti) as tpm:
        new = await renew_once(
            state,
            gateway.factory(state),
            signing_pin=pin(memory_pki),
            wall=time.time,
            tpm=tpm,
            tpm_mode="auto",
        )
        assert isinstance(new, LoadedTpmState)
        # node.key.next held the TPM record, pinned to the CSR's key, before the send
        (req,) = gateway.requests
        csr_key = pki.csr_public_key(pki.parse_csr(req.csr_der))
        sent_record = NodeKeyRecord.from_json(gateway.next_key_at_send[0])
        assert sent_record.pin == pki.spki_pin(csr_key)
        # the file key proved possession (the fake checked it under the old leaf), and a
        # file-key leaf names no AK: no key attestation
        message = pki.renew_pop_message(req.csr_der, state.identity.node_id, req.client_time_ms)
        pki.verify_p1363(file_key.public_key(), req.pop_sig, message)
        assert req.key_attestation is None
        assert pki.same_public_key(new.public_key, csr_key)
        record = _assert_tpm_identity(tmp_path, new)
        assert record == sent_record

        # it loads as a TPM node through the helper, and renews as one
        loaded = await trio.to_thread.run_sync(load_state, tmp_path, tpm.derive_sync)
        assert isinstance(loaded, LoadedTpmState)
        assert loaded.identity == new.identity
        again = await renew_once(
            new,
            gateway.factory(new),
            signing_pin=pin(memory_pki),
            wall=time.time,
            tpm=tpm,
            tpm_mode="auto",
        )
        assert isinstance(again, LoadedTpmState)
        assert again.record.unique != new.record.unique
        assert _assert_tpm_identity(tmp_path, again) == again.record


@pytest.mark.parametrize("helper", ["no-tpm", "unreachable"])
async def test_auto_falls_back_to_a_file_key_when_the_helper_cannot_make_it(
    tmp_path: Path,
    memory_pki: Pki,
    sockdir: Path,
    caplog: pytest.LogCaptureFixture,
    helper: str,
) -> None:
    state = joined_state(tmp_path, memory_pki, time.time())
    gateway = FakeGateway(memory_pki, tmp_path, clock=time.time)
    async with contextlib.AsyncExitStack() as stack:
        if helper == "no-tpm":  # bcd helper runs, with the TPM off: answers no-tpm
            tpm = await stack.enter_async_context(_helper(sockdir, "device:/dev/none", "off"))
        else:
            tpm = HelperKeys(HelperClient(sockdir / "missing.sock"))
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            new = await renew_once(
                state,
                gateway.factory(state),
                signing_pin=pin(memory_pki),
                wall=time.time,
                tpm=tpm,
                tpm_mode="auto",
                log=LOG,
            )
    assert isinstance(new, LoadedState)
    assert len(gateway.requests) == 1
    warnings = [r for r in caplog.records if r.name == LOG.name]
    assert len(warnings) == 1  # once per renewal
    text = warnings[0].getMessage()
    assert text.startswith("renewal: the next node key is a file key, not in the TPM: ")
    assert ("no usable TPM" if helper == "no-tpm" else "bcd helper is not running") in text
    assert json.loads((tmp_path / "identity.json").read_text())["key"] == "file"
    on_disk = load_key_pem((tmp_path / "node.key").read_bytes())
    assert pki.same_public_key(on_disk.public_key(), new.key.public_key())


@pytest.mark.parametrize("helper", ["no-tpm", "unreachable"])
async def test_required_fails_the_renewal_before_anything_is_sent(
    tmp_path: Path, memory_pki: Pki, sockdir: Path, helper: str
) -> None:
    state = joined_state(tmp_path, memory_pki, time.time())
    before = (tmp_path / "node.key").read_bytes(), (tmp_path / "identity.json").read_bytes()

    async def never(_body: bytes) -> str:
        raise AssertionError("nothing may be sent")

    async with contextlib.AsyncExitStack() as stack:
        if helper == "no-tpm":
            tpm = await stack.enter_async_context(_helper(sockdir, "device:/dev/none", "off"))
        else:
            tpm = HelperKeys(HelperClient(sockdir / "missing.sock"))
        with pytest.raises(JoinError) as info:
            await renew_once(
                state,
                never,
                signing_pin=pin(memory_pki),
                wall=time.time,
                tpm=tpm,
                tpm_mode="required",
            )
    assert str(info.value).startswith(
        "the renewal failed before anything was sent: [tpm] mode = required, but the TPM "
        "cannot be used through bcd helper ("
    )
    after = (tmp_path / "node.key").read_bytes(), (tmp_path / "identity.json").read_bytes()
    assert after == before


async def test_off_keeps_a_file_key_under_the_helper(
    tmp_path: Path, memory_pki: Pki, swtpm: SwTpm, sockdir: Path
) -> None:
    state = joined_state(tmp_path, memory_pki, time.time())
    gateway = FakeGateway(memory_pki, tmp_path, clock=time.time)
    async with _helper(sockdir, swtpm.tcti) as tpm:
        new = await renew_once(
            state,
            gateway.factory(state),
            signing_pin=pin(memory_pki),
            wall=time.time,
            tpm=tpm,
            tpm_mode="off",
        )
    assert isinstance(new, LoadedState)
    assert json.loads((tmp_path / "identity.json").read_text())["key"] == "file"


async def test_the_task_switches_the_state_to_the_tpm_and_goes_on_renewing_there(
    tmp_path: Path,
    memory_pki: Pki,
    swtpm: SwTpm,
    sockdir: Path,
    slow_autojump_clock: trio.testing.MockClock,
) -> None:
    holder: list[LoadedState | LoadedTpmState] = [
        joined_state(tmp_path, memory_pki, wall() - 0.9 * TTL_S)  # due now
    ]
    gateway = FakeGateway(memory_pki, tmp_path, ttl_s=60)  # short leaves: few naps

    def on_call(n: int) -> None:
        if n == 3:
            gateway.failures.append(CertificateRevoked("stop"))

    gateway.on_call = on_call
    async with _helper(sockdir, swtpm.tcti) as tpm:
        with pytest.raises(CertificateRevoked):
            await renewal_task(
                lambda: holder[-1],
                holder.append,
                gateway.factory,
                signing_pin=pin(memory_pki),
                wall=wall,
                log=LOG,
                tpm=tpm,
                tpm_mode="auto",
            )
    # the file state, then two TPM states; each sender was built from the state of its
    # time (the first from the file key, the second from the TPM key)
    assert [type(s) for s in holder] == [LoadedState, LoadedTpmState, LoadedTpmState]
    assert [type(s) for s in gateway.senders] == [LoadedState, LoadedTpmState, LoadedTpmState]
    assert len(gateway.requests) == 2
    assert all(req.key_attestation is None for req in gateway.requests)
    last = holder[-1]
    assert isinstance(last, LoadedTpmState)
    assert json.loads((tmp_path / "identity.json").read_text())["key"] == "tpm"
    assert NodeKeyRecord.from_json((tmp_path / "node.key").read_bytes()) == last.record


async def test_a_replaced_tpm_key_is_released_in_the_helper_after_its_hold(
    tmp_path: Path,
    memory_pki: Pki,
    swtpm: SwTpm,
    sockdir: Path,
    slow_autojump_clock: trio.testing.MockClock,
) -> None:
    from bcd.renew import OldKeys

    holder: list[LoadedState | LoadedTpmState] = [
        joined_state(tmp_path, memory_pki, wall() - 0.9 * TTL_S)  # due now
    ]
    gateway = FakeGateway(memory_pki, tmp_path, ttl_s=60)

    def on_call(n: int) -> None:
        if n == 3:
            gateway.failures.append(CertificateRevoked("stop"))

    gateway.on_call = on_call
    released: list[NodeKeyRecord] = []
    async with _helper(sockdir, swtpm.tcti) as tpm:
        real = tpm.client.release

        async def spy(record: NodeKeyRecord) -> None:
            released.append(record)
            await real(record)  # the helper answers it (a real tpm.release)

        tpm.client.release = spy  # type: ignore[method-assign]
        with pytest.raises(CertificateRevoked):
            await renewal_task(
                lambda: holder[-1],
                holder.append,
                gateway.factory,
                signing_pin=pin(memory_pki),
                wall=wall,
                log=LOG,
                tpm=tpm,
                tpm_mode="auto",
                old_keys=OldKeys(hold_s=1.0),
            )
    first_tpm = holder[1]
    assert isinstance(first_tpm, LoadedTpmState)
    # the file key went without a call; the first TPM key, replaced by the second
    # renewal, was released in the helper once its hold ended
    assert released == [first_tpm.record]

"""bcd helper: the protocol (pure, with properties), the server against a real swtpm over a
real Unix socket, the node's checks against a helper that answers wrong, and
``run_helper`` as a real process stopped by SIGTERM."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st
from tpm2_pytss import ESAPI, TPM2B_PUBLIC, TPM2B_SENSITIVE_CREATE, TPMT_PUBLIC
from tpm2_pytss.constants import ESYS_TR

from bcd import pki, wire
from bcd.config import parse_config
from bcd.errors import BcdError
from bcd.helper import HelperError, HelperKeyMismatch
from bcd.helper.client import HelperAk, HelperClient
from bcd.helper.protocol import (
    MAX_LINE,
    TOO_LARGE,
    AkCall,
    AkResult,
    Answer,
    Call,
    CertifyCall,
    CertifyResult,
    ErrorAnswer,
    LineBuffer,
    NodeKeyCall,
    NodeKeyResult,
    ProtocolError,
    ReleaseCall,
    ReleaseResult,
    Request,
    Result,
    SignCall,
    SignResult,
    encode_error,
    encode_request,
    encode_result,
    method_of,
    parse_answer,
    parse_request,
)
from bcd.helper.server import HelperSettings, run_helper, serve_helper
from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmKeyMismatch
from bcd.tpm.ak import ak_public, certify
from bcd.tpm.device import open_tpm
from bcd.tpm.nodekey import create_node_key_record, public_key_of, sign
from bcd.tpm.record import NodeKeyPublic, NodeKeyRecord
from bcd.tpm.templates import AK_ATTRIBUTES, check_ak_public, node_key_template, p256_public_area
from bcd.tpm.verify import verify_certify
from tests.swtpm import SwTpm
from tests.world.agent import NOBODY, helper_settings, running, transients, wrong_helper

DIGEST = hashlib.sha256(b"a message").digest()
CSR_DIGEST = hashlib.sha256(b"a CSR").digest()


# --- fixtures -----------------------------------------------------------------------


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A directory nobody can traverse (pytest's temp dirs are root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    """The effective uid and gid of nobody (SO_PEERCRED reports them) until the block ends."""
    os.setegid(NOBODY.pw_gid)
    os.seteuid(NOBODY.pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


async def _raw(path: Path, data: bytes) -> list[bytes]:
    """Send bytes on a raw connection; the lines read until the helper closes or pauses."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(data)
        buffer = b""
        with trio.move_on_after(1):
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                buffer += chunk
    lines = buffer.split(b"\n")
    assert lines[-1] == b""
    return lines[:-1]


# --- the protocol (pure) ------------------------------------------------------------

RECORD = create_node_key_record()
PINNED = RECORD.pinned(ec.generate_private_key(ec.SECP256R1()).public_key())
CALLS = [
    NodeKeyCall(RECORD),
    NodeKeyCall(PINNED),
    SignCall(RECORD, DIGEST),
    AkCall(),
    CertifyCall(PINNED, CSR_DIGEST),
    ReleaseCall(RECORD),
]
RESULTS: list[Result] = [
    NodeKeyResult(b"public", b"spki"),
    SignResult(b"s" * 64),
    AkResult(b"ak", b"\x00\x0bname"),
    CertifyResult(b"attest", b"sig"),
    ReleaseResult(),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.method)
def test_requests_round_trip(call: Call) -> None:
    line = encode_request(7, call)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    doc = json.loads(line)
    assert set(doc) == {"id", "method", "params"}
    assert doc["method"] == call.method
    assert parse_request(line[:-1]) == Request(7, call)


@pytest.mark.parametrize("result", RESULTS, ids=lambda r: method_of(r))
def test_answers_round_trip(result: Result) -> None:
    line = encode_result(3, result)
    assert parse_answer(line[:-1], method_of(result)) == Answer(3, result)
    error = encode_error(3, "tpm", "the TPM refused it")
    assert json.loads(error) == {"id": 3, "error": {"code": "tpm", "message": "the TPM refused it"}}
    assert parse_answer(error[:-1], method_of(result)) == Answer(
        3, ErrorAnswer("tpm", "the TPM refused it")
    )


def _request(**change: object) -> bytes:
    doc: dict[str, object] = json.loads(encode_request(5, SignCall(RECORD, DIGEST)))
    doc.update(change)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("line", "code", "message", "request_id"),
    [
        (b"", "bad-request", "not a JSON object", None),
        (b"\xff", "bad-request", "not a JSON object", None),
        (b"[1]", "bad-request", "not a JSON object", None),
        (b'{"id": NaN}', "bad-request", "not a JSON object", None),
        (b'{"id": 1, "id": 2}', "bad-request", "not a JSON object", None),
        (b"[" * 100000, "too-large", "longer than", None),
        (_request(id=-1), "bad-request", "no valid id", None),
        (_request(id=True), "bad-request", "no valid id", None),
        (_request(id=2**60), "bad-request", "no valid id", None),
        (_request(id="5"), "bad-request", "no valid id", None),
        (_request(method="tpm.clear"), "unknown-method", "unknown method 'tpm.clear'", 5),
        (_request(method=["x"]), "bad-request", "method is not a string", 5),
        (_request(params=[]), "bad-request", "params is not an object", 5),
        (_request(extra=1), "bad-request", "exactly id, method and params", 5),
        (_request(params={"record": RECORD.to_dict()}), "bad-request", "digest, record", 5),
        (
            _request(
                params={
                    "record": RECORD.to_dict() | {"template": "bcd-ak-ecc-p256-v1"},
                    "digest": "",
                }
            ),
            "bad-request",
            "unknown TPM key template",
            5,
        ),
        (
            _request(params={"record": RECORD.to_dict(), "digest": "AAAA"}),
            "bad-request",
            "digest is not a 32-byte",
            5,
        ),
        (
            _request(params={"record": RECORD.to_dict(), "digest": "QUJD\n"}),
            "bad-request",
            "not base64",
            5,
        ),
        (
            _request(params={"record": RECORD.to_dict(), "digest": "QUJ="}),
            "bad-request",
            "canonical",
            5,
        ),
        (_request(params={"record": "x", "digest": ""}), "bad-request", "not a node-key record", 5),
    ],
)
def test_bad_requests_are_named(
    line: bytes, code: str, message: str, request_id: int | None
) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        parse_request(line)
    assert info.value.code == code
    assert info.value.request_id == request_id
    assert isinstance(info.value, BcdError)


def test_ak_and_release_params() -> None:
    with pytest.raises(ProtocolError, match="takes nothing"):
        parse_request(b'{"id": 1, "method": "tpm.ak", "params": {"record": {}}}')
    ak_line = b'{"id": 1, "method": "tpm.ak", "params": {}}'
    assert parse_request(ak_line) == Request(1, AkCall())


def test_bad_answers_are_named() -> None:
    good = json.loads(encode_result(1, SignResult(b"s" * 64)))
    cases: list[tuple[object, str]] = [
        ([], "not a JSON object"),
        ({"id": 1}, "exactly id and result"),
        ({"id": None, "result": good["result"]}, "exactly id and result"),
        ({"id": "1", "result": good["result"]}, "id is not an integer"),
        ({"id": 1, "result": {"signature": "AA=="}, "x": 1}, "exactly id and result"),
        ({"id": 1, "result": {}}, "must hold signature"),
        ({"id": 1, "result": {"signature": 5}}, "signature is not base64"),
        ({"id": 1, "error": "boom"}, "code and message"),
        ({"id": 1, "error": {"code": "Not A Code", "message": ""}}, "not a code"),
        ({"id": 1, "error": {"code": "tpm", "message": 5}}, "not a string"),
    ]
    for doc, message in cases:
        with pytest.raises(ProtocolError, match=message) as info:
            parse_answer(json.dumps(doc).encode(), "tpm.sign")
        assert info.value.code == "bad-answer"


def test_error_messages_are_cut_and_printable() -> None:
    line = encode_error(None, "internal", "a\nb\x1b[31m" + "x" * 1000)
    message = json.loads(line)["error"]["message"]
    assert message.startswith("a\\nb\\x1b[31m")
    assert message.endswith("…")
    assert len(message) < 520
    again = parse_answer(line[:-1], "tpm.ak").outcome
    assert again == ErrorAnswer("internal", message[:500] + "…")  # cut again, never longer
    with pytest.raises(ValueError, match="not an error code"):
        encode_error(1, "Bad Code", "")


def test_line_buffer_splits_and_limits() -> None:
    buffer = LineBuffer(limit=10)
    buffer.feed(b"one\ntw")
    assert buffer.next_line() == b"one"
    assert buffer.next_line() is None
    buffer.feed(b"o\n" + b"x" * 10 + b"\n")
    assert buffer.next_line() == b"two"
    assert buffer.next_line() == b"x" * 10  # exactly the limit is accepted
    assert buffer.next_line() is None
    assert buffer.pending == 0
    buffer.feed(b"y" * 11)
    with pytest.raises(ProtocolError, match="longer than 10") as info:
        buffer.next_line()
    assert info.value.code == TOO_LARGE


@given(st.binary(max_size=400))
def test_request_parser_raises_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_request(data)


@given(
    st.binary(max_size=400),
    st.sampled_from(["tpm.nodekey", "tpm.sign", "tpm.ak", "tpm.certify", "tpm.release"]),
)
def test_answer_parser_raises_only_protocol_error(data: bytes, method: str) -> None:
    with contextlib.suppress(ProtocolError):
        parse_answer(data, method)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.integers() | _JSON,
            "method": st.sampled_from(
                ["tpm.nodekey", "tpm.sign", "tpm.ak", "tpm.certify", "tpm.release"]
            )
            | _JSON,
            "params": st.fixed_dictionaries(
                {},
                optional={
                    "record": st.just(RECORD.to_dict()) | _JSON,
                    "digest": st.just("A" * 43 + "=") | _JSON,
                    "qualifying_data": st.just("A" * 43 + "=") | _JSON,
                },
            )
            | _JSON,
            "result": _JSON,
        },
    )
)
def test_structured_requests_and_answers_raise_only_protocol_error(doc: dict[str, object]) -> None:
    line = json.dumps(doc).encode()
    with contextlib.suppress(ProtocolError):
        request = parse_request(line)
        assert parse_request(encode_request(request.id, request.call)[:-1]) == request
    for method in ("tpm.nodekey", "tpm.sign", "tpm.ak", "tpm.certify", "tpm.release"):
        with contextlib.suppress(ProtocolError):
            parse_answer(line, method)


@given(st.sampled_from(CALLS), st.integers(min_value=0, max_value=2**53 - 1))
def test_every_request_round_trips(call: Call, request_id: int) -> None:
    assert parse_request(encode_request(request_id, call)[:-1]) == Request(request_id, call)


def test_client_and_protocol_do_not_load_tpm2_pytss() -> None:
    """bcd node checks the helper's answers without libtss2."""
    code = (
        "import sys, bcd.helper.client, bcd.helper.protocol\n"
        "assert 'tpm2_pytss' not in sys.modules, 'tpm2_pytss was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- the helper against swtpm ---------------------------------------------------------


async def test_each_method_round_trips(swtpm: SwTpm, sockdir: Path) -> None:
    async with running(helper_settings(swtpm, sockdir)) as client:
        record = create_node_key_record()
        key = await client.nodekey(record)
        assert isinstance(key.public_key.curve, ec.SECP256R1)
        pinned = record.pinned(key.public_key)
        again = await client.nodekey(pinned)
        assert again == key

        signature = await client.sign(pinned, key, hashlib.sha256(b"hello").digest())
        pki.verify_p1363(key.public_key, signature, b"hello")

        ak = await client.ak()
        assert check_ak_public(ak.public_area).name == ak.name
        assert await client.ak(expected_name=ak.name) == ak

        certification = await client.certify(pinned, key, CSR_DIGEST)
        assert certification.ak == ak
        verify_certify(
            certification.attest, certification.signature, ak.public_area, key.name, CSR_DIGEST
        )
        assert (await client.certify(pinned, key, CSR_DIGEST, ak)).ak == ak

        await client.release(pinned)
        assert await client.nodekey(pinned) == key  # release forgets nothing it needs


async def test_socket_directory_and_mode(swtpm: SwTpm, sockdir: Path) -> None:
    settings = helper_settings(swtpm, sockdir, mode="off")
    async with running(settings):
        st_sock = os.lstat(settings.socket)
        assert stat.S_ISSOCK(st_sock.st_mode)
        assert stat.S_IMODE(st_sock.st_mode) == 0o660
        assert (st_sock.st_uid, st_sock.st_gid) == (0, NOBODY.pw_gid)
        st_dir = os.lstat(settings.socket.parent)
        assert stat.S_IMODE(st_dir.st_mode) == 0o755
        assert st_dir.st_uid == 0
        assert [p.name for p in settings.socket.parent.iterdir()] == ["helper.sock"]


async def test_helper_checks_the_pin_and_refuses_other_templates(
    swtpm: SwTpm, sockdir: Path
) -> None:
    settings = helper_settings(swtpm, sockdir)
    other = ec.generate_private_key(ec.SECP256R1()).public_key()
    record = create_node_key_record().pinned(other)
    async with running(settings) as client:
        for call in (
            client.nodekey(record),
            client.sign(record, await client.nodekey(create_node_key_record()), DIGEST),
        ):
            with pytest.raises(HelperKeyMismatch, match="derives another key") as info:
                await call
            assert isinstance(info.value, TpmKeyMismatch)
            assert str(info.value) == KEY_MISMATCH_MESSAGE
        ak_record = RECORD.to_dict() | {"template": "bcd-ak-ecc-p256-v1"}
        line = json.dumps({"id": 1, "method": "tpm.nodekey", "params": {"record": ak_record}})
        [answer] = await _raw(settings.socket, line.encode() + b"\n")
        assert json.loads(answer)["error"]["code"] == "bad-request"
        assert "unknown TPM key template" in json.loads(answer)["error"]["message"]


async def test_bad_requests_get_errors_and_the_connection_stays(
    swtpm: SwTpm, sockdir: Path
) -> None:
    settings = helper_settings(swtpm, sockdir)
    async with running(settings):
        good = encode_request(9, AkCall())
        lines = await _raw(
            settings.socket, b"not json\n" + b'{"id": 4, "method": "x", "params": {}}\n' + good
        )
        first, second, third = (json.loads(line) for line in lines)
        assert first == {
            "id": None,
            "error": {"code": "bad-request", "message": "the request is not a JSON object"},
        }
        assert second["id"] == 4
        assert second["error"]["code"] == "unknown-method"
        assert third["id"] == 9
        assert set(third["result"]) == {"public", "name"}
        for line in lines:
            assert b"Traceback" not in line

        lines = await _raw(settings.socket, b"x" * (MAX_LINE + 1) + b"\n" + good)
        assert [json.loads(line)["error"]["code"] for line in lines] == ["too-large"]


async def test_another_user_is_refused_and_logged(
    swtpm: SwTpm, sockdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = helper_settings(swtpm, sockdir, allowed=frozenset({0}))
    async with running(settings) as client:
        with as_nobody():
            stream = await trio.open_unix_socket(str(settings.socket))
        async with stream:
            await stream.send_all(encode_request(1, AkCall()))
            answer = await stream.receive_some(4096)
            assert await stream.receive_some(4096) == b""  # and closed
        assert json.loads(answer) == {
            "id": None,
            "error": {
                "code": "forbidden",
                "message": f"uid {NOBODY.pw_uid} may not use bcd helper",
            },
        }
        assert f"(uid {NOBODY.pw_uid}, gid {NOBODY.pw_gid}): not the [helper] user" in caplog.text

        with as_nobody(), pytest.raises(HelperError, match="refused this user"):
            await client.ak()
        await client.ak()  # root may


async def test_the_helper_user_may_use_it(swtpm: SwTpm, sockdir: Path) -> None:
    settings = helper_settings(swtpm, sockdir, allowed=frozenset({0, NOBODY.pw_uid}))
    async with running(settings) as client:
        with as_nobody():
            key = await client.nodekey(RECORD)
            signature = await client.sign(RECORD, key, DIGEST)
    assert len(signature) == 64  # and the client checked it against the key


async def test_a_user_outside_the_socket_group_cannot_connect(swtpm: SwTpm, sockdir: Path) -> None:
    settings = helper_settings(swtpm, sockdir, gid=0, mode="off")
    async with running(settings) as client:
        with as_nobody(), pytest.raises(HelperError, match="permission denied"):
            await client.ak()


async def test_leftovers_are_flushed_at_start(swtpm: SwTpm, sockdir: Path) -> None:
    esapi = ESAPI(swtpm.tcti)  # another program, or a helper killed mid-call
    try:
        public, _ = TPMT_PUBLIC.unmarshal(node_key_template(b"\x02" * 32))
        for _ in range(3):  # swtpm has three object slots
            esapi.create_primary(
                TPM2B_SENSITIVE_CREATE(), TPM2B_PUBLIC(publicArea=public), ESYS_TR.OWNER
            )
    finally:
        esapi.close()
    assert len(transients(swtpm.tcti)) == 3
    async with running(helper_settings(swtpm, sockdir)) as client:
        key = await client.nodekey(RECORD)  # would find no free slot without the flush
        ak = await client.ak()
        await client.certify(RECORD, key, CSR_DIGEST, ak)  # two objects at once


async def test_stale_socket_is_replaced_and_a_live_one_kept(swtpm: SwTpm, sockdir: Path) -> None:
    settings = helper_settings(swtpm, sockdir, mode="off")
    settings.socket.parent.mkdir(mode=0o755)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(settings.socket))
    stale.close()  # a killed helper's socket: nothing listens
    async with running(settings) as client:
        with pytest.raises(HelperError, match=r"the TPM is off in config\.toml"):
            await client.ak()
        with pytest.raises(HelperError, match="another bcd helper is serving at"):
            await serve_helper(settings)
        assert settings.socket.exists()
        with pytest.raises(HelperError, match="the TPM is off"):
            await client.release(RECORD)


async def test_what_is_not_a_socket_or_not_roots_is_left_alone(swtpm: SwTpm, sockdir: Path) -> None:
    settings = helper_settings(swtpm, sockdir, mode="off")
    settings.socket.parent.mkdir(mode=0o755)
    settings.socket.write_text("a file")
    with pytest.raises(HelperError, match="exists and is not a socket"):
        await serve_helper(settings)
    assert settings.socket.read_text() == "a file"
    settings.socket.unlink()
    settings.socket.parent.chmod(0o777)
    with pytest.raises(HelperError, match="writable by no one else"):
        await serve_helper(settings)
    with pytest.raises(HelperError, match="too long"):
        await serve_helper(
            HelperSettings(sockdir / ("x" * 120), frozenset({0}), 0, swtpm.tcti, "off")
        )


async def test_a_failure_inside_the_helper_is_logged_not_sent(
    swtpm: SwTpm,
    sockdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("internal detail 1234")

    monkeypatch.setattr("bcd.helper.server.public_key_of", broken)
    async with running(helper_settings(swtpm, sockdir)) as client:
        with pytest.raises(HelperError) as info:
            await client.nodekey(RECORD)
        assert str(info.value) == (
            "bcd helper could not answer tpm.nodekey: bcd helper failed on tpm.nodekey; see its log"
        )
        assert "internal detail 1234" in caplog.text  # logged with its traceback
        await client.ak()  # and the helper goes on


async def test_a_lost_tpm_is_a_clear_error(swtpm: SwTpm, sockdir: Path) -> None:
    async with running(helper_settings(swtpm, sockdir)) as client:
        await trio.to_thread.run_sync(swtpm.stop)
        try:
            with pytest.raises(
                HelperError, match=r"could not answer tpm\.nodekey: cannot reach the TPM at swtpm:"
            ):
                await client.nodekey(RECORD)
        finally:
            await trio.to_thread.run_sync(swtpm.start)


async def test_no_socket_is_a_clear_error(sockdir: Path) -> None:
    with pytest.raises(
        HelperError, match=r"bcd helper is not running: no socket at .*helper\.sock"
    ):
        await HelperClient(sockdir / "helper.sock").ak()


async def test_required_tpm_that_cannot_be_opened_stops_the_start(sockdir: Path) -> None:
    settings = HelperSettings(
        sockdir / "helper.sock", frozenset({0}), 0, "swtpm:host=127.0.0.1,port=1", "required"
    )
    with pytest.raises(HelperError, match="the TPM is required but cannot be used"):
        await serve_helper(settings)
    auto = HelperSettings(
        sockdir / "run" / "helper.sock", frozenset({0}), 0, "swtpm:host=127.0.0.1,port=1", "auto"
    )
    async with running(auto, tpm=False) as client:
        with pytest.raises(HelperError, match="this machine's TPM cannot be used: cannot open"):
            await client.nodekey(RECORD)


# --- a helper that answers wrong: the node's checks -----------------------------------


@dataclass(frozen=True)
class Real:
    """Answers the swtpm really gives, to splice into a wrong helper's answers."""

    record: NodeKeyRecord
    key: NodeKeyPublic
    other: NodeKeyPublic
    signature_by_other: bytes
    ak_public: bytes
    ak_name: bytes
    attest: bytes
    attest_signature: bytes


@pytest.fixture(scope="module")
def real(swtpm: SwTpm) -> Real:
    record = create_node_key_record()
    other_record = create_node_key_record()
    with open_tpm(swtpm.tcti) as tpm:
        key = public_key_of(tpm, record)
        other = public_key_of(tpm, other_record)
        attest, attest_signature = certify(tpm, record, CSR_DIGEST)
        ak, name = ak_public(tpm)
        return Real(
            record.pinned(key.public_key),
            key,
            other,
            sign(tpm, other_record, DIGEST),
            ak,
            name,
            attest,
            attest_signature,
        )


def _software_ak(key: ec.EllipticCurvePrivateKey) -> bytes:
    return p256_public_area(key.public_key(), AK_ATTRIBUTES)


def _answering(**results: Result) -> Callable[[Request], bytes]:
    def answer(request: Request) -> bytes:
        return encode_result(request.id, results[request.call.method.replace("tpm.", "")])

    return answer


async def test_node_refuses_a_key_without_the_node_key_attributes(
    real: Real, sockdir: Path
) -> None:
    unpinned = NodeKeyRecord(real.record.unique)
    spki = pki.spki_der(check_ak_public(real.ak_public).ec_key())
    answer = _answering(nodekey=NodeKeyResult(real.ak_public, spki))
    async with wrong_helper(sockdir / "h.sock", answer) as client:
        with pytest.raises(
            HelperError,
            match=r"tpm\.nodekey: the derived key does not have the node-key attributes",
        ):
            await client.nodekey(unpinned)


async def test_node_refuses_another_key_than_the_pin(real: Real, sockdir: Path) -> None:
    other_spki = pki.spki_der(real.other.public_key)
    answer = _answering(nodekey=NodeKeyResult(real.other.public_area, other_spki))
    async with wrong_helper(sockdir / "h.sock", answer) as client:
        with pytest.raises(HelperKeyMismatch, match="derives another key"):
            await client.nodekey(real.record)


async def test_node_refuses_an_spki_that_is_not_the_public_area(real: Real, sockdir: Path) -> None:
    answer = _answering(
        nodekey=NodeKeyResult(real.key.public_area, pki.spki_der(real.other.public_key))
    )
    async with wrong_helper(sockdir / "h.sock", answer) as client:
        with pytest.raises(HelperError, match="SPKI is not the key of the public area"):
            await client.nodekey(real.record)


async def test_node_refuses_a_signature_of_another_key(real: Real, sockdir: Path) -> None:
    answer = _answering(sign=SignResult(real.signature_by_other))
    async with wrong_helper(sockdir / "h.sock", answer) as client:
        with pytest.raises(
            HelperError, match=r"tpm\.sign: the signature does not verify against the node key"
        ):
            await client.sign(real.record, real.key, DIGEST)
    answer = _answering(sign=SignResult(b"\x01" * 63))
    async with wrong_helper(sockdir / "h2.sock", answer) as client:
        with pytest.raises(HelperError, match=r"tpm\.sign: .*64 bytes"):
            await client.sign(real.record, real.key, DIGEST)


async def test_node_refuses_a_certification_from_another_ak(real: Real, sockdir: Path) -> None:
    software = ec.generate_private_key(ec.SECP256R1())
    forged = pki.sign_p1363(software, real.attest)  # P1363 over SHA-256(attest)
    cases: list[tuple[bytes, bytes]] = [
        (real.ak_public, forged),  # announced the TPM's AK, certified with another
        (
            _software_ak(software),
            real.attest_signature,
        ),  # announced another, certified by the TPM's
    ]
    for index, (announced, signature) in enumerate(cases):
        announced_name = check_ak_public(announced).name
        answer = _answering(
            ak=AkResult(announced, announced_name),
            certify=CertifyResult(real.attest, signature),
        )
        async with wrong_helper(sockdir / f"{index}.sock", answer) as client:
            with pytest.raises(
                HelperError,
                match=r"tpm\.certify: the certification does not verify against the AK the helper announced",
            ):
                await client.certify(real.record, real.key, CSR_DIGEST)
    answer = _answering(certify=CertifyResult(real.attest, real.attest_signature))
    async with wrong_helper(sockdir / "ok.sock", answer) as client:
        ak = HelperAk(real.ak_public, real.ak_name)
        await client.certify(real.record, real.key, CSR_DIGEST, ak)  # the real one passes
        with pytest.raises(HelperError, match="certifies for other qualifying data"):
            await client.certify(real.record, real.key, DIGEST, ak)
        with pytest.raises(HelperError, match="certifies another key"):
            await client.certify(real.record, real.other, CSR_DIGEST, ak)


async def test_node_refuses_a_wrong_ak(real: Real, sockdir: Path) -> None:
    cases = [
        (AkResult(real.key.public_area, real.key.name), "the AK does not have the AK attributes"),
        (
            AkResult(real.ak_public, real.key.name),
            "the AK's name is not the name of its public area",
        ),
    ]
    for index, (result, message) in enumerate(cases):
        async with wrong_helper(sockdir / f"{index}.sock", _answering(ak=result)) as client:
            with pytest.raises(HelperError, match=f"tpm.ak: {message}"):
                await client.ak()
    async with wrong_helper(
        sockdir / "x.sock", _answering(ak=AkResult(real.ak_public, real.ak_name))
    ) as client:
        with pytest.raises(
            HelperError, match="the TPM derives another AK than the certificate names"
        ):
            await client.ak(expected_name=real.key.name)


async def test_node_refuses_malformed_silent_or_slow_answers(real: Real, sockdir: Path) -> None:
    cases: list[tuple[Callable[[Request], bytes | None], str]] = [
        (lambda r: b"garbage\n", "refused bcd helper's answer to tpm.ak: malformed answer"),
        (
            lambda r: encode_result(r.id + 1, AkResult(real.ak_public, real.ak_name)),
            "another request",
        ),
        (lambda r: encode_result(r.id, SignResult(b"x")), "must hold public, name"),
        (lambda r: None, "closed the connection without answering tpm.ak"),
        (lambda r: b"x" * (MAX_LINE + 10), "a line over"),
        (
            lambda r: encode_error(r.id, "tpm", "the TPM refused CreatePrimary"),
            "could not answer tpm.ak: the TPM refused CreatePrimary",
        ),
        (lambda r: b"hang", "did not answer tpm.ak within 2 seconds"),
    ]
    for index, (answer, message) in enumerate(cases):
        async with wrong_helper(sockdir / f"{index}.sock", answer) as client:
            with pytest.raises(HelperError, match=message):
                await client.ak()


async def test_client_refuses_bad_arguments(real: Real, sockdir: Path) -> None:
    client = HelperClient(sockdir / "none.sock")
    with pytest.raises(HelperError, match="32-byte"):
        await client.sign(real.record, real.key, b"short")
    with pytest.raises(HelperError, match="32-byte"):
        await client.certify(real.record, real.key, b"short")


# --- run_helper: a real process ---------------------------------------------------------


def _config_text(swtpm: SwTpm, socket_path: Path, *, helper: bool = True) -> str:
    pin = pki.spki_pin(pki.generate_key().public_key())
    text = (
        'gateway_url = "https://gw.example.com"\n'
        f'site = "site_{"a" * 26}"\n'
        f'serving_ca_spki_pin = "{pin}"\n'
        f'join_signing_key_pin = "{pin}"\n'
        f'join_encryption_key_pin = "{pin}"\n'
        "\n[tpm]\n"
        'mode = "required"\n'
        f'tcti = "{swtpm.tcti}"\n'
    )
    if helper:
        text += f'\n[helper]\nuser = "nobody"\nsocket = "{socket_path}"\n'
    return text


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"bcd helper exited: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError("bcd helper did not create its socket")
        time.sleep(0.05)


async def test_run_helper_serves_until_sigterm(swtpm: SwTpm, sockdir: Path) -> None:
    socket_path = sockdir / "run" / "helper.sock"
    config = sockdir / "config.toml"
    config.write_text(_config_text(swtpm, socket_path))
    code = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "from bcd.config import load_config\n"
        "from bcd.helper.server import run_helper\n"
        "logging.basicConfig(format='%(name)s: %(message)s')\n"
        "warn = lambda m: print(m, file=sys.stderr)\n"
        f"sys.exit(run_helper(load_config(Path({str(config)!r})), warn))\n"
    )
    proc = subprocess.Popen(  # noqa: ASYNC220 - a real process, waited for below
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TSS2_LOG="all+NONE"),
    )
    try:
        await trio.to_thread.run_sync(_wait_for, socket_path, proc)
        st_sock = os.lstat(socket_path)
        assert (st_sock.st_uid, st_sock.st_gid) == (0, NOBODY.pw_gid)
        client = HelperClient(socket_path)
        key = await client.nodekey(RECORD)
        await client.sign(RECORD, key, DIGEST)
        with as_nobody():  # nobody is this config's [helper] user
            await client.ak()
        proc.send_signal(signal.SIGTERM)
        _out, err = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=20))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "received SIGTERM; stopping" in err
    assert "Traceback" not in err
    assert not socket_path.exists()
    assert transients(swtpm.tcti) == []


def test_run_helper_without_a_helper_table_or_user(swtpm: SwTpm, sockdir: Path) -> None:
    path = sockdir / "config.toml"
    cfg = parse_config(_config_text(swtpm, sockdir / "h.sock", helper=False), path)
    said: list[str] = []
    assert run_helper(cfg, said.append) == 1
    assert len(said) == 1
    assert "has no [helper] table" in said[0]
    text = _config_text(swtpm, sockdir / "h.sock").replace('"nobody"', '"no-such-user-x"')
    said.clear()
    assert run_helper(parse_config(text, path), said.append) == 1
    assert len(said) == 1
    assert "no user named 'no-such-user-x'" in said[0]


# --- root's join record -------------------------------------------------------------


def _record_of(memory_pki: Any, node_id: str, tmp: Path) -> Path:
    from bcd.identity import JOIN_RECORD_FILE

    signed = wire.sign_response({"kind": "joined", "node_id": node_id}, memory_pki.join_signing_key)
    tmp.mkdir(mode=0o700, exist_ok=True)
    (tmp / JOIN_RECORD_FILE).write_text(signed)
    (tmp / JOIN_RECORD_FILE).chmod(0o600)
    return tmp / JOIN_RECORD_FILE


def test_the_helper_reads_root_s_join_record(memory_pki: Any, tmp_path: Path) -> None:
    from bcd.helper.server import read_join_record

    pin = memory_pki.pins()["join_signing_key_pin"]
    assert read_join_record(tmp_path / "none", pin) == ""  # not joined as root yet
    node = "node_" + "a" * 26
    path = _record_of(memory_pki, node, tmp_path / "hc")
    assert read_join_record(path.parent, pin) == node
    other_pin = pki.spki_pin(ec.generate_private_key(ec.SECP256R1()).public_key())
    with pytest.raises(HelperError, match="does not verify under join_signing_key_pin"):
        read_join_record(path.parent, other_pin)
    forged = wire.sign_response({"kind": "joined", "node_id": node}, pki.generate_key())
    path.write_text(forged)
    with pytest.raises(HelperError, match="does not verify"):
        read_join_record(path.parent, pin)
    _record_of(memory_pki, node, tmp_path / "hc")
    path.chmod(0o666)
    with pytest.raises(HelperError, match="writable only by root"):
        read_join_record(path.parent, pin)


async def test_the_helper_tells_which_node_it_serves(swtpm: SwTpm, tmp_path: Path) -> None:
    node = "node_" + "b" * 26
    settings = dataclasses.replace(helper_settings(swtpm, tmp_path), node_id=node)
    async with running(settings) as client:
        assert await client.served_node() == node
    async with running(helper_settings(swtpm, tmp_path)) as client:
        assert await client.served_node() == ""


async def test_doctor_names_the_node_the_helper_serves(swtpm: SwTpm, tmp_path: Path) -> None:
    from bcd.doctor import helper_node_check

    node = "node_" + "c" * 26
    settings = dataclasses.replace(helper_settings(swtpm, tmp_path), node_id=node)
    path = tmp_path / "config.toml"
    path.write_text(_config_text(swtpm, settings.socket))
    cfg = parse_config(path.read_text(), path)
    async with running(settings):
        same = await trio.to_thread.run_sync(helper_node_check, cfg, node)
        other = await trio.to_thread.run_sync(helper_node_check, cfg, "node_" + "d" * 26)
    assert (same.status, same.message) == (
        "ok",
        f"bcd helper serves node {node} (root's join record)",
    )
    assert other.status == "fail"
    assert "restart bcd-helper.service" in other.message

"""Adversarial review: bcd's command line, its credential sources, bcd join --reset, the
privacy of the data directory, config.toml's reads, the seeds' texts and install-bcd.sh.

Each test failed before its fix; each asserts what an operator (or an attacker) sees.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import pwd
import re
import resource
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki
from bcd.cli import main
from bcd.config import load_config, parse_config
from bcd.doctor import run_checks
from bcd.errors import ConfigError, IdentityError
from bcd.helper import HelperError
from bcd.helper.client import HelperAk
from bcd.helper.protocol import CertifyResult, Request, SignResult, encode_result
from bcd.identity import NOT_JOINED, load_state, persist_join
from bcd.keys.file import key_to_pem
from bcd.tpm.record import NodeKeyPublic, NodeKeyRecord, create_node_key_record
from bcd.tpm.templates import (
    AK_ATTRIBUTES,
    check_ak_public,
    check_node_key_public,
    node_key_public_area,
    p256_public_area,
)
from control.installscript import build_values, render
from tests.certs import CertAuthority, make_ca, node_identity
from tests.world import BIN, ControlPlane, Node, cli_env, offline_node_config, run

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "control" / "install-bcd.sh"
NOW = datetime.now(UTC)


# A token of the bearer form, never minted: the checks under test come first. Its
# secret mixes upper and lower case and digits, as every real one does.
SECRET = base64.urlsafe_b64encode(bytes(range(7, 39))).rstrip(b"=").decode()
TOKEN = f"bcjt_jt_01k5w8x9y2z3a4b5c6d7e8f9g0.{SECRET}"
StdinFrom = Callable[[bytes | None], None]


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return make_ca()


def joined(data_dir: Path, ca: CertAuthority) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key, identity = node_identity(ca)
    pem = key_to_pem(key)
    persist_join(data_dir, identity, pem, NOW)
    return key, pem


class _Stdin:
    """Stands in for sys.stdin: ``buffer`` is a real file object with a descriptor."""

    def __init__(self, raw: io.BufferedReader) -> None:
        self.buffer = raw


@pytest.fixture
def stdin_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[StdinFrom]:
    """``stdin_from(b"...")`` makes standard input a file holding those bytes."""
    opened: list[io.BufferedReader] = []

    def use(data: bytes | None) -> None:
        if data is None:
            raw = open(os.devnull, "rb")  # noqa: SIM115 - closed below
        else:
            path = tmp_path / f"stdin-{len(opened)}"
            path.write_bytes(data)
            raw = open(path, "rb")  # noqa: SIM115 - closed below
        opened.append(raw)
        monkeypatch.setattr(sys, "stdin", _Stdin(raw))

    yield use
    for raw in opened:
        raw.close()


def _bcd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- 1. the command line never echoes a token, and names the flag ----------------------


def test_an_abbreviated_token_flag_is_an_unknown_option_and_the_token_is_never_echoed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _bcd(capsys, "join", "--token", TOKEN)
    assert code == 2
    assert "unknown option --token" in err
    assert SECRET not in out + err
    assert "bcjt_" not in out + err
    code, out, err = _bcd(capsys, "join", f"--token={TOKEN}")
    assert code == 2
    assert "unknown option --token" in err
    assert SECRET not in out + err


@pytest.mark.parametrize(
    "argv",
    [
        ["join", "--attestor", TOKEN],
        ["join", "--token-file", TOKEN],
        ["join", f"--token-file={TOKEN}"],
        ["join", "--config", TOKEN],
        ["join", "--data-dir", f"/var/lib/{TOKEN}"],
        ["join", "--node-id", SECRET],
        ["join", "--server", f"https://{SECRET}.example.com"],
        ["join", "--join-signing-pin", TOKEN],
        ["join", "--role", TOKEN],
        ["join", "--" + TOKEN],
        ["join", TOKEN],
        ["doctor", "--config", TOKEN],
        ["vouch", "--mac", TOKEN, "--boot-lease-epoch", "1"],
        ["vouch", "--mac", "0c:c4:7a:12:34:56", "--boot-lease-epoch", TOKEN],
        [TOKEN],
    ],
)
def test_no_value_that_may_be_a_secret_is_echoed(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _bcd(capsys, *argv)
    assert code == 2, err
    assert SECRET not in out + err
    assert "bcjt_" not in out + err
    assert err.startswith("bcd: usage: ")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["join", "--tokenfile", "/run/secrets/join-token"], "unknown option --tokenfile"),
        (["join", "--foo"], "unknown option --foo"),
        (["join", "--foo=bar"], "unknown option --foo"),
        (["join", "--role", "siet"], "argument --role: invalid choice: 'siet'"),
        (["join", "--token-file"], "argument --token-file: expected one argument"),
        (["doctor", "--js"], "unknown option --js"),  # no abbreviation on any parser
        (["vouch", "--ma", "x", "--boot-lease-epoch", "1"], "unknown option --ma"),
        (["vouch", "--boot-lease-epoch", "1"], "bcd vouch needs --mac"),
    ],
)
def test_a_typo_names_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = _bcd(capsys, *argv)
    assert code == 2
    assert named in err
    assert "takes no positional argument" not in err


def test_a_positional_argument_is_still_refused_without_echo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _bcd(capsys, "join", "hunter2")
    assert code == 2
    assert "takes no positional argument" in err
    assert "hunter2" not in out + err


def test_the_value_of_a_secret_looking_pin_is_refused_only_for_a_bearer_prefix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A real pin is high-entropy: it is never mistaken for a secret."""
    pin = pki.spki_pin(pki.generate_key().public_key())
    code, _out, err = _bcd(
        capsys, "join", "--config", str(tmp_path / "none.toml"), "--join-signing-pin", pin
    )
    assert code == 1  # past the command line: no configuration there
    assert "no configuration at" in err


# --- 4. two credential sources are a usage error ----------------------------------------


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "join-token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def test_a_token_file_and_a_token_on_standard_input_are_refused(
    capsys: pytest.CaptureFixture[str], stdin_from: StdinFrom, tmp_path: Path
) -> None:
    token_file = _token_file(tmp_path)
    stdin_from(TOKEN.encode() + b"\n")
    config = str(tmp_path / "c.toml")
    code, out, err = _bcd(capsys, "join", "--config", config, "--token-file", str(token_file))
    assert code == 2
    assert "both on standard input and with --token-file" in err
    assert SECRET not in out + err
    assert token_file.exists()  # neither was used


def test_a_token_file_with_the_tpm_attestor_is_refused(
    capsys: pytest.CaptureFixture[str], stdin_from: StdinFrom, tmp_path: Path
) -> None:
    stdin_from(None)
    token_file = _token_file(tmp_path)
    code, _out, err = _bcd(capsys, "join", "--token-file", str(token_file), "--attestor", "tpm")
    assert code == 2
    assert "--token-file gives a join token, and --attestor tpm reads none" in err
    assert token_file.exists()


def test_a_token_on_standard_input_with_the_tpm_attestor_is_refused(
    capsys: pytest.CaptureFixture[str], stdin_from: StdinFrom
) -> None:
    stdin_from(TOKEN.encode())
    code, out, err = _bcd(capsys, "join", "--attestor", "tpm")
    assert code == 2
    assert "--attestor tpm reads no join token, but standard input holds something" in err
    assert SECRET not in out + err


def test_an_empty_standard_input_beside_a_token_file_is_no_conflict(
    capsys: pytest.CaptureFixture[str], stdin_from: StdinFrom, tmp_path: Path
) -> None:
    stdin_from(None)
    token_file = _token_file(tmp_path)
    code, _out, err = _bcd(
        capsys, "join", "--config", str(tmp_path / "none.toml"), "--token-file", str(token_file)
    )
    assert code == 1
    assert "no configuration at" in err


# --- 3. bcd join --reset --yes: read and check first, say what happened after ------------


def test_reset_yes_without_a_credential_moves_aside_and_says_so(
    capsys: pytest.CaptureFixture[str], stdin_from: StdinFrom, tmp_path: Path, ca: CertAuthority
) -> None:
    data = tmp_path / "data"
    joined(data, ca)
    config = offline_node_config(tmp_path, data)
    stdin_from(None)
    code, out, err = _bcd(capsys, "join", "--config", str(config), "--reset", "--yes")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split(" -> ")[0] for line in lines if line.startswith("moved ")] == [
        f"moved {data}/identity.json",
        f"moved {data}/node.key",
    ]
    assert "moving" not in out
    assert lines[-1].startswith("no join credential was given, so nothing was joined")
    assert not (data / "identity.json").exists()
    assert len(list(data.glob("identity.json.reset-*"))) == 1
    assert len(list(data.glob("node.key.reset-*"))) == 1
    assert load_state(data) is None  # the second step, bcd join, now joins


def test_reset_yes_from_a_terminal_moves_aside_too(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    ca: CertAuthority,
) -> None:
    data = tmp_path / "data"
    joined(data, ca)
    config = offline_node_config(tmp_path, data)
    controller, terminal = os.openpty()
    try:
        with open(terminal, "rb", closefd=False) as raw:
            monkeypatch.setattr(sys, "stdin", _Stdin(raw))
            code, out, _err = _bcd(capsys, "join", "--config", str(config), "--reset", "--yes")
    finally:
        os.close(controller)
        os.close(terminal)
    assert code == 0
    assert "moved " in out
    assert not (data / "identity.json").exists()


@pytest.mark.parametrize("source", ["not a token", "missing token file"])
def test_reset_yes_with_a_bad_credential_moves_nothing_and_prints_no_move(
    source: str,
    capsys: pytest.CaptureFixture[str],
    stdin_from: StdinFrom,
    tmp_path: Path,
    ca: CertAuthority,
) -> None:
    data = tmp_path / "data"
    joined(data, ca)
    before = sorted(p.name for p in data.iterdir())
    config = offline_node_config(tmp_path, data)
    if source == "not a token":
        stdin_from(b"bcak_not_a_join_token\n")
        extra: list[str] = []
        expected = "the join credential is not a join token (bcjt_…)"
    else:
        stdin_from(None)
        extra = ["--token-file", str(tmp_path / "absent")]
        expected = "does not exist"
    code, out, err = _bcd(capsys, "join", "--config", str(config), "--reset", "--yes", *extra)
    assert code == 1
    assert expected in err
    assert "mov" not in out
    assert sorted(p.name for p in data.iterdir()) == before


def test_the_doctors_two_steps_work_as_written(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    """`bcd join --reset --yes`, then `bcd join`, with real processes."""
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site)
    first = node.join(cp.token(pool)["token"])
    assert first.returncode == 0, first.stderr
    old = json.loads((node.data_dir / "identity.json").read_text())["node_id"]

    step1 = node.join(None, "--reset", "--yes")
    assert step1.returncode == 0, step1.stderr
    assert "moved " in step1.stdout
    assert "moving" not in step1.stdout
    assert not (node.data_dir / "identity.json").exists()
    assert node.bcd("doctor").stdout.splitlines()[1].endswith(NOT_JOINED)

    token = cp.token(pool, allowReclaim=True)["token"]
    step2 = node.join(token)
    assert step2.returncode == 0, step2.stderr
    assert step2.stdout.startswith("joined as node_")
    assert json.loads((node.data_dir / "identity.json").read_text())["node_id"] == old
    assert token.split(".")[1] not in step1.stdout + step1.stderr + step2.stdout + step2.stderr


# --- 6. the data directory and its files must be private ---------------------------------


def test_an_open_data_directory_is_refused_and_doctor_fails(
    tmp_path: Path, ca: CertAuthority
) -> None:
    data = tmp_path / "data"
    joined(data, ca)
    data.chmod(0o777)
    with pytest.raises(IdentityError, match=rf"chmod 0700 {re.escape(str(data))}$"):
        load_state(data)
    check = run_checks(offline_node_config(tmp_path, data), datetime.now(UTC))[1]
    assert check.status == "fail"
    assert "is not private (it is mode 0777: other users can read and write it)" in check.message
    data.chmod(0o700)
    assert run_checks(offline_node_config(tmp_path, data), datetime.now(UTC))[1].status == "ok"


def test_a_readable_node_key_is_refused_and_doctor_fails(tmp_path: Path, ca: CertAuthority) -> None:
    data = tmp_path / "data"
    joined(data, ca)
    (data / "node.key").chmod(0o644)
    with pytest.raises(IdentityError, match=r"chmod 0600 .*node\.key \(another user may have"):
        load_state(data)
    check = run_checks(offline_node_config(tmp_path, data), datetime.now(UTC))[1]
    assert check.status == "fail"
    assert "node.key is not private (it is mode 0644: other users can read it)" in check.message


def test_a_file_of_another_user_is_refused_unless_it_is_the_helper_users(
    tmp_path: Path, ca: CertAuthority
) -> None:
    nobody = pwd.getpwnam("nobody")
    data = tmp_path / "data"
    joined(data, ca)
    os.chown(data / "node.key", nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(IdentityError, match=rf"owned by uid {nobody.pw_uid}, which is not root"):
        load_state(data)
    plain = run_checks(offline_node_config(tmp_path, data), datetime.now(UTC))[1]
    assert plain.status == "fail"
    # under [helper] the join hands node.key to the helper user: trusted
    helper = offline_node_config(tmp_path, data, '[helper]\nuser = "nobody"\n[tpm]\nmode = "off"\n')
    assert run_checks(helper, datetime.now(UTC))[1].status == "ok"


def test_a_planted_tpm_record_never_replaces_a_file_key(
    tmp_path: Path, ca: CertAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    """A record pinned to the leaf's public key is built from public data alone."""
    data = tmp_path / "data"
    key, pem = joined(data, ca)
    planted = create_node_key_record().pinned(key.public_key()).to_json()
    next_key = data / "node.key.next"
    next_key.write_bytes(planted)
    next_key.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="bcd.identity"):
        state = load_state(data)
    assert state is not None
    assert (data / "node.key").read_bytes() == pem  # the file key is intact
    assert not next_key.exists()
    (aside,) = data.glob("node.key.next.refused-*")
    assert aside.read_bytes() == planted
    assert "holds a tpm key and identity.json's key is a file key" in caplog.text
    assert load_state(data) is not None  # and it keeps loading


def test_a_next_key_others_could_read_is_never_promoted(
    tmp_path: Path, ca: CertAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    _key, pem = joined(data, ca)
    next_key = data / "node.key.next"
    next_key.write_bytes(pem)
    next_key.chmod(0o644)
    (data / "node.key").write_bytes(key_to_pem(pki.generate_key()))  # as if mid-renewal
    with (
        caplog.at_level(logging.WARNING, logger="bcd.identity"),
        pytest.raises(IdentityError, match="does not match the node certificate"),
    ):
        load_state(data)
    assert not next_key.exists()
    assert len(list(data.glob("node.key.next.refused-*"))) == 1
    assert "it is mode 0644: other users can read it" in caplog.text


def test_a_search_only_data_directory_is_private(tmp_path: Path, ca: CertAuthority) -> None:
    data = tmp_path / "data"
    joined(data, ca)
    data.chmod(0o711)
    assert load_state(data) is not None


# --- 7. config.toml is judged before it is read ------------------------------------------


def _limited() -> None:
    limit = 2 * 1024**3
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _doctor(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "bcd"), "doctor", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=_limited,
    )


def test_a_fifo_as_config_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    done = _doctor(fifo)  # raised TimeoutExpired before: bcd waited for a writer
    assert done.returncode == 1
    assert f"{fifo}: is a FIFO, not a regular file" in done.stdout
    with pytest.raises(ConfigError, match="is a FIFO, not a regular file"):
        load_config(fifo)


def test_dev_zero_and_a_huge_sparse_file_as_config_are_refused_unread(tmp_path: Path) -> None:
    done = _doctor(Path("/dev/zero"))  # exited 70 (MemoryError) before
    assert done.returncode == 1, done.stderr
    assert "/dev/zero: is a character device, not a regular file" in done.stdout
    sparse = tmp_path / "config.toml"
    with open(sparse, "wb") as f:
        f.truncate(8 * 1024**3)
    done = _doctor(sparse)
    assert done.returncode == 1, done.stderr
    assert f"{sparse}: larger than 65536 bytes" in done.stdout


def test_a_fifo_as_the_join_key_file_fails_the_join_at_once(tmp_path: Path) -> None:
    config = offline_node_config(tmp_path, tmp_path / "data", '[tpm]\nmode = "off"\n')
    os.mkfifo(tmp_path / "join-encryption.jwk")
    done = run(
        [str(BIN / "bcd"), "join", "--config", str(config)],
        input=(TOKEN + "\n").encode(),
        env=cli_env(tmp_path, secret=False),
        timeout=60,
    )
    assert done.returncode == 1
    assert "join-encryption.jwk is a FIFO, not a regular file" in done.stderr
    assert SECRET not in done.stdout + done.stderr


# --- 5. the seeds' texts, verbatim --------------------------------------------------------


def test_not_joined_is_the_seeds_text_for_doctor_and_node(tmp_path: Path) -> None:
    from bcd.node import load_identity

    config = offline_node_config(tmp_path, tmp_path / "data")
    check = run_checks(config, datetime.now(UTC))[1]
    assert check.message == "this node has not joined (run bcd join)"
    cfg = parse_config(config.read_text(), config)
    with pytest.raises(IdentityError) as info:
        load_identity(cfg, datetime.now(UTC))
    assert str(info.value) == "this node has not joined (run bcd join)"


def _software_node_key() -> tuple[NodeKeyRecord, NodeKeyPublic]:
    public = pki.generate_key().public_key()
    area = node_key_public_area(public)
    return create_node_key_record().pinned(public), NodeKeyPublic(
        public, area, check_node_key_public(area).name
    )


async def test_the_helpers_wrong_signature_and_ak_use_the_seeds_texts(tmp_path: Path) -> None:
    from tests.world.agent import wrong_helper

    record, key = _software_node_key()
    digest = secrets.token_bytes(32)
    other = pki.generate_key()

    def sign_answer(request: Request) -> bytes:
        return encode_result(request.id, SignResult(pki.sign_p1363(other, b"something")))

    async with wrong_helper(tmp_path / "s.sock", sign_answer) as client:
        with pytest.raises(HelperError, match="the helper's signature is not the node key's"):
            await client.sign(record, key, digest)

    announced = pki.generate_key()
    area = p256_public_area(announced.public_key(), AK_ATTRIBUTES)
    ak = HelperAk(area, check_ak_public(area).name)
    attest = b"\xffTCG" + secrets.token_bytes(60)

    def certify_answer(request: Request) -> bytes:
        return encode_result(request.id, CertifyResult(attest, pki.sign_p1363(other, attest)))

    async with wrong_helper(tmp_path / "c.sock", certify_answer) as client:
        with pytest.raises(HelperError, match="the helper certified with another AK"):
            await client.certify(record, key, digest, ak)


def test_a_replayed_key_says_revoke_that_token_and_create_a_new_one(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    base = ["join-tokens", "create", "--tenant", cp.root_tenant, "--pool", pool, "--key", "k1"]
    assert cp.cli(*base, "--out", str(tmp_path / "a")).returncode == 0
    replay = cp.cli(*base, "--out", str(tmp_path / "b"))
    assert replay.returncode == 1
    assert "revoke that token and create a new one (better-compute join-tokens revoke jt_" in (
        replay.stderr
    )


# --- 2. install-bcd.sh: the token leaves the environment before any process starts -------

_BUILTIN_WORDS = {"if", "elif", "else", "fi", "then", "[", "!", "read", "unset", "true", "set"}
_BUILTIN_WORDS |= {"umask"}


def _commands_before_unset(text: str) -> list[str]:
    """The shell commands before ``unset BCD_JOIN_TOKEN`` (comments and blanks dropped)."""
    lines = text.splitlines()
    index = next(
        i for i, line in enumerate(lines) if line.strip().startswith("unset BCD_JOIN_TOKEN")
    )
    commands: list[str] = []
    for line in lines[:index]:
        code = line.strip()
        if not code or code.startswith("#"):
            continue
        commands.extend(part.strip() for part in re.split(r";|\|\||&&", code) if part.strip())
    return commands


def _rendered(memory_pki: Any) -> str:
    pins = memory_pki.pins()
    jwk = memory_pki.well_known_join()["encryptionJwk"]
    values = build_values(
        pool="pool_" + "0" * 26,
        site="site_" + "1" * 26,
        gateway_url="https://gw.example.com",
        base_url="https://compute.example.com",
        bcd_version="0.1.0",
        sha256="amd64=" + "ab" * 32,
        pins=pins,
        join_jwk=jwk,
    )
    return render(values)


def test_the_first_command_that_can_start_a_process_comes_after_the_unset(
    memory_pki: Any,
) -> None:
    for text in (TEMPLATE.read_text(), _rendered(memory_pki)):
        commands = _commands_before_unset(text)
        assert commands, "the token is read and unset near the top"
        for command in commands:
            assert "$(" not in command, command
            assert "`" not in command, command
            assert not re.search(r"(?<!\|)\|(?!\|)", command), command  # no pipeline
            word = command.split()[0]
            assert word in _BUILTIN_WORDS or re.fullmatch(r"[a-z_]+=\S*", word), command


def _stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("via", ["environment", "standard input"])
def test_no_program_the_script_starts_sees_the_token(
    via: str, memory_pki: Any, tmp_path: Path
) -> None:
    """Stand-ins for id and uname record their environment; the script stops at uname."""
    script = tmp_path / "install-bcd.sh"
    script.write_text(_rendered(memory_pki))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    seen = tmp_path / "seen"
    record = f'env >> {seen}; printf "%s\\n" "--- $0" >> {seen}\n'
    _stub(stubs, "id", record + "echo 0\n")
    _stub(stubs, "uname", record + "echo sparc64\n")
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C"}
    if via == "environment":
        env["BCD_JOIN_TOKEN"] = TOKEN
    done = subprocess.run(
        ["sh", str(script)],
        input=TOKEN + "\n" if via == "standard input" else "",
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "this machine is sparc64" in done.stderr
    recorded = seen.read_text()
    assert "--- " + str(stubs / "id") in recorded
    assert "--- " + str(stubs / "uname") in recorded
    assert SECRET not in recorded
    assert "BCD_JOIN_TOKEN" not in recorded
    assert SECRET not in done.stdout + done.stderr


def test_the_template_reads_the_token_before_its_first_check() -> None:
    text = TEMPLATE.read_text()
    assert text.index("unset BCD_JOIN_TOKEN") < text.index("$(id -u)")
    assert text.index("unset BCD_JOIN_TOKEN") < text.index("# @@RENDERED@@")

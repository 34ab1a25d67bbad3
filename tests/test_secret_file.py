"""The PKI secret from a file: ``--secret-file FILE`` and systemd's
``$CREDENTIALS_DIRECTORY/better-compute-secret``, with real ``better-compute``
processes. The file is a regular 0600/0400 file of this user, never followed through a
symlink, at most 4 KiB, its trailing newline not part of the secret; a refusal names the
file and the fix and never a byte of the file. ``BETTER_COMPUTE_SECRET`` keeps working.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e import BIN, SECRET, cli_env, run, start_serve

BC = str(BIN / "better-compute")


@pytest.fixture
def home(tmp_path: Path, pki_template: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    return home


def _secret_file(path: Path, text: str = SECRET + "\n", mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_secret_file_decrypts_the_pki_without_the_environment(home: Path, tmp_path: Path) -> None:
    secret = _secret_file(tmp_path / "secret")
    env = cli_env(home, secret=False)
    done = run([BC, "pki", "issue-gateway", "--san", "gw.example", "--secret-file", str(secret)],
               env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (home / "pki" / "gateway-gw.example.crt").exists()
    # the same with the environment's secret: it keeps working
    done = run([BC, "pki", "issue-gateway", "--san", "gw2.example"], env=cli_env(home))
    assert done.returncode == 0, done.stderr


def test_systemd_credential_is_read(home: Path, tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    _secret_file(creds / "better-compute-secret", mode=0o400)
    env = {**cli_env(home, secret=False), "CREDENTIALS_DIRECTORY": str(creds)}
    done = run([BC, "pki", "rotate-join-key"], env=env)
    assert done.returncode == 0, done.stderr
    assert "a new join encryption key" in done.stdout


@pytest.mark.parametrize(
    ("mode", "credential_ok", "secret_file_ok"),
    [
        # systemd's LoadCredential=: root's 0400 plus a POSIX ACL for the service user,
        # whose mask stat shows in the group bits
        (0o440, True, False),
        (0o460, False, False),  # group write
        (0o450, False, False),  # group exec
        (0o444, False, False),  # others
        (0o400, True, True),
    ],
)
def test_a_credential_may_be_group_readable_and_a_secret_file_not(
    home: Path, tmp_path: Path, mode: int, credential_ok: bool, secret_file_ok: bool
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    credential = _secret_file(creds / "better-compute-secret", mode=mode)
    env = {**cli_env(home, secret=False), "CREDENTIALS_DIRECTORY": str(creds)}
    done = run([BC, "pki", "rotate-join-key"], env=env, timeout=30)
    assert (done.returncode == 0) is credential_ok, done.stderr
    if not credential_ok:
        assert f"the secret file {credential} can be read or changed by other users" in (
            done.stderr
        )
    plain = _secret_file(tmp_path / "secret", mode=mode)
    done = run([BC, "pki", "rotate-join-key", "--secret-file", str(plain)],
               env=cli_env(home, secret=False), timeout=30)  # fmt: skip
    assert (done.returncode == 0) is secret_file_ok, done.stderr
    if not secret_file_ok:
        assert f"(mode {mode:04o}): chmod 0600 {plain}" in done.stderr
    assert SECRET not in done.stderr


def test_serve_takes_its_secret_from_the_file(home: Path, tmp_path: Path) -> None:
    secret = _secret_file(tmp_path / "secret")
    env = cli_env(home, secret=False)
    proc, info = start_serve(
        home,
        ["--api-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0",
         "--secret-file", str(secret)],
        env,
    )  # fmt: skip
    try:
        assert info["role"] == "all"
        for part in ("environ", "cmdline"):  # the secret is in neither
            assert SECRET.encode() not in Path(f"/proc/{proc.pid}/{part}").read_bytes()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert SECRET not in (home / "serve.log").read_text()


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("mode", "can be read or changed by other users (mode 0640): chmod 0600 {path}"),
        ("symlink", "is a symbolic link, not a regular file; name the file itself"),
        ("missing", "does not exist"),
        ("fifo", "is a FIFO, not a regular file"),
        ("large", "is over 4096 bytes"),
        ("short", "is shorter than 16 characters"),
    ],
)
def test_a_bad_secret_file_is_refused_by_name(
    home: Path, tmp_path: Path, setup: str, expected: str
) -> None:
    path = tmp_path / "secret"
    if setup == "mode":
        _secret_file(path, mode=0o640)
    elif setup == "symlink":
        _secret_file(tmp_path / "real")
        path.symlink_to(tmp_path / "real")
    elif setup == "fifo":
        os.mkfifo(path, 0o600)
    elif setup == "large":
        _secret_file(path, SECRET * 200)
    elif setup == "short":
        _secret_file(path, "shortsecret\n")
    done = run([BC, "pki", "rotate-join-key", "--secret-file", str(path)],
               env=cli_env(home, secret=False), timeout=20)  # fmt: skip
    assert done.returncode == 1
    line = done.stderr.strip()
    assert "\n" not in line
    assert line.startswith(f"better-compute: INVALID_CONFIG: the secret file {path} ") or (
        setup == "short"
        and line.startswith(f"better-compute: INVALID_CONFIG: the secret in {path}")
    )
    assert expected.format(path=path) in line
    assert SECRET not in done.stderr
    assert "shortsecret" not in done.stderr


def test_the_trailing_newline_is_not_part_of_the_secret(home: Path, tmp_path: Path) -> None:
    bare = _secret_file(tmp_path / "bare", SECRET)
    crlf = _secret_file(tmp_path / "crlf", SECRET + "\r\n")
    wrong = _secret_file(tmp_path / "wrong", SECRET + "\n\n")
    env = cli_env(home, secret=False)
    for path in (bare, crlf):
        done = run([BC, "pki", "rotate-join-key", "--secret-file", str(path)], env=env)
        assert done.returncode == 0, done.stderr
    done = run([BC, "pki", "rotate-join-key", "--secret-file", str(wrong)], env=env)
    assert done.returncode == 1
    assert "does not decrypt" in done.stderr


def test_pki_pins_needs_no_secret(home: Path) -> None:
    done = run([BC, "pki", "pins"], env=cli_env(home, secret=False))
    assert done.returncode == 0, done.stderr
    assert "serving_ca_spki_pin" in done.stdout


def test_a_gateway_refuses_a_secret_file(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path / "secret")
    done = run(
        [BC, "serve", "--role", "gateway", "--gateway-dir", str(tmp_path), "--db",
         "postgresql://127.0.0.1:1/x", "--api-upstream", "https://127.0.0.1:1",
         "--secret-file", str(secret)],
        env=cli_env(tmp_path, secret=False),
        timeout=20,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"a gateway holds no PKI key: give it no secret (--secret-file {secret})" in done.stderr

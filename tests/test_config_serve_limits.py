"""``serve --relay-max-per-source N`` (and its config key ``relay-max-per-source``): the
relay listener's connections from one address, 512 by default, 1 to 2,048 (the
listener's own bound); a bad value is a usage error naming it. Real ``better-compute``
processes."""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from control import server
from control.cli import build_parser
from control.errors import ControlError
from tests.e2e import BIN, cli_env, run, start_serve

BC = str(BIN / "better-compute")


def _config(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_the_default_is_512() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.relay_max_per_source is None  # not given: server.main's default
    assert server.RELAY_MAX_PER_SOURCE == 512
    assert server.relay_limits() == server.LIMITS["relay"]
    assert server.LIMITS["relay"].max_per_source == 512


def test_a_gateway_given_the_relay_bound_is_refused(tmp_path: Path) -> None:
    done = run([BC, "serve", "--role", "gateway", "--relay-max-per-source", "64"],
               env=cli_env(tmp_path, secret=False))  # fmt: skip
    assert done.returncode == 2
    assert "--relay-max-per-source is for --role api" in done.stderr


@contextlib.contextmanager
def _connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _closed(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_relay_listener_refuses_the_source_past_the_configured_bound(
    tmp_path: Path, pki_template: Path
) -> None:
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    config = _config(tmp_path / "serve.toml", "relay-max-per-source = 2\n")
    proc, info = start_serve(
        home,
        ["--config", str(config), "--role", "api", "--relay-listen", "127.0.0.1:0",
         "--relay-san", "127.0.0.1", "--api-listen", "127.0.0.1:0",
         "--db", f"sqlite:///{home / 'store.db'}"],
        cli_env(home),
    )  # fmt: skip
    try:
        with _connections(int(info["relay_port"]), 3) as (first, second, third):
            assert _closed(third, 2.0)  # closed at accept, no TLS
            assert not _closed(first, 0.3)  # the first two wait for their handshakes
            assert not _closed(second, 0.3)
        deadline = time.monotonic() + 5
        warning = "connection limit: refused 1 connections (at most 2048, 2 per source)"
        while warning not in (home / "serve.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert warning in (home / "serve.log").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("value", ["0", "2049", "-1", "many", "1.5"])
def test_a_bad_value_on_the_command_line_is_a_usage_error(tmp_path: Path, value: str) -> None:
    done = run([BC, "serve", "--relay-max-per-source", value], env=cli_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "better-compute: usage: argument --relay-max-per-source: a whole number from 1 to 2,048"
    )
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("value", ["0", "4096", '"many"'])
def test_a_bad_value_in_the_file_is_a_usage_error_naming_it(tmp_path: Path, value: str) -> None:
    config = _config(tmp_path / "serve.toml", f"relay-max-per-source = {value}\n")
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"better-compute: usage: {config}: argument --relay-max-per-source: a whole number "
        "from 1 to 2,048"
    )


def test_a_bad_value_from_a_caller_is_invalid_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "setup_logging", lambda *_args: None)
    monkeypatch.setattr(server, "raise_file_limit", lambda: 1 << 20)
    with pytest.raises(ControlError) as refused:
        server.main(
            home=Path("/nonexistent"), db_url="sqlite://", api_listen="127.0.0.1:0",
            gateway_listen="127.0.0.1:0", gateway_san="127.0.0.1", gateway_url=None,
            ready_file=None, secret=None, relay_max_per_source=0,
        )  # fmt: skip
    assert refused.value.code == "INVALID_ARGUMENT"
    assert refused.value.message == "--relay-max-per-source must be a whole number from 1 to 2,048"

"""``serve --relay-max-per-source N`` (and its config key ``relay-max-per-source``): the
relay listener's connections from one address, 512 by default, 1 to 2,048 (the
listener's own bound); ``serve --ipv6-source-prefix N`` (``ipv6-source-prefix``): the
prefix every listener but the relay counts an IPv6 client by, 48 by default, 48 to
128, for every role; the relay listener counts each address (128) whatever it is. A
bad value is a usage error naming it. Real ``better-compute`` processes, and
``serve``'s plumbing in-process up to its listeners' limits."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from control import cli, server
from control.cli import build_parser
from control.errors import ControlError
from control.http import Limits
from tests.e2e import BIN, SECRET, cli_env, run, start_serve

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


RELAY_RANGE = "a whole number from 1 to 2,048"
PREFIX_RANGE = "a whole number from 48 to 128"
BAD_ON_THE_COMMAND_LINE = [
    *(("--relay-max-per-source", v, RELAY_RANGE) for v in ["0", "2049", "-1", "many", "1.5"]),
    *(("--ipv6-source-prefix", v, PREFIX_RANGE)
      for v in ["47", "129", "0", "256", "-48", "many", "56.0"]),
]  # fmt: skip
BAD_IN_THE_FILE = [
    *(("relay-max-per-source", v, RELAY_RANGE) for v in ["0", "4096", '"many"']),
    *(("ipv6-source-prefix", v, PREFIX_RANGE) for v in ["32", "129", '"many"']),
]
BAD_FROM_A_CALLER = [
    ("relay_max_per_source", 0, "--relay-max-per-source must be " + RELAY_RANGE),
    *(("ipv6_source_prefix", v, "--ipv6-source-prefix must be " + PREFIX_RANGE)
      for v in [47, 129, True]),
]  # fmt: skip


@pytest.mark.parametrize(("flag", "value", "expected"), BAD_ON_THE_COMMAND_LINE)
def test_a_bad_value_on_the_command_line_is_a_usage_error(
    tmp_path: Path, flag: str, value: str, expected: str
) -> None:
    done = run([BC, "serve", flag, value], env=cli_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"better-compute: usage: argument {flag}: {expected}"
    )
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("key", "value", "expected"), BAD_IN_THE_FILE)
def test_a_bad_value_in_the_file_is_a_usage_error_naming_it(
    tmp_path: Path, key: str, value: str, expected: str
) -> None:
    config = _config(tmp_path / "serve.toml", f"{key} = {value}\n")
    done = run([BC, "serve", "--config", str(config)], env=cli_env(tmp_path, secret=False))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"better-compute: usage: {config}: argument --{key}: {expected}"


@pytest.mark.parametrize(("name", "value", "expected"), BAD_FROM_A_CALLER)
def test_a_bad_value_from_a_caller_is_invalid_argument(
    monkeypatch: pytest.MonkeyPatch, name: str, value: int, expected: str
) -> None:
    monkeypatch.setattr(server, "setup_logging", lambda *_args: None)
    monkeypatch.setattr(server, "raise_file_limit", lambda: 1 << 20)
    with pytest.raises(ControlError) as refused:
        server.main(
            home=Path("/nonexistent"), db_url="sqlite://", api_listen="127.0.0.1:0",
            gateway_listen="127.0.0.1:0", gateway_san="127.0.0.1", gateway_url=None,
            ready_file=None, secret=None, **{name: value},
        )  # fmt: skip
    assert refused.value.code == "INVALID_ARGUMENT"
    assert refused.value.message == expected


# --ipv6-source-prefix N: what every listener of the serve but the relay counts an IPv6
# client by; the relay listener counts each address, as it counts IPv4


def test_the_ipv6_source_prefix_is_48_by_default_on_every_listener_but_the_relay() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.ipv6_source_prefix is None  # not given: server.main's default
    assert server.IPV6_SOURCE_PREFIX == 48
    assert {name: limits.source_prefix for name, limits in server.LIMITS.items()} == {
        "gateway": 48,
        "relay": 128,
        "api": 48,
        "metrics": 48,
    }


@pytest.mark.parametrize("per_source", [1, 64, 512, 2_048])
def test_the_relay_listener_counts_each_ipv6_address_as_a_source(per_source: int) -> None:
    """Its clients are the operator's gateways, usually in one /48 or /64: grouped by a
    prefix they would share one source's share."""
    assert server.relay_limits(per_source).source_prefix == 128


@pytest.mark.parametrize("prefix", [48, 56, 64, 65, 80, 96, 127, 128])
def test_limits_take_an_ipv6_source_prefix_from_48_to_128_only(prefix: int) -> None:
    assert Limits(source_prefix=prefix).source_prefix == prefix
    for bad in (prefix - 81, prefix + 81, float(prefix), 47, 129):
        with pytest.raises(ValueError, match="source_prefix must be from 48 to 128"):
            Limits(source_prefix=bad)  # type: ignore[arg-type]


class _Store:
    def close(self) -> None:
        pass


def _serve_limits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, role: str, argv: list[str]
) -> dict[str, Limits]:
    """The limits ``better-compute serve --role ROLE ARGV`` gives its listeners (in this
    process: its parts and its listeners stubbed, nothing is served)."""
    seen: dict[str, Limits] = {}

    def parts(**_kwargs: object) -> server._Parts:
        return server._Parts(role=role, store=_Store(), limiter=None)  # type: ignore[arg-type]

    async def run(parts: server._Parts, *_args: object) -> None:
        seen.update(parts.limits)

    monkeypatch.setattr(server, "setup_logging", lambda *_args: None)
    monkeypatch.setattr(server, "raise_file_limit", lambda: 1 << 20)
    monkeypatch.setattr(server, "_api_parts", parts)
    monkeypatch.setattr(server, "_gateway_parts", lambda *_args: parts())
    monkeypatch.setattr(server, "_run", run)
    for name in [k for k in os.environ if k.startswith("BETTER_COMPUTE_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    if role == "gateway":
        argv = [*argv, "--gateway-dir", str(tmp_path), "--db", "postgresql://gw@db.invalid/x",
                "--api-upstream", "https://api.invalid:9443"]  # fmt: skip
    else:
        monkeypatch.setenv("BETTER_COMPUTE_SECRET", SECRET)
        argv = [*argv, "--db", f"sqlite:///{tmp_path / 'store.db'}"]
    if role == "api":
        argv = [*argv, "--relay-listen", "127.0.0.1:0", "--relay-max-per-source", "64"]
    umask = os.umask(0o022)
    try:
        assert cli.main(["--home", str(tmp_path), "serve", "--role", role, *argv]) == 0
    finally:
        os.umask(umask)
    assert set(seen) == set(server.LIMITS)
    return seen


@pytest.mark.parametrize("role", ["all", "api", "gateway"])
@pytest.mark.parametrize(
    ("given", "prefix"),
    [
        ([], 48),
        (["--ipv6-source-prefix", "64"], 64),
        (["--ipv6-source-prefix", "56"], 56),
        (["--ipv6-source-prefix", "96"], 96),
        (["--ipv6-source-prefix", "128"], 128),
        (["--config", "ipv6-source-prefix = 64"], 64),
        (["--config", "ipv6-source-prefix = 128"], 128),
    ],
)
def test_every_role_counts_ipv6_clients_on_every_listener_but_the_relay_by_the_prefix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, role: str, given: list[str], prefix: int
) -> None:
    if given[:1] == ["--config"]:
        given = ["--config", str(_config(tmp_path / "serve.toml", given[1] + "\n"))]
    limits = _serve_limits(monkeypatch, tmp_path, role, given)
    # the relay listener counts each gateway's address, whatever the flag says
    assert {name: lim.source_prefix for name, lim in limits.items()} == {
        **dict.fromkeys(server.LIMITS, prefix),
        "relay": 128,
    }
    # nothing else of a listener's limits changes; the relay keeps its own bound
    relay = server.relay_limits(64 if role == "api" else server.RELAY_MAX_PER_SOURCE)
    assert limits["relay"] == relay
    for name, lim in limits.items():
        if name != "relay":
            assert lim == dataclasses.replace(server.LIMITS[name], source_prefix=prefix), name

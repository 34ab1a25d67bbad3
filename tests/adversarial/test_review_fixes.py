"""What the review of the hardening found, each pinned by a test (pure or in process)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcd.attestor_api import hookimpl
from bcd.config import load_config
from bcd.errors import ConfigError
from bcd.plugins import load_plugins
from control.errors import ControlError
from control.http import Request, source_key, source_of
from control.proofs import spend_proof
from control.relay import RelayClient
from control.store import Store


@pytest.mark.parametrize(
    ("remote", "key"),
    [
        ("192.0.2.7:5000", "192.0.2.7"),
        ("[::ffff:192.0.2.7]:5000", "192.0.2.7"),
        ("[2001:db8:1:2:aaaa::1]:443", "2001:db8:1:2::/64"),
        ("[2001:db8:1:2:bbbb::9]:443", "2001:db8:1:2::/64"),
    ],
)
def test_one_ipv6_host_is_one_source(remote: str, key: str) -> None:
    assert source_key(remote) == key
    assert source_of(remote.rpartition(":")[0].strip("[]")) == key


def test_a_proof_is_refused_again_at_exactly_120_s(store: Store) -> None:
    with store.tx() as tx:
        assert spend_proof(tx, "p" * 64, "node_x", 1_000_000)
    with store.tx() as tx:
        assert not spend_proof(tx, "p" * 64, "node_x", 1_120_000)  # still spent
    with store.tx() as tx:
        assert spend_proof(tx, "p" * 64, "node_x", 1_120_001)


def test_a_config_others_can_change_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('gateway_url = "https://gw.example"\n')
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="can be changed by other users"):
        load_config(path)


class EmptyName:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return [""]  # "" is join-token on the wire


def test_a_plugin_claiming_the_empty_name_collides_with_join_token() -> None:
    plugins = load_plugins(extra=[EmptyName()])
    assert "join-token" not in plugins.names()
    assert "" not in plugins.names()
    assert any("join-token" in f.error for f in plugins.failures)


def _request() -> Request:
    return Request("POST", "/v1/join", {}, {}, b"{}", None, "192.0.2.1:1")


async def test_a_call_already_sent_is_not_sent_to_another_replica() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        if request.url.host == "a.example":
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, stream=httpx.ByteStream(b"signed"))

    client = RelayClient(
        ["https://a.example", "https://b.example"],
        ssl.create_default_context(),
        transport=httpx.MockTransport(handler),
    )
    with pytest.raises(ControlError) as unavailable:
        await client.forward(_request())
    assert unavailable.value.code == "UNAVAILABLE"
    assert calls == ["a.example"]  # b never saw it: a may still be judging it
    answer = await client.forward(_request())  # the retry goes to the next one
    assert (answer.status, answer.body, calls[-1]) == (200, b"signed", "b.example")
    await client.aclose()


async def test_a_call_that_never_reached_a_replica_moves_to_the_next() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> Any:
        calls.append(request.url.host)
        if request.url.host == "a.example":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, stream=httpx.ByteStream(b"signed"))

    client = RelayClient(
        ["https://a.example", "https://b.example"],
        ssl.create_default_context(),
        transport=httpx.MockTransport(handler),
    )
    answer = await client.forward(_request())
    assert (answer.status, calls) == (200, ["a.example", "b.example"])
    await client.aclose()

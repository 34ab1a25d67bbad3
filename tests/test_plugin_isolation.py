"""A plugin that fails to load, or whose server half raises, is reported by name and
never takes the host down (issue 5, "Third-party attestors"); in process.

The broken plugin is a distribution made for the test: a ``.dist-info`` directory
(METADATA and an ``entry_points.txt`` in the ``bcd.attestors`` group) on ``sys.path``,
pointing at a module that raises when imported, so ``importlib.metadata`` finds it
exactly as it finds an installed one.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from bcd import pki as bpki
from bcd import wire
from bcd.attestor_api import hookimpl
from bcd.doctor import plugins_check
from bcd.plugins import load_plugins
from control import events, tenancy, tokens
from control.errors import Refused
from control.joinservice import JoinService
from control.pki import Pki
from control.server import join_crypto
from control.store import Store
from tests.world.joins import join_body, machine

BROKEN = "broken-at-import"
BUILT_IN = ("join-token", "tpm", "serial-allowlist")
SECRET_TEXT = "s3cr3t-detail-from-the-plugin"


@pytest.fixture
def broken_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    site = tmp_path / "site-packages"
    dist_info = site / "bcd_broken_attestor-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: bcd-broken-attestor\nVersion: 0.1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[bcd.attestors]\n{BROKEN} = bcd_broken_attestor\n"
    )
    (site / "bcd_broken_attestor.py").write_text(
        f'raise RuntimeError("{SECRET_TEXT}: this plugin cannot be imported")\n'
    )
    monkeypatch.syspath_prepend(str(site))
    return BROKEN


def test_a_plugin_that_raises_at_import_is_reported_by_name(
    broken_distribution: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="bcd.plugins"):
        plugins = load_plugins()

    assert [f.name for f in plugins.failures] == [broken_distribution]
    assert plugins.failures[0].error.startswith("RuntimeError: ")
    for name in BUILT_IN:  # the others still load and answer
        assert name in plugins.names()
    assert broken_distribution not in plugins.names()
    assert any(broken_distribution in r.getMessage() for r in caplog.records)
    # bcd doctor lists it (warn, exit code unchanged by a warning)
    check = plugins_check(plugins)
    assert check.name == "plugins"
    assert check.status == "warn"
    assert f"{broken_distribution} did not load (RuntimeError: " in check.message


def test_a_plugin_implementing_an_unknown_hook_is_reported() -> None:
    class Typo:
        @hookimpl
        def bcd_attestor_names(self) -> list[str]:
            return ["typo"]

        @hookimpl
        def bcd_server_verfy(self, attestor: str) -> None:  # sic: not a hook bcd defines
            return None

    plugins = load_plugins(extra=[Typo()])

    assert [f.error for f in plugins.failures] == ["implements an unknown hook"]
    assert plugins_check(plugins).status == "warn"
    assert "join-token" in plugins.names()


class Exploding:
    """A third-party server half that raises inside the join transaction."""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["exploding"]

    @hookimpl
    def bcd_server_verify(self, attestor: str, request: wire.JoinRequest) -> None:
        if attestor != "exploding":
            return None
        raise RuntimeError(SECRET_TEXT)


def _refusals(store: Store, tenant: str) -> list[dict[str, Any]]:
    with store.tx() as tx:
        return events.list_events(tx, tenant, "security.join.refused", limit=1000)


def test_a_server_half_that_raises_is_a_uniform_refusal(
    store: Store, memory_pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        tenant, _ = tenancy.create_tenant(tx, "acme")
        site = tenancy.create_site(tx, tenant, "rack-b7")["id"]
        pool = tenancy.create_pool(tx, tenant, site, "gpu", "bcd", {})["id"]
    plugins = load_plugins(extra=[Exploding()])
    assert plugins.failures == []
    svc = JoinService(store, join_crypto(memory_pki), plugins)
    request = wire.JoinRequest(
        role="node",
        attestor="exploding",
        sealed_token=None,
        csr_der=bpki.make_csr(bpki.generate_key()),
        claims=machine(1),
        evidence={},
        node_id=None,
        daemon_version="0.1.0-test",
    )

    with caplog.at_level(logging.ERROR), pytest.raises(Refused) as info:
        svc.join(wire.dumps(request.to_json()))

    refusal = info.value
    assert (refusal.code, refusal.message, str(refusal)) == (
        "ACCESS_DENIED",
        "Join refused",
        "Join refused",
    )
    assert refusal.reason == "exploding:plugin-error"
    assert SECRET_TEXT not in repr(refusal.__dict__)
    assert refusal.__cause__ is None
    assert refusal.__suppress_context__
    # logged with its traceback on the server ...
    logged = [r for r in caplog.records if "exploding" in r.getMessage()]
    assert logged
    assert logged[0].exc_info is not None
    assert SECRET_TEXT in caplog.text
    # ... recorded with the uniform reason, its text in no event
    refused = _refusals(store, root)
    assert [e["payload"]["reason"] for e in refused] == ["exploding:plugin-error"]
    assert SECRET_TEXT not in repr(refused)

    # the control plane still serves joins with the other attestors
    with store.tx() as tx:
        token = str(tokens.create(tx, tenant, pool, ttl_s=3600)["token"])
    enc = memory_pki.join_encryption_key.public_key()
    signed = svc.join(join_body(token, enc, machine(2)).body)
    body = wire.verify_response(signed, memory_pki.pins()["join_signing_key_pin"])
    assert body["node_id"].startswith("node_")


class Babbling:
    """A third-party server half that returns something that is not a verdict."""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["babbling"]

    @hookimpl
    def bcd_server_verify(self, attestor: str) -> object:
        return {"admit": True} if attestor == "babbling" else None


def test_a_server_half_returning_no_verdict_is_a_uniform_refusal(
    store: Store, memory_pki: Pki
) -> None:
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
    svc = JoinService(store, join_crypto(memory_pki), load_plugins(extra=[Babbling()]))
    request = wire.JoinRequest(
        role="node",
        attestor="babbling",
        sealed_token=None,
        csr_der=bpki.make_csr(bpki.generate_key()),
        claims=machine(3),
        evidence={},
        node_id=None,
        daemon_version="0.1.0-test",
    )
    with pytest.raises(Refused) as info:
        svc.join(wire.dumps(request.to_json()))
    assert (info.value.code, info.value.message) == ("ACCESS_DENIED", "Join refused")
    assert info.value.reason == "babbling:plugin-error"
    with store.tx() as tx:
        assert tx.one("SELECT COUNT(*) AS n FROM nodes") in ({"n": 0}, {"count": 0})
    assert [e["payload"]["reason"] for e in _refusals(store, root)] == ["babbling:plugin-error"]


def _distribution(site: Path, dist: str, module: str, entry_point: str) -> None:
    dist_info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[bcd.attestors]\n{entry_point} = {module}\n")
    (site / f"{module}.py").write_text(
        "from bcd.attestor_api import hookimpl\n"
        f"WHO = {dist!r}\n"
        "@hookimpl\n"
        f"def bcd_attestor_names():\n    return [{entry_point!r}]\n"
    )


def test_an_entry_point_two_distributions_register_is_a_failure_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first by distribution name is loaded, whatever the order on sys.path; the
    other is reported, by doctor too."""
    _distribution(tmp_path / "first", "acme-dup-b", "acme_dup_b", "dup-attestor")
    _distribution(tmp_path / "second", "acme-dup-a", "acme_dup_a", "dup-attestor")
    monkeypatch.syspath_prepend(str(tmp_path / "second"))
    monkeypatch.syspath_prepend(str(tmp_path / "first"))  # b comes first on sys.path
    for module in ("acme_dup_a", "acme_dup_b"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with caplog.at_level(logging.WARNING, logger="bcd.plugins"):
        plugins = load_plugins()

    assert "dup-attestor" in plugins.names()
    assert getattr(plugins.owners["dup-attestor"], "WHO", None) == "acme-dup-a"
    assert "acme_dup_b" not in sys.modules  # the other is never imported
    (failure,) = plugins.failures
    assert failure.name == "dup-attestor of acme-dup-b"
    assert failure.error == (
        "acme-dup-a and acme-dup-b both register dup-attestor; the one of acme-dup-a "
        "(the first by distribution name) is loaded"
    )
    assert any("acme-dup-b" in r.getMessage() for r in caplog.records)
    check = plugins_check(plugins)
    assert check.status == "warn"
    assert "acme-dup-a and acme-dup-b both register dup-attestor" in check.message
    for name in BUILT_IN:
        assert name in plugins.names()

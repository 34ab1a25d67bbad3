"""bcd.testing.conformance against bcd's attestors, the example third-party one,
and plugins that break the contract in each way it checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import bcd_example_attestor
import pytest

from attestors import join_token, tpm
from bcd import wire
from bcd.attestor_api import NodeEvidence, PoolRecord, Refuse, hookimpl
from bcd.testing.conformance import (
    ConformanceContext,
    assert_conforms,
    check_attestor,
    minimal_node_context,
)
from control.ids import new_id, new_secret
from control.pki import Pki


def test_join_token_conforms(memory_pki: Pki) -> None:
    ctx = minimal_node_context(
        credential=f"bcjt_{new_id('jt')}.{new_secret()}",
        encryption_key=memory_pki.join_encryption_key.public_key(),
    )
    assert_conforms(join_token, "join-token", node_ctx=ctx)


def test_join_token_without_a_credential_is_reported() -> None:
    problems = check_attestor(join_token, "join-token")
    assert len(problems) == 1
    assert problems[0].startswith("bcd_node_evidence raised CredentialError for 'join-token'")


def test_tpm_server_half_conforms(tmp_path: Path) -> None:
    # the node half needs a TPM (tests/test_e2e_tpm.py): server half only
    assert_conforms(tpm, "tpm", node=False)
    allow = tmp_path / "ek-allow"
    allow.write_text("")
    assert_conforms(
        tpm, "tpm", node=False, settings={"tpm.pool": "pool_x", "tpm.ek_allow": str(allow)}
    )


def test_the_example_attestor_conforms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dmi = tmp_path / "sys/class/dmi/id"
    dmi.mkdir(parents=True)
    (dmi / "product_serial").write_text("SN-1\n")
    monkeypatch.setenv("SERIAL_ALLOWLIST_SYSFS_ROOT", str(tmp_path))
    name = "serial-allowlist"
    assert_conforms(bcd_example_attestor, name)  # not configured: Refuse, still conforming
    pool = PoolRecord("pool_1", "tenant_1", "site_1", "bcd")
    settings = {f"{name}.pool": "pool_1", f"{name}.serials": "SN-0,SN-1"}
    assert_conforms(
        bcd_example_attestor,
        name,
        settings=settings,
        pools={"pool_1": pool},
        claims=wire.Claims(product_serial="SN-1"),
    )


def test_the_conformance_context_is_a_server_context() -> None:
    ctx = ConformanceContext(attestor="x")
    challenge_id = ctx.save_challenge(
        secret_sha256="a", ak_name="b", ek_sha256="c", csr_sha256="d", not_after_ms=1
    )
    record = ctx.lock_challenge(challenge_id)
    assert record is not None
    assert (record.attestor, record.used) == ("x", False)
    ctx.consume_challenge(challenge_id)
    assert ctx.consumed == [("challenge", challenge_id)]
    assert ctx.lookup_pool("pool_1") is None
    assert ctx.lock_join_token("jt_1") is None


# --- plugins that break the contract -------------------------------------------------


class Greedy:
    """Answers for every name, and names another attestor."""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["someone-else"]

    @hookimpl
    def bcd_node_evidence(self, attestor: str) -> NodeEvidence:
        return NodeEvidence(sealed_token=None, evidence={})

    @hookimpl
    def bcd_server_verify(self, attestor: str) -> Refuse:
        return Refuse("greedy:nope")


def test_a_greedy_plugin_is_reported() -> None:
    problems = check_attestor(Greedy(), "greedy")
    assert "bcd_attestor_names does not list 'greedy': ['someone-else']" in problems
    assert "bcd_node_evidence returned NodeEvidence for a name it does not own" in problems
    assert "bcd_server_verify returned Refuse for a name it does not own" in problems
    assert any("is not a bare word" in p for p in problems)
    with pytest.raises(AssertionError, match="breaks the plugin contract"):
        assert_conforms(Greedy(), "greedy")


class Raising:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["raising"]

    @hookimpl
    def bcd_node_evidence(self, attestor: str) -> NodeEvidence | None:
        raise KeyError(attestor)

    @hookimpl
    def bcd_server_verify(self, attestor: str, request: wire.JoinRequest) -> Any:
        if attestor != "raising":
            return None
        return {"admit": True}  # not a verdict


def test_a_raising_plugin_is_reported() -> None:
    problems = check_attestor(Raising(), "raising")
    assert "bcd_node_evidence raised KeyError for a name it does not own" in problems
    assert any(p.startswith("bcd_node_evidence raised KeyError for 'raising'") for p in problems)
    assert any(p.startswith("bcd_server_verify returned dict, not a verdict") for p in problems)


class ExtraArgument:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["extra"]

    @hookimpl
    def bcd_server_verify(self, attestor: str, request: wire.JoinRequest, store: Any) -> None:
        return None


class UnknownHook:
    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["unknown"]

    @hookimpl
    def bcd_server_verfy(self, attestor: str) -> None:
        return None


def test_signatures_beyond_the_hookspecs_are_reported() -> None:
    (problem,) = check_attestor(ExtraArgument(), "extra")
    assert problem.startswith("does not register: ")
    assert "store" in problem
    problems = check_attestor(UnknownHook(), "unknown", node=False)
    assert problems[0].startswith("implements a hook bcd does not define: ")
    assert "does not implement bcd_server_verify (server=False for no server half)" in problems


class BadChecks:
    """Settings checks that answer for every name, with something not a list of lines,
    or with problems for the settings they were given."""

    @hookimpl
    def bcd_attestor_names(self) -> list[str]:
        return ["bad-checks"]

    @hookimpl
    def bcd_node_evidence(self, attestor: str) -> NodeEvidence | None:
        return NodeEvidence(sealed_token=None, evidence={}) if attestor == "bad-checks" else None

    @hookimpl
    def bcd_server_verify(self, attestor: str) -> Refuse | None:
        return Refuse("nope") if attestor == "bad-checks" else None

    @hookimpl
    def bcd_server_check_settings(self, attestor: str) -> Any:
        return "fine"  # for every name, and not a list

    @hookimpl
    def bcd_node_check_settings(self, attestor: str, table: dict[str, Any]) -> list[str] | None:
        if attestor != "bad-checks":
            return None
        return [f"unknown key {key!r}" for key in table]


def test_settings_checks_are_checked() -> None:
    ctx = minimal_node_context(settings={"colour": "blue"})
    problems = check_attestor(BadChecks(), "bad-checks", node_ctx=ctx)
    assert problems == [
        "bcd_server_check_settings returned str for a name it does not own",
        "bcd_server_check_settings returned 'fine', not a list of str",
        "bcd_node_check_settings finds problems with the settings it was given: "
        "[\"unknown key 'colour'\"]",
    ]
    assert check_attestor(BadChecks(), "bad-checks", node=False, server=False) == [
        "bcd_server_check_settings returned str for a name it does not own"
    ]

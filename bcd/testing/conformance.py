"""A conformance check attestor plugin authors run against their plugin.

``check_attestor(plugin, name)`` registers ``plugin`` (a module or an object with
``@hookimpl`` functions) in a plugin manager of its own, with bcd's hookspecs, and
returns the problems it finds (an empty list when it conforms):

- it registers: every implementation's arguments are a subset of its hookspec's
  arguments, and it implements no hook bcd does not define;
- ``bcd_attestor_names()`` lists ``name`` (and only strings);
- no hook raises, and every attestor hook returns ``None``, for a name it does not
  own;
- the node half (unless ``node=False``) returns a :class:`~bcd.attestor_api.NodeEvidence`
  for ``name`` whose evidence is a JSON object;
- the settings checks (``bcd_server_check_settings``, ``bcd_node_check_settings``),
  when implemented, return ``None`` for a name they do not own and a list of strings
  for ``name``, empty for the settings given (``settings``, ``node_ctx.settings``);
- the server half (unless ``server=False``) returns a verdict (``Admit``, ``Refuse``
  or ``Challenge``) for ``name`` with a minimal context, without raising, and the
  verdict is well formed (a refusal reason without the attestor prefix, ``urn:bc:``
  statements, a challenge round of 1 to 3).

``assert_conforms(...)`` does the same and fails with every problem listed, for a
test. Pass ``node_ctx`` when the node half needs a credential or a TPM, ``settings``
and ``pools`` (or a whole ``server_ctx``) when the server half needs configuration,
``claims`` for the request the server half judges (built from the node half's
evidence). It checks the contract's shape, not what the attestor verifies.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from bcd import pki, wire
from bcd.attestor_api import (
    PROJECT,
    Admit,
    AttestorSpec,
    Challenge,
    ChallengeRecord,
    NodeCertRecord,
    NodeEvidence,
    NodeJoinContext,
    NodeRecord,
    PoolRecord,
    Refuse,
    ServerJoinContext,
    TokenRecord,
    Verdict,
    VouchRecord,
)

ATTESTOR_HOOKS = ("bcd_node_evidence", "bcd_node_answer", "bcd_server_verify")
SETTINGS_HOOKS = ("bcd_server_check_settings", "bcd_node_check_settings")
MAX_ROUNDS = 3
_NOT_FOUND = object()


@dataclass
class ConformanceContext:
    """A minimal :class:`~bcd.attestor_api.ServerJoinContext` held in memory.

    ``tokens``, ``pools``, ``challenges``, ``nodes`` (by hardware key) and ``vouches``
    (by site and MAC) are what the lookups find; ``consumed`` records what the server
    half consumed (``("token", id)``, ``("challenge", id)`` or ``("vouch", id)``).
    """

    now_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    seal: wire.OpenedSeal | None = None
    settings: Mapping[str, str] = field(default_factory=dict)
    peer_ip: str | None = None
    tokens: dict[str, TokenRecord] = field(default_factory=dict)
    pools: dict[str, PoolRecord] = field(default_factory=dict)
    challenges: dict[str, ChallengeRecord] = field(default_factory=dict)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    vouches: dict[tuple[str, str], VouchRecord] = field(default_factory=dict)
    consumed: list[tuple[str, str]] = field(default_factory=list)
    attestor: str = ""
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def lock_join_token(self, token_id: str) -> TokenRecord | None:
        return self.tokens.get(token_id)

    def consume_join_token(self, token_id: str) -> None:
        self.consumed.append(("token", token_id))

    def lookup_pool(self, pool_id: str) -> PoolRecord | None:
        return self.pools.get(pool_id)

    def save_challenge(
        self,
        *,
        secret_sha256: str,
        ak_name: str,
        ek_sha256: str,
        csr_sha256: str,
        not_after_ms: int,
    ) -> str:
        challenge_id = f"jc_conformance{next(self._ids)}"
        self.challenges[challenge_id] = ChallengeRecord(
            challenge_id,
            self.attestor,
            secret_sha256,
            ak_name,
            ek_sha256,
            csr_sha256,
            not_after_ms,
            used=False,
        )
        return challenge_id

    def lock_challenge(self, challenge_id: str) -> ChallengeRecord | None:
        return self.challenges.get(challenge_id)

    def consume_challenge(self, challenge_id: str) -> None:
        self.consumed.append(("challenge", challenge_id))

    def lookup_node_cert(self, der: bytes) -> NodeCertRecord | None:
        return None

    def lookup_join_request(self, machine_key: str) -> None:
        """No join request is ever found here."""
        return None

    def lookup_node_by_hardware_key(
        self, hardware_key: str, tenant_id: str | None = None
    ) -> NodeRecord | None:
        node = self.nodes.get(hardware_key)
        return node if node is not None and tenant_id in (None, node.tenant_id) else None

    def lookup_vouch(self, site_id: str, mac: str) -> VouchRecord | None:
        return self.vouches.get((site_id, mac))

    def consume_vouch(self, vouch_id: str) -> None:
        self.consumed.append(("vouch", vouch_id))


def minimal_node_context(**overrides: Any) -> NodeJoinContext:
    """A node context with a fresh CSR, no credential and no encryption key."""
    fields: dict[str, Any] = {
        "credential": None,
        "csr_der": pki.make_csr(pki.generate_key()),
        "encryption_key": None,
        "now_s": int(time.time()),
        "role": "node",
    }
    fields.update(overrides)
    return NodeJoinContext(**fields)


def _impls(pm: pluggy.PluginManager, hook: str) -> list[pluggy.HookImpl]:
    caller = getattr(pm.hook, hook, None)
    return list(caller.get_hookimpls()) if caller is not None else []


def _call(impl: pluggy.HookImpl, **kwargs: Any) -> Any:
    """Call an implementation as pluggy does: with only the arguments it declares."""
    function: Callable[..., Any] = impl.function
    return function(**{a: kwargs[a] for a in impl.argnames})


def _spec_problems(pm: pluggy.PluginManager) -> list[str]:
    problems = []
    for hook in ("bcd_attestor_names", *ATTESTOR_HOOKS, *SETTINGS_HOOKS):
        spec_args = set(getattr(pm.hook, hook).spec.argnames)
        for impl in _impls(pm, hook):
            extra = [a for a in (*impl.argnames, *impl.kwargnames) if a not in spec_args]
            if extra:
                problems.append(f"{hook} declares arguments the hookspec lacks: {extra}")
    return problems


def check_attestor(
    plugin: object,
    name: str,
    *,
    node: bool = True,
    server: bool = True,
    node_ctx: NodeJoinContext | None = None,
    server_ctx: ServerJoinContext | None = None,
    settings: Mapping[str, str] | None = None,
    pools: Mapping[str, PoolRecord] | None = None,
    claims: wire.Claims | None = None,
) -> list[str]:
    """The ways ``plugin`` breaks the attestor contract for ``name`` (empty: none)."""
    problems: list[str] = []
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(AttestorSpec)
    try:
        pm.register(plugin, name=f"conformance:{name}")
    except (pluggy.PluginValidationError, ValueError) as exc:
        return [f"does not register: {exc}"]
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        problems.append(f"implements a hook bcd does not define: {exc}")
    problems += _spec_problems(pm)

    names_impls = _impls(pm, "bcd_attestor_names")
    if not names_impls:
        problems.append("does not implement bcd_attestor_names")
    for impl in names_impls:
        try:
            names = _call(impl)
        except Exception as exc:
            problems.append(f"bcd_attestor_names raised {type(exc).__name__}")
            continue
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            problems.append(f"bcd_attestor_names returned {names!r}, not a list of str")
        elif name not in names:
            problems.append(f"bcd_attestor_names does not list {name!r}: {names!r}")

    foreign = f"{name}-conformance-foreign"
    nctx = node_ctx or minimal_node_context()
    sctx: ServerJoinContext = server_ctx or ConformanceContext(
        settings=dict(settings or {}), pools=dict(pools or {}), attestor=name
    )

    # node half
    evidence: dict[str, Any] = {}
    sealed: str | None = None
    node_impls = _impls(pm, "bcd_node_evidence")
    if node and not node_impls:
        problems.append("does not implement bcd_node_evidence (node=False for no node half)")
    for impl in node_impls:
        _expect_none(problems, impl, "bcd_node_evidence", attestor=foreign, ctx=nctx)
        if not node:
            continue
        try:
            result = _call(impl, attestor=name, ctx=nctx)
        except Exception as exc:
            problems.append(
                f"bcd_node_evidence raised {type(exc).__name__} for {name!r} "
                f"({exc}); pass a node_ctx it can use"
            )
            continue
        if not isinstance(result, NodeEvidence):
            problems.append(f"bcd_node_evidence returned {type(result).__name__}, not NodeEvidence")
            continue
        if not isinstance(result.evidence, dict):
            problems.append("bcd_node_evidence: evidence is not a JSON object (dict)")
            continue
        try:
            wire.dumps(result.evidence)
        except (TypeError, ValueError):
            problems.append("bcd_node_evidence: evidence is not JSON-serialisable")
            continue
        if result.sealed_token is not None and not isinstance(result.sealed_token, str):
            problems.append("bcd_node_evidence: sealed_token is neither a string nor None")
            continue
        evidence = json.loads(wire.dumps(result.evidence))
        sealed = result.sealed_token
    for impl in _impls(pm, "bcd_node_answer"):
        _expect_none(problems, impl, "bcd_node_answer", attestor=foreign, challenge={}, ctx=nctx)

    # server half
    request = wire.JoinRequest(
        role=nctx.role,
        attestor=name,
        sealed_token=sealed,
        csr_der=nctx.csr_der,
        claims=claims or wire.Claims(),
        evidence=evidence,
        node_id=None,
        daemon_version="conformance",
    )
    server_impls = _impls(pm, "bcd_server_verify")
    if server and not server_impls:
        problems.append("does not implement bcd_server_verify (server=False for no server half)")
    for impl in server_impls:
        _expect_none(
            problems, impl, "bcd_server_verify", attestor=foreign, request=request, ctx=sctx
        )
        if not server:
            continue
        try:
            verdict = _call(impl, attestor=name, request=request, ctx=sctx)
        except Exception as exc:
            problems.append(
                f"bcd_server_verify raised {type(exc).__name__} for {name!r}: JoinService "
                "would refuse with plugin-error; return Refuse(reason) instead"
            )
            continue
        problems += _verdict_problems(verdict, request)
    problems += _settings_problems(pm, name, foreign, node, server, nctx, sctx)
    return problems


def _settings_problems(
    pm: pluggy.PluginManager,
    name: str,
    foreign: str,
    node: bool,
    server: bool,
    nctx: NodeJoinContext,
    sctx: ServerJoinContext,
) -> list[str]:
    """The two settings checks: None for a foreign name; for ``name``, a list of lines,
    empty for the settings the check was given (``settings``, ``node_ctx.settings``)."""
    problems: list[str] = []
    halves = (
        ("bcd_server_check_settings", server, {"settings": dict(sctx.settings)}),
        ("bcd_node_check_settings", node, {"table": dict(nctx.settings)}),
    )
    for hook, wanted, given in halves:
        for impl in _impls(pm, hook):
            _expect_none(problems, impl, hook, attestor=foreign, **given)
            if not wanted:
                continue
            try:
                found = _call(impl, attestor=name, **given)
            except Exception as exc:
                problems.append(f"{hook} raised {type(exc).__name__} for {name!r}")
                continue
            if not isinstance(found, list) or not all(isinstance(p, str) for p in found):
                problems.append(f"{hook} returned {found!r}, not a list of str")
            elif found:
                problems.append(f"{hook} finds problems with the settings it was given: {found}")
    return problems


def _expect_none(problems: list[str], impl: pluggy.HookImpl, hook: str, **kwargs: Any) -> Any:
    try:
        result = _call(impl, **kwargs)
    except Exception as exc:
        problems.append(f"{hook} raised {type(exc).__name__} for a name it does not own")
        return _NOT_FOUND
    if result is not None:
        problems.append(f"{hook} returned {type(result).__name__} for a name it does not own")
    return result


def _verdict_problems(verdict: object, request: wire.JoinRequest) -> list[str]:
    hook = "bcd_server_verify"
    if isinstance(verdict, Refuse):
        reason = verdict.reason
        if not isinstance(reason, str) or not reason or any(c in reason for c in ": \n"):
            return [f"{hook}: refusal reason {reason!r} is not a bare word (no prefix)"]
        return []
    if isinstance(verdict, Challenge):
        ok = (
            isinstance(verdict.round, int)
            and request.round < verdict.round <= MAX_ROUNDS
            and isinstance(verdict.challenge, dict)
            and isinstance(verdict.not_after_ms, int)
        )
        return [] if ok else [f"{hook}: a malformed Challenge {verdict!r}"]
    if isinstance(verdict, Admit):
        out = []
        if verdict.role != request.role:
            out.append(f"{hook}: admits role {verdict.role!r}, the request asked {request.role!r}")
        statements = verdict.statements
        if len(set(statements)) != len(statements) or not all(
            isinstance(s, str) and s.startswith("urn:bc:") for s in statements
        ):
            out.append(f"{hook}: statements must be distinct urn:bc: URIs: {statements!r}")
        return out
    if isinstance(verdict, Verdict):  # a verdict kind this check does not inspect further
        return []
    return [f"{hook} returned {type(verdict).__name__}, not a verdict ({Verdict})"]


def assert_conforms(plugin: object, name: str, **kwargs: Any) -> None:
    """Fail (AssertionError) listing every problem :func:`check_attestor` finds."""
    problems = check_attestor(plugin, name, **kwargs)
    if problems:
        raise AssertionError(
            f"attestor {name!r} breaks the plugin contract:\n- " + "\n- ".join(problems)
        )

"""The plugin manager: loads the attestor plugins and calls them, by owner.

The contract (hookspecs, records, verdicts, the ``hookimpl`` marker) is the public
face :mod:`bcd.attestor_api`; this module is bcd's and the control plane's side of it.

Plugins are the entry points of the group ``bcd.attestors``. A plugin that fails to
import or register is reported by name in :attr:`Plugins.failures` (and by ``bcd
doctor``); it never takes the agent or the control plane down. Each attestor name is
answered by the one plugin that claims it. An entry point name two distributions
register loads from the first by distribution name; the other is such a failure.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from bcd import attestor_api, wire
from bcd.attestor_api import (
    ENTRY_POINT_GROUP,
    PROJECT,
    AttestorSpec,
    NodeEvidence,
    NodeJoinContext,
    ServerJoinContext,
    Verdict,
    canonical_name,
)

log = logging.getLogger("bcd.plugins")


@dataclass(frozen=True, slots=True)
class PluginFailure:
    name: str
    error: str


@dataclass
class Plugins:
    """The loaded attestors. Each name is answered by the one plugin that claims it
    (``owners``): a hook is called on that plugin only, so a plugin registered later
    cannot answer for another's attestor, and a name two plugins claim is refused at
    load (both claims; reported in ``failures``), never silently given to either."""

    pm: pluggy.PluginManager
    failures: list[PluginFailure]
    owners: dict[str, object] = field(default_factory=dict)

    def names(self) -> list[str]:
        return list(self.owners)

    def _impl(self, hook: str, owned: str) -> pluggy.HookImpl | None:
        """The implementation of ``hook`` by the plugin that owns ``owned`` (or None)."""
        owner = self.owners.get(canonical_name(owned))
        if owner is None:
            return None
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin is owner:
                found: pluggy.HookImpl = impl
                return found
        return None

    def _call(self, hook: str, owned: str, /, **kwargs: Any) -> Any:
        impl = self._impl(hook, owned)
        if impl is None:
            return None
        return impl.function(*[kwargs[name] for name in impl.argnames])

    def node_evidence(self, attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
        result: NodeEvidence | None = self._call(
            "bcd_node_evidence", attestor, attestor=attestor, ctx=ctx
        )
        return result

    def node_answer(
        self, attestor: str, challenge: dict[str, Any], ctx: NodeJoinContext
    ) -> dict[str, Any] | None:
        result: dict[str, Any] | None = self._call(
            "bcd_node_answer", attestor, attestor=attestor, challenge=challenge, ctx=ctx
        )
        return result

    def server_verify(
        self, attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
    ) -> Verdict | None:
        result: Verdict | None = self._call(
            "bcd_server_verify", attestor, attestor=attestor, request=request, ctx=ctx
        )
        return result

    def server_settings_problems(self, settings: Mapping[str, str]) -> list[str]:
        """Every problem with the control plane's attestor settings (``better-compute
        serve`` stops at the first): a setting ``<attestor>.<key>`` no loaded attestor
        owns (its plugin did not load, or a typo), then each loaded attestor's own. A
        check that raises (or answers other than a list of strings) is a problem too,
        named by the exception's class only: serve does not start with settings nobody
        checked."""
        problems: list[str] = []
        for key in sorted(settings):
            if not any(key.startswith(f"{name}.") for name in self.owners):
                prefix = key.split(".", 1)[0]
                why = "".join(
                    f"; the plugin {f.name} did not load" for f in self.failures if f.name == prefix
                )
                problems.append(f"attestor setting {key}: no loaded attestor owns it{why}")
        for name in self.owners:
            try:
                found = self._call(
                    "bcd_server_check_settings", name, attestor=name, settings=dict(settings)
                )
                problems += _problem_lines(found)
            except Exception as exc:  # a broken plugin is named, never a traceback
                log.debug("attestor plugin %s failed to check its settings", name, exc_info=True)
                problems.append(
                    f"the {name} attestor plugin failed to check its settings "
                    f"({type(exc).__name__})"
                )
        return problems

    def node_settings_problem(self, tables: Mapping[str, Any]) -> str | None:
        """The first problem with config.toml's ``[attestors]`` table, None when every
        ``[attestors.<name>]`` names a loaded attestor whose plugin accepts it."""
        for name, table in tables.items():
            shown = json.dumps(name[:64], ensure_ascii=True)[1:-1]
            if not isinstance(table, dict):
                return f'"attestors.{shown}" must be a table ([attestors.{shown}])'
            if name not in self.owners:
                why = "".join(
                    f"; the plugin {f.name} did not load ({f.error})"
                    for f in self.failures
                    if f.name == name
                )
                return (
                    f'unknown attestor "attestors.{shown}": no attestor plugin has that name{why}'
                )
            if self._impl("bcd_node_check_settings", name) is None:
                if table:
                    return f"[attestors.{name}]: the {name} attestor takes no settings"
                continue
            try:
                found = self._call(
                    "bcd_node_check_settings", name, attestor=name, table=dict(table)
                )
                problems = _problem_lines(found)
            except Exception as exc:  # a broken plugin is named, never a traceback
                log.debug("attestor plugin %s failed to check its settings", name, exc_info=True)
                return (
                    f"[attestors.{name}]: the {name} attestor plugin failed to check its "
                    f"settings ({type(exc).__name__})"
                )
            if problems:
                return f"[attestors.{name}]: {problems[0]}"
        return None


def _problem_lines(found: object) -> list[str]:
    """A check hook's answer as lines: None (not the plugin's) is none; anything but a
    list of strings is a plugin bug (TypeError, handled as an exception of the hook)."""
    if found is None:
        return []
    if not isinstance(found, list) or not all(isinstance(p, str) for p in found):
        raise TypeError("a settings check must return a list of strings")
    return [(p.strip().splitlines() or ["(no message)"])[0] for p in found]


def node_settings_problem(tables: Mapping[str, Any]) -> str | None:
    """:meth:`Plugins.node_settings_problem` with the installed plugins: bcd.config
    calls it (and so loads the plugins) only for a config.toml with ``[attestors]``."""
    return load_plugins().node_settings_problem(tables)


def _owners(pm: pluggy.PluginManager, failures: list[PluginFailure]) -> dict[str, object]:
    claims: dict[str, list[tuple[str, object]]] = {}
    for impl in pm.hook.bcd_attestor_names.get_hookimpls():
        try:
            names = impl.function()
        except Exception as exc:  # a broken plugin never takes the host down
            failures.append(PluginFailure(impl.plugin_name, f"{type(exc).__name__}: {exc}"))
            continue
        for claimed in names if isinstance(names, list) else []:
            if not isinstance(claimed, str):
                continue
            name = canonical_name(claimed)  # "" is join-token: one name, not two
            if (impl.plugin_name, impl.plugin) not in claims.get(name, []):
                claims.setdefault(name, []).append((impl.plugin_name, impl.plugin))
    owners: dict[str, object] = {}
    for name, claimants in sorted(claims.items()):
        if len(claimants) == 1:
            owners[name] = claimants[0][1]
            continue
        who = ", ".join(sorted(n for n, _ in claimants))
        log.warning("attestor %r is claimed by several plugins (%s): refused", name, who)
        failures.append(PluginFailure(who, f"several plugins claim the attestor {name!r}"))
    return owners


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


def load_plugins(extra: list[object] | None = None) -> Plugins:
    """Load every attestor registered under ``bcd.attestors``, reporting failures.

    An entry point name two distributions register is the first's by distribution
    name (whether it loads or not, so the same install always loads the same code);
    the other is a failure naming both."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(AttestorSpec)
    failures: list[PluginFailure] = []
    seen: dict[str, str] = {}
    for ep in sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
        key=lambda e: (e.name, _dist_name(e)),
    ):
        if ep.name in seen:
            dist, first = _dist_name(ep), seen[ep.name]
            log.warning("attestor plugin %s of %s passed over: %s has it", ep.name, dist, first)
            failures.append(
                PluginFailure(
                    f"{ep.name} of {dist}",
                    f"{first} and {dist} both register {ep.name}; the one of {first} "
                    "(the first by distribution name) is loaded",
                )
            )
            continue
        seen[ep.name] = _dist_name(ep)
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # a broken plugin never takes the host down
            log.warning("attestor plugin %s failed to load: %s", ep.name, type(exc).__name__)
            failures.append(PluginFailure(ep.name, f"{type(exc).__name__}: {exc}"))
    for plugin in extra or []:
        pm.register(plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        failures.append(PluginFailure(str(exc.plugin), "implements an unknown hook"))
    return Plugins(pm, failures, _owners(pm, failures))


def __getattr__(name: str) -> object:
    """The contract's names as bcd.plugins held them before :mod:`bcd.attestor_api`
    (``from bcd.plugins import Admit, hookimpl`` keeps working; new code imports the
    public face)."""
    if not name.startswith("_") and hasattr(attestor_api, name):
        return getattr(attestor_api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

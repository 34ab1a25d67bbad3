"""``bcd doctor``: checks that say what is wrong with this node and the way back.

Checks, in order:

``config``
    config.toml loads. ok: the file's path; fail: the configuration error.
``identity``
    The identity in the data directory loads (the same rules as every agent mode).
    warn: the node has not joined; fail: the identity does not load, the certificate
    expired, or there is no configuration to find it; ok: the node, site, role and
    the certificate's end.
``plugins``
    Every registered attestor plugin loaded (``bcd doctor`` adds it with
    :func:`plugins_check`). warn: a plugin did not load, naming it; ok: the attestors.

Each check is ``ok``, ``warn`` or ``fail``. Exit codes (:func:`exit_code`):

* ``0`` no check failed (warnings allowed);
* ``1`` at least one check failed.

Loading the identity applies rule 2 of LoadState, so doctor may promote or remove a
node.key.next left by an interrupted renewal, exactly as the agent would at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bcd.config import load_config
from bcd.errors import ConfigError, IdentityError
from bcd.identity import NOT_JOINED, load_state

if TYPE_CHECKING:
    from bcd.plugins import Plugins

Status = Literal["ok", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail")
NO_CONFIG_FOR_IDENTITY = "cannot check the identity without a configuration"
EXPIRED_WAY_BACK = "join again as root: bcd join --reset --yes, then bcd join"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    message: str


def run_checks(config_path: Path, now: datetime) -> list[Check]:
    """Run every check against the configuration at ``config_path`` at time ``now``."""
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        return [
            Check("config", "fail", str(exc)),
            Check("identity", "fail", NO_CONFIG_FOR_IDENTITY),
        ]
    return [Check("config", "ok", str(config_path)), check_identity(cfg.data_dir, now)]


def check_identity(data_dir: Path, now: datetime) -> Check:
    """The identity check alone, for a data directory."""
    try:
        state = load_state(data_dir)
    except IdentityError as exc:
        return Check("identity", "fail", str(exc))
    if state is None:
        return Check("identity", "warn", NOT_JOINED)
    ident = state.identity
    if state.expired(now):
        return Check(
            "identity",
            "fail",
            f"the certificate expired at {ident.not_after}; {EXPIRED_WAY_BACK}",
        )
    return Check(
        "identity",
        "ok",
        f"node {ident.node_id} (site {ident.site_id}, role {ident.role}); "
        f"certificate valid until {ident.not_after}",
    )


def plugins_check(plugins: Plugins) -> Check:
    """warn for each attestor plugin that did not load; ok with the attestors' names."""
    if plugins.failures:
        failed = "; ".join(f"{f.name} did not load ({f.error})" for f in plugins.failures)
        return Check("plugins", "warn", f"attestor plugins: {failed}")
    names = plugins.names()
    return Check("plugins", "ok", "attestors: " + (", ".join(names) if names else "none"))


def exit_code(checks: list[Check]) -> int:
    """0 when no check failed (warnings allowed), 1 when any failed."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def render_text(checks: list[Check]) -> str:
    """One line a check: status, name, message, in columns."""
    width = max((len(c.name) for c in checks), default=0)
    width = max(width, 9)
    return "".join(f"{c.status:<5} {c.name:<{width}} {c.message}\n" for c in checks)


def render_json(checks: list[Check]) -> str:
    """``{"checks": [{"name", "status", "message"}, …], "ok": bool}``."""
    body = {
        "checks": [{"name": c.name, "status": c.status, "message": c.message} for c in checks],
        "ok": exit_code(checks) == 0,
    }
    return json.dumps(body, indent=2) + "\n"

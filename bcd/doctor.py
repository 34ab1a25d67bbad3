"""``bcd doctor``: checks that say what is wrong with this node and the way back.

Checks, in order:

``config``
    config.toml loads. ok: the file's path; fail: the configuration error.
``identity``
    The identity in the data directory loads (the same rules as every agent mode).
    warn: the node has not joined; fail: the identity does not load, the certificate
    expired, or there is no configuration to find it; fail too when the data directory
    or a file in it is not private (group or other permission bits, or an owner other
    than root, the user running doctor or the ``[helper]`` user), with the chmod or
    chown back; ok: the node, site, role and the certificate's end.
``revoked``
    Only for an identity that loads: what ``bcd node`` recorded in the journal
    (read only, :func:`bcd.journal.recorded`). fail: it stopped on a signed
    revocation of this certificate (the record names its serial; an older record
    without one applies when it is not older than the certificate), with the seeds'
    way back; warn: the journal cannot be read; ok otherwise. A ``session`` warning
    follows when the gateway last said the control plane does not know this
    certificate (``unknown-certificate``: a database restored from an older backup)
    and no session opened with it since. Doctor makes no network call: what it
    shows is what the agent last heard.
``x509pop``
    Only after an expiry of at most 7 days (and not for a certificate naming a TPM
    AK): warn with the other way back, ``bcd join --attestor x509pop`` as root, when
    the control plane has x509pop configured (doctor cannot tell whether it has).
``servingca``
    ``serving-ca.pem`` beside config.toml (``bcd doctor`` adds it with
    :func:`serving_ca_check`), loaded as the agent loads it
    (:func:`bcd.servingca.read_anchor`). ok: the file carries serving_ca_spki_pin;
    warn: there is none (bcd fetches it from the gateway on its next run, checked
    against the pin; install-bcd.sh writes it); fail: it does not load (not a regular
    file or a symlink, unreadable, not the one certificate carrying the pin, owned by
    another user, or writable by group or others), with the way back (run install-bcd.sh again, or remove it and bcd
    fetches it again).
``tpm``
    The TPM the node keys live in (``bcd doctor`` adds it with :func:`tpm_check`).
    ``[tpm] mode = off``: ok, the TPM is not used. Under ``[helper]``: fail while the
    ``[helper]`` user is still a member of the ``tss`` group (it could open the TPM
    itself, bypassing bcd helper; the way back is ``gpasswd -d <user> tss``); then the
    TPM must answer ``tpm.ak`` through bcd helper. bcd helper has no call that reads
    the EK certificate, so the ok message says "EK certificate not checked through the
    helper". Without ``[helper]``, as root, the TPM at ``[tpm] tcti`` is opened
    directly and the EK certificate must be readable (warn when it is not: only a
    ``--attestor tpm`` join needs it). No usable TPM: fail with ``mode = required``, ok
    ("no TPM; node keys are files") with ``mode = auto``; bcd helper not reachable: fail
    with ``required``, warn with ``auto``. Without ``[helper]`` and not root: warn, the
    TPM is not checked.
``hardware``
    What ``bcd join`` would claim (read as it reads them, under ``--sysfs-root``):
    the product UUID, serials, permanent MACs, GPU UUIDs and hostname, and the
    hardware key derived from them by the control plane's rule
    (:func:`bcd.hardware.hardware_key`). ok: the key is trusted; warn: it is a
    placeholder, so a join-token join is refused as placeholder hardware unless its
    token binds the machine with ``expect`` (a TPM join does not need it), with each
    value that made it so (:func:`bcd.hardware.placeholder_reasons`). ``--json``
    carries the claims and the key under ``details``.
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

import functools
import grp
import json
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import trio

from bcd.config import Config, load_config, trusted_owners
from bcd.errors import BcdError, ConfigError
from bcd.identity import NOT_JOINED, AnyState, load_state
from bcd.servingca import read_anchor, serving_ca_path

if TYPE_CHECKING:
    from bcd.plugins import Plugins

Status = Literal["ok", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail")
NO_CONFIG_FOR_IDENTITY = "cannot check the identity without a configuration"
NO_CONFIG_FOR_TPM = "cannot check the TPM without a configuration"
NO_CONFIG_FOR_SERVING_CA = "cannot check serving-ca.pem without a configuration"
SERVING_CA_WAY_BACK = (
    "run install-bcd.sh again, or remove the file and bcd fetches it from the gateway, "
    "checked against the pin"
)
EXPIRED_WAY_BACK = "join again as root: bcd join --reset --yes, then bcd join"
REVOKED_WAY_BACK = (
    "the machine comes back only by joining again with fresh evidence (a new token, or "
    "the TPM): as root, bcd join --reset --yes, then bcd join"
)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    message: str
    details: dict[str, Any] | None = None
    """Structured facts for ``--json`` (never a secret); the text shows ``message``."""


def run_checks(config_path: Path, now: datetime) -> list[Check]:
    """Run every check against the configuration at ``config_path`` at time ``now``."""
    try:
        cfg = load_config(config_path, check_attestors=True)
    except ConfigError as exc:
        return [
            Check("config", "fail", str(exc)),
            Check("identity", "fail", NO_CONFIG_FOR_IDENTITY),
        ]
    identity, state = _identity_and_state(cfg.data_dir, now, _loader(cfg))
    checks = [Check("config", "ok", str(config_path)), identity]
    if state is not None:
        checks.extend(journal_checks(cfg.data_dir, state))
    hint = rejoin_hint(state, now)
    if hint is not None:
        checks.append(hint)
    if cfg.helper is not None and state is not None:
        checks.append(helper_node_check(cfg, state.identity.node_id))
    return checks


def helper_node_check(cfg: Config, node_id: str) -> Check:
    """Which node bcd helper serves (from root's join record, read at its start)."""
    import trio

    from bcd.helper import HelperError
    from bcd.helper.client import HelperClient

    assert cfg.helper is not None
    try:
        served = trio.run(HelperClient(cfg.helper.socket).served_node)
    except HelperError as exc:
        return Check("helper", "warn", f"cannot ask bcd helper which node it serves: {exc}")
    if not served:
        return Check(
            "helper",
            "warn",
            "bcd helper has no root join record (bcd join as root writes it; then restart "
            "bcd-helper.service)",
        )
    if served != node_id:
        return Check(
            "helper",
            "fail",
            f"bcd helper serves node {served}, but this identity is node {node_id}: "
            "restart bcd-helper.service (it reads root's join record at start)",
        )
    return Check("helper", "ok", f"bcd helper serves node {node_id} (root's join record)")


def journal_checks(data_dir: Path, state: AnyState) -> list[Check]:
    """The ``revoked`` check, and the ``session`` warning; see the module's entry."""
    from bcd.identity import parse_time
    from bcd.journal import JournalError, recorded
    from bcd.revocation import UNKNOWN_CAUSE, UNKNOWN_CERTIFICATE, UNKNOWN_TEXT

    serial = state.leaf_info.serial_hex
    try:
        events = recorded(data_dir, ("revoked", UNKNOWN_CERTIFICATE, "session-open"))
    except JournalError as exc:
        return [Check("revoked", "warn", f"{exc}; cannot tell whether a revocation was recorded")]

    def applies(payload: dict[str, Any], at: str) -> bool:
        named = payload.get("serial")
        if isinstance(named, str):
            return named == serial
        try:  # recorded before records named the serial: not older than this certificate
            return parse_time(at) >= state.leaf_info.not_before
        except ValueError:
            return False

    for event in events:  # newest first
        if event.kind == "revoked" and applies(event.payload, event.at):
            reason = str(event.payload.get("reason", "?"))[:200]
            return [
                Check(
                    "revoked",
                    "fail",
                    f"bcd node stopped at {event.at} on a signed revocation of this node's "
                    f"certificate (serial {serial}, reason {json.dumps(reason)}); "
                    f"{REVOKED_WAY_BACK}",
                )
            ]
    checks = [Check("revoked", "ok", f"no revocation recorded for certificate {serial}")]
    last = next(
        (e for e in events if e.kind != "revoked" and e.payload.get("serial") == serial), None
    )
    if last is not None and last.kind == UNKNOWN_CERTIFICATE:
        checks.append(
            Check(
                "session",
                "warn",
                f"at {last.at} the gateway said {UNKNOWN_TEXT} (serial {serial}), and no "
                f"session opened with it since: {UNKNOWN_CAUSE}; bcd node keeps retrying "
                f"until it expires at {state.identity.not_after}; unless the operator "
                f"restores a newer backup, {EXPIRED_WAY_BACK}",
            )
        )
    return checks


def hardware_check(sysfs_root: Path = Path("/")) -> Check:
    """What ``bcd join`` would claim and whether its hardware key is trusted."""
    from bcd.hardware import hardware_key, identifiers, placeholder_reasons, read_claims

    claims = read_claims(sysfs_root)
    hw = hardware_key(claims)
    ids = identifiers(claims)
    details: dict[str, Any] = {
        "claims": {k: v for k, v in claims.to_json().items() if k != "boot_id"},
        "identifiers": {kind: sorted(values) for kind, values in ids.items()},
        "hardwareKey": hw.hex,
        "trusted": not hw.placeholder,
        "placeholderReasons": placeholder_reasons(claims),
    }

    def show(values: list[str] | tuple[str, ...]) -> str:
        return ", ".join(json.dumps(v) for v in values) if values else "none"

    serials = [claims.product_serial, claims.board_serial, claims.chassis_serial]
    claimed = (
        f"join claims: product UUID {show([claims.product_uuid] if claims.product_uuid else [])}; "
        f"serials {show([v for v in serials if v])}; permanent MACs {show(claims.macs)}; "
        f"GPU UUIDs {show(claims.gpu_uuids)}; hostname {show([claims.hostname] if claims.hostname else [])}"
    )
    if not hw.placeholder:
        kinds = ", ".join(sorted(hw.kinds))
        key = f"sha256:{hw.hex[:16]}…" if hw.hex else "none"
        return Check(
            "hardware", "ok", f"{claimed}; hardware key {key} is trusted ({kinds})", details
        )
    why = "; ".join(details["placeholderReasons"])
    return Check(
        "hardware",
        "warn",
        f"{claimed}; the hardware key is a placeholder ({why}): a join with a join token is "
        "refused as placeholder hardware unless the token binds this machine with expect "
        "(better-compute join-tokens create --expect-…), or join with the TPM",
        details,
    )


REJOIN_WINDOW = timedelta(days=7)


def rejoin_hint(state: AnyState | None, now: datetime) -> Check | None:
    """After an expiry of at most 7 days, the other way back: an x509pop re-join.

    Doctor does not ask the control plane, so it cannot tell whether x509pop is
    configured there; the hint says so. None when it does not apply (not expired,
    expired longer ago, or a TPM-AK-bound certificate, which x509pop refuses).
    """
    if state is None or not state.expired(now) or state.leaf_info.statements:
        return None
    until = state.leaf_info.not_after + REJOIN_WINDOW
    if now >= until:
        return None
    return Check(
        "x509pop",
        "warn",
        "when the control plane has x509pop configured, this node can instead re-join as "
        f"itself until {until.strftime('%Y-%m-%dT%H:%M:%SZ')}, as root: "
        "bcd join --attestor x509pop",
    )


def _loader(cfg: Config) -> Callable[[Path], AnyState | None]:
    """LoadState as ``bcd node`` does it: under ``[helper]`` a TPM key is derived there.

    The data directory and its files may be owned by root, the user running doctor or
    the ``[helper]`` user (:func:`bcd.config.trusted_owners`).
    """
    owners = trusted_owners(cfg)
    if cfg.helper is None:
        return functools.partial(load_state, owners=owners)
    from bcd.helper.client import HelperClient
    from bcd.helper.nodekeys import HelperKeys

    keys = HelperKeys(HelperClient(cfg.helper.socket))

    def load(data_dir: Path) -> AnyState | None:
        work = functools.partial(load_state, data_dir, keys.derive_sync, owners=owners)
        return trio.run(trio.to_thread.run_sync, work)

    return load


def check_identity(
    data_dir: Path,
    now: datetime,
    load: Callable[[Path], AnyState | None] = load_state,
) -> Check:
    """The identity check alone, for a data directory."""
    return _identity_and_state(data_dir, now, load)[0]


def _identity_and_state(
    data_dir: Path,
    now: datetime,
    load: Callable[[Path], AnyState | None],
) -> tuple[Check, AnyState | None]:
    try:
        state = load(data_dir)
    except BcdError as exc:  # IdentityError, or the helper failing to derive the key
        return Check("identity", "fail", str(exc)), None
    if state is None:
        return Check("identity", "warn", NOT_JOINED), None
    ident = state.identity
    if state.expired(now):
        return Check(
            "identity",
            "fail",
            f"the certificate expired at {ident.not_after}; {EXPIRED_WAY_BACK}",
        ), state
    return Check(
        "identity",
        "ok",
        f"node {ident.node_id} (site {ident.site_id}, role {ident.role}); "
        f"certificate valid until {ident.not_after}",
    ), state


TSS_GROUP = "tss"
TPM_OFF = "TPM not used (mode off)"
NO_TPM_FILE_KEYS = "no TPM; node keys are files"
EK_NOT_CHECKED = "EK certificate not checked through the helper"


def in_group(user: str, group: str) -> bool:
    """Whether ``user`` is a member of ``group`` (listed in it, or its primary group)."""
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        return False
    if user in entry.gr_mem:
        return True
    try:
        return pwd.getpwnam(user).pw_gid == entry.gr_gid
    except KeyError:
        return False


def tpm_check(cfg: Config) -> Check:
    """The TPM the node keys live in; see the module's ``tpm`` entry."""
    mode = cfg.tpm.mode
    if mode == "off":
        return Check("tpm", "ok", TPM_OFF)
    if cfg.helper is not None:
        user = cfg.helper.user
        if in_group(user, TSS_GROUP):
            return Check(
                "tpm",
                "fail",
                f"the [helper] user {user} is a member of the {TSS_GROUP} group, so bcd node "
                f"could open the TPM itself; remove {user} from the {TSS_GROUP} group: "
                f"gpasswd -d {user} {TSS_GROUP}",
            )
        return _tpm_through_helper(cfg)
    if os.geteuid() != 0:
        return Check(
            "tpm",
            "warn",
            f"the TPM at {cfg.tpm.tcti} was not checked: run bcd doctor as root "
            "(or configure [helper] with bcd helper running)",
        )
    return _tpm_direct(cfg)


def _no_tpm(mode: str, why: str) -> Check:
    if mode == "required":
        return Check("tpm", "fail", f"[tpm] mode = required, but {why}")
    return Check("tpm", "ok", f"{NO_TPM_FILE_KEYS} ({why})")


def _tpm_through_helper(cfg: Config) -> Check:
    import trio

    from bcd.helper import HelperError, HelperNoTpm
    from bcd.helper.client import HelperClient

    assert cfg.helper is not None
    client = HelperClient(cfg.helper.socket)
    try:
        ak = trio.run(client.ak)
    except HelperNoTpm as exc:
        return _no_tpm(cfg.tpm.mode, str(exc))
    except HelperError as exc:
        return Check("tpm", "fail" if cfg.tpm.mode == "required" else "warn", str(exc))
    return Check(
        "tpm",
        "ok",
        f"TPM reachable through bcd helper at {cfg.helper.socket} "
        f"(AK sha256:{ak.name[2:].hex()[:16]}…); {EK_NOT_CHECKED}",
    )


def _tpm_direct(cfg: Config) -> Check:
    from bcd.tpm import TpmError
    from bcd.tpm.device import missing_device, open_tpm
    from bcd.tpm.ek import ek_kind, read_ek_certificate

    absent = missing_device(cfg.tpm.tcti)
    if absent is not None:
        return _no_tpm(cfg.tpm.mode, f"no usable TPM at {cfg.tpm.tcti}: {absent}")
    try:
        with open_tpm(cfg.tpm.tcti) as tpm:
            try:
                kind = ek_kind(tpm)
                read_ek_certificate(tpm, kind)
            except TpmError as exc:
                return Check(
                    "tpm",
                    "warn",
                    f"TPM present at {cfg.tpm.tcti}, but the EK certificate is not readable "
                    f"({exc}); a join with --attestor tpm needs it",
                )
    except TpmError as exc:
        return _no_tpm(cfg.tpm.mode, f"no usable TPM at {cfg.tpm.tcti}: {exc}")
    return Check("tpm", "ok", f"TPM present at {cfg.tpm.tcti}; EK certificate ({kind}) readable")


def serving_ca_check(cfg: Config) -> Check:
    """``serving-ca.pem`` as the agent loads it; see the module's ``servingca`` entry."""
    path = serving_ca_path(cfg)
    try:
        anchor = read_anchor(path, cfg.serving_ca_spki_pin)
    except ConfigError as exc:
        if isinstance(exc.__cause__, ValueError):  # the content: the message has the way back
            return Check("servingca", "fail", str(exc))
        return Check("servingca", "fail", f"{exc}; {SERVING_CA_WAY_BACK}")
    if anchor is None:
        return Check(
            "servingca",
            "warn",
            f"no {path}: bcd fetches it from the gateway on its next run (checked against "
            "serving_ca_spki_pin); install-bcd.sh writes it",
        )
    return Check("servingca", "ok", f"{path} carries serving_ca_spki_pin")


def plugins_check(plugins: Plugins) -> Check:
    """warn for each attestor plugin that did not load; ok with the attestors' names."""
    if plugins.failures:
        failed = "; ".join(f"{f.name} did not load ({f.error})" for f in plugins.failures)
        return Check("plugins", "warn", f"attestor plugins: {failed}")
    names = plugins.names()
    return Check("plugins", "ok", "attestors: " + (", ".join(names) if names else "none"))


def all_checks(config_path: Path, now: datetime, sysfs_root: Path = Path("/")) -> list[Check]:
    """What ``bcd doctor`` shows: :func:`run_checks`, then serving-ca.pem, the TPM, the
    hardware claims (under ``sysfs_root``) and the plugins."""
    from bcd.plugins import load_plugins

    checks = run_checks(config_path, now)
    try:
        cfg = load_config(config_path, check_attestors=True)
    except ConfigError:
        checks.append(Check("servingca", "fail", NO_CONFIG_FOR_SERVING_CA))
        checks.append(Check("tpm", "fail", NO_CONFIG_FOR_TPM))
    else:
        checks.append(serving_ca_check(cfg))
        checks.append(tpm_check(cfg))
    checks.append(hardware_check(sysfs_root))
    checks.append(plugins_check(load_plugins()))
    return checks


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
        "checks": [
            {
                "name": c.name,
                "status": c.status,
                "message": c.message,
                **({"details": c.details} if c.details is not None else {}),
            }
            for c in checks
        ],
        "ok": exit_code(checks) == 0,
    }
    return json.dumps(body, indent=2) + "\n"

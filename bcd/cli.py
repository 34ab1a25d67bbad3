"""``bcd``: join | doctor | version.

Exit codes: 0 success, 1 a failure or refusal, 2 a usage error (and ``bcd join
--reset`` without ``--yes``). Known errors print one line with the way back.

The command line never leaks a token: options are never abbreviated (``--token``
is not ``--token-file``); an unknown option is named without its value; a
positional argument is never echoed; argparse's own complaints are reworded so a
value that may be a secret (:func:`bcd.credential.may_be_secret`) is never shown;
and any option whose value looks like a join token or another secret is refused
before anything runs, naming the option only.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bcd import __version__
from bcd.errors import BcdError, ConfigError, UsageError, describe_os_error, os_error_in

# What a command needs is imported by that command (trio, cryptography, jwcrypto,
# pluggy, the TPM, and even logging, typing and dataclasses), so bcd version and bcd
# --help start in a few tens of ms (bench/cli_start.py). typing is left out too:
# with postponed annotations it is needed only by the type checker.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from datetime import datetime
    from typing import Any, BinaryIO, NoReturn

DEFAULT_CONFIG = Path("/etc/bcd/config.toml")
JOIN_TOKEN = "join-token"  # noqa: S105 - bcd.attestor_api.JOIN_TOKEN, a name, not a secret


class _ParseProblem(Exception):
    """argparse's complaint, raised instead of printed so :func:`parse_args` words it."""


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--token`` never means ``--token-file``), no printed errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise _ParseProblem(message)


NOT_ECHOED = "not echoed: it may be a secret"
POSITIONAL_JOIN = (
    "bcd join takes no positional argument and never reads a token from the command line "
    "(nothing was echoed); pass it on standard input or with --token-file"
)
PIN_DESTS = ("serving_ca_pin", "join_signing_pin", "join_encryption_pin")


def _command(argv: Sequence[str]) -> str:
    first = argv[0] if argv else ""
    return first if first in ("join", "doctor", "node", "helper", "vouch", "version") else ""


def _help_hint(command: str) -> str:
    return f"see bcd {command} --help" if command else "see bcd --help"


def _unknown_arguments(command: str, extra: Sequence[str]) -> str:
    """The message for what argparse did not recognise: the first unknown option by
    name (never its value), else the positional arguments, never echoed."""
    from bcd.credential import may_be_secret, shown

    for item in extra:
        if item == "--" or not item.startswith("-") or item == "-":
            continue
        option = item.split("=", 1)[0]
        if may_be_secret(option):
            return f"an unknown option ({NOT_ECHOED}); {_help_hint(command)}"
        return f"unknown option {shown(option)}; {_help_hint(command)}"
    if command == "join":
        return POSITIONAL_JOIN
    where = f"bcd {command}" if command else "bcd"
    return f"{where} takes no positional argument (nothing was echoed); {_help_hint(command)}"


def _refuse_secret_values(args: argparse.Namespace) -> None:
    """Refuse any option whose value may be a secret, naming the option only.

    The three pins are high-entropy public values: for them only a bearer prefix
    (``bcjt_``, ``bcak_``) counts; their own check never echoes them.
    """
    given = [(d, v) for d, v in sorted(vars(args).items()) if d != "command" and isinstance(v, str)]
    if not given:
        return
    from bcd.credential import looks_like_token, may_be_secret

    for dest, value in given:
        risky = looks_like_token(value) if dest in PIN_DESTS else may_be_secret(value)
        if risky:
            flag = "--" + dest.replace("_", "-")
            raise UsageError(
                f"{flag}: the value is invalid ({NOT_ECHOED}); bcd never reads a join token "
                "from the command line: pass it on standard input or with --token-file"
            )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse bcd's command line; every problem is a UsageError that echoes no secret."""
    command = _command(argv)
    try:
        args, extra = build_parser().parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        from bcd.credential import may_be_secret

        name = exc.argument_name or "an argument"
        if may_be_secret(exc.message) or not exc.message.isprintable():
            raise UsageError(
                f"argument {name}: the value is invalid ({NOT_ECHOED}); {_help_hint(command)}"
            ) from None
        raise UsageError(f"argument {name}: {exc.message}; {_help_hint(command)}") from None
    except _ParseProblem as exc:
        from bcd.credential import may_be_secret

        message = str(exc)
        if may_be_secret(message) or not message.isprintable():
            message = f"invalid arguments ({NOT_ECHOED})"
        raise UsageError(f"{message}; {_help_hint(command)}") from None
    if extra:
        raise UsageError(_unknown_arguments(command, extra))
    _refuse_secret_values(args)
    return args


def _now() -> datetime:
    from datetime import UTC, datetime

    return datetime.now(UTC)


# --- join ------------------------------------------------------------------------------


def _stdin() -> BinaryIO | None:
    return sys.stdin.buffer if sys.stdin is not None else None


def _say(line: str) -> None:
    print(line, flush=True)


def _warn(line: str) -> None:
    """A warning on stderr (``bcd join``'s retries): ``<4>`` under journald."""
    import logging

    from bcd.systemd import prioritized, under_journald

    journald = under_journald(sys.stderr)
    print(prioritized(line, logging.WARNING) if journald else line, file=sys.stderr)


def _final(line: str, args: argparse.Namespace | None = None, logger: str = "bcd") -> None:
    """A last line on stderr (``agent: …``, ``bcd: …``) at error priority: under
    journald with its ``<3>`` prefix, and with ``--log-format json`` a JSON line of
    ``logger`` like every other line."""
    import logging

    if args is not None and getattr(args, "log_format", "text") == "json":
        logging.getLogger(logger).error("%s", line)
        return
    from bcd.systemd import prioritized, under_journald

    journald = under_journald(sys.stderr)
    print(prioritized(line, logging.ERROR) if journald else line, file=sys.stderr)


def cmd_join(args: argparse.Namespace) -> int:
    """Plan the join the flags ask for (:func:`bcd.joinplan.plan_join`), then run it."""
    import trio

    from bcd.joinplan import Finished, JoinOptions, Report, finish, plan_join, run_plan

    opts = JoinOptions(
        config=Path(args.config),
        attestor=args.attestor,
        role=args.role,
        node_id=args.node_id,
        reset=args.reset,
        yes=args.yes,
        server=args.server,
        serving_ca_pin=args.serving_ca_pin,
        join_signing_pin=args.join_signing_pin,
        join_encryption_pin=args.join_encryption_pin,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        sysfs_root=Path(args.sysfs_root),
        token_file=Path(args.token_file) if args.token_file else None,
    )
    report = Report(say=_say, warn=_warn)
    plan = plan_join(opts, _stdin(), report)
    if isinstance(plan, Finished):
        return finish(plan, report)
    ident = trio.run(run_plan, plan, report).identity
    print(
        f"joined as {ident.node_id} (site {ident.site_id}, role {ident.role}); "
        f"certificate valid until {ident.not_after}"
    )
    return 0


# --- doctor and version ------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from bcd import doctor

    checks = doctor.all_checks(Path(args.config), _now(), Path(args.sysfs_root))
    print(doctor.render_json(checks) if args.json else doctor.render_text(checks).rstrip("\n"))
    return doctor.exit_code(checks)


def cmd_node(args: argparse.Namespace) -> int:
    import logging

    import trio

    from bcd.config import load_config
    from bcd.errors import CertificateRevoked, IdentityError
    from bcd.node import (
        EXIT_INTERNAL,
        EXIT_NEEDS_OPERATOR,
        EXIT_TEMPORARY,
        REVOKED_MESSAGE,
        run_node,
    )

    cfg = load_config(Path(args.config))
    outcome = 0
    try:
        trio.run(run_node, cfg)
    except* CertificateRevoked as group:
        logging.getLogger("bcd.node").error("%s", group.exceptions[0])
        _final(REVOKED_MESSAGE, args, "bcd.node")
        outcome = EXIT_NEEDS_OPERATOR
    except* (IdentityError, ConfigError) as group:
        _final(f"agent: {group.exceptions[0]}", args, "bcd.node")
        outcome = EXIT_NEEDS_OPERATOR
    except* BcdError as group:
        _final(f"agent: {group.exceptions[0]}", args, "bcd.node")
        outcome = EXIT_TEMPORARY
    except* Exception as group:
        logging.getLogger("bcd.node").error(
            "agent: a task failed; stopping", exc_info=group.exceptions[0]
        )
        _final(
            f"agent: stopped after an internal error ({type(group.exceptions[0]).__name__})",
            args,
            "bcd.node",
        )
        outcome = EXIT_INTERNAL
    return outcome


def cmd_helper(args: argparse.Namespace) -> int:
    from bcd.config import load_config
    from bcd.helper.server import run_helper
    from bcd.systemd import LEVELS

    return run_helper(
        load_config(Path(args.config)),
        lambda line: _final(line, args, "bcd.helper"),
        level=LEVELS[args.log_level],
    )


def cmd_vouch(args: argparse.Namespace) -> int:
    import trio

    from bcd.config import load_config
    from bcd.credential import shown
    from bcd.hardware import normalize_mac
    from bcd.vouch import vouch

    missing = [
        flag
        for flag, value in (("--mac", args.mac), ("--boot-lease-epoch", args.boot_lease_epoch))
        if value is None
    ]
    if missing:
        raise UsageError(f"bcd vouch needs {' and '.join(missing)}; see bcd vouch --help")
    mac = normalize_mac(args.mac)
    if mac is None:
        raise UsageError(
            f"--mac {shown(repr(args.mac))} is not a permanent, globally administered unicast MAC"
        )
    if args.boot_lease_epoch <= 0:
        raise UsageError("--boot-lease-epoch must be a positive integer (the lease's unix time)")
    cfg = load_config(Path(args.config))
    answer = trio.run(vouch, cfg, mac, args.boot_lease_epoch, args.ip, args.workflow_id)
    print(
        f"vouched for {answer.get('mac')} on site {answer.get('site_id')} "
        f"(boot {answer.get('boot_lease_epoch')}, {answer.get('vouch_id')}); "
        f"it may join until {answer.get('expires_at')}"
    )
    return 0


def version_text() -> str:
    """What ``bcd version`` and ``bcd --version`` print."""
    return f"bcd {__version__}"


def cmd_version(args: argparse.Namespace) -> int:
    print(version_text())
    return 0


LOG_LEVELS = ("debug", "info", "warning", "error")  # bcd.systemd.LEVELS, not imported here
LOG_FORMATS = ("text", "json")  # bcd.systemd.FORMATS


def _log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="the least severe lines (info)"
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text (default) or json: one JSON object a line with the event's fields",
    )


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(prog="bcd", description="bcd, the better-compute node agent")
    top.add_argument("--version", action="version", version=version_text())
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("join", help="join this machine with a join token (as root)")
    p.set_defaults(fn=cmd_join)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--token-file", help="a file only its owner can read (0600/0400), deleted after")
    p.add_argument(
        "--attestor",
        default=JOIN_TOKEN,
        help="join-token (default), tpm or discovery (no token), x509pop (re-join the "
        "identity held here after an offline expiry), or a plugin's",
    )
    p.add_argument("--role", default="node", choices=["node", "site", "ramdisk"])
    p.add_argument("--node-id")
    p.add_argument("--reset", action="store_true", help="move the identity aside first")
    p.add_argument("--yes", action="store_true", help="with --reset: really move it")
    p.add_argument("--server", help="the control plane's URL (the well-known document)")
    p.add_argument("--serving-ca-pin")
    p.add_argument("--join-signing-pin")
    p.add_argument("--join-encryption-pin")
    p.add_argument("--data-dir")
    p.add_argument("--sysfs-root", default="/", help=argparse.SUPPRESS)

    p = sub.add_parser("doctor", help="check the configuration and the identity")
    p.set_defaults(fn=cmd_doctor)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--sysfs-root", default="/", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("node", help="run the agent: renew the identity, keep the session open")
    p.set_defaults(fn=cmd_node)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    _log_flags(p)

    p = sub.add_parser("helper", help="serve the TPM to bcd node over a Unix socket (as root)")
    p.set_defaults(fn=cmd_helper)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    _log_flags(p)

    p = sub.add_parser(
        "vouch", help="as a site agent: vouch for a machine that booted on this site"
    )
    p.set_defaults(fn=cmd_vouch)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    # Required, but checked by cmd_vouch: argparse would report a missing one before an
    # unknown option (a typo of it), which is the more useful message.
    p.add_argument("--mac", help="the booted machine's MAC (required)")
    p.add_argument(
        "--boot-lease-epoch", type=int, help="the boot's DHCP lease (unix time; required)"
    )
    p.add_argument("--ip", help="the address the machine was given")
    p.add_argument("--workflow-id", help="the provisioning workflow that booted it")

    p = sub.add_parser("version")
    p.set_defaults(fn=cmd_version)
    return top


INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE, as bcd node's


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except UsageError as exc:
        _final(f"bcd: usage: {exc}")
        return exc.exit_code
    if args.command != "version":  # which logs nothing, and so starts without logging
        import logging

        from bcd import systemd

        systemd.configure_logging(
            sys.stderr,
            systemd.LEVELS.get(getattr(args, "log_level", ""), logging.WARNING),
            log_format=getattr(args, "log_format", "text"),
        )
    try:
        code: int = args.fn(args)
    except BcdError as exc:
        _final(f"bcd: {exc}", args)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, never a traceback (it could hold a secret)
        if os.environ.get("BCD_DEBUG") == "1":
            raise
        os_error = os_error_in(exc)
        if os_error is not None:  # the system said no: not a bug
            _final(f"bcd: {describe_os_error(os_error)}", args)
            return 1
        _final(
            f"bcd: internal error ({type(exc).__name__}); this is a bug in bcd. Run the same "
            "command with BCD_DEBUG=1 for the traceback",
            args,
        )
        return INTERNAL_ERROR_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())

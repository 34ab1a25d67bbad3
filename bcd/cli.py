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
import json
import logging
import os
import pwd
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import __version__, doctor, fs, pki, systemd, wire
from bcd.config import (
    Config,
    join_encryption_jwk_path,
    load_config,
    parse_config,
    render_config,
    trusted_owners,
)
from bcd.credential import (
    Credential,
    looks_like_token,
    may_be_secret,
    read_stdin,
    read_stdin_if_any,
    read_token_file,
    remove_credential_files,
    shown,
    stdin_holds_data,
)
from bcd.errors import (
    BcdError,
    ConfigError,
    CredentialError,
    JoinError,
    UsageError,
    describe_os_error,
    os_error_in,
)
from bcd.hardware import read_claims
from bcd.httpclient import fetch_url
from bcd.identity import (
    apply_reset,
    check_data_dir,
    hand_over,
    load_state,
    persist_join,
    persist_rejoin,
    reset_plan,
    write_join_record,
)
from bcd.keys.file import generate_file_key, key_to_pem
from bcd.plugins import JOIN_TOKEN, load_plugins
from bcd.tpm.record import NodeKeyRecord

if TYPE_CHECKING:
    from bcd.join import HeldKey

DEFAULT_CONFIG = Path("/etc/bcd/config.toml")
WELL_KNOWN = "/.well-known/better-compute"
BASE_PATH = "/api/compute"


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
    for dest, value in sorted(vars(args).items()):
        if dest == "command" or not isinstance(value, str):
            continue
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
        name = exc.argument_name or "an argument"
        if may_be_secret(exc.message) or not exc.message.isprintable():
            raise UsageError(
                f"argument {name}: the value is invalid ({NOT_ECHOED}); {_help_hint(command)}"
            ) from None
        raise UsageError(f"argument {name}: {exc.message}; {_help_hint(command)}") from None
    except _ParseProblem as exc:
        message = str(exc)
        if may_be_secret(message) or not message.isprintable():
            message = f"invalid arguments ({NOT_ECHOED})"
        raise UsageError(f"{message}; {_help_hint(command)}") from None
    if extra:
        raise UsageError(_unknown_arguments(command, extra))
    _refuse_secret_values(args)
    return args


def _now() -> datetime:
    return datetime.now(UTC)


# --- join ------------------------------------------------------------------------------


def _encryption_key_from_file(cfg: Config) -> ec.EllipticCurvePublicKey | None:
    path = join_encryption_jwk_path(cfg)
    rotated = (
        f"{path} does not match join_encryption_key_pin (was the join key rotated?); "
        "generate the install script again and rerun it, which rewrites the file and the pins"
    )
    try:
        raw = fs.read_regular_file(path, 4096)
    except FileNotFoundError:
        return None
    except fs.NotRegularFile as exc:
        raise JoinError(
            f"{path} is {exc.kind}, not a regular file (nothing was read); "
            "generate the install script again and rerun it, which rewrites the file"
        ) from exc
    except fs.FileTooLarge as exc:
        raise JoinError(rotated) from exc
    except OSError as exc:
        raise JoinError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        key = wire.public_key_of_jwk(wire.loads_object(raw, 4096))
    except wire.WireError as exc:
        raise JoinError(rotated) from exc
    if not pki.pins_equal(pki.spki_pin(key), cfg.join_encryption_key_pin):
        raise JoinError(rotated)
    return key


def _well_known_url(server: str) -> str:
    parsed = urllib.parse.urlsplit(server)
    if parsed.scheme not in ("https", "http") or not parsed.hostname:
        raise UsageError("--server must be the control plane's https:// (or http://) URL")
    base = server.rstrip("/")
    if not parsed.path.rstrip("/").endswith(BASE_PATH):
        base += BASE_PATH
    return base + WELL_KNOWN


async def fetch_well_known(server: str) -> dict[str, Any]:
    resp = await fetch_url(_well_known_url(server))
    if resp.status != 200:
        raise JoinError(f"{server} has no well-known document (HTTP {resp.status})")
    try:
        return wire.loads_object(resp.body)
    except wire.WireError as exc:
        raise JoinError(f"the well-known document of {server} is not JSON") from exc


def _key_from_document(doc: dict[str, Any], pin: str, server: str) -> ec.EllipticCurvePublicKey:
    join = doc.get("join")
    if not isinstance(join, dict):
        raise JoinError(f"{server} publishes no join section (is pki.join configured?)")
    try:
        key = wire.public_key_of_jwk(join.get("encryptionJwk"))
    except wire.WireError as exc:
        raise JoinError(f"the join encryption key published by {server} does not parse") from exc
    if not pki.pins_equal(pki.spki_pin(key), pin):
        raise JoinError(
            f"the join encryption key published by {server} does not match "
            "join_encryption_key_pin; the document is not trusted"
        )
    return key


def _bootstrap_config(args: argparse.Namespace, doc: dict[str, Any]) -> Config:
    """A config built from the well-known document's gateway section and the pin flags."""
    pins = {
        "serving_ca_spki_pin": args.serving_ca_pin,
        "join_signing_key_pin": args.join_signing_pin,
        "join_encryption_key_pin": args.join_encryption_pin,
    }
    missing = [
        flag
        for flag, value in zip(
            ("--serving-ca-pin", "--join-signing-pin", "--join-encryption-pin"),
            pins.values(),
            strict=True,
        )
        if not value
    ]
    if missing:
        raise UsageError(
            f"without {args.config} a join with --server needs the pins from the install: "
            + ", ".join(missing)
        )
    for name, value in pins.items():
        try:
            pki.parse_pin(value)
        except pki.PkiError as exc:
            flag = {
                "serving_ca_spki_pin": "--serving-ca-pin",
                "join_signing_key_pin": "--join-signing-pin",
                "join_encryption_key_pin": "--join-encryption-pin",
            }[name]
            raise UsageError(f"{flag}: {exc}") from exc
    gateway = doc.get("gateway")
    if not isinstance(gateway, dict) or not isinstance(gateway.get("url"), str):
        raise JoinError(f"{args.server} publishes no gateway section; write {args.config} instead")
    published = {
        "serving_ca_spki_pin": gateway.get("servingCaPin"),
        "join_signing_key_pin": (doc.get("join") or {}).get("signingKeyPin"),
        "join_encryption_key_pin": (doc.get("join") or {}).get("encryptionKeyPin"),
    }
    for name, value in pins.items():
        seen = published[name]
        if not isinstance(seen, str) or not pki.pins_equal(seen, value):
            raise JoinError(
                f"the well-known document of {args.server} has another {name} than the one "
                "given; refusing it"
            )
    site_placeholder = "site_" + "0" * 26
    lines = [
        f"gateway_url = {json.dumps(gateway['url'])}",
        f"site = {json.dumps(site_placeholder)}",
        *(f"{k} = {json.dumps(v)}" for k, v in pins.items()),
    ]
    if isinstance(gateway.get("serverName"), str):
        lines.append(f"server_name = {json.dumps(gateway['serverName'])}")
    if args.data_dir:
        lines.append(f"data_dir = {json.dumps(str(Path(args.data_dir).absolute()))}")
    return parse_config("\n".join(lines) + "\n", Path(args.config))


def _stdin() -> BinaryIO | None:
    return sys.stdin.buffer if sys.stdin is not None else None


def _check_credential_sources(args: argparse.Namespace) -> None:
    """A usage error (exit 2) for two credential sources, never a silent choice.

    ``--token-file`` with an attestor that reads no token; a token on standard input
    as well as ``--token-file``; a token on standard input for an attestor that reads
    none. Standard input is only looked at when it is not a terminal, and never waited
    on (:func:`bcd.credential.stdin_holds_data`).
    """
    attestor = shown(args.attestor)
    if args.token_file and args.attestor != JOIN_TOKEN:
        raise UsageError(
            f"--token-file gives a join token, and --attestor {attestor} reads none; "
            "drop --token-file, or join with a token (the default attestor)"
        )
    if args.token_file or args.attestor != JOIN_TOKEN:
        stdin = _stdin()
        if stdin is not None and stdin_holds_data(stdin):
            if args.token_file:
                raise UsageError(
                    "a join credential came both on standard input and with --token-file; "
                    "give it one way only (neither was used)"
                )
            raise UsageError(
                f"--attestor {attestor} reads no join token, but standard input holds "
                "something; give none (it was not used)"
            )


def _read_credential(args: argparse.Namespace, *, optional: bool = False) -> Credential | None:
    """The join credential, checked to be a join token before anything else is done.

    None for an attestor that reads none and, with ``optional``, when standard input
    (without ``--token-file``) is a terminal or empty.
    """
    if args.attestor != JOIN_TOKEN:
        return None
    if args.token_file:
        credential = read_token_file(Path(args.token_file))
    else:
        stdin = _stdin()
        if optional:
            found = read_stdin_if_any(stdin) if stdin is not None else None
            if found is None:
                return None
            credential = found
        elif stdin is None:
            raise CredentialError(
                "bcd join reads the join token from standard input or --token-file, and "
                "standard input is closed; pipe it in: bcd join < join-token"
            )
        else:
            credential = read_stdin(stdin)
    try:
        wire.parse_token(credential.text)
    except wire.WireError:
        raise CredentialError("the join credential is not a join token (bcjt_…)") from None
    return credential


def _print_moved(src: Path, dst: Path) -> None:
    print(f"moved {src} -> {dst}")


TPM_ATTESTOR = "tpm"


def _derive_in_tpm(cfg: Config) -> Callable[[NodeKeyRecord], ec.EllipticCurvePublicKey]:
    """LoadState's ``derive`` for a TPM-held node key: bcd join (root) opens the TPM."""

    def derive(record: NodeKeyRecord) -> ec.EllipticCurvePublicKey:
        from bcd.tpm.device import open_tpm
        from bcd.tpm.nodekey import derive_node_key

        with open_tpm(cfg.tpm.tcti) as tpm:
            return derive_node_key(tpm, record)

    return derive


def _tpm_node_key(cfg: Config) -> HeldKey:
    """A new node key in the TPM: its record (pinned to the key), public half and CSR."""
    from bcd.join import HeldKey
    from bcd.tpm.device import open_tpm
    from bcd.tpm.nodekey import create_node_key_record, derive_node_key, sign

    with open_tpm(cfg.tpm.tcti) as tpm:
        record = create_node_key_record()
        record = record.pinned(derive_node_key(tpm, record))
        public_key = derive_node_key(tpm, record)
        csr_der = pki.make_csr_with(public_key, lambda digest: sign(tpm, record, digest))
    return HeldKey(public_key, csr_der, record.to_dict())


def _node_key(cfg: Config, attestor: str) -> tuple[ec.EllipticCurvePrivateKey | HeldKey, bytes]:
    """Join step 1: the node key and what node.key will hold.

    A tpm join makes it in the TPM. Otherwise ``[tpm] mode`` decides: ``off`` a file
    key; ``required`` a key in the TPM at ``[tpm] tcti``, or a JoinError before
    anything is sent; ``auto`` a key in the TPM when one is usable there AND
    ``[helper]`` is configured, else a file key. ``bcd node`` uses a TPM-held key only
    through ``bcd helper`` (it never opens the TPM), so without ``[helper]`` a TPM key
    would make a node that cannot run: ``auto`` then keeps a file key.
    """
    if attestor == TPM_ATTESTOR:
        held = _tpm_node_key(cfg)
        return held, NodeKeyRecord.from_dict(held.record).to_json()
    mode, tcti = cfg.tpm.mode, cfg.tpm.tcti
    if mode == "required" or (mode == "auto" and cfg.helper is not None):
        from bcd.tpm import TpmError
        from bcd.tpm.device import missing_device

        why = missing_device(tcti)
        if why is None:
            try:
                held = _tpm_node_key(cfg)
            except TpmError as exc:
                why = str(exc)
            else:
                return held, NodeKeyRecord.from_dict(held.record).to_json()
        if mode == "required":
            raise JoinError(
                f"[tpm] mode = required, but the TPM cannot be used ({why}); nothing was sent. "
                f"Make the TPM at {tcti} usable, or set [tpm] mode = auto or off in {cfg.path}"
            )
    key = generate_file_key()
    return key, key_to_pem(key)


def _helper_owner(cfg: Config) -> tuple[int, int] | None:
    """Under ``[helper]``, the uid and gid identity.json and node.key are handed to.

    Looked up before anything is sent: a missing user fails the join with nothing done.
    """
    if cfg.helper is None:
        return None
    try:
        user = pwd.getpwnam(cfg.helper.user)
    except KeyError as exc:
        raise JoinError(
            f"no user named {cfg.helper.user!r} ([helper] user in {cfg.path}) to hand the "
            "identity over to; create it or fix the configuration, then join again"
        ) from exc
    return user.pw_uid, user.pw_gid


def cmd_join(args: argparse.Namespace) -> int:
    _check_credential_sources(args)
    if os.geteuid() != 0:
        raise BcdError("bcd join must run as root (it writes the node's identity)")
    plugins = load_plugins()
    for failure in plugins.failures:
        print(
            f"warning: attestor plugin {failure.name} did not load: {failure.error}",
            file=sys.stderr,
        )
    if args.attestor not in plugins.names():
        raise JoinError(f"no attestor plugin named {shown(repr(args.attestor))} is loaded")
    config_path = Path(args.config)
    bootstrap_doc: dict[str, Any] | None = None
    if not config_path.exists() and args.server:
        bootstrap_doc = trio.run(fetch_well_known, args.server)
        cfg = _bootstrap_config(args, bootstrap_doc)
    else:
        cfg = load_config(config_path)
        if args.data_dir:
            cfg = replace(cfg, data_dir=Path(args.data_dir).absolute())
    data_dir = cfg.data_dir
    owners = trusted_owners(cfg)
    check_data_dir(data_dir, owners)  # a directory others can write is never used
    if args.attestor == TPM_ATTESTOR and cfg.tpm.mode == "off":
        raise JoinError("--attestor tpm needs the TPM, but the configuration says [tpm] mode = off")

    from bcd import rejoin as x509pop

    rejoin = None
    if args.attestor == x509pop.X509POP:  # re-join the identity held here
        rejoin = x509pop.prepare(
            cfg, _derive_in_tpm(cfg), reset=args.reset, node_id=args.node_id, now=_now()
        )
    plan: list[tuple[Path, Path]] = []
    credential: Credential | None = None
    if args.reset:  # never with x509pop: prepare() refused that combination
        plan = reset_plan(data_dir, _now())
        if not args.yes:
            for src, dst in plan:
                print(f"would move {src} -> {dst}")
            if not plan:
                print(f"nothing to move in {data_dir}")
            print("nothing was moved; run again with --reset --yes to move the identity aside")
            return 2
        credential = _read_credential(args, optional=True)
        if credential is None and args.attestor == JOIN_TOKEN:
            # The first step of "bcd join --reset --yes, then bcd join": no credential,
            # so only the move aside, and the way on.
            apply_reset(plan, _print_moved)
            if not plan:
                print(f"nothing to move in {data_dir}")
            print(
                "no join credential was given, so nothing was joined; join now as root: "
                "bcd join < join-token (or --token-file PATH, or --attestor tpm)"
            )
            return 0
    elif rejoin is None:
        state = load_state(data_dir, _derive_in_tpm(cfg), owners=owners)
        if state is not None:
            ident = state.identity
            if args.node_id and args.node_id != ident.node_id:
                raise JoinError(
                    f"this machine is already joined as {ident.node_id}; --node-id names another "
                    "node (to join again: bcd join --reset --yes, then bcd join)"
                )
            print(f"already joined as {ident.node_id} (site {ident.site_id}, role {ident.role})")
            return 0
    if credential is None:
        credential = _read_credential(args)  # read and checked before any key is made

    owner = _helper_owner(cfg)
    key, key_bytes = _node_key(cfg, args.attestor)
    encryption_key = None
    if args.attestor == JOIN_TOKEN:
        encryption_key = _encryption_key_from_file(cfg) if bootstrap_doc is None else None
        if encryption_key is None:
            if not args.server:
                raise JoinError(
                    f"{join_encryption_jwk_path(cfg)} is missing; give the control plane's URL "
                    "with --server to fetch the join key from its well-known document"
                )
            doc = bootstrap_doc or trio.run(fetch_well_known, args.server)
            encryption_key = _key_from_document(doc, cfg.join_encryption_key_pin, args.server)
    elif bootstrap_doc is not None:
        # No token to seal, but the bootstrap writes join-encryption.jwk beside the new
        # config.toml (a later token join needs it): checked against its pin before
        # anything is sent, like the rest of the document.
        encryption_key = _key_from_document(bootstrap_doc, cfg.join_encryption_key_pin, args.server)
    from bcd.join import join

    joined = trio.run(
        lambda: join(
            cfg,
            plugins,
            attestor=args.attestor,
            role=args.role if rejoin is None else rejoin.role,
            credential=credential.text if credential else None,
            encryption_key=encryption_key,
            claims=read_claims(Path(args.sysfs_root)),
            key=key,
            node_id=args.node_id,
            identity_chain_der=rejoin.chain_der if rejoin else (),
            identity_signer=rejoin.signer if rejoin else None,
        )
    )
    ident = joined.identity
    if cfg.helper is not None:
        # Join step 5, root's record, before the identity: a failed record fails the
        # join and leaves no identity (and, after --reset --yes, the old one in place).
        write_join_record(cfg.helper.hostconfig_dir, joined.signed)
    # The old identity moves aside only once the new one is in hand: a refused or
    # failed join after --reset --yes leaves the machine as it was.
    if rejoin is not None:  # crash safe: the old identity loads until the new one is whole
        persist_rejoin(data_dir, ident, key_bytes)
    else:
        apply_reset(plan, _print_moved)  # each move printed once it is done
        persist_join(data_dir, ident, key_bytes, _now())
    if owner is not None:
        hand_over(data_dir, *owner)  # join step 7: lchown, never through a swapped-in link
    if bootstrap_doc is not None:
        cfg = replace(cfg, site=ident.site_id)
        fs.ensure_dir(config_path.parent, 0o755)
        fs.atomic_write(config_path, render_config(cfg).encode(), 0o644)
        assert encryption_key is not None
        fs.atomic_write(
            join_encryption_jwk_path(cfg), wire.dumps(wire.public_jwk_of(encryption_key)), 0o644
        )
    if credential is not None:
        for warning in remove_credential_files(credential):
            print(warning, file=sys.stderr)
    print(
        f"joined as {ident.node_id} (site {ident.site_id}, role {ident.role}); "
        f"certificate valid until {ident.not_after}"
    )
    return 0


# --- doctor and version ------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    config_path = Path(args.config)
    checks = doctor.run_checks(config_path, _now())
    try:
        cfg = load_config(config_path)
    except ConfigError:
        checks.append(doctor.Check("tpm", "fail", doctor.NO_CONFIG_FOR_TPM))
    else:
        checks.append(doctor.tpm_check(cfg))
    plugins = load_plugins()
    checks.append(doctor.plugins_check(plugins))
    print(doctor.render_json(checks) if args.json else doctor.render_text(checks).rstrip("\n"))
    return doctor.exit_code(checks)


def cmd_node(args: argparse.Namespace) -> int:
    from bcd.errors import CertificateRevoked, IdentityError
    from bcd.node import (
        EXIT_INTERNAL,
        EXIT_NEEDS_OPERATOR,
        EXIT_TEMPORARY,
        REVOKED_MESSAGE,
        run_node,
    )

    logging.getLogger().setLevel(logging.INFO)
    cfg = load_config(Path(args.config))
    outcome = 0
    try:
        trio.run(run_node, cfg)
    except* CertificateRevoked as group:
        logging.getLogger("bcd.node").error("%s", group.exceptions[0])
        print(REVOKED_MESSAGE, file=sys.stderr)
        outcome = EXIT_NEEDS_OPERATOR
    except* (IdentityError, ConfigError) as group:
        print(f"agent: {group.exceptions[0]}", file=sys.stderr)
        outcome = EXIT_NEEDS_OPERATOR
    except* BcdError as group:
        print(f"agent: {group.exceptions[0]}", file=sys.stderr)
        outcome = EXIT_TEMPORARY
    except* Exception as group:
        logging.getLogger("bcd.node").error(
            "agent: a task failed; stopping", exc_info=group.exceptions[0]
        )
        print(
            f"agent: stopped after an internal error ({type(group.exceptions[0]).__name__})",
            file=sys.stderr,
        )
        outcome = EXIT_INTERNAL
    return outcome


def cmd_helper(args: argparse.Namespace) -> int:
    from bcd.helper.server import run_helper

    return run_helper(load_config(Path(args.config)))


def cmd_vouch(args: argparse.Namespace) -> int:
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


def cmd_version(args: argparse.Namespace) -> int:
    print(f"bcd {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(prog="bcd", description="bcd, the better-compute node agent")
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
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("node", help="run the agent: renew the identity, keep the session open")
    p.set_defaults(fn=cmd_node)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))

    p = sub.add_parser("helper", help="serve the TPM to bcd node over a Unix socket (as root)")
    p.set_defaults(fn=cmd_helper)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))

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
    systemd.configure_logging(sys.stderr, logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"bcd: usage: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        code: int = args.fn(args)
    except BcdError as exc:
        print(f"bcd: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, never a traceback (it could hold a secret)
        if os.environ.get("BCD_DEBUG") == "1":
            raise
        os_error = os_error_in(exc)
        if os_error is not None:  # the system said no: not a bug
            print(f"bcd: {describe_os_error(os_error)}", file=sys.stderr)
            return 1
        print(
            f"bcd: internal error ({type(exc).__name__}); this is a bug in bcd. Run the same "
            "command with BCD_DEBUG=1 for the traceback",
            file=sys.stderr,
        )
        return INTERNAL_ERROR_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())

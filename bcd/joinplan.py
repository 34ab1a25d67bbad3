"""``bcd join`` as a plan: what the command line asked, decided once, then run.

:func:`plan_join` turns :class:`JoinOptions` (the command line, nothing else) into a
:class:`JoinPlan`: the configuration (read, or built by the ``--server`` bootstrap
from the well-known document, :mod:`bcd.bootstrap`), the attestor and its plugins,
the credential (read and checked before any key is made), the node key (in the TPM
or a file), the join encryption key (``join-encryption.jwk`` beside config.toml, or the document's, both
checked against ``join_encryption_key_pin``), the identity to lend (an x509pop
re-join), what ``--reset --yes`` moves aside and the user the identity is handed to.
Everything that can be refused is refused here, before a byte is sent. When there is
nothing to join (``--reset`` without ``--yes``, an identity already here, ``--reset
--yes`` without a credential) it returns a :class:`Finished` instead.

:func:`run_plan` runs a JoinPlan: the exchange (:func:`bcd.join.join`), then root's
record, the identity, the hand-over, the bootstrap's files and the removal of the
token file, in that order. :func:`finish` runs a Finished. Neither prints: every
line goes to a :class:`Report` the caller gives (``bcd join`` prints them).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import trio
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import wire
from bcd.attestor_api import JOIN_TOKEN
from bcd.bootstrap import (
    bootstrap_config,
    encryption_key_from_file,
    fetch_well_known,
    key_from_document,
    write_bootstrap,
)
from bcd.config import (
    Config,
    join_encryption_jwk_path,
    load_config,
    trusted_owners,
)
from bcd.credential import (
    Credential,
    read_stdin,
    read_stdin_if_any,
    read_token_file,
    remove_credential_files,
    shown,
    stdin_holds_data,
)
from bcd.errors import BcdError, CredentialError, JoinError, UsageError
from bcd.hardware import read_claims
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
from bcd.join import Joined, join
from bcd.keys.file import generate_file_key, key_to_pem
from bcd.keys.node import FileKey, NodeKey, new_root_tpm_key
from bcd.plugins import Plugins, load_plugins
from bcd.tpm.record import NodeKeyRecord

if TYPE_CHECKING:
    from bcd.rejoin import Rejoin

TPM_ATTESTOR = "tpm"
X509POP = "x509pop"  # bcd.rejoin.X509POP, imported only for such a re-join


@dataclass(frozen=True, slots=True)
class JoinOptions:
    """What ``bcd join``'s command line asked (flags as given, nothing looked up)."""

    config: Path
    attestor: str = JOIN_TOKEN
    role: str = "node"
    node_id: str | None = None
    reset: bool = False
    yes: bool = False
    server: str | None = None
    serving_ca_pin: str | None = None
    join_signing_pin: str | None = None
    join_encryption_pin: str | None = None
    data_dir: Path | None = None
    sysfs_root: Path = Path("/")
    token_file: Path | None = None


@dataclass(frozen=True, slots=True)
class Report:
    """Where bcd join's lines go: ``say`` what happened, ``warn`` what to look at."""

    say: Callable[[str], None]
    warn: Callable[[str], None]


@dataclass(frozen=True, slots=True)
class JoinPlan:
    """A join decided: everything :func:`run_plan` needs, nothing left to look up."""

    cfg: Config
    plugins: Plugins
    attestor: str
    role: str
    node_id: str | None
    credential: Credential | None
    encryption_key: ec.EllipticCurvePublicKey | None
    claims: wire.Claims
    key: NodeKey
    key_bytes: bytes = field(repr=False)
    rejoin: Rejoin | None = None
    moves: tuple[tuple[Path, Path], ...] = ()
    """``--reset --yes``: moved aside once the new identity is in hand."""
    owner: tuple[int, int] | None = None
    """Under ``[helper]``: the uid and gid identity.json and node.key are handed to."""
    bootstrap: bool = False
    """Write config.toml and join-encryption.jwk once joined (``--server``, no config)."""


@dataclass(frozen=True, slots=True)
class Finished:
    """Nothing to join: the moves to make (``--reset --yes`` alone), lines, exit code."""

    code: int
    lines: tuple[str, ...] = ()
    moves: tuple[tuple[Path, Path], ...] = ()


def _now() -> datetime:
    return datetime.now(UTC)


# --- the credential --------------------------------------------------------------------


def check_credential_sources(opts: JoinOptions, stdin: BinaryIO | None) -> None:
    """A usage error (exit 2) for two credential sources, never a silent choice.

    ``--token-file`` with an attestor that reads no token; a token on standard input
    as well as ``--token-file``; a token on standard input for an attestor that reads
    none. Standard input is only looked at when it is not a terminal, and never waited
    on (:func:`bcd.credential.stdin_holds_data`).
    """
    attestor = shown(opts.attestor)
    if opts.token_file and opts.attestor != JOIN_TOKEN:
        raise UsageError(
            f"--token-file gives a join token, and --attestor {attestor} reads none; "
            "drop --token-file, or join with a token (the default attestor)"
        )
    if (opts.token_file or opts.attestor != JOIN_TOKEN) and (
        stdin is not None and stdin_holds_data(stdin)
    ):
        if opts.token_file:
            raise UsageError(
                "a join credential came both on standard input and with --token-file; "
                "give it one way only (neither was used)"
            )
        raise UsageError(
            f"--attestor {attestor} reads no join token, but standard input holds "
            "something; give none (it was not used)"
        )


def _read_credential(
    opts: JoinOptions, stdin: BinaryIO | None, *, optional: bool = False
) -> Credential | None:
    """The join credential, checked to be a join token before anything else is done.

    None for an attestor that reads none and, with ``optional``, when standard input
    (without ``--token-file``) is a terminal or empty.
    """
    if opts.attestor != JOIN_TOKEN:
        return None
    if opts.token_file:
        credential = read_token_file(opts.token_file)
    elif optional:
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


# --- the node key ----------------------------------------------------------------------


def _derive_in_tpm(cfg: Config) -> Callable[[NodeKeyRecord], ec.EllipticCurvePublicKey]:
    """LoadState's ``derive`` for a TPM-held node key: bcd join (root) opens the TPM."""

    def derive(record: NodeKeyRecord) -> ec.EllipticCurvePublicKey:
        from bcd.tpm.device import open_tpm
        from bcd.tpm.nodekey import derive_node_key

        with open_tpm(cfg.tpm.tcti) as tpm:
            return derive_node_key(tpm, record)

    return derive


def _node_key(cfg: Config, attestor: str) -> tuple[NodeKey, bytes]:
    """Join step 1: the node key and what node.key will hold.

    A tpm join makes it in the TPM (:func:`bcd.keys.node.new_root_tpm_key`: a record
    pinned to the key, and the CSR). Otherwise ``[tpm] mode`` decides: ``off`` a file
    key; ``required`` a key in the TPM at ``[tpm] tcti``, or a JoinError before
    anything is sent; ``auto`` a key in the TPM when one is usable there AND
    ``[helper]`` is configured, else a file key. ``bcd node`` uses a TPM-held key only
    through ``bcd helper`` (it never opens the TPM), so without ``[helper]`` a TPM key
    would make a node that cannot run: ``auto`` then keeps a file key.
    """
    if attestor == TPM_ATTESTOR:
        held = new_root_tpm_key(cfg.tpm.tcti)
        return held, held.stored()
    mode, tcti = cfg.tpm.mode, cfg.tpm.tcti
    if mode == "required" or (mode == "auto" and cfg.helper is not None):
        from bcd.tpm import TpmError
        from bcd.tpm.device import missing_device

        why = missing_device(tcti)
        if why is None:
            try:
                held = new_root_tpm_key(tcti)
            except TpmError as exc:
                why = str(exc)
            else:
                return held, held.stored()
        if mode == "required":
            raise JoinError(
                f"[tpm] mode = required, but the TPM cannot be used ({why}); nothing was sent. "
                f"Make the TPM at {tcti} usable, or set [tpm] mode = auto or off in {cfg.path}"
            )
    key = generate_file_key()
    return FileKey(key), key_to_pem(key)


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


# --- the plan --------------------------------------------------------------------------


def _plugins(attestor: str, report: Report) -> Plugins:
    plugins = load_plugins()
    for failure in plugins.failures:
        report.warn(f"warning: attestor plugin {failure.name} did not load: {failure.error}")
    if attestor not in plugins.names():
        raise JoinError(f"no attestor plugin named {shown(repr(attestor))} is loaded")
    return plugins


def _config(opts: JoinOptions) -> tuple[Config, dict[str, Any] | None]:
    """The configuration, and the well-known document when the bootstrap built it."""
    if not opts.config.exists() and opts.server:
        doc = trio.run(fetch_well_known, opts.server)
        pins = {
            "serving_ca_spki_pin": opts.serving_ca_pin,
            "join_signing_key_pin": opts.join_signing_pin,
            "join_encryption_key_pin": opts.join_encryption_pin,
        }
        cfg = bootstrap_config(
            doc, server=opts.server, config=opts.config, pins=pins, data_dir=opts.data_dir
        )
        return cfg, doc
    cfg = load_config(opts.config, check_attestors=True)
    if opts.data_dir:
        cfg = replace(cfg, data_dir=opts.data_dir.absolute())
    return cfg, None


def _encryption_key(
    opts: JoinOptions, cfg: Config, doc: dict[str, Any] | None
) -> ec.EllipticCurvePublicKey | None:
    """The key the token is sealed to: join-encryption.jwk, else the document's."""
    if opts.attestor == JOIN_TOKEN:
        key = encryption_key_from_file(cfg) if doc is None else None
        if key is not None:
            return key
        if not opts.server:
            raise JoinError(
                f"{join_encryption_jwk_path(cfg)} is missing; give the control plane's URL "
                "with --server to fetch the join key from its well-known document"
            )
        doc = doc or trio.run(fetch_well_known, opts.server)
        return key_from_document(doc, cfg.join_encryption_key_pin, opts.server)
    if doc is not None and opts.server:
        # No token to seal, but the bootstrap writes join-encryption.jwk beside the new
        # config.toml (a later token join needs it): checked against its pin before
        # anything is sent, like the rest of the document.
        return key_from_document(doc, cfg.join_encryption_key_pin, opts.server)
    return None


def plan_join(opts: JoinOptions, stdin: BinaryIO | None, report: Report) -> JoinPlan | Finished:
    """Decide the join ``opts`` asks for, refusing what cannot be done before anything is
    sent; or what to do instead when there is nothing to join."""
    check_credential_sources(opts, stdin)
    if os.geteuid() != 0:
        raise BcdError("bcd join must run as root (it writes the node's identity)")
    plugins = _plugins(opts.attestor, report)
    cfg, doc = _config(opts)
    owners = trusted_owners(cfg)
    check_data_dir(cfg.data_dir, owners)  # a directory others can write is never used
    if opts.attestor == TPM_ATTESTOR and cfg.tpm.mode == "off":
        raise JoinError("--attestor tpm needs the TPM, but the configuration says [tpm] mode = off")

    rejoin = None
    if opts.attestor == X509POP:  # re-join the identity held here
        from bcd.rejoin import prepare

        rejoin = prepare(
            cfg, _derive_in_tpm(cfg), reset=opts.reset, node_id=opts.node_id, now=_now()
        )
    moves: tuple[tuple[Path, Path], ...] = ()
    credential: Credential | None = None
    if opts.reset:  # never with x509pop: prepare() refused that combination
        moves = tuple(reset_plan(cfg.data_dir, _now()))
        nothing = () if moves else (f"nothing to move in {cfg.data_dir}",)
        if not opts.yes:
            return Finished(
                2,
                (
                    *(f"would move {src} -> {dst}" for src, dst in moves),
                    *nothing,
                    "nothing was moved; run again with --reset --yes to move the identity aside",
                ),
            )
        credential = _read_credential(opts, stdin, optional=True)
        if credential is None and opts.attestor == JOIN_TOKEN:
            # The first step of "bcd join --reset --yes, then bcd join": no credential,
            # so only the move aside, and the way on.
            return Finished(
                0,
                (
                    *nothing,
                    "no join credential was given, so nothing was joined; join now as root: "
                    "bcd join < join-token (or --token-file PATH, or --attestor tpm)",
                ),
                moves,
            )
    elif rejoin is None:
        state = load_state(cfg.data_dir, _derive_in_tpm(cfg), owners=owners)
        if state is not None:
            ident = state.identity
            if opts.node_id and opts.node_id != ident.node_id:
                raise JoinError(
                    f"this machine is already joined as {ident.node_id}; --node-id names another "
                    "node (to join again: bcd join --reset --yes, then bcd join)"
                )
            return Finished(
                0, (f"already joined as {ident.node_id} (site {ident.site_id}, role {ident.role})",)
            )
    if credential is None:
        credential = _read_credential(opts, stdin)  # read and checked before any key is made

    owner = _helper_owner(cfg)
    key, key_bytes = _node_key(cfg, opts.attestor)
    return JoinPlan(
        cfg=cfg,
        plugins=plugins,
        attestor=opts.attestor,
        role=opts.role if rejoin is None else rejoin.role,
        node_id=opts.node_id,
        credential=credential,
        encryption_key=_encryption_key(opts, cfg, doc),
        claims=read_claims(opts.sysfs_root),
        key=key,
        key_bytes=key_bytes,
        rejoin=rejoin,
        moves=moves,
        owner=owner,
        bootstrap=doc is not None,
    )


# --- running it ------------------------------------------------------------------------


def _moved(report: Report) -> Callable[[Path, Path], None]:
    return lambda src, dst: report.say(f"moved {src} -> {dst}")


def finish(done: Finished, report: Report) -> int:
    """Run a :class:`Finished`: its moves (each reported once done), then its lines."""
    if done.moves:
        apply_reset(list(done.moves), _moved(report))
    for line in done.lines:
        report.say(line)
    return done.code


async def run_plan(plan: JoinPlan, report: Report) -> Joined:
    """The join, then what it leaves on disk; return the verified join."""
    cfg = plan.cfg
    rejoin = plan.rejoin
    joined = await join(
        cfg,
        plan.plugins,
        attestor=plan.attestor,
        role=plan.role,
        credential=plan.credential.text if plan.credential else None,
        encryption_key=plan.encryption_key,
        claims=plan.claims,
        key=plan.key,
        node_id=plan.node_id,
        identity_chain_der=rejoin.chain_der if rejoin else (),
        identity_signer=rejoin.signer if rejoin else None,
        say=report.say,
    )
    ident = joined.identity
    if cfg.helper is not None:
        # Join step 5, root's record, before the identity: a failed record fails the
        # join and leaves no identity (and, after --reset --yes, the old one in place).
        write_join_record(cfg.helper.hostconfig_dir, joined.signed)
    # The old identity moves aside only once the new one is in hand: a refused or
    # failed join after --reset --yes leaves the machine as it was.
    if rejoin is not None:  # crash safe: the old identity loads until the new one is whole
        persist_rejoin(cfg.data_dir, ident, plan.key_bytes)
    else:
        apply_reset(list(plan.moves), _moved(report))  # each move reported once it is done
        persist_join(cfg.data_dir, ident, plan.key_bytes, _now())
    if plan.owner is not None:
        hand_over(cfg.data_dir, *plan.owner)  # join step 7: lchown, never through a link
    if plan.bootstrap:
        assert plan.encryption_key is not None
        write_bootstrap(cfg, ident.site_id, plan.encryption_key)
    if plan.credential is not None:
        for warning in remove_credential_files(plan.credential):
            report.warn(warning)
    return joined

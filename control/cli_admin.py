"""``better-compute`` commands run on the control plane's host: the PKI, ``serve``,
``migrate``, ``backup`` and the first tenant."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bcd import fs
from control.cli_common import _db_url, _emit, _home, _now, _secret, secret_configured
from control.errors import ControlError

# --- pki ------------------------------------------------------------------------------


def cmd_pki_init(args: argparse.Namespace) -> int:
    from control import pki

    secret = _secret(args)
    directory = _home(args) / "pki"
    try:
        pki.init_pki(directory, args.trust_domain, secret, _now())
        loaded = pki.load_pki(directory, secret)
    except pki.PkiSetupError as exc:
        raise ControlError(
            "ALREADY_EXISTS" if "already" in str(exc) else "INVALID_ARGUMENT", str(exc)
        ) from exc
    pins = loaded.pins()
    text = "\n".join([f"PKI for {args.trust_domain} written to {directory}"]
                     + [f'{name} = "{pin}"' for name, pin in pins.items()])  # fmt: skip
    _emit(args, {"trustDomain": args.trust_domain, "directory": str(directory), "pins": pins}, text)
    return 0


def cmd_pki_issue_gateway(args: argparse.Namespace) -> int:
    from control import pki

    secret = _secret(args)
    directory = _home(args) / "pki"
    try:
        loaded = pki.load_pki(directory, secret)
        if args.out:
            from control import gatewaypki

            meta = gatewaypki.issue_bundle(loaded, Path(args.out), args.san, _now())
            _emit(args, {"san": args.san, "bundle": str(meta.parent)},
                  f"gateway bundle for {args.san} written to {meta.parent}")  # fmt: skip
            return 0
        cert, _key = pki.issue_gateway(loaded, directory, args.san, secret, _now())
    except (pki.PkiSetupError, ValueError) as exc:
        raise ControlError("INVALID_ARGUMENT", str(exc)) from exc
    _emit(args, {"san": args.san, "certificate": str(cert)},
          f"gateway certificate for {args.san} written to {cert}")  # fmt: skip
    return 0


def cmd_pki_pins(args: argparse.Namespace) -> int:
    from control import pki

    directory = _home(args) / "pki"
    try:
        found = pki.public_pins(directory)  # public values: no secret needed
        pins = found if found is not None else pki.load_pki(directory, _secret(args)).pins()
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    if args.json:
        print(json.dumps(pins, indent=2))
    else:
        for name, pin in pins.items():
            print(f'{name} = "{pin}"')
    return 0


def cmd_pki_rotate_join_key(args: argparse.Namespace) -> int:
    from control import pki

    secret = _secret(args)
    directory = _home(args) / "pki"
    try:
        retired = pki.rotate_join_encryption_key(directory, secret, _now())
        loaded = pki.load_pki(directory, secret)
    except pki.PkiSetupError as exc:
        raise ControlError("INVALID_CONFIG", str(exc)) from exc
    pin = loaded.pins()["join_encryption_key_pin"]
    text = (
        f"a new join encryption key is in {directory}; the old one is kept as {retired.name}\n"
        f'join_encryption_key_pin = "{pin}"\n'
        "restart better-compute serve to use it, then generate every install script again "
        "(better-compute daemon install-script): old scripts and join-encryption.jwk files no "
        "longer match; joined nodes are not affected"
    )
    _emit(args, {"directory": str(directory), "retired": retired.name,
                 "join_encryption_key_pin": pin}, text)  # fmt: skip
    return 0


# --- serve and bootstrap ----------------------------------------------------------------


_ROLE_FLAGS = {
    "api": ("relay_listen", "relay_san", "relay_max_per_source"),
    "gateway": ("gateway_dir", "api_upstream"),
    "api/all": (
        "downloads", "tpm_ek_ca", "tpm_ek_allow", "tpm_pool", "x509pop_ca", "discovery_pool",
        "attestor_setting", "gateway_url",
    ),
}  # fmt: skip


def _check_role_flags(args: argparse.Namespace) -> None:
    """A flag of another role is a usage error, never silently ignored."""
    for roles, flags in _ROLE_FLAGS.items():
        if args.role in roles.split("/"):
            continue
        for flag in flags:
            if getattr(args, flag, None):
                name = "--" + flag.replace("_", "-")
                print(
                    f"better-compute: usage: {name} is for --role {roles.replace('/', ' or ')}",
                    file=sys.stderr,
                )
                raise SystemExit(2)


def cmd_serve(args: argparse.Namespace) -> int:
    from control import server

    _check_role_flags(args)
    if args.role == "gateway":
        named = secret_configured(args)
        if named == "BETTER_COMPUTE_SECRET":
            raise ControlError(
                "INVALID_CONFIG",
                "a gateway holds no PKI key: unset BETTER_COMPUTE_SECRET in its environment",
            )
        if named is not None:
            raise ControlError(
                "INVALID_CONFIG", f"a gateway holds no PKI key: give it no secret ({named})"
            )
        if not args.db and not os.environ.get("BETTER_COMPUTE_DB"):
            raise ControlError(
                "INVALID_ARGUMENT", "--role gateway needs --db postgresql://… (its read-only role)"
            )
        if not args.api_upstream:
            raise ControlError("INVALID_ARGUMENT", "--role gateway needs --api-upstream URL")
    return server.main(
        home=_home(args),
        db_url=_db_url(args),
        api_listen=args.api_listen,
        gateway_listen=args.gateway_listen,
        gateway_san=args.gateway_san,
        gateway_url=args.gateway_url,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        secret=None if args.role == "gateway" else _secret(args),
        cert_ttl_s=args.cert_ttl_seconds,
        attestor_settings=_attestor_settings(args),
        downloads=Path(args.downloads) if args.downloads else None,
        role=args.role,
        relay_listen=args.relay_listen,
        relay_san=args.relay_san,
        gateway_dir=Path(args.gateway_dir) if args.gateway_dir else None,
        api_upstreams=args.api_upstream or (),
        drain_s=args.drain_seconds,
        session_ping_s=args.session_ping_seconds,
        metrics_listen=args.metrics_listen,
        log_level=args.log_level,
        log_format=args.log_format,
        relay_max_per_source=args.relay_max_per_source or server.RELAY_MAX_PER_SOURCE,
        ipv6_source_prefix=args.ipv6_source_prefix or server.IPV6_SOURCE_PREFIX,
    )


def _attestor_settings(args: argparse.Namespace) -> dict[str, str]:
    """``--attestor-setting NAME=VALUE`` (repeatable) and the tpm attestor's named flags."""
    settings: dict[str, str] = {}
    for item in args.attestor_setting or []:
        name, sep, value = item.partition("=")
        if not sep or "." not in name or not name.split(".", 1)[1]:
            raise ControlError(
                "INVALID_ARGUMENT", f"--attestor-setting {name!r}: expected ATTESTOR.KEY=VALUE"
            )
        settings[name] = value
    for flag, name in (
        ("tpm_ek_ca", "tpm.ek_ca"),
        ("tpm_ek_allow", "tpm.ek_allow"),
        ("tpm_pool", "tpm.pool"),
        ("discovery_pool", "discovery.pool"),
        ("x509pop_ca", "x509pop.ca"),
    ):
        value = getattr(args, flag, None)
        if value:
            is_file = flag in ("tpm_ek_ca", "tpm_ek_allow", "x509pop_ca")
            settings[name] = str(Path(value).absolute()) if is_file else value
    return settings


def cmd_migrate(args: argparse.Namespace) -> int:
    from control.store import open_store, reach

    url = _db_url(args)
    reach.probe(url)
    store = open_store(url)
    try:
        applied = store.migrate()
    finally:
        store.close()
    _emit(args, {"applied": applied}, f"applied migrations: {applied or 'none'}")
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    """An online copy of a SQLite store with SQLite's backup API (``serve`` may run):
    a consistent snapshot written to a new 0600 file, checked, then linked into place
    (never over an existing file). PostgreSQL is backed up with ``pg_dump``."""
    from control.cli_common import usage_error

    url = _db_url(args)
    if not url.startswith("sqlite:///"):
        usage_error(
            "backup copies a SQLite store; back up PostgreSQL with pg_dump "
            "(docs/operators.md, Backup and restore)"
        )
    source = Path(url[len("sqlite:///") :])
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        raise ControlError("ALREADY_EXISTS", f"{out} exists; --out never writes over a file")
    if not source.is_file():
        raise ControlError("NOT_FOUND", f"no database at {source} (name it with --db)")
    size = sqlite_backup(source, out)
    _emit(
        args,
        {"database": str(source), "out": str(out), "bytes": size},
        f"backed up {source} to {out} ({size} bytes, mode 0600)",
    )
    return 0


def sqlite_backup(source: Path, out: Path) -> int:
    """Copy the SQLite database ``source`` to the new file ``out`` (0600); its size.

    The copy is made under a temporary name beside ``out`` with
    :meth:`sqlite3.Connection.backup` (pages copied in one read transaction, so a
    running ``serve`` keeps writing), switched to a rollback journal so it is one
    self-contained file, checked with ``PRAGMA quick_check``, fsynced and linked to
    ``out`` (which fails if the name was taken meanwhile). The temporary file lives in
    a private (0700) directory made beside ``out``, so no other writer of ``out``'s
    directory can swap a symlink in while SQLite and chmod open it by name."""
    import contextlib
    import shutil
    import sqlite3
    import tempfile

    private = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp = private / "copy.db"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        try:
            src = sqlite3.connect(source.resolve().as_uri() + "?mode=ro", uri=True, timeout=30)
            try:
                dst = sqlite3.connect(tmp)
                try:
                    src.backup(dst)
                    dst.execute("PRAGMA journal_mode=DELETE").fetchone()
                    check = dst.execute("PRAGMA quick_check").fetchall()
                finally:
                    dst.close()
            finally:
                src.close()
        except sqlite3.Error as exc:
            raise ControlError("UNAVAILABLE", f"cannot back up {source}: {exc}") from None
        if [tuple(r) for r in check] != [("ok",)]:
            raise ControlError("INVALID_STATE", f"the copy of {source} does not check ok")
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o600)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, out)
        except FileExistsError:
            raise ControlError(
                "ALREADY_EXISTS", f"{out} exists; --out never writes over a file"
            ) from None
        fs.fsync_dir(out.parent)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(private)
    return out.stat().st_size


def cmd_tenants_create(args: argparse.Namespace) -> int:
    from control import tenancy
    from control.store import open_store, reach

    out = Path(args.credential_out)
    if out.exists() or out.is_symlink():
        raise ControlError(
            "ALREADY_EXISTS", f"{out} exists; --credential-out never writes over a file"
        )
    _home(args).mkdir(parents=True, exist_ok=True, mode=0o700)
    url = _db_url(args)
    reach.probe(url)
    store = open_store(url)
    written = False
    try:
        store.migrate()
        with store.tx() as tx:
            tenant_id, credential = tenancy.create_tenant(tx, args.name, root=args.root)
            try:
                fs.create_new(out, (credential + "\n").encode("ascii"), 0o600)
            except FileExistsError as exc:
                raise ControlError("ALREADY_EXISTS", f"{out} exists") from exc
            written = True
    except BaseException:
        if written:  # the tenant was not created: its credential must not linger
            fs.remove(out)
        raise
    finally:
        store.close()
    _emit(args, {"id": tenant_id, "name": args.name, "root": args.root}, f"tenant {tenant_id}")
    return 0

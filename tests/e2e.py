"""Real processes on loopback: a `better-compute serve` and `bcd join` runs.

The control plane's PKI is made once per test session with the real CLI and copied
into each control plane's home; every control plane has its own database.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from control import tenancy
from control.client import ApiClient
from control.store import Store, open_store
from tests.fakesys import random_machine

BIN = Path(sys.executable).parent
SECRET = "e2e-secret-0123456789abcdef"
TRUST_DOMAIN = "td.example"


def cli_env(home: Path, *, secret: bool = True) -> dict[str, str]:
    """A child's environment; only control-plane commands that decrypt the PKI get the secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BETTER_COMPUTE_", "BCD_"))}
    if secret:
        env["BETTER_COMPUTE_SECRET"] = SECRET
    env["BETTER_COMPUTE_HOME"] = str(home)
    return env


def run(
    args: Sequence[str],
    *,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args),
        input=input.decode() if input is not None else None,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def make_pki(home: Path) -> None:
    env = cli_env(home)
    for args in (
        ["pki", "init", "--trust-domain", TRUST_DOMAIN],
        ["pki", "issue-gateway", "--san", "127.0.0.1"],
    ):
        done = run([str(BIN / "better-compute"), *args], env=env)
        assert done.returncode == 0, done.stderr


SERVE_WRAPPER: list[str] = []
"""A command every ``serve`` is started under (``bench/fleet.py --instructions`` sets
valgrind's callgrind here); empty for the tests."""
SERVE_READY_S = 20.0
"""How long a ``serve`` may take to write its ready file (longer under valgrind)."""


def start_serve(
    home: Path, args: Sequence[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``better-compute serve ARGS`` with its log in ``home/serve.log``, once it wrote
    its ready file (the bound addresses, returned)."""
    ready = home / "ready.json"
    log = open(home / "serve.log", "wb")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [*SERVE_WRAPPER, str(BIN / "better-compute"), "serve", *args, "--ready-file", str(ready)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + SERVE_READY_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("serve did not start: " + (home / "serve.log").read_text())
        time.sleep(0.02)
    info: dict[str, Any] = json.loads(ready.read_text())
    return proc, info


@dataclass
class ControlPlane:
    home: Path
    db_url: str
    proc: subprocess.Popen[bytes]
    api: str
    gateway_port: int
    root_tenant: str
    root_credential_file: Path
    store: Store
    ready: dict[str, Any]
    """The ready file's document: the role and every bound listener."""

    @classmethod
    def start(
        cls,
        home: Path,
        pki_template: Path,
        db_url: str,
        gateway_url: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> ControlPlane:
        shutil.copytree(pki_template / "pki", home / "pki")
        store = open_store(db_url)
        store.migrate()
        with store.tx() as tx:
            root = tenancy.root_tenant(tx)
            if root is None:
                root, credential = tenancy.create_tenant(tx, "platform", root=True)
            else:
                credential = tenancy.create_credential(tx, root)
        cred_file = home / "root.credential"
        cred_file.write_text(credential + "\n")
        cred_file.chmod(0o600)
        port = None
        if gateway_url is not None:
            import socket

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        proc, info = start_serve(
            home,
            [
                "--db",
                db_url,
                "--api-listen",
                "127.0.0.1:0",
                "--gateway-listen",
                f"127.0.0.1:{port or 0}",
                "--gateway-san",
                "127.0.0.1",
                *(["--gateway-url", gateway_url.format(port=port)] if gateway_url else []),
                *extra_args,
            ],
            cli_env(home),
        )
        return cls(
            home, db_url, proc, info["api"], info.get("gateway_port", 0), root, cred_file, store,
            info,
        )  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.store.close()

    def client(self, credential_file: Path | None = None) -> ApiClient:
        cred = (credential_file or self.root_credential_file).read_text().strip()
        return ApiClient(self.api + "/api/compute", cred)

    def cli(
        self, *args: str, credential_file: Path | None = None, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        cred = credential_file or self.root_credential_file
        return run(
            [str(BIN / "better-compute"), *args, "--api", self.api, "--credential-file", str(cred)],
            env=cli_env(self.home),
            input=input,
        )

    def tenant(self, name: str) -> tuple[str, Path]:
        with self.store.tx() as tx:
            tenant_id, credential = tenancy.create_tenant(tx, name)
        path = self.home / f"{tenant_id}.credential"
        path.write_text(credential + "\n")
        path.chmod(0o600)
        return tenant_id, path

    def site_and_pool(
        self,
        tenant: str | None = None,
        cred: Path | None = None,
        policy: dict[str, Any] | None = None,
    ) -> tuple[str, str]:
        tenant = tenant or self.root_tenant
        api = self.client(cred)
        site = api.call("POST", f"/v1/tenants/{tenant}/sites", {"name": "rack-b7"})
        pool = api.call(
            "POST",
            f"/v1/tenants/{tenant}/pools",
            {"siteId": site["id"], "name": "gpu", "agent": "bcd", "policy": policy or {}},
        )
        return site["id"], pool["id"]

    def token(
        self, pool: str, tenant: str | None = None, cred: Path | None = None, **fields: Any
    ) -> dict[str, Any]:
        tenant = tenant or self.root_tenant
        body = {"ttlSeconds": 3600, **fields}
        return self.client(cred).call(
            "POST", f"/v1/tenants/{tenant}/pools/{pool}/join-tokens", body
        )

    def pins(self) -> dict[str, str]:
        done = run([str(BIN / "better-compute"), "pki", "pins", "--json"], env=cli_env(self.home))
        assert done.returncode == 0, done.stderr
        pins: dict[str, str] = json.loads(done.stdout)
        return pins

    def well_known(self) -> dict[str, Any]:
        return ApiClient(self.api + "/api/compute", None).call("GET", "/.well-known/better-compute")

    def events(self, tenant: str | None = None, type_: str | None = None) -> list[dict[str, Any]]:
        with self.store.tx() as tx:
            sql = "SELECT type, payload FROM events WHERE tenant_id = ?"
            params: list[Any] = [tenant or self.root_tenant]
            if type_:
                sql += " AND type = ?"
                params.append(type_)
            rows = tx.query(sql + " ORDER BY created_at, id", params)
        return [{"type": r["type"], **json.loads(r["payload"])} for r in rows]

    def one(self, sql: str, params: Sequence[Any] = ()) -> dict[str, Any] | None:
        with self.store.tx() as tx:
            return tx.one(sql, params)


def helper_table(user: str, socket: Path, hostconfig_dir: Path) -> str:
    """A ``[helper]`` table for config.toml: ``bcd helper``'s user, socket, root's record."""
    return f'[helper]\nuser = "{user}"\nsocket = "{socket}"\nhostconfig_dir = "{hostconfig_dir}"\n'


def root_site_store(
    tmp_path: Path, site_name: str, *pools: tuple[str, dict[str, Any]]
) -> tuple[str, str, list[str]]:
    """A SQLite store under ``tmp_path`` with a root tenant, one site of it and ``pools``
    (name, policy) there, made before ``serve`` starts (its flags name a pool).

    Returns the database URL, the site id and the pool ids.
    """
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = open_store(db_url)
    store.migrate()
    with store.tx() as tx:
        root, _ = tenancy.create_tenant(tx, "platform", root=True)
        site = str(tenancy.create_site(tx, root, site_name)["id"])
        ids = [
            str(tenancy.create_pool(tx, root, site, name, "bcd", policy)["id"])
            for name, policy in pools
        ]
    store.close()
    return db_url, site, ids


def start_in(
    tmp_path: Path,
    pki_template: Path,
    db_url: str,
    extra_args: Sequence[str],
    gateway_url: str | None = None,
) -> ControlPlane:
    """``ControlPlane.start`` with its home at ``tmp_path/cp``."""
    home = tmp_path / "cp"
    home.mkdir()
    return ControlPlane.start(
        home, pki_template, db_url, gateway_url=gateway_url, extra_args=extra_args
    )


def random_pins() -> dict[str, str]:
    """The three pins of config.toml, each of a fresh key (for a node that dials nobody)."""
    from bcd import pki

    names = ("serving_ca_spki_pin", "join_signing_key_pin", "join_encryption_key_pin")
    return {name: pki.spki_pin(pki.generate_key().public_key()) for name in names}


def write_node_config(
    path: Path,
    *,
    gateway_url: str,
    site: str,
    pins: Mapping[str, str],
    data_dir: Path,
    extra: str = "",
) -> Path:
    """A node's config.toml: the gateway, the site, the pins, the data dir, then ``extra``
    (TOML tables). Every node of the tests gets its config from here."""
    path.write_text(
        f'gateway_url = "{gateway_url}"\n'
        f'site = "{site}"\n'
        + "".join(f'{k} = "{v}"\n' for k, v in pins.items())
        + f'data_dir = "{data_dir}"\n'
        + extra
    )
    return path


@dataclass
class Node:
    root: Path
    config: Path
    data_dir: Path
    sysfs: Path

    @classmethod
    def make(
        cls,
        root: Path,
        cp: ControlPlane,
        site: str,
        *,
        seed: int = 1,
        write_jwk: bool = True,
        gateway_port: int | None = None,
        write_serving_ca: bool = True,
    ) -> Node:
        etc = root / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        data = root / "data"
        pins = cp.pins()
        config = write_node_config(
            etc / "config.toml",
            gateway_url=f"https://127.0.0.1:{gateway_port or cp.gateway_port}",
            site=site,
            pins=pins,
            data_dir=data,
        )
        if write_jwk:
            jwk = cp.well_known()["join"]["encryptionJwk"]
            (etc / "join-encryption.jwk").write_text(json.dumps(jwk))
        if write_serving_ca:  # as install-bcd.sh writes it (without it, bcd probes)
            serving_ca = (cp.home / "pki" / "serving-ca.crt").read_text()
            (etc / "serving-ca.pem").write_text(serving_ca)
        sysfs = random_machine(root / "sys", seed)
        return cls(root, config, data, sysfs)

    def bcd(
        self, *args: str, input: bytes | None = None, config: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(BIN / "bcd"), *args]
        if config:
            argv += ["--config", str(self.config)]
        return run(argv, input=input, env=cli_env(self.root, secret=False), timeout=timeout)

    def spawn_join(self, *extra: str) -> subprocess.Popen[str]:
        """``bcd join`` without a token, left running (it may wait on a join request)."""
        return subprocess.Popen(
            [
                str(BIN / "bcd"),
                "join",
                "--sysfs-root",
                str(self.sysfs),
                *extra,
                "--config",
                str(self.config),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(self.root, secret=False),
        )

    def join(
        self, token: str | None, *extra: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.bcd(
            "join",
            "--sysfs-root",
            str(self.sysfs),
            *extra,
            input=(token + "\n").encode() if token is not None else b"",
            timeout=timeout,
        )

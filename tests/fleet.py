"""The control plane as a fleet runs it, as real processes on loopback and PostgreSQL.

``Fleet.start`` makes a fresh PostgreSQL schema, runs API replicas (``serve --role
api``, holding the PKI) and gateways (``serve --role gateway``: a gateway bundle, no
secret, logged in to PostgreSQL as a member of the read-only role
``better_compute_gateway``). :class:`Forwarder` is a TCP relay the tests use as the
load balancer in front of the gateways (switch it to another gateway) and as a
network between a gateway and PostgreSQL (cut it).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

from tests.conftest import PG_OK, PG_URL
from tests.e2e import BIN, ControlPlane, cli_env, run, start_serve

GATEWAY_GROUP = "better_compute_gateway"


def pg_schema_url(schema: str, user: str | None = None) -> str:
    base = PG_URL
    if user is not None:
        parts = urlsplit(PG_URL)
        netloc = f"{user}@{parts.hostname}:{parts.port or 5432}"
        base = parts._replace(netloc=netloc).geturl()
    return f"{base}?options=-csearch_path%3D{schema}"


@contextlib.contextmanager
def pg_schema() -> Iterator[str]:
    """A new schema in the test database, dropped afterwards; yields its name."""
    assert PG_OK, f"PostgreSQL is not reachable at {PG_URL}"
    schema = f"f_{secrets.token_hex(6)}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def gateway_login(schema: str) -> str:
    """A LOGIN role in the gateway group (after migration); the URL a gateway uses."""
    user = f"gw_{secrets.token_hex(4)}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {user} LOGIN IN ROLE {GATEWAY_GROUP}")
    return pg_schema_url(schema, user)


def drop_login(url: str) -> None:
    user = urlsplit(url).username
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (user,)
        )
        conn.execute(f"DROP ROLE IF EXISTS {user}")


@dataclass
class Gateway:
    home: Path
    proc: subprocess.Popen[bytes]
    port: int
    ready: dict[str, object]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.home / "serve.log").read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)


def issue_bundle(cp_home: Path, out: Path) -> Path:
    done = run(
        [str(BIN / "better-compute"), "pki", "issue-gateway", "--san", "127.0.0.1", "--out",
         str(out)],
        env=cli_env(cp_home),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


def start_gateway(
    home: Path,
    bundle: Path,
    db_url: str,
    upstreams: Sequence[str],
    *,
    port: int = 0,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Gateway:
    home.mkdir(parents=True, exist_ok=True)
    proc, info = start_serve(
        home,
        [
            "--role", "gateway", "--db", db_url, "--gateway-listen", f"127.0.0.1:{port}",
            "--gateway-dir", str(bundle),
            *[arg for url in upstreams for arg in ("--api-upstream", url)],
            *extra,
        ],
        {**cli_env(home, secret=False), **(env or {})},
    )  # fmt: skip
    return Gateway(home, proc, int(info["gateway_port"]), info)


def start_api(
    home: Path, pki_template: Path, db_url: str, extra: Sequence[str] = ()
) -> ControlPlane:
    home.mkdir(parents=True, exist_ok=True)
    return ControlPlane.start(
        home,
        pki_template,
        db_url,
        extra_args=[
            "--role", "api", "--relay-listen", "127.0.0.1:0", "--relay-san", "127.0.0.1", *extra,
        ],
    )  # fmt: skip


def relay_url(api: ControlPlane) -> str:
    return str(api.ready["relay"])


def point_at(config: Path, port: int) -> None:
    """Rewrite a node's config.toml to dial the gateway on ``port``."""
    lines = config.read_text().splitlines()
    out = [
        f'gateway_url = "https://127.0.0.1:{port}"' if ln.startswith("gateway_url") else ln
        for ln in lines
    ]
    config.write_text("\n".join(out) + "\n")


@dataclass
class Fleet:
    """API replicas and gateways on one PostgreSQL schema."""

    root: Path
    schema: str
    apis: list[ControlPlane]
    gateways: list[Gateway]
    gateway_db_url: str
    bundle: Path
    forwarders: list[Forwarder] = field(default_factory=list)

    @property
    def api(self) -> ControlPlane:
        return self.apis[0]

    def add_gateway(
        self,
        name: str,
        upstreams: Sequence[str] | None = None,
        *,
        db_url: str | None = None,
        env: dict[str, str] | None = None,
        extra: Sequence[str] = (),
    ) -> Gateway:
        ups = list(upstreams) if upstreams is not None else [relay_url(a) for a in self.apis]
        gw = start_gateway(
            self.root / name, self.bundle, db_url or self.gateway_db_url, ups, env=env,
            extra=extra,
        )  # fmt: skip
        self.gateways.append(gw)
        return gw

    def stop(self) -> None:
        for gw in self.gateways:
            if gw.proc.poll() is None:
                gw.proc.kill()
                gw.proc.wait(10)
        for api in self.apis:
            api.stop()
        for fwd in self.forwarders:
            fwd.close()
        drop_login(self.gateway_db_url)


@contextlib.contextmanager
def fleet(root: Path, pki_template: Path, *, apis: int = 1, gateways: int = 2) -> Iterator[Fleet]:
    with pg_schema() as schema:
        url = pg_schema_url(schema)
        started: list[ControlPlane] = []
        f: Fleet | None = None
        try:
            for i in range(apis):
                started.append(start_api(root / f"api{i + 1}", pki_template, url))
            bundle = issue_bundle(started[0].home, root / "gateway-bundle")
            f = Fleet(root, schema, started, [], gateway_login(schema), bundle)
            for i in range(gateways):
                f.add_gateway(f"gw{i + 1}")
            yield f
        finally:
            if f is not None:
                f.stop()
            else:
                for api in started:
                    api.stop()


class Forwarder:
    """A TCP relay on 127.0.0.1 to a target port that can be switched or cut."""

    def __init__(self, target: int, *, delay_s: float = 0.0) -> None:
        self.target = target
        self.delay_s = delay_s
        self.cut = False
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def switch(self, target: int) -> None:
        self.target = target

    def sever(self) -> None:
        """Refuse new connections and reset every open one (a network that went away)."""
        self.cut = True
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def heal(self) -> None:
        self.cut = False

    def close(self) -> None:
        self._closed = True
        self.sever()
        self._sock.close()


def copy_pki(src: Path, dst: Path) -> None:
    shutil.copytree(src / "pki", dst / "pki")

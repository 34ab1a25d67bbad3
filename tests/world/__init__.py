"""The test world: the one place an end-to-end test gets a control plane, nodes and a TPM.

Every piece is real (processes on loopback, a SQLite file or a PostgreSQL schema, the
swtpm) and lives in its own module; this module composes them and holds the helpers
the end-to-end tests share, so no test module imports another.

- **control plane**: one ``better-compute serve`` process (:class:`ControlPlane`,
  ``tests/e2e.py``) on SQLite or PostgreSQL, or a fleet (:class:`Fleet`,
  ``tests/fleet.py``): API replicas and gateways on one PostgreSQL schema, with a
  :class:`Forwarder` as the load balancer or as a network that can be cut.
- **gateway variants**: the real gateway of either shape, or the hostile gateway
  (:class:`HostileGateway`, ``tests/adversarial/hostile.py``) that presents a real
  serving certificate and then follows a script.
- **nodes**: :class:`Node` (``config.toml`` written by :func:`write_node_config`, a
  data dir, a simulated machine; ``bcd`` run as a subprocess), :func:`tpm_node` for a
  node whose key lives in the swtpm, :class:`RunningNode` for ``bcd node`` left running,
  :func:`start_helper` for ``bcd helper``.
- **TPM**: :class:`SwTpm` (``tests/swtpm.py``): the session's (fixture ``swtpm``) or a
  test's own (``own_swtpm``, which a test may clear).
- **install sandbox**: ``tests/installsandbox.py`` runs ``install-bcd.sh`` as root in
  a mount namespace against a control plane of this world.

:class:`E2EWorld` (fixture ``e2e``) starts these under the test's ``tmp_path`` and
stops whatever it started at teardown. The fixtures ``control_plane`` (SQLite and
PostgreSQL), ``sqlite_control_plane``, ``own_swtpm`` and ``tpm_control_plane`` in
``tests/conftest.py`` hand out its pieces.

The in-process half: :mod:`tests.world.joins` (JoinService over the real store,
fixtures ``world`` and ``tw``), :mod:`tests.world.renewals` (RenewService, fixture
``env``) and :mod:`tests.world.agent` (a joined node's files, a gateway faked for the
renewal loop, ``bcd helper`` served in a task). ``docs/tests.md`` maps the seeds'
sections to the tests.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bcd import pki
from bcd.identity import LoadedState, load_state
from tests.adversarial.hostile import HostileGateway
from tests.certs import new_id
from tests.e2e import (
    BIN,
    SECRET,
    TRUST_DOMAIN,
    ControlPlane,
    Node,
    cli_env,
    helper_table,
    random_pins,
    root_site_store,
    run,
    write_node_config,
)
from tests.fleet import (
    PG_URL,
    Fleet,
    Forwarder,
    Gateway,
    drop_login,
    fleet,
    gateway_login,
    pg_schema,
    pg_schema_url,
    relay_url,
)
from tests.swtpm import SwTpm

__all__ = [
    "BIN",
    "JOINED",
    "PG_URL",
    "REFUSED_LINE",
    "SECRET",
    "TRUST_DOMAIN",
    "ControlPlane",
    "E2EWorld",
    "Fleet",
    "Forwarder",
    "Gateway",
    "HostileGateway",
    "Node",
    "RunningNode",
    "SwTpm",
    "cli_env",
    "closed_tcti",
    "drop_login",
    "fleet",
    "fleet_node",
    "gateway_login",
    "helper_table",
    "leaf",
    "loaded",
    "node_id",
    "offline_node_config",
    "other_ca_bundle",
    "pg_schema",
    "pg_schema_url",
    "post_join",
    "post_join_raw",
    "random_pins",
    "relay_url",
    "renew_body",
    "root_site_store",
    "run",
    "start_helper",
    "stop_process",
    "tpm_node",
    "wait_for",
    "with_table",
    "write_node_config",
]

JOINED = re.compile(
    r"^joined as (node_[0-9a-z]{26}) \(site (site_[0-9a-z]{26}), role node\); "
    r"certificate valid until \S+Z$"
)
"""The line ``bcd join`` prints on success."""
REFUSED_LINE = "bcd: the control plane refused the join (ACCESS_DENIED: Join refused)\n"
"""What ``bcd join`` says for every refusal (the seed's one answer)."""


# --- the world ----------------------------------------------------------------------


@dataclass
class E2EWorld:
    """What one test starts under ``tmp``, all stopped at its teardown."""

    tmp: Path
    pki_template: Path
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def close(self) -> None:
        self.stack.close()

    def control_plane(
        self,
        db_url: str | None = None,
        *,
        name: str = "cp",
        extra_args: Sequence[str] = (),
        gateway_url: str | None = None,
    ) -> ControlPlane:
        """``better-compute serve`` in ``tmp/name`` (default: a SQLite file in ``tmp``)."""
        home = self.tmp / name
        home.mkdir()
        cp = ControlPlane.start(
            home,
            self.pki_template,
            db_url or f"sqlite:///{self.tmp / 'store.db'}",
            gateway_url=gateway_url,
            extra_args=extra_args,
        )
        self.stack.callback(cp.stop)
        return cp

    def tpm_plane(self, ek_ca: Path, extra: Sequence[str] = ()) -> tuple[ControlPlane, str, str]:
        """A control plane trusting the EK CA bundle ``ek_ca`` for a tpm pool of a root
        site; returns it, the site and the pool."""
        db_url, site, (pool,) = root_site_store(self.tmp, "rack-t1", ("tpm", {}))
        cp = self.control_plane(
            db_url, extra_args=["--tpm-ek-ca", str(ek_ca), "--tpm-pool", pool, *extra]
        )
        return cp, site, pool

    def fleet(self, *, apis: int = 1, gateways: int = 2) -> Fleet:
        """API replicas and gateways on a fresh PostgreSQL schema."""
        return self.stack.enter_context(
            fleet(self.tmp, self.pki_template, apis=apis, gateways=gateways)
        )

    def swtpm(self, name: str = "swtpm") -> SwTpm:
        """A swtpm of this test's own (which it may clear)."""
        tpm = SwTpm.provision(self.tmp / name)
        tpm.start()
        self.stack.callback(tpm.stop)
        return tpm

    def node(self, cp: ControlPlane, site: str, name: str = "n", **kw: Any) -> Node:
        return Node.make(self.tmp / name, cp, site, **kw)


# --- nodes --------------------------------------------------------------------------


def with_table(node: Node, text: str) -> Node:
    """Append ``text`` (TOML tables) to the node's config.toml."""
    with node.config.open("a") as f:
        f.write(text)
    return node


def offline_node_config(directory: Path, data_dir: Path, extra: str = "") -> Path:
    """``directory/config.toml`` for a node whose gateway is never dialled: a gateway
    name, a fresh site id, three pins of fresh keys, ``data_dir``, then ``extra``."""
    return write_node_config(
        directory / "config.toml",
        gateway_url="https://gw.example.com",
        site=new_id("site"),
        pins=random_pins(),
        data_dir=data_dir,
        extra=extra,
    )


def tpm_node(root: Path, cp: ControlPlane, site: str, swtpm: SwTpm) -> Node:
    """A node that joins with ``--attestor tpm`` on ``swtpm`` (no join-encryption.jwk)."""
    return with_table(Node.make(root, cp, site, write_jwk=False), f'[tpm]\ntcti = "{swtpm.tcti}"\n')


def leaf(node: Node) -> pki.LeafInfo:
    """The node's current certificate, read from its identity.json."""
    ident = json.loads((node.data_dir / "identity.json").read_text())
    return pki.leaf_info(pki.load_pem_chain(ident["chain"])[0])


def node_id(node: Node) -> str:
    return str(json.loads((node.data_dir / "identity.json").read_text())["node_id"])


def loaded(node: Node) -> LoadedState:
    """The node's identity as ``bcd node`` loads it (a file key)."""
    state = load_state(node.data_dir)
    assert isinstance(state, LoadedState)
    return state


def renew_body(state: LoadedState) -> bytes:
    """A RenewRequest body for ``state`` with a fresh key, as ``bcd node`` sends it."""
    from bcd.renew import build_request

    _csr, req = build_request(state, pki.generate_key(), int(time.time() * 1000))
    return json.dumps(req.to_json()).encode()


def fleet_node(f: Fleet, root: Path, seed: int, site: str, pool: str, port: int) -> Node:
    """A node joined with a token through the gateway on ``port``."""
    node = Node.make(root, f.api, site, seed=seed, gateway_port=port)
    done = node.join(f.api.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    return node


class RunningNode:
    """``bcd node`` with its log in a file, so a test can read it while it runs."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.log_path = node.root / "node.log"
        self.proc = subprocess.Popen(
            [str(BIN / "bcd"), "node", "--config", str(node.config)],
            env=cli_env(node.root, secret=False),
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "wb"),  # noqa: SIM115 - the process owns it
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sessions(self) -> int:
        return self.log().count("session open (")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def start_helper(node: Node) -> subprocess.Popen[str]:
    """`bcd helper` as root (the tests run as root), serving the config's [helper] socket."""
    from bcd.config import load_config

    cfg = load_config(node.config)
    assert cfg.helper is not None
    proc = subprocess.Popen(
        [str(BIN / "bcd"), "helper", "--config", str(node.config)],
        env=cli_env(node.root, secret=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not cfg.helper.socket.exists():
        if proc.poll() is not None:
            raise AssertionError(f"bcd helper exited: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("bcd helper did not create its socket")
        time.sleep(0.05)
    return proc


def stop_process(proc: subprocess.Popen[str]) -> str:
    """SIGTERM (SIGKILL after 15 s); returns the process's stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    _out, err = proc.communicate()
    return err


# --- the TPM's surroundings ---------------------------------------------------------


def closed_tcti() -> str:
    """A swtpm TCTI at a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"swtpm:host=127.0.0.1,port={port}"


def other_ca_bundle(path: Path) -> Path:
    """A self-signed CA that signed no EK certificate, as a PEM bundle."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not the manufacturer")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


# --- waiting and raw requests ---------------------------------------------------------


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, *, step: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


async def post_join_raw(cp: ControlPlane, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` to the gateway's /v1/join over a pinned TLS connection."""
    from tests.gatewaycalls import node_post

    pin = cp.pins()["serving_ca_spki_pin"]
    resp = await node_post(cp.gateway_port, pin, None, "/v1/join", body)
    return resp.status, resp.body


async def post_join(cp: ControlPlane, body: bytes) -> tuple[int, dict[str, Any]]:
    """:func:`post_join_raw`, the answer parsed as JSON."""
    status, raw = await post_join_raw(cp, body)
    return status, json.loads(raw)

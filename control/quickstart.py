"""``make quickstart``: a control plane on SQLite on loopback and one node joined to it.

The node's whole life: it joins with a one-use token, ``bcd node`` opens its session
and renews its short-lived certificate by itself, and it stops the moment its
identity is revoked. Certificates live 20 s here (``serve --cert-ttl-seconds``) so a
renewal shows within seconds; production keeps 24 h.

Everything lives under ``./.quickstart/`` (ignored by git); each run starts it
afresh. Every step prints the command it runs, so the output doubles as a tour.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bcd import fs
from bcd.hardware import hardware_key, read_claims

BIN = Path(sys.executable).parent
ROOT = Path(".quickstart").absolute()
CERT_TTL_S = 20


def step(title: str) -> None:
    print(f"\n==> {title}", flush=True)


def run(*args: str, stdin: Path | None = None, env: dict[str, str] | None = None) -> str:
    shown = " ".join(shlex.quote(a) for a in args) + (f" < {stdin}" if stdin else "")
    print(f"$ {shown}", flush=True)
    with open(stdin, "rb") if stdin else open(os.devnull, "rb") as fin:
        done = subprocess.run(
            list(args), stdin=fin, capture_output=True, text=True, env=env, check=False
        )
    out = (done.stdout + done.stderr).rstrip()
    if out:
        print(out, flush=True)
    if done.returncode != 0:
        raise SystemExit(f"quickstart: step failed with exit code {done.returncode}")
    return done.stdout


def _run_node(bcd: str, config: Path, env: dict[str, str]) -> Callable[..., None]:
    """``bcd node`` in the background: its session, a renewal, then the revocation."""

    def go(bc: str, tenant: str, node_id: str, api: list[str]) -> None:
        step(f"bcd node: the session, and a renewal at 60 % of the {CERT_TTL_S} s certificate")
        print(f"$ {bcd} node --config {config} &", flush=True)
        agent = subprocess.Popen(
            [bcd, "node", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        lines: list[str] = []
        reader = threading.Thread(target=_collect, args=(agent, lines), daemon=True)
        reader.start()
        try:
            _wait_for(lines, "renewed: certificate", agent, CERT_TTL_S * 2)
            step("revoke the node's identity: bcd node stops at once")
            run(bc, "nodes", "revoke-identity", node_id, "--tenant", tenant, *api, env=env)
            code = agent.wait(30)
            reader.join(5)
            print(f"bcd node exited {code} (1: a person must act; systemd does not restart it)")
            if code != 1:
                raise SystemExit("quickstart: bcd node did not stop on the revocation")
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()

    return go


def _collect(agent: subprocess.Popen[str], lines: list[str]) -> None:
    assert agent.stdout is not None
    for line in agent.stdout:
        print(f"  bcd node | {line.rstrip()}", flush=True)
        lines.append(line)


def _wait_for(lines: list[str], text: str, agent: subprocess.Popen[str], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not any(text in line for line in lines):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"quickstart: bcd node did not log {text!r} in time")
        time.sleep(0.1)


def main() -> int:
    if os.geteuid() != 0:
        print("quickstart: bcd join runs as root; run make quickstart as root", file=sys.stderr)
        return 1
    if ROOT.exists():
        step(f"starting afresh: removing {ROOT}")
        shutil.rmtree(ROOT)
    home, node = ROOT / "control-plane", ROOT / "node"
    home.mkdir(parents=True, mode=0o700)
    (node / "etc").mkdir(parents=True)
    # The PKI secret is a new random one in a 0600 file that only the commands which
    # decrypt the PKI (pki init, pki issue-gateway, serve) name with --secret-file: it
    # never reaches a child's argv or environment.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BETTER_COMPUTE_SECRET", "BETTER_COMPUTE_HOME", "CREDENTIALS_DIRECTORY")
    }
    env["BETTER_COMPUTE_HOME"] = str(home)
    secret_file = home / "secret"
    fs.atomic_write(secret_file, secrets.token_urlsafe(32).encode() + b"\n", 0o600)
    secret = ("--secret-file", str(secret_file))
    bc = str(BIN / "better-compute")

    step("the machine PKI: CAs, JoinService keys, a gateway certificate")
    print(f"the PKI secret: a new random one in {secret_file} (0600)")
    run(bc, "pki", "init", "--trust-domain", "quickstart.example", *secret, env=env)
    run(bc, "pki", "issue-gateway", "--san", "127.0.0.1", *secret, env=env)
    pins = json.loads(run(bc, "pki", "pins", "--json", env=env))

    step("the root tenant and its API credential")
    cred = home / "root.credential"
    tenant = json.loads(
        run(
            bc,
            "tenants",
            "create",
            "--root",
            "--name",
            "platform",
            "--credential-out",
            str(cred),
            "--json",
            env=env,
        )
    )["id"]

    step("better-compute serve: the API and the gateway, on SQLite, on loopback")
    ready = home / "ready.json"
    log = open(home / "serve.log", "wb")  # noqa: SIM115 - closed in finally
    print(
        f"$ {bc} serve --secret-file {secret_file} --api-listen 127.0.0.1:0 "
        f"--gateway-listen 127.0.0.1:0 --cert-ttl-seconds {CERT_TTL_S} --ready-file {ready} &"
    )
    serve = subprocess.Popen(
        [
            bc,
            "serve",
            *secret,
            "--api-listen",
            "127.0.0.1:0",
            "--gateway-listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            "--cert-ttl-seconds",
            str(CERT_TTL_S),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                print((home / "serve.log").read_text(), file=sys.stderr)
                raise SystemExit("quickstart: the control plane did not start")
            time.sleep(0.05)
        addr = json.loads(ready.read_text())
        print(f"API {addr['api']}, gateway {addr['gateway']}")
        api = ["--api", addr["api"], "--credential-file", str(cred), "--json"]

        step("a site, a pool that runs bcd, and a one-use join token")
        site = json.loads(
            run(bc, "sites", "create", "--tenant", tenant, "--name", "lab", *api, env=env)
        )["id"]
        pool = json.loads(
            run(
                bc,
                "pools",
                "create",
                "--tenant",
                tenant,
                "--site",
                site,
                "--name",
                "servers",
                *api,
                env=env,
            )
        )["id"]
        token = ROOT / "join-token"
        run(
            bc,
            "join-tokens",
            "create",
            "--tenant",
            tenant,
            "--pool",
            pool,
            "--ttl",
            "15m",
            "--out",
            str(token),
            *api,
            env=env,
        )

        step("the node's config.toml and join-encryption.jwk (what install-bcd.sh writes)")
        well_known = addr["api"] + "/api/compute/.well-known/better-compute"
        with urllib.request.urlopen(well_known) as resp:  # noqa: S310 - our own http URL
            jwk = json.load(resp)["join"]["encryptionJwk"]
        config = node / "etc" / "config.toml"
        config.write_text(
            f'gateway_url = "{addr["gateway"]}"\nsite = "{site}"\n'
            + "".join(f'{k} = "{v}"\n' for k, v in pins.items())
            + f'data_dir = "{node / "data"}"\n'
        )
        (node / "etc" / "join-encryption.jwk").write_text(json.dumps(jwk))
        print(config.read_text().rstrip())

        sysfs = "/"
        if not hardware_key(read_claims(Path("/"))).trusted:
            from control.simulate import random_machine

            sysfs = str(random_machine(ROOT / "machine", 7))
            print(
                f"this machine reports fewer than two hardware identifiers; presenting a simulated one ({sysfs})"
            )

        step("bcd join: the machine becomes a node")
        bcd = str(BIN / "bcd")
        run(
            bcd,
            "join",
            "--config",
            str(config),
            "--token-file",
            str(token),
            "--sysfs-root",
            sysfs,
            env=env,
        )
        print(f"the token file is gone: {not token.exists()}")

        step("bcd doctor")
        run(bcd, "doctor", "--config", str(config), env=env)
        step("bcd join again: already joined, no credential read")
        run(bcd, "join", "--config", str(config), "--sysfs-root", sysfs, env=env)
        node_id = json.loads((node / "data" / "identity.json").read_text())["node_id"]
        _run_node(bcd, config, env)(bc, tenant, node_id, api[:-1])
        step("the control plane's view")
        run(bc, "nodes", "show", node_id, "--tenant", tenant, *api[:-1], env=env)
        run(bc, "events", "list", "--tenant", tenant, *api[:-1], env=env)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(10)
        log.close()
    step(f"done: all state is under {ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

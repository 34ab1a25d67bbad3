"""The docs' first run, run as written, so the docs cannot drift from the product.

The convention (also in docs/tests.md, "The docs' first run"):

- **Runnable blocks.** A ```sh fence right after the line ``<!-- docs-test: NAME -->``
  (an HTML comment: invisible when the page renders) is a runnable block of group
  NAME. A page's blocks of one group run in their order as one bash script under
  ``set -euo pipefail``: a documented command that fails fails the test, and what
  the blocks start in the background (``serve &``, ``bcd node &``) is theirs to stop.
- **Placeholders.** The test replaces only what the page itself says to change: the
  scratch directory ``/tmp/bc`` (by a directory under the test's ``tmp_path``) and
  the two ports of ``127.0.0.1:8080`` and ``127.0.0.1:8443`` (by free ports). Nothing
  else of the text is changed.
- **One sandbox addition.** On a host whose firmware reports fewer than two hardware
  identifiers (VMs and containers, this suite's CI), ``bcd join`` is refused
  ``placeholder-hardware``; there the test appends bcd's hidden ``--sysfs-root`` of a
  simulated machine to the ``bcd join`` command, as ``make quickstart`` does. The
  page says what an operator does on such a host instead (an ``--expect-*`` binding).
- **Skipped steps.** None in the first run: it installs no unit and writes nothing
  outside ``/tmp/bc``. Steps that need a real systemd or change the host for good
  (installing units, ``/etc/bcd``) are left unmarked and named on the page as such.
- **The sandbox.** The venv's ``bin`` first on ``PATH``, no ``BETTER_COMPUTE_*`` or
  ``BCD_*`` variable, ``HOME`` under ``tmp_path``, loopback only; real ``serve`` and
  ``bcd`` processes. Whatever the script left running is stopped by its process group.

The assertions are the outcomes the page promises: the join, the node's session
(bcd node's log and serve's), ``nodes list`` naming the node, ``bcd node`` exiting 1
on the revocation, ``serve`` stopping cleanly; and that no secret is on an argv or in
an ``export`` of the page, nor in anything the run printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import urllib.request
from pathlib import Path

import pytest

from bcd.hardware import hardware_key, read_claims
from control.server import default_gateway_host
from control.simulate import random_machine
from tests.world import BIN, ControlPlane, E2EWorld, Node, cli_env, run

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARK = re.compile(r"^<!-- docs-test: ([\w-]+) -->\n```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SCRATCH = re.compile(r"/tmp/bc(?![\w.-])")
API_PORT, GATEWAY_PORT = "127.0.0.1:8080", "127.0.0.1:8443"
TOOLS = ("bash", "openssl", "curl", "jq")


def blocks(name: str) -> dict[Path, list[str]]:
    """Each page's runnable blocks of group ``name``, in their order."""
    found: dict[Path, list[str]] = {}
    for page in sorted(DOCS.glob("*.md")):
        for match in MARK.finditer(page.read_text()):
            if match.group(1) == name:
                found.setdefault(page, []).append(match.group(2))
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _sandboxed(text: str, scratch: Path, api_port: int, gateway_port: int) -> str:
    text = SCRATCH.sub(str(scratch), text)
    text = text.replace(API_PORT, f"127.0.0.1:{api_port}")
    return text.replace(GATEWAY_PORT, f"127.0.0.1:{gateway_port}")


def _with_simulated_machine(script: str, sysfs: Path) -> str:
    """``--sysfs-root`` on the ``bcd join`` command (its last continuation line)."""
    lines = script.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("bcd join "))
    end = start
    while lines[end].rstrip().endswith("\\"):
        end += 1
    lines[end] = f"{lines[end]} --sysfs-root {sysfs}"
    return "\n".join(lines)


def _exported_names(script: str) -> set[str]:
    return set(re.findall(r"^export (\w+)=", script, re.MULTILINE))


def test_the_first_run_is_marked_and_holds_no_secret_on_argv_or_in_an_export() -> None:
    pages = blocks("first-run")
    assert list(pages) == [DOCS / "README.md"], pages
    script = "\n".join(pages[DOCS / "README.md"])
    assert len(pages[DOCS / "README.md"]) >= 4
    for step in ("better-compute serve ", "bcd join --server ", "bcd node ", "nodes list"):
        assert step in script, step
    # the secret only ever as a file, named by --secret-file
    assert "BETTER_COMPUTE_SECRET" not in script
    assert not re.search(r"--secret(?!-file)\b", script)
    assert "--secret-file /tmp/bc/secret" in script
    assert _exported_names(script) == {
        "BETTER_COMPUTE_HOME",
        "BETTER_COMPUTE_API",
        "BETTER_COMPUTE_CREDENTIAL_FILE",
    }
    # it names no host path outside the placeholder directory
    for path in re.findall(r"(?<![\w.])/(?:etc|var|srv|root|home)/[\w./-]+", script):
        pytest.fail(f"the first run writes outside /tmp/bc: {path}")


def test_the_docs_first_run_works_as_written(tmp_path: Path) -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    assert not missing, f"the docs' first run needs {', '.join(missing)} (docs/README.md)"
    scratch = tmp_path / "bc"
    api_port, gateway_port = _free_port(), _free_port()
    text = "\n".join(blocks("first-run")[DOCS / "README.md"])
    script = _sandboxed(text, scratch, api_port, gateway_port)
    for placeholder in ("/tmp/bc", ":8080", ":8443"):
        assert placeholder not in script, placeholder
    if not hardware_key(read_claims(Path("/"))).trusted:
        script = _with_simulated_machine(script, random_machine(tmp_path / "machine", 11))
    (tmp_path / "first-run.sh").write_text("set -euo pipefail\n" + script + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BETTER_COMPUTE_", "BCD_"))}
    env |= {"PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}", "HOME": str(tmp_path)}
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "first-run.sh")],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: serve & and bcd node & with it
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever a failed run left running
        proc.wait()
    logs = {
        name: (scratch / name).read_text() if (scratch / name).exists() else ""
        for name in ("serve.log", "node.log")
    }
    shown = f"stdout:\n{out}\nstderr:\n{err}\n" + "".join(
        f"{name}:\n{text}\n" for name, text in logs.items()
    )
    assert proc.returncode == 0, shown

    joined = re.search(r"^joined as (node_\w+) \(site (site_\w+), role node\)", out, re.M)
    assert joined, shown
    node, site = joined.groups()
    # bcd join --server built config.toml from the well-known document: serve published
    # its loopback gateway without --gateway-url
    config = (scratch / "node" / "config.toml").read_text()
    assert f'gateway_url = "https://127.0.0.1:{gateway_port}"' in config
    assert f'site = "{site}"' in config
    assert not (scratch / "join-token").exists()  # spent and deleted
    # the session was open (both ends say so) and nodes list showed the node
    assert "bcd: bcd.session: session open (sess_" in logs["node.log"], shown
    assert re.search(rf"session sess_\w+ open for {node}", logs["serve.log"]), shown
    assert re.search(rf"^{node}\s", out, re.MULTILINE), shown  # nodes list named it
    # the revocation stopped bcd node with exit 1; serve drained and stopped
    assert "agent: this node's certificate was revoked" in logs["node.log"], shown
    assert "bcd node exited 1" in out, shown
    assert "INFO control.server: stopped" in logs["serve.log"], shown
    # no secret in anything the run printed or logged
    secret_file = scratch / "secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = secret_file.read_text().strip()
    credential = (scratch / "root.credential").read_text().strip()
    for value in (secret, credential):
        assert value not in out + err + "".join(logs.values())
    assert "bcjt_" not in out + err + "".join(logs.values())


@pytest.mark.parametrize(
    ("listen", "san", "host"),
    [
        ("127.0.0.1:8443", "127.0.0.1", "127.0.0.1"),
        ("127.0.0.2:0", "localhost", "127.0.0.2"),
        ("localhost:8443", "127.0.0.1", "localhost"),
        ("[::1]:8443", "::1", "[::1]"),
        ("0.0.0.0:443", "127.0.0.1", None),  # every address: another machine may dial it
        ("10.0.0.5:8443", "127.0.0.1", None),
        ("127.0.0.1:8443", "gw.eu.example.com", None),  # behind a proxy with a public name
        ("[::]:443", "::1", None),
    ],
)
def test_gateway_url_defaults_only_for_a_gateway_nothing_else_can_dial(
    listen: str, san: str, host: str | None
) -> None:
    assert default_gateway_host(listen, san) == host


def test_without_a_loopback_default_serve_warns_and_bcd_join_names_the_flag(
    e2e: E2EWorld, tmp_path: Path
) -> None:
    template = tmp_path / "pki-template"
    shutil.copytree(e2e.pki_template, template)
    issued = run(
        [str(BIN / "better-compute"), "pki", "issue-gateway", "--san", "gw.example.com"],
        env=cli_env(template),
    )
    assert issued.returncode == 0, issued.stderr
    (tmp_path / "cp").mkdir()
    cp = ControlPlane.start(
        tmp_path / "cp",
        template,
        f"sqlite:///{tmp_path / 'store.db'}",
        extra_args=["--gateway-san", "gw.example.com"],
    )
    e2e.stack.callback(cp.stop)
    log = (cp.home / "serve.log").read_text()
    assert "no --gateway-url: the well-known document has no gateway section" in log
    with urllib.request.urlopen(cp.api + "/api/compute/.well-known/better-compute") as resp:  # noqa: S310
        assert "gateway" not in json.load(resp)
    site, pool = cp.site_and_pool()
    machine = Node.make(tmp_path / "m", cp, site)
    pins = cp.pins()
    config = tmp_path / "fresh" / "config.toml"
    done = run(
        [
            str(BIN / "bcd"), "join", "--config", str(config), "--server", cp.api,
            "--sysfs-root", str(machine.sysfs),
            "--serving-ca-pin", pins["serving_ca_spki_pin"],
            "--join-signing-pin", pins["join_signing_key_pin"],
            "--join-encryption-pin", pins["join_encryption_key_pin"],
        ],
        input=cp.token(pool)["token"].encode(),
        env=cli_env(tmp_path, secret=False),
    )  # fmt: skip
    assert done.returncode == 1
    assert "publishes no gateway section: its better-compute serve runs without --gateway-url" in (
        done.stderr
    )
    assert f"or write {config} instead" in done.stderr
    assert not config.exists()

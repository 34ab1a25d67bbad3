"""x509pop with real processes: a node whose certificate expired while no ``bcd node``
ran re-joins with ``bcd join --attestor x509pop`` as the same node; after the window
(``x509pop.max_expired_s``, shortened here so the test need not wait 7 days) it is
refused, and its old identity stays."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bcd import pki
from bcd.identity import parse_time
from bcd.tpm.device import open_tpm
from bcd.tpm.nodekey import derive_node_key
from bcd.tpm.record import NodeKeyRecord
from tests.world import BIN, ControlPlane, E2EWorld, Node, SwTpm, cli_env

pytestmark = pytest.mark.e2e

TTL_S = 10
WINDOW_S = 8


@pytest.fixture
def cp(e2e: E2EWorld) -> ControlPlane:
    return e2e.control_plane(
        extra_args=[
            "--cert-ttl-seconds",
            str(TTL_S),
            "--x509pop-ca",
            str(e2e.tmp / "cp" / "pki" / "node-root-ca.crt"),
            "--attestor-setting",
            f"x509pop.max_expired_s={WINDOW_S}",
        ],
    )


def _identity(node: Node) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((node.data_dir / "identity.json").read_text())
    return loaded


def _serial(node: Node) -> str:
    chain = _identity(node)["chain"]
    assert isinstance(chain, str)
    return pki.leaf_info(pki.load_pem_chain(chain)[0]).serial_hex


def _wait_until(when: datetime) -> None:
    delay = (when - datetime.now(UTC)).total_seconds()
    if delay > 0:
        time.sleep(delay)


def _not_after(node: Node) -> datetime:
    not_after = _identity(node)["not_after"]
    assert isinstance(not_after, str)
    return parse_time(not_after)


def test_x509pop_rejoins_after_an_offline_expiry_and_is_refused_after_the_window(
    cp: ControlPlane, tmp_path: Path
) -> None:
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site, seed=11)
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    node_id = joined.stdout.split()[2]
    first_serial = _serial(node)

    # offline: no bcd node runs, the certificate expires
    _wait_until(_not_after(node))
    time.sleep(0.5)
    doctor = node.bcd("doctor")
    assert doctor.returncode == 1
    assert "the certificate expired at" in doctor.stdout
    assert "join again as root: bcd join --reset --yes, then bcd join" in doctor.stdout
    (x509pop_line,) = [line for line in doctor.stdout.splitlines() if " x509pop " in line]
    assert x509pop_line.endswith("as root: bcd join --attestor x509pop")
    plain = node.join(None)  # an expired identity still loads: plain join says so
    assert plain.returncode == 0
    assert plain.stdout.startswith(f"already joined as {node_id}")

    rejoined = node.join(None, "--attestor", "x509pop")
    assert rejoined.returncode == 0, rejoined.stderr
    line = rejoined.stdout.splitlines()[-1]
    assert line.startswith(f"joined as {node_id} (site {site}, role node); certificate valid until")
    ident = _identity(node)
    assert ident["node_id"] == node_id
    assert ident["identity_generation"] == 2
    assert _serial(node) != first_serial
    doctor = node.bcd("doctor")
    assert doctor.returncode == 0, doctor.stdout
    assert f"node {node_id}" in doctor.stdout

    rows = cp.one("SELECT identity_generation, attestor FROM nodes WHERE id = ?", (node_id,))
    assert rows == {"identity_generation": 2, "attestor": "x509pop"}
    old = cp.one("SELECT revoke_reason FROM node_certs WHERE serial = ?", (first_serial,))
    assert old == {"revoke_reason": "rejoined"}
    joined_events = [e for e in cp.events(type_="node.joined") if e["nodeId"] == node_id]
    assert [(e["attestor"], e["reclaim"]) for e in joined_events] == [
        ("join-token", False),
        ("x509pop", True),
    ]

    # bcd node works with the new identity: it opens its session and renews
    proc = subprocess.Popen(
        [str(BIN / "bcd"), "node", "--config", str(node.config)],
        env=cli_env(node.root, secret=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rejoined_serial = _serial(node)
    try:
        deadline = time.monotonic() + 20
        while _serial(node) == rejoined_serial:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "bcd node did not renew the re-joined identity"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    assert _identity(node)["identity_generation"] == 2

    # offline again, now past the window: refused, and the old identity is kept
    _wait_until(_not_after(node))
    time.sleep(WINDOW_S + 1)
    before = {name: (node.data_dir / name).read_bytes() for name in ("identity.json", "node.key")}
    refused = node.join(None, "--attestor", "x509pop")
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "bcd: the control plane refused the join (ACCESS_DENIED: Join refused)"
    )
    assert "Traceback" not in refused.stderr
    after = {name: (node.data_dir / name).read_bytes() for name in ("identity.json", "node.key")}
    assert after == before
    assert not (node.data_dir / "node.key.next").exists()
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert reasons == ["x509pop:expired-too-long"]
    doctor = node.bcd("doctor")
    assert doctor.returncode == 1
    assert "the certificate expired at" in doctor.stdout


def test_x509pop_without_an_identity_or_with_reset_says_what_to_do(
    cp: ControlPlane, tmp_path: Path
) -> None:
    site, _pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site, seed=12)
    none = node.join(None, "--attestor", "x509pop")
    assert none.returncode == 1
    assert "holds none; join with a token: bcd join" in none.stderr
    assert "Traceback" not in none.stderr
    reset = node.join(None, "--attestor", "x509pop", "--reset", "--yes")
    assert reset.returncode == 2
    assert "does not combine with --reset" in reset.stderr
    assert not (node.data_dir / "identity.json").exists()


def test_serve_refuses_an_unusable_x509pop_setting(tmp_path: Path, e2e: E2EWorld) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("nope\n")
    for extra in (
        ["--x509pop-ca", str(bad)],
        ["--attestor-setting", "x509pop.max_expired_s=forever"],
    ):
        with pytest.raises(RuntimeError) as info:
            e2e.control_plane(
                f"sqlite:///{tmp_path / f's{len(extra[1])}.db'}",
                name=f"cp{len(extra[1])}",
                extra_args=extra,
            )
        assert "x509pop" in str(info.value)
        assert "Traceback" not in str(info.value)


def test_x509pop_rejoins_a_tpm_held_key_it_proves_through_the_tpm(
    cp: ControlPlane, tmp_path: Path, swtpm: SwTpm
) -> None:
    """A token join whose key landed in the TPM (no AK statement: a token join proves
    nothing about where the key lives); offline past its expiry, ``bcd join --attestor
    x509pop`` (root) signs the proof with the TPM-held key and makes the next key there."""
    site, pool = cp.site_and_pool()
    node = Node.make(tmp_path / "n", cp, site, seed=12)
    with node.config.open("a") as f:
        f.write(f'[tpm]\nmode = "required"\ntcti = "{swtpm.tcti}"\n')
    joined = node.join(cp.token(pool)["token"])
    assert joined.returncode == 0, joined.stderr
    node_id = joined.stdout.split()[2]
    assert _identity(node)["key"] == "tpm"
    first_record = (node.data_dir / "node.key").read_bytes()
    first_serial = _serial(node)

    _wait_until(_not_after(node))
    time.sleep(0.5)
    rejoined = node.join(None, "--attestor", "x509pop")

    assert rejoined.returncode == 0, rejoined.stderr
    ident = _identity(node)
    assert (ident["node_id"], ident["identity_generation"], ident["key"]) == (node_id, 2, "tpm")
    assert (node.data_dir / "node.key").read_bytes() != first_record  # a new key, in the TPM
    record = NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes())
    chain = ident["chain"]
    assert isinstance(chain, str)
    leaf = pki.load_pem_chain(chain)[0]
    with open_tpm(swtpm.tcti) as tpm:
        derived = derive_node_key(tpm, record)
    assert pki.same_public_key(derived, leaf.public_key())  # type: ignore[arg-type]
    old = cp.one("SELECT revoke_reason FROM node_certs WHERE serial = ?", (first_serial,))
    assert old == {"revoke_reason": "rejoined"}
    assert not (node.data_dir / "node.key.next").exists()

"""End to end, the tpm attestor: a real `better-compute serve --tpm-ek-ca` and real
`bcd join --attestor tpm` processes against the session's swtpm."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bcd import pki
from bcd.identity import TPM_KEY_MISMATCH, TPM_NODE_UNSUPPORTED, load_state
from bcd.tpm.ak import ak_public
from bcd.tpm.device import open_tpm
from bcd.tpm.record import NodeKeyRecord
from tests.world import (
    BIN,
    JOINED,
    REFUSED_LINE,
    ControlPlane,
    E2EWorld,
    Node,
    SwTpm,
    cli_env,
    closed_tcti,
    helper_table,
    leaf,
    other_ca_bundle,
    start_helper,
    stop_process,
    tpm_node,
)

pytestmark = pytest.mark.e2e


def test_a_machine_joins_with_its_tpm_and_reclaims_its_node(
    tpm_control_plane: tuple[ControlPlane, str, str], tmp_path: Path, own_swtpm: SwTpm
) -> None:
    swtpm = own_swtpm
    cp, site, pool = tpm_control_plane
    node = tpm_node(tmp_path / "node", cp, site, swtpm)

    done = node.join(None, "--attestor", "tpm")

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, done.stdout
    node_id = m.group(1)
    ident = json.loads((node.data_dir / "identity.json").read_text())
    assert ident["key"] == "tpm"
    record = NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes())
    leaf = pki.load_pem_chain(ident["chain"])[0]
    info = pki.leaf_info(leaf)
    assert record.pin == pki.spki_pin(leaf.public_key())  # type: ignore[arg-type]
    with open_tpm(swtpm.tcti) as tpm:
        _, ak_name = ak_public(tpm)
    assert info.statements == (f"urn:bc:tpm-ak:sha256:{ak_name[2:].hex()}",)
    (joined,) = cp.events(type_="node.joined")
    assert joined["nodeId"] == node_id
    assert joined["nodeKey"] == "tpm"
    assert joined["attestor"] == "tpm"
    assert joined["reclaim"] is False
    row = cp.one("SELECT pool_id, hardware_key_trusted FROM nodes WHERE id = ?", (node_id,))
    assert row == {"pool_id": pool, "hardware_key_trusted": 1}
    assert cp.one("SELECT COUNT(*) AS n FROM join_challenges WHERE used_at IS NOT NULL") == {"n": 1}

    # the identity loads (the TPM derives the key again): already joined
    again = node.join(None, "--attestor", "tpm")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"already joined as {node_id} (site {site}, role node)"
    # bcd node cannot use a TPM-held key yet, and says so
    agent = node.bcd("node")
    assert agent.returncode == 1
    assert agent.stderr.strip() == f"agent: {TPM_NODE_UNSUPPORTED}"

    # the same machine joining again (after --reset) reclaims its node
    reset = node.join(None, "--reset", "--yes", "--attestor", "tpm")
    assert reset.returncode == 0, reset.stderr
    assert f"joined as {node_id} " in reset.stdout
    reclaimed = cp.events(type_="node.joined")[-1]
    assert (reclaimed["nodeId"], reclaimed["reclaim"], reclaimed["nodeKey"]) == (
        node_id,
        True,
        "tpm",
    )
    assert cp.one("SELECT identity_generation FROM nodes WHERE id = ?", (node_id,)) == {
        "identity_generation": 2
    }

    # a cleared TPM derives another key: the identity no longer loads
    swtpm.clear()
    cleared = node.join(None, "--attestor", "tpm")
    assert cleared.returncode == 1
    assert cleared.stderr == f"bcd: {TPM_KEY_MISMATCH}\n"
    assert "the TPM derives another key from node.key (was the TPM cleared?)" in cleared.stderr

    def derive(rec: NodeKeyRecord):  # type: ignore[no-untyped-def]
        from bcd.tpm.nodekey import derive_node_key

        with open_tpm(swtpm.tcti) as tpm:
            return derive_node_key(tpm, rec)

    from bcd.errors import IdentityError

    with pytest.raises(IdentityError, match=re.escape(TPM_KEY_MISMATCH)):
        load_state(node.data_dir, derive)
    # the way back: join again with --reset (same EK and AK: the same node)
    back = node.join(None, "--reset", "--yes", "--attestor", "tpm")
    assert back.returncode == 0, back.stderr
    assert f"joined as {node_id} " in back.stdout
    loaded = load_state(node.data_dir, derive)
    assert loaded is not None
    assert loaded.identity.node_id == node_id


def test_an_ek_not_chaining_to_the_bundle_is_refused(
    tmp_path: Path, e2e: E2EWorld, swtpm: SwTpm
) -> None:
    cp, site, _pool = e2e.tpm_plane(other_ca_bundle(tmp_path / "other-ca.pem"))
    node = tpm_node(tmp_path / "node", cp, site, swtpm)
    done = node.join(None, "--attestor", "tpm")
    assert done.returncode == 1
    assert done.stderr == REFUSED_LINE
    assert not (node.data_dir / "identity.json").exists()
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert reasons == ["tpm:ek-chain"]


# --- token joins and [tpm] mode ---------------------------------------------------------


def _token_node(root: Path, cp: ControlPlane, site: str, tpm: str) -> Node:
    node = Node.make(root, cp, site)
    with node.config.open("a") as f:
        f.write(tpm)
    return node


def test_a_token_join_with_tpm_required_makes_the_node_key_in_the_tpm(
    sqlite_control_plane: ControlPlane, tmp_path: Path, swtpm: SwTpm
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = _token_node(
        tmp_path / "node", cp, site, f'[tpm]\nmode = "required"\ntcti = "{swtpm.tcti}"\n'
    )

    done = node.join(cp.token(pool)["token"])

    assert done.returncode == 0, done.stderr
    m = JOINED.match(done.stdout.strip())
    assert m, done.stdout
    node_id = m.group(1)
    ident = json.loads((node.data_dir / "identity.json").read_text())
    assert ident["key"] == "tpm"
    raw = (node.data_dir / "node.key").read_bytes()
    record = NodeKeyRecord.from_json(raw)
    assert json.loads(raw) == record.to_dict()  # node.key is the record, no key material
    leaf_key = pki.load_pem_chain(ident["chain"])[0].public_key()
    assert record.pin == pki.spki_pin(leaf_key)  # type: ignore[arg-type]
    from bcd.tpm.nodekey import derive_node_key

    with open_tpm(swtpm.tcti) as tpm:
        assert pki.same_public_key(derive_node_key(tpm, record), leaf_key)  # type: ignore[arg-type]
    (joined,) = cp.events(type_="node.joined")
    assert (joined["nodeId"], joined["nodeKey"]) == (node_id, "unattested")

    again = node.join(None)  # the identity loads: the TPM derives the key again
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"already joined as {node_id} (site {site}, role node)"


def test_tpm_mode_auto_under_helper_makes_the_node_key_in_the_tpm(
    sqlite_control_plane: ControlPlane, tmp_path: Path, swtpm: SwTpm
) -> None:
    """With [helper], bcd node can use a TPM key through bcd helper: auto uses the TPM."""
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    helper = helper_table("root", tmp_path / "run" / "helper.sock", tmp_path / "hostconfig")
    node = _token_node(
        tmp_path / "node", cp, site, f'{helper}\n[tpm]\nmode = "auto"\ntcti = "{swtpm.tcti}"\n'
    )
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    assert json.loads((node.data_dir / "identity.json").read_text())["key"] == "tpm"
    assert NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes()).pin is not None
    assert (tmp_path / "hostconfig" / "join-response.jws").exists()


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_tpm_mode_off_and_auto_without_helper_keep_a_file_key(
    sqlite_control_plane: ControlPlane, tmp_path: Path, swtpm: SwTpm, mode: str
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = _token_node(
        tmp_path / "node", cp, site, f'[tpm]\nmode = "{mode}"\ntcti = "{swtpm.tcti}"\n'
    )
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    assert json.loads((node.data_dir / "identity.json").read_text())["key"] == "file"
    assert (node.data_dir / "node.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_tpm_mode_auto_without_a_tpm_keeps_a_file_key(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    node = _token_node(
        tmp_path / "node", cp, site, '[tpm]\nmode = "auto"\ntcti = "device:/dev/no-tpm"\n'
    )
    done = node.join(cp.token(pool)["token"])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no TPM device: not even opened
    assert json.loads((node.data_dir / "identity.json").read_text())["key"] == "file"


def test_tpm_mode_required_without_a_tpm_fails_before_sending(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    tcti = closed_tcti()
    node = _token_node(tmp_path / "node", cp, site, f'[tpm]\nmode = "required"\ntcti = "{tcti}"\n')
    token = cp.token(pool)
    done = node.join(token["token"])
    assert done.returncode == 1
    assert (
        f"bcd: [tpm] mode = required, but the TPM cannot be used (cannot open the TPM at {tcti}"
        in done.stderr
    )
    assert "nothing was sent" in done.stderr
    assert not (node.data_dir / "identity.json").exists()
    assert cp.events(type_="node.joined") == []
    assert cp.events(type_="security.join.refused") == []
    # the token is still good: the same machine joins with it once the TPM is off
    node.config.write_text(node.config.read_text().replace('"required"', '"off"'))
    assert node.join(token["token"]).returncode == 0


# --- bcd node with a TPM-held key, through bcd helper -------------------------------------


def test_bcd_node_renews_a_tpm_key_through_the_helper_and_fails_on_a_cleared_tpm(
    tmp_path: Path, e2e: E2EWorld, own_swtpm: SwTpm
) -> None:
    """A tpm join under [helper], then `bcd node` (as root here: the venv's interpreter
    lives under /root, which an unprivileged user cannot reach) renews its TPM key with
    the AK's attestation through a real `bcd helper` on the test's own swtpm; once that
    swtpm is cleared, `bcd node` does not load."""
    swtpm = own_swtpm
    cp, site, _pool = e2e.tpm_plane(swtpm.ca_bundle, ["--cert-ttl-seconds", "10"])
    sockdir = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    helper: subprocess.Popen[str] | None = None
    agent: subprocess.Popen[str] | None = None
    try:
        node = tpm_node(tmp_path / "node", cp, site, swtpm)
        with node.config.open("a") as f:
            f.write(helper_table("root", sockdir / "run" / "helper.sock", tmp_path / "hostconfig"))
        # swtpm serves one connection at a time: the join opens the TPM itself (root),
        # then the helper holds it
        done = node.join(None, "--attestor", "tpm")
        assert done.returncode == 0, done.stderr
        node_id = JOINED.match(done.stdout.strip()).group(1)  # type: ignore[union-attr]
        first = leaf(node)
        (statement,) = first.statements
        assert statement.startswith("urn:bc:tpm-ak:sha256:")
        first_record = NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes())

        helper = start_helper(node)
        agent = subprocess.Popen(
            [str(BIN / "bcd"), "node", "--config", str(node.config)],
            env=cli_env(node.root, secret=False),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        # storage writes identity.json, then renames node.key.next over node.key: wait
        # for both steps before reading them
        while leaf(node).serial_hex == first.serial_hex or (
            (node.data_dir / "node.key.next").exists()
        ):
            if agent.poll() is not None:
                raise AssertionError(f"bcd node exited: {agent.communicate()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no renewal: {stop_process(agent)}")
            time.sleep(0.1)
        # the new leaf still names the AK; node.key is the next record, pinned to it
        renewed = leaf(node)
        assert renewed.statements == (statement,)
        ident = json.loads((node.data_dir / "identity.json").read_text())
        assert ident["key"] == "tpm"
        record = NodeKeyRecord.from_json((node.data_dir / "node.key").read_bytes())
        assert record.unique != first_record.unique
        leaf_key = pki.load_pem_chain(ident["chain"])[0].public_key()
        assert record.pin == pki.spki_pin(leaf_key)  # type: ignore[arg-type]
        assert not (node.data_dir / "node.key.next").exists()
        with cp.store.tx() as tx:
            certs = tx.query("SELECT serial FROM node_certs WHERE node_id = ?", (node_id,))
        assert len(certs) >= 2
        assert cp.events(type_="security.renew.refused") == []
        assert agent.poll() is None
        err = stop_process(agent)
        agent = None
        assert "renewed: certificate" in err, err
        assert "session open" in err, err  # the session's TLS signs through the helper too
        assert "Traceback" not in err
        doctor = node.bcd("doctor", "--json")  # the identity loads through the helper
        checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
        assert checks["identity"]["status"] == "ok", checks["identity"]

        # a cleared TPM derives another key from node.key: bcd node does not load
        stop_process(helper)
        helper = None
        swtpm.clear()
        helper = start_helper(node)
        cleared = node.bcd("node")
        assert cleared.returncode == 1, cleared.stderr
        assert cleared.stderr.strip().endswith(f"agent: {TPM_KEY_MISMATCH}")
        assert "the TPM derives another key from node.key (was the TPM cleared?)" in cleared.stderr
        doctor = node.bcd("doctor")
        assert doctor.returncode == 1
        assert "was the TPM cleared?" in doctor.stdout
        with cp.store.tx() as tx:
            after = tx.query("SELECT serial FROM node_certs WHERE node_id = ?", (node_id,))
        assert len(after) == len(certs)
    finally:
        if agent is not None:
            stop_process(agent)
        if helper is not None:
            stop_process(helper)
        shutil.rmtree(sockdir, ignore_errors=True)


def test_bcd_node_moves_a_file_key_into_the_tpm_at_its_next_renewal(
    tmp_path: Path, e2e: E2EWorld, own_swtpm: SwTpm
) -> None:
    """A token join with a file key ([tpm] mode = off then), then [tpm] mode = auto under
    [helper]: `bcd node`'s next renewal makes the next key in the TPM through a real
    `bcd helper` (the proof by the file key, over the file key's TLS), and the node
    renews from then on as a TPM node."""
    swtpm = own_swtpm
    cp = e2e.control_plane(extra_args=["--cert-ttl-seconds", "10"])
    sockdir = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/tmp"))
    helper: subprocess.Popen[str] | None = None
    agent: subprocess.Popen[str] | None = None
    try:
        site, pool = cp.site_and_pool()
        node = _token_node(
            tmp_path / "node",
            cp,
            site,
            helper_table("root", sockdir / "run" / "helper.sock", tmp_path / "hostconfig")
            + f'\n[tpm]\nmode = "off"\ntcti = "{swtpm.tcti}"\n',
        )
        done = node.join(cp.token(pool)["token"])
        assert done.returncode == 0, done.stderr
        node_id = JOINED.match(done.stdout.strip()).group(1)  # type: ignore[union-attr]
        assert json.loads((node.data_dir / "identity.json").read_text())["key"] == "file"
        first = leaf(node)
        assert first.statements == ()

        node.config.write_text(node.config.read_text().replace('mode = "off"', 'mode = "auto"'))
        helper = start_helper(node)
        agent = subprocess.Popen(
            [str(BIN / "bcd"), "node", "--config", str(node.config)],
            env=cli_env(node.root, secret=False),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def wait_for(done: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 40
            while not done():
                assert agent is not None
                if agent.poll() is not None:
                    raise AssertionError(f"bcd node exited: {agent.communicate()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what}: {stop_process(agent)}")
                time.sleep(0.1)

        def tpm_record_after(serial: str) -> NodeKeyRecord | None:
            """node.key's record once a TPM leaf other than ``serial`` is fully stored
            (identity.json is written before node.key.next is renamed over node.key)."""
            ident = json.loads((node.data_dir / "identity.json").read_text())
            leaf = pki.load_pem_chain(ident["chain"])[0]
            if ident["key"] != "tpm" or pki.leaf_info(leaf).serial_hex == serial:
                return None
            raw = (node.data_dir / "node.key").read_bytes()
            if not raw.startswith(b"{"):
                return None
            record = NodeKeyRecord.from_json(raw)
            pinned = record.pin == pki.spki_pin(leaf.public_key())  # type: ignore[arg-type]
            return record if pinned else None

        wait_for(
            lambda: tpm_record_after(first.serial_hex) is not None,
            "the key did not move into the TPM",
        )
        moved = leaf(node)
        assert moved.statements == ()  # a token join's leaf names no AK, nor does its renewal
        moved_record = tpm_record_after(first.serial_hex)
        assert moved_record is not None

        # and renews again, now as a TPM node (the proof and TLS through the helper)
        wait_for(lambda: tpm_record_after(moved.serial_hex) is not None, "no renewal as a TPM node")
        record = tpm_record_after(moved.serial_hex)
        assert record is not None
        assert record.unique != moved_record.unique
        assert cp.events(type_="security.renew.refused") == []
        with cp.store.tx() as tx:
            certs = tx.query("SELECT serial FROM node_certs WHERE node_id = ?", (node_id,))
        assert len(certs) >= 3
        assert agent.poll() is None
        err = stop_process(agent)
        agent = None
        assert err.count("renewed: certificate") >= 2, err
        assert "renewal failed" not in err, err
        assert "not in the TPM" not in err, err
        assert "Traceback" not in err, err
        doctor = node.bcd("doctor", "--json")  # the identity loads through the helper
        checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
        assert checks["identity"]["status"] == "ok", checks["identity"]
    finally:
        if agent is not None:
            stop_process(agent)
        if helper is not None:
            stop_process(helper)
        shutil.rmtree(sockdir, ignore_errors=True)

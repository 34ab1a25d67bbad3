"""Crash safety of a renewal, shown (issue 3): a crash at any storage step still loads.

The seed's storage order (node.key.next first; then node.key.next again,
identity.json, and node.key.next renamed over node.key) means that whatever instant
a renewal stops at, LoadState (rule 2) settles the directory to a key and a
certificate that match, and the node renews again from there. Three views:

- a crash after each named storage step (the fail points of ``renew_once``);
- each state those steps leave on disk, checked directly against ``load_state``;
- real processes renewing in a loop, killed with SIGKILL at random instants.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from bcd import pki
from bcd.identity import LoadedState, load_state
from bcd.keys.file import generate_file_key, key_to_pem
from bcd.renew import FAIL_POINTS, renew_once
from control.pki import Pki
from tests.world.agent import FakeGateway, joined_state, pin, wall

ROOT = Path(__file__).resolve().parent.parent


class Crash(BaseException):
    """The process stops here (nothing after the fail point runs)."""


def assert_matching(state: LoadedState | None) -> LoadedState:
    """The loaded key is the one the loaded leaf certifies."""
    assert state is not None
    leaf_key = state.leaf.public_key()
    assert isinstance(leaf_key, pki.ec.EllipticCurvePublicKey)
    assert pki.same_public_key(state.key.public_key(), leaf_key)
    return state


# Where a crash after each step leaves the node: which certificate the next start
# loads, and what rule 2 did with node.key.next.
EXPECTED = {
    "next-key-first": ("old", "removed"),  # the request may or may not have gone out
    "next-key": ("old", "removed"),  # the answer checked, node.key.next written again
    "identity": ("new", "promoted"),  # identity.json written, before the rename
    "rename": ("new", "none"),  # everything stored
}


def test_every_fail_point_is_covered() -> None:
    assert tuple(EXPECTED) == FAIL_POINTS


@pytest.mark.parametrize("point", FAIL_POINTS)
async def test_a_crash_after_each_storage_step_loads_a_matching_identity_and_renews_again(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock, point: str
) -> None:
    old = joined_state(tmp_path, memory_pki, wall())
    gateway = FakeGateway(memory_pki, tmp_path)
    reached: list[str] = []

    def fail_point(name: str) -> None:
        reached.append(name)
        if name == point:
            raise Crash(name)

    with pytest.raises(Crash):
        await renew_once(
            old,
            gateway.factory(old),
            signing_pin=pin(memory_pki),
            wall=wall,
            fail_point=fail_point,
        )
    assert reached == list(FAIL_POINTS[: FAIL_POINTS.index(point) + 1])

    # the next start
    loaded = assert_matching(load_state(tmp_path))
    which, next_key = EXPECTED[point]
    assert loaded.next_key == next_key
    if which == "old":
        assert loaded.identity == old.identity
    else:
        assert loaded.identity != old.identity
        assert loaded.leaf_info.spiffe == old.leaf_info.spiffe
        assert loaded.leaf == gateway.issued[-1]
    assert not (tmp_path / "node.key.next").exists()
    assert assert_matching(load_state(tmp_path)).identity == loaded.identity  # settled for good

    # and the node renews again from there
    again = await renew_once(
        loaded, gateway.factory(loaded), signing_pin=pin(memory_pki), wall=wall
    )
    assert again.identity != loaded.identity
    assert assert_matching(load_state(tmp_path)).identity == again.identity


# --- each state on disk, directly against load_state ---------------------------------


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o600)


async def test_each_on_disk_state_of_a_renewal_loads(
    tmp_path: Path, memory_pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    """Build every state the storage order can leave, including half-written temp files."""
    old_dir = tmp_path / "old"
    new_dir = tmp_path / "new"
    old = joined_state(old_dir, memory_pki, wall())
    gateway = FakeGateway(memory_pki, old_dir)
    new = await renew_once(old, gateway.factory(old), signing_pin=pin(memory_pki), wall=wall)
    new_dir.mkdir()
    old_key, new_key = key_to_pem(old.key), key_to_pem(new.key)
    old_json, new_json = old.identity.to_json(), new.identity.to_json()
    stray = key_to_pem(generate_file_key())

    states: list[tuple[str, dict[str, bytes], str, str]] = [
        ("joined", {"identity.json": old_json, "node.key": old_key}, "old", "none"),
        (
            "next key written first",
            {"identity.json": old_json, "node.key": old_key, "node.key.next": new_key},
            "old",
            "removed",
        ),
        (
            "next key half written (temp file only)",
            {
                "identity.json": old_json,
                "node.key": old_key,
                ".node.key.next.0a1b2c3d4e5f.tmp": new_key[:40],
            },
            "old",
            "none",
        ),
        (
            "identity.json half written (temp file only)",
            {
                "identity.json": old_json,
                "node.key": old_key,
                "node.key.next": new_key,
                ".identity.json.0a1b2c3d4e5f.tmp": new_json[: len(new_json) // 2],
            },
            "old",
            "removed",
        ),
        (
            "identity.json written, not renamed",
            {"identity.json": new_json, "node.key": old_key, "node.key.next": new_key},
            "new",
            "promoted",
        ),
        ("renamed", {"identity.json": new_json, "node.key": new_key}, "new", "none"),
        (
            "a next key of another attempt",
            {"identity.json": old_json, "node.key": old_key, "node.key.next": stray},
            "old",
            "removed",
        ),
        (
            "an empty next key",
            {"identity.json": new_json, "node.key": new_key, "node.key.next": b""},
            "new",
            "removed",
        ),
    ]
    for name, files, which, next_key in states:
        case = tmp_path / "cases" / name.replace(" ", "-").replace("(", "").replace(")", "")
        case.mkdir(parents=True)
        os.chmod(case, 0o700)
        for file_name, data in files.items():
            _write(case / file_name, data)
        loaded = assert_matching(load_state(case))
        expected = old if which == "old" else new
        assert loaded.identity == expected.identity, name
        assert loaded.next_key == next_key, name
        assert not (case / "node.key.next").exists(), name


# --- real processes, killed with SIGKILL --------------------------------------------

CHILD = r"""
import sys
from pathlib import Path

from bcd import pki
from bcd.identity import load_state, make_identity, store_renewal, write_next_key
from bcd.keys.file import generate_file_key, key_to_pem
from tests.certs import chain_pem, make_ca

data_dir = Path(sys.argv[1])
state = load_state(data_dir)
assert state is not None
spiffe = state.leaf_info.spiffe
ca = make_ca()
print("ready", flush=True)
while True:
    key = generate_file_key()
    pem = key_to_pem(key)
    write_next_key(data_dir, pem)
    leaf = ca.issue_leaf(
        key.public_key(),
        node_id=spiffe.node_id,
        site_id=spiffe.site_id,
        trust_domain=spiffe.trust_domain,
    )
    identity = make_identity(
        chain=chain_pem(leaf, ca),
        bundle=state.identity.bundle,
        trust_version=state.identity.trust_version,
        server_time=state.identity.server_time,
        key="file",
        identity_generation=state.identity.identity_generation,
    )
    store_renewal(data_dir, identity, pem)
"""


def test_sigkill_at_random_instants_of_renewals_always_loads(
    tmp_path: Path, memory_pki: Pki
) -> None:
    first = joined_state(tmp_path, memory_pki, time.time())
    rng = random.Random(3)  # when to kill, not a secret
    outcomes: dict[str, int] = {}
    serials = {first.leaf_info.serial_hex}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(30):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path)],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"
            # a tiny random wait: the child is somewhere in its renewals' storage steps
            time.sleep(rng.uniform(0.0, 0.03))
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        state = assert_matching(load_state(tmp_path))
        assert state.leaf_info.spiffe == first.leaf_info.spiffe
        outcomes[state.next_key] = outcomes.get(state.next_key, 0) + 1
        serials.add(state.leaf_info.serial_hex)
    print("next-key outcomes over 30 kills:", outcomes)
    assert len(serials) > 10  # the kills landed while renewals were being stored

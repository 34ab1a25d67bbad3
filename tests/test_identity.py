"""The identity on disk: LoadState's rules, persisting a join, renewal order, reset."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcd import pki
from bcd.errors import IdentityError
from bcd.identity import (
    IDENTITY_FIELDS,
    KEY_MISMATCH,
    TPM_KEY_MISMATCH,
    TPM_NODE_UNSUPPORTED,
    Identity,
    apply_reset,
    format_time,
    load_state,
    make_identity,
    parse_identity,
    parse_time,
    persist_join,
    reset_plan,
    store_renewal,
    write_next_key,
)
from bcd.keys.file import generate_file_key, key_to_pem, load_key_pem
from tests.certs import CertAuthority, make_ca, new_id, node_identity

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
WAY_BACK = "join again: bcd join --reset --yes, then bcd join"


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return make_ca()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def joined(data_dir: Path, ca: CertAuthority, **leaf_args: object) -> tuple[bytes, Identity]:
    key, identity = node_identity(ca, None, **leaf_args)
    pem = key_to_pem(key)
    persist_join(data_dir, identity, pem, NOW)
    return pem, identity


# --- the file key backend ---------------------------------------------------------


def test_file_key_round_trip() -> None:
    key = generate_file_key()
    pem = key_to_pem(key)
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pki.same_public_key(load_key_pem(pem).public_key(), key.public_key())


def test_load_key_pem_refuses_other_keys() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    sec1 = generate_file_key().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    p384 = ec.generate_private_key(ec.SECP384R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ed = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    encrypted = generate_file_key().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"),
    )
    two = key_to_pem(generate_file_key()) + key_to_pem(generate_file_key())
    for data in (b"", b"garbage", sec1, p384, ed, encrypted, two, b"\xff" * 100):
        with pytest.raises(IdentityError):
            load_key_pem(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_load_key_pem_raises_only_identity_error(data: bytes) -> None:
    for candidate in (
        data,
        b"-----BEGIN PRIVATE KEY-----\n" + data + b"\n-----END PRIVATE KEY-----",
    ):
        with contextlib.suppress(IdentityError):
            load_key_pem(candidate)


# --- identity.json ----------------------------------------------------------------


def test_identity_json_round_trip(ca: CertAuthority) -> None:
    key, identity = node_identity(ca)
    assert parse_identity(identity.to_json()) == identity
    obj = json.loads(identity.to_json())
    assert list(obj) == list(IDENTITY_FIELDS)
    assert obj["version"] == 1
    assert obj["key"] == "file"
    leaf = identity.leaf()
    assert pki.same_public_key(leaf.public_key(), key.public_key())  # type: ignore[arg-type]
    assert identity.not_after == format_time(leaf.not_valid_after_utc)
    assert (
        identity.spiffe_id == f"spiffe://td.example/site/{identity.site_id}/node/{identity.node_id}"
    )


def test_make_identity_reads_names_from_leaf(ca: CertAuthority) -> None:
    node, site = new_id("node"), new_id("site")
    _, identity = node_identity(ca, node_id=node, site_id=site, role="site")
    assert (identity.node_id, identity.site_id, identity.role) == (node, site, "site")


def test_make_identity_refuses_a_chain_without_node_identity() -> None:
    with pytest.raises(IdentityError, match="unusable"):
        make_identity(
            chain=pki.cert_pem(make_ca().cert),
            bundle="",
            trust_version=1,
            server_time=format_time(NOW),
            key="file",
            identity_generation=1,
        )


def damaged(identity: Identity, **changes: object) -> bytes:
    obj = identity.to_dict()
    for name, value in changes.items():
        if value is KeyError:
            del obj[name]
        else:
            obj[name] = value
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "changes",
    [
        {"version": 2},
        {"version": True},
        {"node_id": KeyError},
        {"extra": 1},
        {"node_id": new_id("node")},
        {"node_id": "node_x"},
        {"site_id": new_id("site")},
        {"role": "tenant"},
        {"role": "site"},
        {"trust_domain": "other.example"},
        {"spiffe_id": "spiffe://td.example/x"},
        {"chain": "not pem"},
        {"chain": ""},
        {"bundle": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"},
        {"bundle": 5},
        {"trust_version": -1},
        {"trust_version": "1"},
        {"server_time": "yesterday"},
        {"server_time": "2030-01-01T00:00:00"},
        {"not_after": "2030-01-01T00:00:00+02:00"},
        {"not_after": "2099-01-01T00:00:00Z"},
        {"key": "hsm"},
        {"identity_generation": 1.5},
    ],
)
def test_parse_identity_refuses_damage(ca: CertAuthority, changes: dict[str, object]) -> None:
    _, identity = node_identity(ca)
    with pytest.raises(IdentityError) as info:
        parse_identity(damaged(identity, **changes))
    message = str(info.value)
    assert message.startswith("identity.json is damaged: ")
    assert message.endswith(WAY_BACK)


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"version": 1}'])
def test_parse_identity_refuses_non_identity(data: bytes) -> None:
    with pytest.raises(IdentityError, match=r"^identity\.json is damaged: "):
        parse_identity(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_parse_identity_raises_only_identity_error_on_bytes(data: bytes) -> None:
    with contextlib.suppress(IdentityError):
        parse_identity(data)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*IDENTITY_FIELDS, "x"]), _JSON, max_size=14))
def test_parse_identity_raises_only_identity_error_on_objects(obj: dict[str, object]) -> None:
    with contextlib.suppress(IdentityError):
        parse_identity(json.dumps(obj).encode())


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(IDENTITY_FIELDS), value=_JSON)
def test_parse_identity_one_field_changed(field: str, value: object) -> None:
    obj = _VALID.to_dict()
    obj[field] = value
    try:
        parsed = parse_identity(json.dumps(obj).encode())
    except IdentityError:
        return
    assert parsed.to_dict() == obj


_, _VALID = node_identity(make_ca())


def test_parse_time() -> None:
    assert parse_time("2030-01-02T03:04:05Z") == NOW
    assert format_time(NOW) == "2030-01-02T03:04:05Z"
    for bad in ("2030-01-02", "2030-01-02T03:04:05", "2030-01-02T03:04:05+01:00", "x"):
        with pytest.raises(ValueError, match=r"."):
            parse_time(bad)


# --- LoadState ----------------------------------------------------------------------


def test_not_joined(tmp_path: Path) -> None:
    assert load_state(tmp_path / "absent") is None
    assert load_state(tmp_path) is None
    (tmp_path / "node.key").write_bytes(key_to_pem(generate_file_key()))
    assert load_state(tmp_path) is None


def test_loads_a_joined_identity(tmp_path: Path, ca: CertAuthority) -> None:
    pem, identity = joined(tmp_path, ca)
    state = load_state(tmp_path)
    assert state is not None
    assert state.identity == identity
    assert state.next_key == "none"
    assert pki.same_public_key(state.key.public_key(), load_key_pem(pem).public_key())
    assert state.leaf_info.spiffe.node_id == identity.node_id
    assert state.leaf_info.role == "node"
    assert not state.expired(state.leaf_info.not_before)
    assert state.expired(state.leaf_info.not_after)
    assert state.expired(state.leaf_info.not_after + timedelta(seconds=1))


def test_next_key_certified_by_leaf_is_promoted(tmp_path: Path, ca: CertAuthority) -> None:
    """A renewal stopped after storing identity.json, before the rename."""
    old_pem, _ = joined(tmp_path, ca)
    next_key, renewed = node_identity(ca)
    next_pem = key_to_pem(next_key)
    (tmp_path / "node.key.next").write_bytes(next_pem)
    (tmp_path / "node.key.next").chmod(0o600)  # as a renewal writes it (a 0644 one is refused)
    (tmp_path / "identity.json").write_bytes(renewed.to_json())
    state = load_state(tmp_path)
    assert state is not None
    assert state.next_key == "promoted"
    assert state.identity == renewed
    assert (tmp_path / "node.key").read_bytes() == next_pem
    assert not (tmp_path / "node.key.next").exists()
    assert old_pem != next_pem


def test_stale_next_key_is_removed(tmp_path: Path, ca: CertAuthority) -> None:
    """A renewal stopped before storing the certificate."""
    pem, identity = joined(tmp_path, ca)
    write_next_key(tmp_path, key_to_pem(generate_file_key()))
    state = load_state(tmp_path)
    assert state is not None
    assert state.next_key == "removed"
    assert state.identity == identity
    assert (tmp_path / "node.key").read_bytes() == pem
    assert not (tmp_path / "node.key.next").exists()


def test_unparseable_next_key_is_removed(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    (tmp_path / "node.key.next").write_bytes(b"half a key")
    state = load_state(tmp_path)
    assert state is not None
    assert state.next_key == "removed"
    assert not (tmp_path / "node.key.next").exists()


def test_mismatched_key_gives_the_exact_message(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    (tmp_path / "node.key").write_bytes(key_to_pem(generate_file_key()))
    with pytest.raises(IdentityError) as info:
        load_state(tmp_path)
    assert str(info.value) == KEY_MISMATCH
    assert str(info.value) == (
        "the node key does not match the node certificate; "
        "join again: bcd join --reset --yes, then bcd join"
    )


def test_missing_node_key(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    (tmp_path / "node.key").unlink()
    with pytest.raises(IdentityError, match="missing") as info:
        load_state(tmp_path)
    assert str(info.value).endswith(WAY_BACK)


def test_unreadable_node_key(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    (tmp_path / "node.key").write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="does not load") as info:
        load_state(tmp_path)
    assert str(info.value).endswith(WAY_BACK)


def test_node_key_without_permission(tmp_path: Path, ca: CertAuthority) -> None:
    """A reader that may not open node.key (the unprivileged bcd user) is told so."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    joined(tmp_path, ca)
    tmp_path.chmod(0o711)
    for parent in tmp_path.parents:  # pytest's base temp dirs are root's 0700
        if parent == Path(tempfile.gettempdir()):
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    os.chmod(tmp_path / "identity.json", 0o644)
    os.seteuid(nobody.pw_uid)  # node.key stays root's 0600
    try:
        with pytest.raises(IdentityError, match="cannot read") as info:
            load_state(tmp_path)
    finally:
        os.seteuid(0)
    assert str(info.value).endswith(WAY_BACK)


def test_node_key_that_is_a_directory(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    (tmp_path / "node.key").unlink()
    (tmp_path / "node.key").mkdir()
    with pytest.raises(IdentityError, match="not a regular file") as info:
        load_state(tmp_path)
    assert str(info.value).endswith(WAY_BACK)


def test_damaged_identity_json(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    (tmp_path / "identity.json").write_bytes(b'{"version": 1, "node_id": ')
    with pytest.raises(IdentityError, match=r"^identity\.json is damaged: "):
        load_state(tmp_path)


@pytest.mark.parametrize("name", ["identity.json", "node.key", "node.key.next"])
def test_symlinks_are_refused(tmp_path: Path, ca: CertAuthority, name: str) -> None:
    joined(tmp_path, ca)
    real = tmp_path / "elsewhere"
    path = tmp_path / name
    if path.exists():
        os.rename(path, real)
    else:
        real.write_bytes(b"x")
    path.symlink_to(real)
    with pytest.raises(IdentityError, match="symbolic link"):
        load_state(tmp_path)


def test_data_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(IdentityError, match="not a directory"):
        load_state(path)


def test_tpm_identity_is_refused_clearly(tmp_path: Path, ca: CertAuthority) -> None:
    _pem, identity = joined(tmp_path, ca)
    obj = identity.to_dict() | {"key": "tpm"}
    (tmp_path / "identity.json").write_bytes(json.dumps(obj).encode())
    with pytest.raises(IdentityError) as info:
        load_state(tmp_path)
    assert str(info.value) == TPM_NODE_UNSUPPORTED
    assert "bcd node uses it only through bcd helper" in str(info.value)


def test_tpm_identity_loads_when_the_tpm_derives_its_key(tmp_path: Path, ca: CertAuthority) -> None:
    """node.key holds the record; ``derive`` stands in for the TPM (tests/test_e2e_tpm.py
    does it with the swtpm)."""
    from bcd.identity import LoadedTpmState
    from bcd.tpm import KEY_MISMATCH_MESSAGE, TpmKeyMismatch
    from bcd.tpm.record import create_node_key_record

    key, identity = node_identity(ca, None)
    identity = dataclasses.replace(identity, key="tpm")
    record = create_node_key_record().pinned(key.public_key())
    persist_join(tmp_path, identity, record.to_json(), NOW)
    assert (tmp_path / "node.key").read_bytes() == record.to_json()

    state = load_state(tmp_path, lambda r: key.public_key())
    assert isinstance(state, LoadedTpmState)
    assert state.record == record
    assert state.identity == identity

    def cleared(_r: object) -> pki.ec.EllipticCurvePublicKey:
        raise TpmKeyMismatch(KEY_MISMATCH_MESSAGE)

    with pytest.raises(IdentityError) as info:
        load_state(tmp_path, cleared)
    assert str(info.value) == TPM_KEY_MISMATCH
    assert str(info.value).startswith("the node key does not match the node certificate; ")
    assert KEY_MISMATCH_MESSAGE in str(info.value)
    other = generate_file_key().public_key()
    with pytest.raises(IdentityError, match=r"was the TPM cleared\?"):
        load_state(tmp_path, lambda r: other)
    # a record pinned to another key is not this certificate's key
    (tmp_path / "node.key").write_bytes(create_node_key_record().pinned(other).to_json())
    with pytest.raises(IdentityError) as info:
        load_state(tmp_path, lambda r: key.public_key())
    assert str(info.value) == KEY_MISMATCH
    (tmp_path / "node.key").write_bytes(b"-----BEGIN PRIVATE KEY-----")
    with pytest.raises(IdentityError, match="does not load"):
        load_state(tmp_path, lambda r: key.public_key())
    with pytest.raises(IdentityError, match="does not certify"):
        persist_join(tmp_path, identity, create_node_key_record().pinned(other).to_json(), NOW)


# --- persisting a join ----------------------------------------------------------------


def test_persist_modes_and_content(tmp_path: Path, ca: CertAuthority) -> None:
    data_dir = tmp_path / "var" / "lib" / "bcd"
    pem, identity = joined(data_dir, ca)
    assert mode_of(data_dir) == 0o700
    assert mode_of(data_dir / "node.key") == 0o600
    assert mode_of(data_dir / "identity.json") == 0o600
    assert (data_dir / "node.key").read_bytes() == pem
    assert parse_identity((data_dir / "identity.json").read_bytes()) == identity
    assert sorted(os.listdir(data_dir)) == ["identity.json", "node.key"]


def test_persist_tightens_an_open_data_dir(tmp_path: Path, ca: CertAuthority) -> None:
    os.chmod(tmp_path, 0o750)  # noqa: S103 - the open mode persist must tighten
    joined(tmp_path, ca)
    assert mode_of(tmp_path) == 0o700


def test_persist_writes_node_key_before_identity(
    tmp_path: Path, ca: CertAuthority, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bcd import fs

    (tmp_path / "node.key.next").write_bytes(b"stale")
    events: list[str] = []
    real_write, real_remove = fs.atomic_write, fs.remove

    def write(path: Path, data: bytes, mode: int = 0o600) -> None:
        events.append(f"write {path.name} {mode:o}")
        real_write(path, data, mode)

    def remove(path: Path) -> bool:
        events.append(f"remove {path.name}")
        return real_remove(path)

    monkeypatch.setattr(fs, "atomic_write", write)
    monkeypatch.setattr(fs, "remove", remove)
    joined(tmp_path, ca)
    assert events == ["remove node.key.next", "write node.key 600", "write identity.json 600"]
    assert not (tmp_path / "node.key.next").exists()


def test_persist_refuses_a_key_the_leaf_does_not_certify(tmp_path: Path, ca: CertAuthority) -> None:
    _, identity = node_identity(ca)
    with pytest.raises(IdentityError, match="does not certify"):
        persist_join(tmp_path, identity, key_to_pem(generate_file_key()), NOW)
    assert not (tmp_path / "identity.json").exists()


def test_journal_moved_aside_for_another_node(tmp_path: Path, ca: CertAuthority) -> None:
    _, old = joined(tmp_path, ca)
    (tmp_path / "journal.db").write_bytes(b"old journal")
    (tmp_path / "journal.db-wal").write_bytes(b"old wal")
    _, new = joined(tmp_path, ca)
    stamp = int(NOW.timestamp())
    assert not (tmp_path / "journal.db").exists()
    assert not (tmp_path / "journal.db-wal").exists()
    assert (tmp_path / f"journal.db.{old.node_id}-{stamp}").read_bytes() == b"old journal"
    assert (tmp_path / f"journal.db.{old.node_id}-{stamp}-wal").read_bytes() == b"old wal"
    state = load_state(tmp_path)
    assert state is not None
    assert state.identity == new


def test_journal_moved_aside_twice_in_a_second(tmp_path: Path, ca: CertAuthority) -> None:
    _, first = joined(tmp_path, ca)
    (tmp_path / "journal.db").write_bytes(b"1")
    joined(tmp_path, ca)
    joined(tmp_path, ca, node_id=first.node_id)
    (tmp_path / "journal.db").write_bytes(b"2")
    joined(tmp_path, ca)
    stamp = int(NOW.timestamp())
    assert (tmp_path / f"journal.db.{first.node_id}-{stamp}").read_bytes() == b"1"
    assert (tmp_path / f"journal.db.{first.node_id}-{stamp}-1").read_bytes() == b"2"


def test_journal_kept_for_the_same_node(tmp_path: Path, ca: CertAuthority) -> None:
    _, identity = joined(tmp_path, ca)
    (tmp_path / "journal.db").write_bytes(b"journal")
    joined(tmp_path, ca, node_id=identity.node_id, site_id=identity.site_id)
    assert (tmp_path / "journal.db").read_bytes() == b"journal"


def test_journal_moved_aside_for_a_damaged_identity(tmp_path: Path, ca: CertAuthority) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / "identity.json").write_bytes(b"garbage")
    (tmp_path / "journal.db").write_bytes(b"journal")
    joined(tmp_path, ca)
    assert (tmp_path / f"journal.db.unknown-{int(NOW.timestamp())}").read_bytes() == b"journal"


def test_persist_replaces_a_planted_symlink_not_its_target(
    tmp_path: Path, ca: CertAuthority
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (data_dir / "node.key").symlink_to(victim)
    joined(data_dir, ca)
    assert victim.read_bytes() == b"untouched"
    assert not (data_dir / "node.key").is_symlink()
    assert load_state(data_dir) is not None


# --- renewal storage ----------------------------------------------------------------


def test_store_renewal(tmp_path: Path, ca: CertAuthority) -> None:
    _, identity = joined(tmp_path, ca)
    next_key, renewed = node_identity(ca, node_id=identity.node_id, site_id=identity.site_id)
    next_pem = key_to_pem(next_key)
    write_next_key(tmp_path, next_pem)
    assert mode_of(tmp_path / "node.key.next") == 0o600
    store_renewal(tmp_path, renewed, next_pem)
    assert not (tmp_path / "node.key.next").exists()
    assert (tmp_path / "node.key").read_bytes() == next_pem
    assert mode_of(tmp_path / "node.key") == 0o600
    state = load_state(tmp_path)
    assert state is not None
    assert state.identity == renewed
    assert state.next_key == "none"


# --- reset ----------------------------------------------------------------------------


def test_reset_plan_and_apply(tmp_path: Path, ca: CertAuthority) -> None:
    pem, _ = joined(tmp_path, ca)
    (tmp_path / "journal.db").write_bytes(b"j")
    (tmp_path / "journal.db-shm").write_bytes(b"s")
    (tmp_path / "unrelated").write_bytes(b"u")
    stamp = int(NOW.timestamp())
    plan = reset_plan(tmp_path, NOW)
    assert plan == [
        (tmp_path / "identity.json", tmp_path / f"identity.json.reset-{stamp}"),
        (tmp_path / "node.key", tmp_path / f"node.key.reset-{stamp}"),
        (tmp_path / "journal.db", tmp_path / f"journal.db.reset-{stamp}"),
        (tmp_path / "journal.db-shm", tmp_path / f"journal.db.reset-{stamp}-shm"),
    ]
    assert (tmp_path / "identity.json").exists()  # planning moves nothing
    apply_reset(plan)
    assert load_state(tmp_path) is None
    assert (tmp_path / f"node.key.reset-{stamp}").read_bytes() == pem
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            f"identity.json.reset-{stamp}",
            f"node.key.reset-{stamp}",
            f"journal.db.reset-{stamp}",
            f"journal.db.reset-{stamp}-shm",
            "unrelated",
        ]
    )


def test_reset_plan_includes_next_key(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    write_next_key(tmp_path, b"next")
    names = [src.name for src, _ in reset_plan(tmp_path, NOW)]
    assert names == ["identity.json", "node.key", "node.key.next"]


def test_reset_plan_of_nothing(tmp_path: Path) -> None:
    assert reset_plan(tmp_path, NOW) == []
    assert reset_plan(tmp_path / "absent", NOW) == []
    apply_reset([])


def test_second_reset_in_the_same_second(tmp_path: Path, ca: CertAuthority) -> None:
    joined(tmp_path, ca)
    apply_reset(reset_plan(tmp_path, NOW))
    joined(tmp_path, ca)
    plan = reset_plan(tmp_path, NOW)
    stamp = int(NOW.timestamp())
    assert [dst.name for _, dst in plan] == [
        f"identity.json.reset-{stamp}-1",
        f"node.key.reset-{stamp}-1",
    ]
    apply_reset(plan)
    assert load_state(tmp_path) is None


def test_apply_reset_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    with pytest.raises(IdentityError, match="cannot move"):
        apply_reset([(tmp_path / "a", tmp_path / "b")])
    assert (tmp_path / "b").read_bytes() == b"b"


def test_load_state_removes_temporaries_a_crash_left_behind(tmp_path: Path) -> None:
    from bcd.identity import load_state, persist_join
    from bcd.keys.file import key_to_pem
    from tests.certs import node_identity

    key, identity = node_identity()
    persist_join(tmp_path, identity, key_to_pem(key), datetime.now(UTC))
    stale = tmp_path / ".node.key.next.0123456789ab.tmp"
    stale.write_bytes(key_to_pem(key))
    other = tmp_path / ".unrelated.tmp"
    other.write_text("keep")
    assert load_state(tmp_path) is not None
    assert not stale.exists()
    assert other.exists()


def test_hand_over_changes_only_a_swapped_in_link(tmp_path: Path) -> None:
    """A real temporary user (useradd; skipped without it)."""
    from bcd.identity import hand_over
    from tests.sysusers import temporary_user

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "identity.json").write_text("{}\n")
    target = tmp_path / "elsewhere"
    target.write_text("root's\n")
    (data_dir / "node.key").symlink_to(target)
    with temporary_user() as user:
        hand_over(data_dir, user.pw_uid, user.pw_gid)
        owner = (user.pw_uid, user.pw_gid)
        st = (data_dir / "identity.json").stat()
        assert (st.st_uid, st.st_gid) == owner
        link = os.lstat(data_dir / "node.key")
        assert (link.st_uid, link.st_gid) == owner
        assert (target.stat().st_uid, target.stat().st_gid) == (0, 0)

"""The node's journal: journal.db with its journal id; a bad journal starts over, the identity stays."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio

from bcd import journal as journal_mod
from bcd.identity import load_state, persist_join
from bcd.journal import JOURNAL_ID_RE, Journal, JournalError, new_journal_id, open_journal
from bcd.keys.file import key_to_pem
from tests.certs import make_ca, node_identity

NOW = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
STAMP = int(NOW.timestamp())


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _open(data_dir: Path, now: datetime = NOW) -> Journal:
    return open_journal(data_dir, now)


def _id_of(data_dir: Path) -> str:
    with _open(data_dir) as j:
        return j.journal_id


def _joined(data_dir: Path) -> dict[str, bytes]:
    """A joined node's identity files; returns their bytes to compare afterwards."""
    key, identity = node_identity(make_ca())
    persist_join(data_dir, identity, key_to_pem(key), NOW)
    return {n: (data_dir / n).read_bytes() for n in ("identity.json", "node.key")}


def _identity_untouched(data_dir: Path, before: dict[str, bytes]) -> None:
    for name, data in before.items():
        assert (data_dir / name).read_bytes() == data
    state = load_state(data_dir)
    assert state is not None
    assert state.next_key == "none"


def test_journal_id_form() -> None:
    ids = {new_journal_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(JOURNAL_ID_RE.fullmatch(i) for i in ids)
    assert all(len(i) == 30 for i in ids)


def test_a_missing_journal_is_created_0600_with_an_id(tmp_path: Path) -> None:
    data_dir = tmp_path / "bcd"
    with _open(data_dir) as j:
        assert JOURNAL_ID_RE.fullmatch(j.journal_id)
        assert j.path == data_dir / "journal.db"
        j.append("renewed", {})
        sidecars = [p for p in data_dir.iterdir() if p.name.startswith("journal.db-")]
        assert sidecars  # the write-ahead log
        assert all(_mode(p) == 0o600 for p in sidecars)
    assert _mode(data_dir / "journal.db") == 0o600
    assert _mode(data_dir) == 0o700
    assert not [p for p in data_dir.iterdir() if p.name.endswith(".tmp")]


def test_the_journal_id_survives_a_restart(tmp_path: Path) -> None:
    first = _id_of(tmp_path)
    assert _id_of(tmp_path) == first
    assert _id_of(tmp_path) == first


def test_events_are_appended_and_read_back(tmp_path: Path) -> None:
    with _open(tmp_path) as j:
        first = j.append("renewed", {"serial": "ab", "n": 1}, at=NOW)
        second = j.append("revoked", {"reason": "operator"})
        assert second > first
    with _open(tmp_path) as j:
        events = j.events()
        assert [(e.kind, e.payload) for e in events] == [
            ("renewed", {"n": 1, "serial": "ab"}),
            ("revoked", {"reason": "operator"}),
        ]
        assert events[0].at == "2025-03-04T05:06:07Z"
        assert [e.kind for e in j.events("revoked")] == ["revoked"]


def test_what_the_session_last_heard_replaces_itself(tmp_path: Path) -> None:
    """A gateway flipping welcome / unknown-certificate forever leaves one row of
    either kind (bcd node's SESSION_WORDS), and the other kinds are kept."""
    from bcd.node import SESSION_WORDS

    with _open(tmp_path) as j:
        j.append("renewed", {"serial": "ab"})
        for _ in range(50):
            for kind in SESSION_WORDS:
                j.append(kind, {"serial": "ab"}, replacing=SESSION_WORDS)
        assert [e.kind for e in j.events()] == ["renewed", SESSION_WORDS[-1]]


def test_bad_events_are_refused(tmp_path: Path) -> None:
    with _open(tmp_path) as j:
        with pytest.raises(ValueError, match="kind"):
            j.append("", {})
        with pytest.raises(ValueError, match="kind"):
            j.append("k" * 65, {})
        with pytest.raises(ValueError, match="payload"):
            j.append("big", {"x": "y" * 70_000})
        with pytest.raises(TypeError):
            j.append("odd", {"x": object()})
        assert j.events() == []


async def test_the_journal_is_used_from_worker_threads(tmp_path: Path) -> None:
    j = await trio.to_thread.run_sync(_open, tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(trio.to_thread.run_sync, j.append, "renewed", {"i": i})
        events = await trio.to_thread.run_sync(j.events)
        assert sorted(e.payload["i"] for e in events) == list(range(20))
    finally:
        j.close()


def test_a_closed_journal_refuses_writes(tmp_path: Path) -> None:
    j = _open(tmp_path)
    j.close()
    j.close()
    with pytest.raises(JournalError, match="closed"):
        j.append("renewed", {})


def test_the_mode_is_put_back_to_0600(tmp_path: Path) -> None:
    first = _id_of(tmp_path)
    os.chmod(tmp_path / "journal.db", 0o644)
    assert _id_of(tmp_path) == first
    assert _mode(tmp_path / "journal.db") == 0o600


# --- a bad journal starts over; the identity stays ---------------------------------


def _damage_pages(path: Path) -> None:
    """Overwrite every page after the first with garbage (the header stays valid)."""
    size = path.stat().st_size
    assert size > 4096
    with path.open("r+b") as f:
        f.seek(4096)
        f.write(b"\xa5" * (size - 4096))


def _other_schema(path: Path) -> None:
    path.unlink()
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (k TEXT, v TEXT)")
    conn.execute("INSERT INTO meta VALUES ('journal_id', 'jrn_aaaaaaaaaaaaaaaaaaaaaaaaaa')")
    conn.commit()
    conn.close()


def _no_journal_id(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM meta WHERE key = 'journal_id'")
    conn.commit()
    conn.close()


def _bad_journal_id(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = 'not-an-id' WHERE key = 'journal_id'")
    conn.commit()
    conn.close()


def _other_version(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()


def _garbage(path: Path) -> None:
    path.write_bytes(b"this is not a database\n" * 500)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _symlink(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent / "elsewhere")


@pytest.mark.parametrize(
    "damage",
    [
        _garbage,
        _empty,
        _damage_pages,
        _other_schema,
        _no_journal_id,
        _bad_journal_id,
        _other_version,
        _directory,
        _symlink,
    ],
)
def test_a_bad_journal_is_moved_aside_and_a_new_id_starts(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    before = _joined(tmp_path)
    with _open(tmp_path) as j:
        old_id = j.journal_id
        for i in range(200):  # some pages for _damage_pages to hit
            j.append("renewed", {"i": i, "pad": "x" * 100})
    path = tmp_path / "journal.db"
    damage(path)
    with _open(tmp_path) as j:
        new_id = j.journal_id
        assert j.events() == []
    assert new_id != old_id
    assert os.path.lexists(tmp_path / f"journal.db.corrupt-{STAMP}")
    assert _mode(path) == 0o600
    assert _id_of(tmp_path) == new_id  # the new journal is a good one
    _identity_untouched(tmp_path, before)


def test_a_wiped_journal_starts_over_and_leaves_its_wal_behind(tmp_path: Path) -> None:
    before = _joined(tmp_path)
    old_id = _id_of(tmp_path)
    (tmp_path / "journal.db").unlink()
    (tmp_path / "journal.db-wal").write_bytes(b"stale write-ahead log")
    new_id = _id_of(tmp_path)
    assert new_id != old_id
    assert (tmp_path / f"journal.db.corrupt-{STAMP}-wal").read_bytes() == b"stale write-ahead log"
    _identity_untouched(tmp_path, before)


def test_two_bad_journals_in_one_second_keep_both_copies(tmp_path: Path) -> None:
    _garbage(tmp_path / "journal.db")
    _id_of(tmp_path)
    _garbage(tmp_path / "journal.db")
    _id_of(tmp_path)
    assert (tmp_path / f"journal.db.corrupt-{STAMP}").exists()
    assert (tmp_path / f"journal.db.corrupt-{STAMP}-1").exists()


def test_a_later_start_names_the_copy_by_its_own_time(tmp_path: Path) -> None:
    _garbage(tmp_path / "journal.db")
    _id_of(tmp_path)
    later = NOW + timedelta(hours=1)
    _garbage(tmp_path / "journal.db")
    with open_journal(tmp_path, later):
        pass
    assert (tmp_path / f"journal.db.corrupt-{int(later.timestamp())}").exists()


def test_a_journal_that_cannot_be_opened_is_an_error_not_a_reset(tmp_path: Path) -> None:
    data_dir = tmp_path / "file"
    data_dir.write_bytes(b"")
    with pytest.raises(JournalError, match="cannot open the journal"):
        open_journal(data_dir, NOW)


def test_a_locked_journal_is_not_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _id_of(tmp_path)
    monkeypatch.setattr(journal_mod, "BUSY_TIMEOUT_S", 0.05)
    holder = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    try:
        holder.execute("PRAGMA journal_mode=DELETE")
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(JournalError):
            open_journal(tmp_path, NOW)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not list(tmp_path.glob("journal.db.corrupt-*"))
    assert _id_of(tmp_path) == first

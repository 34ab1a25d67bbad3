"""``--log-level`` and ``--log-format text|json`` on ``better-compute serve`` (and its
``--config`` file), ``bcd node`` and ``bcd helper``; the ``<N>`` priority of every line
under journald (``JOURNAL_STREAM`` naming stderr), the final ``agent:`` line too; the
events' structured lines, written only once their transaction commits. Real processes
whose stderr is a file; a real SQLite store for the commit rule."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bcd.systemd import JournaldFormatter, TextFormatter, json_formatter
from control import events, tenancy
from control.store import open_store
from tests.e2e import BIN, SECRET, cli_env, random_pins, start_serve, write_node_config

PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


def _journal_env(path: Path, base: dict[str, str]) -> dict[str, str]:
    """``base`` with JOURNAL_STREAM naming the file ``path`` (created here)."""
    path.touch()
    st = os.stat(path)
    return {**base, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def _json_lines_with_priority(text: str) -> list[dict[str, object]]:
    """Every line is ``<N>{json}`` with N the JSON line's level: the objects."""
    out = []
    for line in text.splitlines():
        assert line.startswith("<"), line
        prefix, _, body = line.partition(">")
        obj = json.loads(body)
        assert int(prefix[1:]) == PRIORITY[str(obj["level"])], line
        assert {"time", "level", "logger", "message"} <= obj.keys(), line
        out.append(obj)
    return out


def _record(msg: str, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("control.events", level, __file__, 1, msg, None, None)
    record.__dict__.update(extra)
    return record


def test_text_and_json_lines_carry_the_events_fields() -> None:
    record = _record("node joined", event="node.joined", node_id="node_1", reclaim=False,
                     reason="two words")  # fmt: skip
    text = TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert text == (
        "INFO control.events: node joined event=node.joined node_id=node_1 reclaim=false "
        'reason="two words"'
    )
    obj = json.loads(json_formatter().format(record))
    assert obj["event"] == "node.joined"
    assert (obj["level"], obj["logger"], obj["message"]) == (
        "INFO",
        "control.events",
        "node joined",
    )
    assert obj["node_id"] == "node_1"
    assert obj["reclaim"] is False
    assert obj["time"].endswith("+00:00")
    journald = json_formatter(journald=True).format(_record("x", logging.WARNING))
    assert journald.startswith('<4>{"time"')
    assert JournaldFormatter("%(message)s").format(_record("m", node_id="n")) == "<6>m node_id=n"


def test_an_event_is_logged_once_its_transaction_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    with store.tx() as tx:
        tenant, _credential = tenancy.create_tenant(tx, "platform", root=True)
    caplog.set_level(logging.INFO, logger="control.events")

    def rolled_back() -> None:
        with store.tx() as tx:
            events.publish(tx, tenant, "node.joined", {"nodeId": "node_rolled_back"})
            assert not caplog.records  # not before the commit either
            raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        rolled_back()
    assert not caplog.records
    with store.tx() as tx:
        event_id = events.publish(
            tx, tenant, "node.joined", {"nodeId": "node_a", "certSerial": "ab"}
        )
    (rec,) = caplog.records
    assert rec.getMessage() == "node joined"
    assert (rec.event, rec.event_id, rec.tenant_id, rec.node_id, rec.serial) == (  # type: ignore[attr-defined]
        "node.joined", event_id, tenant, "node_a", "ab",
    )  # fmt: skip
    store.close()


def test_serve_reads_log_level_and_format_from_its_config_file(
    tmp_path: Path, pki_template: Path
) -> None:
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    config = tmp_path / "serve.toml"
    config.write_text(
        f'secret-file = "{secret}"\n'
        'api-listen = "127.0.0.1:0"\n'
        'gateway-listen = "127.0.0.1:0"\n'
        'log-level = "debug"\n'
        'log-format = "json"\n'
    )
    config.chmod(0o600)
    env = _journal_env(home / "serve.log", cli_env(home, secret=False))  # start_serve's log
    proc, _info = start_serve(home, ["--config", str(config)], env)
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    lines = _json_lines_with_priority((home / "serve.log").read_text())
    assert any(o["level"] == "DEBUG" and o["logger"] == "control.server" for o in lines), lines
    assert any(str(o["message"]).startswith("serving (role all)") for o in lines), lines


def test_serve_log_level_warning_hides_info(tmp_path: Path, pki_template: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    proc, _info = start_serve(
        home,
        ["--api-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0", "--log-level",
         "warning"],
        cli_env(home),
    )  # fmt: skip
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    assert "serving (role all)" not in (home / "serve.log").read_text()


def _node_config(tmp_path: Path) -> Path:
    return write_node_config(
        tmp_path / "config.toml",
        gateway_url="https://127.0.0.1:1",
        site=f"site_{'0' * 26}",
        pins=random_pins(),
        data_dir=tmp_path / "data",
    )


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_bcd_nodes_final_line_has_its_priority_under_journald(
    tmp_path: Path, log_format: str
) -> None:
    config = _node_config(tmp_path)
    stderr_path = tmp_path / "stderr"
    env = _journal_env(stderr_path, cli_env(tmp_path, secret=False))
    with stderr_path.open("w") as stderr:
        done = subprocess.run(
            [str(BIN / "bcd"), "node", "--config", str(config), "--log-level", "debug",
             "--log-format", log_format],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    text = stderr_path.read_text()
    final = "agent: this node has not joined (run bcd join)"
    if log_format == "json":
        last = _json_lines_with_priority(text)[-1]
        assert (last["level"], last["logger"], last["message"]) == ("ERROR", "bcd.node", final)
    else:
        assert text.splitlines()[-1] == f"<3>{final}"
    # without journald: the same line, no prefix
    plain = subprocess.run(
        [str(BIN / "bcd"), "node", "--config", str(config)],
        env=cli_env(tmp_path, secret=False), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert plain.stderr.splitlines()[-1] == final


def test_bcd_node_refuses_an_unknown_log_level(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(BIN / "bcd"), "node", "--config", str(_node_config(tmp_path)), "--log-level",
         "verbose"],
        env=cli_env(tmp_path, secret=False), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--log-level" in done.stderr
    assert "invalid choice" in done.stderr


def test_bcd_helper_takes_log_level_and_format(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("bcd helper runs as root")
    config = _node_config(tmp_path)
    with config.open("a") as f:
        f.write(
            f'[helper]\nuser = "root"\nsocket = "{tmp_path / "run" / "helper.sock"}"\n'
            f'hostconfig_dir = "{tmp_path / "hostconfig"}"\n[tpm]\nmode = "off"\n'
        )
    stderr_path = tmp_path / "stderr"
    env = _journal_env(stderr_path, cli_env(tmp_path, secret=False))
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "bcd"), "helper", "--config", str(config),
             "--log-level", "warning", "--log-format", "json"],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
        try:
            from tests.world import wait_for

            wait_for((tmp_path / "run" / "helper.sock").exists, 20, "the helper's socket")
            proc.terminate()
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    lines = _json_lines_with_priority(stderr_path.read_text())
    assert [o["level"] for o in lines] == ["WARNING"], lines  # info lines are below the level
    assert "no join record yet" in str(lines[0]["message"])


def test_serves_last_error_line_has_its_priority_under_journald(
    tmp_path: Path, pki_template: Path
) -> None:
    home = tmp_path / "home"
    shutil.copytree(pki_template, home)
    stderr_path = tmp_path / "stderr"
    env = _journal_env(stderr_path, cli_env(home, secret=False))  # no secret: it cannot start
    with stderr_path.open("w") as stderr:
        done = subprocess.run(
            [str(BIN / "better-compute"), "serve", "--api-listen", "127.0.0.1:0",
             "--gateway-listen", "127.0.0.1:0"],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    lines = stderr_path.read_text().splitlines()
    assert lines, "serve said nothing"
    assert lines[-1].startswith("<3>better-compute: INVALID_CONFIG: "), lines
    assert all(line.startswith("<") for line in lines), lines


def test_bcds_flag_choices_are_the_levels_and_formats() -> None:
    from bcd import cli, systemd

    assert tuple(systemd.LEVELS) == cli.LOG_LEVELS
    assert cli.LOG_FORMATS == systemd.FORMATS


def test_a_value_with_a_unicode_line_break_does_not_make_a_journald_line_of_its_own() -> None:
    """journald splits at "\\n" only if the text is split so; a U+2028 or \\r inside a
    value stays inside its line, and JSON escapes it."""
    import json as _json

    from bcd.systemd import json_formatter, prioritized

    assert prioritized("a\u2028<3>FORGED\rx", logging.INFO) == "<6>a\u2028<3>FORGED\rx"
    assert prioritized("one\ntwo", logging.ERROR) == "<3>one\n<3>two"
    record = logging.LogRecord("control", logging.INFO, __file__, 1, "jrn\u2028<3>F", None, None)
    line = json_formatter(journald=True).format(record)
    assert "\u2028" not in line
    assert line.count("\n") == 0
    assert _json.loads(line[3:])["message"] == "jrn\u2028<3>F"


def test_a_nul_inside_a_message_does_not_end_a_journald_entry() -> None:
    from bcd.systemd import prioritized

    assert prioritized("a\0<0>FORGED", logging.INFO) == "<6>a\\x00<0>FORGED"

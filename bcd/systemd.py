"""What bcd needs from systemd, without a dependency: readiness and journald logs.

``notify`` is sd_notify(3): one datagram to the ``NOTIFY_SOCKET`` the service manager
gives a ``Type=notify`` unit (a path, or an abstract name written ``@name``). Outside
such a unit (no ``NOTIFY_SOCKET``) it does nothing; a socket that cannot be reached is
ignored too, since readiness must never stop bcd.

``log_format`` is bcd's log line. Under journald (``JOURNAL_STREAM`` names the
device and inode of standard error, see systemd.exec(5)) each line starts with the
syslog priority ``<N>``, which journald turns into the entry's level and strips; the
journal stamps every entry itself, so no time is printed in either case.

``configure_logging`` sets the level (``--log-level``) and the format (``--log-format``):
``text``, the message followed by the event's structured fields as ``key=value``, or
``json``, one object a line (python-json-logger) with ``time``, ``level``, ``logger``,
``message`` and those fields as keys. The priority prefix is added in both formats.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping
from typing import TextIO

PLAIN_FORMAT = "bcd: %(name)s: %(message)s"

_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def notify(*lines: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``READY=1``, ``STATUS=…``, ``STOPPING=1`` … to the service manager.

    Returns whether a datagram was sent. Newlines inside a line are replaced by
    spaces, since each line is one assignment.
    """
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET", "")
    if not address or not lines:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        return False  # vsock and other forms are not for bcd
    payload = "\n".join(line.replace("\n", " ") for line in lines).encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
    except OSError:
        return False
    return True


def under_journald(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is the journal stream systemd connected (``JOURNAL_STREAM``)."""
    env = os.environ if environ is None else environ
    dev, sep, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (journald's ``<N>``)."""
    return _PRIORITY.get(levelno, 6 if levelno < logging.WARNING else 3)


def prioritized(text: str, levelno: int) -> str:
    """Every line of ``text`` with the ``<N>`` prefix of ``levelno``."""
    level = priority(levelno)
    # split at "\n" only: str.splitlines also breaks at \r, U+0085, U+2028 …, which
    # a value inside a line could carry, and journald would take what follows as a
    # line of its own with the priority it names
    # journald also ends an entry at a NUL byte: shown escaped, never as a break
    text = text.replace("\0", "\\x00")
    return "\n".join(f"<{level}>{line}" for line in text.split("\n"))


LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
"""``--log-level``'s choices."""
FORMATS = ("text", "json")
"""``--log-format``'s choices."""

# A LogRecord's own attributes: whatever else it carries came from ``extra={...}``.
RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


def fields(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields an event's log call gave in ``extra={...}``."""
    return {k: v for k, v in vars(record).items() if k not in RECORD_ATTRS}


def _shown(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    """``fmt``, then the record's structured fields as `` key=value`` (quoted when
    needed), so a text line carries what the JSON line's keys do."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = fields(record)
        if not extra:
            return text
        first, sep, rest = text.partition("\n")
        pairs = " ".join(f"{k}={_shown(v)}" for k, v in extra.items())
        return f"{first} {pairs}{sep}{rest}"


class JournaldFormatter(TextFormatter):
    """``<priority>bcd: logger: message``: journald reads the level from the prefix."""

    def format(self, record: logging.LogRecord) -> str:
        return prioritized(super().format(record), record.levelno)


def json_formatter(*, journald: bool = False) -> logging.Formatter:
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, then the
    event's fields (an exception's traceback in ``exc_info``); under journald with the
    ``<N>`` prefix."""
    from datetime import UTC, datetime

    from pythonjsonlogger.json import JsonFormatter

    class _Json(JsonFormatter):
        def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
            return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")

        def format(self, record: logging.LogRecord) -> str:
            line = super().format(record)
            return prioritized(line, record.levelno) if journald else line

    return _Json(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        json_ensure_ascii=True,
    )


def make_formatter(log_format: str, fmt: str, *, journald: bool) -> logging.Formatter:
    """The formatter of ``--log-format``: ``text`` (``fmt`` and the fields) or ``json``."""
    if log_format == "json":
        return json_formatter(journald=journald)
    return JournaldFormatter(fmt) if journald else TextFormatter(fmt)


def configure_logging(
    stream: TextIO, level: int, fmt: str = PLAIN_FORMAT, *, log_format: str = "text"
) -> None:
    """The root logger's handler on ``stream``, with priorities under journald.

    Like ``logging.basicConfig``, it does nothing when the root logger has a handler.
    """
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(stream)
    handler.setFormatter(make_formatter(log_format, fmt, journald=under_journald(stream)))
    root.addHandler(handler)
    root.setLevel(level)

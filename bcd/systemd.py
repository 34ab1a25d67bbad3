"""What bcd needs from systemd, without a dependency: readiness and journald logs.

``notify`` is sd_notify(3): one datagram to the ``NOTIFY_SOCKET`` the service manager
gives a ``Type=notify`` unit (a path, or an abstract name written ``@name``). Outside
such a unit (no ``NOTIFY_SOCKET``) it does nothing; a socket that cannot be reached is
ignored too, since readiness must never stop bcd.

``log_format`` is bcd's log line. Under journald (``JOURNAL_STREAM`` names the
device and inode of standard error, see systemd.exec(5)) each line starts with the
syslog priority ``<N>``, which journald turns into the entry's level and strips; the
journal stamps every entry itself, so no time is printed in either case.
"""

from __future__ import annotations

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


class JournaldFormatter(logging.Formatter):
    """``<priority>bcd: logger: message``: journald reads the level from the prefix."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        level = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return "\n".join(f"<{level}>{line}" for line in text.splitlines() or [""])


def configure_logging(stream: TextIO, level: int, fmt: str = PLAIN_FORMAT) -> None:
    """The root logger's handler on ``stream``, with priorities under journald.

    Like ``logging.basicConfig``, it does nothing when the root logger has a handler.
    """
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(stream)
    formatter = JournaldFormatter(fmt) if under_journald(stream) else logging.Formatter(fmt)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level)

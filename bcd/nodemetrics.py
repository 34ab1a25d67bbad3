"""``[metrics] textfile``: bcd node's few figures for node_exporter's textfile collector.

The node only dials out, so nothing scrapes it: when ``[metrics] textfile`` is set,
``bcd node`` writes these to that file, and node_exporter (``--collector.textfile.
directory``) serves them with its own (adding ``instance``, so no node id label)::

    bcd_certificate_expiry_timestamp_seconds   the node certificate's notAfter (unix s)
    bcd_identity_generation                    the certificate's identity generation
    bcd_last_renewal_timestamp_seconds         the last successful renewal (unix s):
                                               the journal's last one at start, absent
                                               before this node ever renewed
    bcd_session_up                             1 while a session is open (welcomed), else 0
    bcd_renewal_failures_total                 failed renewal attempts since bcd node started

The text is prometheus-client's (``generate_latest``) from a
:class:`~prometheus_client.CollectorRegistry` of its own (never the global one); it
goes to a new temporary file with a random name in the same directory (``….tmp``,
which node_exporter does not read), renamed over the textfile, so a reader sees the
old file or the new one whole; the temporary file is removed when a write fails.
The file is mode 0644 whatever the umask (:meth:`TextfileMetrics._write`). It
is written at start, after each renewal and each failed renewal, and when the session
opens or is lost. A write that fails (a missing directory, no permission, a full disk)
is logged once as a warning, and again only after a write succeeded in between; it
never stops the node.

prometheus_client is imported only here, and this module only when ``[metrics]
textfile`` is set (``bcd node``'s start-up time, ``bench/cli_start.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from datetime import datetime
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

from bcd.identity import AnyState

log = logging.getLogger("bcd.node")

TEXTFILE_MODE = 0o644


class TextfileMetrics:
    """The node's gauges and counter, and the textfile they are written to."""

    def __init__(self, path: Path) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
        self.path = path
        self._lock = threading.Lock()
        self._failing = False
        self.registry = CollectorRegistry(auto_describe=True)
        self._expiry = Gauge(
            "bcd_certificate_expiry_timestamp_seconds",
            "When the node certificate expires (its notAfter), in unix seconds.",
            registry=self.registry,
        )
        self._generation = Gauge(
            "bcd_identity_generation",
            "The identity generation of the node certificate.",
            registry=self.registry,
        )
        self._session_up = Gauge(
            "bcd_session_up",
            "1 while the node's session with the gateway is open, else 0.",
            registry=self.registry,
        )
        self._failures = Counter(
            "bcd_renewal_failures",
            "Failed renewal attempts since bcd node started.",
            registry=self.registry,
        )
        # registered once known: absent until the node renewed once
        self._last_renewal = Gauge(
            "bcd_last_renewal_timestamp_seconds",
            "When the node certificate was last renewed, in unix seconds.",
            registry=None,
        )
        self._last_renewal_registered = False
        self._up: bool | None = None

    # --- figures (cheap; write() publishes them) ----------------------------------

    def certificate(self, state: AnyState) -> None:
        self._expiry.set(state.leaf_info.not_after.timestamp())
        self._generation.set(state.identity.identity_generation)

    def renewed_at(self, when: datetime) -> None:
        with self._lock:
            if not self._last_renewal_registered:
                self.registry.register(self._last_renewal)
                self._last_renewal_registered = True
        self._last_renewal.set(when.timestamp())

    def renewal_failed(self) -> None:
        self._failures.inc()

    def session(self, up: bool) -> bool:
        """Set ``bcd_session_up``; return whether it changed."""
        changed = self._up is not up
        self._up = up
        self._session_up.set(1 if up else 0)
        return changed

    # --- the file -----------------------------------------------------------------

    def write(self) -> bool:
        """Write the textfile atomically (mode 0644); log a failure once; never raise.

        Blocking: call it in a worker thread from trio.
        """
        with self._lock:  # the last write holds the latest figures
            try:
                self._write()
            except (OSError, ValueError) as exc:
                if not self._failing:
                    log.warning(
                        "cannot write the metrics textfile %s: %s (bcd node goes on; "
                        "logged once until a write succeeds)",
                        self.path,
                        getattr(exc, "strerror", None) or exc,
                    )
                    self._failing = True
                return False
            if self._failing:
                log.info("the metrics textfile %s is written again", self.path)
                self._failing = False
            return True

    def _write(self) -> None:
        """prometheus-client's exposition text, written to a new temporary file and
        renamed into place.

        Not ``write_to_textfile``: it opens ``<path>.<pid>.<thread id>`` with a plain
        ``open(…, "wb")``, which follows a symlink another writer of the (shared)
        textfile directory could plant at that predictable name, and a chmod by path
        would follow one at ``path``. Here the temporary name is random, made with
        ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0644 set on the descriptor (so
        ``bcd.service``'s ``UMask=0077`` does not apply), and ``rename`` replaces
        whatever is at ``path`` without following it.
        """
        data = generate_latest(self.registry)
        tmp = f"{self.path}.{secrets.token_hex(8)}.tmp"  # node_exporter reads *.prom only
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, TEXTFILE_MODE)
        try:
            try:
                os.fchmod(fd, TEXTFILE_MODE)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

"""The operator CLI's client of the tenant API (synchronous, stdlib http.client)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from typing import Any

from control.errors import ControlError


def system_store_context() -> ssl.SSLContext:
    """The client of an https:// ``--api``: the system trust store, host names checked.

    Built by hand, as :func:`bcd.gatewayclient.system_store_context` is, so it is the
    same on every Python: ``http.client``'s default (``create_default_context``)
    writes the TLS secrets, and with them the operator's credential, to
    ``$SSLKEYLOGFILE``, and from 3.13 on sets ``VERIFY_X509_STRICT`` and
    ``VERIFY_X509_PARTIAL_CHAIN``. Not strict: the API's TLS is the operator's
    front (serve has no TLS on the API listener), under a CA the project does not
    issue.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host names checked
    ctx.load_default_certs()
    return ctx


class ApiClient:
    def __init__(self, base_url: str, credential: str | None, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ControlError("INVALID_ARGUMENT", "--api must be an http:// or https:// URL")
        self._parsed = parsed
        self._credential = credential
        self._timeout = timeout

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        p = self._parsed
        conn: http.client.HTTPConnection
        if p.scheme == "https":
            conn = http.client.HTTPSConnection(
                p.hostname or "", p.port, timeout=self._timeout, context=system_store_context()
            )
        else:
            conn = http.client.HTTPConnection(p.hostname or "", p.port, timeout=self._timeout)
        headers = {"content-type": "application/json", "accept": "application/json"}
        if self._credential:
            headers["authorization"] = f"Bearer {self._credential}"
        data = json.dumps(body).encode() if body is not None else None
        try:
            conn.request(method, p.path.rstrip("/") + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(4 << 20)
        except OSError as exc:
            raise ControlError(
                "UNAVAILABLE",
                f"cannot reach the control plane at {p.geturl()}: {exc.strerror or exc}",
            ) from exc
        finally:
            conn.close()
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if resp.status >= 400:
            if isinstance(obj, dict) and isinstance(obj.get("code"), str):
                raise ControlError(obj["code"], str(obj.get("message", "")))
            raise ControlError("UNAVAILABLE", f"the control plane answered HTTP {resp.status}")
        if not isinstance(obj, dict):
            raise ControlError("UNAVAILABLE", "the control plane's answer is not JSON")
        return obj

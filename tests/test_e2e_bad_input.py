"""Bad input at the real gateway and API: a clear 4xx, never a 500, nothing consumed."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from bcd import pki, wire
from tests.world import ControlPlane, post_join

pytestmark = pytest.mark.e2e


def _request(csr_der: bytes, sealed: str | None, **overrides: Any) -> bytes:
    claims = wire.Claims(
        product_uuid="4c4c4544-0042-3510-8052-b4c04f4d3732",
        product_serial="SN-1",
        macs=("00:1b:21:aa:bb:01",),
    )
    obj = wire.JoinRequest(
        role="node",
        attestor="",
        sealed_token=sealed,
        csr_der=csr_der,
        claims=claims,
        evidence={},
        node_id=None,
        daemon_version="test",
    ).to_json()
    obj.update(overrides)
    return json.dumps(obj).encode()


async def test_malformed_bodies_get_invalid_argument_and_consume_nothing(
    sqlite_control_plane: ControlPlane,
) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    made = cp.token(pool)
    csr = pki.make_csr(pki.generate_key())
    bodies = [
        b"not json",
        b"[1, 2]",
        b'{"protocol": 1}',
        _request(csr, None, role=7),
        _request(csr, None, csr="***"),
        _request(csr, None, claims={"macs": "nope"}),
        _request(csr, None, claims={"hostname": "x" * 1000}),
        _request(csr, None, protocol=2),
        b"{" * 100_000,
    ]
    for body in bodies:
        status, answer = await post_join(cp, body)
        assert status in (400, 413), body[:40]
        assert answer["code"] == "INVALID_ARGUMENT"
        assert "Traceback" not in answer["message"]
    assert cp.one("SELECT uses_left FROM join_tokens WHERE id = ?", (made["id"],)) == {
        "uses_left": 1
    }
    assert cp.one("SELECT COUNT(*) AS n FROM nodes") in ({"n": 0}, {"count": 0})


async def test_bad_seals_and_csrs_are_refused_uniformly(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    made = cp.token(pool)
    token = wire.parse_token(made["token"])
    enc = wire.public_key_of_jwk(cp.well_known()["join"]["encryptionJwk"])
    csr = pki.make_csr(pki.generate_key())
    other_csr = pki.make_csr(pki.generate_key())
    now = int(time.time())
    broken_csr = bytearray(csr)
    broken_csr[-5] ^= 0xFF
    cases = {
        "seal-invalid": _request(csr, "a.b.c.d.e"),
        "seal-csr": _request(csr, wire.seal_token(token, enc, other_csr, now)),
        "seal-stale": _request(csr, wire.seal_token(token, enc, csr, now - 900)),
        "token-malformed": _request(csr, None),
        "csr-invalid": _request(
            bytes(broken_csr),
            wire.seal_token(token, enc, bytes(broken_csr), now),
        ),
    }
    for reason, body in cases.items():
        status, answer = await post_join(cp, body)
        assert (status, answer) == (403, {"code": "ACCESS_DENIED", "message": "Join refused"}), (
            reason
        )
    reasons = [e["reason"] for e in cp.events(type_="security.join.refused")]
    assert reasons == [f"join-token:{r}" for r in cases]
    assert cp.one("SELECT uses_left FROM join_tokens WHERE id = ?", (made["id"],)) == {
        "uses_left": 1
    }


def test_the_api_answers_bad_requests_with_codes(sqlite_control_plane: ControlPlane) -> None:
    import http.client
    import urllib.parse

    cp = sqlite_control_plane
    _site, pool = cp.site_and_pool()
    cred = cp.root_credential_file.read_text().strip()
    url = urllib.parse.urlsplit(cp.api)
    cases = [
        (
            "POST",
            f"/api/compute/v1/tenants/{cp.root_tenant}/pools/{pool}/join-tokens",
            b"{",
            cred,
            400,
        ),
        (
            "POST",
            f"/api/compute/v1/tenants/{cp.root_tenant}/pools/{pool}/join-tokens",
            b'{"ttlSeconds": "1h"}',
            cred,
            400,
        ),
        (
            "POST",
            f"/api/compute/v1/tenants/{cp.root_tenant}/pools/{pool}/join-tokens",
            b'{"ttlSeconds": 3600}',
            "bcak_x.y",
            401,
        ),
        ("GET", f"/api/compute/v1/tenants/{cp.root_tenant}/nope", b"", cred, 404),
        (
            "POST",
            f"/api/compute/v1/tenants/{cp.root_tenant}/pools/{pool}/join-tokens",
            b'{"ttlSeconds": 3600, "expect": {"mac": "02:00:00:00:00:01"}}',
            cred,
            400,
        ),
    ]
    for method, path, body, bearer, status in cases:
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
        conn.request(method, path, body=body, headers={"authorization": f"Bearer {bearer}"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        conn.close()
        assert resp.status == status, (path, body, answer)
        assert set(answer) == {"code", "message"}

"""An expired node certificate completes the TLS handshake and is answered 401
UNAUTHENTICATED by the gateway, at session open and at renewal (never a broken handshake)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from bcd.identity import LoadedState, load_state
from tests.gatewaycalls import node_post
from tests.world import ControlPlane, Node

pytestmark = pytest.mark.e2e


async def test_an_expired_certificate_is_answered_unauthenticated(
    tmp_path: Path, pki_template: Path
) -> None:
    home = tmp_path / "cp"
    home.mkdir()
    cp = ControlPlane.start(
        home,
        pki_template,
        f"sqlite:///{tmp_path / 's.db'}",
        extra_args=["--cert-ttl-seconds", "10"],
    )
    try:
        site, pool = cp.site_and_pool()
        node = Node.make(tmp_path / "n", cp, site, seed=41)
        done = node.join(cp.token(pool)["token"])
        assert done.returncode == 0, done.stderr
        state = load_state(node.data_dir)
        assert isinstance(state, LoadedState)
        pin = cp.pins()["serving_ca_spki_pin"]
        not_after = datetime.fromisoformat(state.identity.not_after.replace("Z", "+00:00"))
        wait = not_after.timestamp() - time.time() + 1.5
        time.sleep(max(0.0, wait))  # noqa: ASYNC251 - the certificate must expire
        for path in ("/v1/session", "/v1/renew"):
            answer = await node_post(cp.gateway_port, pin, state, path, b"{}")
            assert answer.status == 401, (path, answer.body)
            assert json.loads(answer.body)["code"] == "UNAUTHENTICATED"
    finally:
        cp.stop()

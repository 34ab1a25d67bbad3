"""The tenant API's events list against bad paging input, on both stores (real serve)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.world import ControlPlane

pytestmark = pytest.mark.e2e


def _get(cp: ControlPlane, query: str) -> tuple[int, dict[str, object]]:
    cred = cp.root_credential_file.read_text().strip()
    req = urllib.request.Request(  # noqa: S310 - http on loopback
        f"{cp.api}/api/compute/v1/tenants/{cp.root_tenant}/events?{query}",
        headers={"Authorization": f"Bearer {cred}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    "query",
    ["limit=-1", "limit=0", "limit=1001", "limit=%EF%BC%91", "since=-5",
     "since=99999999999999999999999", "since=1e9", "type=%0Aevil", "limit=" + "9" * 4000],
)  # fmt: skip
def test_bad_paging_is_invalid_argument_on_both_stores(
    control_plane: ControlPlane, query: str
) -> None:
    status, body = _get(control_plane, query)
    assert status == 400, body
    assert body["code"] == "INVALID_ARGUMENT"


def test_good_paging_answers(control_plane: ControlPlane) -> None:
    status, body = _get(control_plane, "limit=1000&since=0")
    assert status == 200
    assert isinstance(body["items"], list)
    assert all(item["createdAtMs"] >= 0 for item in body["items"])


@pytest.mark.parametrize(
    "body",
    [
        b'{"name": "\\ud800"}',
        b'{"name": "ok", "extra": ["\\udfff"]}',
        b'{"\\ud800": "x"}',
    ],
)
def test_a_lone_surrogate_is_invalid_argument_not_a_503(
    control_plane: ControlPlane, body: bytes
) -> None:
    """Found by make fuzz: JSON's \\ud800 escapes made strings no store could bind."""
    cred = control_plane.root_credential_file.read_text().strip()
    req = urllib.request.Request(  # noqa: S310 - http on loopback
        f"{control_plane.api}/api/compute/v1/tenants/{control_plane.root_tenant}/sites",
        data=body,
        headers={"Authorization": f"Bearer {cred}", "content-type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(req, timeout=10)  # noqa: S310
    assert failed.value.code == 400
    assert json.loads(failed.value.read())["code"] == "INVALID_ARGUMENT"
    assert "Traceback" not in (control_plane.home / "serve.log").read_text()

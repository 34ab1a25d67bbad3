"""End to end, a TPM enrollment: `better-compute serve` with `tpm.enrollment=true` and
no EK trust, `bcd join --attestor tpm` waiting on its join request, the request
approved with `better-compute join-requests approve`, and the join completing."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.world import JOINED, E2EWorld, SwTpm, other_ca_bundle, tpm_node

pytestmark = pytest.mark.e2e


def test_a_tpm_enrollment_waits_for_approval_then_joins(
    tmp_path: Path, e2e: E2EWorld, swtpm: SwTpm
) -> None:
    # an EK CA bundle that signed no EK: the EK is on no allow-list and does not chain
    bundle = other_ca_bundle(tmp_path / "other-ca.pem")
    cp, site, pool = e2e.tpm_plane(bundle, ["--attestor-setting", "tpm.enrollment=true"])
    agent: subprocess.Popen[str] | None = None
    try:
        tenant = cp.root_tenant
        node = tpm_node(tmp_path / "node", cp, site, swtpm)
        agent = node.spawn_join("--attestor", "tpm")
        deadline = time.monotonic() + 30
        row = None
        while row is None:
            assert agent.poll() is None, agent.communicate()
            assert time.monotonic() < deadline, "no join request was recorded"
            row = cp.one("SELECT id, state, csr_sha256 FROM join_requests")
            time.sleep(0.1)
        assert row["state"] == "pending"
        request_id = row["id"]
        assert cp.one("SELECT COUNT(*) AS n FROM nodes") == {"n": 0}

        listed = cp.cli("join-requests", "list", "--tenant", tenant, "--pool", pool, "--json")
        assert listed.returncode == 0, listed.stderr
        (item,) = json.loads(listed.stdout)["items"]
        assert (item["id"], item["attestor"], item["state"]) == (request_id, "tpm", "pending")
        assert item["csrSha256"] == row["csr_sha256"]
        text = cp.cli("join-requests", "list", "--tenant", tenant, "--pool", pool)
        assert request_id in text.stdout
        assert f"csrSha256: {row['csr_sha256']}" in text.stdout

        too_short = cp.cli(
            "join-requests", "approve", request_id, "--tenant", tenant, "--pool", pool,
            "--ttl", "59",
        )  # fmt: skip
        assert too_short.returncode == 2
        approved = cp.cli(
            "join-requests", "approve", request_id, "--tenant", tenant, "--pool", pool,
            "--ttl", "900", "--reason", "rack B7 intake, ticket 4411",
        )  # fmt: skip
        assert approved.returncode == 0, approved.stderr
        assert approved.stdout.startswith(f"approved {request_id} until ")

        out, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err
        assert f"waiting for approval of join request {request_id}" in out
        last = out.strip().splitlines()[-1]
        m = JOINED.match(last)
        assert m, out
        node_id = m.group(1)
        assert re.search(r"asking again in [1-9]\d* s", out)

        done = cp.one("SELECT state, consumed_at FROM join_requests WHERE id = ?", (request_id,))
        assert done is not None
        assert done["state"] == "approved"
        assert done["consumed_at"] is not None
        (joined,) = cp.events(type_="node.joined")
        assert (joined["nodeId"], joined["attestor"], joined["joinRequestId"]) == (
            node_id,
            "tpm",
            request_id,
        )
        (decision,) = cp.events(type_="security.join-request.approved")
        assert decision["requestId"] == request_id
        assert decision["reason"] == "rack B7 intake, ticket 4411"
        assert cp.one("SELECT COUNT(*) AS n FROM join_challenges WHERE used_at IS NOT NULL") == {
            "n": 1
        }
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()

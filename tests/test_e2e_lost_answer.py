"""End to end, a join whose answer is lost: a relay between `bcd join` and the real
gateway drops the connection just as the answer comes back (the join committed). bcd
retries with the same CSR and the control plane answers the same identity again,
spending nothing more: one node, one certificate, one use of the token."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from pathlib import Path

import pytest

from tests.world import JOINED, ControlPlane, Node

pytestmark = pytest.mark.e2e
REQUEST_BYTES = 1500
"""More than a TLS client ever sends before its request (ClientHello, Finished) and
less than a join request (a sealed token, a CSR and the claims)."""


class DroppingRelay:
    """A TCP relay to ``port`` that drops its first connection once the answer starts."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.dropped = 0
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            drop = self.dropped == 0
            server = socket.create_connection(("127.0.0.1", self.upstream))
            sent = [0]
            threading.Thread(target=self._up, args=(client, server, sent), daemon=True).start()
            threading.Thread(
                target=self._down, args=(server, client, sent, drop), daemon=True
            ).start()

    def _up(self, client: socket.socket, server: socket.socket, sent: list[int]) -> None:
        try:
            while data := client.recv(65536):
                sent[0] += len(data)
                server.sendall(data)
        except OSError:
            pass

    def _down(
        self, server: socket.socket, client: socket.socket, sent: list[int], drop: bool
    ) -> None:
        try:
            while data := server.recv(65536):
                if drop and sent[0] > REQUEST_BYTES:
                    self.dropped += 1
                    break  # the answer: never delivered
                client.sendall(data)
        except OSError:
            pass
        for s in (client, server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_lost_join_answer_is_answered_again_without_spending_more(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    site, pool = cp.site_and_pool()
    token = cp.token(pool, maxUses=1)
    relay = DroppingRelay(cp.gateway_port)
    try:
        node = Node.make(tmp_path / "m", cp, site, seed=3)
        text = node.config.read_text().replace(
            f"127.0.0.1:{cp.gateway_port}", f"127.0.0.1:{relay.port}"
        )
        node.config.write_text(text)

        done = node.join(token["token"])

        assert done.returncode == 0, done.stderr
        assert relay.dropped == 1
        assert relay.connections >= 2
        assert "join attempt 1 failed" in done.stderr
        m = JOINED.match(done.stdout.strip())
        assert m, done.stdout
        node_id = m.group(1)
        ident = json.loads((node.data_dir / "identity.json").read_text())
        assert ident["node_id"] == node_id
        assert cp.one("SELECT COUNT(*) AS n FROM nodes") == {"n": 1}
        assert cp.one("SELECT COUNT(*) AS n FROM node_certs") == {"n": 1}
        assert cp.one("SELECT uses_left FROM join_tokens WHERE id = ?", (token["id"],)) == {
            "uses_left": 0
        }
        assert [e["nodeId"] for e in cp.events(type_="node.joined")] == [node_id]
        assert node.bcd("doctor").returncode == 0
    finally:
        relay.close()

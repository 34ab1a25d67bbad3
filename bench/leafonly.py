"""What the CAs after a node's leaf cost the gateway in a mutual-TLS handshake.

Run from the repository root::

    .venv/bin/python bench/leafonly.py [--handshakes 2000] [--kept 3000]

It prints figures and judges nothing; it is not part of the test suite.

A node's chain holds its leaf, the node CA and the node root CA (JoinService's
answer). The gateway holds both CAs as its trust anchors, so the node presents its
leaf alone (:func:`bcd.tls.presented_leaf`). Here OpenSSL's handshakes run in
process over memory BIOs, with the gateway's own server context
(``control.pkitls.server_ssl_context``, the node CA and root as client CAs) and a
node's pinned client context (``bcd.tls.pinned_context``) built with the three
certificates loaded and with the leaf alone; each side's CPU is timed apart
(``time.process_time``). Memory: a child process per way keeps ``--kept`` server
connections after their handshakes and reports its RSS growth per connection (what
OpenSSL and the ``SSLObject`` hold; the client ends are dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import ssl
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from bcd import pki
from bcd.tls import anchor_of, pinned_context
from control.pki import build_pki
from control.pkicerts import Pki, issue_node_leaf, make_gateway_cert
from control.pkitls import server_ssl_context

NAME = "gw.bench"


def _contexts(leaf_only: bool) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The gateway's server context and a node's client context: ``pinned_context``
    given the node's chain (it loads the leaf alone), or with the three certificates
    loaded, as it loaded them before."""
    now = datetime.now(UTC)
    ca: Pki = build_pki("bench.test", now)
    gw_key = pki.generate_key()
    gw_cert = make_gateway_cert(ca, gw_key.public_key(), NAME, now)
    server = server_ssl_context(
        pki.cert_pem(gw_cert) + pki.cert_pem(ca.serving_ca),
        gw_key,
        client_ca_pem=ca.chain_tail_pem(),
        client_time_in_app=True,
    )
    node_key = pki.generate_key()
    spiffe = pki.SpiffeId("bench.test", "site_" + "a" * 26, "node_" + "b" * 26)
    leaf = issue_node_leaf(ca, node_key.public_key(), spiffe, "node", (), now, 3600)
    key_pem = node_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    anchor = anchor_of(pki.cert_pem(ca.serving_ca), ca.pins()["serving_ca_spki_pin"])
    if leaf_only:
        return server, pinned_context(anchor, (pki.cert_pem(leaf) + ca.chain_tail_pem(), key_pem))
    client = pinned_context(anchor)  # then the three certificates, as it loaded them before
    with tempfile.TemporaryDirectory() as tmp:
        chain_path, key_path = Path(tmp, "chain.pem"), Path(tmp, "key.pem")
        chain_path.write_text(pki.cert_pem(leaf) + ca.chain_tail_pem())
        key_path.write_bytes(key_pem)
        client.load_cert_chain(chain_path, key_path)
    return server, client


def _handshake(
    server: ssl.SSLContext, client: ssl.SSLContext
) -> tuple[float, float, ssl.SSLObject]:
    """One handshake over memory BIOs: (client CPU s, server CPU s, the server end)."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    node = client.wrap_bio(c_in, c_out, server_hostname=NAME)
    gateway = server.wrap_bio(s_in, s_out, server_side=True)
    spent = [0.0, 0.0]
    done = [False, False]
    for _ in range(20):
        for side, (end, out, peer_in) in enumerate(((node, c_out, s_in), (gateway, s_out, c_in))):
            start = time.process_time()
            if not done[side]:
                try:
                    end.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
            data = out.read()
            spent[side] += time.process_time() - start
            if data:
                peer_in.write(data)
        if all(done):
            break
    start = time.process_time()
    with contextlib.suppress(ssl.SSLWantReadError):
        gateway.read(1)  # nothing is left to read: the server's handshake took it all
    spent[1] += time.process_time() - start
    if gateway.getpeercert(binary_form=True) is None:
        raise RuntimeError("the gateway saw no client certificate")
    return spent[0], spent[1], gateway


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _memory_child(leaf_only: bool, kept: int) -> None:
    server, client = _contexts(leaf_only)
    for _ in range(200):
        _handshake(server, client)
    gc.collect()
    held: list[ssl.SSLObject] = []
    before = _rss_kb()
    for _ in range(kept):
        held.append(_handshake(server, client)[2])
    gc.collect()
    print(json.dumps({"kb_per_connection": (_rss_kb() - before) * 1024 / 1000 / kept}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handshakes", type=int, default=2000)
    parser.add_argument("--kept", type=int, default=3000)
    parser.add_argument("--memory-child", choices=("chain", "leaf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        _memory_child(args.memory_child == "leaf", args.kept)
        return
    print(f"{ssl.OPENSSL_VERSION}; {args.handshakes} handshakes a way, TLS 1.3, the ways")
    print("interleaved in blocks of 100 so that the machine's drift falls on both alike")
    ways = {"leaf, node CA, root": _contexts(False), "its leaf alone": _contexts(True)}
    spent = {way: [0.0, 0.0] for way in ways}
    for server, client in ways.values():
        for _ in range(50):
            _handshake(server, client)
    for _ in range(max(1, args.handshakes // 100)):
        for way, (server, client) in ways.items():
            for _ in range(100):
                node_s, gateway_s, _ = _handshake(server, client)
                spent[way][0] += node_s
                spent[way][1] += gateway_s
    done = max(1, args.handshakes // 100) * 100
    print(f"{'the node presents':<24}{'node CPU':>12}{'gateway CPU':>14}{'gateway memory':>18}")
    for way, (node_s, gateway_s) in spent.items():
        child = subprocess.run(
            [sys.executable, __file__, "--memory-child", "leaf" if "alone" in way else "chain",
             "--kept", str(args.kept)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        kb = json.loads(child.stdout)["kb_per_connection"]
        print(
            f"{way:<24}{node_s / done * 1e3:>9.3f} ms"
            f"{gateway_s / done * 1e3:>11.3f} ms{kb:>13.1f} KB/conn"
        )


if __name__ == "__main__":
    main()

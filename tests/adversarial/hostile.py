"""A hostile gateway on loopback, and `bcd` children watched for their memory.

The gateway presents a real serving certificate from the test PKI (so bcd's pin
check passes and every byte after it is the attacker's) and follows a script per
connection: stall after the TCP accept, stall mid-handshake, or complete TLS, read
the request and answer with a responder (endless bodies, huge heads, stalls, bad
pushback values, malformed session lines). Children run with their stderr in a
file; their peak RSS comes from ``wait4`` (the child's own rusage) and, while they
run, from ``/proc/<pid>/status`` (``VmHWM``); one that grows past
:data:`RSS_LIMIT` is killed at once, so a regression cannot take the machine down.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import pki, wire
from control.pki import Pki, make_gateway_cert, server_ssl_context
from tests.e2e import BIN, cli_env, write_node_config
from tests.fakesys import random_machine

RSS_LIMIT = 200 * 1024 * 1024
SENT_CAP = 512 * 1024 * 1024
"""The most an "endless" answer sends: far past any bound bcd has, so a missing
bound shows as memory, yet finite."""
TOKEN = "bcjt_jt_" + "0" * 26 + "." + "A" * 43
LINE = b"x" * 1023 + b"\n"


# --- the gateway ----------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes


Tls = trio.SSLStream[trio.SocketStream]
Responder = Callable[[Tls, Request], Awaitable[None]]
Script = Callable[["HostileGateway", trio.SocketStream], Awaitable[None]]


def gateway_context(memory_pki: Pki) -> ssl.SSLContext:
    """A server context with a real serving certificate for 127.0.0.1."""
    key = pki.generate_key()
    cert = make_gateway_cert(memory_pki, key.public_key(), "127.0.0.1", datetime.now(UTC))
    return server_ssl_context(pki.cert_pem(cert) + pki.cert_pem(memory_pki.serving_ca), key)


@dataclass
class HostileGateway:
    ctx: ssl.SSLContext
    scripts: Sequence[Script]
    """Connection ``i`` follows ``scripts[min(i, len - 1)]``."""
    port: int = 0
    connections: int = 0
    requests: list[Request] = field(default_factory=list)

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.port)

    async def _handle(self, tcp: trio.SocketStream) -> None:
        script = self.scripts[min(self.connections, len(self.scripts) - 1)]
        self.connections += 1
        # the peer going away, or a TLS alert, ends a script; nothing else may
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            try:
                await script(self, tcp)
            finally:
                await trio.aclose_forcefully(tcp)


async def read_request(stream: trio.abc.ReceiveStream) -> Request:
    """One HTTP/1.1 request with a Content-Length body (what bcd sends)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data or len(buf) > 65536:
            raise trio.BrokenResourceError("no request")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError("short body")
        rest += data
    return Request(method, path, rest[:length])


def stall_after_accept() -> Script:
    async def script(gw: HostileGateway, tcp: trio.SocketStream) -> None:
        await trio.sleep_forever()

    return script


def stall_mid_handshake() -> Script:
    """Read the ClientHello, then never answer it."""

    async def script(gw: HostileGateway, tcp: trio.SocketStream) -> None:
        await tcp.receive_some(65536)
        await trio.sleep_forever()

    return script


def tls(responder: Responder | Mapping[str, Responder]) -> Script:
    """Complete TLS, read the request, answer with ``responder`` (or by path)."""

    async def script(gw: HostileGateway, tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, gw.ctx, server_side=True, https_compatible=True)
        await stream.do_handshake()
        req = await read_request(stream)
        gw.requests.append(req)
        chosen = responder if callable(responder) else responder[req.path]
        try:
            await chosen(stream, req)
        finally:
            await trio.aclose_forcefully(stream)

    return script


# --- responders ---------------------------------------------------------------------


def _head(status: int, headers: Sequence[tuple[str, bytes | str]]) -> bytes:
    out = f"HTTP/1.1 {status} X\r\n".encode("ascii")
    for name, value in headers:
        raw = value if isinstance(value, bytes) else value.encode("latin-1")
        out += name.encode("ascii") + b": " + raw + b"\r\n"
    return out + b"\r\n"


def answer(status: int, body: bytes, headers: Sequence[tuple[str, bytes | str]] = ()) -> Responder:
    async def respond(stream: Tls, req: Request) -> None:
        head = [("content-length", str(len(body))), ("connection", "close"), *headers]
        await stream.send_all(_head(status, head) + body)

    return respond


def error(code: str, message: str, headers: Sequence[tuple[str, bytes | str]] = ()) -> Responder:
    body = json.dumps({"code": code, "message": message}).encode()
    return answer(wire.STATUS[code], body, [("content-type", "application/json"), *headers])


REFUSED = error("ACCESS_DENIED", "Join refused")


def pushback(value: bytes) -> Responder:
    return error("UNAVAILABLE", "later", [("retry-pushback-ms", value)])


def endless_chunked(status: int, piece: bytes = LINE) -> Responder:
    """A chunked body that never ends (until :data:`SENT_CAP`)."""
    chunk_data = piece * (65536 // len(piece))
    chunk = f"{len(chunk_data):x}\r\n".encode() + chunk_data + b"\r\n"

    async def respond(stream: Tls, req: Request) -> None:
        await stream.send_all(_head(status, [("transfer-encoding", "chunked")]))
        sent = 0
        while sent < SENT_CAP:
            await stream.send_all(chunk)
            sent += len(chunk)
        await trio.sleep_forever()

    return respond


def endless_content_length(status: int) -> Responder:
    """A Content-Length of 2^40 bytes, sent for as long as the peer reads."""
    chunk = LINE * 64

    async def respond(stream: Tls, req: Request) -> None:
        await stream.send_all(_head(status, [("content-length", str(1 << 40))]))
        sent = 0
        while sent < SENT_CAP:
            await stream.send_all(chunk)
            sent += len(chunk)
        await trio.sleep_forever()

    return respond


def huge_head() -> Responder:
    """A status line, then header lines forever."""
    chunk = b"x-junk: " + b"a" * 1000 + b"\r\n"

    async def respond(stream: Tls, req: Request) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\n")
        sent = 0
        while sent < SENT_CAP:
            await stream.send_all(chunk * 64)
            sent += len(chunk) * 64
        await trio.sleep_forever()

    return respond


def huge_chunk_header() -> Responder:
    """A chunked body whose first chunk-size line never ends."""

    async def respond(stream: Tls, req: Request) -> None:
        await stream.send_all(_head(200, [("transfer-encoding", "chunked")]) + b"1")
        sent = 0
        while sent < SENT_CAP:
            await stream.send_all(b"0" * 65536)
            sent += 65536
        await trio.sleep_forever()

    return respond


def stall_after_head(status: int = 200) -> Responder:
    async def respond(stream: Tls, req: Request) -> None:
        await stream.send_all(_head(status, [("content-length", "100")]))
        await trio.sleep_forever()

    return respond


def stall_mid_body(status: int = 200, *, chunked: bool = False) -> Responder:
    async def respond(stream: Tls, req: Request) -> None:
        if chunked:
            head = _head(status, [("transfer-encoding", "chunked")])
            await stream.send_all(head + b"20\r\n" + b'{"code": "UNAVAILABLE", "mess')
        else:
            await stream.send_all(_head(status, [("content-length", "100")]) + b'{"code"')
        await trio.sleep_forever()

    return respond


def stream_lines(status: int, lines: Sequence[bytes], *, then_stall: bool = True) -> Responder:
    """A chunked session body of ``lines`` (each sent as is), then silence or the end."""

    async def respond(stream: Tls, req: Request) -> None:
        await stream.send_all(_head(status, [("transfer-encoding", "chunked")]))
        for line in lines:
            await stream.send_all(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        if then_stall:
            await trio.sleep_forever()
        await stream.send_all(b"0\r\n\r\n")

    return respond


# --- a node's files ----------------------------------------------------------------


def write_config(root: Path, memory_pki: Pki, port: int, *, serving_ca: bool = True) -> Path:
    """config.toml, join-encryption.jwk and (unless not ``serving_ca``) serving-ca.pem,
    as install-bcd.sh writes them, for a node whose gateway is ``port``."""
    etc = root / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    config = write_node_config(
        etc / "config.toml",
        gateway_url=f"https://127.0.0.1:{port}",
        site=f"site_{'a' * 26}",
        pins=memory_pki.pins(),
        data_dir=root / "data",
    )
    jwk = memory_pki.well_known_join()["encryptionJwk"]
    (etc / "join-encryption.jwk").write_text(json.dumps(jwk))
    if serving_ca:
        (etc / "serving-ca.pem").write_text(pki.cert_pem(memory_pki.serving_ca))
    return config


# --- children --------------------------------------------------------------------


@dataclass
class Child:
    """A `bcd` child process: its stderr file, exit code and peak RSS (bytes)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    returncode: int | None = None
    peak_rss: int = 0
    killed_for_memory: bool = False

    @classmethod
    def spawn(cls, args: Sequence[str], root: Path, stdin: bytes | None = None) -> Child:
        log_path = root / f"{args[0]}-{time.monotonic_ns()}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(BIN / "bcd"), *args],
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=cli_env(root, secret=False),
            )
        if stdin is not None:
            assert proc.stdin is not None
            proc.stdin.write(stdin)
            proc.stdin.close()
        return cls(proc, log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _hwm(self) -> int:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return 0
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def _signal(self, signum: int) -> None:
        # os.kill, not Popen's methods: those reap the child, and its rusage with it
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)

    def _reaped(self, flags: int) -> bool:
        if self.returncode is not None:
            return True
        pid, status, usage = os.wait4(self.proc.pid, flags)
        if pid == 0:
            return False
        self.returncode = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.returncode
        self.peak_rss = max(self.peak_rss, usage.ru_maxrss * 1024)
        return True

    async def _poll(self) -> bool:
        """Watch memory once; return whether the child has exited."""
        self.peak_rss = max(self.peak_rss, self._hwm())
        if self.peak_rss > RSS_LIMIT and self.returncode is None:
            self.killed_for_memory = True
            self._signal(signal.SIGKILL)
        return self._reaped(os.WNOHANG)

    async def wait(self, timeout: float) -> int:  # noqa: ASYNC109 - a plain deadline
        with trio.fail_after(timeout):
            while True:
                if await self._poll():
                    break
                await trio.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    async def wait_for_log(self, *needles: str, timeout: float) -> str:  # noqa: ASYNC109
        """Wait until every needle is in the log (or the child exits, or memory runs over)."""
        deadline = trio.current_time() + timeout
        while True:
            text = self.log()
            if all(n in text for n in needles):
                return text
            if await self._poll() or self.killed_for_memory:
                return self.log()
            if trio.current_time() > deadline:
                return text
            await trio.sleep(0.05)

    async def stop(self, timeout: float = 15) -> int:  # noqa: ASYNC109
        """SIGTERM, then wait (SIGKILL if it does not go)."""
        self._signal(signal.SIGTERM)
        try:
            return await self.wait(timeout)
        except trio.TooSlowError:
            self._signal(signal.SIGKILL)
            return await self.wait(5)


def spawn_join(root: Path, config: Path, seed: int = 1) -> Child:
    sysfs = random_machine(root / "sys", seed)
    args = ["join", "--sysfs-root", str(sysfs), "--config", str(config)]
    return Child.spawn(args, root, stdin=(TOKEN + "\n").encode())


def one_line_error(text: str) -> str:
    """The last line of a child's output, which bcd makes its one-line message."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def assert_clean(child: Child, text: str) -> None:
    """No traceback, no internal error, no exit 70, memory bounded."""
    assert not child.killed_for_memory, f"peak RSS {child.peak_rss >> 20} MiB: {text[-2000:]}"
    assert child.peak_rss < RSS_LIMIT, child.peak_rss
    assert "Traceback" not in text, text[-4000:]
    assert "internal error" not in text, text[-4000:]
    assert child.returncode != 70, text[-4000:]


def revocation_stream(
    memory_pki: Pki, data_dir: Path, *, signing_key: ec.EllipticCurvePrivateKey | None = None
) -> Responder:
    """A session that sends a welcome, then a revocation of the node's own certificate
    (read from ``data_dir`` when the session arrives) with a notice signed by
    ``signing_key`` (default: the PKI's join-signing key, so it verifies)."""

    async def respond(stream: Tls, req: Request) -> None:
        ident = json.loads((data_dir / "identity.json").read_text())
        serial = format(
            x509.load_pem_x509_certificates(ident["chain"].encode())[0].serial_number, "x"
        )
        body = wire.revocation_notice_body(ident["node_id"], serial, "key compromised", 0)
        notice = wire.sign_response(body, signing_key or memory_pki.join_signing_key)
        lines = [
            b'{"type": "welcome", "session_id": "s1"}\n',
            json.dumps({"type": "revocation", "reason": "key compromised", "serial": serial,
                        "notice": notice}).encode() + b"\n",
        ]  # fmt: skip
        await stream_lines(200, lines)(stream, req)

    return respond
